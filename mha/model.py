"""A Transformer built on :class:`mha.attention.MultiHeadAttention`.

The model predicts one output token per input position (the toy tasks are
per-position), and returns every layer's attention weights beside the logits:

    logits, attention = Transformer(config).apply(
        {"params": params}, tokens, head_mask=head_mask)

By default it is an encoder (every position sees the whole sequence); with
``TransformerConfig(causal=True)`` the same blocks get causal masks and it is
a decoder-only language model, position i predicting token i + 1; with
``num_kv_heads`` its heads share fewer heads of keys and values
(grouped-query attention). ``decode=True`` runs one position a call through
a cache of keys and values (Flax's ``cache`` collection; :mod:`mha.decode`
generates with it).

``config.num_heads`` may be an int or a per-layer tuple, so a model whose heads
were physically pruned (different head counts per layer, possibly zero) is an
ordinary model of this class.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mha.aliases import Array
from mha.attention import (MultiHeadAttention, causal_mask, combine_masks,
                           padding_mask_from_tokens)


POSITIONAL_KINDS = ("learned", "sinusoidal")
DTYPES = ("float32", "bfloat16")  # computation dtypes (model.dtype)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters of the Transformer (static, hashable).

  Attributes:
    vocab_size: size of the token space (inputs and outputs); 0 is padding.
    num_layers: number of encoder blocks.
    num_heads: heads per layer, an int or a tuple with one count per layer
      (0 allowed: that layer's attention computes nothing).
    d_model: residual stream width.
    mlp_dim: hidden width of the feed-forward blocks.
    max_len: longest input the position embedding covers.
    dropout_rate: dropout on embeddings and residual branches.
    attention_dropout_rate: dropout on attention weights.
    head_dim: per-head width; defaults to ``d_model // num_heads`` (required
      when ``num_heads`` is a tuple).
    pre_norm: pre-LayerNorm blocks (True) or post-LayerNorm (False).
    positional: "learned" or "sinusoidal" position embeddings.
    dtype: computation dtype, "float32" or "bfloat16" (a ``jnp`` dtype is
      taken too); parameters, the softmax and the loss stay float32.
    causal: a decoder: position i attends to positions <= i only (the
      padding mask still applies).
    num_kv_heads: heads of keys and values in every layer (grouped-query
      attention, Ainslie et al. 2023); it must divide every layer's head
      count. None: ``num_heads`` (the same parameters as before the field).
    decode: one position a call through the ``cache`` collection (needs
      ``causal``; the first call, ``init``, sizes the cache from its tokens).
  """

  vocab_size: int
  num_layers: int = 2
  num_heads: int | tuple[int, ...] = 4
  d_model: int = 64
  mlp_dim: int = 128
  max_len: int = 16
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  head_dim: int | None = None
  pre_norm: bool = True
  positional: str = "learned"
  dtype: str = "float32"
  causal: bool = False
  num_kv_heads: int | None = None
  decode: bool = False

  def __post_init__(self):
    if isinstance(self.num_heads, (list, tuple, np.ndarray)):
      object.__setattr__(self, "num_heads",
                         tuple(int(h) for h in self.num_heads))
      if len(self.num_heads) != self.num_layers:
        raise ValueError(
            f"num_heads has {len(self.num_heads)} entries but num_layers is "
            f"{self.num_layers}.")
      if self.head_dim is None:
        raise ValueError("head_dim is required when num_heads is per-layer.")
    elif self.num_heads < 1:
      raise ValueError(f"num_heads must be >= 1, got {self.num_heads}.")
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f"d_model ({self.d_model}) must be divisible by num_heads "
          f"({self.num_heads}).")
    if any(h < 0 for h in self.heads_per_layer):
      raise ValueError(f"head counts must be >= 0, got {self.num_heads}.")
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
    if self.positional not in POSITIONAL_KINDS:
      raise ValueError(f"positional must be one of {POSITIONAL_KINDS}, got "
                       f"{self.positional!r}.")
    if self.num_kv_heads is not None and (self.num_kv_heads < 1 or any(
        h % self.num_kv_heads for h in self.heads_per_layer)):
      raise ValueError(
          f"num_kv_heads ({self.num_kv_heads}) must be >= 1 and divide "
          f"num_heads ({self.num_heads}).")
    if self.decode and not self.causal:
      raise ValueError("decode=True needs a causal model (causal=True).")

  @property
  def heads_per_layer(self) -> tuple[int, ...]:
    """The head count of every layer."""
    if isinstance(self.num_heads, tuple):
      return self.num_heads
    return (self.num_heads,) * self.num_layers

  @property
  def resolved_head_dim(self) -> int:
    """Per-head width Dh."""
    if self.head_dim is not None:
      return self.head_dim
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    """``dtype`` as a ``jnp`` dtype."""
    return jnp.dtype(self.dtype)

  @property
  def max_heads(self) -> int:
    """The largest head count of any layer (the width of a dense head mask)."""
    return max(self.heads_per_layer, default=0)


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """The fixed sine/cosine position table ``[max_len, d_model]``."""
  pos = np.arange(max_len)[:, None]
  dim = np.arange(0, d_model, 2)[None, :]
  angle = pos / np.power(10000.0, dim / d_model)
  table = np.zeros((max_len, d_model), np.float32)
  table[:, 0::2] = np.sin(angle)
  table[:, 1::2] = np.cos(angle[:, : d_model // 2])
  return table


def attention_mask(config: TransformerConfig, tokens: Array) -> Array:
  """The mask every layer of the model gets for ``tokens [..., L]``: the
  padding mask ``[..., 1, L, L]`` (:func:`padding_mask_from_tokens`), and
  causal too when ``config.causal``."""
  mask = padding_mask_from_tokens(tokens)
  if config.causal:
    mask = combine_masks(mask, causal_mask(tokens.shape[-1]))
  return mask


class MlpBlock(nn.Module):
  """Position-wise feed-forward block: Dense, GELU, dropout, Dense."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    cfg = self.config
    y = nn.Dense(cfg.mlp_dim, dtype=cfg.compute_dtype, name="fc1")(x)
    y = nn.gelu(y)
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    return nn.Dense(x.shape[-1], dtype=cfg.compute_dtype, name="fc2")(y)


class EncoderBlock(nn.Module):
  """Self-attention and feed-forward sublayers with residual connections
  (the decoder's block too: the mask makes it causal)."""

  config: TransformerConfig
  num_heads: int

  @nn.compact
  def __call__(self, x: Array, mask: Array, head_mask: Array | None, *,
               deterministic: bool,
               return_weights: bool) -> tuple[Array, Array | None]:
    cfg = self.config
    norm = lambda name: nn.LayerNorm(dtype=cfg.compute_dtype, name=name)
    dropout = lambda y: nn.Dropout(cfg.dropout_rate)(
        y, deterministic=deterministic)

    y = norm("ln_attention")(x) if cfg.pre_norm else x
    y, weights = MultiHeadAttention(
        num_heads=self.num_heads,
        qkv_features=self.num_heads * cfg.resolved_head_dim,
        out_features=cfg.d_model,
        dropout_rate=cfg.attention_dropout_rate,
        # One dropout draw per weight (Flax's layer shares one across batch
        # and heads by default); the model has always dropped this way.
        broadcast_dropout=False,
        dtype=cfg.compute_dtype,
        num_kv_heads=cfg.num_kv_heads,
        decode=cfg.decode,
        name="attention",
    )(y, mask=mask, head_mask=head_mask, deterministic=deterministic,
      return_weights=return_weights)
    x = x + dropout(y)
    if not cfg.pre_norm:
      x = norm("ln_attention")(x)

    y = norm("ln_mlp")(x) if cfg.pre_norm else x
    y = MlpBlock(cfg, name="mlp")(y, deterministic=deterministic)
    x = x + dropout(y)
    if not cfg.pre_norm:
      x = norm("ln_mlp")(x)
    return x, weights


class Transformer(nn.Module):
  """Transformer for per-position prediction: an encoder, or with
  ``config.causal`` a decoder-only language model.

  Called as ``logits, attention = model(tokens, head_mask=..., ...)`` with
  tokens int ``[..., L]`` (0 = padding; the padding mask is derived from
  them), logits ``[..., L, vocab_size]`` and ``attention`` a tuple with one
  ``[..., H_l, L, L]`` array per layer (None entries when
  ``return_weights=False``).

  With ``config.decode`` each call after ``init`` takes tokens ``[..., 1]``
  at the next position and updates the ``cache`` collection (apply with
  ``mutable=["cache"]``); the attention is then ``[..., H_l, 1, L_cache]``.
  """

  config: TransformerConfig

  def setup(self) -> None:
    """The embeddings, one :class:`EncoderBlock` per layer and the read-out."""
    cfg = self.config
    self.token_embed = nn.Embed(
        cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
        embedding_init=nn.initializers.normal(stddev=1.0), name="embed")
    if cfg.positional == "learned":
      self.pos_embedding = self.param(
          "pos_embedding", nn.initializers.normal(stddev=0.5),
          (cfg.max_len, cfg.d_model))
    # The name the compact version gave it: the same dropout rngs.
    self.embed_dropout = nn.Dropout(cfg.dropout_rate, name="Dropout_0")
    self.blocks = [EncoderBlock(cfg, heads, name=f"layer_{layer}")
                   for layer, heads in enumerate(cfg.heads_per_layer)]
    if cfg.pre_norm:
      self.ln_final = nn.LayerNorm(dtype=cfg.compute_dtype, name="ln_final")
    self.logits_dense = nn.Dense(cfg.vocab_size, dtype=cfg.compute_dtype,
                                 name="logits")
    if cfg.decode:  # The position of the next token (wmt's cache_index).
      self.cache_index = self.variable("cache", "cache_index",
                                       lambda: jnp.array(0, jnp.int32))

  def embed(self, tokens: Array, *, deterministic: bool = True) -> Array:
    """The input of the first block: token embeddings plus positions,
    ``[..., L, d_model]`` (dropout unless ``deterministic``). Also
    ``model.apply(variables, tokens, method="embed")``."""
    cfg = self.config
    x = self.token_embed(tokens)
    if cfg.positional == "learned":
      pos = self.pos_embedding
    else:
      pos = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model))
    if cfg.decode and not self.is_initializing():
      index = self.cache_index.value
      self.cache_index.value = index + 1
      pos = jax.lax.dynamic_slice_in_dim(pos, index, 1)
    x = x + jnp.broadcast_to(pos[:tokens.shape[-1]].astype(x.dtype), x.shape)
    return self.embed_dropout(x, deterministic=deterministic)

  def readout(self, x: Array) -> Array:
    """The logits ``[..., L, vocab_size]`` of the last block's output (after
    the final LayerNorm of a pre-norm model). Also
    ``model.apply(variables, x, method="readout")``."""
    if self.config.pre_norm:
      x = self.ln_final(x)
    return self.logits_dense(x)

  def __call__(
      self,
      tokens: Array,
      *,
      head_mask: Array | Sequence[Array] | None = None,
      deterministic: bool = True,
      return_weights: bool = True,
  ) -> tuple[Array, tuple[Array | None, ...]]:
    """Runs the model.

    Args:
      tokens: int ``[..., L]``, ``L <= max_len``, 0 = padding.
      head_mask: float ``[num_layers, H]`` (or ``[..., num_layers, H]``) for a
        model with the same head count in every layer, or a sequence of one
        ``[H_l]`` array per layer (for a pruned model).
      deterministic: disables dropout when True (needs a 'dropout' rng
        otherwise).
      return_weights: when False the attention takes the fused path and the
        attention tuple holds None.

    Returns:
      ``(logits, attention)``: logits ``[..., L, vocab_size]`` and one
      attention-weights array ``[..., H_l, L, L]`` per layer (None with
      ``return_weights=False``).

    Raises:
      ValueError: tokens that are not integers or longer than ``max_len``,
        or a ``head_mask`` whose shape (or per-layer counts) does not match
        the model's heads.
    """
    cfg = self.config
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}.")
    if tokens.ndim < 1 or tokens.shape[-1] > cfg.max_len:
      raise ValueError(
          f"`tokens` has shape {tokens.shape}, expected [..., L] with "
          f"L <= max_len = {cfg.max_len}.")
    head_masks = self._split_head_mask(head_mask)
    x = self.embed(tokens, deterministic=deterministic)
    # Built once, passed down; when decoding, each layer's cache masks the
    # positions not yet written.
    mask = None if cfg.decode else attention_mask(cfg, tokens)
    attention = []
    for block, layer_mask in zip(self.blocks, head_masks):
      x, weights = block(x, mask, layer_mask, deterministic=deterministic,
                         return_weights=return_weights)
      attention.append(weights)
    return self.readout(x), tuple(attention)

  def _split_head_mask(
      self, head_mask: Array | Sequence[Array] | None
  ) -> list[Array | None]:
    cfg = self.config
    heads = cfg.heads_per_layer
    if head_mask is None:
      return [None] * cfg.num_layers
    if isinstance(head_mask, (list, tuple)):
      if len(head_mask) != cfg.num_layers:
        raise ValueError(
            f"head_mask has {len(head_mask)} per-layer entries, expected "
            f"num_layers = {cfg.num_layers}.")
      return list(head_mask)
    head_mask = jnp.asarray(head_mask)
    if len(set(heads)) != 1:
      raise ValueError(
          "a per-layer head count needs head_mask as a sequence of one [H_l] "
          f"array per layer; got an array of shape {head_mask.shape}.")
    if head_mask.ndim < 2 or head_mask.shape[-2:] != (cfg.num_layers,
                                                       heads[0]):
      raise ValueError(
          f"`head_mask` has shape {head_mask.shape}, expected "
          f"[num_layers, num_heads] = [{cfg.num_layers}, {heads[0]}].")
    return [head_mask[..., layer, :] for layer in range(cfg.num_layers)]
