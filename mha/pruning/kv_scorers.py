"""KV-cache head scorers: which heads of a causal decoder need their full
KV cache (higher = more), after the published head-level cache methods.

Each scorer is a mean, over the query positions where it is defined, of a
per-position value read from one head's attention weights ``w[t, s]``
(query ``t``, key ``s <= t``, both real tokens; 0 = padding). With ``x``
the inputs and ``y`` the targets (``y[t] < 0``: not scored,
:func:`mha.data.scored`):

* ``retrieval_score`` (Wu et al. 2024, "Retrieval Head Mechanistically
  Explains Long-Context Factuality"): copy-paste frequency. Eligible: scored
  ``t`` with ``R_t = {s <= t : x[s] == y[t]}`` non-empty; value 1 when the
  head's top-1 key ``argmax_s w[t, s]`` (the first on ties) is in ``R_t``.
  Adapted: Wu et al. decode the answer to a planted needle, count a hit when
  the top-1 key lies in the needle and holds the generated token, divide by
  the needle's length and average over the examples answered correctly.
  Here the "generated" token is the target (teacher forcing), the "needle"
  is every earlier-or-equal occurrence of it, hits are pooled over every
  eligible position of the split, and no example is filtered by accuracy.
* ``echo`` (RazorAttention, Tang et al. 2024): the mass on the previous
  occurrences of the current token, ``E_t = {s < t : x[s] == x[t]}``;
  eligible: real ``t`` with ``E_t`` non-empty.
* ``induction`` (RazorAttention): the mass on the tokens right after them,
  ``{s + 1 : s < t, x[s] == x[t]}`` (``s + 1 <= t``); eligible: the same.
* ``headkv`` (HeadKV, Fu et al. 2024, "Not All Heads Matter"): the
  retrieval-reasoning score, as the authors' code computes it
  (github.com/FYYFU/HeadKV, ``Important_Head/retrieval_head_detection_r2.py``,
  ``retrieval_calculate``): per decoding step, of the ``k`` keys of highest
  weight (``k`` the needle's length), those inside the needle add ``w / k``
  (Wu et al.'s token match is commented out: a soft score), summed over the
  ~``k`` answer steps, about a mean over steps. Here the needle of ``t`` is
  ``R_t``, ``k = |R_t|``, the value ``sum of w[t, s] over s in R_t among
  the k largest w[t, .]`` (ties: the earlier key first), the mean over the
  positions eligible for ``retrieval_score`` (no filter on the answer's
  F1 > 50 either). Not checked against the paper's text beyond that code.
* ``attention_distance``: ``sum_s w[t, s] (t - s)``, in tokens, over every
  real ``t``.

All but the distance lie in ``[0, 1]``. Eligibility depends on the tokens
only, so one count serves every head: a score is NaN for every head when no
position of the split is eligible (a position with nothing eligible is left
out of the mean), and NaN where a layer lacks the head.

    scores = kv_scorers.measure(model, params, splits["test"])
    scores["retrieval_score"]  # [L, H] float64

The scorers in :data:`SCORERS` and :func:`pattern_sums` are pure (``jit``,
``vmap``) per-batch sums and counts; :func:`measure` loops over the
batches of a split, as :func:`mha.head_roles.head_roles` does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mha import data
from mha import head_masks
from mha.aliases import Array, Params
from mha.model import Transformer, TransformerConfig
from mha.run import arguments
from mha.run import sharding as sharding_lib

#: Examples x positions x positions of one call of :func:`measure`, at most:
#: its scorers hold a few float32 copies of a layer's attention weights
#: ``[B, H, T, T]``, so long windows come a few at a time. On ``passkey``'s
#: 128 windows of 256 tokens (2 CPU cores, AMD EPYC, 2026-12-07) the whole
#: split in one call peaked at 2.0 GiB, 32 windows a call (this bound) at
#: 0.9 GiB and no slower; the scores move in their last bits only.
CALL_ATTENTION_ENTRIES = 1 << 21

#: A scorer's per-batch core: ``(weights [B, H, T, T], inputs [B, T],
#: targets [B, T]) -> (sums [H] float32, count scalar int32)``.
Scorer = Callable[[Array, Array, Array], tuple[Array, Array]]


def _allowed(inputs_BxT: Array) -> Array:
  """``[B, Q, K]``: a real query's real keys up to itself."""
  valid_BxT = inputs_BxT != 0
  length = inputs_BxT.shape[-1]
  causal_QxK = jnp.tril(jnp.ones((length, length), bool))
  return valid_BxT[:, :, None] & valid_BxT[:, None, :] & causal_QxK[None]


def _clean(weights_BxHxQxK: Array, inputs_BxT: Array) -> Array:
  """The weights in float32, zero outside :func:`_allowed`."""
  allowed_Bx1xQxK = _allowed(inputs_BxT)[:, None]
  return jnp.where(allowed_Bx1xQxK, weights_BxHxQxK.astype(jnp.float32), 0.0)


def _pooled(value_BxHxQ: Array, eligible_BxQ: Array) -> tuple[Array, Array]:
  """``(sum over eligible positions [H], their number)``."""
  sums_H = jnp.sum(jnp.where(eligible_BxQ[:, None], value_BxHxQ, 0.0),
                   axis=(0, 2))
  return sums_H, jnp.sum(eligible_BxQ, dtype=jnp.int32)


def _mass(keys_BxQxK: Array, weights_BxHxQxK: Array,
          inputs_BxT: Array) -> tuple[Array, Array]:
  """Pooled mass on ``keys`` over the queries having any of them."""
  w = _clean(weights_BxHxQxK, inputs_BxT)
  mass_BxHxQ = jnp.sum(jnp.where(keys_BxQxK[:, None], w, 0.0), axis=-1)
  return _pooled(mass_BxHxQ, jnp.any(keys_BxQxK, axis=-1))


def target_keys(inputs_BxT: Array, targets_BxT: Array) -> Array:
  """``[B, Q, K]``: ``R_t``, the keys ``s <= t`` holding the target of a
  scored query ``t`` (all False for an unscored or padding query)."""
  scored_BxQ = data.scored(inputs_BxT, targets_BxT)
  same_BxQxK = inputs_BxT[:, None, :] == targets_BxT[:, :, None]
  return _allowed(inputs_BxT) & same_BxQxK & scored_BxQ[:, :, None]


def echo_keys(inputs_BxT: Array) -> Array:
  """``[B, Q, K]``: the earlier keys holding the query's token."""
  length = inputs_BxT.shape[-1]
  before_QxK = jnp.tril(jnp.ones((length, length), bool), k=-1)
  same_BxQxK = inputs_BxT[:, :, None] == inputs_BxT[:, None, :]
  return _allowed(inputs_BxT) & same_BxQxK & before_QxK[None]


def induction_keys(inputs_BxT: Array) -> Array:
  """``[B, Q, K]``: the keys right after an earlier occurrence of the
  query's token (key ``s + 1`` for ``s < t``, ``x[s] == x[t]``)."""
  previous_BxT = jnp.pad(inputs_BxT[:, :-1], ((0, 0), (1, 0)))  # x[s - 1]
  follows_BxQxK = inputs_BxT[:, :, None] == previous_BxT[:, None, :]
  return _allowed(inputs_BxT) & follows_BxQxK  # x[t] != 0 = previous[0]


def retrieval_score(weights_BxHxQxK: Array, inputs_BxT: Array,
                    targets_BxT: Array) -> tuple[Array, Array]:
  """Wu et al.'s copy-paste hits: is the top-1 key in ``R_t``?

  Args:
    weights_BxHxQxK: one layer's attention weights.
    inputs_BxT: the tokens, 0 = padding.
    targets_BxT: the next-token targets, < 0 where not scored.

  Returns:
    ``(sums [H], count)``: hits and eligible positions.
  """
  keys_BxQxK = target_keys(inputs_BxT, targets_BxT)
  w = _clean(weights_BxHxQxK, inputs_BxT)
  top_BxHxQx1 = jnp.argmax(w, axis=-1)[..., None]
  key_1x1x1xK = jnp.arange(w.shape[-1])[None, None, None]
  hit_BxHxQ = jnp.any(keys_BxQxK[:, None] & (key_1x1x1xK == top_BxHxQx1),
                      axis=-1)
  return _pooled(hit_BxHxQ.astype(jnp.float32), jnp.any(keys_BxQxK, -1))


def echo(weights_BxHxQxK: Array, inputs_BxT: Array,
         targets_BxT: Array) -> tuple[Array, Array]:
  """RazorAttention's echo: the mass on :func:`echo_keys` (``targets``
  unused). Returns ``(sums [H], count)``."""
  del targets_BxT
  return _mass(echo_keys(inputs_BxT), weights_BxHxQxK, inputs_BxT)


def induction(weights_BxHxQxK: Array, inputs_BxT: Array,
              targets_BxT: Array) -> tuple[Array, Array]:
  """RazorAttention's induction: the mass on :func:`induction_keys`
  (``targets`` unused). Returns ``(sums [H], count)``."""
  del targets_BxT
  return _mass(induction_keys(inputs_BxT), weights_BxHxQxK, inputs_BxT)


def headkv(weights_BxHxQxK: Array, inputs_BxT: Array,
           targets_BxT: Array) -> tuple[Array, Array]:
  """HeadKV's retrieval-reasoning score: the mass on ``R_t`` within the
  ``|R_t|`` keys of highest weight (ties: earlier key first). Returns
  ``(sums [H], count)``."""
  keys_BxQxK = target_keys(inputs_BxT, targets_BxT)
  w = _clean(weights_BxHxQxK, inputs_BxT)
  order = jnp.argsort(-w, axis=-1, stable=True)
  rank_BxHxQxK = jnp.argsort(order, axis=-1)  # 0 = the largest weight
  k_Bx1xQx1 = jnp.sum(keys_BxQxK, axis=-1)[:, None, :, None]
  chosen = keys_BxQxK[:, None] & (rank_BxHxQxK < k_Bx1xQx1)
  mass_BxHxQ = jnp.sum(jnp.where(chosen, w, 0.0), axis=-1)
  return _pooled(mass_BxHxQ, jnp.any(keys_BxQxK, -1))


def attention_distance(weights_BxHxQxK: Array, inputs_BxT: Array,
                       targets_BxT: Array) -> tuple[Array, Array]:
  """The mean distance ``sum_s w[t, s] (t - s)`` over every real query
  (``targets`` unused). Returns ``(sums [H], count)``."""
  del targets_BxT
  w = _clean(weights_BxHxQxK, inputs_BxT)
  position = jnp.arange(w.shape[-1])
  distance_QxK = (position[:, None] - position[None, :]).astype(jnp.float32)
  value_BxHxQ = jnp.sum(w * distance_QxK[None, None], axis=-1)
  return _pooled(value_BxHxQ, inputs_BxT != 0)


#: The scorers by name, in the order they are reported.
SCORERS: dict[str, Scorer] = {
    "retrieval_score": retrieval_score, "echo": echo,
    "induction": induction, "headkv": headkv,
    "attention_distance": attention_distance}


def _names(names: Sequence[str] | None) -> tuple[str, ...]:
  """The scorer names asked for (all by default), checked."""
  names = tuple(SCORERS) if names is None else tuple(names)
  unknown = [n for n in names if n not in SCORERS]
  if unknown or not names:
    raise ValueError(f"unknown scorers {unknown} (or none asked); known: "
                     f"{list(SCORERS)}")
  return names


def pattern_sums(weights_BxHxQxK: Array, inputs_BxT: Array,
                 targets_BxT: Array, names: Sequence[str] | None = None
                 ) -> tuple[dict[str, Array], dict[str, Array]]:
  """Every scorer's per-batch sums of one layer.

  Args:
    weights_BxHxQxK: one layer's attention weights (a causal model's).
    inputs_BxT: the batch's tokens, 0 = padding.
    targets_BxT: its targets, < 0 where not scored.
    names: the scorers (default: all of :data:`SCORERS`).

  Returns:
    ``(sums, counts)``: ``sums[name]`` ``[H]`` float32, the sum of the
    per-position values over the eligible positions, ``counts[name]`` the
    number of those (a scalar: the same for every head).
  """
  sums, counts = {}, {}
  for name in _names(names):
    sums[name], counts[name] = SCORERS[name](weights_BxHxQxK, inputs_BxT,
                                             targets_BxT)
  return sums, counts


def attention_sums(attention: Sequence[Array], inputs_BxT: Array,
                   targets_BxT: Array, max_heads: int | None = None,
                   names: Sequence[str] | None = None
                   ) -> tuple[dict[str, Array], dict[str, Array]]:
  """:func:`pattern_sums` of every layer's ``[B, H_l, T, T]`` weights:
  ``sums[name]`` ``[L, H]`` (zero past a layer's count; ``H`` the largest
  count or ``max_heads``), ``counts[name]`` a scalar."""
  names = _names(names)
  width = max_heads if max_heads is not None else max(
      a.shape[1] for a in attention)
  per_layer = [pattern_sums(a, inputs_BxT, targets_BxT, names)
               for a in attention]
  sums = {n: jnp.stack([jnp.pad(s[n], (0, width - s[n].shape[0]))
                        for s, _ in per_layer]) for n in names}
  return sums, per_layer[0][1]


def scores(sums: Mapping[str, Any], counts: Mapping[str, Any],
           config: TransformerConfig) -> dict[str, np.ndarray]:
  """Means from pooled sums: ``name -> [L, H]`` float64, NaN where a layer
  has no such head or no position was eligible."""
  exists = head_masks.existing_heads(config)
  out = {}
  for name, total in sums.items():
    count = float(counts[name])
    total = np.asarray(total, np.float64)
    mean = total / count if count > 0 else np.full_like(total, np.nan)
    out[name] = np.where(exists, mean, np.nan)
  return out


@functools.partial(jax.jit, static_argnames=("model", "names"))
def _batch_sums(model: Transformer, params: Params, inputs: Array,
                targets: Array, names: tuple[str, ...]):
  _, attention = model.apply({"params": params}, inputs, return_weights=True)
  return attention_sums(attention, inputs, targets, model.config.max_heads,
                        names)


def measure(model: Transformer, params: Params, split: data.Split, *,
            batch_size: int = 1000, names: Sequence[str] | None = None,
            mesh: Mesh | None = None) -> dict[str, np.ndarray]:
  """The KV-cache scores of every head of a causal model on ``split``.

  Args:
    model: a causal Transformer (``config.causal``).
    params: its parameters.
    split: the examples; a split with ``weights`` is read through
      :func:`mha.data.scored_targets` (weight 0: not scored).
    batch_size: examples per batch (split across the devices of ``mesh``),
      at most :data:`CALL_ATTENTION_ENTRIES` over the square of the
      model's positions.
    names: the scorers (default: all of :data:`SCORERS`).
    mesh: the devices (default: every device).

  Returns:
    ``name -> [L, H]`` float64 (NaN: no such head, or nothing eligible).

  Raises:
    ValueError: a model that is not causal, an unknown scorer, a bad
      ``batch_size``.
  """
  if not model.config.causal:
    raise ValueError("the KV-cache scorers read a causal model's attention; "
                     "this model has causal=False.")
  arguments.check_count("batch_size", batch_size)
  names = _names(names)
  mesh = sharding_lib.make_mesh() if mesh is None else mesh
  shape = (model.config.num_layers, model.config.max_heads)
  sums = {n: np.zeros(shape, np.float64) for n in names}
  counts = {n: 0 for n in names}
  batch_size = min(batch_size, max(
      1, CALL_ATTENTION_ENTRIES // max(1, model.config.max_len) ** 2))
  for batch in sharding_lib.eval_batches(data.scored_targets(split),
                                         batch_size, mesh):
    batch_sums, batch_counts = jax.device_get(_batch_sums(
        model, params, batch["inputs"], batch["targets"], names))
    for n in names:
      sums[n] += np.asarray(batch_sums[n], np.float64)
      counts[n] += int(batch_counts[n])
  return scores(sums, counts, model.config)


__all__ = ["CALL_ATTENTION_ENTRIES", "SCORERS", "Scorer", "target_keys",
           "echo_keys", "induction_keys", "retrieval_score", "echo",
           "induction", "headkv", "attention_distance", "pattern_sums",
           "attention_sums", "scores", "measure"]
