"""Multi-head attention as a Flax NNX module that returns its weights.

:class:`MultiHeadAttention` is a drop-in for ``flax.nnx.MultiHeadAttention``
(Flax 0.12.8): every constructor and call argument, in Flax's order and with
Flax's defaults, the same attributes and the same submodules (``query``,
``key``, ``value``, ``out`` as ``nnx.LinearGeneral``; ``query_ln``/``key_ln``
as ``nnx.LayerNorm`` with ``normalize_qk``; the ``rngs`` dropout stream; the
``cached_key``/``cached_value``/``cache_index`` caches), built in Flax's
order, so that the same ``nnx.Rngs`` give the same parameters and
``nnx.state`` of one updates the other. What it computes is not Flax's code:
the projections go through the pure functions of :mod:`mha.attention` (the
masks, the decode step, the weights or fused path, the head gate), so the
NNX and Linen layers share one attention. It returns ``(out, weights)`` and
takes the Linen layer's ``valid_lens``, ``head_mask`` and
``return_weights``; ``num_kv_heads`` is grouped-query attention.

A trained Linen model from NNX: ``mha.checkpoint.transformer_from_checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import functools
from types import MappingProxyType
from typing import Any

from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_kernel_init
import jax.numpy as jnp

from mha import attention as att
from mha.aliases import Array
from mha.run import arguments

Dtype = Any
Initializer = Callable[..., Array]
PromoteDtypeFn = Callable[..., Any]

__all__ = ["MultiHeadAttention"]


def _first_set(name: str, *values: Any) -> Any:
  """The first value that is not None (the call's, then the module's), as
  Flax takes ``decode`` and ``deterministic``; ``ValueError`` if none is."""
  for value in values:
    if value is not None:
      return value
  raise ValueError(
      f"No `{name}` argument was provided to MultiHeadAttention as either a "
      "__call__ argument or a class attribute.")


def _causal(lq: int, lk: int) -> Array:
  """``[Lq, Lk]`` lower-triangular from the top left: query i sees keys
  ``<= i`` (``is_causal`` as ``jax.nn.dot_product_attention`` and Flax's
  NNX layer read it, also when ``Lq != Lk``)."""
  return jnp.tril(jnp.ones((lq, lk), dtype=bool))


class MultiHeadAttention(nnx.Module):
  """Multi-head attention that returns ``(out, weights)``: a drop-in for
  ``flax.nnx.MultiHeadAttention``.

  The constructor's arguments are Flax's, with Flax's meaning and defaults
  (see ``flax.nnx.MultiHeadAttention``); so are the attributes they set and
  ``head_dim``. Parameters: ``query`` kernel ``[in_features, H, Dh]``,
  ``key``/``value`` kernels ``[in_kv_features, H_kv, Dh]``, biases ``[H,
  Dh]``/``[H_kv, Dh]``, ``out`` kernel ``[H, Dh, out_features]`` and bias
  ``[out_features]``; ``query_ln``/``key_ln`` scales ``[Dh]`` with
  ``normalize_qk``.

  Where it differs from Flax's layer, on purpose (as the Linen layer does):

  * the softmax runs in float32 whatever ``dtype`` (Flax: in ``dtype`` on
    its weights path);
  * a query row with no valid key gets zero weights and a zero context;
  * ``attention_fn`` defaults to :func:`mha.attention.dot_product_attention`
    (another function is called with the keyword arguments Flax passes, and
    may return the context or ``(context, weights)``);
  * ``set_view(decode=True, batch_size=..., max_length=...)`` creates the
    cache when there is none (Flax 0.12.8 tests ``hasattr``, always true, and
    so never creates it);
  * ``num_heads`` not a multiple of ``num_kv_heads`` raises our
    ``ValueError`` (naming both), worded differently from Flax's.

  Args:
    num_heads: query heads H; ``qkv_features`` must be divisible by it.
    in_features: width of the query inputs.
    qkv_features: total width H * Dh of queries, keys and values (default
      ``in_features``).
    out_features: output width (default ``in_features``).
    num_kv_heads: key/value heads ``H_kv`` (default ``num_heads``); fewer is
      grouped-query attention, query head n reading key/value head
      ``n // (H / H_kv)``.
    in_kv_features: width of the key/value inputs (default ``in_features``).
    dtype: computation dtype (default: from inputs and parameters).
    param_dtype: parameter dtype.
    broadcast_dropout: one attention-dropout mask shared over batch and heads.
    dropout_rate: dropout on the attention weights.
    deterministic: disables dropout; the call's argument takes precedence.
    precision: matmul precision.
    kernel_init, out_kernel_init, bias_init, out_bias_init: initializers (the
      ``out_`` ones default to the others).
    use_bias: whether the projections have biases.
    attention_fn: the attention of the projected heads (see above).
    decode: autoregressive decoding through the cache (``init_cache`` first);
      the call's argument takes precedence.
    normalize_qk: LayerNorm (no bias) on queries and keys (ViT-22B).
    qkv_promote_dtype, out_promote_dtype, ln_promote_dtype: dtype promotion
      of the projections and norms (Flax's).
    qkv_dot_general, out_dot_general, qkv_dot_general_cls,
      out_dot_general_cls: the projections' ``dot_general`` (deprecated in
      Flax).
    rngs: ``nnx.Rngs`` for the parameters (and the dropout stream).
    keep_rngs: keep a fork of the dropout stream as ``self.rngs`` when
      ``dropout_rate > 0``.
    kernel_metadata, out_kernel_metadata, bias_metadata, out_bias_metadata,
      query_ln_scale_metadata, key_ln_scale_metadata: metadata of the
      parameters' variables.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      broadcast_dropout: bool = True,
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      precision: Any = None,
      kernel_init: Initializer = default_kernel_init,
      out_kernel_init: Initializer | None = None,
      bias_init: Initializer = nnx.initializers.zeros_init(),
      out_bias_init: Initializer | None = None,
      use_bias: bool = True,
      attention_fn: Callable[..., Any] = att.dot_product_attention,
      decode: bool | None = None,
      normalize_qk: bool = False,
      qkv_promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
      out_promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
      ln_promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
      qkv_dot_general: Any = None,
      out_dot_general: Any = None,
      qkv_dot_general_cls: Any = None,
      out_dot_general_cls: Any = None,
      rngs: nnx.Rngs,
      keep_rngs: bool = True,
      kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
      key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    arguments.check_count("num_heads", num_heads)
    arguments.check_count("in_features", in_features)
    for name, value in (("qkv_features", qkv_features),
                        ("out_features", out_features),
                        ("num_kv_heads", num_kv_heads),
                        ("in_kv_features", in_kv_features)):
      arguments.check_count(name, value, none="the default")
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = in_features if qkv_features is None else qkv_features
    self.out_features = in_features if out_features is None else out_features
    self.in_kv_features = (in_features if in_kv_features is None
                           else in_kv_features)
    self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    att._check_groups(self.num_heads, self.num_kv_heads)
    if self.num_heads < 1 or self.qkv_features % self.num_heads:
      raise ValueError(
          f"qkv_features ({self.qkv_features}) must be divisible by "
          f"num_heads ({self.num_heads}), at least 1.")
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.broadcast_dropout = broadcast_dropout
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.precision = precision
    self.use_bias = use_bias
    self.attention_fn = attention_fn
    self.decode = decode
    self.normalize_qk = normalize_qk
    self.qkv_promote_dtype = qkv_promote_dtype
    self.out_promote_dtype = out_promote_dtype
    self.ln_promote_dtype = ln_promote_dtype
    self.qkv_dot_general = qkv_dot_general
    self.out_dot_general = out_dot_general
    self.qkv_dot_general_cls = qkv_dot_general_cls
    self.out_dot_general_cls = out_dot_general_cls
    self.head_dim = self.qkv_features // self.num_heads

    # Flax's submodules, created in Flax's order: the same rngs draw the same
    # parameters.
    common = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                  precision=precision, rngs=rngs)
    projection = functools.partial(
        nnx.LinearGeneral, kernel_init=kernel_init, bias_init=bias_init,
        promote_dtype=qkv_promote_dtype, dot_general=qkv_dot_general,
        dot_general_cls=qkv_dot_general_cls, kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata, **common)
    kv_shape = (self.num_kv_heads, self.head_dim)
    self.query = projection(in_features,
                            out_features=(num_heads, self.head_dim))
    self.key = projection(self.in_kv_features, out_features=kv_shape)
    self.value = projection(self.in_kv_features, out_features=kv_shape)
    if normalize_qk:
      norm = functools.partial(nnx.LayerNorm, self.head_dim, use_bias=False,
                               dtype=dtype, param_dtype=param_dtype,
                               promote_dtype=ln_promote_dtype, rngs=rngs)
      self.query_ln = norm(scale_metadata=query_ln_scale_metadata)
      self.key_ln = norm(scale_metadata=key_ln_scale_metadata)
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)
    self.out = nnx.LinearGeneral(
        in_features=(num_heads, self.head_dim),
        out_features=self.out_features, axis=(-2, -1),
        kernel_init=out_kernel_init or kernel_init,
        bias_init=out_bias_init or bias_init,
        promote_dtype=out_promote_dtype, dot_general=out_dot_general,
        dot_general_cls=out_dot_general_cls,
        kernel_metadata=out_kernel_metadata or kernel_metadata,
        bias_metadata=out_bias_metadata or bias_metadata, **common)
    self.rngs = (rngs.dropout.fork() if keep_rngs and dropout_rate > 0
                 else None)
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)

  def __call__(
      self,
      inputs_q: Array,
      inputs_k: Array | None = None,
      inputs_v: Array | None = None,
      *,
      mask: Array | None = None,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | nnx.RngStream | None = None,
      sow_weights: bool = False,
      decode: bool | None = None,
      is_causal=False,
      out_sharding=None,
      qkv_sharding=None,
      input_positions: Array | None = None,
      valid_lens: Array | None = None,
      head_mask: Array | None = None,
      return_weights: bool = True,
  ) -> tuple[Array, Array | None]:
    """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v``.

    Args:
      inputs_q: queries ``[..., Lq, in_features]``.
      inputs_k: keys ``[..., Lk, in_kv_features]``; default ``inputs_q``.
      inputs_v: values ``[..., Lk, in_kv_features]``; default ``inputs_k``.
      mask: boolean, True = may attend, broadcastable to ``[..., H, Lq,
        Lk]``.
      deterministic: disables dropout (before the attribute).
      rngs: the dropout key's source, ``nnx.Rngs`` (its ``dropout``
        stream) or an ``nnx.RngStream``; default ``self.rngs``.
      sow_weights: sow the weights as ``nnx.Intermediate``
        ``attention_weights``.
      decode: one position through the cache (before the attribute).
      is_causal: query i sees keys ``<= i`` (from the top left).
      out_sharding, qkv_sharding: output shardings of the output and the
        query/key/value projections.
      input_positions: positions ``[..., Lq]`` for an ``attention_fn`` that
        takes them (Flax's ``dot_product_attention_with_rope``, flax >=
        0.12.12), passed on as Flax's layer does; the default attention has
        no positions and refuses them.
      valid_lens: integer ``[...]`` or ``[..., Lq]``: keys at positions
        ``>= valid_lens`` get zero weight.
      head_mask: float ``[H]`` or ``[..., H]`` gating each query head's
        context before the output projection.
      return_weights: when False, ``(out, None)`` through the fused path
        (unless dropout is active, ``precision`` or another ``attention_fn``
        is set).

    Returns:
      ``(out, weights)``: ``out [..., Lq, out_features]`` and the softmax
      weights ``[..., H, Lq, Lk]`` (before dropout; or None).
    """
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("`inputs_k` cannot be None if `inputs_v` is not "
                         "None: pass the value to `inputs_k` alone.")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    att._check_inputs(inputs_q, inputs_k, inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(
          f"Incompatible input dimension, got {inputs_q.shape[-1]} but "
          f"module expects {self.in_features}.")
    batch_shape = inputs_q.shape[:-2]
    if head_mask is not None:
      head_mask = att._check_head_mask(head_mask, batch_shape, self.num_heads)

    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    extra_mask = None
    if _first_set("decode", decode, self.decode):
      key, value, extra_mask = self._decode_step(key, value)
    if is_causal:
      extra_mask = att.combine_masks(
          extra_mask, _causal(query.shape[-3], key.shape[-3]))
    mask, kv_lengths = att._layer_masks(
        mask, valid_lens, extra_mask, batch_shape, self.num_heads,
        query.shape[-3], key.shape[-3])
    deterministic, dropout_rng = self._dropout(deterministic, rngs)
    want_weights = return_weights or sow_weights
    if self.attention_fn is att.dot_product_attention:
      if input_positions is not None:
        raise ValueError(
            "`input_positions` is for an `attention_fn` that takes positions "
            "(e.g. flax.nnx.dot_product_attention_with_rope); the default "
            "attention has none.")
      context, weights = att._attend_heads(
          query, key, value, mask, kv_lengths, dropout_rng=dropout_rng,
          dropout_rate=self.dropout_rate, deterministic=deterministic,
          broadcast_dropout=self.broadcast_dropout, dtype=self.dtype,
          precision=self.precision, want_weights=want_weights)
      if sow_weights:
        self.sow(nnx.Intermediate, "attention_weights", weights)
    else:
      context, weights = self._custom_attention(
          query, key, value, mask, kv_lengths, deterministic, dropout_rng,
          sow_weights, input_positions)
    context = att._gate_heads(context, head_mask)
    out = self.out(context, out_sharding=out_sharding)
    return out, (weights if return_weights else None)

  def _decode_step(self, key: Array, value: Array
                   ) -> tuple[Array, Array, Array]:
    """Writes one position into the cache: ``(keys, values, mask)`` of every
    position so far."""
    if self.cached_key is None or self.cached_value is None or (
        self.cache_index is None):
      raise ValueError(
          "Autoregressive cache not initialized, call ``init_cache`` first.")
    cached_key = self.cached_key[...]
    expected = cached_key.shape[:-3] + (1,) + cached_key.shape[-2:]
    if key.shape != expected:
      raise ValueError("Autoregressive cache shape error, expected key shape "
                       f"{expected} instead got {key.shape}.")
    key, value, index, mask = att._decode_step(
        cached_key, self.cached_value[...], self.cache_index[...], key, value)
    self.cached_key[...] = key
    self.cached_value[...] = value
    self.cache_index[...] = index
    return key, value, mask

  def _dropout(self, deterministic: bool | None,
               rngs: nnx.Rngs | nnx.RngStream | None
               ) -> tuple[bool, Array | None]:
    """``(deterministic, dropout key or None)`` by Flax's rule: the flag is
    needed only with dropout; the key from the call's rngs, else the kept
    stream."""
    if self.dropout_rate <= 0.0:
      return True, None
    deterministic = _first_set("deterministic", deterministic,
                               self.deterministic)
    if deterministic:
      return True, None
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs.dropout
    rngs = self.rngs if rngs is None else rngs
    if rngs is None:
      raise ValueError(
          "'rngs' must be provided to __call__ method if MultiHeadAttention "
          "instance is defined with keep_rngs=False.")
    return False, rngs()

  def _custom_attention(self, query: Array, key: Array, value: Array,
                        mask: Array | None, kv_lengths: Array | None,
                        deterministic: bool, dropout_rng: Array | None,
                        sow_weights: bool, input_positions: Array | None = None
                        ) -> tuple[Array, Array | None]:
    """Another ``attention_fn``, called with the keyword arguments Flax's
    layer passes (the causal mask is already in ``mask``; ``input_positions``
    only when given, as Flax does)."""
    extra = {} if input_positions is None else {
        "input_positions": input_positions}
    shape = query.shape[:-3] + (self.num_heads, query.shape[-3],
                                key.shape[-3])
    result = self.attention_fn(
        query, key, value, mask=att._lengths_or_mask(mask, kv_lengths, shape),
        dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout,
        deterministic=deterministic, dtype=self.dtype,
        precision=self.precision, module=self if sow_weights else None,
        is_causal=False, **extra)
    return result if isinstance(result, tuple) else (result, None)

  def init_cache(self, input_shape: tuple[int, ...],
                 dtype: Dtype = jnp.float32) -> None:
    """Creates the decode cache for inputs of ``input_shape`` ``[...,
    max_length, in_features]``: keys and values ``[..., max_length, H_kv,
    Dh]`` of zeros and ``cache_index`` 0 (int32). Call it before decoding;
    then each call takes one position."""
    shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

  def set_view(self, deterministic: bool | None = None,
               decode: bool | None = None,
               batch_size: int | tuple[int, ...] | None = None,
               max_length: int | None = None) -> None:
    """What ``nnx.view`` sets: ``deterministic``, ``decode``, and with
    ``decode`` a cache of ``batch_size`` x ``max_length`` when there is none
    yet (``TypeError`` if either is missing then)."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is None:
      return
    self.decode = decode
    if decode and self.cached_key is None:
      if batch_size is None or max_length is None:
        raise TypeError("'batch_size' and 'max_length' must be provided when "
                        "initializing cache.")
      if isinstance(batch_size, int):
        batch_size = (batch_size,)
      self.init_cache((*batch_size, max_length, self.in_features),
                      self.dtype or jnp.float32)
