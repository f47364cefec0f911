"""Searches for the best subset of heads beyond the exhaustive oracle's reach.

Each search returns, for every number ``k`` of heads removed, one removal
(flat head indices ``layer * H + head``, as :func:`mha.pruning.oracle.
ranked_removals` gives) and its value. Both evaluate subsets through a
batched value function, so a whole level of candidates is one call:

* :func:`layer_surrogate`: every removal set of each layer alone
  (``2**H_l`` per layer, the other layers whole), then a knapsack over the
  layers for the ``top`` best combinations of each size under the additive
  surrogate ``v(full) + sum_l gain_l(R_l)``, each evaluated exactly, the best
  polished by swap local search. Exact when the value is layer-additive.
* :func:`beam_search`: from the full model, remove one more head at a time,
  keeping the ``width`` best subsets of each size (all children of a level in
  one call). With a width of at least ``C(N, k)`` it is exhaustive.

    value_fn = lambda masks: validation_token_accuracy(masks)   # [B] values
    found = layer_surrogate(value_fn, config)
    found[3]   # {"k": 3, "removed": array([...]), "value": 0.97}
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Callable

import numpy as np

from mha import head_masks
from mha.aliases import Log
from mha.model import TransformerConfig
from mha.run.progress import Tenths, quiet
from mha.run import arguments

#: Seconds after which a search reports its progress (a line per tenth of
#: its sizes ``k``).
PROGRESS_AFTER_S = 10.0

#: ``value_fn(masks)``: float ``[B, L, H]`` head masks (1 keeps) -> ``[B]``
#: values, higher is better.
ValueFn = Callable[[np.ndarray], np.ndarray]


def _masks(config: TransformerConfig, removals: list[tuple[int, ...]]
           ) -> np.ndarray:
  return np.stack([head_masks.mask_without(config, list(r))
                   for r in removals]) if removals else np.zeros(
                       (0,) + head_masks.existing_heads(config).shape,
                       np.float32)


def _evaluate(value_fn: ValueFn, config: TransformerConfig,
              removals: list[tuple[int, ...]]) -> np.ndarray:
  if not removals:
    return np.zeros((0,))
  return np.asarray(value_fn(_masks(config, removals)), np.float64)


def _entry(k: int, removal: tuple[int, ...], value: float) -> dict[str, Any]:
  return {"k": k, "removed": np.asarray(sorted(removal), np.int64),
          "value": float(value)}


def _layer_heads(config: TransformerConfig) -> list[list[int]]:
  """The flat indices of each layer's existing heads."""
  return [[layer * config.max_heads + h for h in range(count)]
          for layer, count in enumerate(config.heads_per_layer)]


def _knapsack(gains: list[dict[tuple[int, ...], float]], top: int
              ) -> list[list[tuple[float, tuple[int, ...]]]]:
  """For every total size, the ``top`` best combinations of one removal per
  layer by the sum of their gains: ``[k] -> [(gain, removal)]``, best
  first."""
  table: dict[int, list[tuple[float, tuple[int, ...]]]] = {0: [(0.0, ())]}
  for layer_gains in gains:
    nxt: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
    for size, options in table.items():
      for removal, gain in layer_gains.items():
        bucket = nxt.setdefault(size + len(removal), [])
        for total, chosen in options:
          bucket.append((total + gain, chosen + removal))
    table = {size: heapq.nlargest(top, bucket, key=lambda x: x[0])
             for size, bucket in nxt.items()}
  return [table.get(k, []) for k in range(max(table) + 1)]


def _polish(value_fn: ValueFn, config: TransformerConfig,
            removal: tuple[int, ...], value: float, heads: list[int],
            max_rounds: int) -> tuple[tuple[int, ...], float, int]:
  """Swap local search: exchange one removed head for a kept one while that
  raises the value (every swap of a round in one call). Returns the removal,
  its value and the number of subsets evaluated."""
  evaluated = 0
  for _ in range(max_rounds):
    kept = [h for h in heads if h not in removal]
    swaps = [tuple(sorted(set(removal) - {out} | {back}))
             for out in removal for back in kept]
    if not swaps:
      break
    values = _evaluate(value_fn, config, swaps)
    evaluated += len(swaps)
    best = int(np.argmax(values))
    if values[best] <= value:
      break
    removal, value = swaps[best], float(values[best])
  return removal, value, evaluated


def layer_surrogate(value_fn: ValueFn, config: TransformerConfig, *,
                    top: int = 8, polish_rounds: int = 4,
                    log: Log = quiet) -> list[dict[str, Any]]:
  """The layer-additive surrogate search (see the module docstring).

  Args:
    value_fn: values of batches of head masks (:data:`ValueFn`).
    config: the model's config (which heads exist).
    top: combinations per size evaluated exactly.
    polish_rounds: rounds of swap local search (0: none).
    log: where long searches report their progress.

  Returns:
    for ``k = 0..N`` the best removal found and its value.
  """
  arguments.check_count("top", top)
  arguments.check_count("polish_rounds", polish_rounds, 0)
  layers = _layer_heads(config)
  singles = [tuple(r) for heads in layers
             for size in range(len(heads) + 1)
             for r in itertools.combinations(heads, size)]
  values = dict(zip(singles, _evaluate(value_fn, config, singles)))
  full = values[()]
  gains = [{r: values[r] - full for r in singles
            if set(r) <= set(heads)} for heads in layers]
  ranked = _knapsack(gains, top)
  candidates = [r for level in ranked for _, r in level]
  exact = dict(zip(candidates, _evaluate(value_fn, config, candidates)))
  heads = [h for layer in layers for h in layer]
  progress = Tenths(log, "surrogate search, polishing", len(ranked) - 1,
                    PROGRESS_AFTER_S)
  evaluated = len(singles) + len(candidates)
  out = []
  for k, level in enumerate(ranked):
    removal = max((r for _, r in level), key=lambda r: exact[r])
    removal, value, swaps = _polish(
        value_fn, config, removal, exact[removal], heads,
        polish_rounds if 0 < k < len(heads) else 0)
    evaluated += swaps
    out.append(_entry(k, removal, value))
    progress(k, f"sizes, {evaluated:,} subsets")
  return out


def beam_search(value_fn: ValueFn, config: TransformerConfig, *,
                width: int = 16, log: Log = quiet) -> list[dict[str, Any]]:
  """Beam search over removals, one head more per level (see the module
  docstring); ``width`` subsets kept per level; long searches report their
  progress to ``log``."""
  arguments.check_count("width", width)
  heads = [h for layer in _layer_heads(config) for h in layer]
  beam = [()]
  out = [_entry(0, (), float(_evaluate(value_fn, config, [()])[0]))]
  progress = Tenths(log, "beam search", len(heads), PROGRESS_AFTER_S)
  evaluated = 1
  for k in range(1, len(heads) + 1):
    children = sorted({tuple(sorted(r + (h,))) for r in beam for h in heads
                       if h not in r})
    values = _evaluate(value_fn, config, children)
    evaluated += len(children)
    progress(k, f"sizes, {evaluated:,} subsets")
    order = np.argsort(-values, kind="stable")[:width]
    beam = [children[i] for i in order]
    out.append(_entry(k, beam[0], values[order[0]]))
  return out


def surrogate_evaluations(config: TransformerConfig, *, top: int = 8,
                          polish_rounds: int = 4) -> tuple[int, int]:
  """The fewest and the most subsets :func:`layer_surrogate` evaluates:
  every removal of each layer alone, the ``top`` best combinations of each
  size, then one round of swaps per size (at least) up to
  ``polish_rounds`` (at most)."""
  arguments.check_count("top", top)
  arguments.check_count("polish_rounds", polish_rounds, 0)
  n = sum(config.heads_per_layer)
  fixed = (sum(2 ** h for h in config.heads_per_layer)
           + sum(min(top, math.comb(n, k)) for k in range(n + 1)))
  swaps = sum(k * (n - k) for k in range(1, n))
  return fixed + swaps * min(polish_rounds, 1), fixed + swaps * polish_rounds


def beam_evaluations(config: TransformerConfig, *, width: int = 16) -> int:
  """The most subsets :func:`beam_search` evaluates (exact when ``width``
  keeps every subset of each size): the full model, then per size ``k``
  the children of the beam, at most ``C(N, k)``."""
  arguments.check_count("width", width)
  n = sum(config.heads_per_layer)
  return 1 + sum(min(math.comb(n, k),
                     min(width, math.comb(n, k - 1)) * (n - k + 1))
                 for k in range(1, n + 1))


__all__ = ["ValueFn", "layer_surrogate", "beam_search",
           "surrogate_evaluations", "beam_evaluations"]
