"""Head importance, pruning curves and physical head pruning.

Which heads of a trained :class:`mha.model.Transformer` matter, and can the
others go to make prediction faster? (d2l, Multi-Head Attention, exercise 2.)

Conventions: head masks, flat head indices and orders are those of
:mod:`mha.head_masks` (re-exported by :mod:`mha.pruning`); importance arrays are ``[L, H]``,
NaN where a head does not exist.

The core (:func:`per_example_loss`, :func:`head_mask_gradients`,
:func:`masked_metric_sums`, :func:`attention_statistics`) is pure: arrays in,
arrays out, through ``jit``, ``grad`` and ``vmap`` -- over head masks (every
leave-one-out mask in one call) and over stacked parameters (several seeds in
one call). The drivers below it loop over the batches of a
:class:`mha.data.Split` on the host and return NumPy arrays.

    ckpt = mha.load_checkpoint("runs/reverse")
    imp = gradient_importance(ckpt.model, ckpt.params, splits["validation"])
    params, config = prune_heads(ckpt.params, ckpt.model_config,
                                 [(0, 1), (1, 3)])
    logits, _ = Transformer(config).apply({"params": params}, tokens)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import evaluate as eval_lib
from mha.aliases import Array, HeadSpec, Params
from mha.evaluate import example_metric_sums  # Re-exported: per example.
from mha.head_masks import (all_but_one_masks, existing_heads, full_head_mask,
                            leave_one_out_masks,
                            masked_logits)  # noqa: F401  (re-exported)
from mha.model import Transformer, TransformerConfig
from mha.pruning import ablation as ablation_lib
from mha.pruning.ablation import Ablation, ablated_logits, batches
from mha.run import arguments



def pruning_counts(num_heads: int, step_fraction: float = 0.0) -> np.ndarray:
  """Numbers of heads removed at the points of a pruning curve.

  ``step_fraction=0`` removes one head at a time (``0, 1, ..., N``);
  otherwise the points are the rounded multiples of ``step_fraction`` of
  ``N`` (Michel et al. use 0.1), always including 0 and ``N``.
  """
  arguments.check_count("num_heads", num_heads, 0)
  if not 0.0 <= step_fraction <= 1.0:
    raise ValueError(f"step_fraction must be in [0, 1], got {step_fraction}.")
  if step_fraction == 0.0:
    return np.arange(num_heads + 1)
  fractions = np.append(np.arange(0.0, 1.0, step_fraction), 1.0)
  return np.unique(np.round(fractions * num_heads).astype(np.int64))


# --------------------------------------------------------------------------
# The pure core.
# --------------------------------------------------------------------------


def per_example_loss(model: Transformer, params: Params, inputs: Array,
                     targets: Array, head_mask: Array,
                     ablation: Ablation | None = None) -> Array:
  """Mean token cross-entropy of each example ``[B]`` (0 for empty rows);
  removed heads replaced as ``ablation`` (aligned with ``inputs``) says,
  zero when None."""
  sums = eval_lib.example_metric_sums(
      ablated_logits(model, params, inputs, head_mask, ablation), targets,
      inputs)
  return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1)


def head_mask_gradients(model: Transformer, params: Params, inputs: Array,
                        targets: Array, head_mask: Array,
                        ablation: Ablation | None = None) -> Array:
  """Per-example gradients of the loss with respect to the head mask.

  ``vmap`` of ``grad`` over the examples, so that importance is the mean of
  per-example absolute values (Michel et al.), not the absolute value of the
  batch-mean gradient (which lets opposite signs cancel).

  Returns:
    ``[B, L, H]``.
  """

  def one(x, y, a):
    if a is not None and a.donors is not None:
      a = a.replace(donors=a.donors[None])
    loss = lambda m: per_example_loss(model, params, x[None], y[None], m,
                                      a)[0]
    return jax.grad(loss)(head_mask)

  # Resample's donors are per example; other ablations are shared.
  axes = (None if ablation is None or ablation.donors is None else
          ablation.replace(shifts=None, donors=0))
  return jax.vmap(one, in_axes=(0, 0, axes))(inputs, targets, ablation)


def masked_metric_sums(model: Transformer, params: Params, inputs: Array,
                       targets: Array, head_mask: Array,
                       ablation: Ablation | None = None) -> dict[str, Array]:
  """:func:`mha.evaluate.metric_sums` of the model under ``head_mask``
  (and ``ablation``, aligned with ``inputs``)."""
  logits = ablated_logits(model, params, inputs, head_mask, ablation)
  return eval_lib.metric_sums(logits, targets, inputs)


def masked_example_sums(model: Transformer, params: Params, inputs: Array,
                        targets: Array, head_mask: Array,
                        ablation: Ablation | None = None
                        ) -> dict[str, Array]:
  """:func:`mha.evaluate.example_metric_sums` of the model under
  ``head_mask`` (and ``ablation``, aligned with ``inputs``)."""
  logits = ablated_logits(model, params, inputs, head_mask, ablation)
  return eval_lib.example_metric_sums(logits, targets, inputs)


def attention_statistics(model: Transformer, params: Params,
                         inputs: Array) -> dict[str, Array]:
  """Sums over non-padding queries of each head's max weight and entropy.

  Voita et al.'s "confidence" is the mean max weight; a head that always
  attends to one position has confidence 1 and entropy 0.

  Returns:
    ``max_weight`` and ``entropy`` sums ``[L, H]`` (0 for heads that do not
    exist) and ``queries``, the number of non-padding queries.
  """
  config = model.config
  _, attention = model.apply({"params": params}, inputs, return_weights=True)
  queries = (inputs != 0).astype(jnp.float32)  # [B, T]
  max_sums, entropy_sums = [], []
  for weights in attention:  # [B, H_l, T, T]
    w = weights.astype(jnp.float32)
    top = jnp.max(w, axis=-1)
    entropy = -jnp.sum(jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)),
                                 0.0), axis=-1)
    pad = config.max_heads - w.shape[1]
    q = queries[:, None, :]
    max_sums.append(jnp.pad(jnp.sum(top * q, axis=(0, 2)), (0, pad)))
    entropy_sums.append(jnp.pad(jnp.sum(entropy * q, axis=(0, 2)), (0, pad)))
  return {"max_weight": jnp.stack(max_sums),
          "entropy": jnp.stack(entropy_sums),
          "queries": jnp.sum(queries)}


# --------------------------------------------------------------------------
# Jitted batch functions (the model is static: a hashable flax Module).
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="model")
def _abs_gradients(model, params, inputs, targets, head_mask, ablation=None):
  return jnp.abs(head_mask_gradients(model, params, inputs, targets,
                                     head_mask, ablation))


@functools.partial(jax.jit, static_argnames=("model", "per_example"))
def _metric_sums_per_mask(model, params, inputs, targets, masks,
                          per_example=False, ablation=None):
  fn = masked_example_sums if per_example else masked_metric_sums
  if ablation is not None:  # resample's donors once, not once per mask
    ablation = ablation.resolved(model, params)
  return jax.vmap(lambda m: fn(model, params, inputs, targets, m,
                               ablation))(masks)


_metric_sums_one_mask = jax.jit(masked_metric_sums, static_argnames="model")
_attention_statistics = jax.jit(attention_statistics, static_argnames="model")




# --------------------------------------------------------------------------
# Importance measures over a split.
# --------------------------------------------------------------------------


def normalize_per_layer(importance: np.ndarray) -> np.ndarray:
  """Divides each layer's importances by their L2 norm (Michel et al.).
  NumPy on the host (NaN-aware): not for ``jit``."""
  norm = np.sqrt(np.nansum(np.square(importance), axis=-1, keepdims=True))
  return importance / np.where(norm > 0, norm, 1.0)


def gradient_importance(model: Transformer, params: Params, split: data.Split,
                        *, head_mask: np.ndarray | None = None,
                        batch_size: int = 1000,
                        normalize: bool = False,
                        ablation: Ablation | None = None,
                        per_example: bool = False) -> np.ndarray:
  """Michel et al.'s importance ``I_h = E_x |dL(x)/d xi_h|`` at ``head_mask``.

  Args:
    model, params: the model.
    split: the examples (use validation; measure accuracy on test).
    head_mask: where the gradient is taken; defaults to every head kept.
    batch_size: examples per jitted call.
    normalize: divide each layer by its L2 norm.
    ablation: what a removed head outputs (:mod:`mha.pruning.ablation`,
      built for ``split``); zero when None.
    per_example: return each example's ``|dL(x)/d xi_h|`` instead of their
      mean (whose weighted means give the importance under any resample of
      the examples).

  Returns:
    ``[L, H]`` (``[n, L, H]`` with ``per_example``), NaN where a head does
    not exist.

  Raises:
    ValueError: ``per_example`` and ``normalize`` together (a per-example
      value has no layer norm to divide by that its mean would keep).
  """
  arguments.check_count("batch_size", batch_size)
  config = model.config
  mask = jnp.asarray(full_head_mask(config) if head_mask is None else head_mask)
  if per_example and normalize:
    raise ValueError("normalize applies to the mean over examples, not to "
                     "per_example values")
  # Per-example values, summed on the host in float64 (padding rows, which
  # count nothing, cut off): one compiled program for both uses.
  rows = [np.asarray(_abs_gradients(model, params, inputs, targets, mask,
                                    abl), np.float64)
          for inputs, targets, abl in ablation_lib.batched(
              split, batch_size, ablation)]
  values = (np.concatenate(rows)[:len(split)] if rows
            else np.zeros((0,) + mask.shape))
  if per_example:
    return np.where(existing_heads(config), values, np.nan)
  importance = values.sum(axis=0) / max(len(split), 1)
  importance = np.where(existing_heads(config), importance, np.nan)
  return normalize_per_layer(importance) if normalize else importance


def evaluate_masks(model: Transformer, params: Params, split: data.Split,
                   masks: np.ndarray, *, batch_size: int = 1000,
                   chunk_size: int = 8,
                   per_example: bool = False,
                   ablation: Ablation | None = None
                   ) -> dict[str, np.ndarray]:
  """Loss, token accuracy and exact match under each of ``masks``, removed
  heads replaced as ``ablation`` (:mod:`mha.pruning.ablation`, built for
  ``split``) says, zero when None.

  The masks are split into even chunks of at most ``chunk_size``; each chunk
  is one vmapped, jitted call per batch of ``batch_size / chunk`` examples
  (the last chunk is padded, so one compilation serves every chunk). On
  CPU the work is memory-bound: a call's speed per mask depends on whether
  its activations (masks x examples rows) stay in cache, so ``batch_size``
  bounds the rows of a call rather than the examples.

  Returns:
    ``loss``, ``token_accuracy``, ``exact_match``: arrays ``[N]``. With
    ``per_example``: the :func:`example_metric_sums` of every example,
    ``[N, n]`` each (their sums over examples give the metrics through
    :func:`mha.evaluate.summarize`).
  """
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("chunk_size", chunk_size)
  masks = np.asarray(masks, np.float32)
  n = len(masks)
  if n == 0:  # No masks (an empty selection, say): empty results.
    if per_example:
      return {key: np.zeros((0, len(split)), np.float32)
              for key in eval_lib.SUM_KEYS}
    return eval_lib.summarize({key: np.zeros(0) for key in eval_lib.SUM_KEYS})
  chunk = -(-n // -(-n // max(chunk_size, 1)))  # even chunks, least padding
  totals: dict[str, list[np.ndarray]] = {}
  for start in range(0, n, chunk):
    part = masks[start:start + chunk]
    padded = np.concatenate([part, np.repeat(part[-1:], chunk - len(part), 0)])
    padded = jnp.asarray(padded)
    pieces: dict[str, list[np.ndarray]] = {}
    for inputs, targets, abl in ablation_lib.batched(
        split, -(-batch_size // chunk), ablation):
      out = jax.device_get(_metric_sums_per_mask(
          model, params, inputs, targets, padded, per_example, abl))
      for key, value in out.items():
        pieces.setdefault(key, []).append(np.asarray(value))
    for key, value in pieces.items():
      if per_example:  # [chunk, B] per batch -> [chunk, n]
        joined = np.concatenate(value, axis=-1)[:, :len(split)]
      else:
        joined = np.sum(np.stack(value), axis=0, dtype=np.float64)
      totals.setdefault(key, []).append(joined[:len(part)])
  stacked = {k: np.concatenate(v) for k, v in totals.items()}
  return stacked if per_example else eval_lib.summarize(stacked)


def summarize_examples(sums: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Metrics ``[...]`` from per-example sums ``[..., n]`` (all examples)."""
  return eval_lib.summarize({k: np.sum(np.asarray(v, np.float64), axis=-1)
                             for k, v in sums.items()})


def evaluate_masks_loop(model: Transformer, params: Params, split: data.Split,
                        masks: np.ndarray, *,
                        batch_size: int = 1000) -> dict[str, np.ndarray]:
  """:func:`evaluate_masks` as a Python loop over the masks (one jitted call
  per mask and batch): the baseline the vmapped version is timed against."""
  arguments.check_count("batch_size", batch_size)
  totals: dict[str, list[float]] = {}
  for mask in np.asarray(masks, np.float32):
    sums: dict[str, float] = {}
    mask = jnp.asarray(mask)
    for inputs, targets in batches(split, batch_size):
      out = jax.device_get(
          _metric_sums_one_mask(model, params, inputs, targets, mask))
      for key, value in out.items():
        sums[key] = sums.get(key, 0.0) + float(value)
    for key, value in sums.items():
      totals.setdefault(key, []).append(value)
  return eval_lib.summarize({k: np.asarray(v) for k, v in totals.items()})


def heads_to_array(config: TransformerConfig, values: np.ndarray) -> np.ndarray:
  """Puts one value per existing head into an ``[L, H]`` array (NaN
  elsewhere). NumPy on the host: not for ``jit``."""
  exists = existing_heads(config)
  out = np.full(exists.shape, np.nan)
  out[exists] = values
  return out


def leave_one_out(model: Transformer, params: Params, split: data.Split, *,
                  batch_size: int = 1000,
                  ablation: Ablation | None = None) -> dict[str, Any]:
  """Metrics with each head removed alone (replaced as ``ablation`` says,
  zero when None), all masks in vmapped calls.

  Returns:
    ``base``: the unpruned metrics; ``loss``, ``token_accuracy``,
    ``exact_match``: ``[L, H]`` metrics with that head removed (NaN where no
    head); ``loss_increase``: ``loss - base loss`` (the importance).
  """
  arguments.check_count("batch_size", batch_size)
  config = model.config
  metrics = evaluate_masks(model, params, split,
                           leave_one_out_masks_with_full(config),
                           batch_size=batch_size, ablation=ablation)
  return leave_one_out_from_metrics(config, metrics)


def leave_one_out_masks_with_full(config: TransformerConfig) -> np.ndarray:
  """The full mask, then :func:`leave_one_out_masks`: ``[1 + N, L, H]``."""
  return np.concatenate([full_head_mask(config)[None],
                         leave_one_out_masks(config)])


def leave_one_out_from_metrics(config: TransformerConfig,
                               metrics: Mapping[str, np.ndarray]
                               ) -> dict[str, Any]:
  """:func:`leave_one_out`'s result from the ``[1 + N]`` metrics of
  :func:`leave_one_out_masks_with_full` (however they were evaluated)."""
  base = {k: float(v[0]) for k, v in metrics.items()}
  out: dict[str, Any] = {"base": base}
  for key, values in metrics.items():
    out[key] = heads_to_array(config, values[1:])
  out["loss_increase"] = out["loss"] - base["loss"]
  return out


def all_but_one(model: Transformer, params: Params, split: data.Split, *,
                batch_size: int = 1000) -> dict[str, np.ndarray]:
  """Metrics ``[L, H]`` when a layer keeps only that head (others intact)."""
  arguments.check_count("batch_size", batch_size)
  config = model.config
  metrics = evaluate_masks(model, params, split, all_but_one_masks(config),
                           batch_size=batch_size)
  return {key: heads_to_array(config, values) for key, values in metrics.items()}


def attention_confidence(model: Transformer, params: Params,
                         split: data.Split, *,
                         batch_size: int = 1000) -> dict[str, np.ndarray]:
  """Voita et al.'s confidence (mean max weight) and the mean entropy of
  every head over the non-padding queries of ``split``.

  Returns:
    ``confidence`` and ``entropy``, ``[L, H]`` (NaN where no head).
  """
  arguments.check_count("batch_size", batch_size)
  config = model.config
  sums = {"max_weight": 0.0, "entropy": 0.0, "queries": 0.0}
  for inputs, _ in batches(split, batch_size):
    out = jax.device_get(_attention_statistics(model, params, inputs))
    for key in sums:
      sums[key] = sums[key] + np.asarray(out[key], np.float64)
  queries = max(float(sums["queries"]), 1.0)
  exists = existing_heads(config)
  return {
      "confidence": np.where(exists, sums["max_weight"] / queries, np.nan),
      "entropy": np.where(exists, sums["entropy"] / queries, np.nan),
  }


# --------------------------------------------------------------------------
# Orders and curves.
# --------------------------------------------------------------------------


def order_from_importance(importance: np.ndarray) -> np.ndarray:
  """Flat indices of the existing (non-NaN) heads, least important first
  (ties broken by index, so the order is deterministic). NumPy on the host,
  in float64: not for ``jit``."""
  flat = np.asarray(importance, np.float64).reshape(-1)
  heads = np.flatnonzero(~np.isnan(flat))
  return heads[np.argsort(flat[heads], kind="stable")]


def keep_one_per_layer(config: TransformerConfig,
                       order: Sequence[int]) -> np.ndarray:
  """``order`` without the head that would empty its layer: walking the
  order, a layer's last remaining head is skipped (and never removed)."""
  remaining = np.asarray(config.heads_per_layer, np.int64).copy()
  kept = []
  for head in np.asarray(order, np.int64):
    layer = int(head) // config.max_heads
    if remaining[layer] > 1:
      remaining[layer] -= 1
      kept.append(int(head))
  return np.asarray(kept, np.int64)


def removable_keeping_layers(config: TransformerConfig) -> int:
  """How many heads can go with one head left in every layer that has
  heads."""
  counts = np.asarray(config.heads_per_layer)
  return int(np.sum(np.maximum(counts - 1, 0)))


def iterative_gradient_order(model: Transformer, params: Params,
                             split: data.Split, *, batch_size: int = 1000,
                             normalize: bool = False) -> np.ndarray:
  """Removes heads one at a time, re-estimating gradient importance under
  the current mask after each removal (Michel et al.'s iterative variant)."""
  arguments.check_count("batch_size", batch_size)
  config = model.config
  mask = full_head_mask(config)
  order: list[int] = []
  for _ in range(int(existing_heads(config).sum())):
    importance = gradient_importance(model, params, split, head_mask=mask,
                                     batch_size=batch_size,
                                     normalize=normalize).reshape(-1)
    importance[np.asarray(order, np.int64)] = np.nan
    alive = np.flatnonzero(~np.isnan(importance))
    head = int(alive[np.argmin(importance[alive])])
    order.append(head)
    mask.reshape(-1)[head] = 0.0
  return np.asarray(order, np.int64)


def random_orders(config: TransformerConfig, num_orders: int,
                  rng: np.random.Generator) -> np.ndarray:
  """``[num_orders, N]`` uniformly random orders of the existing heads."""
  arguments.check_count("num_orders", num_orders, 0)
  heads = np.flatnonzero(existing_heads(config))
  return np.stack([rng.permutation(heads) for _ in range(num_orders)])


def curve_auc(fractions: np.ndarray, values: np.ndarray) -> float:
  """Area under a pruning curve, normalised by the fraction range (so an
  accuracy curve's AUC is in [0, 1])."""
  fractions = np.asarray(fractions, np.float64)
  width = fractions[-1] - fractions[0]
  if width <= 0:
    return float(values[0])
  return float(np.trapezoid(values, fractions) / width)


def max_prunable_fraction(fractions: np.ndarray, values: np.ndarray,
                          tolerance: float = 0.01) -> float:
  """The largest fraction up to which every point of the curve stays within
  ``tolerance`` of the unpruned value (``values[0]``)."""
  ok = np.asarray(values) >= values[0] - tolerance - 1e-12
  bad = np.flatnonzero(~ok)
  last = (bad[0] - 1) if len(bad) else len(ok) - 1
  return float(np.asarray(fractions)[last])


# --------------------------------------------------------------------------
# Physical pruning.
# --------------------------------------------------------------------------


def _heads_by_layer(config: TransformerConfig,
                    heads: HeadSpec) -> dict[int, set[int]]:
  if isinstance(heads, Mapping):
    pairs = [(layer, h) for layer, hs in heads.items() for h in hs]
  else:
    pairs = list(heads)
  counts = config.heads_per_layer
  by_layer: dict[int, set[int]] = {}
  for pair in pairs:
    try:
      layer, head = (int(v) for v in pair)
    except (TypeError, ValueError):
      raise ValueError(
          f"heads must be (layer, head) pairs, got {pair!r}.") from None
    if not (0 <= layer < len(counts) and 0 <= head < counts[layer]):
      raise ValueError(
          f"head ({layer}, {head}) does not exist: the model has "
          f"{len(counts)} layers with head counts {counts}.")
    by_layer.setdefault(layer, set()).add(head)
  return by_layer


#: The head axis of each attention parameter: ``[D, H, Dh]`` kernels and
#: ``[H, Dh]`` biases of query, key and value, the ``[H, Dh, D]`` out
#: kernel; the out bias has none.
HEAD_AXES = {("query", "kernel"): 1, ("key", "kernel"): 1,
             ("value", "kernel"): 1, ("query", "bias"): 0,
             ("key", "bias"): 0, ("value", "bias"): 0, ("out", "kernel"): 0}


def prune_heads(params: Params, config: TransformerConfig,
                heads: HeadSpec) -> tuple[Params, TransformerConfig]:
  """Physically removes attention heads.

  Slices the removed heads out of each layer's query/key/value kernels
  ``[D, H, Dh]`` and biases ``[H, Dh]`` and out kernel ``[H, Dh, D]``; the
  out bias stays. A layer that loses every head keeps only its out bias (see
  :class:`mha.attention.MultiHeadAttention` with ``num_heads=0``). The pruned
  model's outputs equal the masked model's.

  Pure in ``params`` (``jnp.take`` with static indices), so it also runs
  under ``jit`` and ``vmap`` over stacked parameters.

  Args:
    params: the model parameters (the ``"params"`` collection).
    config: the model's config.
    heads: ``(layer, head)`` pairs or ``{layer: heads}``, indices into the
      heads ``config`` has now (a pruned model's heads are renumbered
      ``0..H_l-1`` in their original order).

  Returns:
    ``(params, config)``: new parameters and a config with per-layer head
    counts and an explicit ``head_dim``.

  Raises:
    ValueError: a head that does not exist.
  """
  removed = _heads_by_layer(config, heads)
  new_params = dict(params)
  counts = list(config.heads_per_layer)
  for layer, drop in removed.items():
    keep = np.asarray([h for h in range(counts[layer]) if h not in drop],
                      np.int64)
    name = f"layer_{layer}"
    block = dict(new_params[name])
    attention = block["attention"]
    if len(keep) == 0:
      pruned = {"out": {"bias": attention["out"]["bias"]}}
    else:
      def take(proj, leaf, x):
        axis = HEAD_AXES.get((proj, leaf))
        return x if axis is None else jnp.take(x, keep, axis=axis)
      pruned = {proj: {leaf: take(proj, leaf, x)
                       for leaf, x in attention[proj].items()}
                for proj in ("query", "key", "value", "out")}
    block["attention"] = pruned
    new_params[name] = block
    counts[layer] = len(keep)
  new_config = dataclasses.replace(config, num_heads=tuple(counts),
                                   head_dim=config.resolved_head_dim)
  return new_params, new_config


def count_params(params: Params) -> int:
  """Number of scalars in a parameter tree."""
  return int(sum(np.size(p) for p in jax.tree.leaves(params)))


__all__ = [
    "HeadSpec",
    "HEAD_AXES",
    "pruning_counts",
    "per_example_loss",
    "head_mask_gradients",
    "masked_metric_sums",
    "example_metric_sums", "leave_one_out_masks_with_full",
    "leave_one_out_from_metrics",
    "masked_example_sums",
    "batches",
    "summarize_examples",
    "attention_statistics",
    "normalize_per_layer",
    "gradient_importance",
    "evaluate_masks",
    "evaluate_masks_loop",
    "heads_to_array",
    "leave_one_out",
    "all_but_one",
    "attention_confidence",
    "order_from_importance",
    "iterative_gradient_order",
    "keep_one_per_layer",
    "removable_keeping_layers",
    "random_orders",
    "curve_auc",
    "max_prunable_fraction",
    "prune_heads",
    "count_params",
]
