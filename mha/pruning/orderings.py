"""Orderings of the heads, least important first, from importance measures.

Each ordering is a 1-D array of flat head indices (``layer * H + head``,
:mod:`mha.head_masks`), the head to remove first at index 0. The measures
are taken on one split (the study uses validation): gradient importance
(Michel et al., per-example ``|dL/d xi|``, raw and L2-normalised per layer,
and re-estimated after each removal), Fisher importance (Kwon et al.,
per-example ``(dL/d xi)^2``, :mod:`mha.pruning.kwon`), attribution
patching (the first-order estimate of each head's removal under a zero, a
mean-per-position and a resample baseline, :mod:`mha.pruning.ablation`),
leave-one-out loss increase, attention
confidence and entropy (Voita et al.), exact Shapley values (with every
subset evaluated, :mod:`mha.pruning.oracle`), and the reverse gradient order
as a sanity baseline. Random orders come from
:func:`mha.pruning.core.random_orders`.

    orders = compute_orders(model, params, splits["validation"],
                            batch_size=1000, oracle_max_heads=16)
    orders["gradient"]  # e.g. array([5, 2, 0, ...])
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

from mha import data
from mha import evaluate as eval_lib
from mha.aliases import Log, Params
from mha.model import Transformer
from mha.run.progress import quiet, timed
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.pruning import kv_scorers
from mha.pruning import kwon
from mha.pruning import oracle
from mha.pruning.constants import KV_SCORES, ORDERINGS
from mha.run import arguments

# ORDERINGS (mha.pruning.constants): key -> label of each ordering.


def halves(split: data.Split) -> tuple[data.Split, data.Split]:
  """The first and second half of ``split`` (the odd example goes last)."""
  n = len(split) // 2
  first = data.Split(split.inputs[:n], split.targets[:n])
  second = data.Split(split.inputs[n:], split.targets[n:])
  return first, second


def _leave_one_out(model: Transformer, params: Params, validation: data.Split,
                   batch_size: int,
                   table: Mapping[str, np.ndarray] | None,
                   subsets: Mapping[str, np.ndarray] | None,
                   ablation: ablation_lib.Ablation | None = None
                   ) -> dict[str, Any]:
  """:func:`core.leave_one_out`, looked up in the metrics of every subset
  (``subsets``) or in the per-example subset ``table`` when there is one."""
  config = model.config
  ids = oracle.subset_index(config, core.leave_one_out_masks_with_full(config))
  if subsets is not None:
    return core.leave_one_out_from_metrics(
        config, {k: np.asarray(v)[ids] for k, v in subsets.items()})
  if table is None:
    return core.leave_one_out(model, params, validation,
                              batch_size=batch_size, ablation=ablation)
  return core.leave_one_out_from_metrics(config, core.summarize_examples(
      {k: np.asarray(v)[ids] for k, v in table.items()}))


def measure_importance(model: Transformer, params: Params,
                       validation: data.Split, *, batch_size: int,
                       log: Log = quiet,
                       timings: dict[str, float] | None = None,
                       table: Mapping[str, np.ndarray] | None = None,
                       subsets: Mapping[str, np.ndarray] | None = None,
                       ablation: ablation_lib.Ablation | None = None,
                       baselines: Mapping[str, ablation_lib.Ablation]
                       | None = None) -> dict[str, Any]:
  """Every per-head measure on ``validation``: ``[L, H]`` arrays (NaN where
  no head), and ``validation``, the unpruned metrics. ``subsets``: the
  metrics of every subset on ``validation`` (``[2**N]`` each, from the
  streamed oracle), or ``table``, their per-example sums, when evaluated.
  ``fisher_blocks`` (``[L, H, H]``, :func:`mha.pruning.kwon.fisher_blocks`)
  is the Fisher information ``fisher`` is the diagonal of. ``timings``
  receives the seconds of each measure. ``ablation`` (built for
  ``validation``): what a removed head outputs in leave-one-out (and in
  ``subsets``/``table``); the mask-gradient measures (gradient, Fisher) are
  taken at zero ablation, except under ``streaming``, where they are taken
  under it (a mask value mixes a head's full and windowed outputs). ``baselines``: the ablations of attribution
  patching, ``attribution_<name>`` (default
  :func:`attribution_baselines`). ``gradient_per_example`` ``[n, L, H]``
  holds each example's ``|dL/d xi|``, whose mean is ``gradient``."""
  arguments.check_count("batch_size", batch_size)
  timings = {} if timings is None else timings
  half_a, half_b = halves(validation)

  # Under streaming a mask value mixes a head's full and windowed outputs
  # (DuoAttention's gate): its gradient is the measure's natural meaning.
  # Other modes keep the published measures, at zero ablation.
  at = ablation if ablation is not None and ablation.streaming else None

  def gradients():  # Per example: the halves' means and the whole's.
    per = core.gradient_importance(model, params, validation,
                                   batch_size=batch_size, per_example=True,
                                   ablation=at)
    mean = lambda rows: rows.sum(axis=0) / max(len(rows), 1)
    return (mean(per[:len(half_a)]), mean(per[len(half_a):]), mean(per),
            per)

  (grad_a, grad_b, grad, per_example), timings["gradient_s"] = timed(
      log, "gradient importance (vmap of grad, per-example |.|), two halves",
      gradients)
  loo, timings["leave_one_out_s"] = timed(
      log, "leave-one-out" + (
          " (from the subsets)" if table is not None or subsets is not None
          else " (every head's mask, vmapped)"),
      lambda: _leave_one_out(model, params, validation, batch_size, table,
                             subsets, ablation))
  if baselines is None:
    baselines = attribution_baselines(model, params, validation,
                                      batch_size=batch_size)
  attribution = {}
  if baselines:
    attribution, timings["attribution_s"] = timed(
        log, "attribution patching (" + ", ".join(baselines) + "): a "
        "forward and a backward pass each",
        lambda: {f"attribution_{name}": ablation_lib.attribution(
            model, params, validation, abl, batch_size=batch_size)
                 for name, abl in baselines.items()})
  blocks, timings["fisher_s"] = timed(
      log, "Fisher information of the head mask (per-example gradients "
      "squared, block-diagonal by layer)",
      lambda: kwon.fisher_blocks(model, params, validation,
                                 batch_size=batch_size, ablation=at))
  attn, timings["confidence_s"] = timed(
      log, "attention confidence and entropy",
      lambda: core.attention_confidence(model, params, validation,
                                        batch_size=batch_size))
  kv = {}
  if model.config.causal:
    kv, timings["kv_scorers_s"] = timed(
        log, "KV-cache head scores (retrieval score, echo, induction, "
        "HeadKV, attention distance)",
        lambda: kv_scorers.measure(model, params, validation,
                                   batch_size=batch_size))
  return {
      "gradient": grad,
      "gradient_l2": core.normalize_per_layer(grad),
      "fisher": kwon.fisher_importance(blocks, model.config),
      "fisher_blocks": blocks,
      "leave_one_out": loo["loss_increase"],
      **attribution,
      "confidence": attn["confidence"],
      "entropy": attn["entropy"],
      **kv,
      "leave_one_out_token_accuracy_drop":
          loo["base"]["token_accuracy"] - loo["token_accuracy"],
      "gradient_validation_half_a": grad_a,
      "gradient_validation_half_b": grad_b,
      "gradient_per_example": per_example,
      "validation": loo["base"],
  }


#: Attribution patching's baselines: ordering ``attribution_<name>`` ->
#: the ablation mode it patches in (:mod:`mha.pruning.ablation`).
ATTRIBUTION_BASELINES = {"zero": "zero", "mean": "mean_position",
                         "resample": "resample"}


def attribution_baselines(model: Transformer, params: Params,
                          split: data.Split, *, batch_size: int = 1000,
                          seed: int = 0
                          ) -> dict[str, ablation_lib.Ablation]:
  """The ablation of each of :data:`ATTRIBUTION_BASELINES` on ``split``
  (means per position measured on it; resample's donors drawn with
  ``seed``)."""
  arguments.check_count("batch_size", batch_size)
  means = ablation_lib.position_means(model, params, split,
                                      batch_size=batch_size)
  return {name: ablation_lib.build(
      model, params, mode, split, split, means=means,
      rng=np.random.default_rng([seed, 3]))
          for name, mode in ATTRIBUTION_BASELINES.items()}


def orders_from_importance(importance: Mapping[str, np.ndarray]
                           ) -> dict[str, np.ndarray]:
  """The order (least important first) of every measure in ``importance``
  and the reverse gradient order."""
  orders = {
      "gradient": core.order_from_importance(importance["gradient"]),
      "gradient_l2": core.order_from_importance(importance["gradient_l2"]),
      "fisher": core.order_from_importance(importance["fisher"]),
      "leave_one_out": core.order_from_importance(
          importance["leave_one_out"]),
      "confidence": core.order_from_importance(importance["confidence"]),
      # Low entropy = focused = important: remove the most diffuse first.
      "entropy": core.order_from_importance(-importance["entropy"]),
  }
  for name in ATTRIBUTION_BASELINES:
    key = f"attribution_{name}"
    if key in importance:  # The estimated loss increase, least first.
      orders[key] = core.order_from_importance(importance[key])
  # The KV-cache scores (higher: needs its full cache more), where measured.
  for name in KV_SCORES:
    if name in importance:
      orders[name] = core.order_from_importance(importance[name])
  shapley = importance.get("shapley_token_accuracy")
  if shapley is not None and not np.all(np.isnan(shapley)):
    orders["shapley"] = core.order_from_importance(shapley)
  orders["reverse_gradient"] = orders["gradient"][::-1].copy()
  return orders


def compute_orders(model: Transformer, params: Params, validation: data.Split,
                   *, batch_size: int, oracle_max_heads: int,
                   reestimate: bool = True,
                   names: Collection[str] | None = None
                   ) -> dict[str, np.ndarray]:
  """The order (flat head indices, least important first) of every
  non-random ordering of :data:`ORDERINGS`, measured on ``validation``
  (``shapley`` only when the model has at most ``oracle_max_heads``
  heads; ``gradient_iterative`` only with ``reestimate``).

  ``names``: when given, the orderings wanted; the expensive ones (every
  subset for ``shapley``, the re-estimated gradient, attribution patching)
  are computed only when asked for. The cheap measures come back regardless.
  """
  arguments.check_count("batch_size", batch_size)
  wanted = lambda name: names is None or name in names
  subsets = None
  if wanted("shapley") and oracle.oracle_applies(model.config,
                                                 oracle_max_heads):
    subsets = eval_lib.summarize(oracle.subset_totals(
        model, params, validation, batch_size=batch_size))
  # Attribution patching only for the baselines asked for.
  baselines = None
  if names is not None:
    wanted_baselines = [n for n in ATTRIBUTION_BASELINES
                        if wanted(f"attribution_{n}")]
    baselines = {}
    if wanted_baselines:
      baselines = {n: b for n, b in attribution_baselines(
          model, params, validation, batch_size=batch_size).items()
                   if n in wanted_baselines}
  importance = measure_importance(model, params, validation,
                                  batch_size=batch_size, subsets=subsets,
                                  baselines=baselines)
  if subsets is not None:
    importance["shapley_token_accuracy"] = oracle.shapley_values(
        subsets["token_accuracy"], model.config)
  orders = orders_from_importance(importance)
  if reestimate and wanted("gradient_iterative"):
    orders["gradient_iterative"] = core.iterative_gradient_order(
        model, params, validation, batch_size=batch_size)
  return orders


__all__ = ["ORDERINGS", "ATTRIBUTION_BASELINES", "KV_SCORES", "attribution_baselines",
           "halves", "measure_importance",
           "orders_from_importance", "compute_orders"]
