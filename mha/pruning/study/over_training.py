"""The oracle and the orderings along training: ``checkpoints_over_training``.

Trained to the end, the study's models are saturated (validation loss near
0), which flattens every gradient-based measure. Each run keeps several
checkpoints (``config.max_checkpoints_to_keep``); on each, the study's
analysis of one seed (:func:`mha.pruning.study.analysis.analyze_seed`, the
same code path) measures how prunable the model is (the oracle's level
within the tolerance) and each ordering's AUC gap to the oracle, the best
ordering and, by loss, to the oracle by loss: how the measures fare while
the model learns (Michel et al. §6 measured prunability over training).

Kept cheap: the searches, Kwon et al.'s search, the gates, retraining, mean
ablation and the re-estimation of orderings in every resample are off on the
other checkpoints; the analysed step itself is the study's own analysis,
not computed again. Each step's analysis is kept in
``<out>/over_training/seed_<s>/step_<t>.npz`` and reused by a rerun
(:mod:`mha.pruning.study.kept_analyses`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np

from mha import checkpoint as ckpt_lib
from mha import data
from mha.aliases import Log
from mha.pruning.study import analysis
from mha.pruning.study import kept_analyses
from mha.pruning.study import summary
from mha.pruning.study.options import StudyOptions

#: Each ordering's statistics kept per step (variant ``all``), with their
#: intervals.
ORDERING_STATISTICS = (
    "auc_token_accuracy", "auc_token_accuracy_minus_oracle",
    "auc_token_accuracy_minus_best_ordering",
    "prunable_heads_token_accuracy",
    "prunable_heads_token_accuracy_minus_oracle", "auc_loss",
    "auc_loss_minus_oracle_by_loss")
#: The oracle's statistics kept per step.
ORACLE_STATISTICS = ("prunable_heads_token_accuracy",
                     "test_token_accuracy_at_prunable", "auc_token_accuracy",
                     "auc_loss")
#: The curves that are not orderings (each has its own entry or none).
NOT_ORDERINGS = ("oracle", "oracle_by_loss", *analysis.SEARCH_LABELS)


def checkpoint_options(options: StudyOptions) -> StudyOptions:
  """The study's options on a checkpoint along training: the orderings, the
  oracle and the intervals as in the study, the searches and extensions
  off."""
  return dataclasses.replace(
      options, searches=False, kwon=False, gates=False, retrain=False,
      mean_ablation=False, bootstrap_importance=False, speed=False)


def _steps(directory: str) -> list[int]:
  manager = ckpt_lib.make_manager(directory, read_only=True)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def _kept(statistics: Mapping[summary.Key, np.ndarray]
          ) -> dict[summary.Key, np.ndarray]:
  """The statistics an entry needs (variant ``all``)."""
  wanted = set(ORDERING_STATISTICS) | set(ORACLE_STATISTICS)
  return {k: v for k, v in statistics.items()
          if k[0] == "all" and k[2] in wanted}


def _entry(step: int, nested: Mapping[str, Any],
           result: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """One step's entry from a ``curve_summary`` (a seed's or the mean over
  seeds), and the unpruned metrics of ``result`` (one seed's)."""
  summary_ = nested["curve_summary"]
  out: dict[str, Any] = {"step": int(step)}
  if result is not None:
    out["validation"] = dict(result["validation"])
    out["test"] = dict(result["test"])
  oracle = summary_.get("oracle")
  if oracle is not None:
    out["oracle"] = {s: oracle[s] for stat in ORACLE_STATISTICS
                     for s in (stat, f"{stat}_ci") if s in oracle}
  by_loss = summary_.get("oracle_by_loss")
  if by_loss is not None:
    out["oracle_by_loss"] = {s: by_loss[s] for s in ("auc_loss",
                                                     "auc_loss_ci")}
  out["orderings"] = {
      name: {s: entry[s] for stat in ORDERING_STATISTICS
             for s in (stat, f"{stat}_ci", f"{stat}_per_seed") if s in entry}
      for name, entry in summary_.items() if name not in NOT_ORDERINGS}
  return out


def _analyze_step(directory: str, step: int, seed: int,
                  splits: Mapping[str, data.Split], options: StudyOptions,
                  resamples: analysis.Resamples, out_dir: str, log: Log
                  ) -> dict[str, Any] | None:
  """One checkpoint's analysis (kept in ``out_dir`` and reused):
  ``{"entry", "statistics"}``, or None when the checkpoint is damaged."""
  try:
    ckpt = ckpt_lib.load_checkpoint(directory, step)
  except ckpt_lib.DamagedCheckpointError as e:
    log(f"  step {step}: skipped ({e})")
    return None
  rng = np.random.default_rng([options.seed, 5, seed, step])
  path = os.path.join(out_dir, "over_training", f"seed_{seed}",
                      f"step_{step}.npz")
  digest = kept_analyses.key(options, step, ckpt.params, splits, resamples,
                             rng)
  kept = kept_analyses.load(path, digest, rng, log)
  if kept is not None:
    log(f"  step {step}: reusing its analysis kept in {path}")
    return kept
  start = time.perf_counter()
  result, statistics = analysis.analyze_seed(
      ckpt.model, ckpt.params, splits, options, rng, resamples,
      lambda _: None, run_config=ckpt.config)
  kept = {"entry": _entry(step, summary.seed_summary(_kept(statistics))[
      "all"], result), "statistics": _kept(statistics)}
  log(f"  step {step}: analysed in {time.perf_counter() - start:.1f} s")
  try:
    kept_analyses.save(path, digest, kept, rng)
  except TypeError as e:  # Computed, but a rerun will compute it again.
    log(f"  its analysis could not be kept ({e})")
  return kept


def seed_over_training(directory: str, result: Mapping[str, Any],
                       statistics: Mapping[summary.Key, np.ndarray],
                       splits: Mapping[str, data.Split],
                       options: StudyOptions,
                       resamples: analysis.Resamples, out_dir: str,
                       log: Log = print
                       ) -> tuple[list[dict[str, Any]],
                                  dict[int, dict[summary.Key, np.ndarray]]]:
  """One seed's ``checkpoints_over_training``: an entry per checkpoint step
  its run ``directory`` holds (the step the study analysed from
  ``result`` and ``statistics``, the others analysed here with
  :func:`checkpoint_options`), and each step's statistics for the
  aggregate."""
  seed, analysed = int(result["seed"]), int(result["step"])
  steps = _steps(directory)
  log(f"Over training, seed {seed}: checkpoint steps "
      + ", ".join(map(str, steps)) + f" (step {analysed}: the study's own)")
  entries, per_step = [], {}
  reduced = checkpoint_options(options)
  for step in steps:
    if step == analysed:
      kept = {"entry": _entry(step, summary.seed_summary(_kept(statistics))[
          "all"], result), "statistics": _kept(statistics)}
    else:
      kept = _analyze_step(directory, step, seed, splits, reduced, resamples,
                           out_dir, log)
      if kept is None:
        continue
    entries.append(kept["entry"])
    per_step[step] = kept["statistics"]
  return entries, per_step


def aggregate(per_seed: Sequence[Mapping[int, Mapping[summary.Key,
                                                          np.ndarray]]],
              seed_weights: np.ndarray) -> list[dict[str, Any]]:
  """The mean over seeds at each step every seed holds, with the study's
  two-level intervals (:func:`summary.aggregate_statistics`)."""
  steps = sorted(set.intersection(*(set(s) for s in per_seed)))
  out = []
  for step in steps:
    stats_ = [s[step] for s in per_seed]
    keys = set.intersection(*(set(s) for s in stats_))
    nested = summary.aggregate_statistics(
        [{k: s[k] for k in keys} for s in stats_], seed_weights)
    out.append(_entry(step, nested["all"]))
  return out


def run(directories: Sequence[str], results: Sequence[dict[str, Any]],
        statistics: Sequence[Mapping[summary.Key, np.ndarray]],
        splits: Mapping[str, data.Split], options: StudyOptions,
        resamples: analysis.Resamples, out_dir: str, log: Log = print
        ) -> list[dict[str, Any]]:
  """Every seed's ``checkpoints_over_training`` (written into its result)
  and their mean over seeds, per step (returned)."""
  per_seed = []
  for directory, result, stat in zip(directories, results, statistics):
    result["checkpoints_over_training"], steps = seed_over_training(
        directory, result, stat, splits, options, resamples, out_dir, log)
    per_seed.append(steps)
  return aggregate(per_seed, resamples.seeds)


__all__ = ["checkpoint_options", "seed_over_training", "aggregate", "run"]
