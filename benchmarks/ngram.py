"""A byte n-gram language model with interpolated modified Kneser-Ney
smoothing, in numpy: the baseline of the character LM (``pylm``).

Chen & Goodman (1999), "An empirical study of smoothing techniques for
language modeling", section 3 (interpolated, three discounts a level). For
an order-``K`` model and a context ``h`` of ``n - 1`` bytes (``h'``: ``h``
without its first byte),

    p_n(w | h) = (max(c(hw) - D(c(hw)), 0) + gamma(h) p_{n-1}(w | h')) / c(h)
    gamma(h)   = D1 N1(h.) + D2 N2(h.) + D3 N3+(h.)

where ``c`` is the raw count at the top level (``n = K``) and the
continuation count (the number of distinct bytes seen just before) below it,
``c(h)`` the sum of ``c(hw)`` over ``w``, ``Nk(h.)`` the number of bytes
``w`` with ``c(hw) = k`` (``3+``: at least 3), and ``D(c)`` the level's
discount for a count ``c`` (``D(0) = 0``), from its counts of counts. A
context never seen at a level (``c(h) = 0``, or the stream's start, where
``h`` is not all there) leaves ``p_{n-1}``. Level 0 is uniform over the 256
byte values, so every byte has a probability above 0 and the probabilities
of a context sum to 1 (tested).

An n-gram is one ``uint64`` (``n <= 8`` bytes, the first byte highest), so
fitting is a few sorts (``np.unique``) a level and scoring a few
``np.searchsorted`` a level: the standard library's 10.6 MB train split, all
orders 2 to 6, in well under a minute on one core.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

VOCAB = 256  # Byte values.
MAX_ORDER = 8  # Bytes an n-gram key holds.


@dataclasses.dataclass(frozen=True)
class Level:
  """The counts of one level (n-grams of ``n`` bytes) and their contexts."""

  n: int
  keys: np.ndarray  # [G] uint64, sorted: the n-grams seen.
  counts: np.ndarray  # [G] int64: c(hw) (raw or continuation).
  context_keys: np.ndarray  # [C] uint64, sorted: their contexts h.
  context_totals: np.ndarray  # [C] float64: c(h).
  context_gammas: np.ndarray  # [C] float64: gamma(h), the discounted mass.
  discounts: np.ndarray  # [4] float64: D(0) = 0, D1, D2, D3+.


@dataclasses.dataclass(frozen=True)
class KneserNey:
  """An order-``order`` model: ``levels[n - 1]`` for ``n = 1 .. order``."""

  order: int
  levels: tuple[Level, ...]


def _as_bytes(data: bytes | np.ndarray) -> np.ndarray:
  return (np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray))
          else np.asarray(data, np.uint8))


def ngram_keys(data: bytes | np.ndarray, n: int) -> np.ndarray:
  """The ``len(data) - n + 1`` n-grams of ``data`` as uint64 keys (byte
  ``i`` of an n-gram at bits ``8 (n - 1 - i)``)."""
  data = _as_bytes(data)
  count = max(len(data) - n + 1, 0)
  keys = np.zeros(count, np.uint64)
  for i in range(n):
    keys |= data[i:i + count].astype(np.uint64) << np.uint64(8 * (n - 1 - i))
  return keys


def discounts(counts: np.ndarray) -> np.ndarray:
  """``[0, D1, D2, D3+]`` of a level's counts (Chen & Goodman's estimates
  from the counts of counts ``n1..n4``: ``Y = n1 / (n1 + 2 n2)``, ``Dk = k -
  (k + 1) Y n(k+1) / nk``). Where too few counts make one undefined or out
  of ``(0, k)`` (tiny corpora), it is clipped into ``[0.1, k - 0.1]`` (0.5 k
  when undefined), which keeps every probability above 0."""
  nk = np.array([np.sum(counts == k) for k in range(1, 5)], np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    y = nk[0] / (nk[0] + 2 * nk[1])
    d = np.array([k - (k + 1) * y * nk[k] / nk[k - 1] for k in (1, 2, 3)])
  k = np.arange(1, 4)
  d = np.where(np.isfinite(d), d, 0.5 * k)
  return np.concatenate([[0.0], np.clip(d, 0.1, k - 0.1)])


def make_level(n: int, keys: np.ndarray, counts: np.ndarray) -> Level:
  """A :class:`Level` of sorted unique n-gram ``keys`` and their ``counts``
  (its discounts from those counts)."""
  d = discounts(counts)
  contexts = keys >> np.uint64(8)  # Sorted too: the keys are.
  starts = np.flatnonzero(np.r_[True, contexts[1:] != contexts[:-1]])
  discount = d[np.minimum(counts, 3)]
  return Level(
      n=n, keys=keys, counts=counts.astype(np.int64),
      context_keys=contexts[starts],
      context_totals=np.add.reduceat(counts.astype(np.float64), starts),
      context_gammas=np.add.reduceat(discount, starts),
      discounts=d)


def fit_all(train: bytes | np.ndarray,
            orders: tuple[int, ...] = (2, 3, 4, 5, 6)
            ) -> dict[int, KneserNey]:
  """A model of every order in ``orders`` fitted on ``train`` (one byte
  stream), sharing their lower levels: {order: model}."""
  if not orders or min(orders) < 1 or max(orders) > MAX_ORDER:
    raise ValueError(f"orders {orders} must lie in 1..{MAX_ORDER}")
  data = _as_bytes(train)
  if not len(data):
    raise ValueError("the n-gram model's train stream is empty")
  top = max(orders)
  raw = {}  # n: (sorted unique keys, counts)
  for n in range(1, top + 1):
    raw[n] = np.unique(ngram_keys(data, n), return_counts=True)
  continuation = {}  # Level n from the distinct (n + 1)-grams.
  for n in range(1, top):
    mask = np.uint64((1 << (8 * n)) - 1)
    keys, counts = np.unique(raw[n + 1][0] & mask, return_counts=True)
    continuation[n] = make_level(n, keys, counts)
  return {order: KneserNey(order=order, levels=tuple(
      continuation[n] for n in range(1, order)) + (make_level(
          order, *raw[order]),)) for order in orders}


def fit(train: bytes | np.ndarray, order: int) -> KneserNey:
  """An order-``order`` model fitted on ``train`` (one byte stream)."""
  return fit_all(train, (order,))[order]


def window_probs(model: KneserNey, windows: np.ndarray,
                 available: np.ndarray | None = None) -> np.ndarray:
  """``p(w | h)`` of each row of ``windows`` ``[Q, model.order]`` uint8
  (the context ``h`` then the byte ``w``, last); ``available`` ``[Q]``: how
  many of a row's last bytes are real (the rest is before a stream's start;
  default all). Returns ``[Q]`` float64."""
  windows = np.asarray(windows, np.uint8)
  order = model.order
  if windows.ndim != 2 or windows.shape[1] != order:
    raise ValueError(f"windows {windows.shape} must be [Q, {order}]")
  if available is None:
    available = np.full(len(windows), order)
  p = np.full(len(windows), 1.0 / VOCAB)
  key = np.zeros(len(windows), np.uint64)
  for n, level in enumerate(model.levels, start=1):
    key |= windows[:, order - n].astype(np.uint64) << np.uint64(8 * (n - 1))
    context = key >> np.uint64(8)
    at = np.minimum(np.searchsorted(level.context_keys, context),
                    len(level.context_keys) - 1)
    seen = (available >= n) & (level.context_keys[at] == context)
    hit = np.minimum(np.searchsorted(level.keys, key), len(level.keys) - 1)
    count = np.where(seen & (level.keys[hit] == key), level.counts[hit], 0)
    mass = np.maximum(count - level.discounts[np.minimum(count, 3)], 0.0)
    p = np.where(seen, (mass + level.context_gammas[at] * p)
                 / level.context_totals[at], p)
  return p


def distribution(model: KneserNey, context: bytes) -> np.ndarray:
  """``p(w | context)`` for every byte ``w``: ``[256]`` (its last
  ``order - 1`` bytes count; a shorter context is a stream's start)."""
  context = _as_bytes(context)[-(model.order - 1):] if model.order > 1 else (
      np.zeros(0, np.uint8))
  windows = np.zeros((VOCAB, model.order), np.uint8)
  windows[:, model.order - 1 - len(context):model.order - 1] = context
  windows[:, -1] = np.arange(VOCAB)
  return window_probs(model, windows, np.full(VOCAB, len(context) + 1))


def log2_probs(model: KneserNey, stream: bytes | np.ndarray,
               positions: np.ndarray | None = None,
               chunk: int = 1 << 20) -> np.ndarray:
  """``log2 p(stream[i] | stream[:i])`` at ``positions`` (default: every
  one), the context the ``order - 1`` bytes before (fewer at the stream's
  start); ``chunk`` positions at a time."""
  data = _as_bytes(stream)
  positions = (np.arange(len(data)) if positions is None
               else np.asarray(positions, np.int64))
  padded = np.concatenate([np.zeros(model.order - 1, np.uint8), data])
  view = np.lib.stride_tricks.sliding_window_view(padded, model.order)
  out = np.empty(len(positions))
  for start in range(0, len(positions), chunk):
    at = positions[start:start + chunk]
    out[start:start + chunk] = np.log2(window_probs(
        model, view[at], np.minimum(at + 1, model.order)))
  return out


def bits_per_char(model: KneserNey, stream: bytes | np.ndarray,
                  positions: np.ndarray | None = None) -> float:
  """Mean ``-log2 p`` of ``stream``'s bytes at ``positions`` (default all):
  bits per byte, per character for ASCII text."""
  return float(-np.mean(log2_probs(model, stream, positions)))


def pylm_targets(stream_length: int, context_length: int) -> np.ndarray:
  """The stream positions a pylm split scores: the targets of its windows
  (:func:`mha.data.corpus_windows`), positions ``1 .. N * context_length``."""
  count = max(stream_length - 1, 0) // context_length
  return np.arange(1, count * context_length + 1)


def sizes(models: Mapping[int, KneserNey]) -> dict[int, int]:
  """Distinct n-grams at each model's top level: {order: count}."""
  return {order: len(model.levels[-1].keys) for order, model in models.items()}
