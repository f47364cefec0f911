"""A mixed KV cache: full heads keep every position, the others a ring.

The streaming ablation (``--ablation streaming:SINKS,WINDOW``,
:mod:`mha.pruning.ablation`) says which heads of a causal decoder can do
with the first ``SINKS`` positions and the last ``WINDOW``; this module
decodes that way and saves the memory for real. Per layer the cache holds

* ``full_key``, ``full_value`` ``[B, T, F, Dh]``: the ``F`` full heads'
  keys and values at every position so far;
* ``ring_key``, ``ring_value`` ``[B, SINKS + WINDOW, H - F, Dh]``: the
  streaming heads'. Position ``p < SINKS`` stays in slot ``p``; a later
  position goes to slot ``SINKS + (p - SINKS) % WINDOW``, overwriting the
  one ``WINDOW`` positions before it, so the slots always hold the sinks and
  the last ``WINDOW`` positions (``ring_position`` records which);

so its size is ``(F T + (H - F)(SINKS + WINDOW)) / (H T)`` of the full
cache's, the study's ``kv_memory``. Each step runs the model's own blocks
(norms, residuals, MLP) on one position; only the attention layer's call is
replaced (``nn.intercept_methods``): the layer's own projections (its
parameters), :func:`mha.attention.dot_product_attention` over each part of
the cache, the two contexts put back in head order, the layer's output
projection. Decoding with a head mask of the removed heads
equals the streaming ablation's forward pass
(:func:`mha.pruning.ablation.ablated_logits`), and with every head full the
model's own (tested).

Under grouped keys and values (``num_kv_heads``, GQA) a layer's cache
holds key/value *groups*, shared by their query heads: a group keeps every
position when any of its query heads is full, else a ring; ``F`` and ``H``
above count groups. A streaming query head of a full group reads the
group's whole cache through the window mask, so decoding still equals the
streaming ablation with those query heads removed; memory is saved only
by groups whose query heads all stream.

    cache = mixed_cache.init_cache(config, full, batch_size=8, length=2048,
                                   sinks=4, window=16)
    logits, cache = mixed_cache.decode_step(model, params, cache, tokens_B)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mha.aliases import Array, Params
from mha.attention import MultiHeadAttention, dot_product_attention
from mha.model import Transformer, TransformerConfig


@struct.dataclass
class LayerCache:
  """One layer's mixed cache (see the module docstring)."""

  full_key: Array
  full_value: Array
  ring_key: Array
  ring_value: Array
  ring_position: Array  # [SINKS + WINDOW] int32, -1 where empty


@struct.dataclass
class MixedCache:
  """Every layer's :class:`LayerCache`, the next position ``index``, and
  (static) each layer's full query heads, its key/value groups that keep
  every position (the heads themselves without GQA), and the ring's
  shape."""

  layers: tuple[LayerCache, ...]
  index: Array
  full: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)
  full_groups: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)
  sinks: int = struct.field(pytree_node=False)
  window: int = struct.field(pytree_node=False)


def _check(config: TransformerConfig) -> None:
  if not config.causal:
    raise ValueError("a KV cache is a decoder's: this model is an encoder")


def _group_size(config: TransformerConfig, heads: int) -> int:
  """Query heads per key/value group in a layer of ``heads`` heads."""
  return heads // (config.num_kv_heads or heads)


def init_cache(config: TransformerConfig, full: Any, *, batch_size: int,
               length: int, sinks: int, window: int) -> MixedCache:
  """An empty mixed cache for ``batch_size`` sequences of up to ``length``
  positions; ``full`` ``[L, H]`` (true: the query head keeps every
  position; under GQA its group then does too)."""
  _check(config)
  if not 1 <= length <= config.max_len:
    raise ValueError(f"a cache of {length} positions: the model has 1 to "
                     f"max_len = {config.max_len}")
  if sinks < 0 or window < 0 or sinks + window < 1:
    raise ValueError(f"sinks {sinks} and window {window}: need both >= 0 "
                     "and sinks + window >= 1")
  full = np.asarray(full, bool)
  dtype = jnp.dtype(config.dtype)
  head_dim = config.head_dim or config.d_model // max(config.heads_per_layer)
  layers, heads, groups = [], [], []
  for layer, count in enumerate(config.heads_per_layer):
    heads.append(tuple(int(h) for h in np.flatnonzero(full[layer, :count])))
    size = _group_size(config, count) if count else 1
    kept = tuple(sorted({h // size for h in heads[-1]}))
    groups.append(kept)
    zeros = lambda n, g: jnp.zeros((batch_size, n, g, head_dim), dtype)
    ring = count // size - len(kept)
    layers.append(LayerCache(
        zeros(length, len(kept)), zeros(length, len(kept)),
        zeros(sinks + window, ring), zeros(sinks + window, ring),
        jnp.full((sinks + window,), -1, jnp.int32)))
  return MixedCache(tuple(layers), jnp.zeros((), jnp.int32), tuple(heads),
                    tuple(groups), sinks, window)


def cache_bytes(cache: MixedCache) -> int:
  """Bytes of the keys and values the cache holds (not the slot
  positions)."""
  return sum(a.size * a.dtype.itemsize for layer in cache.layers
             for a in (layer.full_key, layer.full_value, layer.ring_key,
                       layer.ring_value))


def _slot(position: Array, sinks: int, window: int) -> Array:
  """The ring slot of ``position``: itself among the sinks, else the
  window's slot it cycles through."""
  if window == 0:
    return jnp.minimum(position, sinks - 1)  # never written past the sinks
  return jnp.where(position < sinks, position,
                   sinks + (position - sinks) % window)


def _project(params: Params, name: str, x: Array) -> Array:
  """The layer's ``name`` projection of ``x`` ``[B, 1, D]``: ``[B, 1, H,
  Dh]``, as its ``DenseGeneral`` computes it."""
  p = params[name]
  y = jnp.einsum("bld,dhk->blhk", x, p["kernel"].astype(x.dtype))
  if "bias" not in p:
    return y
  return y + p["bias"].astype(x.dtype)[None, None]


def _in_window(position: Array, index: Array, sinks: int,
               window: int) -> Array:
  """Whether the key at ``position`` is a sink or among the last
  ``window`` positions up to ``index`` (:func:`ablation.window_mask`)."""
  return (position < sinks) | (index - position < window)


def _attention(layer: LayerCache, full: tuple[int, ...],
               full_groups: tuple[int, ...], sinks: int, window: int,
               index: Array, params: Params, x: Array
               ) -> tuple[Array, LayerCache]:
  """One position's attention output ``[B, 1, D]`` through the mixed
  cache, and the cache with the position written."""
  query, key, value = (_project(params, n, x) for n in ("query", "key",
                                                        "value"))
  count = query.shape[-2]
  size = count // max(key.shape[-2], 1)
  ring_groups = tuple(g for g in range(key.shape[-2])
                      if g not in full_groups)
  write = lambda cache, new, at: jax.lax.dynamic_update_slice_in_dim(
      cache, new.astype(cache.dtype), at, axis=1)
  # The query heads reading each part, group by group (the layer's own
  # convention: query head h reads group h // size).
  of = lambda groups: [g * size + i for g in groups for i in range(size)]
  contexts = []
  if full_groups:
    groups, heads = jnp.asarray(full_groups), of(full_groups)
    full_key = write(layer.full_key, key[:, :, groups], index)
    full_value = write(layer.full_value, value[:, :, groups], index)
    position = jnp.arange(full_key.shape[1])  # [T]
    window_only = jnp.asarray([h not in full for h in heads])  # [Q]
    seen = (position[None] <= index) & (~window_only[:, None] | _in_window(
        position, index, sinks, window)[None])  # [Q, T]
    context, _ = dot_product_attention(
        query[:, :, jnp.asarray(heads)], full_key, full_value,
        mask=seen[None, :, None])
    contexts.append((jnp.asarray(heads), context))
    layer = layer.replace(full_key=full_key, full_value=full_value)
  if ring_groups:
    groups, heads = jnp.asarray(ring_groups), jnp.asarray(of(ring_groups))
    slot = _slot(index, sinks, window)
    ring_key = write(layer.ring_key, key[:, :, groups], slot)
    ring_value = write(layer.ring_value, value[:, :, groups], slot)
    position = layer.ring_position.at[slot].set(index)
    seen = (position >= 0) & _in_window(position, index, sinks, window)
    context, _ = dot_product_attention(
        query[:, :, heads], ring_key, ring_value, mask=seen[None, None, None])
    contexts.append((heads, context))
    layer = layer.replace(ring_key=ring_key, ring_value=ring_value,
                          ring_position=position)
  context = jnp.zeros(query.shape[:2] + (count, value.shape[-1]),
                      query.dtype)
  for heads, part in contexts:  # back in head order
    context = context.at[:, :, heads].set(part.astype(context.dtype))
  out = params["out"]
  y = jnp.einsum("blhk,hkd->bld", context, out["kernel"].astype(x.dtype))
  if "bias" in out:
    y = y + out["bias"].astype(x.dtype)[None, None]
  return y, layer


def decode_step(model: Transformer, params: Params, cache: MixedCache,
                tokens_B: Array) -> tuple[Array, MixedCache]:
  """Reads ``tokens_B`` ``[B]`` at the cache's next position: the logits
  ``[B, V]`` of the token after them, and the cache with them written."""
  config = model.config
  _check(config)
  index = cache.index
  decoder = Transformer(dataclasses.replace(config, decode=True))
  x, _ = decoder.apply({"params": params, "cache": {"cache_index": index}},
                       tokens_B[:, None], method="embed", mutable=["cache"])
  layers = list(cache.layers)

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if not (isinstance(module, MultiHeadAttention)
            and context.method_name == "__call__"):
      return next_fun(*args, **kwargs)
    if module.normalize_qk:
      raise ValueError("the mixed cache does not normalise queries and keys")
    layer = int(module.path[-2].split("_")[-1])
    out, layers[layer] = _attention(
        layers[layer], cache.full[layer], cache.full_groups[layer],
        cache.sinks, cache.window, index, module.variables["params"],
        args[0])
    return out, None

  with nn.intercept_methods(intercept):
    logits, _ = model.apply({"params": params}, tokens_B[:, None],
                            return_weights=False, method=_from_embedding,
                            embedded=x)
  return logits[:, 0], cache.replace(layers=tuple(layers), index=index + 1)


def _from_embedding(model: Transformer, tokens: Array, *, embedded: Array,
                    return_weights: bool) -> tuple[Array, Any]:
  """The model's blocks and read-out applied to ``embedded`` (one position:
  no mask is needed, the cache decides what it sees)."""
  x = embedded
  for block in model.blocks:
    x, _ = block(x, None, None, deterministic=True,
                 return_weights=return_weights)
  return model.readout(x), None


@functools.partial(jax.jit, static_argnames=("model", "sinks", "window",
                                             "full"))
def _cached_logits(model, params, tokens, full, sinks, window):
  cache = init_cache(model.config, np.asarray(full), batch_size=tokens.shape[0],
                     length=tokens.shape[1], sinks=sinks, window=window)

  def step(cache, tokens_B):
    logits, cache = decode_step(model, params, cache, tokens_B)
    return cache, logits
  _, logits = jax.lax.scan(step, cache, tokens.T)
  return jnp.swapaxes(logits, 0, 1)


def cached_logits(model: Transformer, params: Params, tokens: Array,
                  full: Any, *, sinks: int, window: int) -> Array:
  """The logits ``[B, T, V]`` of ``tokens`` ``[B, T]`` read one position a
  step through a mixed cache (``full`` ``[L, H]``: the heads that keep every
  position); one ``lax.scan`` under ``jit``."""
  full = tuple(map(tuple, np.asarray(full, bool).tolist()))
  return _cached_logits(model, params, jnp.asarray(tokens), full, sinks,
                        window)


__all__ = ["LayerCache", "MixedCache", "init_cache", "cache_bytes",
           "decode_step", "cached_logits"]
