"""Tests of the study over training (mha.pruning.study.over_training) and
of each method's cost (mha.pruning.study.analysis.method_costs): pure
functions on planted statistics."""

import numpy as np
import pytest

from mha.pruning.study import analysis
from mha.pruning.study import over_training
from mha.pruning.study.options import StudyOptions


def _statistics(gap, prunable, replicates=4):
  """Planted ``[1 + R]`` statistics of the oracle, the best ordering and
  one ordering (gradient), variant ``all``."""
  row = lambda v: np.full(1 + replicates, float(v))
  out = {}
  for name, auc in (("oracle", 0.8), ("best_ordering", 0.8 + gap / 2),
                    ("gradient", 0.8 + gap)):
    out[("all", name, "auc_token_accuracy")] = row(auc)
    out[("all", name, "auc_token_accuracy_minus_oracle")] = row(auc - 0.8)
    out[("all", name, "prunable_heads_token_accuracy")] = row(prunable)
  out[("all", "oracle", "test_token_accuracy_at_prunable")] = row(0.9)
  return out


def test_over_training_averages_the_steps_every_seed_holds():
  per_seed = [{10: _statistics(-0.1, 3), 20: _statistics(-0.02, 5)},
              {10: _statistics(-0.3, 1), 20: _statistics(-0.04, 5),
               30: _statistics(0.0, 6)}]
  entries = over_training.aggregate(per_seed, np.zeros((4, 2)))
  assert [e["step"] for e in entries] == [10, 20]  # 30: one seed only
  first = entries[0]
  assert first["oracle"]["prunable_heads_token_accuracy"] == 2.0
  gradient = first["orderings"]["gradient"]
  assert gradient["auc_token_accuracy_minus_oracle"] == pytest.approx(-0.2)
  assert gradient["auc_token_accuracy_minus_oracle_per_seed"] == (
      pytest.approx([-0.1, -0.3]))
  assert "oracle" not in first["orderings"]  # a reference, not an ordering
  assert set(first["orderings"]) == {"best_ordering", "gradient"}


def test_checkpoints_along_training_run_without_searches():
  options = over_training.checkpoint_options(StudyOptions())
  assert not (options.searches or options.kwon or options.gates
              or options.retrain or options.mean_ablation
              or options.bootstrap_importance)
  assert StudyOptions().over_training  # on by default


def test_each_method_costs_what_it_evaluates():
  n = 4
  timings = {"oracle_s": 2.0, "best_ordering_s": 0.01, "gradient_s": 1.0,
             "attribution_s": 3.0, "surrogate_s": 0.5, "fisher_s": 0.2,
             "kwon_s": 0.1, "gates_k_s": 4.0}
  names = ["oracle", "best_ordering", "gradient", "attribution_zero",
           "attribution_mean", "attribution_resample", "surrogate", "kwon",
           "random", "gates_k", "shapley"]
  cost = analysis.method_costs(
      names, n, timings, {"surrogate": 34}, StudyOptions(shapley_pairs=3),
      "sampled", {"steps": 5, "targets": [1, 2, 3]})
  assert cost["oracle"] == {"subset_evaluations": 16, "forward_passes": 16,
                            "backward_passes": 0, "seconds": 2.0}
  assert cost["best_ordering"]["seconds"] == pytest.approx(2.01)
  assert cost["gradient"]["backward_passes"] == 1
  assert cost["attribution_mean"]["seconds"] == pytest.approx(1.0)
  assert cost["surrogate"]["subset_evaluations"] == 34
  assert cost["kwon"]["seconds"] == pytest.approx(0.3)
  assert cost["random"]["seconds"] == 0.0
  assert cost["gates_k"]["forward_passes"] == 15
  assert cost["gates_k"]["unit"] == "training batches"
  # Sampled Shapley: 2 permutations a pair, N + 1 subsets each.
  assert cost["shapley"]["subset_evaluations"] == 2 * 3 * (n + 1)
  assert set(cost) == set(names)
