"""Head roles: how much of each head's attention follows a simple pattern.

For every head, one score in ``[0, 1]`` per pattern, averaged over the valid
(non-padding) queries of a split, pooled over its examples. For query ``i``
of a sequence of valid length ``n`` with tokens ``x``:

* ``previous_position``: the weight on key ``i - 1`` (queries ``i >= 1``);
* ``next_position``: the weight on key ``i + 1`` (queries ``i <= n - 2``);
* ``same_position``: the weight on key ``i``;
* ``anti_diagonal``: the weight on key ``n - 1 - i`` (what ``reverse``
  needs);
* ``same_token``: the weight on the *other* keys holding the same token,
  ``{j != i : x[j] == x[i]}`` (what ``histogram`` needs; queries whose token
  occurs once are left out, and the query's own position does not count, so
  a head that attends to itself does not score here);
* ``diffuse``: the normalised entropy of the query's weights over the ``n``
  keys it may attend to (the valid keys; in a causal model, those up to
  the query), ``H(w) / log n = 1 - KL(w || uniform) / log n``: 1 for a
  uniform head, 0 for a head on one key (queries with ``n >= 2``).

The first five are attention *masses* on a pattern; ``diffuse`` is the
closeness to uniform. A query where a pattern has no key (the first query
for ``previous_position``, say) is left out of that pattern's mean, so a
head that follows a pattern exactly scores 1 on it.

    roles = head_roles(ckpt.model, ckpt.params, splits["test"], 1000)
    roles["anti_diagonal"]  # [layers, heads], NaN where a layer lacks a head

:func:`role_sums` is pure (``jit``/``vmap``); :func:`head_roles` loops over
the batches of a split on every device, as :func:`mha.evaluate.evaluate`
does.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mha import data
from mha.run import sharding as sharding_lib
from mha.aliases import Array
from mha.model import Transformer


#: The patterns, in the order they are shown.
PATTERNS: tuple[str, ...] = ("previous_position", "next_position",
                             "same_position", "anti_diagonal", "same_token",
                             "diffuse")
#: Short labels of the patterns (tables, the explorer).
LABELS: dict[str, str] = {
    "previous_position": "previous", "next_position": "next",
    "same_position": "same position", "anti_diagonal": "anti-diagonal",
    "same_token": "same token", "diffuse": "diffuse"}


def pattern_keys(tokens_BxL: Array) -> dict[str, Array]:
  """Boolean ``[B, Q, K]`` per mass pattern: the keys of each query's
  pattern, restricted to valid keys (all False for a padding query)."""
  valid_BxL = tokens_BxL != 0
  length = tokens_BxL.shape[-1]
  n_B = jnp.sum(valid_BxL, axis=-1)
  q = jnp.arange(length)[:, None]
  k = jnp.arange(length)[None, :]
  pairs_BxQxK = valid_BxL[:, :, None] & valid_BxL[:, None, :]
  same_token = tokens_BxL[:, :, None] == tokens_BxL[:, None, :]
  keys = {
      "previous_position": (k == q - 1)[None],
      "next_position": (k == q + 1)[None],
      "same_position": (k == q)[None],
      "anti_diagonal": k[None] == n_B[:, None, None] - 1 - q[None],
      "same_token": same_token & (k != q)[None],
  }
  return {name: key & pairs_BxQxK for name, key in keys.items()}


def role_sums(weights_BxHxQxK: Array, tokens_BxL: Array,
              causal: bool = False
              ) -> tuple[dict[str, Array], dict[str, Array]]:
  """Sums over a batch of every pattern's per-query score, per head.

  Args:
    weights_BxHxQxK: one layer's attention weights (padding queries all 0).
    tokens_BxL: the batch's tokens, 0 = padding (a valid prefix per row).
    causal: the weights are a causal model's: query ``i`` may attend to
      keys ``<= i`` only (``diffuse`` is normalised by their number).

  Returns:
    ``(sums, counts)``: ``sums[pattern]`` ``[H]`` float32, the sum of the
    score over the queries where the pattern is defined, and
    ``counts[pattern]`` (a scalar) their number.
  """
  w = weights_BxHxQxK.astype(jnp.float32)
  sums, counts = {}, {}
  for name, keys_BxQxK in pattern_keys(tokens_BxL).items():
    defined_BxQ = jnp.any(keys_BxQxK, axis=-1)
    mass_BxHxQ = jnp.sum(jnp.where(keys_BxQxK[:, None], w, 0.0), axis=-1)
    sums[name] = jnp.sum(jnp.where(defined_BxQ[:, None], mass_BxHxQ, 0.0),
                         axis=(0, 2))
    counts[name] = jnp.sum(defined_BxQ)
  valid_BxL = tokens_BxL != 0
  n_B = jnp.sum(valid_BxL, axis=-1)
  entropy_BxHxQ = -jnp.sum(
      jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0), axis=-1)
  keys_BxQ = jnp.broadcast_to(n_B[:, None], valid_BxL.shape)
  if causal:  # query i sees keys 0..i
    keys_BxQ = jnp.minimum(keys_BxQ, jnp.arange(valid_BxL.shape[-1])[None] + 1)
  log_n_BxQ = jnp.log(jnp.maximum(keys_BxQ, 2).astype(jnp.float32))
  defined_BxQ = valid_BxL & (keys_BxQ >= 2)
  diffuse_BxHxQ = jnp.clip(entropy_BxHxQ / log_n_BxQ[:, None], 0.0, 1.0)
  sums["diffuse"] = jnp.sum(
      jnp.where(defined_BxQ[:, None], diffuse_BxHxQ, 0.0), axis=(0, 2))
  counts["diffuse"] = jnp.sum(defined_BxQ)
  return sums, counts


def attention_role_sums(attention: Sequence[Array], tokens_BxL: Array,
                        max_heads: int | None = None, causal: bool = False
                        ) -> tuple[dict[str, Array], dict[str, Array]]:
  """:func:`role_sums` of every layer: ``sums[pattern]`` ``[L, H]`` (zero
  past a layer's head count, ``H`` the largest count or ``max_heads``),
  ``counts[pattern]`` a scalar (the same queries in every layer)."""
  width = max_heads if max_heads is not None else max(
      (a.shape[1] for a in attention), default=0)
  per_layer = [role_sums(a, tokens_BxL, causal) for a in attention]
  counts = per_layer[0][1] if per_layer else {p: jnp.zeros(()) for p in
                                               PATTERNS}
  sums = {p: jnp.stack([jnp.pad(s[p], (0, width - s[p].shape[0]))
                        for s, _ in per_layer]) for p in PATTERNS}
  return sums, counts


def scores(sums: Mapping[str, Any], counts: Mapping[str, Any],
           heads_per_layer: Sequence[int]) -> dict[str, np.ndarray]:
  """Means from sums: ``pattern -> [L, H]`` float64, NaN where a layer has
  no such head or the pattern occurred at no query."""
  out = {}
  for name in PATTERNS:
    total = np.asarray(sums[name], np.float64)
    count = float(counts[name])
    mean = total / count if count > 0 else np.full_like(total, np.nan)
    exists = np.arange(total.shape[1])[None] < np.asarray(
        heads_per_layer)[:, None]
    out[name] = np.where(exists, mean, np.nan)
  return out


def roles_of_attention(attention: Sequence[Array | np.ndarray],
                       tokens_BxL: Array | np.ndarray, causal: bool = False
                       ) -> dict[str, np.ndarray]:
  """Head roles of given attention weights (one ``[B, H_l, L, L]`` array
  per layer, a causal model's where ``causal``) on the tokens ``[B, L]``:
  ``pattern -> [L, H]``."""
  attention = [jnp.asarray(a) for a in attention]
  sums, counts = jax.jit(attention_role_sums, static_argnames="causal")(
      attention, jnp.asarray(tokens_BxL), causal=causal)
  return scores(sums, counts, [a.shape[1] for a in attention])


@functools.partial(jax.jit, static_argnames="model")
def _batch_role_sums(model: Transformer, params: Any, inputs: Array):
  _, attention = model.apply({"params": params}, inputs, return_weights=True)
  return attention_role_sums(attention, inputs, model.config.max_heads,
                             model.config.causal)


def head_roles(model: Transformer, params: Any, split: data.Split,
               batch_size: int, *, mesh: Mesh | None = None
               ) -> dict[str, np.ndarray]:
  """Every head's role scores on ``split``: ``pattern -> [L, H]`` float64
  in ``[0, 1]`` (NaN where a layer has no such head), each batch split
  across the devices of ``mesh`` (default: every device)."""
  mesh = sharding_lib.make_mesh() if mesh is None else mesh
  sums = {p: 0.0 for p in PATTERNS}
  counts = {p: 0.0 for p in PATTERNS}
  for batch in sharding_lib.eval_batches(split, batch_size, mesh):
    batch_sums, batch_counts = jax.device_get(
        _batch_role_sums(model, params, batch["inputs"]))
    for p in PATTERNS:
      sums[p] = sums[p] + np.asarray(batch_sums[p], np.float64)
      counts[p] += float(batch_counts[p])
  return scores(sums, counts, model.config.heads_per_layer)


def top_roles(roles: Mapping[str, Any]) -> list[list[str | None]]:
  """The pattern of highest score of each head, ``[L][H]`` (None where a
  layer has no such head)."""
  stacked = np.stack([np.asarray(roles[p], np.float64) for p in PATTERNS])
  best = np.argmax(np.where(np.isnan(stacked), -np.inf, stacked), axis=0)
  missing = np.all(np.isnan(stacked), axis=0)
  return [[None if missing[layer, head] else PATTERNS[best[layer, head]]
           for head in range(stacked.shape[2])]
          for layer in range(stacked.shape[1])]


def to_json(roles: Mapping[str, Any]) -> dict[str, list[list[float | None]]]:
  """``pattern -> [L][H]`` nested lists, None for NaN (JSON has no NaN)."""
  return {p: [[None if not np.isfinite(v) else round(float(v), 6)
               for v in row] for row in np.asarray(roles[p], np.float64)]
          for p in PATTERNS}


__all__ = ["PATTERNS", "LABELS", "pattern_keys", "role_sums",
           "attention_role_sums", "scores", "roles_of_attention",
           "head_roles", "top_roles", "to_json"]
