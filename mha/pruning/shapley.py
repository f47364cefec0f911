"""Shapley values beyond exhaustive reach, and pairwise interactions.

Two techniques on a value function over subsets of heads (``v(S)``: a
metric with exactly the heads of ``S`` kept):

* :func:`sampled_shapley`: permutation sampling with antithetic pairs (a
  random order of the heads and its reverse; Mitchell et al. 2022). Each
  head's estimate is the mean of its marginal contributions over the pairs;
  its 95% interval covers both the sampling of permutations and the sampling
  of examples (a crossed design: ``var = var_pairs / P + var_examples / n``).
  It needs ``2 P (N + 1)`` evaluations instead of ``2**N``.
* :func:`interaction_indices`: pairwise Shapley interaction indices
  (Grabisch 1997) of a full subset table, through its Möbius transform in
  ``O(N 2**N)``: ``I_ij = sum over T containing i and j of m(T) / (|T| - 1)``.
  Positive: the two heads are worth more together (complements); negative:
  either does the other's job (redundant).

Subsets are indexed as in :mod:`mha.pruning.oracle`: bit ``i`` of ``s`` keeps
the ``i``-th existing head.

    phi, ci = sampled_shapley(value_fn, num_heads=32, num_pairs=64, rng=rng)
    pairs = interaction_pairs(values, config)   # largest magnitude first
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from mha import head_masks
from mha.model import TransformerConfig
from mha.run import arguments

#: ``value_fn(kept)``: ``kept`` ``[B, N]`` bool (which heads each subset
#: keeps) -> ``[B, n]`` per-example values whose mean over examples is
#: ``v(S)``.
ValueFn = Callable[[np.ndarray], np.ndarray]


def _chain_masks(orders: np.ndarray) -> np.ndarray:
  """``[P, N + 1, N]`` bool: for each order, the subsets that add its heads
  one at a time (row ``j`` keeps the first ``j`` heads of the order)."""
  p, n = orders.shape
  position = np.empty_like(orders)
  position[np.arange(p)[:, None], orders] = np.arange(n)[None, :]
  steps = np.arange(n + 1)[None, :, None]
  return position[:, None, :] < steps


def sampled_shapley(value_fn: ValueFn, num_heads: int, *, num_pairs: int,
                    rng: np.random.Generator, z: float = 1.959964
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Shapley values by antithetic permutation sampling.

  Args:
    value_fn: per-example values of subsets (:data:`ValueFn`).
    num_heads: ``N``, the players.
    num_pairs: ``P`` random orders, each evaluated with its reverse.
    rng: the orders' generator.
    z: the normal quantile of the interval (1.96: 95%).

  Returns:
    ``(phi, ci)``: ``[N]`` estimates and ``[N, 2]`` intervals.
  """
  arguments.check_count("num_heads", num_heads)
  if num_pairs < 2:
    raise ValueError(f"num_pairs must be >= 2, got {num_pairs}")
  orders = np.stack([rng.permutation(num_heads) for _ in range(num_pairs)])
  orders = np.concatenate([orders, orders[:, ::-1]])  # [2P, N]
  chains = _chain_masks(orders)  # [2P, N + 1, N]
  values = np.asarray(value_fn(chains.reshape(-1, num_heads)), np.float64)
  values = values.reshape(chains.shape[:2] + values.shape[-1:])  # [2P, N+1, n]
  gains = np.diff(values, axis=1)  # [2P, N, n]: gain of the order's j-th head
  per_head = np.empty_like(gains)
  rows = np.arange(len(orders))[:, None]
  per_head[rows, orders] = gains  # [2P, N (head), n]
  pairs = 0.5 * (per_head[:num_pairs] + per_head[num_pairs:])  # [P, N, n]
  by_pair = pairs.mean(axis=2)  # [P, N]
  by_example = pairs.mean(axis=0)  # [N, n]
  phi = by_pair.mean(axis=0)
  variance = (by_pair.var(axis=0, ddof=1) / num_pairs
              + by_example.var(axis=1, ddof=1) / by_example.shape[1])
  half = z * np.sqrt(variance)
  return phi, np.stack([phi - half, phi + half], axis=1)


def mobius(values: np.ndarray) -> np.ndarray:
  """The Möbius transform ``m(T) = sum over S in T of (-1)^{|T - S|} v(S)``
  of a subset table ``[2**N]``, in ``O(N 2**N)``. NumPy on the host, in
  float64: not for ``jit``."""
  m = np.array(values, np.float64)
  n = int(round(math.log2(len(m))))
  if 2 ** n != len(m):
    raise ValueError(f"a subset table has 2**N entries, got {len(m)}")
  for i in range(n):
    m = m.reshape(-1, 2, 2 ** i)
    m[:, 1, :] -= m[:, 0, :]
    m = m.reshape(-1)
  return m


def interaction_indices(values: np.ndarray) -> np.ndarray:
  """Pairwise Shapley interaction indices ``[N, N]`` (zero diagonal) of a
  subset table ``values`` ``[2**N]``. NumPy on the host: not for ``jit``."""
  m = mobius(values)
  n = int(round(math.log2(len(m))))
  bits = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(
      np.float64)
  size = bits.sum(axis=1)
  weight = np.where(size >= 2, m / np.maximum(size - 1, 1), 0.0)
  out = (bits * weight[:, None]).T @ bits
  np.fill_diagonal(out, 0.0)
  return out


def interaction_pairs(values: np.ndarray, config: TransformerConfig,
                      top: int | None = None) -> list[dict[str, Any]]:
  """Every pair of heads with its interaction index, largest magnitude
  first: ``{"heads": [[l, h], [l, h]], "value": v}`` (``top``: the first
  ``top`` only)."""
  arguments.check_count("top", top, none="every pair")
  matrix = interaction_indices(values)
  flat = np.flatnonzero(head_masks.existing_heads(config))
  pairs = head_masks.flat_to_pairs(config, flat)
  rows = [{"heads": [list(pairs[i]), list(pairs[j])],
           "value": float(matrix[i, j])}
          for i in range(len(flat)) for j in range(i + 1, len(flat))]
  rows.sort(key=lambda r: -abs(r["value"]))
  return rows[:top] if top is not None else rows


def layer_summary(pairs: list[dict[str, Any]]) -> dict[str, float]:
  """Mean interaction of the pairs within one layer and across layers, and
  the share of the most negative decile (the most redundant pairs) that lie
  within a layer, beside the share of all pairs that do."""
  within = np.asarray([p["heads"][0][0] == p["heads"][1][0] for p in pairs])
  value = np.asarray([p["value"] for p in pairs])
  if not len(value):
    return {}
  redundant = np.argsort(value)[:max(1, len(value) // 10)]
  nan_mean = lambda x: float(np.mean(x)) if len(x) else float("nan")
  return {"mean_within_layer": nan_mean(value[within]),
          "mean_across_layers": nan_mean(value[~within]),
          "redundant_decile_within_layer": float(np.mean(within[redundant])),
          "all_pairs_within_layer": float(np.mean(within))}


__all__ = ["ValueFn", "sampled_shapley", "mobius", "interaction_indices",
           "interaction_pairs", "layer_summary"]
