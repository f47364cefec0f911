"""The head-importance and head-pruning experiment, end to end.

``scripts/prune_heads.py`` is a thin command line over :func:`run`:

1. Load the trained checkpoint of ``workdir`` and, for ``num_seeds > 1``,
   train the same config with other seeds (``out/seeds/seed_<s>/``). A seed
   already trained there is reused when its recorded config matches the
   workdir's (seed and ``config_validation.RESUMABLE_KEYS`` but
   ``num_train_steps`` aside); otherwise the run is refused, or the seed
   retrained with ``retrain_seeds``. Every seed is analysed at the step of
   the workdir's checkpoint.
2. Per seed, on the *validation* split: gradient importance (Michel et al.,
   per-example ``|dL/d xi|``, raw, L2-normalised per layer, and re-estimated
   after each removal), leave-one-out loss increase (every mask in one
   vmapped call), attention confidence and entropy (Voita et al.); the
   Spearman correlations between them and between two disjoint halves.
   With at most ``oracle_max_heads`` heads, every subset of heads on
   validation (:mod:`mha.pruning.oracle`): the oracle (the best subset for
   each number of heads removed) and exact Shapley values.
3. Per seed, pruning curves for every order (each measure,
   ``num_random_orders`` random orders, the reverse of the gradient order)
   and the oracle, on validation and test, plain and never emptying a
   layer; the level prunable within ``tolerance`` is chosen on validation
   and its test accuracy reported; Michel et al.'s single-head ablation
   (paired t-tests, Benjamini-Hochberg) and all-but-one tables.
4. Intervals: a paired bootstrap over examples (and seeds), see
   :mod:`mha.pruning.summary`.
5. On the first seed: physical pruning (:func:`mha.pruning.prune_heads`) at
   ``speed_fractions`` of the heads, examples/s at ``batch_sizes`` against
   the parameter and FLOP counts.

Everything lands in ``out``: ``results.json``, ``report.md``, PNG plots and
each seed's per-example sums of every mask it evaluated
(``examples_seed<s>.npz``, what a new resample needs).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any, Callable, Collection, Mapping, Sequence

import jax
import numpy as np

from mha import build
from mha import checkpoint as ckpt_lib
from mha import config_validation
from mha import data
from mha import head_roles
from mha import train
from mha.model import Transformer
from mha.pruning import beyond
from mha.pruning import core as pruning
from mha.pruning import oracle
from mha.pruning import speed
from mha.pruning import stats
from mha.pruning import summary

# Orders of the pruning curves: key -> label. Measures first, then baselines.
ORDERINGS = {
    "gradient": "gradient",
    "gradient_l2": "gradient (L2 per layer)",
    "gradient_iterative": "gradient (re-estimated)",
    "leave_one_out": "leave-one-out",
    "confidence": "confidence",
    "entropy": "entropy",
    "shapley": "Shapley value",
    "reverse_gradient": "reverse gradient",
    "random": "random",
}
#: The curves: every ordering and the oracle (not an ordering: its subsets
#: for k and k + 1 heads removed need not be nested).
CURVE_LABELS = {**ORDERINGS, "oracle": "oracle (best subset)"}
#: Subsets per number of heads removed among which each bootstrap replicate
#: chooses the oracle again (the best ones on the full validation split), so
#: that the oracle's intervals include the variability of its choice.
ORACLE_CANDIDATES = 5
#: The cost of one subset in ``oracle.evaluate_subsets`` relative to one mask
#: of ``evaluate_masks`` (0.85 measured on 2 CPU cores when the study was
#: written; ``scripts/benchmark.py`` measures it again: ``pruning_masks``,
#: ``subsets.speedup`` is its inverse). Every subset is evaluated instead of
#: ``M`` masks when ``M >= SUBSET_COST * 2**N``.
SUBSET_COST = 0.85
BASELINES = summary.BASELINES
CURVE_METRICS = summary.CURVE_METRICS


@dataclasses.dataclass(frozen=True)
class Options:
  """Settings of the experiment (the script's flags).

  Attributes:
    num_seeds: models analysed: the workdir's, then ``num_seeds - 1`` more
      trained with seeds ``config.seed + 1, ...``.
    retrain_seeds: retrain a seed directory trained with another config
      (otherwise that is an error).
    oracle_max_heads: evaluate every subset of heads (the oracle, Shapley
      values) up to this many heads; above it both are skipped.
    num_bootstrap: bootstrap resamples of every interval.
    num_random_orders: random orders per seed (the baseline).
    step_fraction: fraction of the heads removed per curve point; 0 removes
      one head at a time.
    reestimate: include the order that re-estimates gradient importance
      after each removal.
    tolerance: "prunable" means every validation point up to there is
      within this much of the unpruned validation accuracy (0.01 = 1 point);
      the level is chosen on validation and its test accuracy reported.
    speed_fractions: fractions of heads physically pruned for the speed
      table (0 is always added).
    batch_sizes: batch sizes of the speed table.
    speed_repeats: timing repeats per model and batch size (median).
    speed_order: the ordering whose least important heads are pruned for
      the speed table.
    remove_heads: extra ``(layer, head)`` set to prune physically and
      evaluate (reported as ``custom_pruning``).
    batch_size: examples per evaluation call.
    seed: seed of the random orders.
    speed: whether to run the speed table.
    gates: train hard-concrete head gates (:mod:`mha.pruning.gates`), one
      per strength of ``gate_lambdas``, for ``gate_steps`` steps at
      ``gate_learning_rate``, and evaluate their subsets.
    retrain: fine-tune pruned models for ``retrain_steps`` steps at each of
      ``retrain_fractions`` (gradient order, oracle, gates and
      ``retrain_random`` random orders) against the same architectures
      trained from scratch (trains the gates too).
    mean_ablation: every curve again with removed heads outputting their
      mean (:mod:`mha.pruning.mean_ablation`).
  """

  num_seeds: int = 5
  retrain_seeds: bool = False
  oracle_max_heads: int = 12
  num_bootstrap: int = 1000
  num_random_orders: int = 20
  step_fraction: float = 0.0
  reestimate: bool = True
  tolerance: float = 0.01
  speed_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)
  batch_sizes: tuple[int, ...] = (1, 16, 64, 256)
  speed_repeats: int = speed.REPEATS
  speed_order: str = "gradient_l2"
  remove_heads: tuple[tuple[int, int], ...] = ()
  batch_size: int = 1000
  seed: int = 0
  speed: bool = True
  gates: bool = False
  gate_lambdas: tuple[float, ...] = (0.1, 0.3, 1.0, 2.0, 3.0, 4.0, 6.0)
  gate_steps: int = 200
  gate_learning_rate: float = 0.1
  retrain: bool = False
  retrain_steps: int = 100
  retrain_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)
  retrain_random: int = 5
  mean_ablation: bool = False

  def validate(self) -> None:
    """Raises ValueError naming the first bad setting."""
    for name in ("num_seeds", "oracle_max_heads", "num_bootstrap",
                 "num_random_orders", "speed_repeats", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
    if not 0.0 <= self.step_fraction <= 1.0:
      raise ValueError(
          f"--step_fraction must be in [0, 1], got {self.step_fraction}")
    if not 0.0 <= self.tolerance <= 1.0:
      raise ValueError(f"--tolerance must be in [0, 1], got {self.tolerance}")
    for f in self.speed_fractions:
      if not 0.0 <= f <= 1.0:
        raise ValueError(
            f"--speed_fractions: {f} is outside [0, 1]")
    if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
      raise ValueError(
          f"--batch_sizes must be positive integers, got {self.batch_sizes}")
    if self.speed_order not in ORDERINGS or self.speed_order in (
        "random", "shapley"):
      valid = ", ".join(k for k in ORDERINGS
                        if k not in ("random", "shapley"))
      raise ValueError(
          f"--speed_order {self.speed_order!r} is not one of: {valid}")
    if self.speed_order == "gradient_iterative" and not self.reestimate:
      raise ValueError("--speed_order=gradient_iterative needs --reestimate")
    self._validate_beyond()

  def _validate_beyond(self) -> None:
    for name in ("gate_steps", "retrain_steps", "retrain_random"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
    if not self.gate_lambdas or any(
        not (math.isfinite(x) and x >= 0) for x in self.gate_lambdas):
      raise ValueError("--gate_lambdas must be numbers >= 0, got "
                       f"{list(self.gate_lambdas)}")
    if not (math.isfinite(self.gate_learning_rate)
            and self.gate_learning_rate > 0):
      raise ValueError("--gate_learning_rate must be > 0, got "
                       f"{self.gate_learning_rate}")
    if not self.retrain_fractions or any(
        not 0.0 < f < 1.0 for f in self.retrain_fractions):
      raise ValueError("--retrain_fractions must be in (0, 1), got "
                       f"{list(self.retrain_fractions)}")

  @property
  def beyond(self) -> bool:
    """Whether any of the gates, retraining or mean ablation runs."""
    return self.gates or self.retrain or self.mean_ablation


Log = Callable[[str], None]


def _timed(log: Log, what: str, fn: Callable[[], Any]) -> tuple[Any, float]:
  start = time.perf_counter()
  out = fn()
  seconds = time.perf_counter() - start
  log(f"  {what}: {seconds:.2f} s")
  return out, seconds


def _quiet(_: str) -> None:
  pass


# --------------------------------------------------------------------------
# Importance measures and orders, on validation.
# --------------------------------------------------------------------------


def _halves(split: data.Split) -> tuple[data.Split, data.Split]:
  n = len(split) // 2
  first = data.Split(split.inputs[:n], split.targets[:n])
  second = data.Split(split.inputs[n:], split.targets[n:])
  return first, second


def _leave_one_out(model: Transformer, params: Any, validation: data.Split,
                   options: Options,
                   table: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
  """:func:`core.leave_one_out`, looked up in the subset ``table`` (per
  example, every subset) when there is one."""
  if table is None:
    return pruning.leave_one_out(model, params, validation,
                                 batch_size=options.batch_size)
  config = model.config
  ids = oracle.subset_index(config,
                            pruning.leave_one_out_masks_with_full(config))
  return pruning.leave_one_out_from_metrics(config, pruning.summarize_examples(
      {k: np.asarray(v)[ids] for k, v in table.items()}))


def measure_importance(model: Transformer, params: Any, validation: data.Split,
                       options: Options, log: Log = _quiet,
                       timings: dict[str, float] | None = None, *,
                       table: Mapping[str, np.ndarray] | None = None
                       ) -> dict[str, Any]:
  """Every per-head measure on ``validation``: ``[L, H]`` arrays (NaN where
  no head), and ``validation``, the unpruned metrics. ``table``: the
  per-example sums of every subset on ``validation``, when evaluated."""
  timings = {} if timings is None else timings
  bs = options.batch_size
  half_a, half_b = _halves(validation)

  def gradients():  # The mean of |g| over both halves is the whole's.
    a = pruning.gradient_importance(model, params, half_a, batch_size=bs)
    b = pruning.gradient_importance(model, params, half_b, batch_size=bs)
    return a, b, (len(half_a) * a + len(half_b) * b) / max(len(validation), 1)

  (grad_a, grad_b, grad), timings["gradient_s"] = _timed(
      log, "gradient importance (vmap of grad, per-example |.|), two halves",
      gradients)
  loo, timings["leave_one_out_s"] = _timed(
      log, "leave-one-out" + (" (from the subsets)" if table is not None
                              else " (every head's mask, vmapped)"),
      lambda: _leave_one_out(model, params, validation, options, table))
  attn, timings["confidence_s"] = _timed(
      log, "attention confidence and entropy",
      lambda: pruning.attention_confidence(model, params, validation,
                                           batch_size=bs))
  return {
      "gradient": grad,
      "gradient_l2": pruning.normalize_per_layer(grad),
      "leave_one_out": loo["loss_increase"],
      "confidence": attn["confidence"],
      "entropy": attn["entropy"],
      "leave_one_out_token_accuracy_drop":
          loo["base"]["token_accuracy"] - loo["token_accuracy"],
      "gradient_validation_half_a": grad_a,
      "gradient_validation_half_b": grad_b,
      "validation": loo["base"],
  }


def orders_from_importance(importance: Mapping[str, np.ndarray]
                           ) -> dict[str, np.ndarray]:
  """The order (least important first) of every measure in ``importance``
  and the reverse gradient order."""
  orders = {
      "gradient": pruning.order_from_importance(importance["gradient"]),
      "gradient_l2": pruning.order_from_importance(importance["gradient_l2"]),
      "leave_one_out": pruning.order_from_importance(
          importance["leave_one_out"]),
      "confidence": pruning.order_from_importance(importance["confidence"]),
      # Low entropy = focused = important: remove the most diffuse first.
      "entropy": pruning.order_from_importance(-importance["entropy"]),
  }
  shapley = importance.get("shapley_token_accuracy")
  if shapley is not None and not np.all(np.isnan(shapley)):
    orders["shapley"] = pruning.order_from_importance(shapley)
  orders["reverse_gradient"] = orders["gradient"][::-1].copy()
  return orders


def oracle_applies(config: Any, options: Options) -> bool:
  """Whether every subset of the model's heads is evaluated."""
  return oracle.num_heads(config) <= options.oracle_max_heads


def subset_values(metrics: Mapping[str, np.ndarray]) -> np.ndarray:
  """The oracle's and Shapley's value of each subset: token accuracy, ties
  broken by the loss (differences in token accuracy are multiples of one
  token in the split, far above 1e-9 x loss)."""
  return metrics["token_accuracy"] - 1e-9 * metrics["loss"]


def oracle_removals(model: Transformer, params: Any, validation: data.Split,
                    options: Options, *, no_layer_emptied: bool = False,
                    top: int = 1,
                    table: Mapping[str, np.ndarray] | None = None
                    ) -> list[list[np.ndarray]]:
  """The oracle, chosen on ``validation``: for each number ``k`` of heads
  removed (0..N), the removed heads (flat indices, ``layer * H + head``) of
  the ``top`` best subsets by :func:`subset_values`, the best first;
  ``[k][0]`` is the oracle's choice.

  ``table``: the per-example sums of every subset on ``validation``
  (``oracle.evaluate_subsets(..., per_example=True)``) when already
  evaluated; otherwise they are evaluated here.
  """
  if table is None:
    table = oracle.evaluate_subsets(model, params, validation,
                                    batch_size=options.batch_size,
                                    per_example=True)
  values = subset_values(pruning.summarize_examples(table))
  return oracle.ranked_removals(values, model.config,
                                no_layer_emptied=no_layer_emptied, top=top)


def compute_orders(model: Transformer, params: Any, validation: data.Split,
                   options: Options, *,
                   names: Collection[str] | None = None
                   ) -> dict[str, np.ndarray]:
  """The order (flat head indices, least important first) of every
  non-random ordering of :data:`ORDERINGS`, measured on ``validation``
  (``shapley`` only when the model has at most ``oracle_max_heads``
  heads; ``gradient_iterative`` only with ``options.reestimate``).

  ``names``: when given, the orderings wanted; the expensive ones (every
  subset for ``shapley``, the re-estimated gradient) are computed only when
  asked for. The cheap measures come back regardless.
  """
  wanted = lambda name: names is None or name in names
  table = None
  if wanted("shapley") and oracle_applies(model.config, options):
    table = oracle.evaluate_subsets(model, params, validation,
                                    batch_size=options.batch_size,
                                    per_example=True)
  importance = measure_importance(model, params, validation, options,
                                  table=table)
  if table is not None:
    importance["shapley_token_accuracy"] = oracle.shapley_values(
        pruning.summarize_examples(table)["token_accuracy"], model.config)
  orders = orders_from_importance(importance)
  if options.reestimate and wanted("gradient_iterative"):
    orders["gradient_iterative"] = pruning.iterative_gradient_order(
        model, params, validation, batch_size=options.batch_size)
  return orders


# --------------------------------------------------------------------------
# The masks a seed evaluates, and their per-example results.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
  """Distinct masks ``[M, L, H]`` and, per variant and curve, the ``[R, P]``
  mask ids of its points (R = 1 but for ``random``); the ids of the oracle
  at every ``k`` and of the single-head and all-but-one masks."""

  masks: list[np.ndarray] = dataclasses.field(default_factory=list)
  index: dict[bytes, int] = dataclasses.field(default_factory=dict)
  curves: dict[str, dict[str, np.ndarray]] = dataclasses.field(
      default_factory=dict)
  counts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  oracle: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  single: np.ndarray | None = None
  all_but_one: np.ndarray | None = None

  def add(self, mask: np.ndarray) -> int:
    """The id of ``mask``, added if new."""
    key = np.asarray(mask, np.float32).tobytes()
    if key not in self.index:
      self.index[key] = len(self.masks)
      self.masks.append(np.asarray(mask, np.float32))
    return self.index[key]

  def add_curve(self, variant: str, name: str, config: Any,
                removals: Sequence[Sequence[int]]) -> None:
    """A curve whose point ``p`` removes the heads ``removals[p]``; several
    calls with one name stack (random orders)."""
    ids = [self.add(pruning.mask_without(config, r)) for r in removals]
    curves = self.curves.setdefault(variant, {})
    row = np.asarray(ids, np.int64)[None]
    curves[name] = row if name not in curves else np.concatenate(
        [curves[name], row])


def plan_masks(config: Any, orders: Mapping[str, np.ndarray],
               random_orders: np.ndarray, oracle_removals: Mapping[str, Any],
               counts: np.ndarray) -> Plan:
  """Every curve of both variants (``all``; ``no_layer_emptied``, which
  skips a layer's last head and stops at ``N - layers with heads``), the
  full mask (id 0) and the single-head and all-but-one masks.
  ``oracle_removals``: variant -> for each ``k`` the removals of the best
  subsets on validation, best first (the oracle's candidates)."""
  plan = Plan()
  plan.add(pruning.full_head_mask(config))
  limit = pruning.removable_keeping_layers(config)
  plan.counts = {"all": counts, "no_layer_emptied": counts[counts <= limit]}
  named = [(k, v) for k, v in orders.items()] + [
      ("random", o) for o in random_orders]
  for variant, points in plan.counts.items():
    for name, order in named:
      if variant == "no_layer_emptied":
        order = pruning.keep_one_per_layer(config, order)
      plan.add_curve(variant, name, config, [order[:k] for k in points])
    ranked = oracle_removals.get(variant)
    if ranked is not None:  # A row per candidate, the best first.
      for c in range(max(len(r) for r in ranked)):
        plan.add_curve(variant, "oracle", config,
                       [ranked[k][min(c, len(ranked[k]) - 1)]
                        for k in points])
      plan.oracle[variant] = np.asarray(
          [plan.add(pruning.mask_without(config, r[0])) for r in ranked])
  plan.single = np.asarray([plan.add(m) for m in
                            pruning.leave_one_out_masks(config)])
  plan.all_but_one = np.asarray([plan.add(m) for m in
                                 pruning.all_but_one_masks(config)])
  return plan


def _per_example(model: Transformer, params: Any, split: data.Split,
                 masks: np.ndarray, table: Mapping[str, np.ndarray] | None,
                 options: Options) -> dict[str, np.ndarray]:
  """Per-example sums ``[M, n]`` of ``masks``: looked up in ``table`` (every
  subset) when given; else every subset is evaluated when that is cheaper
  (the masks are at least :data:`SUBSET_COST` of the subsets), else just
  ``masks``."""
  config = model.config
  if table is None and oracle_applies(config, options) and (
      len(masks) >= SUBSET_COST * 2 ** oracle.num_heads(config)):
    table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                    batch_size=options.batch_size)
  if table is not None:
    ids = oracle.subset_index(config, masks)
    return {k: np.asarray(v)[ids] for k, v in table.items()}
  return pruning.evaluate_masks(model, params, split, masks,
                                batch_size=options.batch_size,
                                per_example=True)


# --------------------------------------------------------------------------
# One seed.
# --------------------------------------------------------------------------


def _oracle(model: Transformer, params: Any, validation: data.Split,
            options: Options, log: Log, timings: dict[str, float]
            ) -> tuple[dict[str, np.ndarray] | None, np.ndarray,
                       dict[str, list[np.ndarray]]]:
  """Every subset on validation (per example), Shapley values ``[L, H]``
  and the oracle's removals per variant; ``(None, NaN, {})`` above
  ``oracle_max_heads``."""
  config = model.config
  n = oracle.num_heads(config)
  if not oracle_applies(config, options):
    log(f"  oracle and Shapley values skipped: {n} heads > "
        f"--oracle_max_heads={options.oracle_max_heads}")
    return None, np.full(pruning.existing_heads(config).shape, np.nan), {}
  table, timings["oracle_s"] = _timed(
      log, f"oracle: all {2 ** n} subsets of heads on validation, layer by "
      "layer", lambda: oracle.evaluate_subsets(
          model, params, validation, per_example=True,
          batch_size=options.batch_size))
  removals = {variant: oracle_removals(
      model, params, validation, options, table=table, top=ORACLE_CANDIDATES,
      no_layer_emptied=variant == "no_layer_emptied")
      for variant in ("all", "no_layer_emptied")}
  shapley = oracle.shapley_values(
      pruning.summarize_examples(table)["token_accuracy"], config)
  return table, shapley, removals


def _oracle_entries(config: Any, plan: Plan, variant: str,
                    val: Mapping[str, np.ndarray],
                    test: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
  """The ``oracle`` list of ``results.json``: for every ``k`` the removed
  heads and their validation and test metrics."""
  entries = []
  for k, mask_id in enumerate(plan.oracle.get(variant, [])):
    removed = np.flatnonzero(plan.masks[mask_id].reshape(-1) == 0)
    removed = removed[pruning.existing_heads(config).reshape(-1)[removed]]
    entries.append({
        "k": k, "removed": [list(p) for p in
                            pruning.flat_to_pairs(config, removed)],
        "validation": {m: float(v[mask_id]) for m, v in val.items()},
        "test": {m: float(v[mask_id]) for m, v in test.items()},
    })
  return entries


def _ablations(config: Any, plan: Plan, val: Mapping[str, np.ndarray],
               test: Mapping[str, np.ndarray],
               test_sums: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """Michel et al.'s tables on test: each head removed alone (change, paired
  t-test over examples, Benjamini-Hochberg q), and each layer reduced to
  one head (the best head chosen on validation)."""
  single: dict[str, Any] = {}
  for metric, key in (("token_accuracy", "correct"), ("exact_match",
                                                      "exact")):
    single[f"{metric}_change"] = pruning.heads_to_array(
        config, test[metric][plan.single] - test[metric][0])
    p = stats.paired_ttest_pvalues(test_sums[key][0],
                                   test_sums[key][plan.single])
    single[f"{metric}_p"] = pruning.heads_to_array(config, p)
    single[f"{metric}_q"] = pruning.heads_to_array(
        config, stats.benjamini_hochberg(p))
  single["loss_change"] = pruning.heads_to_array(
      config, test["loss"][plan.single] - test["loss"][0])
  abo_val = {m: pruning.heads_to_array(config, v[plan.all_but_one])
             for m, v in val.items()}
  abo_test = {m: pruning.heads_to_array(config, v[plan.all_but_one])
              for m, v in test.items()}
  best = []
  for layer, count in enumerate(config.heads_per_layer):
    if count == 0:
      best.append(None)
      continue
    head = int(np.nanargmax(abo_val["token_accuracy"][layer]))
    best.append({
        "layer": layer, "head": head,
        "validation_token_accuracy": float(
            abo_val["token_accuracy"][layer, head]),
        **{f"test_{k}": float(abo_test[k][layer, head])
           for k in ("token_accuracy", "exact_match", "loss")}})
  return {"single_head_ablation": single,
          "all_but_one": {"test": abo_test, "validation": abo_val,
                          "best_head_per_layer": best}}


def _spearman(importance: Mapping[str, np.ndarray]) -> dict[str, Any]:
  pairs = {
      "gradient_vs_leave_one_out": ("gradient", "leave_one_out"),
      "gradient_l2_vs_leave_one_out": ("gradient_l2", "leave_one_out"),
      "gradient_halves": ("gradient_validation_half_a",
                          "gradient_validation_half_b"),
      "confidence_vs_leave_one_out": ("confidence", "leave_one_out"),
      "shapley_vs_leave_one_out": ("shapley_token_accuracy",
                                   "leave_one_out_token_accuracy_drop"),
      "shapley_vs_gradient": ("shapley_token_accuracy", "gradient"),
  }
  return {name: stats.spearman(importance[a], importance[b])
          for name, (a, b) in pairs.items()}


@dataclasses.dataclass(frozen=True)
class Resamples:
  """The bootstrap resamples shared by every seed: ``[R, n]`` example counts
  of validation and test, and ``[R, S]`` seed weights."""

  validation: np.ndarray
  test: np.ndarray
  seeds: np.ndarray

  @classmethod
  def draw(cls, splits: Mapping[str, data.Split], num_seeds: int,
           num_bootstrap: int, rng: np.random.Generator) -> "Resamples":
    """Independent resamples of both splits and of the seeds."""
    return cls(
        stats.example_weights(len(splits["validation"]), num_bootstrap, rng),
        stats.example_weights(len(splits["test"]), num_bootstrap, rng),
        stats.seed_weights(num_seeds, num_bootstrap, rng))


def _measure_seed(model: Transformer, params: Any,
                  splits: Mapping[str, data.Split], options: Options,
                  rng: np.random.Generator, log: Log,
                  timings: dict[str, float]) -> dict[str, Any]:
  """Importance, orders, the oracle and the per-example sums of every mask
  the seed's curves and tables need, on validation and test."""
  config = model.config
  val, test = splits["validation"], splits["test"]
  table, shapley, removals = _oracle(model, params, val, options, log,
                                     timings)
  importance = measure_importance(model, params, val, options, log, timings,
                                  table=table)
  validation = importance.pop("validation")
  importance["shapley_token_accuracy"] = shapley
  orders = orders_from_importance(importance)
  if options.reestimate:
    orders["gradient_iterative"], timings["gradient_iterative_s"] = _timed(
        log, "gradient importance re-estimated after each removal",
        lambda: pruning.iterative_gradient_order(
            model, params, val, batch_size=options.batch_size))
  random_orders = pruning.random_orders(config, options.num_random_orders,
                                        rng)
  n = oracle.num_heads(config)
  plan = plan_masks(config, orders, random_orders, removals,
                    pruning.pruning_counts(n, options.step_fraction))
  masks = np.stack(plan.masks)
  val_sums, timings["validation_masks_s"] = _timed(
      log, f"{len(masks)} distinct masks on validation",
      lambda: _per_example(model, params, val, masks, table, options))
  test_sums, timings["test_masks_s"] = _timed(
      log, f"{len(masks)} distinct masks on test (curves, oracle, tables)",
      lambda: _per_example(model, params, test, masks, None, options))
  return {"importance": importance, "validation": validation,
          "orders": {**orders, "random": random_orders}, "plan": plan,
          "val_sums": val_sums, "test_sums": test_sums, "num_heads": n,
          "oracle_ran": table is not None}


def analyze_seed(model: Transformer, params: Any,
                 splits: Mapping[str, data.Split], options: Options,
                 rng: np.random.Generator, resamples: Resamples,
                 log: Log = print) -> tuple[dict[str, Any],
                                            dict[summary.Key, np.ndarray]]:
  """Importance measures (validation), the oracle, pruning curves and
  Michel et al.'s tables (test) of one model.

  Returns:
    ``(result, statistics)``: the JSON-able result of the seed, and its
    bootstrap statistics (:func:`mha.pruning.summary.seed_statistics`) for
    :func:`aggregate`.
  """
  config = model.config
  timings: dict[str, float] = {}
  m = _measure_seed(model, params, splits, options, rng, log, timings)
  plan = m["plan"]
  statistics = summary.seed_statistics(
      plan.curves, plan.counts, m["num_heads"], m["val_sums"],
      m["test_sums"], resamples.validation, resamples.test,
      options.tolerance)
  val = pruning.summarize_examples(m["val_sums"])
  test = pruning.summarize_examples(m["test_sums"])
  nested = summary.seed_summary(statistics)
  out: dict[str, Any] = {
      "importance": m["importance"], "validation": m["validation"],
      "test": {k: float(v[0]) for k, v in test.items()},
      "spearman": _spearman(m["importance"]), "orders": m["orders"],
      "counts": plan.counts["all"],
      "fractions": plan.counts["all"] / max(m["num_heads"], 1),
      **nested["all"],
      "oracle": _oracle_entries(config, plan, "all", val, test),
      "no_layer_emptied": {
          "counts": plan.counts["no_layer_emptied"],
          "fractions": plan.counts["no_layer_emptied"] / max(
              m["num_heads"], 1),
          **nested["no_layer_emptied"],
          "oracle": _oracle_entries(config, plan, "no_layer_emptied", val,
                                    test)},
      **_ablations(config, plan, val, test, m["test_sums"]),
      "timings": timings,
  }
  # What each head attends to, on the split of the importance measures.
  out["head_roles"] = head_roles.head_roles(
      model, params, splits["validation"], options.batch_size)
  if not m["oracle_ran"]:
    out["oracle_skipped"] = (
        f"{m['num_heads']} heads > --oracle_max_heads="
        f"{options.oracle_max_heads}: 2**{m['num_heads']} subsets not "
        "evaluated")
  out["examples"] = {"masks": np.stack(plan.masks),
                     "validation": m["val_sums"], "test": m["test_sums"]}
  return out, statistics


# --------------------------------------------------------------------------
# Physical pruning and speed.
# --------------------------------------------------------------------------


def custom_pruning(model: Transformer, params: Any, test: data.Split,
                   heads: Sequence[tuple[int, int]],
                   batch_size: int) -> dict[str, Any]:
  """Test metrics of the model with ``heads`` physically pruned."""
  p, c = pruning.prune_heads(params, model.config, heads)
  metrics = pruning.evaluate_masks(Transformer(c), p, test,
                                   pruning.full_head_mask(c)[None],
                                   batch_size=batch_size)
  return {"removed": [list(h) for h in heads],
          "heads_per_layer": list(c.heads_per_layer),
          "params": pruning.count_params(p),
          **{f"test_{k}": float(v[0]) for k, v in metrics.items()}}


# --------------------------------------------------------------------------
# Seeds, the whole run, outputs.
# --------------------------------------------------------------------------


def kept_steps(config: Any) -> list[int]:
  """The checkpoint steps a finished run of ``config`` keeps."""
  every, total = config.checkpoint_every_steps, config.num_train_steps
  steps = sorted({*range(every, total + 1, every), total})
  keep = config.max_checkpoints_to_keep
  return steps[-keep:] if keep and keep > 0 else steps


def check_step(first: ckpt_lib.LoadedCheckpoint, num_seeds: int) -> None:
  """Raises ValueError when the other seeds cannot be analysed at the step of
  the workdir's checkpoint ``first`` (a step their runs do not keep)."""
  steps = kept_steps(first.config)
  if num_seeds > 1 and first.step not in steps:
    raise ValueError(
        f"step {first.step}: the seeds this script trains keep steps "
        f"{', '.join(map(str, steps))}; pick one of them with --step or "
        "--num_seeds=1")


def _seed_config(first: ckpt_lib.LoadedCheckpoint, offset: int) -> Any:
  config = copy.deepcopy(first.config)
  config.seed = first.config.seed + offset
  return config


def seed_dir(out_dir: str, seed: int) -> str:
  """Where the study trains the model of ``seed``."""
  return os.path.join(out_dir, "seeds", f"seed_{seed}")


def seed_conflicts(first: ckpt_lib.LoadedCheckpoint, out_dir: str,
                   num_seeds: int) -> dict[str, list[str]]:
  """Seed directories under ``out_dir`` whose recorded config differs from
  the workdir's (seed aside, and the keys a resumed run may change,
  ``config_validation.RESUMABLE_KEYS``, but for ``num_train_steps``: a seed
  trained longer is another model at its end): directory -> differing
  keys."""
  out = {}
  for i in range(1, num_seeds):
    config = _seed_config(first, i)
    directory = seed_dir(out_dir, config.seed)
    saved = ckpt_lib.saved_config(directory) if os.path.isdir(
        directory) else None
    if saved is not None:
      keys = [c.split(" ", 1)[0] for c in
              config_validation.resume_conflicts(saved, config)]
      if saved.get("num_train_steps") != config.num_train_steps:
        keys.append("num_train_steps")
      if keys:
        out[directory] = keys
  return out


def _saved_steps(directory: str) -> list[int]:
  """The checkpoint steps in ``directory`` (none when it has none)."""
  if not os.path.isdir(ckpt_lib.checkpoint_dir(directory)):
    return []
  manager = ckpt_lib.make_manager(directory, read_only=True)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def check_seeds(first: ckpt_lib.LoadedCheckpoint, out_dir: str,
                num_seeds: int, retrain: bool) -> dict[str, list[str]]:
  """Checks that every seed can be analysed at ``first.step``; returns the
  seed directories to retrain (:func:`seed_conflicts`, with ``retrain``).

  Raises:
    ValueError: a step the seeds' runs do not keep; a seed directory
      trained with another config (without ``retrain``); a finished seed
      directory without a checkpoint of ``first.step``.
  """
  check_step(first, num_seeds)
  conflicts = seed_conflicts(first, out_dir, num_seeds)
  if conflicts and not retrain:
    directory, keys = next(iter(conflicts.items()))
    raise ValueError(
        f"{directory} was trained with another config (differs in "
        f"{', '.join(keys)}); delete it or pass --retrain_seeds")
  for i in range(1, num_seeds):
    directory = seed_dir(out_dir, first.config.seed + i)
    steps = [] if directory in conflicts else _saved_steps(directory)
    if (steps and steps[-1] >= first.config.num_train_steps
        and first.step not in steps):
      raise ValueError(
          f"{directory} has no checkpoint of step {first.step} (steps "
          f"saved: {', '.join(map(str, steps))}); delete it or pass another "
          "--step")
  return conflicts


def check_inputs(workdir: str, out_dir: str, options: Options,
                 step: int | None = None) -> ckpt_lib.LoadedCheckpoint:
  """Every check of the user's input before the long work: the options,
  the workdir's checkpoint (of ``step``), the seeds
  (:func:`check_seeds`), the heads to remove. Returns the checkpoint.

  Raises:
    FileNotFoundError: no checkpoint (of ``step``) in ``workdir``.
    ValueError: any other mistake, naming it.
  """
  options.validate()
  first = ckpt_lib.load_checkpoint(workdir, step)
  check_seeds(first, out_dir, options.num_seeds, options.retrain_seeds)
  if options.remove_heads:
    pruning.prune_heads(first.params, first.model_config, options.remove_heads)
  return first


def seed_models(first: ckpt_lib.LoadedCheckpoint, out_dir: str,
                num_seeds: int, log: Log = print, *,
                retrain: bool = False) -> list[ckpt_lib.LoadedCheckpoint]:
  """The workdir's checkpoint ``first``, then ``num_seeds - 1`` models of
  the same config trained with the next seeds under ``out_dir/seeds/``,
  each at ``first.step``. A seed directory is reused when its recorded
  config matches; one trained with another config is an error
  (ValueError, :func:`check_seeds`), or retrained from scratch with
  ``retrain``."""
  stale = check_seeds(first, out_dir, num_seeds, retrain)
  loaded = [first]
  for i in range(1, num_seeds):
    config = _seed_config(first, i)
    directory = seed_dir(out_dir, config.seed)
    if directory in stale:
      log(f"Retraining seed {config.seed}: {directory} was trained with "
          f"another config ({', '.join(stale[directory])})")
      shutil.rmtree(directory)
    steps = _saved_steps(directory)
    if steps and steps[-1] >= config.num_train_steps:
      log(f"Reusing seed {config.seed} from {directory}")
    else:
      log(f"Training seed {config.seed} in {directory} ...")
      train.train_and_evaluate(config, directory)
    loaded.append(ckpt_lib.load_checkpoint(directory, first.step))
  return loaded


# --------------------------------------------------------------------------
# Across seeds.
# --------------------------------------------------------------------------


def aggregate(seed_results: Sequence[Mapping[str, Any]],
              seed_statistics: Sequence[Mapping[summary.Key, np.ndarray]],
              seed_weights: np.ndarray) -> dict[str, Any]:
  """The mean over seeds of every curve statistic with two-level bootstrap
  intervals; Spearman correlations averaged through Fisher's z; per seed,
  the share of random orders at least as good as each ordering (a one-sided
  permutation p-value) and the heads whose removal alone changes test token
  accuracy significantly (Benjamini-Hochberg q < 0.05)."""
  nested = summary.aggregate_statistics(seed_statistics, seed_weights)
  out: dict[str, Any] = {**nested["all"],
                         "no_layer_emptied": nested["no_layer_emptied"]}
  out["spearman"] = {
      key: stats.fisher_mean([r["spearman"][key] for r in seed_results])
      for key in seed_results[0]["spearman"]}
  share: dict[str, list[float]] = {}
  for r in seed_results:
    per_order = np.asarray(
        r["curve_summary"]["random"]["auc_token_accuracy_per_order"])
    for name, entry in r["curve_summary"].items():
      if name != "random":
        share.setdefault(name, []).append(float(
            (1 + np.sum(per_order >= entry["auc_token_accuracy"])) /
            (1 + len(per_order))))
  out["share_of_random_at_least_as_good"] = share
  out["significant_single_heads"] = [
      int(np.nansum(np.asarray(
          r["single_head_ablation"]["token_accuracy_q"], np.float64) < 0.05))
      for r in seed_results]
  return out


# --------------------------------------------------------------------------
# The whole run, outputs.
# --------------------------------------------------------------------------


def _analyze_all(checkpoints, splits, options, log):
  rng = np.random.default_rng(options.seed)
  resamples = Resamples.draw(splits, len(checkpoints), options.num_bootstrap,
                             np.random.default_rng([options.seed, 1]))
  seeds, statistics, extras = [], [], []
  for ckpt in checkpoints:
    log(f"Seed {ckpt.config.seed} (step {ckpt.step}, "
        f"{pruning.count_params(ckpt.params):,} parameters):")
    seed_start = time.perf_counter()
    result, stat = analyze_seed(ckpt.model, ckpt.params, splits, options,
                                rng, resamples, log)
    result["seed"] = int(ckpt.config.seed)
    result["step"] = int(ckpt.step)
    result["config"] = ckpt.config.to_dict()
    result["timings"]["total_s"] = time.perf_counter() - seed_start
    if options.beyond:
      extras.append(beyond.analyze_seed(ckpt, result, splits, options,
                                        resamples, log))
      result["timings"]["beyond_s"] = (time.perf_counter() - seed_start
                                       - result["timings"]["total_s"])
    seeds.append(result)
    statistics.append(stat)
  extra = (beyond.aggregate(extras, statistics, seeds, resamples.seeds,
                            options) if extras else {})
  return seeds, aggregate(seeds, statistics, resamples.seeds), extra


def _header(workdir, first, options, splits) -> dict[str, Any]:
  return {
      "workdir": os.path.abspath(os.path.expanduser(workdir)),
      "task": first.config.task,
      "model": dataclasses.asdict(first.model_config) | {"dtype": str(
          first.model_config.dtype)},
      "options": dataclasses.asdict(options),
      "orderings": ORDERINGS,
      "curve_labels": CURVE_LABELS,
      "splits": {"importance": "validation", "accuracy": "test",
                 "sizes": {k: len(v) for k, v in splits.items()}},
      "definitions": {
          "auc": "trapezoid area under the test curve over the fraction of "
                 "heads removed, divided by the fraction range",
          "max_prunable": "largest fraction of heads removed up to which "
                          "every validation point is within `tolerance` of "
                          "the unpruned validation value (chosen on "
                          "validation; test_<metric>_at_prunable is its test "
                          "value)",
          "ci": "95% percentile interval of a paired bootstrap over "
                "validation and test examples (and, across seeds, over "
                "seeds: two-level)",
          "oracle": "for each k, the subset with k heads removed of best "
                    "validation token accuracy (ties: lower loss)",
          "no_layer_emptied": "the same orderings, skipping the last head "
                              "of a layer (and the oracle among subsets "
                              "keeping one head per layer)",
      },
  }


def run(workdir: str, out_dir: str, options: Options,
        step: int | None = None, log: Log = print) -> dict[str, Any]:
  """The whole experiment on the checkpoint of ``workdir`` (its newest, or
  ``step``); writes ``results.json``, ``report.md``, the plots and each
  seed's per-example results (``examples_seed<s>.npz``) to ``out_dir`` and
  returns the results.

  Raises:
    FileNotFoundError: no checkpoint (of ``step``) in ``workdir``.
    ValueError: bad options, a head to remove that does not exist, a
      step the other seeds will not have, or a seed directory trained
      with another config (without ``retrain_seeds``): :func:`check_inputs`.
  """
  start = time.perf_counter()
  first = check_inputs(workdir, out_dir, options, step)
  os.makedirs(out_dir, exist_ok=True)
  checkpoints = seed_models(first, out_dir, options.num_seeds, log,
                            retrain=options.retrain_seeds)
  config = first.config
  splits = data.load_splits(build.data_spec(config), config.data.data_dir)
  experiment_start = time.perf_counter()
  seeds, agg, extra = _analyze_all(checkpoints, splits, options, log)
  results = _header(workdir, first, options, splits) | extra | {
      "seeds": seeds, "aggregate": agg,
      "jax": {"version": jax.__version__, "backend": jax.default_backend(),
              "devices": [str(d) for d in jax.devices()]}}
  if options.speed:
    log("Speed of physically pruned models (first seed):")
    order = np.asarray(seeds[0]["orders"][options.speed_order])
    results["speed"], seconds = _timed(
        log, "speed table",
        lambda: speed.speed_table(
            first.model, first.params, order, splits["test"],
            fractions=options.speed_fractions,
            batch_sizes=options.batch_sizes, repeats=options.speed_repeats,
            log=log) | {"order": options.speed_order})
    seeds[0]["timings"]["speed_s"] = seconds
  if options.remove_heads:
    results["custom_pruning"] = custom_pruning(
        first.model, first.params, splits["test"], options.remove_heads,
        options.batch_size)
  results["timings"] = {
      "experiment_s": time.perf_counter() - experiment_start,
      "first_seed_with_speed_s": seeds[0]["timings"]["total_s"] +
                                 seeds[0]["timings"].get("speed_s", 0.0),
      "total_s": time.perf_counter() - start,
  }
  write_outputs(results, out_dir)
  return results


def _jsonable(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.ndarray, jax.Array)):
    return _jsonable(np.asarray(value).tolist())
  if isinstance(value, (np.floating, float)):
    return None if not math.isfinite(float(value)) else float(value)
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.bool_,)):
    return bool(value)
  return value


def _write_examples(seed: Mapping[str, Any], out_dir: str) -> str:
  """The seed's per-example sums of every mask it evaluated (what a new
  resample needs): ``masks [M, L, H]``, ``validation_<sum>`` and
  ``test_<sum>`` ``[M, n]``."""
  examples = seed["examples"]
  arrays = {"masks": examples["masks"]}
  for split in ("validation", "test"):
    arrays.update({f"{split}_{k}": v for k, v in examples[split].items()})
  path = os.path.join(out_dir, f"examples_seed{seed['seed']}.npz")
  np.savez_compressed(path, **arrays)
  return path


def write_outputs(results: Mapping[str, Any], out_dir: str) -> list[str]:
  """Writes ``results.json``, each seed's ``examples_seed<s>.npz`` (when
  the results hold them), the plots and ``report.md``; returns the paths."""
  from mha.pruning import report  # Deferred: matplotlib.

  os.makedirs(out_dir, exist_ok=True)
  written = [_write_examples(s, out_dir) for s in results["seeds"]
             if "examples" in s]
  results = dict(results, seeds=[{k: v for k, v in s.items()
                                  if k != "examples"}
                                 for s in results["seeds"]])
  path = os.path.join(out_dir, "results.json")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(_jsonable(results), f, indent=1, allow_nan=False)
  os.replace(path + ".tmp", path)
  return written + [path] + report.write(results, out_dir)


__all__ = ["Options", "ORDERINGS", "CURVE_LABELS", "Resamples", "aggregate",
           "analyze_seed", "compute_orders", "oracle_removals",
           "measure_importance", "orders_from_importance", "custom_pruning",
           "run", "seed_models", "check_inputs", "check_seeds", "write_outputs"]
