"""The best possible ordering: the nested chain of subsets of highest AUC.

An ordering removes one head at a time, so its subsets are nested: the
subset with ``k + 1`` heads removed is the one with ``k`` removed less one
head. The oracle (:mod:`mha.pruning.oracle`) chooses the best subset for
each ``k`` on its own, and its subsets need not be nested. Between the two
lies the best any ordering can do: among the ``N!`` chains from every head
kept to none, the one whose curve has the highest area under it. Given the
value of every subset (the oracle's table), a dynamic program over the
subset lattice finds it in ``O(N 2**N)``: the best chain from subset ``s``
down to the empty set is ``s``'s own value plus the best chain from
``s`` less one of its heads.

An ordering's gap to the oracle then splits in two: its gap to the best
ordering (the ranking error: a better ranking could close it) and the best
ordering's gap to the oracle (the price of nesting: no ordering can close
it).

Subset ``s`` keeps head ``i`` (the ``i``-th existing head) iff bit ``i`` of
``s`` is set, as in :mod:`mha.pruning.oracle`. NumPy on the host.

    values = oracle.subset_values(metrics)                # [2**N]
    weights = auc_weights(core.pruning_counts(n), n)     # the study's AUC
    order = best_order(values, config, weights)          # flat head indices
"""

from __future__ import annotations

import numpy as np

from mha import head_masks
from mha.model import TransformerConfig


def auc_weights(counts: np.ndarray, num_heads: int) -> np.ndarray:
  """``[N + 1]``: the weight of the value at ``k`` heads removed in the
  study's AUC (the trapezoid over the fractions ``counts / N`` divided by
  their range, ``summary._auc``); 0 for a ``k`` not among ``counts``."""
  counts = np.asarray(counts, np.int64)
  weights = np.zeros(num_heads + 1)
  if len(counts) == 1:
    weights[counts[0]] = 1.0
    return weights
  fractions = counts / max(num_heads, 1)
  width = fractions[-1] - fractions[0]
  step = np.diff(fractions) / 2
  np.add.at(weights, counts[:-1], step)
  np.add.at(weights, counts[1:], step)
  return weights / width


def _check(values: np.ndarray, weights: np.ndarray | None
           ) -> tuple[np.ndarray, np.ndarray, int]:
  values = np.asarray(values, np.float64)
  n = int(round(np.log2(len(values)))) if len(values) else -1
  if values.ndim != 1 or n < 0 or 2 ** n != len(values):
    raise ValueError(f"values must be [2**N], got {values.shape}")
  weights = (np.ones(n + 1) if weights is None
             else np.asarray(weights, np.float64))
  if weights.shape != (n + 1,):
    raise ValueError(f"weights must be [N + 1] = [{n + 1}], got "
                     f"{weights.shape}")
  return values, weights, n


def chain_value(values: np.ndarray, order: np.ndarray,
                weights: np.ndarray | None = None) -> float:
  """``sum_k weights[k] * values[s_k]`` of the chain that removes the bits
  ``order[0], order[1], ...`` one at a time from the full subset
  (``weights`` default: 1 for every ``k``)."""
  values, weights, n = _check(values, weights)
  subset, total = 2 ** n - 1, weights[0] * values[2 ** n - 1]
  for k, bit in enumerate(order, start=1):
    subset &= ~(1 << int(bit))
    total += weights[k] * values[subset]
  return float(total)


def best_chain(values: np.ndarray, weights: np.ndarray | None = None
               ) -> tuple[np.ndarray, float]:
  """The removal order (bit indices, the first removed first) of the chain
  maximising ``sum_k weights[k] * values[s_k]``, and that sum.

  Args:
    values: ``[2**N]`` the value of each subset (bit ``i`` set: head ``i``
      kept), higher is better.
    weights: ``[N + 1]`` the weight of the subset with ``k`` heads removed
      (:func:`auc_weights` gives the study's AUC); default 1 for every
      ``k``.

  Returns:
    ``(order, total)``: ``[N]`` bit indices, and the chain's weighted sum.
    Ties go to the lowest bit removed first.
  """
  values, weights, n = _check(values, weights)
  subsets = np.arange(2 ** n, dtype=np.int64)
  kept = np.zeros(2 ** n, np.int64)
  for i in range(n):
    kept += (subsets >> i) & 1
  # best[s]: the highest weighted sum of a chain from s down to the empty
  # set, s included; choice[s]: the head that chain removes from s first.
  best = np.full(2 ** n, -np.inf)
  best[0] = weights[n] * values[0]
  choice = np.zeros(2 ** n, np.int8 if n < 128 else np.int64)
  for size in range(1, n + 1):
    level = subsets[kept == size]
    rest = np.full(len(level), -np.inf)
    for i in range(n):  # Ties: the lowest bit, kept by the strict ">".
      has = (level >> i) & 1 == 1
      candidate = np.where(has, best[level & ~(1 << i)], -np.inf)
      better = candidate > rest
      rest = np.where(better, candidate, rest)
      choice[level[better]] = i
    best[level] = weights[n - size] * values[level] + rest
  order, subset = [], 2 ** n - 1
  while subset:
    bit = int(choice[subset])
    order.append(bit)
    subset &= ~(1 << bit)
  return np.asarray(order, np.int64), float(best[2 ** n - 1])


def best_order(values: np.ndarray, config: TransformerConfig,
               weights: np.ndarray | None = None) -> np.ndarray:
  """:func:`best_chain`'s order as flat head indices (``layer * H +
  head``, as the orders of :mod:`mha.pruning.core`), the head removed first
  at index 0."""
  flat = np.flatnonzero(head_masks.existing_heads(config))
  if len(values) != 2 ** len(flat):
    raise ValueError(f"values must be [2**N] = [{2 ** len(flat)}], got "
                     f"{np.shape(values)}")
  order, _ = best_chain(values, weights)
  return flat[order]


__all__ = ["auc_weights", "best_chain", "best_order", "chain_value"]
