"""The head study at the granularity of key/value groups (a GQA model).

On a model whose query heads share key/value heads
(:func:`mha.pruning.kv_groups.is_grouped`) each seed's results gain
``kv_groups``: the study's curves, oracle and statistics with whole groups
as the units (a group's key and value projections and all its query heads
removed together), under the same keys as the head-level study
(``curve_summary``, ``oracle``, ``oracle_by_loss``, ``importance``,
``orders``, ``counts``, ``fractions``), so both granularities sit side by
side. The statistics use the head-level study's resamples of the same
examples, so the two are paired.

A removed group outputs zero (zero ablation) under ``--ablation`` zero,
mean or resample. Under ``--ablation streaming:SINKS,WINDOW`` a removed
group keeps a streaming cache instead: every query head of the group sees
only the sinks and the window of its shared keys and values, which is what
:func:`mha.pruning.mixed_cache.mixed_cache` decodes with the group's ring
buffer. The result then gains ``kv_memory``: the share of the KV cache kept
for each number of groups streaming, ``(k T + (U - k)(SINKS + WINDOW)) /
(U T)`` for ``k`` of ``U`` groups full (every group is one key/value head
of one layer, so they hold equal bytes). That is the memory a grouped
model saves for real; the head-level ``kv_memory`` counts query heads.

The orderings at group level: the group gradient (Michel et al.'s mean
absolute per-example gradient of the group's mask), Fisher (its mean
square, Kwon et al.), leave-one-out (the validation loss a group's removal
alone adds), random orders, and the best subsets: the oracle by token
accuracy and by loss (every subset of the ``U`` groups evaluated). Under
streaming the published KV-cache scores order groups too, each group by its
most important query head (:func:`mha.pruning.kv_groups.induced_order`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import numpy as np

from mha import data
from mha.aliases import Params
from mha.pruning import ablation as ablation_lib
from mha.model import Transformer
from mha.pruning import core
from mha.pruning import kv_groups
from mha.pruning import oracle
from mha.pruning.constants import (ABLATION_STREAMING, KV_SCORES,
                                   parse_ablation)
from mha.pruning.study import summary
from mha.pruning.study.options import StudyOptions

VARIANT = "kv_groups"
#: The group orderings (importance measures) and their report labels.
ORDERINGS = {"gradient": "gradient (group mask)",
             "fisher": "Fisher (group mask)",
             "leave_one_out": "leave-one-group-out"}
#: Random orders of the groups are drawn from this seed (the same orders for
#: every seed of a study).
RANDOM_SEED = 0


def applies(model: Transformer, options: StudyOptions) -> bool:
  """Whether the study runs at group granularity too: a grouped model
  whose ``2**U`` group subsets are within ``--oracle_max_heads``."""
  config = model.config
  return (kv_groups.is_grouped(config)
          and kv_groups.num_groups(config) <= options.oracle_max_heads)


def streams(options: StudyOptions) -> bool:
  """Whether removed groups keep a streaming cache (``--ablation
  streaming``) rather than output zero."""
  return parse_ablation(options.ablation)[0] == ABLATION_STREAMING


def _best(values: np.ndarray, kept: np.ndarray, count: int,
          lower_is_better: bool = False) -> np.ndarray:
  """``[count, U + 1]`` subset ids: for each number of groups removed, the
  best ``count`` subsets by ``values`` (the best first; the best repeated
  where fewer exist)."""
  units = int(kept.max())
  sign = 1.0 if lower_is_better else -1.0
  out = np.zeros((count, units + 1), np.int64)
  for k in range(units + 1):
    ids = np.flatnonzero(kept == units - k)
    ranked = ids[np.argsort(sign * values[ids], kind="stable")]
    out[:, k] = np.concatenate(
        [ranked, np.repeat(ranked[:1], max(0, count - len(ranked)))])[:count]
  return out


def _entries(config, ids: np.ndarray, val: Mapping[str, np.ndarray],
             test: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
  """``[{k, removed: [[layer, group], ...], validation, test}]`` of a chain
  of subset ids."""
  return [{"k": k,
           "removed": [list(p) for p in kv_groups.removed_groups(config,
                                                                 int(s))],
           "validation": {m: float(v[s]) for m, v in val.items()},
           "test": {m: float(v[s]) for m, v in test.items()}}
          for k, s in enumerate(ids)]


def analyze(model: Transformer, params: Params,
            splits: Mapping[str, data.Split], options: StudyOptions,
            val_weights: np.ndarray, test_weights: np.ndarray,
            log: Callable[[str], None],
            ablations: Mapping[str, ablation_lib.Ablation] | None = None,
            head_orders: Mapping[str, np.ndarray] | None = None
            ) -> tuple[dict[str, Any], dict[summary.Key, np.ndarray]]:
  """The seed's ``kv_groups`` result and its bootstrap statistics (keys
  ``("kv_groups", curve, statistic)``, for
  :func:`mha.pruning.study.summary.aggregate_statistics`).

  ``ablations``: the study's ``--ablation`` built for ``validation`` and
  ``test``; used where it is ``streaming`` (:func:`streams`), else removed
  groups output zero. ``head_orders``: the head level's orders; under
  streaming those of the KV-cache scores (:data:`KV_SCORES`) are also
  ordered by group (:func:`mha.pruning.kv_groups.induced_order`: a group
  streams once all its query heads do), under the same names.
  """
  start = time.perf_counter()
  config = model.config
  units = kv_groups.num_groups(config)
  streaming = streams(options)
  if streaming and ablations is None:
    raise ValueError(f"--ablation={options.ablation}: the groups' streaming "
                     "ablation must be given (ablations)")
  abl = ablations if streaming else {"validation": None, "test": None}
  masks = kv_groups.head_mask(config, kv_groups.subset_masks(config))
  sums = {name: core.evaluate_masks(model, params, splits[name], masks,
                                    batch_size=options.batch_size,
                                    per_example=True, ablation=abl[name])
          for name in ("validation", "test")}
  val = core.summarize_examples(sums["validation"])
  test = core.summarize_examples(sums["test"])
  kept = kv_groups.kept_counts(config)
  full = 2 ** units - 1
  gradients = kv_groups.group_gradients(model, params, splits["validation"],
                                        batch_size=options.batch_size,
                                        ablation=abl["validation"])
  importance = kv_groups.group_importance(gradients)
  alone = np.array([full & ~(1 << u) for u in range(units)])
  importance["leave_one_out"] = val["loss"][alone] - val["loss"][full]
  orders = {name: kv_groups.order_from_importance(importance[name])
            for name in ORDERINGS}
  if streaming:  # The published KV scores, a group by its heads.
    orders.update({name: kv_groups.induced_order(config, head_orders[name])
                   for name in KV_SCORES if name in (head_orders or {})})
  rng = np.random.default_rng(RANDOM_SEED)
  random = [rng.permutation(units) for _ in range(options.num_random_orders)]
  candidates = oracle.ORACLE_CANDIDATES
  curves = {name: kv_groups.chain_subsets(config, order)[None]
            for name, order in orders.items()}
  curves["random"] = np.stack([kv_groups.chain_subsets(config, o)
                               for o in random])
  curves["oracle"] = _best(val["token_accuracy"], kept, candidates)
  curves["oracle_by_loss"] = _best(val["loss"], kept, candidates,
                                   lower_is_better=True)
  counts = np.arange(units + 1)
  statistics = summary.seed_statistics(
      {VARIANT: curves}, {VARIANT: counts}, units, sums["validation"],
      sums["test"], val_weights, test_weights, options.tolerance,
      select={"oracle": "token_accuracy", "oracle_by_loss": "loss"},
      loss_tolerance_bits=options.loss_tolerance_bits)
  nested = summary.seed_summary(statistics)[VARIANT]
  result = {
      "num_groups": units,
      "groups_per_layer": list(kv_groups.groups_per_layer(config)),
      "heads_per_group": [h // config.num_kv_heads if h else 0
                          for h in config.heads_per_layer],
      "counts": counts, "fractions": counts / units,
      "importance": {k: v.tolist() for k, v in importance.items()},
      "orders": {k: v.tolist() for k, v in orders.items()},
      **nested,
      "oracle": _entries(config, curves["oracle"][0], val, test),
      "oracle_by_loss": _entries(config, curves["oracle_by_loss"][0], val,
                                 test),
      "ablation": options.ablation if streaming else "zero",
      "seconds": time.perf_counter() - start,
  }
  if streaming:  # The share of the KV cache kept, groups as the units.
    _, sinks, window = ablation_lib.parse(options.ablation)
    memory = ablation_lib.kv_memory(units - counts, units,
                                    splits["test"].inputs.shape[1], sinks,
                                    window)
    result["kv_memory"] = memory
    for curve in result.get("curves", {}).values():
      curve["kv_memory"] = memory
  log(f"  KV groups: {units} groups, {len(masks)} subsets on validation and "
      f"test: {result['seconds']:.2f} s")
  return result, statistics


__all__ = ["VARIANT", "ORDERINGS", "applies", "streams", "analyze"]
