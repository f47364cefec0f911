"""Multi-head dot-product attention that returns its attention weights.

Conventions (shared with the rest of the package):

* Per-head arrays are ``[..., L, H, Dh]``: any number of leading batch
  dimensions (zero included), then length, heads, per-head width.
* Attention weights are ``[..., H, Lq, Lk]``.
* Masks are boolean, ``True`` = may attend, broadcastable to
  ``[..., H, Lq, Lk]`` (the Flax convention).
* A query row with no key to attend to gets all-zero weights and a zero
  context, never NaN and never a uniform distribution.
* ``head_mask`` (the gate xi_h of Michel et al. 2019) is a float ``[..., H]``
  that multiplies each head's context before the output projection.

Everything here is a pure function of its inputs, so ``jax.jit``,
``jax.grad`` and ``jax.vmap`` pass through (over batch axes, over head masks,
and over stacked parameters).

:class:`MultiHeadAttention` is a drop-in for
``flax.linen.MultiHeadDotProductAttention`` (every field and call argument,
the same parameters, cache and sown weights) that also returns the weights;
its docstring lists where it differs on purpose. On an NVIDIA GPU, in 16-bit
floats, the fused path runs cuDNN flash attention (:mod:`mha.attention_kernels`).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp

from mha import attention_kernels
from mha.aliases import Array

Dtype = Any
Initializer = Callable[..., Array]
Precision = Any

__all__ = [
    "MultiHeadAttention",
    "dot_product_attention",
    "fused_dot_product_attention",
    "causal_mask",
    "combine_masks",
    "lengths_to_mask",
    "padding_mask_from_lengths",
    "padding_mask_from_tokens",
]


# --------------------------------------------------------------------------
# Masks.
# --------------------------------------------------------------------------


def lengths_to_mask(valid_lens: Array, length: int) -> Array:
  """Boolean ``[..., length]`` that is True at positions ``< valid_lens``."""
  valid_lens = jnp.asarray(valid_lens)[..., None]
  positions = _expand_to_rank(jnp.arange(length), valid_lens.ndim)
  return positions < valid_lens


def padding_mask_from_lengths(valid_lens: Array, num_keys: int, *,
                              per_query: bool = False) -> Array:
  """Attention mask from valid lengths (the d2l semantics).

  Args:
    valid_lens: integer ``[...]`` (one length per sequence) or, with
      ``per_query=True``, ``[..., Lq]`` (one length per query).
    num_keys: the key length ``Lk``.
    per_query: whether the last axis of ``valid_lens`` indexes queries.

  Returns:
    Boolean mask ``[..., 1, 1, Lk]`` (per sequence) or ``[..., 1, Lq, Lk]``
    (per query); key positions ``>= valid_len`` are False.
  """
  key_ok = lengths_to_mask(valid_lens, num_keys)
  return key_ok[..., None, :, :] if per_query else key_ok[..., None, None, :]


def padding_mask_from_tokens(tokens: Array, pad_id: int = 0) -> Array:
  """Pairwise padding mask ``[..., 1, L, L]`` from token ids.

  Position pairs where either the query or the key is padding are False, so
  padding queries get all-zero weights and padding keys get zero weight.
  """
  valid = tokens != pad_id
  return valid[..., None, :, None] & valid[..., None, None, :]


def causal_mask(length: int) -> Array:
  """Boolean ``[1, L, L]`` lower-triangular mask: query i may see keys <= i."""
  return jnp.tril(jnp.ones((length, length), dtype=bool))[None]


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the given masks (``None`` entries ignored).

  Masks of different ranks are aligned on their trailing axes. Returns None
  when every mask is None.
  """
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  rank = max(jnp.ndim(m) for m in masks)
  out = _expand_to_rank(jnp.asarray(masks[0], bool), rank)
  for m in masks[1:]:
    out = jnp.logical_and(out, _expand_to_rank(jnp.asarray(m, bool), rank))
  return out


def _expand_to_rank(x: Array, rank: int) -> Array:
  """Prepends singleton axes so that ``x`` has ``rank`` dimensions."""
  return jnp.reshape(x, (1,) * (rank - x.ndim) + x.shape)


def _shape_error(name: str, shape: tuple[int, ...], expected: str) -> ValueError:
  return ValueError(f"`{name}` has shape {tuple(shape)}, expected {expected}.")


# --------------------------------------------------------------------------
# The attention function.
# --------------------------------------------------------------------------


def _check_dtypes(**arrays: Array | None) -> None:
  """Raises ``ValueError`` naming the first array whose dtype is not a real
  floating-point type: a complex input would lose its imaginary part in the
  float32 softmax, and integers are not activations."""
  for name, x in arrays.items():
    if x is None:
      continue
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f"`{name}` has dtype {dtype}, expected a real floating-point dtype "
          "(float32, bfloat16, float16, ...); complex and integer inputs are "
          "not supported.")


def _check_qkv(query: Array, key: Array, value: Array) -> None:
  _check_dtypes(query=query, key=key, value=value)
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim < 3:
      raise _shape_error(name, x.shape, "[..., L, H, Dh] (at least 3 dims)")
  if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
    raise ValueError(
        "query, key and value must share their batch dimensions; got "
        f"query {query.shape}, key {key.shape}, value {value.shape}.")
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(
        f"key and value must have the same length; got key {key.shape}, "
        f"value {value.shape}.")
  if key.shape[-2] != value.shape[-2]:
    raise ValueError(
        "key and value must have the same number of heads; got "
        f"key {key.shape}, value {value.shape}.")
  _check_groups(query.shape[-2], key.shape[-2], "query heads", "key heads")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
        f"query and key must have the same per-head width; got query "
        f"{query.shape}, key {key.shape}.")


def _check_groups(num_heads: int, num_kv_heads: int,
                  heads_name: str = "num_heads",
                  kv_name: str = "num_kv_heads") -> None:
  """Raises ``ValueError`` naming both counts unless ``num_kv_heads`` heads
  of keys and values can each serve a group of query heads."""
  if num_kv_heads < 1 and num_heads > 0 or (
      num_kv_heads > 0 and num_heads % num_kv_heads):
    raise ValueError(
        f"{heads_name} ({num_heads}) must be a multiple of {kv_name} "
        f"({num_kv_heads}), each key/value head serving a group of query "
        "heads.")


def _broadcastable(name: str, x: Array, target: tuple[int, ...]) -> Array:
  """``x`` as an array, after checking it broadcasts to ``target``."""
  x = jnp.asarray(x)
  try:
    ok = jnp.broadcast_shapes(x.shape, target) == tuple(target)
  except ValueError:
    ok = False
  if not ok:
    raise _shape_error(name, x.shape,
                       f"a shape broadcastable to {tuple(target)}")
  return x


def _check_mask(mask: Array, target: tuple[int, ...]) -> Array:
  """Validates ``mask`` against ``[..., H, Lq, Lk]``; returns it as bool."""
  return _broadcastable("mask", mask, target).astype(bool)


def _full_mask(mask: Array, shape: tuple[int, ...]) -> Array:
  """Validates ``mask`` and broadcasts it to exactly ``shape``."""
  mask = _check_mask(mask, shape)
  return jnp.broadcast_to(_expand_to_rank(mask, len(shape)), shape)


def _check_head_mask(head_mask: Array, batch_shape: tuple[int, ...],
                     num_heads: int) -> Array:
  head_mask = jnp.asarray(head_mask)
  target = tuple(batch_shape) + (num_heads,)
  try:
    ok = (head_mask.ndim >= 1 and head_mask.shape[-1] == num_heads and
          jnp.broadcast_shapes(head_mask.shape, target) == target)
  except ValueError:
    ok = False
  if not ok:
    raise _shape_error("head_mask", head_mask.shape,
                       f"[{num_heads}] or a shape broadcastable to {target}")
  return head_mask


def _gate_heads(context: Array, head_mask: Array | None) -> Array:
  """Multiplies ``context [..., Lq, H, Dh]`` by ``head_mask [..., H]``."""
  if head_mask is None:
    return context
  gate = head_mask[..., None, :, None].astype(context.dtype)
  return context * _expand_to_rank(gate, context.ndim)


def _einsums(precision: Precision, einsum_dot_general: Callable | None,
             qk_attn_weights_einsum: Callable | None,
             attn_weights_value_einsum: Callable | None
             ) -> tuple[Callable, Callable]:
  """The two einsums (``QK^T`` and weights x values), with Flax's checks."""
  if (qk_attn_weights_einsum is None) != (attn_weights_value_einsum is None):
    raise ValueError("qk_attn_weights_einsum and attn_weights_value_einsum "
                     "must be specified together.")
  if qk_attn_weights_einsum is not None:
    if precision is not None or einsum_dot_general is not None:
      raise ValueError(
          "precision/einsum_dot_general and qk_attn_weights_einsum/"
          "attn_weights_value_einsum are mutually exclusive; specify only "
          "one of them.")
    return qk_attn_weights_einsum, attn_weights_value_einsum
  if einsum_dot_general is not None:
    einsum = functools.partial(jnp.einsum, precision=precision,
                               _dot_general=einsum_dot_general)
    return einsum, einsum
  einsum = functools.partial(jnp.einsum, precision=precision)
  return einsum, einsum


# Grouped-query attention (Ainslie et al. 2023): H query heads share
# H_kv <= H heads of keys and values, query head n reading key/value head
# n // (H / H_kv) (jax.nn.dot_product_attention's and Flax's grouping). The
# two einsums below see the groups as an axis of their own, so keys and values
# are never repeated H / H_kv times in memory; with H_kv = H they are the
# plain einsums, unchanged.


def _grouped(num_heads: int, num_kv_heads: int) -> bool:
  return num_kv_heads not in (0, num_heads)


def _qk_logits(query: Array, key: Array, einsum: Callable) -> Array:
  """``QK^T`` per query head: ``[..., H, Lq, Lk]`` from ``query [..., Lq, H,
  D]`` and ``key [..., Lk, H_kv, D]``."""
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if not _grouped(num_heads, num_kv_heads):
    return einsum("...qhd,...khd->...hqk", query, key)
  query = jnp.reshape(query, query.shape[:-2] + (
      num_kv_heads, num_heads // num_kv_heads, query.shape[-1]))
  logits = einsum("...qhgd,...khd->...hgqk", query, key)
  return jnp.reshape(logits, logits.shape[:-4] + (num_heads,)
                     + logits.shape[-2:])


def _weighted_values(probs: Array, value: Array, einsum: Callable) -> Array:
  """The context ``[..., Lq, H, Dv]`` of ``probs [..., H, Lq, Lk]`` and
  ``value [..., Lk, H_kv, Dv]``."""
  num_heads, num_kv_heads = probs.shape[-3], value.shape[-2]
  if not _grouped(num_heads, num_kv_heads):
    return einsum("...hqk,...khd->...qhd", probs, value)
  probs = jnp.reshape(probs, probs.shape[:-3] + (
      num_kv_heads, num_heads // num_kv_heads) + probs.shape[-2:])
  context = einsum("...hgqk,...khd->...qhgd", probs, value)
  return jnp.reshape(context, context.shape[:-3] + (num_heads,
                                                    context.shape[-1]))


def _attention_weights(query: Array, key: Array, bias: Array | None,
                       mask: Array | None, einsum: Callable) -> Array:
  """Float32 softmax weights ``[..., H, Lq, Lk]``; masked keys exactly 0,
  rows with no valid key all 0."""
  depth = query.shape[-1]
  query = query / jnp.asarray(math.sqrt(depth), query.dtype)
  logits = _qk_logits(query, key, einsum)
  if bias is not None:
    logits = logits + bias
  logits = logits.astype(jnp.float32)  # softmax in float32 whatever the dtype
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits)
  if mask is not None:
    # Exact zeros for masked keys, and all-zero rows where nothing is valid
    # (the softmax of an all-masked row would be uniform otherwise).
    weights = jnp.where(mask, weights, 0.0)
  return weights


def _dropout(probs: Array, rng: Array, rate: float, broadcast: bool,
             dtype: Dtype, batch_ndim: int) -> Array:
  """Flax's attention dropout: one mask shared over batch and heads when
  ``broadcast``, else one per element; kept weights scaled by 1/(1-rate)."""
  keep_prob = 1.0 - rate
  shape = ((1,) * (batch_ndim + 1) + probs.shape[-2:] if broadcast
           else probs.shape)
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  return probs * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    bias: Array | None = None,
    mask: Array | None = None,
    head_mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dtype: Dtype | None = None,
    precision: Precision = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
) -> tuple[Array, Array]:
  """Scaled dot-product attention on per-head arrays, returning the weights.

  The arguments of ``flax.linen.dot_product_attention`` with their meaning
  (``module`` aside: the weights are returned), plus ``head_mask``.

  Args:
    query: ``[..., Lq, H, Dh]``, real floating point.
    key: ``[..., Lk, H_kv, Dh]``; ``H_kv`` divides ``H`` (grouped-query
      attention when smaller: query head n reads key/value head
      ``n // (H / H_kv)``, as in ``jax.nn.dot_product_attention``).
    value: ``[..., Lk, H_kv, Dv]``.
    bias: optional, added to the logits; broadcastable to
      ``[..., H, Lq, Lk]``.
    mask: optional boolean, True = may attend, broadcastable to
      ``[..., H, Lq, Lk]``.
    head_mask: optional float ``[H]`` or ``[..., H]``; multiplies each head's
      context (after attention, before any output projection).
    broadcast_dropout: one dropout mask shared across batch and heads (True,
      Flax's default) or one per element.
    dropout_rng: PRNG key, needed when dropout is active.
    dropout_rate: dropout on the attention weights (applied to the weights
      used for the context, not to the returned weights).
    deterministic: disables dropout when True.
    dtype: computation dtype (default: that of query, key and value).
    precision: matmul precision for the two einsums.
    force_fp32_for_softmax: return the weights (and multiply them with the
      values) in float32 rather than in ``dtype``. The softmax itself always
      runs in float32.
    einsum_dot_general: the ``dot_general`` of the two einsums.
    qk_attn_weights_einsum: replaces the ``QK^T`` einsum (with the next; not
      with ``precision`` or ``einsum_dot_general``).
    attn_weights_value_einsum: replaces the weights x values einsum.

  Returns:
    ``(context, weights)``: context ``[..., Lq, H, Dv]`` and the softmax
    weights ``[..., H, Lq, Lk]`` (before dropout, in ``dtype``, or float32
    with ``force_fp32_for_softmax``). Masked keys get exactly zero weight;
    rows with no valid key are all zero (not uniform, as in Flax).

  Raises:
    ValueError: naming the argument, for a complex or integer query, key or
      value, or a shape that does not fit.
  """
  qk_einsum, av_einsum = _einsums(precision, einsum_dot_general,
                                  qk_attn_weights_einsum,
                                  attn_weights_value_einsum)
  _check_qkv(query, key, value)
  dtype = jnp.result_type(query, key, value) if dtype is None else dtype
  query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  batch_shape = query.shape[:-3]
  num_heads = query.shape[-2]
  weights_shape = batch_shape + (num_heads, query.shape[-3], key.shape[-3])
  if mask is not None:
    mask = _full_mask(mask, weights_shape)
  if bias is not None:
    bias = _broadcastable("bias", bias, weights_shape)
  if head_mask is not None:
    head_mask = _check_head_mask(head_mask, batch_shape, num_heads)

  weights = _attention_weights(query, key, bias, mask, qk_einsum)
  weights = weights.astype(jnp.float32 if force_fp32_for_softmax else dtype)
  probs = weights
  if not deterministic and dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError("dropout_rng is required when dropout is active.")
    probs = _dropout(probs, dropout_rng, dropout_rate, broadcast_dropout,
                     dtype, len(batch_shape))
  context = _weighted_values(probs, value, av_einsum)
  return _gate_heads(context, head_mask), weights


def _lengths_or_mask(mask: Array | None, kv_lengths: Array | None,
                     shape: tuple[int, ...]) -> Array | None:
  """``mask`` and the key-length mask of ``kv_lengths``, as one full mask."""
  if kv_lengths is not None:
    mask = combine_masks(mask, padding_mask_from_lengths(kv_lengths,
                                                         shape[-1]))
  return None if mask is None else _full_mask(mask, shape)


def _fused(query: Array, key: Array, value: Array, mask: Array | None,
           kv_lengths: Array | None, *,
           return_weights: bool) -> tuple[Array, Array | None]:
  """``(context, float32 weights or None)`` of the fused path: the math of
  :func:`dot_product_attention` (XLA fuses it), except where cuDNN flash
  attention can run (:func:`mha.attention_kernels.choose_implementation`
  on JAX's default device: an NVIDIA GPU, 16-bit floats, ...). There the
  kernel is chosen when the program is lowered: the same math on CPU,
  ``jax.nn.dot_product_attention`` with cuDNN elsewhere, the weights
  rebuilt from its log-sum-exp when asked for."""
  shape = query.shape[:-3] + (query.shape[-2], query.shape[-3],
                              key.shape[-3])

  def on_cpu(q, k, v, m, n):
    context, weights = dot_product_attention(
        q, k, v, mask=_lengths_or_mask(m, n, shape))
    return context, (weights.astype(jnp.float32) if return_weights else None)

  # Only cuDNN computes something else (another kernel, weights from its
  # log-sum-exp); without it, one plain program for every platform, and
  # nothing else to trace.
  facts = attention_kernels.device_facts()
  if attention_kernels.choose_implementation(
      query, key, value, mask=mask, kv_lengths=kv_lengths,
      facts=facts) != "cudnn":
    return on_cpu(query, key, value, mask, kv_lengths)

  def elsewhere(q, k, v, m, n):
    if m is not None:
      # Full batch axes, but one head when the mask has one: cuDNN takes the
      # mask as an additive bias (and computes its gradient), H times
      # smaller that way.
      m = combine_masks(m, None if n is None else padding_mask_from_lengths(
          n, shape[-1]))
      heads = 1 if m.ndim < 3 or m.shape[-3] == 1 else shape[-3]
      m = _full_mask(m, shape[:-3] + (heads,) + shape[-2:])
      n = None
    return attention_kernels.fused_attention(
        q, k, v, mask=m, kv_lengths=n, return_weights=return_weights,
        facts=facts)

  return jax.lax.platform_dependent(query, key, value, mask, kv_lengths,
                                    cpu=on_cpu, default=elsewhere)


def fused_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    head_mask: Array | None = None,
    kv_lengths: Array | None = None,
) -> Array:
  """The context of :func:`dot_product_attention`, without the weights.

  Same semantics as the weights path: rows with no valid key give a zero
  context, ``head_mask`` gates heads. No dropout (use
  :func:`dot_product_attention` for training with dropout).

  It is the math of :func:`dot_product_attention` with the weights dropped,
  which XLA fuses (on CPU into one kernel: ``QK^T``, softmax, product with
  the values; ``jax.nn.dot_product_attention`` would add a copy of the
  ``[..., H, Lq, Lk]`` probabilities, a layer 1.4x slower at batch 8, length
  512, width 512). Where cuDNN flash attention's constraints hold on JAX's
  default device (:func:`mha.attention_kernels.select_implementation`: an
  NVIDIA GPU, 16-bit floats, a head width it supports, a mask it takes), the
  kernel is chosen when the program is lowered (``jax.lax.platform_dependent``):
  that math on CPU, ``jax.nn.dot_product_attention`` with
  ``implementation="cudnn"`` elsewhere.

  Args:
    query, key, value: as for :func:`dot_product_attention` (grouped keys
      and values too).
    mask: optional boolean, broadcastable to ``[..., H, Lq, Lk]``.
    head_mask: optional float ``[H]`` or ``[..., H]``.
    kv_lengths: optional integer ``[...]``: keys at positions ``>= length``
      are masked (cuDNN's padding mask when there is no ``mask``).
  """
  _check_qkv(query, key, value)
  batch_shape = query.shape[:-3]
  num_heads = query.shape[-2]
  weights_shape = batch_shape + (num_heads, query.shape[-3], key.shape[-3])
  if mask is not None:
    mask = _check_mask(mask, weights_shape)
  if kv_lengths is not None:
    kv_lengths = jnp.asarray(kv_lengths)
    if kv_lengths.shape != batch_shape:
      raise _shape_error("kv_lengths", kv_lengths.shape, f"{batch_shape}")
  if head_mask is not None:
    head_mask = _check_head_mask(head_mask, batch_shape, num_heads)
  context, _ = _fused(query, key, value, mask, kv_lengths,
                      return_weights=False)
  return _gate_heads(context, head_mask)


# --------------------------------------------------------------------------
# The Flax module.
# --------------------------------------------------------------------------


def _resolve_inputs(inputs_q: Array, inputs_k: Array | None,
                    inputs_v: Array | None,
                    inputs_kv: Array | None) -> tuple[Array, Array]:
  """``(inputs_k, inputs_v)`` as Flax resolves them (self-attention by
  default; ``inputs_kv`` deprecated), its warnings included."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError(
          "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must "
          "be None. If `inputs_kv` is not None, both `inputs_k` and "
          "`inputs_v` must be None. Use `inputs_k` and `inputs_v`: "
          "`inputs_kv` will be deprecated.")
    warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k "
                  "and inputs_v instead.", DeprecationWarning, stacklevel=3)
    return inputs_kv, inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
          "`inputs_k` cannot be None if `inputs_v` is not None. To have both "
          "`inputs_k` and `inputs_v` be the same value, pass in the value to "
          "`inputs_k` and leave `inputs_v` as None.")
    inputs_k = inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
  elif inputs_v.ndim >= 2 and inputs_v.shape[-1] == inputs_v.shape[-2]:
    warnings.warn(
        f"You are passing an array of shape {inputs_v.shape} to the "
        "`inputs_v` arg, when you may have intended to pass it to the `mask` "
        "arg. As in Flax since version 0.7.4, the function signature of "
        "MultiHeadAttention's `__call__` method has changed to "
        "`__call__(inputs_q, inputs_k=None, inputs_v=None, *, "
        "inputs_kv=None, mask=None, deterministic=None)`. Use the kwarg "
        "`mask` instead.", DeprecationWarning, stacklevel=3)
  return inputs_k, inputs_v


def _check_inputs(inputs_q: Array, inputs_k: Array, inputs_v: Array) -> None:
  """Dtypes and shapes of the layer's three inputs agree."""
  _check_dtypes(inputs_q=inputs_q, inputs_k=inputs_k, inputs_v=inputs_v)
  for name, x in (("inputs_q", inputs_q), ("inputs_k", inputs_k),
                  ("inputs_v", inputs_v)):
    if x.ndim < 2:
      raise _shape_error(name, x.shape, "[..., L, D] (at least 2 dims)")
  if inputs_q.shape[:-2] != inputs_k.shape[:-2] or (
      inputs_k.shape[:-1] != inputs_v.shape[:-1]):
    raise ValueError(
        "inputs_q, inputs_k and inputs_v must share their batch dimensions "
        "and keys/values their length; got inputs_q "
        f"{inputs_q.shape}, inputs_k {inputs_k.shape}, "
        f"inputs_v {inputs_v.shape}.")


# The layer's steps that are pure functions of arrays, shared by the Linen
# layer below and the NNX layer of :mod:`mha.nnx`.


def _layer_masks(mask: Array | None, valid_lens: Array | None,
                 extra_mask: Array | None, batch_shape: tuple[int, ...],
                 num_heads: int, lq: int,
                 lk: int) -> tuple[Array | None, Array | None]:
  """A layer's ``mask`` and ``valid_lens`` (checked against ``[..., H, Lq,
  Lk]``) and another mask (decode, causal) as ``(mask, kv_lengths)``:
  per-sequence ``valid_lens`` alone stay lengths (the fused kernels take them
  as such), anything else is one mask."""
  target = batch_shape + (num_heads, lq, lk)
  if mask is not None:
    mask = _check_mask(mask, target)
  mask = combine_masks(mask, extra_mask)
  if valid_lens is None:
    return mask, None
  valid_lens = jnp.asarray(valid_lens)
  if valid_lens.shape not in (batch_shape, batch_shape + (lq,)):
    raise _shape_error("valid_lens", valid_lens.shape,
                       f"{batch_shape} or {batch_shape + (lq,)}")
  per_query = valid_lens.shape == batch_shape + (lq,)
  if mask is None and not per_query:
    return None, valid_lens
  return combine_masks(mask, padding_mask_from_lengths(
      valid_lens, lk, per_query=per_query)), None


def _decode_step(cached_key: Array, cached_value: Array, cache_index: Array,
                 key: Array, value: Array
                 ) -> tuple[Array, Array, Array, Array]:
  """One step of Flax's decode cache: ``key``/``value`` ``[..., 1, H_kv,
  Dh]`` written at ``cache_index`` into the caches ``[..., L, H_kv, Dh]``.

  Returns:
    ``(keys, values, cache_index + 1, mask)``: the updated caches and index,
    and the mask ``[..., 1, 1, L]`` that lets the one query see the
    positions written so far, not the zeros after them.
  """
  batch_ndim, max_length = cached_key.ndim - 3, cached_key.shape[-3]
  zero = jnp.array(0, dtype=jax.lax.dtype(cache_index.dtype))
  indices = (zero,) * batch_ndim + (cache_index, zero, zero)
  key = jax.lax.dynamic_update_slice(cached_key, key, indices)
  value = jax.lax.dynamic_update_slice(cached_value, value, indices)
  mask = jnp.broadcast_to(jnp.arange(max_length) <= cache_index,
                          cached_key.shape[:-3] + (1, 1, max_length))
  return key, value, cache_index + 1, mask


def _attend_heads(query: Array, key: Array, value: Array, mask: Array | None,
                  kv_lengths: Array | None, *, dropout_rng: Array | None,
                  dropout_rate: float, deterministic: bool,
                  broadcast_dropout: bool, dtype: Dtype | None,
                  precision: Precision, force_fp32_for_softmax: bool = False,
                  qk_einsum: Callable | None = None,
                  av_einsum: Callable | None = None, want_weights: bool,
                  weights_from_lse: bool = False
                  ) -> tuple[Array, Array | None]:
  """``(context, weights or None)`` of projected heads: the unfused path
  (:func:`dot_product_attention`) when the weights are wanted (unless
  ``weights_from_lse``), dropout is on, the precision or einsums are set, or
  ``force_fp32_for_softmax`` asks for float32 weights times values below
  float32 (the fused kernels multiply weights of the values' dtype); else the
  fused one, whose float32 weights get Flax's dtype."""
  shape = query.shape[:-3] + (query.shape[-2], query.shape[-3],
                              key.shape[-3])  # [..., H, Lq, Lk]
  dropout = not deterministic and dropout_rate > 0.0
  low_precision = jnp.result_type(query, key, value) != jnp.float32
  unfused = (dropout or precision is not None or qk_einsum is not None
             or (want_weights and not weights_from_lse)
             or (force_fp32_for_softmax and low_precision))
  if unfused:
    return dot_product_attention(
        query, key, value, mask=_lengths_or_mask(mask, kv_lengths, shape),
        broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, deterministic=not dropout, dtype=dtype,
        precision=precision, force_fp32_for_softmax=force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_einsum,
        attn_weights_value_einsum=av_einsum)
  context, weights = _fused(query, key, value, mask, kv_lengths,
                            return_weights=want_weights)
  if weights is not None:  # float32 from the kernel: Flax's dtype rule
    weights = weights.astype(jnp.float32 if force_fp32_for_softmax
                             else query.dtype)
  return context, weights


class _OutBias(nn.Module):
  """The output bias alone: what is left of a layer with zero heads."""

  features: int
  param_dtype: Dtype
  bias_init: Initializer

  @nn.compact
  def __call__(self, shape: tuple[int, ...], dtype: Dtype) -> Array:
    bias = self.param("bias", self.bias_init, (self.features,),
                      self.param_dtype)
    return jnp.broadcast_to(bias.astype(dtype), shape + (self.features,))


class MultiHeadAttention(nn.Module):
  """Multi-head attention that returns ``(out, weights)``: a drop-in for
  ``flax.linen.MultiHeadDotProductAttention``.

  Every constructor field and call argument of the installed Flax layer
  (0.12.8) is here, in Flax's order, with its meaning and default; ours come
  after them. The parameter tree is exactly Flax's with the same settings
  (``query``/``key``/``value`` kernels ``[D_in, H, Dh]`` and biases
  ``[H, Dh]``, ``out`` kernel ``[H, Dh, D_out]`` and bias ``[D_out]``;
  ``query_ln``/``key_ln`` with ``normalize_qk``), so a checkpoint of either
  loads into the other and gives the same outputs, and ``decode=True`` keeps
  Flax's cache (``cached_key``, ``cached_value``, ``cache_index`` in the
  ``cache`` collection). ``sow_weights=True`` sows the weights where Flax
  does (``intermediates`` / ``attention_weights``).

  Where ours differs from Flax's, on purpose:

  * a query row with no valid key gets all-zero weights and a zero context
    (Flax: uniform weights over the masked keys);
  * the softmax always runs in float32 (``force_fp32_for_softmax`` then only
    decides whether the weights stay float32 or are cast to ``dtype``);
  * complex or integer inputs raise ``ValueError`` (Flax computes in complex
    or promotes integers to float);
  * a wrong shape raises ``ValueError`` naming the argument at trace time.

  ``num_heads=0`` is allowed (a fully pruned layer): no attention is computed,
  the output is the out-projection bias alone (what a model with every head
  masked gives), and the weights are ``[..., 0, Lq, Lk]``.

  Attributes:
    num_heads: number of heads H.
    dtype: computation dtype (default: inferred from inputs and parameters).
    param_dtype: parameter dtype.
    qkv_features: total width H * Dh of queries, keys and values; defaults to
      the query input width.
    out_features: output width; defaults to the query input width.
    broadcast_dropout: one attention-dropout mask shared across batch and
      heads (True, Flax's default) or one per element.
    dropout_rate: dropout on the attention weights.
    deterministic: disables dropout when True; merged with the call's
      argument (exactly one of them is set when ``dropout_rate > 0``).
    precision: matmul precision.
    kernel_init: initializer of the kernels.
    out_kernel_init: initializer of the out kernel (None: ``kernel_init``).
    bias_init: initializer of the biases.
    out_bias_init: initializer of the out bias (None: ``bias_init``).
    use_bias: whether the projections have biases.
    attention_fn: the attention of the projected heads. The default is this
      module's :func:`dot_product_attention`; another function is called as
      Flax calls it (keyword arguments it does not take are left out; with
      ``module=self`` when sowing) and may return the context alone (then
      the weights are None) or ``(context, weights)``.
    decode: autoregressive decoding with a cache of keys and values: the
      first call (``init``) sizes the cache from its inputs, each later call
      takes one position.
    normalize_qk: LayerNorm (no bias) on queries and keys (ViT-22B).
    force_fp32_for_softmax: weights in float32 whatever ``dtype``.
    qkv_dot_general, out_dot_general, qkv_dot_general_cls,
      out_dot_general_cls: the ``dot_general`` of the projections
      (deprecated in Flax).
    qk_attn_weights_einsum_cls, attn_weights_value_einsum_cls: factories of
      the two attention einsums (for quantized einsums).
    weights_from_lse: where cuDNN flash attention runs (an NVIDIA GPU,
      16-bit floats), when the weights are wanted and dropout is off, run it
      with its residual (the log-sum-exp) and rebuild the weights as
      ``exp(logits - lse)`` in float32, instead of the unfused path (which
      runs everywhere else either way).
    num_kv_heads: heads of keys and values (grouped-query attention, Ainslie
      et al. 2023): the ``key``/``value`` kernels are ``[D_in, H_kv, Dh]``
      and each key/value head serves ``num_heads / num_kv_heads`` query heads
      (query head n reads ``n // (num_heads / num_kv_heads)``, as in
      ``flax.nnx.MultiHeadAttention`` and ``jax.nn.dot_product_attention``);
      so does the decode cache. The weights stay ``[..., H, Lq, Lk]``, one
      per query head, and ``head_mask`` gates query heads. None (default):
      ``num_heads``, the parameter tree above exactly. ``num_heads`` must be
      a multiple of it (``ValueError`` naming both otherwise).
  """

  num_heads: int
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  broadcast_dropout: bool = True
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  precision: Precision = None
  kernel_init: Initializer = nn.linear.default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  out_bias_init: Initializer | None = None
  use_bias: bool = True
  attention_fn: Callable[..., Any] = dot_product_attention
  decode: bool = False
  normalize_qk: bool = False
  force_fp32_for_softmax: bool = False
  qkv_dot_general: Any = None
  out_dot_general: Any = None
  qkv_dot_general_cls: Any = None
  out_dot_general_cls: Any = None
  qk_attn_weights_einsum_cls: Callable[..., Callable[..., Array]] | None = None
  attn_weights_value_einsum_cls: Callable[..., Callable[..., Array]] | None = (
      None)
  weights_from_lse: bool = False
  num_kv_heads: int | None = None

  @nn.compact
  def __call__(
      self,
      inputs_q: Array,
      inputs_k: Array | None = None,
      inputs_v: Array | None = None,
      *,
      inputs_kv: Array | None = None,
      mask: Array | None = None,
      deterministic: bool | None = None,
      dropout_rng: Array | None = None,
      sow_weights: bool = False,
      valid_lens: Array | None = None,
      head_mask: Array | None = None,
      return_weights: bool = True,
  ) -> tuple[Array, Array | None]:
    """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v``.

    Args:
      inputs_q: queries ``[..., Lq, D_q]`` (``[Lq, D_q]`` unbatched works).
      inputs_k: keys ``[..., Lk, D_k]``; defaults to ``inputs_q``.
      inputs_v: values ``[..., Lk, D_v]``; defaults to ``inputs_k``.
      inputs_kv: keys and values at once (deprecated, as in Flax).
      mask: boolean, True = may attend, broadcastable to ``[..., H, Lq, Lk]``.
      deterministic: disables attention dropout when True; merged with the
        field of the same name.
      dropout_rng: the dropout key; default ``self.make_rng("dropout")``.
      sow_weights: also sow the weights into ``intermediates`` as
        ``attention_weights`` (apply with ``mutable=["intermediates"]``).
      valid_lens: integer ``[...]`` or ``[..., Lq]``; keys at positions
        ``>= valid_lens`` get zero weight. Combined with ``mask`` if both.
      head_mask: float ``[H]`` or ``[..., H]`` gating each head's context.
      return_weights: when False, returns ``(out, None)`` through the fused
        path (unless dropout is active, or ``precision``, einsum factories or
        another ``attention_fn`` are set).

    Returns:
      ``(out, weights)``: ``out [..., Lq, out_features]`` and the softmax
      weights ``[..., H, Lq, Lk]`` (or None).
    """
    inputs_k, inputs_v = _resolve_inputs(inputs_q, inputs_k, inputs_v,
                                         inputs_kv)
    _check_inputs(inputs_q, inputs_k, inputs_v)
    batch_shape = inputs_q.shape[:-2]
    qkv_features, features = self._widths(inputs_q.shape[-1])
    if head_mask is not None:
      head_mask = _check_head_mask(head_mask, batch_shape, self.num_heads)
    if self.num_heads == 0:
      self._masks(mask, valid_lens, None, batch_shape, inputs_q.shape[-2],
                  inputs_k.shape[-2])  # Checked all the same.
      return self._no_heads(inputs_q, inputs_k, features, return_weights)

    query, key, value = self._project(inputs_q, inputs_k, inputs_v,
                                      qkv_features // self.num_heads)
    decode_mask = None
    if self.decode:
      key, value, decode_mask = self._update_cache(query, key, value)
    mask, kv_lengths = self._masks(mask, valid_lens, decode_mask, batch_shape,
                                   query.shape[-3], key.shape[-3])
    deterministic, dropout_rng = self._dropout_setup(deterministic,
                                                     dropout_rng)
    context, weights = self._attend(
        query, key, value, mask, kv_lengths, deterministic=deterministic,
        dropout_rng=dropout_rng, want_weights=return_weights or sow_weights,
        sow_weights=sow_weights)
    context = _gate_heads(context, head_mask)
    out = self._out(context, features)
    return out, (weights if return_weights else None)

  def _widths(self, input_width: int) -> tuple[int, int]:
    """``(qkv_features, out_features)``, both defaulting to the width of the
    queries; raises ``ValueError`` if the heads cannot split the first."""
    qkv_features = (input_width if self.qkv_features is None
                    else self.qkv_features)
    if self.num_heads < 0:
      raise ValueError(f"num_heads must be >= 0, got {self.num_heads}.")
    if self.num_heads and qkv_features % self.num_heads:
      raise ValueError(
          f"qkv_features ({qkv_features}) must be divisible by num_heads "
          f"({self.num_heads}).")
    _check_groups(self.num_heads, self._kv_heads)
    return qkv_features, (input_width if self.out_features is None
                          else self.out_features)

  @property
  def _kv_heads(self) -> int:
    """Heads of keys and values (``num_kv_heads``, default ``num_heads``)."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def _no_heads(self, inputs_q: Array, inputs_k: Array, features: int,
                return_weights: bool) -> tuple[Array, Array | None]:
    """A layer with zero heads: the out bias alone, and empty weights."""
    batch_shape, lq = inputs_q.shape[:-2], inputs_q.shape[-2]
    dtype = self.dtype or jnp.result_type(inputs_q, self.param_dtype)
    weights = jnp.zeros(batch_shape + (0, lq, inputs_k.shape[-2]), dtype)
    if self.use_bias:
      out = _OutBias(features, self.param_dtype,
                     self.out_bias_init or self.bias_init,
                     name="out")(batch_shape + (lq,), dtype)
    else:
      out = jnp.zeros(batch_shape + (lq, features), dtype)
    return out, (weights if return_weights else None)

  def _project(self, inputs_q: Array, inputs_k: Array, inputs_v: Array,
               head_dim: int) -> tuple[Array, Array, Array]:
    """Queries, keys and values ``[..., L, H, Dh]`` (Flax's projections)."""
    dense = functools.partial(
        nn.DenseGeneral,
        axis=-1,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=self.kernel_init,
        bias_init=self.bias_init,
        use_bias=self.use_bias,
        precision=self.precision,
        dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls,
    )
    kv_features = (self._kv_heads, head_dim)
    query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
    key = dense(features=kv_features, name="key")(inputs_k)
    value = dense(features=kv_features, name="value")(inputs_v)
    if self.normalize_qk:
      # Normalizing queries and keys stabilizes training at higher learning
      # rates (ViT-22B, arxiv.org/abs/2302.05442).
      norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype)
      query = norm(name="query_ln")(query)
      key = norm(name="key_ln")(key)
    return query, key, value

  def _update_cache(self, query: Array, key: Array,
                    value: Array) -> tuple[Array, Array, Array | None]:
    """Flax's decode cache: ``(keys, values, mask)`` of every position so far
    (the cache is written at ``cache_index``, then the index advances); the
    first call only creates the cache and attends over its own inputs."""
    is_initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape,
                               key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                 value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index",
                                lambda: jnp.array(0, dtype=jnp.int32))
    if not is_initialized:
      return key, value, None
    *batch_dims, _, num_kv_heads, depth = cached_key.value.shape
    expected = tuple(batch_dims) + (1, num_kv_heads, depth)
    # Flax's check is on the query; with grouped heads, on the key.
    name, got = (("query", query) if self.num_kv_heads is None
                 else ("key", key))
    if expected != got.shape:
      raise ValueError(f"Autoregressive cache shape error, expected {name} "
                       f"shape {expected} instead got {got.shape}.")
    key, value, cache_index.value, mask = _decode_step(
        cached_key.value, cached_value.value, cache_index.value, key, value)
    cached_key.value, cached_value.value = key, value
    return key, value, mask

  def _masks(self, mask: Array | None, valid_lens: Array | None,
             decode_mask: Array | None, batch_shape: tuple[int, ...],
             lq: int, lk: int) -> tuple[Array | None, Array | None]:
    """``(mask, kv_lengths)`` of :func:`_layer_masks`."""
    return _layer_masks(mask, valid_lens, decode_mask, batch_shape,
                        self.num_heads, lq, lk)

  def _dropout_setup(self, deterministic: bool | None,
                     dropout_rng: Array | None) -> tuple[bool, Array | None]:
    """Flax's rule: ``deterministic`` is needed only with dropout, from the
    field or the call (not both); the key from the call or the ``dropout``
    stream."""
    if self.dropout_rate <= 0.0:
      return True, dropout_rng
    deterministic = nn.merge_param("deterministic", self.deterministic,
                                   deterministic)
    if not deterministic and dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    return deterministic, dropout_rng

  def _einsums(self) -> tuple[Callable | None, Callable | None]:
    make = lambda cls: cls() if cls else None
    return (make(self.qk_attn_weights_einsum_cls),
            make(self.attn_weights_value_einsum_cls))

  def _attend(self, query: Array, key: Array, value: Array,
              mask: Array | None, kv_lengths: Array | None, *,
              deterministic: bool, dropout_rng: Array | None,
              want_weights: bool,
              sow_weights: bool) -> tuple[Array, Array | None]:
    """``(context, weights or None)`` of the projected heads: another
    ``attention_fn``, or :func:`_attend_heads` (sown if asked)."""
    shape = query.shape[:-3] + (self.num_heads, query.shape[-3],
                                key.shape[-3])  # [..., H, Lq, Lk]
    if self.attention_fn is not dot_product_attention:
      return self._custom_attention(
          query, key, value, _lengths_or_mask(mask, kv_lengths, shape),
          deterministic, dropout_rng, sow_weights)
    qk_einsum, av_einsum = self._einsums()
    context, weights = _attend_heads(
        query, key, value, mask, kv_lengths, dropout_rng=dropout_rng,
        dropout_rate=self.dropout_rate, deterministic=deterministic,
        broadcast_dropout=self.broadcast_dropout, dtype=self.dtype,
        precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        qk_einsum=qk_einsum, av_einsum=av_einsum, want_weights=want_weights,
        weights_from_lse=self.weights_from_lse)
    if sow_weights:
      self.sow("intermediates", "attention_weights", weights)
    return context, weights

  def _custom_attention(self, query: Array, key: Array, value: Array,
                        mask: Array | None, deterministic: bool,
                        dropout_rng: Array | None,
                        sow_weights: bool) -> tuple[Array, Array | None]:
    """Another ``attention_fn``, called as Flax calls it."""
    qk_einsum, av_einsum = self._einsums()
    kwargs = dict(
        mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
        dtype=self.dtype, precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_einsum,
        attn_weights_value_einsum=av_einsum)
    accepted = inspect.signature(self.attention_fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    if sow_weights:
      kwargs["module"] = self
    result = self.attention_fn(query, key, value, **kwargs)
    return result if isinstance(result, tuple) else (result, None)

  def _out(self, context: Array, features: int) -> Array:
    """The output projection of ``context [..., Lq, H, Dh]``."""
    return nn.DenseGeneral(
        features=features,
        axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls,
        name="out",
    )(context)
