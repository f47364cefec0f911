"""Retraining-free head pruning after Kwon et al. (2022), on validation.

Kwon et al. prune a trained Transformer without retraining, in three steps
that need only gradients and activations of the model on a sample of data.
For attention heads:

1. **Fisher mask search.** A head's importance is the diagonal of the
   empirical Fisher information of its mask variable at the full mask,
   ``F_hh = E_x[(dL(x)/dm_h)^2]`` over examples ``x`` (per-example
   gradients). Under a budget of ``k`` heads removed, the ``k`` heads of
   least Fisher importance go. (Kwon et al. search under a FLOP budget;
   every head here costs the same FLOPs, so a FLOP budget is a head count.)
2. **Mask rearrangement.** Each layer keeps the number of heads the search
   gave it; which of its heads is chosen to minimise the second-order
   estimate of the loss increase with the layer's block of the Fisher
   matrix, ``(1 - m_l)^T F_l (1 - m_l)`` (the block-diagonal
   approximation: heads interact within a layer, not across). Here
   exhaustively, layer by layer.
3. **Mask tuning.** The kept heads' mask values become real numbers, layer
   by layer from the bottom: a least-squares fit so that the layer's output
   before LayerNorm, residual included, on the pruned model's own input
   reproduces the unpruned model's on its input, over every valid position
   (:func:`tune_masks`, as their code does it: layer 0 not tuned, a value
   outside [-10, 10] rejected). Removed heads stay 0.
   :func:`tune_masks_attention_output` fits the attention output alone,
   from layer 0 up (this project's earlier variant).

Each step is a pure function of arrays (the search and
:func:`fisher_importance` in NumPy on the host, in float64), or a jitted
pass over a split:

    blocks = fisher_blocks(model, params, splits["validation"])  # [L, H, H]
    removed = search(blocks, model.config, k=3)     # flat indices, rearranged
    mask = tune_mask(model, params, splits["validation"],
                     head_masks.mask_without(model.config, removed))
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha.aliases import Array, Params
from mha.head_masks import existing_heads, full_head_mask
from mha.model import Transformer, TransformerConfig
from mha.model import attention_mask as model_mask
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.pruning import oracle
from mha.run import arguments

#: Largest number of ways to choose a layer's kept heads that rearrangement
#: tries exhaustively (C(16, 8) = 12,870); above it, pairwise swaps.
EXHAUSTIVE_LIMIT = 20_000


@functools.partial(jax.jit, static_argnames="model")
def _fisher_sums(model: Transformer, params: Params, inputs: Array,
                 targets: Array, head_mask: Array,
                 ablation: ablation_lib.Ablation | None = None) -> Array:
  """``[L, H, H]``: the sum over the batch of each layer's outer product of
  the per-example mask gradient (padding rows have zero gradient)."""
  grads = core.head_mask_gradients(model, params, inputs, targets, head_mask,
                                   ablation)
  return jnp.einsum("blh,blg->lhg", grads, grads)


def fisher_blocks(model: Transformer, params: Params, split: data.Split, *,
                  batch_size: int = 1000,
                  ablation: ablation_lib.Ablation | None = None
                  ) -> np.ndarray:
  """The empirical Fisher information of the head mask at the full mask,
  block-diagonal by layer: ``[L, H, H]``, ``E_x[g_l(x) g_l(x)^T]`` with
  ``g_l(x)`` the gradient of example ``x``'s mean token loss with respect to
  layer ``l``'s head mask (a mask value below 1 mixes in ``ablation``'s
  replacement, built for ``split``; default zero). Entries of heads that do
  not exist are 0."""
  arguments.check_count("batch_size", batch_size)
  config = model.config
  mask = jnp.asarray(full_head_mask(config))
  total = np.zeros((config.num_layers, config.max_heads, config.max_heads),
                   np.float64)
  for inputs, targets, abl in ablation_lib.batched(split, batch_size,
                                                   ablation):
    total += np.asarray(_fisher_sums(model, params, inputs, targets, mask,
                                     abl), np.float64)
  exists = existing_heads(config)
  total *= exists[:, :, None] & exists[:, None, :]
  return total / max(len(split), 1)


def fisher_importance(blocks: np.ndarray,
                      config: TransformerConfig) -> np.ndarray:
  """Each head's Fisher importance ``E_x[(dL/dm_h)^2]``, the diagonal of
  :func:`fisher_blocks`: ``[L, H]``, NaN where no head. NumPy on the
  host, in float64: not for ``jit``."""
  diagonal = np.diagonal(blocks, axis1=-2, axis2=-1).astype(np.float64)
  return np.where(existing_heads(config), diagonal, np.nan)


def _loss_increase(block: np.ndarray, removed: np.ndarray) -> float:
  """``r^T F r`` with ``r`` the 0/1 vector of ``removed`` heads of one
  layer (``(1 - m)`` of the layer's mask)."""
  r = np.zeros(block.shape[0])
  r[removed] = 1.0
  return float(r @ block @ r)


def _rearrange_layer(block: np.ndarray, count: int, remove: int,
                     start: Sequence[int]) -> list[int]:
  """Which ``remove`` of a layer's ``count`` heads to remove (indices within
  the layer), minimising :func:`_loss_increase`; ``start`` (the Fisher
  search's choice) wins ties, so rearrangement never makes the estimate
  worse."""
  start = sorted(start)
  if remove in (0, count):
    return start
  best, best_value = start, _loss_increase(block, np.asarray(start))
  options = itertools.combinations(range(count), remove)
  if math.comb(count, remove) > EXHAUSTIVE_LIMIT:
    options = _swaps(count, start)
  for option in options:
    value = _loss_increase(block, np.asarray(option))
    if value < best_value - 1e-15:
      best, best_value = list(option), value
  return sorted(best)


def _swaps(count: int, start: list[int]):
  """Every removal set one swap (a removed head for a kept one) away from
  ``start``: the neighbourhood tried when exhaustive search is too big."""
  kept = [h for h in range(count) if h not in start]
  for out in start:
    for into in kept:
      yield sorted([h for h in start if h != out] + [into])


def search(blocks: np.ndarray, config: TransformerConfig, k: int, *,
           rearrange: bool = True) -> list[int]:
  """The ``k`` heads to remove (flat indices, ascending): the least Fisher
  importance (:func:`fisher_importance`), then, with ``rearrange``, within
  each layer the removal set of the same size with the least block-Fisher
  loss estimate (:func:`_rearrange_layer`)."""
  arguments.check_count("k", k, 0)
  importance = fisher_importance(blocks, config)
  order = core.order_from_importance(importance)
  if not 0 <= k <= len(order):
    raise ValueError(f"k={k}: expected 0 <= k <= {len(order)} heads")
  removed = [int(i) for i in order[:k]]
  if not rearrange:
    return sorted(removed)
  width = config.max_heads
  out = []
  for layer, count in enumerate(config.heads_per_layer):
    mine = [i - layer * width for i in removed if i // width == layer]
    chosen = _rearrange_layer(blocks[layer, :count, :count], count,
                              len(mine), mine)
    out += [layer * width + h for h in chosen]
  return sorted(out)


def _layer_outputs(model: Transformer, params: Params, layer: int, x: Array,
                   attention_mask: Array) -> Array:
  """``[1 + H_l, B, T, D]``: layer ``layer``'s attention output with no head
  (its bias) and with each head alone."""
  count = model.config.heads_per_layer[layer]
  basis = jnp.concatenate([jnp.zeros((1, count)), jnp.eye(count)])
  return oracle.attention_outputs(model, params, layer, x, attention_mask,
                                  basis, None)


_layer_outputs_jit = jax.jit(_layer_outputs,
                             static_argnames=("model", "layer"))
_block_jit = jax.jit(oracle.run_block, static_argnames=("model", "layer"))


#: Kwon et al.'s bound on a tuned mask value: a layer whose least-squares
#: solution has a value outside ``[-LIMIT, LIMIT]`` is not tuned, and neither
#: is any layer above it (their ``rescale_mask`` stops there).
LIMIT = 10.0


@dataclasses.dataclass(frozen=True)
class Tuned:
  """Tuned masks and, per mask, the layer where tuning stopped.

  Attributes:
    masks: one float32 ``[L, H]`` mask per input mask, 0 where it was 0.
    rejected_layers: per mask, the first layer whose least-squares solution
      was rejected (a value outside ``[-limit, limit]`` or not finite; that
      layer and every layer above kept their untuned values), or None.
  """

  masks: list[np.ndarray]
  rejected_layers: list[int | None]


def fit_scales(heads: np.ndarray, target: np.ndarray, *,
               intercept: bool = False, prior: float = 0.0,
               ridge: float = 1e-6) -> np.ndarray:
  """Least-squares scales ``a`` ``[K]`` of ``heads`` ``[K, E]`` so that
  ``sum_k a_k heads_k (+ c)`` fits ``target`` ``[E]``. NumPy, float64.

  ``intercept``: a constant ``c`` fitted beside the scales and dropped (Kwon
  et al.'s design matrix has a column of ones). ``ridge`` (relative to the
  mean diagonal of the normal equations) pulls the scales towards
  ``prior`` (Kwon et al. damp towards 1; 0 is plain ridge) and keeps nearly
  collinear heads finite; at the default it changes nothing measurable.
  """
  design = np.asarray(heads, np.float64)
  target = np.asarray(target, np.float64)
  k = len(design)
  if intercept:
    design = np.concatenate([design, np.ones((1, design.shape[1]))])
  gram = design @ design.T
  damping = ridge * np.mean(np.diag(gram)) * np.eye(len(design))
  start = np.zeros(len(design))
  start[:k] = prior
  # (G + damping) (a - start) = A t - G start: damped towards ``start``.
  values = start + np.linalg.solve(gram + damping,
                                   design @ target - gram @ start)
  return values[:k]


def tune_mask(model: Transformer, params: Params, split: data.Split,
              mask: np.ndarray, *, ridge: float = 1e-6,
              limit: float = LIMIT) -> np.ndarray:
  """Kwon et al.'s mask tuning of one ``mask`` (:func:`tune_masks`)."""
  return tune_masks(model, params, split, [mask], ridge=ridge,
                    limit=limit).masks[0]


def tune_masks(model: Transformer, params: Params, split: data.Split,
               masks: Sequence[np.ndarray], *, ridge: float = 1e-6,
               limit: float = LIMIT) -> Tuned:
  """Kwon et al.'s mask tuning as their code does it (``rescale_mask`` and
  ``get_mha_lstsq`` in ``prune/rescale.py`` of
  WoosukKwon/retraining-free-pruning): each of ``masks`` ``[L, H]`` (0/1)
  with its kept heads' values refitted by least squares, layer by layer
  from the bottom.

  The target is the layer's output before LayerNorm, residual included: in
  BERT (post-LN) ``x + Attention(x)``, what the attention sublayer's
  LayerNorm normalises. Here the same sum, the block's input ``x`` plus its
  attention sublayer's output: in a post-LN model (``pre_norm=False``) what
  ``ln_attention`` normalises; in a pre-LN model (the default) the residual
  stream after the attention sublayer, which ``ln_mlp`` reads (the
  attention itself reads ``ln_attention(x)``). At layer ``l`` the pruned
  model's input ``x_p`` (the layers below already tuned) and the unpruned
  model's ``x`` give
  ``min_{a, c} || x_p + b + sum_h a_h O_h(x_p) + c - (x + O(x)) ||^2`` over
  every valid position and feature (``b`` the output bias, ``c`` Kwon et
  al.'s constant column, dropped). So a layer also corrects the error that
  the layers below left in the residual stream, which fitting the attention
  output alone (:func:`tune_masks_attention_output`) does not.

  As in their code: layer 0 is not tuned (its input is the unpruned
  model's); a layer with no head kept is skipped; a solution with a value
  outside ``[-limit, limit]`` (or not finite) is rejected and tuning stops
  there, that layer and every layer above keeping their untuned values
  (their loop ``break``s). Their solver (LSMR, damped towards scale 1) is
  replaced by the normal equations with a ``ridge`` towards 1
  (:func:`fit_scales`). The mask values multiply each head's context, so
  they scale the heads' outputs exactly.

  Returns:
    :class:`Tuned`: the masks (float32 ``[L, H]``, 0 where the mask is 0)
    and the layer where each stopped.
  """
  config = model.config
  inputs = jnp.asarray(split.inputs)
  attention_mask = model_mask(model.config, inputs)
  valid = np.asarray(split.inputs) != 0
  full = _unpruned_layers(model, params, inputs, attention_mask)
  out, rejected = [], []
  for mask in masks:
    tuned = np.asarray(mask, np.float32).copy()
    x, stopped = full.embeddings, None
    for layer, count in enumerate(config.heads_per_layer):
      kept = np.flatnonzero(tuned[layer, :count])
      if count and len(kept) and layer > 0 and stopped is None:
        heads = _head_outputs(_layer_outputs_jit(model, params, layer, x,
                                                 attention_mask))
        # x + sum of the unpruned heads (the bias cancels) minus x_p.
        target = (full.inputs[layer] + full.heads[layer].sum(0)
                  - np.asarray(x, np.float64))[valid]  # [P, D]
        values = fit_scales(heads[kept][:, valid].reshape(len(kept), -1),
                            target.reshape(-1), intercept=True, prior=1.0,
                            ridge=ridge)
        if np.all(np.isfinite(values)) and np.all(np.abs(values) <= limit):
          tuned[layer, kept] = values.astype(np.float32)
        else:
          stopped = layer
      if stopped is not None:
        break  # Nothing above is tuned: no need for its input.
      x = _block_jit(model, params, layer, x, attention_mask,
                     jnp.asarray(tuned[layer, :count]))
    out.append(tuned)
    rejected.append(stopped)
  return Tuned(out, rejected)


def tune_mask_attention_output(model: Transformer, params: Params,
                               split: data.Split, mask: np.ndarray, *,
                               ridge: float = 1e-6) -> np.ndarray:
  """:func:`tune_masks_attention_output` of one ``mask``."""
  return tune_masks_attention_output(model, params, split, [mask],
                                     ridge=ridge).masks[0]


def tune_masks_attention_output(model: Transformer, params: Params,
                                split: data.Split,
                                masks: Sequence[np.ndarray], *,
                                ridge: float = 1e-6) -> Tuned:
  """Mask tuning fitted to the attention output alone, from layer 0 up
  (this project's variant of Kwon et al.'s, :func:`tune_masks`; it was
  ``tune_masks`` before their target was).

  At layer ``l`` the kept heads' outputs on the pruned model's input (the
  layers below already tuned) are fitted to the unpruned model's attention
  output on its own input, summed over every valid position and feature:
  ``min_a || sum_h a_h O_h(x_pruned) - (O(x_full) - bias) ||^2``, without
  the residual, an intercept or a bound on the values. ``ridge``: as
  :func:`fit_scales` (towards 0). A layer with every head kept is fitted
  too; one with none stays empty. ``rejected_layers`` is all None.
  """
  config = model.config
  inputs = jnp.asarray(split.inputs)
  attention_mask = model_mask(model.config, inputs)
  valid = np.asarray(split.inputs) != 0
  full = _unpruned_layers(model, params, inputs, attention_mask)
  out = []
  for mask in masks:
    tuned = np.asarray(mask, np.float32).copy()
    x = full.embeddings
    for layer, count in enumerate(config.heads_per_layer):
      kept = np.flatnonzero(tuned[layer, :count])
      if count and len(kept):
        target = full.heads[layer].sum(0)[valid]  # [P, D]
        # Layer 0's input is the same as the unpruned model's.
        heads = full.heads[layer] if layer == 0 else _head_outputs(
            _layer_outputs_jit(model, params, layer, x, attention_mask))
        tuned[layer, kept] = fit_scales(
            heads[kept][:, valid].reshape(len(kept), -1),
            target.reshape(-1), ridge=ridge).astype(np.float32)
      x = _block_jit(model, params, layer, x, attention_mask,
                     jnp.asarray(tuned[layer, :count]))
    out.append(tuned)
  return Tuned(out, [None] * len(out))


def _head_outputs(outputs: Array) -> np.ndarray:
  """``[H, B, T, D]`` float64: each head's own part of
  :func:`_layer_outputs` (its output minus the bias-only output)."""
  outputs = np.asarray(outputs, np.float64)
  return outputs[1:] - outputs[:1]


@dataclasses.dataclass(frozen=True)
class _Unpruned:
  """The unpruned model layer by layer: its embeddings, each block's input
  (float64 ``[B, T, D]``) and each head's output there (``[H, B, T, D]``,
  None for a layer without heads)."""

  embeddings: Array
  inputs: list[np.ndarray]
  heads: list[np.ndarray | None]


def _unpruned_layers(model: Transformer, params: Params, inputs: Array,
                     attention_mask: Array) -> _Unpruned:
  """What every mask is fitted to, computed once for all of them."""
  config = model.config
  full_mask = full_head_mask(config)
  x = embeddings = oracle.embed_tokens(model, params, inputs)
  block_inputs, heads = [], []
  for layer, count in enumerate(config.heads_per_layer):
    block_inputs.append(np.asarray(x, np.float64))
    heads.append(_head_outputs(_layer_outputs_jit(
        model, params, layer, x, attention_mask)) if count else None)
    x = _block_jit(model, params, layer, x, attention_mask,
                   jnp.asarray(full_mask[layer, :count]))
  return _Unpruned(embeddings, block_inputs, heads)


__all__ = ["EXHAUSTIVE_LIMIT", "LIMIT", "Tuned", "fisher_blocks",
           "fisher_importance", "fit_scales", "search", "tune_mask",
           "tune_masks", "tune_mask_attention_output",
           "tune_masks_attention_output"]
