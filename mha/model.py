"""An encoder-only Transformer built on :class:`mha.attention.MultiHeadAttention`.

The model predicts one output token per input position (the toy tasks are
per-position), and returns every layer's attention weights beside the logits:

    logits, attention = Transformer(config).apply(
        {"params": params}, tokens, head_mask=head_mask)

``config.num_heads`` may be an int or a per-layer tuple, so a model whose heads
were physically pruned (different head counts per layer, possibly zero) is an
ordinary model of this class.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from mha.aliases import Array
from mha.attention import MultiHeadAttention, padding_mask_from_tokens


POSITIONAL_KINDS = ("learned", "sinusoidal")
DTYPES = ("float32", "bfloat16")  # computation dtypes (model.dtype)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters of the encoder-only Transformer (static, hashable).

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
  """Self-attention and feed-forward sublayers with residual connections."""

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
  """Encoder-only Transformer for per-position prediction.

  Called as ``logits, attention = model(tokens, head_mask=..., ...)`` with
  tokens int ``[..., L]`` (0 = padding; the padding mask is derived from
  them), logits ``[..., L, vocab_size]`` and ``attention`` a tuple with one
  ``[..., H_l, L, L]`` array per layer (None entries when
  ``return_weights=False``).
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
    """Runs the encoder.

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
    mask = padding_mask_from_tokens(tokens)  # built once, passed down
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
