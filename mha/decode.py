"""Generation from a causal Transformer through a cache of keys and values.

The model with ``decode=True`` (:class:`mha.model.Transformer`) takes one
position a call and keeps every layer's keys and values so far in Flax's
``cache`` collection (``cached_key``/``cached_value`` ``[B, L, H_kv, Dh]``,
``cache_index``), so a token costs one position's work instead of the whole
prefix's. The loop over positions is one ``lax.scan`` under ``jit``:

    cache = decode.init_cache(config, batch_size=1, length=64)
    tokens = decode.generate(config, params, prompt, num_tokens=32,
                             rng=jax.random.key(0), temperature=0.8)

``temperature=0`` is greedy. The prompt is read through the cache one token a
step as well (no separate prefill), every row of a batch with a prompt of
the same length. Token 0 is padding and is never generated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mha.aliases import Array, Params
from mha.model import Transformer, TransformerConfig

Cache = Any  # The 'cache' collection: a nested dict of arrays.


def decoder(config: TransformerConfig) -> Transformer:
  """The model of ``config`` in decode mode (the same parameters)."""
  if not config.causal:
    raise ValueError("only a causal model (causal=True) generates; this one "
                     "is an encoder")
  return Transformer(dataclasses.replace(config, decode=True))


def init_cache(config: TransformerConfig, batch_size: int,
               length: int) -> Cache:
  """An empty cache for ``batch_size`` sequences of up to ``length``
  positions (at most ``config.max_len``): zeros, every index at 0."""
  if not 1 <= length <= config.max_len:
    raise ValueError(f"a cache of {length} positions: the model has 1 to "
                     f"max_len = {config.max_len}")
  model = decoder(config)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.ones((batch_size, length), jnp.int32)))["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decode_step(config: TransformerConfig, params: Params, cache: Cache,
                tokens_B: Array, head_mask: Array | None = None
                ) -> tuple[Array, Cache]:
  """Reads the tokens ``[B]`` at the cache's next position: their logits
  ``[B, V]`` (the distribution of the token after them) and the cache with
  them written."""
  (logits, _), variables = decoder(config).apply(
      {"params": params, "cache": cache}, tokens_B[:, None],
      head_mask=head_mask, return_weights=False, mutable=["cache"])
  return logits[:, 0], variables["cache"]


@functools.partial(jax.jit, static_argnames="config")
def cached_logits(config: TransformerConfig, params: Params, tokens: Array,
                  head_mask: Array | None = None) -> Array:
  """The logits ``[B, L, V]`` of ``tokens [B, L]`` read one position a step
  through the cache: the full causal forward pass's, computed as generation
  computes them (what the tests compare)."""
  batch_size, length = tokens.shape

  def step(cache, tokens_B):
    logits, cache = decode_step(config, params, cache, tokens_B, head_mask)
    return cache, logits

  _, logits_LxBxV = jax.lax.scan(
      step, init_cache(config, batch_size, length), tokens.T)
  return jnp.swapaxes(logits_LxBxV, 0, 1)


def next_token(logits_BxV: Array, rng: Array, temperature: Array | float
               ) -> Array:
  """The token ``[B]`` after ``logits [B, V]``: the argmax when
  ``temperature`` is 0, else a draw from ``softmax(logits / temperature)``;
  never token 0 (padding)."""
  logits_BxV = logits_BxV.astype(jnp.float32).at[:, 0].set(-jnp.inf)
  greedy = jnp.argmax(logits_BxV, axis=-1)
  scale = jnp.where(temperature > 0, temperature, 1.0)
  drawn = jax.random.categorical(rng, logits_BxV / scale, axis=-1)
  return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def check_prompt(config: TransformerConfig, prompt: Array,
                 num_tokens: int) -> None:
  """Raises ``ValueError`` (one line) unless ``prompt`` is integer ``[B, P]``
  with ``P >= 1`` tokens in ``1..vocab_size - 1`` and ``P + num_tokens`` fits
  the model's ``max_len``."""
  if not jnp.issubdtype(prompt.dtype, jnp.integer) or prompt.ndim != 2:
    raise ValueError(f"the prompt must be integer tokens [batch, length], got "
                     f"{prompt.dtype} {tuple(prompt.shape)}")
  if prompt.shape[1] < 1:
    raise ValueError("the prompt is empty: give at least one token")
  if num_tokens < 1:
    raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
  outside = np.asarray(prompt)[(np.asarray(prompt) < 1)
                              | (np.asarray(prompt) >= config.vocab_size)]
  if outside.size:
    raise ValueError(f"prompt token {int(outside[0])} is not a token of the "
                     f"model: they are 1 to {config.vocab_size - 1} (0 is "
                     "padding)")
  if prompt.shape[1] + num_tokens > config.max_len:
    raise ValueError(
        f"a prompt of {prompt.shape[1]} tokens and {num_tokens} more exceed "
        f"the model's {config.max_len} positions")


def encode_text(names: tuple[str, ...] | None, text: str) -> list[int]:
  """The token ids of ``text``, one a character, where ``names`` (a task's
  ``mha.data.token_names``, indexed by id) are single characters.

  Raises:
    ValueError: a task whose tokens are not characters, or a character that
      is no token.
  """
  if names is None or not all(len(n) == 1 for n in names[1:]):
    raise ValueError("this task's tokens are not characters: give the prompt "
                     "as token ids")
  ids = {name: i for i, name in enumerate(names) if i}
  for char in text:
    if char not in ids:
      raise ValueError(f"{char!r} is not a token of this task")
  return [ids[char] for char in text]


def generate(config: TransformerConfig, params: Params, prompt: Array,
             num_tokens: int, *, rng: Array, temperature: float = 0.0,
             head_mask: Array | None = None) -> Array:
  """``prompt [B, P]`` followed by ``num_tokens`` generated tokens: ``[B, P +
  num_tokens]``, greedy with ``temperature=0`` (see :func:`next_token`).

  Raises:
    ValueError: an encoder, or a prompt :func:`check_prompt` refuses.
  """
  prompt = jnp.asarray(prompt)
  decoder(config)  # An encoder is refused before anything is traced.
  check_prompt(config, prompt, num_tokens)
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  return _generate(config, params, prompt, num_tokens, rng,
                   jnp.float32(temperature), head_mask)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens"))
def _generate(config: TransformerConfig, params: Params, prompt: Array,
              num_tokens: int, rng: Array, temperature: Array,
              head_mask: Array | None) -> Array:
  """:func:`generate`, its arguments checked: one scan over the positions,
  each step reading token t and writing token t + 1 (the prompt's while it
  lasts)."""
  batch_size, prompt_len = prompt.shape
  length = prompt_len + num_tokens
  tokens = jnp.zeros((batch_size, length), jnp.int32).at[:, :prompt_len].set(
      prompt)

  def step(carry, t):
    tokens, cache = carry
    logits, cache = decode_step(config, params, cache, tokens[:, t],
                                head_mask)
    chosen = next_token(logits, jax.random.fold_in(rng, t), temperature)
    chosen = jnp.where(t + 1 < prompt_len, tokens[:, t + 1], chosen)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, chosen[:, None],
                                                 t + 1, axis=1)
    return (tokens, cache), None

  (tokens, _), _ = jax.lax.scan(
      step, (tokens, init_cache(config, batch_size, length)),
      jnp.arange(length - 1))
  return tokens
