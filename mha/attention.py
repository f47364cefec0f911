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
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
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


def _check_qkv(query: Array, key: Array, value: Array) -> None:
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
  if not query.shape[-2] == key.shape[-2] == value.shape[-2]:
    raise ValueError(
        "query, key and value must have the same number of heads; got "
        f"query {query.shape}, key {key.shape}, value {value.shape}.")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
        f"query and key must have the same per-head width; got query "
        f"{query.shape}, key {key.shape}.")


def _check_mask(mask: Array, target: tuple[int, ...]) -> Array:
  """Validates ``mask`` against ``[..., H, Lq, Lk]``; returns it as bool."""
  mask = jnp.asarray(mask)
  try:
    ok = jnp.broadcast_shapes(mask.shape, target) == tuple(target)
  except ValueError:
    ok = False
  if not ok:
    raise _shape_error("mask", mask.shape,
                       f"a shape broadcastable to {tuple(target)}")
  return mask.astype(bool)


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


# Why a custom derivative. Differentiated through exp, sum and divide,
# softmax's backward pass keeps the exponentials and a broadcast of 1 / sum:
# two more [..., Lq, Lk] arrays than the rule below, which needs only the
# output y (dy = y * (dx - sum(y * dx))), so training keeps less per layer
# and the backward pass is faster (see scripts/benchmark.py).
#
# What JAX decided about its own: jax.nn.softmax got this same rule in
# jax-ml/jax#15677 (April 2023), with the `jax_softmax_custom_jvp` flag as a
# temporary way back to the old derivative. jax-ml/jax#16096 (May 2023)
# turned the rule off by default ("basically undoing it") after some long
# training runs failed after many steps with it on and not without, to stay
# off "until we diagnose the cause". In the installed JAX (0.10.2) the flag
# is still there and still False by default (jax/_src/config.py), so
# jax.nn.softmax differentiates through exp/sum/divide unless a program opts
# in. We could not find that the failures were ever diagnosed. We keep our
# own rule rather than flip the process-wide flag (it would change every
# other softmax in the program); tests/test_attention.py checks it against
# jax.nn.softmax's derivative (JVP, VJP, masked keys, fully masked rows,
# second derivatives).
@jax.custom_jvp
def _softmax(logits: Array) -> Array:
  """``jax.nn.softmax`` over the last axis, with a derivative that keeps only
  its output (see the comment above)."""
  unnormalized = jnp.exp(
      logits - jnp.max(logits, -1, keepdims=True, initial=-jnp.inf))
  return unnormalized / jnp.sum(unnormalized, -1, keepdims=True)


@_softmax.defjvp
def _softmax_jvp(primals, tangents):
  (logits,), (logits_dot,) = primals, tangents
  y = _softmax(logits)
  return y, y * (logits_dot - jnp.sum(y * logits_dot, -1, keepdims=True))


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    head_mask: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    precision: Precision = None,
) -> tuple[Array, Array]:
  """Scaled dot-product attention on per-head arrays, returning the weights.

  Args:
    query: ``[..., Lq, H, Dh]``.
    key: ``[..., Lk, H, Dh]``.
    value: ``[..., Lk, H, Dv]``.
    mask: optional boolean, True = may attend, broadcastable to
      ``[..., H, Lq, Lk]``.
    head_mask: optional float ``[H]`` or ``[..., H]``; multiplies each head's
      context (after attention, before any output projection).
    dropout_rate: dropout on the attention weights (applied to the weights
      used for the context, not to the returned weights).
    dropout_rng: PRNG key, needed when dropout is active.
    deterministic: disables dropout when True.
    precision: matmul precision for the two einsums.

  Returns:
    ``(context, weights)``: context ``[..., Lq, H, Dv]`` and the softmax
    weights ``[..., H, Lq, Lk]`` (before dropout, in the query dtype). Masked
    keys get exactly zero weight; rows with no valid key are all zero.
  """
  _check_qkv(query, key, value)
  batch_shape = query.shape[:-3]
  num_heads, depth = query.shape[-2], query.shape[-1]
  weights_shape = batch_shape + (num_heads, query.shape[-3], key.shape[-3])
  if mask is not None:
    mask = _full_mask(mask, weights_shape)
  if head_mask is not None:
    head_mask = _check_head_mask(head_mask, batch_shape, num_heads)
  dtype = query.dtype

  query = query / jnp.asarray(math.sqrt(depth), dtype)
  logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
  logits = logits.astype(jnp.float32)  # softmax in float32 whatever the dtype
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = _softmax(logits)
  if mask is not None:
    # Exact zeros for masked keys, and all-zero rows where nothing is valid
    # (the softmax of an all-masked row would be uniform otherwise).
    weights = jnp.where(mask, weights, 0.0)
  weights = weights.astype(dtype)

  probs = weights
  if not deterministic and dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError("dropout_rng is required when dropout is active.")
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / jnp.asarray(1.0 - dropout_rate, dtype),
                      jnp.zeros((), dtype))
  context = jnp.einsum("...hqk,...khd->...qhd", probs, value,
                       precision=precision)
  return _gate_heads(context, head_mask), weights


def fused_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    head_mask: Array | None = None,
) -> Array:
  """The context of :func:`dot_product_attention`, without the weights.

  Same semantics as the weights path: rows with no valid key give a zero
  context, ``head_mask`` gates heads. No dropout (use
  :func:`dot_product_attention` for training with dropout).

  The implementation is chosen per platform when the computation is lowered
  (``jax.lax.platform_dependent``). On CPU it is the math of
  :func:`dot_product_attention` with the weights dropped, which XLA:CPU
  fuses into one kernel (``QK^T``, softmax, product with the values), while
  ``jax.nn.dot_product_attention`` adds a copy of the ``[..., H, Lq, Lk]``
  probabilities (a layer 1.4x slower at batch 8, length 512, width 512).
  Elsewhere it runs ``jax.nn.dot_product_attention``, which uses its XLA
  implementation too unless called with ``implementation="cudnn"``.
  """
  _check_qkv(query, key, value)
  batch_shape = query.shape[:-3]
  num_heads = query.shape[-2]
  weights_shape = batch_shape + (num_heads, query.shape[-3], key.shape[-3])
  if mask is not None:
    mask = _full_mask(mask, weights_shape)
  if head_mask is not None:
    head_mask = _check_head_mask(head_mask, batch_shape, num_heads)
  context = jax.lax.platform_dependent(
      query, key, value, mask,
      cpu=lambda q, k, v, m: dot_product_attention(q, k, v, mask=m)[0],
      default=_library_attention)
  return _gate_heads(context, head_mask)


def _library_attention(query: Array, key: Array, value: Array,
                       mask: Array | None) -> Array:
  """``jax.nn.dot_product_attention`` on ``[..., L, H, Dh]`` arrays, with
  all-masked query rows zeroed; ``mask`` is ``None`` or ``[..., H, Lq, Lk]``.
  """
  batch_shape = query.shape[:-3]
  # jax.nn.dot_product_attention wants exactly one batch axis.
  flat = lambda x: jnp.reshape(x, (-1,) + x.shape[-3:])
  row_ok = flat_mask = None
  if mask is not None:
    flat_mask = flat(mask)
    row_ok = jnp.swapaxes(jnp.any(mask, axis=-1), -1, -2)  # [..., Lq, H]
  context = jax.nn.dot_product_attention(
      flat(query), flat(key), flat(value), mask=flat_mask)
  context = jnp.reshape(context, batch_shape + context.shape[-3:])
  if row_ok is not None:
    context = context * row_ok[..., None].astype(context.dtype)
  return context


# --------------------------------------------------------------------------
# The Flax module.
# --------------------------------------------------------------------------


def _self_attention_defaults(inputs_q: Array, inputs_k: Array | None,
                             inputs_v: Array | None) -> tuple[Array, Array]:
  """``(inputs_k, inputs_v)``, defaulting to self-attention, after checking
  the three inputs' shapes agree."""
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("inputs_v was given without inputs_k.")
    inputs_k = inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
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
  return inputs_k, inputs_v


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
  """Multi-head attention that returns ``(out, weights)``.

  The parameter tree is exactly that of
  ``flax.linen.MultiHeadDotProductAttention`` with the same settings
  (``query``/``key``/``value`` kernels ``[D_in, H, Dh]`` and biases
  ``[H, Dh]``, ``out`` kernel ``[H, Dh, D_out]`` and bias ``[D_out]``), so a
  checkpoint of either loads into the other and gives the same outputs.

  ``num_heads=0`` is allowed (a fully pruned layer): no attention is computed,
  the output is the out-projection bias alone (what a model with every head
  masked gives), and the weights are ``[..., 0, Lq, Lk]``.

  Attributes:
    num_heads: number of heads H.
    qkv_features: total width H * Dh of queries, keys and values; defaults to
      the query input width.
    out_features: output width; defaults to the query input width.
    dropout_rate: dropout on the attention weights.
    use_bias: whether the projections have biases.
    dtype: computation dtype (the softmax is always float32).
    param_dtype: parameter dtype.
    kernel_init: initializer of the four kernels.
    bias_init: initializer of the biases.
    precision: matmul precision.
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  dropout_rate: float = 0.0
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  precision: Precision = None

  @nn.compact
  def __call__(
      self,
      inputs_q: Array,
      inputs_k: Array | None = None,
      inputs_v: Array | None = None,
      *,
      mask: Array | None = None,
      valid_lens: Array | None = None,
      head_mask: Array | None = None,
      deterministic: bool = True,
      return_weights: bool = True,
  ) -> tuple[Array, Array | None]:
    """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v``.

    Args:
      inputs_q: queries ``[..., Lq, D_q]`` (``[Lq, D_q]`` unbatched works).
      inputs_k: keys ``[..., Lk, D_k]``; defaults to ``inputs_q``.
      inputs_v: values ``[..., Lk, D_v]``; defaults to ``inputs_k``.
      mask: boolean, True = may attend, broadcastable to ``[..., H, Lq, Lk]``.
      valid_lens: integer ``[...]`` or ``[..., Lq]``; keys at positions
        ``>= valid_lens`` get zero weight. Combined with ``mask`` if both.
      head_mask: float ``[H]`` or ``[..., H]`` gating each head's context.
      deterministic: disables attention dropout when True.
      return_weights: when False, returns ``(out, None)`` through the fused
        ``jax.nn.dot_product_attention`` path (unless dropout is active).

    Returns:
      ``(out, weights)``: ``out [..., Lq, out_features]`` and the softmax
      weights ``[..., H, Lq, Lk]`` (or None).
    """
    inputs_k, inputs_v = _self_attention_defaults(inputs_q, inputs_k,
                                                  inputs_v)
    batch_shape = inputs_q.shape[:-2]
    lq, lk = inputs_q.shape[-2], inputs_k.shape[-2]
    num_heads = self.num_heads
    qkv_features, features = self._widths(inputs_q.shape[-1])
    dtype = self.dtype or jnp.result_type(inputs_q, self.param_dtype)

    mask = self._combined_mask(mask, valid_lens, batch_shape, num_heads, lq,
                               lk)
    if head_mask is not None:
      head_mask = _check_head_mask(head_mask, batch_shape, num_heads)

    if num_heads == 0:
      weights = jnp.zeros(batch_shape + (0, lq, lk), dtype)
      if self.use_bias:
        out = _OutBias(features, self.param_dtype, self.bias_init,
                       name="out")(batch_shape + (lq,), dtype)
      else:
        out = jnp.zeros(batch_shape + (lq, features), dtype)
      return out, (weights if return_weights else None)

    head_dim = qkv_features // num_heads
    dense = functools.partial(
        nn.DenseGeneral,
        axis=-1,
        features=(num_heads, head_dim),
        use_bias=self.use_bias,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=self.kernel_init,
        bias_init=self.bias_init,
        precision=self.precision,
    )
    query = dense(name="query")(inputs_q)
    key = dense(name="key")(inputs_k)
    value = dense(name="value")(inputs_v)

    context, weights = self._attend(query, key, value, mask, head_mask,
                                    deterministic=deterministic,
                                    return_weights=return_weights)
    out = nn.DenseGeneral(
        features=features,
        axis=(-2, -1),
        use_bias=self.use_bias,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=self.kernel_init,
        bias_init=self.bias_init,
        precision=self.precision,
        name="out",
    )(context)
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
    return qkv_features, (input_width if self.out_features is None
                          else self.out_features)

  def _attend(self, query: Array, key: Array, value: Array,
              mask: Array | None, head_mask: Array | None, *,
              deterministic: bool,
              return_weights: bool) -> tuple[Array, Array | None]:
    """``(context, weights)`` of the projected heads: the explicit path when
    the weights are wanted or dropout is on, else the fused one (no
    weights)."""
    use_dropout = not deterministic and self.dropout_rate > 0.0
    if return_weights or use_dropout:
      dropout_rng = self.make_rng("dropout") if use_dropout else None
      return dot_product_attention(
          query, key, value, mask=mask, head_mask=head_mask,
          dropout_rate=self.dropout_rate, dropout_rng=dropout_rng,
          deterministic=not use_dropout, precision=self.precision)
    return fused_dot_product_attention(
        query, key, value, mask=mask, head_mask=head_mask), None

  @staticmethod
  def _combined_mask(mask: Array | None, valid_lens: Array | None,
                     batch_shape: tuple[int, ...], num_heads: int, lq: int,
                     lk: int) -> Array | None:
    target = batch_shape + (num_heads, lq, lk)
    if mask is not None:
      mask = _check_mask(mask, target)
    if valid_lens is not None:
      valid_lens = jnp.asarray(valid_lens)
      if valid_lens.shape not in (batch_shape, batch_shape + (lq,)):
        raise _shape_error("valid_lens", valid_lens.shape,
                           f"{batch_shape} or {batch_shape + (lq,)}")
      per_query = valid_lens.shape == batch_shape + (lq,)
      mask = combine_masks(
          mask, padding_mask_from_lengths(valid_lens, lk, per_query=per_query))
    return mask
