"""Mean ablation: a removed head's output replaced by its mean, not by zero.

Zero ablation (the head mask of :mod:`mha.pruning.core`) removes a head's
information *and* its average contribution to the residual stream; mean
ablation removes only the information: head ``h`` of layer ``l`` outputs
its mean context ``mu_lh`` (``[Dh]``, the mean over the non-padding query
positions of a split, here validation, of the unpruned model) at every
position. The context passes through the output projection, so the
replacement is a constant added to the layer's output bias,

    out = sum_h (m_h c_h + (1 - m_h) mu_h) W_o[h] + b
        = sum_h m_h c_h W_o[h] + (b + sum_h (1 - m_h) mu_h W_o[h]),

and a mean-ablated model is exactly a zero-ablated one with a shifted bias:
still an ordinary smaller model once the heads are sliced out
(:func:`prune_mean_ablated`).

* :func:`head_means` measures ``mu`` ``[L, H, Dh]`` on a split;
* :func:`bias_shifts` ``[L, H, D]`` = ``mu_lh W_o[h]``;
* :func:`fold` shifts the output biases for a head mask (pure: ``jit``,
  ``vmap`` over masks);
* :func:`mean_ablated_logits` is the definition, computed the long way
  (each removed head's context replaced inside the model), against which
  the fold is tested;
* :func:`evaluate_masks` is :func:`mha.pruning.core.evaluate_masks` under
  mean ablation; every subset at once is
  ``oracle.evaluate_subsets(..., bias_shifts=...)``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import head_masks
from mha.aliases import Array, HeadSpec, Params
from mha.model import Transformer, TransformerConfig
from mha.pruning import core
from mha.pruning.ablation import layer_of
from mha.run import arguments



def _context_sums(model: Transformer, params: Params,
                  inputs: Array) -> list[Array]:
  """Per layer, the sum over non-padding query positions of each head's
  context ``[H_l, Dh]`` (the input of the output projection)."""
  found: dict[int, Array] = {}
  valid = (inputs != 0).astype(jnp.float32)

  def capture(next_fun, args, kwargs, context):
    layer = layer_of(context)
    if layer is not None:
      found[layer] = jnp.einsum("...thd,...t->hd", args[0], valid)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(capture):
    model.apply({"params": params}, inputs, return_weights=False)
  return [found.get(layer) for layer in range(model.config.num_layers)]


@functools.partial(jax.jit, static_argnames="model")
def _batch_context_sums(model, params, inputs):
  return _context_sums(model, params, inputs), jnp.sum(inputs != 0)


def head_means(model: Transformer, params: Params, split: data.Split, *,
               batch_size: int = 1000) -> np.ndarray:
  """``mu`` ``[L, H, Dh]``: each head's mean context over the non-padding
  query positions of ``split`` (zeros where a head does not exist)."""
  arguments.check_count("batch_size", batch_size)
  config = model.config
  total = np.zeros((config.num_layers, config.max_heads,
                    config.resolved_head_dim), np.float64)
  positions = 0
  for inputs, _ in core.batches(split, batch_size):
    sums, count = jax.device_get(_batch_context_sums(model, params, inputs))
    positions += int(count)
    for layer, value in enumerate(sums):
      if value is not None:
        total[layer, :value.shape[0]] += np.asarray(value, np.float64)
  return (total / max(positions, 1)).astype(np.float32)


def bias_shifts(params: Params, config: TransformerConfig,
                means: np.ndarray) -> Array:
  """``[L, H, D]``: what each head adds to its layer's output when it
  outputs its mean, ``mu_lh W_o[h]`` (zeros where no head)."""
  rows = []
  for layer, count in enumerate(config.heads_per_layer):
    shift = jnp.zeros((config.max_heads, config.d_model), jnp.float32)
    if count:
      kernel = params[f"layer_{layer}"]["attention"]["out"]["kernel"]
      shift = shift.at[:count].set(
          jnp.einsum("hd,hdo->ho", jnp.asarray(means[layer, :count]), kernel))
    rows.append(shift)
  return jnp.stack(rows)


def fold(params: Params, config: TransformerConfig, shifts: Array,
         head_mask: Array) -> Params:
  """``params`` with every layer's output bias shifted by the mean outputs
  of the heads ``head_mask`` ``[L, H]`` removes: the model under
  ``head_mask`` is then mean-ablated. Pure (``vmap`` over masks)."""
  new = dict(params)
  removed = 1.0 - jnp.asarray(head_mask, jnp.float32)
  for layer in range(config.num_layers):
    block = dict(new[f"layer_{layer}"])
    attention = dict(block["attention"])
    out = dict(attention["out"])
    out["bias"] = out["bias"] + removed[layer] @ shifts[layer]
    attention["out"] = out
    block["attention"] = attention
    new[f"layer_{layer}"] = block
  return new


def mean_ablated_logits(model: Transformer, params: Params, means: np.ndarray,
                        inputs: Array, head_mask: Array) -> Array:
  """The definition, the long way: logits of the model whose heads removed
  by ``head_mask`` ``[L, H]`` output their mean context ``means`` at every
  position (each one's context replaced before the output projection)."""
  config = model.config
  mask = jnp.asarray(head_mask, jnp.float32)

  def replace(next_fun, args, kwargs, context):
    layer = layer_of(context)
    if layer is None:
      return next_fun(*args, **kwargs)
    count = config.heads_per_layer[layer]
    gated = args[0]  # [..., T, H_l, Dh], removed heads already zero
    mean = (1.0 - mask[layer, :count])[:, None] * jnp.asarray(
        means[layer, :count])
    return next_fun(gated + jnp.broadcast_to(mean, gated.shape), *args[1:],
                    **kwargs)

  with nn.intercept_methods(replace):
    logits, _ = model.apply({"params": params}, inputs,
                            head_mask=[mask[l, :c] for l, c in
                                       enumerate(config.heads_per_layer)],
                            return_weights=False)
  return logits


def prune_mean_ablated(params: Params, config: TransformerConfig,
                       heads: HeadSpec, means: np.ndarray
                       ) -> tuple[Params, TransformerConfig]:
  """The mean-ablated model without ``heads`` as a smaller model: their mean
  outputs folded into the output biases, then sliced out
  (:func:`mha.pruning.core.prune_heads`)."""
  pairs = core._heads_by_layer(config, heads)  # Checks that they exist.
  flat = [layer * config.max_heads + h for layer, hs in pairs.items()
          for h in hs]
  mask = head_masks.mask_without(config, flat)
  folded = fold(params, config, bias_shifts(params, config, means), mask)
  return core.prune_heads(folded, config, pairs)


@functools.partial(jax.jit, static_argnames="model")
def _example_sums_per_mask(model, params, shifts, inputs, targets, masks):
  config = model.config

  def one(mask):
    return core.masked_example_sums(model, fold(params, config, shifts, mask),
                                    inputs, targets, mask)

  return jax.vmap(one)(masks)


def evaluate_masks(model: Transformer, params: Params, shifts: Array,
                   split: data.Split, masks: np.ndarray, *,
                   batch_size: int = 1000,
                   chunk_size: int = 8) -> dict[str, np.ndarray]:
  """Per-example sums ``[M, n]`` (:func:`mha.evaluate.example_metric_sums`)
  of the mean-ablated model under each of ``masks`` ``[M, L, H]``."""
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("chunk_size", chunk_size)
  masks = np.asarray(masks, np.float32)
  parts: dict[str, list[np.ndarray]] = {}
  for start in range(0, len(masks), chunk_size):
    chunk = masks[start:start + chunk_size]
    pieces: dict[str, list[np.ndarray]] = {}
    for inputs, targets in core.batches(split, batch_size):
      out = jax.device_get(_example_sums_per_mask(
          model, params, shifts, inputs, targets, jnp.asarray(chunk)))
      for key, value in out.items():
        pieces.setdefault(key, []).append(np.asarray(value))
    for key, value in pieces.items():
      parts.setdefault(key, []).append(
          np.concatenate(value, axis=-1)[:, :len(split)])
  return {k: np.concatenate(v) for k, v in parts.items()}


__all__ = ["head_means", "bias_shifts", "fold", "mean_ablated_logits",
           "prune_mean_ablated", "evaluate_masks"]
