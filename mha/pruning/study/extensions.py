"""The study's extensions: learned gates, retraining after pruning, mean
ablation, on the study's seeds and with its intervals.

Run by :func:`mha.pruning.study.run` after each seed's analysis when
``StudyOptions.gates``, ``retrain`` or ``mean_ablation`` is set (``--full``: all
three). Every statistic is computed under the study's bootstrap resamples
(:class:`mha.pruning.study.analysis.Resamples`), so it pairs with the orderings'
and the oracle's numbers and combines over seeds in the same two-level way.

* **Mean ablation** (:mod:`mha.pruning.mean_ablation`): every curve of the
  study again (the same orders, the oracle chosen again on the mean-ablated
  validation split), each removed head outputting its mean over validation.
* **Gates** (:mod:`mha.pruning.gates`): one gate vector per strength, trained
  on the train split from the converged model; its kept heads (plain, and
  never emptying a layer) evaluated as masks on validation and test, and
  compared with the oracle's subset with as many heads removed. The gates'
  main result, exact-K gates (one gate vector per number of heads removed,
  trained by the seed's analysis: ``searches.gates_k``, a curve), is
  summarised per target as ``gates.exact_k``.
* **Retraining** (:mod:`mha.pruning.retrain`): at each fraction of heads
  removed, the subsets of the gradient order, the oracle, the gates (the
  strength whose count is nearest, its lowest gates) and ``retrain_random``
  random orders, fine-tuned for ``retrain_steps``; the controls: each
  pruned architecture (heads per layer) initialised as that architecture and
  trained from scratch for the run's steps (Scratch-E) and for the FLOPs of
  the run plus the fine-tuning (Scratch-B), and the kept heads' step-0
  weights trained for the run's steps (rewind). The old control (the full
  model's fresh initialisation under the mask, ``retrain_steps`` steps) is
  kept as ``from_scratch``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha.aliases import Log, Params
from mha.model import Transformer
from mha.pruning import best_ordering
from mha.pruning import core
from mha.pruning import gates as gates_lib
from mha.pruning import mean_ablation
from mha.pruning import oracle
from mha.pruning import retrain
from mha.pruning import stats
from mha.pruning.study import analysis
from mha.pruning.study import summary
from mha.pruning.study.options import StudyOptions

Stat = np.ndarray  # [1 + R]: the full sample, then the resamples


@dataclasses.dataclass(frozen=True)
class SeedInputs:
  """What the extensions need of one analysed seed."""

  model: Transformer
  params: Params
  config: Any  # the run config (ml_collections)
  splits: Mapping[str, data.Split]
  result: Mapping[str, Any]  # analysis.analyze_seed's result
  val_weights: np.ndarray  # [R, n] resample counts
  test_weights: np.ndarray


def _metric_rows(sums: Mapping[str, np.ndarray], weights: np.ndarray,
                 metric: str = "token_accuracy") -> np.ndarray:
  """``[1 + R, M]`` metric of per-example sums ``[M, n]`` per replicate."""
  return stats.resampled_metrics(sums, summary.with_full_sample(weights))[
      metric]


def _find(examples: Mapping[str, Any], mask: np.ndarray) -> int:
  """The row of ``mask`` among the seed's evaluated masks."""
  hits = np.flatnonzero(np.all(np.asarray(examples["masks"]) == mask,
                               axis=(1, 2)))
  if not len(hits):
    raise KeyError("mask not evaluated by the study")
  return int(hits[0])


def _take(sums: Mapping[str, np.ndarray], rows: Sequence[int]
          ) -> dict[str, np.ndarray]:
  return {k: np.asarray(v)[list(rows)] for k, v in sums.items()}


def _pairs(config: Any, mask: np.ndarray) -> list[list[int]]:
  removed = np.flatnonzero((mask.reshape(-1) == 0)
                           & head_masks.existing_heads(config).reshape(-1))
  return [list(p) for p in head_masks.flat_to_pairs(config, removed)]


# --------------------------------------------------------------------------
# Mean ablation.
# --------------------------------------------------------------------------


def mean_ablation_seed(seed: SeedInputs, options: StudyOptions, log: Log
                       ) -> dict[summary.Key, np.ndarray]:
  """Every curve of the study under mean ablation: its bootstrap statistics
  (:func:`mha.pruning.study.summary.seed_statistics`)."""
  model, params, config = seed.model, seed.params, seed.model.config
  val, test = seed.splits["validation"], seed.splits["test"]
  start = time.perf_counter()
  means = mean_ablation.head_means(model, params, val,
                                   batch_size=options.batch_size)
  shifts = mean_ablation.bias_shifts(params, config, means)
  tables, removals = {}, {}
  if oracle.oracle_applies(config, options.oracle_max_heads):
    if oracle.table_bytes(config, len(val)) <= oracle.PER_EXAMPLE_BYTES:
      for name, split in (("validation", val), ("test", test)):
        tables[name] = oracle.evaluate_subsets(
            model, params, split, per_example=True, bias_shifts=shifts,
            batch_size=options.batch_size)
      subsets = core.summarize_examples(tables["validation"])
    else:  # Too many subsets for a per-example table: streamed.
      subsets = eval_lib.summarize(oracle.subset_totals(
          model, params, val, bias_shifts=shifts,
          batch_size=options.batch_size))
    removals = oracle.removals_by_variant(oracle.subset_values(subsets),
                                          config)
  orders = dict(seed.result["orders"])
  random_orders = np.asarray(orders.pop("random"))
  n = oracle.num_heads(config)
  by_loss = None
  if removals:  # The curves read off the table, under mean ablation too.
    orders["best_ordering"] = best_ordering.best_order(
        oracle.subset_values(subsets), config, best_ordering.auc_weights(
            core.pruning_counts(n, options.step_fraction), n))
    by_loss = oracle.ranked_removals(-np.asarray(subsets["loss"]), config,
                                     top=oracle.ORACLE_CANDIDATES)
  # The searches' subsets (found under zero ablation) as they are.
  found = {name: [head_masks.pairs_to_flat(config, e["removed"])
                  for e in entries]
           for name, entries in seed.result.get("searches", {}).items()}
  plan = analysis.plan_masks(
      config, {k: np.asarray(v) for k, v in orders.items()}, random_orders,
      removals, core.pruning_counts(n, options.step_fraction), found,
      by_loss=by_loss)
  masks = np.stack(plan.masks)
  sums = {}
  for name, split in (("validation", val), ("test", test)):
    if name in tables:
      sums[name] = _take(tables[name], oracle.subset_index(config, masks))
    else:
      sums[name] = mean_ablation.evaluate_masks(
          model, params, shifts, split, masks, batch_size=options.batch_size)
  log(f"  mean ablation: {len(masks)} masks on validation and test"
      f"{' (every subset)' if tables else ''}: "
      f"{time.perf_counter() - start:.2f} s")
  return summary.seed_statistics(
      plan.curves, plan.counts, n, sums["validation"], sums["test"],
      seed.val_weights, seed.test_weights, options.tolerance,
      select=analysis.SELECTED,
      loss_tolerance_bits=options.loss_tolerance_bits)


def aggregate_mean_ablation(per_seed: Sequence[Mapping[summary.Key, Any]],
                            zero: Sequence[Mapping[summary.Key, Any]],
                            seed_weights: np.ndarray,
                            results: Mapping[str, Any]) -> dict[str, Any]:
  """``results.json``'s ``mean_ablation``: curves and curve summaries like
  the study's (``curves``, ``curve_summary``, ``validation_curves``,
  ``no_layer_emptied``), and per curve the AUC change from zero to mean
  ablation (``auc_<metric>_mean_minus_zero``, paired)."""
  nested = summary.aggregate_statistics(per_seed, seed_weights)
  out = {"ablation": "each removed head outputs its mean context over the "
                     "validation split (folded into the output bias)",
         "counts": results["seeds"][0]["counts"],
         "fractions": results["seeds"][0]["fractions"],
         **nested["all"], "no_layer_emptied": nested["no_layer_emptied"]}
  for (variant, name, stat) in per_seed[0]:
    if variant != "all" or stat not in ("auc_token_accuracy",
                                         "auc_exact_match"):
      continue
    key = (variant, name, stat)
    diff = np.stack([m[key] - z[key] for m, z in zip(per_seed, zero)])
    entry = out["curve_summary"][name]
    entry[f"{stat}_mean_minus_zero"] = float(diff[:, 0].mean())
    entry[f"{stat}_mean_minus_zero_ci"] = stats.seed_interval(
        diff, seed_weights)
  return out


# --------------------------------------------------------------------------
# Gates.
# --------------------------------------------------------------------------


def _oracle_row(seed: SeedInputs, variant: str, removed: int) -> int | None:
  """The study's row of the oracle's subset with ``removed`` heads removed
  (None when the oracle did not run or has no such subset)."""
  entries = (seed.result["oracle"] if variant == "all" else
             seed.result["no_layer_emptied"]["oracle"])
  if removed >= len(entries):
    return None
  config = seed.model.config
  flat = head_masks.pairs_to_flat(config, entries[removed]["removed"])
  return _find(seed.result["examples"], head_masks.mask_without(config, flat))


def _lowest_loss(seed: SeedInputs, masks: np.ndarray,
                 by_loss: Sequence[Sequence[np.ndarray]] | None
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
  """For each mask, the subset of lowest validation loss with as many heads
  removed (what the gates' objective prefers; None without the oracle) and
  its test token accuracy ``[1 + R, S]``."""
  if by_loss is None:
    return None, None
  config = seed.model.config
  n = oracle.num_heads(config)
  removed = [n - int(m.sum()) for m in masks]
  best = np.stack([head_masks.mask_without(config, by_loss[k][0])
                   for k in removed])
  sums = core.evaluate_masks(seed.model, seed.params, seed.splits["test"],
                             best, per_example=True)
  return best, _metric_rows(sums, seed.test_weights)


def _gate_variant(seed: SeedInputs, log_alpha: np.ndarray,
                  strengths: Sequence[float], variant: str,
                  by_loss: Sequence[Sequence[np.ndarray]] | None = None
                  ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
  """One variant's per-strength entries and its statistics ``[S, 1 + R]``:
  test token accuracy of the gates' subset, minus the oracle's, and the
  lowest-loss subset's (``by_loss``: per ``k`` the removals ranked by
  validation loss) minus the oracle's."""
  model, config = seed.model, seed.model.config
  masks = np.stack([gates_lib.kept_mask(la, config, no_layer_emptied=(
      variant == "no_layer_emptied")) for la in log_alpha])
  sums = {name: core.evaluate_masks(model, seed.params, seed.splits[name],
                                    masks, per_example=True)
          for name in ("validation", "test")}
  test_rows = _metric_rows(sums["test"], seed.test_weights)  # [1+R, S]
  loss_masks, loss_rows = _lowest_loss(seed, masks, by_loss)
  examples = seed.result["examples"]
  entries, gap = [], np.full(test_rows.shape, np.nan)
  criterion = np.full(test_rows.shape, np.nan)
  n = oracle.num_heads(config)
  for i, (lam, mask) in enumerate(zip(strengths, masks)):
    removed = n - int(mask.sum())
    row = _oracle_row(seed, variant, removed)
    entry = {"lambda": float(lam), "heads_removed": removed,
             "fraction_removed": removed / max(n, 1),
             "kept": [list(p) for p in head_masks.flat_to_pairs(
                 config, np.flatnonzero(mask.reshape(-1) > 0))],
             **{name: {k: float(v[i]) for k, v in
                       core.summarize_examples(s).items()}
                for name, s in sums.items()}}
    if row is not None:
      oracle_test = _metric_rows(_take(examples["test"], [row]),
                                 seed.test_weights)[:, 0]
      gap[:, i] = test_rows[:, i] - oracle_test
      entry["oracle_test_token_accuracy"] = float(oracle_test[0])
      entry["minus_oracle_token_accuracy"] = float(gap[0, i])
      entry["minus_oracle_token_accuracy_ci"] = stats.interval(gap[1:, i])
      criterion[:, i] = loss_rows[:, i] - oracle_test
      entry["lowest_loss_subset"] = {
          "removed": _pairs(config, loss_masks[i]),
          "test_token_accuracy": float(loss_rows[0, i])}
      entry["is_lowest_loss_subset"] = bool(np.array_equal(loss_masks[i],
                                                           mask))
    entries.append(entry)
  return entries, {"test_token_accuracy": test_rows.T, "minus_oracle": gap.T,
                   "lowest_loss_minus_oracle": criterion.T}


def _exact_k_seed(seed: SeedInputs
                  ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
  """The exact-K gates' subsets (``searches.gates_k``, evaluated by the
  study) at each trained target: their entries (the oracle's keys and
  ``target_k``) and statistics ``[T, 1 + R]``: test token accuracy and its
  difference from the oracle's subset with as many heads removed."""
  entries = seed.result.get("searches", {}).get("gates_k")
  if not entries:
    return [], {}
  config = seed.model.config
  examples = seed.result["examples"]
  targets = seed.result["gates_k"]["targets"]
  rows = [_find(examples, head_masks.mask_without(
      config, head_masks.pairs_to_flat(config, entries[t]["removed"])))
          for t in targets]
  test = _metric_rows(_take(examples["test"], rows), seed.test_weights)
  gap = np.full(test.shape, np.nan)
  for i, t in enumerate(targets):
    row = _oracle_row(seed, "all", t)
    if row is not None:
      gap[:, i] = test[:, i] - _metric_rows(
          _take(examples["test"], [row]), seed.test_weights)[:, 0]
  return ([dict(entries[t]) for t in targets],
          {"test_token_accuracy": test.T, "minus_oracle": gap.T})


def gates_seed(seed: SeedInputs, options: StudyOptions, log: Log
               ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Trains the gates of every strength and evaluates their subsets:
  ``(result entry, statistics per variant)``."""
  trained = gates_lib.train_gates(
      seed.model, seed.params, seed.splits["train"], options.gate_lambdas,
      steps=options.gate_steps, batch_size=seed.config.batch_size,
      learning_rate=options.gate_learning_rate, seed=int(seed.config.seed),
      log=log)
  log(f"  gates: {len(options.gate_lambdas)} strengths x "
      f"{options.gate_steps} steps trained in {trained['seconds']:.2f} s")
  entry: dict[str, Any] = {"log_alpha": trained["log_alpha"],
                           "train_seconds": trained["seconds"]}
  by_loss = {}
  if seed.result["oracle"]:  # Every subset's validation loss: the gates'
    loss = eval_lib.summarize(oracle.subset_totals(  # criterion (the
        seed.model, seed.params, seed.splits["validation"],  # study's program)
        batch_size=options.batch_size))["loss"]
    by_loss = {v: oracle.ranked_removals(
        -loss, seed.model.config, no_layer_emptied=v == "no_layer_emptied")
        for v in ("all", "no_layer_emptied")}
  statistics = {}
  for variant in ("all", "no_layer_emptied"):
    entry[variant], statistics[variant] = _gate_variant(
        seed, trained["log_alpha"], options.gate_lambdas, variant,
        by_loss.get(variant))
  entry["exact_k"], statistics["exact_k"] = _exact_k_seed(seed)
  if entry["exact_k"]:
    entry["exact_k_train_seconds"] = seed.result["gates_k"]["train_seconds"]
  return entry, statistics


def _combine(rows: Sequence[np.ndarray], seed_weights: np.ndarray
             ) -> tuple[float, list[float]]:
  """Mean over seeds of per-seed ``[1 + R]`` statistics, with its interval
  over examples and seeds (:func:`mha.pruning.stats.seed_interval`; NaN
  when any seed lacks it)."""
  stacked = np.stack(rows)
  if not np.all(np.isfinite(stacked)):
    return float("nan"), [float("nan")] * 2
  return (float(stacked[:, 0].mean()),
          stats.seed_interval(stacked, seed_weights))


def aggregate_gates(per_seed: Sequence[Mapping[str, Any]],
                    statistics: Sequence[Mapping[str, Any]],
                    seed_weights: np.ndarray, options: StudyOptions,
                    seeds: Sequence[int]) -> dict[str, Any]:
  """``results.json``'s ``gates``: per strength, the kept heads and the
  validation and test metrics of every seed, and the means over seeds with
  intervals (test token accuracy, its gap to the oracle with as many heads
  removed); the training cost."""
  out: dict[str, Any] = {
      "strengths": list(options.gate_lambdas), "steps": options.gate_steps,
      "learning_rate": options.gate_learning_rate,
      "trained_on": "train split; model parameters frozen",
      "train_seconds_per_seed": [s["train_seconds"] for s in per_seed],
      "log_alpha_per_seed": [s["log_alpha"] for s in per_seed]}
  for variant in ("all", "no_layer_emptied"):
    rows = []
    for i, lam in enumerate(options.gate_lambdas):
      entry: dict[str, Any] = {"lambda": float(lam), "per_seed": [
          dict(s[variant][i], seed=int(seed))
          for s, seed in zip(per_seed, seeds)]}
      removed = [s[variant][i]["heads_removed"] for s in per_seed]
      entry["heads_removed"] = float(np.mean(removed))
      entry["fraction_removed"] = float(np.mean(
          [s[variant][i]["fraction_removed"] for s in per_seed]))
      for key in ("test_token_accuracy", "minus_oracle",
                  "lowest_loss_minus_oracle"):
        value, ci = _combine([st[variant][key][i] for st in statistics],
                             seed_weights)
        name = (key if key == "test_token_accuracy"
                else f"{key}_token_accuracy")
        entry[name], entry[f"{name}_ci"] = value, ci
      same = [s[variant][i].get("is_lowest_loss_subset") for s in per_seed]
      if None not in same:
        entry["share_lowest_loss_subset"] = float(np.mean(same))
      rows.append(entry)
    out[variant] = rows
  if per_seed[0]["exact_k"] and all(s["exact_k"] for s in per_seed):
    out.update(_aggregate_exact_k(per_seed, statistics, seed_weights,
                                  options, seeds))
  return out


def _aggregate_exact_k(per_seed: Sequence[Mapping[str, Any]],
                       statistics: Sequence[Mapping[str, Any]],
                       seed_weights: np.ndarray, options: StudyOptions,
                       seeds: Sequence[int]) -> dict[str, Any]:
  """``gates.exact_k``: per target ``k`` (``target_k``, heads removed), every
  seed's entry (the oracle's keys and ``target_k``) and the means over
  seeds with intervals of test token accuracy and its gap to the oracle's
  subset with as many heads removed; how the gates trained."""
  rows = []
  for i, first in enumerate(per_seed[0]["exact_k"]):
    entry: dict[str, Any] = {
        "target_k": first["target_k"], "k": first["k"],
        "heads_removed": first["k"],
        "per_seed": [dict(s["exact_k"][i], seed=int(seed))
                     for s, seed in zip(per_seed, seeds)]}
    for key, name in (("test_token_accuracy", "test_token_accuracy"),
                      ("minus_oracle", "minus_oracle_token_accuracy")):
      entry[name], entry[f"{name}_ci"] = _combine(
          [st["exact_k"][key][i] for st in statistics], seed_weights)
    rows.append(entry)
  return {"exact_k": rows, "exact_k_method": options.gate_method,
          "exact_k_steps": options.gate_steps,
          "exact_k_train_seconds_per_seed": [s["exact_k_train_seconds"]
                                             for s in per_seed],
          "exact_k_curve": "gates_k",
          "exact_k_subset": "the k heads of lowest log_alpha: exactly k "
                            "removed by construction"}


# --------------------------------------------------------------------------
# Retraining after pruning.
# --------------------------------------------------------------------------


def _subsets(seed: SeedInputs, options: StudyOptions, log_alpha: np.ndarray | None
             ) -> list[tuple[str, float, int, np.ndarray]]:
  """``(ordering, fraction, index, removed flat heads)`` of every pruned
  model to retrain; the gates' subset is the exact-K gates' for that
  number of heads when they ran, else the strength's whose count is nearest
  (its lowest gates)."""
  config = seed.model.config
  n = oracle.num_heads(config)
  orders, oracle_entries = seed.result["orders"], seed.result["oracle"]
  out = []
  for fraction in options.retrain_fractions:
    k = int(round(fraction * n))
    out.append(("gradient", fraction, 0, np.asarray(orders["gradient"])[:k]))
    if k < len(oracle_entries):
      out.append(("oracle", fraction, 0, np.asarray(
          head_masks.pairs_to_flat(config, oracle_entries[k]["removed"]),
          np.int64)))
    exact = {e["k"]: e["removed"] for e in
             seed.result.get("searches", {}).get("gates_k", [])}
    if k in exact:  # The exact-K gates' subset of exactly k heads.
      out.append(("gates", fraction, 0, np.asarray(
          head_masks.pairs_to_flat(config, exact[k]), np.int64)))
    elif log_alpha is not None:
      removed = [int(np.sum(gates_lib.kept_mask(la, config) == 0)
                     - np.sum(~head_masks.existing_heads(config)))
                 for la in log_alpha]
      nearest = int(np.argmin([abs(r - k) for r in removed]))
      out.append(("gates", fraction, 0,
                  gates_lib.removal_of_size(log_alpha[nearest], config, k)))
    for i, order in enumerate(np.asarray(orders["random"])[
        :options.retrain_random]):
      out.append(("random", fraction, i, order[:k]))
  return out


def _architectures(config: Any, masks: np.ndarray) -> tuple[np.ndarray,
                                                            np.ndarray]:
  """The distinct heads-per-layer of ``masks`` (one mask each, the first
  with it) and, per mask, the index of its architecture."""
  counts = [tuple(int(c) for c in m.sum(axis=1)) for m in masks]
  distinct = list(dict.fromkeys(counts))
  first = np.asarray([counts.index(c) for c in distinct])
  return masks[first], np.asarray([distinct.index(c) for c in counts])


def _distinct(starts: Sequence[int], masks: np.ndarray, steps: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
  """The distinct retraining jobs among rows: rows with the same start
  (``starts``, an id of the parameters they start from), mask and steps
  train to the same parameters (:func:`mha.pruning.retrain.finetune_masked`
  trains each model as it would alone). Returns the first row of each
  distinct job and, per row, the index of its job."""
  keys = [(int(s), m.tobytes(), int(n)) for s, m, n in
          zip(starts, np.asarray(masks, np.float32), steps)]
  distinct = list(dict.fromkeys(keys))
  where = {key: i for i, key in enumerate(distinct)}
  first = np.asarray([keys.index(key) for key in distinct], np.int64)
  return first, np.asarray([where[key] for key in keys], np.int64)


def _train(seed: SeedInputs, params: Params, masks: np.ndarray,
           steps: int | np.ndarray, starts: Sequence[int],
           options: StudyOptions, log: Log) -> tuple[np.ndarray, float]:
  """Trains the stacked ``params`` under ``masks`` for ``steps`` steps (one
  count, or one per row), each distinct job (:func:`_distinct`) once:
  their test metric rows ``[R, 1 + B]`` and the training seconds."""
  steps = np.broadcast_to(np.asarray(steps, np.int64), (len(masks),))
  first, job = _distinct(starts, masks, steps)
  if len(first) < len(masks):
    log(f"    {len(masks)} models, {len(first)} distinct (the others train "
        f"identically: same start, mask and steps)")
  trained, info = retrain.finetune_masked(
      seed.model, jax.tree.map(lambda x: np.asarray(x)[first], params),
      masks[first], seed.splits["train"], seed.config, steps=steps[first],
      log=log)
  sums = retrain.example_sums(seed.model, trained, masks[first],
                              seed.splits["test"],
                              batch_size=options.batch_size)
  return _metric_rows(sums, seed.test_weights).T[job], info["seconds"]


def retrain_seed(seed: SeedInputs, options: StudyOptions, log_alpha: np.ndarray | None,
                 log: Log) -> dict[str, Any]:
  """Retrains every pruned model of :func:`_subsets` in four arms
  (:mod:`mha.pruning.retrain`): fine-tuned from the converged parameters
  for ``retrain_steps``; each architecture (heads per layer) from a fresh
  initialisation of that architecture for the run's steps (Scratch-E) and
  for the FLOPs of the run plus the fine-tuning (Scratch-B); the kept heads'
  step-0 weights for the run's steps (rewind). Also the old control, each
  architecture from the full model's fresh initialisation under the mask
  for ``retrain_steps`` (``scratch``). Test metric rows of each."""
  model, config, run = seed.model, seed.model.config, seed.config
  subsets = _subsets(seed, options, log_alpha)
  masks = np.stack([head_masks.mask_without(config, r) for *_, r in subsets])
  arch_masks, arch_of = _architectures(config, masks)
  count, archs = len(masks), len(arch_masks)
  run_steps = int(run.num_train_steps)
  base = 1000 * (int(run.seed) + 1)  # fresh keys, apart from the run's
  seconds = {}
  log(f"  retraining: {count} pruned models fine-tuned and {archs} "
      f"architectures from scratch (full-model init), "
      f"{options.retrain_steps} steps")
  both = jax.tree.map(lambda a, b: np.concatenate([a, b]),
                      retrain.stack(seed.params, count),
                      retrain.fresh_params(model, base + np.arange(archs)))
  all_masks = np.concatenate([masks, arch_masks])
  # Starts: 0 for the converged parameters, 1 + a for architecture a's fresh
  # ones.
  starts = [0] * count + list(1 + np.arange(archs))
  after_rows, seconds["fine_tuned"] = _train(
      seed, both, all_masks, options.retrain_steps, starts, options, log)
  # The stack of ``after``'s distinct jobs: one compilation serves both.
  first, job = _distinct(starts, all_masks,
                         np.full(len(all_masks), options.retrain_steps))
  before = retrain.example_sums(
      model, retrain.stack(seed.params, len(first)), all_masks[first],
      seed.splits["test"], batch_size=options.batch_size)
  before = {k: v[job[:count]] for k, v in before.items()}

  # The fair controls: of the subsets of the orderings (and of the random
  # ones with ``retrain_controls_random``); NaN rows for the others.
  chosen = np.flatnonzero([options.retrain_controls_random
                           or o != "random" for o, *_ in subsets])
  c_masks, c_of = _architectures(config, masks[chosen])
  c_archs = len(c_masks)
  log(f"  retraining: {c_archs} pruned architectures from scratch "
      f"(Scratch-E) and {len(chosen)} rewound to step 0, {run_steps} steps")
  scratch = retrain.scratch_params(model, c_masks,
                                   base + 500 + np.arange(c_archs))
  rewind = retrain.stack(retrain.step0_params(model, run), len(chosen))
  # Starts: a for architecture a's fresh parameters, c_archs for step 0's.
  e_rows, seconds["scratch_e_and_rewind"] = _train(
      seed, jax.tree.map(lambda a, b: np.concatenate([a, b]), scratch,
                         rewind),
      np.concatenate([c_masks, masks[chosen]]), run_steps,
      list(np.arange(c_archs)) + [c_archs] * len(chosen), options, log)

  b_steps = np.asarray([retrain.scratch_b_steps(
      config, m, train_steps=run_steps, finetune_steps=options.retrain_steps)
      for m in c_masks])
  log(f"  retraining: {c_archs} pruned architectures from scratch "
      f"(Scratch-B), {', '.join(map(str, sorted(set(b_steps.tolist()))))} "
      f"steps")
  b_rows, seconds["scratch_b"] = _train(
      seed, scratch, c_masks, b_steps, np.arange(c_archs), options, log)

  def per_subset(values: np.ndarray) -> np.ndarray:
    out = np.full((count, values.shape[1]), np.nan)
    out[chosen] = values
    return out

  b_per_subset = [None] * count
  for row, a in zip(chosen, c_of):
    b_per_subset[row] = int(b_steps[a])
  return {"subsets": [(o, f, i, _pairs(config, m)) for (o, f, i, _), m in
                      zip(subsets, masks)],
          "before": _metric_rows(before, seed.test_weights).T,
          "after": after_rows[:count], "scratch": after_rows[count:][arch_of],
          "scratch_e": per_subset(e_rows[:c_archs][c_of]),
          "rewind": per_subset(e_rows[c_archs:]),
          "scratch_b": per_subset(b_rows[c_of]),
          "scratch_b_steps": b_per_subset,
          "run_steps": run_steps,
          "seconds": float(sum(seconds.values())),
          "seconds_by_arm": seconds,
          "heads_per_layer": [list(map(int, m.sum(axis=1))) for m in masks]}


#: The retraining arms (``results.json``'s contract) and the old control.
ARMS = ("fine_tuned", "scratch_e", "scratch_b", "rewind")
#: The paired differences of arms reported (``<a>_minus_<b>``).
ARM_DIFFERENCES = (("fine_tuned", "scratch_e"), ("fine_tuned", "scratch_b"),
                   ("rewind", "scratch_e"), ("scratch_b", "scratch_e"))


def _retrain_statistics(seed_run: Mapping[str, Any]
                        ) -> dict[tuple[str, float], dict[str, Stat]]:
  """Per (ordering, fraction): before, after (= fine-tuned), from scratch
  (the old control), Scratch-E, Scratch-B, rewind and their differences,
  ``[1 + R]`` (random: the mean over its subsets)."""
  groups: dict[tuple[str, float], list[int]] = {}
  for row, (ordering, fraction, _, _) in enumerate(seed_run["subsets"]):
    groups.setdefault((ordering, fraction), []).append(row)
  out = {}
  for key, rows in groups.items():
    # An arm not trained for these subsets (NaN) is left out.
    values = {name: np.asarray(seed_run[name])[rows].mean(axis=0)
              for name in ("before", "after", "scratch", "scratch_e",
                           "scratch_b", "rewind") if name in seed_run
              and not np.isnan(np.asarray(seed_run[name])[rows]).any()}
    values["fine_tuned"] = values["after"]
    values["recovered"] = values["after"] - values["before"]
    values["after_minus_from_scratch"] = values["after"] - values["scratch"]
    for a, b in ARM_DIFFERENCES:
      if a in values and b in values:
        values[f"{a}_minus_{b}"] = values[a] - values[b]
    out[key] = values
  for (ordering, fraction), values in out.items():
    random = out.get(("random", fraction))
    if random is not None and ordering != "random":
      values["after_minus_random"] = values["after"] - random["after"]
      values["before_minus_random"] = values["before"] - random["before"]
  return out


def aggregate_retraining(per_seed: Sequence[Mapping[str, Any]],
                         seed_weights: np.ndarray, options: StudyOptions,
                         seeds: Sequence[int]) -> dict[str, Any]:
  """``results.json``'s ``retraining``: per ordering and fraction, test
  token accuracy before, after fine-tuning and from scratch, the recovery
  and the differences against from-scratch and random subsets, each a mean
  over seeds with its 95% interval, and the per-seed values."""
  per_seed_stats = [_retrain_statistics(s) for s in per_seed]
  names = {"before": "before", "after": "after", "scratch": "from_scratch",
           "recovered": "recovered",
           "after_minus_from_scratch": "after_minus_from_scratch",
           "after_minus_random": "after_minus_random",
           "before_minus_random": "before_minus_random",
           **{arm: arm for arm in ARMS},
           **{f"{a}_minus_{b}": f"{a}_minus_{b}"
              for a, b in ARM_DIFFERENCES}}
  orderings: dict[str, dict[str, Any]] = {}
  for key in per_seed_stats[0]:
    if not all(key in s for s in per_seed_stats):
      continue
    ordering, fraction = key
    entry: dict[str, Any] = {"fraction": fraction}
    for stat, name in names.items():
      if stat in per_seed_stats[0][key]:
        entry[name], entry[f"{name}_ci"] = _combine(
            [s[key][stat] for s in per_seed_stats], seed_weights)
        entry[f"{name}_per_seed"] = [float(s[key][stat][0])
                                     for s in per_seed_stats]
    emptied = [[0 in h for (o, f, _, _), h in zip(s["subsets"],
                                                  s["heads_per_layer"])
                if (o, f) == key] for s in per_seed]
    entry["share_emptying_a_layer"] = float(np.mean(sum(emptied, [])))
    b_steps = sorted({n for s in per_seed for (o, f, _, _), n in zip(
        s["subsets"], s.get("scratch_b_steps", []))
        if (o, f) == key and n is not None})
    if b_steps:
      entry["scratch_b_steps"] = b_steps[0] if len(b_steps) == 1 else b_steps
    orderings.setdefault(ordering, {})[f"{fraction:g}"] = entry
  return {
      "steps": options.retrain_steps, "fractions": list(
          options.retrain_fractions),
      "random_subsets": options.retrain_random, "metric": "test token accuracy",
      "schedule": "the run's optimizer (AdamW, warmup then cosine decay) over "
                  "retrain_steps, warmup the same share of them; a fresh "
                  "optimizer per model; the same batches for all",
      "controls_random": options.retrain_controls_random,
      "from_scratch": "each pruned architecture (heads per layer) from fresh "
                      "parameters of the full model under the mask (the full "
                      "model's output-projection scale), retrain_steps steps: "
                      "the old control, kept for comparison; it measures the "
                      "training budget, not the kept weights",
      "run_steps": int(per_seed[0]["run_steps"]) if "run_steps" in per_seed[
          0] else None,
      "arms": {
          "fine_tuned": "the pruned model from the converged parameters, "
                        "retrain_steps steps (= after)",
          "scratch_e": "the pruned architecture (heads per layer) from a "
                       "fresh initialisation of that architecture (its own "
                       "fan-ins), the run's steps and schedule (Liu et al. "
                       "2019, Scratch-E)",
          "scratch_b": "the same initialisation as scratch_e, for the "
                       "training FLOPs of the run plus the fine-tuning: "
                       "round(run_steps * F_full / F_pruned) + retrain_steps "
                       "steps, F the matrix-multiply FLOPs of a forward pass "
                       "(retrain.forward_flops; the importance measurement "
                       "and the search not counted) (Liu et al. 2019, "
                       "Scratch-B)",
          "rewind": "the kept heads' step-0 weights (the run's own initial "
                    "parameters under the mask), the run's steps and "
                    "schedule (Frankle & Carbin 2019, rewinding to "
                    "step 0)"},
      "orderings": orderings,
      "subsets": [{"seed": int(seed), "subsets": [
          {"ordering": o, "fraction": f, "index": i, "removed": r,
           "heads_per_layer": h}
          for (o, f, i, r), h in zip(s["subsets"], s["heads_per_layer"])]}
          for s, seed in zip(per_seed, seeds)],
      "train_seconds_per_seed": [s["seconds"] for s in per_seed],
      "train_seconds_by_arm_per_seed": [s.get("seconds_by_arm", {})
                                        for s in per_seed],
  }


__all__ = ["SeedInputs", "mean_ablation_seed", "aggregate_mean_ablation",
           "gates_seed", "aggregate_gates", "retrain_seed",
           "aggregate_retraining", "ARMS", "ARM_DIFFERENCES"]


# --------------------------------------------------------------------------
# Per seed and across seeds, for the study.
# --------------------------------------------------------------------------


def analyze_seed(ckpt: Any, result: dict[str, Any],
                 splits: Mapping[str, data.Split], options: StudyOptions,
                 resamples: Any, log: Log) -> dict[str, Any]:
  """The extensions ``options`` asks for on one analysed seed (``result``
  of ``analysis.analyze_seed``); their timings go to
  ``result["timings"]``."""
  seed = SeedInputs(ckpt.model, ckpt.params, ckpt.config, splits, result,
                    resamples.validation, resamples.test)
  timings = result["timings"]
  out: dict[str, Any] = {}
  if options.mean_ablation:
    start = time.perf_counter()
    out["mean_ablation"] = mean_ablation_seed(seed, options, log)
    timings["mean_ablation_s"] = time.perf_counter() - start
  log_alpha = None
  if options.gates or options.retrain:
    start = time.perf_counter()
    out["gates"], out["gate_statistics"] = gates_seed(seed, options, log)
    log_alpha = out["gates"]["log_alpha"]
    timings["gates_s"] = time.perf_counter() - start
  if options.retrain:
    start = time.perf_counter()
    out["retraining"] = retrain_seed(seed, options, log_alpha, log)
    timings["retrain_s"] = time.perf_counter() - start
  return out


def aggregate(per_seed: Sequence[Mapping[str, Any]],
              zero_statistics: Sequence[Mapping[summary.Key, Any]],
              seed_results: Sequence[Mapping[str, Any]],
              seed_weights: np.ndarray, options: StudyOptions) -> dict[str, Any]:
  """The ``gates``, ``retraining`` and ``mean_ablation`` entries of
  ``results.json`` (those that ran)."""
  seeds = [int(r["seed"]) for r in seed_results]
  out: dict[str, Any] = {}
  if "mean_ablation" in per_seed[0]:
    out["mean_ablation"] = aggregate_mean_ablation(
        [s["mean_ablation"] for s in per_seed], zero_statistics, seed_weights,
        {"seeds": seed_results})
  if "gates" in per_seed[0]:
    out["gates"] = aggregate_gates(
        [s["gates"] for s in per_seed],
        [s["gate_statistics"] for s in per_seed], seed_weights, options,
        seeds)
  if "retraining" in per_seed[0]:
    out["retraining"] = aggregate_retraining(
        [s["retraining"] for s in per_seed], seed_weights, options, seeds)
  return out
