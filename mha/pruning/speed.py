"""Prediction speed of (physically pruned) models: compiled once, timed fairly.

The protocol (:func:`time_models`): per batch size, every model is compiled
once ahead of time (the same executable gives XLA's cost analysis: FLOPs,
bytes accessed, transcendental functions) and warmed up; then ``repeats``
rounds each time every model for one window of at least ``min_seconds``
(a fixed number of calls, calibrated per model), the models' order rotated by
one every round, so that neither a slot in the round nor a drift of the
machine favours one model. A model's figure is the median of its rounds, with
a distribution-free confidence interval of the median from order statistics
(:func:`median_interval`); its speed-up is the median of the per-round ratios
to the unpruned model (paired: the same round, minutes apart at most), with
the same kind of interval.

    timings = time_models([(model, params), (pruned, p)],
                          {1: inputs_1, 64: inputs_64})
    timings.examples_per_sec, timings.speedup_ci, timings.costs["flops"]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha.aliases import Array, Params
from mha.model import Transformer
from mha.pruning import core


REPEATS = 10  # Rounds of timing (the floor).
MIN_SECONDS = 0.2  # Shortest timing window per model and round.
CONFIDENCE = 0.95  # Nominal coverage of the median's interval.
# XLA's cost analysis keys -> our JSON names.
COST_KEYS = {"flops": "flops", "bytes accessed": "bytes_accessed",
             "transcendentals": "transcendentals"}


def compile_prediction(model: Transformer, params: Params,
                       inputs: Array) -> Any:
  """The AOT-compiled prediction ``(params, inputs) -> logits`` (fused
  attention, no weights) for these shapes."""
  predict = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                             return_weights=False)[0])
  return predict.lower(params, inputs).compile()


def compiled_costs(compiled: Any) -> dict[str, float]:
  """XLA's static cost analysis of a compiled program: ``flops``,
  ``bytes_accessed`` (every operand and result of every HLO op, summed) and
  ``transcendentals`` (exp, log, tanh, ... evaluations); NaN where the
  backend reports none."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older jax: one dict per program.
    cost = cost[0] if cost else {}
  cost = cost or {}
  return {name: float(cost.get(key, float("nan")))
          for key, name in COST_KEYS.items()}


def compiled_flops(compiled: Any) -> float:
  """FLOPs of a compiled program from XLA's cost analysis (NaN if the
  backend reports none)."""
  return compiled_costs(compiled)["flops"]


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE
                    ) -> tuple[float, float, float, float]:
  """The median and a distribution-free confidence interval for it.

  The interval is ``[x_(l), x_(n+1-l)]`` of the sorted samples, ``l`` the
  largest rank with ``P(Binomial(n, 1/2) < l) <= (1 - confidence) / 2``: it
  covers the true median with probability at least ``confidence`` for any
  continuous distribution of independent samples (e.g. ``x_(2), x_(9)`` of
  10 samples, 97.9%). With too few samples for that (fewer than 6 at 95%)
  it is the range, with its smaller coverage.

  Returns:
    ``(median, low, high, coverage)``, coverage the interval's exact one.
  """
  x = np.sort(np.asarray(samples, np.float64))
  n = len(x)
  if n == 0:
    nan = float("nan")
    return nan, nan, nan, nan
  below = lambda k: sum(math.comb(n, i) for i in range(k)) / 2.0 ** n
  rank = 1  # 1-based rank of the lower end.
  while rank + 1 <= (n + 1) // 2 and below(rank + 1) <= (1 - confidence) / 2:
    rank += 1
  coverage = 1.0 - 2.0 * below(rank)
  return (float(np.median(x)), float(x[rank - 1]), float(x[n - rank]),
          float(coverage))


def rotation(num_models: int, repeats: int) -> list[list[int]]:
  """The order the models run in, round by round: round ``r`` starts with
  model ``r mod num_models`` and goes on cyclically."""
  return [[(r + i) % num_models for i in range(num_models)]
          for r in range(repeats)]


@dataclasses.dataclass(frozen=True)
class Timings:
  """What :func:`time_models` measured; arrays are ``[models, batch sizes]``
  (``..., 2]`` for intervals ``[low, high]``, ``..., repeats]`` for rounds).

  Attributes:
    batch_sizes: the batch sizes, in column order.
    examples_per_sec: median over the rounds.
    examples_per_sec_ci: its interval (:func:`median_interval`).
    rounds: examples/s of every round.
    speedup: median over the rounds of the ratio to model 0 in that round.
    speedup_ci: its interval.
    costs: XLA's ``flops``, ``bytes_accessed``, ``transcendentals``.
    calls_per_window: calls timed together in one window.
    schedule: the models' order in every round (:func:`rotation`).
    coverage: the intervals' exact coverage for this number of rounds.
  """

  batch_sizes: tuple[int, ...]
  examples_per_sec: np.ndarray
  examples_per_sec_ci: np.ndarray
  rounds: np.ndarray
  speedup: np.ndarray
  speedup_ci: np.ndarray
  costs: dict[str, np.ndarray]
  calls_per_window: np.ndarray
  schedule: list[list[int]]
  coverage: float


def _window(fn: Callable, params: Params, inputs: Array, calls: int) -> float:
  """Seconds for ``calls`` calls, each result waited for."""
  start = time.perf_counter()
  for _ in range(calls):
    fn(params, inputs).block_until_ready()
  return time.perf_counter() - start


def _calls_for(fn: Callable, params: Params, inputs: Array,
               min_seconds: float) -> int:
  """Calls that take at least ``min_seconds``: doubled until a quarter of it
  is reached, then scaled up (10% margin)."""
  calls, seconds = 1, _window(fn, params, inputs, 1)
  while seconds < min_seconds / 4 and calls < 1 << 20:
    calls *= 2
    seconds = _window(fn, params, inputs, calls)
  if seconds >= min_seconds:
    return calls
  return max(1, math.ceil(1.1 * calls * min_seconds / max(seconds, 1e-9)))


def time_models(models: Sequence[tuple[Transformer, Params]],
                inputs_by_batch: Mapping[int, np.ndarray], *,
                repeats: int = REPEATS, min_seconds: float = MIN_SECONDS,
                progress: Callable[[str], None] | None = None) -> Timings:
  """Times prediction of every model at every batch size (see the module
  docstring for the protocol). ``repeats`` below 10 or ``min_seconds`` below
  0.2 are for tests only."""
  m, b = len(models), len(inputs_by_batch)
  schedule = rotation(m, repeats)
  rounds = np.zeros((m, b, repeats))
  calls = np.zeros((m, b), np.int64)
  costs = {name: np.zeros((m, b)) for name in COST_KEYS.values()}
  for col, (batch_size, inputs) in enumerate(inputs_by_batch.items()):
    inputs = jax.device_put(inputs)
    fns = []
    for row, (model, params) in enumerate(models):
      compiled = compile_prediction(model, params, inputs)
      for name, value in compiled_costs(compiled).items():
        costs[name][row, col] = value
      compiled(params, inputs).block_until_ready()  # warm-up
      calls[row, col] = _calls_for(compiled, params, inputs, min_seconds)
      fns.append(compiled)
    for r, order in enumerate(schedule):
      for row in order:
        seconds = _window(fns[row], models[row][1], inputs, calls[row, col])
        rounds[row, col, r] = calls[row, col] * batch_size / seconds
    if progress:
      progress(f"batch {batch_size}: " + ", ".join(
          f"{np.median(r):,.0f}" for r in rounds[:, col]) + " examples/s")
  stats = np.asarray([[median_interval(rounds[i, j]) for j in range(b)]
                      for i in range(m)])  # [m, b, 4]
  ratio = np.asarray([[median_interval(rounds[i, j] / rounds[0, j])
                       for j in range(b)] for i in range(m)])
  return Timings(
      batch_sizes=tuple(inputs_by_batch), examples_per_sec=stats[..., 0],
      examples_per_sec_ci=stats[..., 1:3], rounds=rounds,
      speedup=ratio[..., 0], speedup_ci=ratio[..., 1:3], costs=costs,
      calls_per_window=calls, schedule=schedule,
      coverage=float(stats[0, 0, 3]) if m and b else float("nan"))


def time_predictions(models: Sequence[tuple[Transformer, Params]],
                     inputs_by_batch: Mapping[int, np.ndarray], *,
                     repeats: int = REPEATS, min_seconds: float = MIN_SECONDS,
                     progress: Callable[[str], None] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Examples per second (median) and FLOPs of each model at each batch
  size, both ``[len(models), len(batch sizes)]``: :func:`time_models`
  without the intervals and the other costs."""
  timings = time_models(models, inputs_by_batch, repeats=repeats,
                        min_seconds=min_seconds, progress=progress)
  return timings.examples_per_sec, timings.costs["flops"]


def _pruned_entries(model: Transformer, params: Params, order: np.ndarray,
                    test: data.Split, fractions: Sequence[float]
                    ) -> tuple[list[dict[str, Any]], list[tuple[Any, Any]]]:
  """Per fraction: the physically pruned ``(model, params)`` and an entry
  with its heads, parameter counts, test metrics and its largest logit
  difference to the original model under the equivalent mask."""
  config = model.config
  num_heads = int(head_masks.existing_heads(config).sum())
  masked_logits = jax.jit(functools.partial(head_masks.masked_logits, model))
  inputs = jnp.asarray(test.inputs)
  entries, models = [], []
  for fraction in fractions:
    k = int(round(fraction * num_heads))
    removed = head_masks.flat_to_pairs(config, order[:k])
    p, c = core.prune_heads(params, config, removed)
    pruned = Transformer(c)
    # One whole-split call each (tiny data): the pruned model, and the
    # original one under the equivalent mask.
    logits = compile_prediction(pruned, p, inputs)(p, inputs)
    reference = masked_logits(params, inputs,
                              jnp.asarray(head_masks.mask_without(config,
                                                            order[:k])))
    metrics = eval_lib.summarize(jax.device_get(eval_lib.metric_sums(
        logits, jnp.asarray(test.targets), inputs)))
    entries.append({
        "fraction": fraction, "heads_removed": k,
        "removed": [list(pair) for pair in removed],
        "heads_per_layer": list(c.heads_per_layer),
        "params": core.count_params(p),
        "attention_params": core.count_params(
            [p[f"layer_{i}"]["attention"] for i in range(c.num_layers)]),
        **{f"test_{key}": value for key, value in metrics.items()},
        "max_abs_logit_diff_pruned_vs_masked": float(
            jnp.max(jnp.abs(logits - reference))),
    })
    models.append((pruned, p))
  return entries, models


def _timing_fields(timings: Timings, row: int) -> dict[str, Any]:
  """The JSON fields of model ``row``: per batch size (string keys), the
  rates, speed-ups and XLA costs, each cost also as a ratio to model 0."""
  per_bs = lambda values: {str(bs): values[j]
                           for j, bs in enumerate(timings.batch_sizes)}
  floats = lambda a: per_bs([float(v) for v in a])
  pairs = lambda a: per_bs([[float(lo), float(hi)] for lo, hi in a])
  fields = {
      "examples_per_sec": floats(timings.examples_per_sec[row]),
      "examples_per_sec_ci": pairs(timings.examples_per_sec_ci[row]),
      "examples_per_sec_rounds": per_bs(
          [[float(v) for v in r] for r in timings.rounds[row]]),
      "speedup": floats(timings.speedup[row]),
      "speedup_ci": pairs(timings.speedup_ci[row]),
      "calls_per_window": per_bs(
          [int(c) for c in timings.calls_per_window[row]]),
  }
  for name, values in timings.costs.items():
    ratio = "flop_ratio" if name == "flops" else f"{name}_ratio"
    fields[name] = floats(values[row])
    fields[ratio] = floats(values[row] / values[0])
  return fields


def speed_table(model: Transformer, params: Params, order: np.ndarray,
                test: data.Split, *, fractions: Sequence[float],
                batch_sizes: Sequence[int], repeats: int = REPEATS,
                min_seconds: float = MIN_SECONDS,
                log: Callable[[str], None] = print) -> dict[str, Any]:
  """Prunes the first ``fraction`` of ``order`` physically for every one of
  ``fractions`` (and 0), checks each pruned model against the masked one on
  ``test``, and times prediction at every batch size (:func:`time_models`).

  Returns:
    ``batch_sizes``; ``timing``: the protocol (``repeats``, ``min_seconds``,
    the rotation ``schedule``, the ``interval`` method and its exact
    ``coverage``); ``entries``: one per fraction, with the pruned model's
    heads, parameters and test metrics and, per batch size,
    ``examples_per_sec`` (median) and ``examples_per_sec_ci``,
    ``examples_per_sec_rounds``, ``speedup`` (median of per-round ratios to
    the unpruned model) and ``speedup_ci``, ``calls_per_window``, and XLA's
    ``flops``, ``bytes_accessed``, ``transcendentals`` with their ratios to
    the unpruned model (``flop_ratio``, ``bytes_accessed_ratio``,
    ``transcendentals_ratio``).
  """
  fractions = sorted({0.0, *fractions})
  entries, models = _pruned_entries(model, params, np.asarray(order), test,
                                    fractions)
  batches = {}
  for bs in batch_sizes:
    batches[bs] = np.tile(test.inputs, (-(-bs // len(test)), 1))[:bs]
  log(f"  timing {len(models)} models x {len(batches)} batch sizes: "
      f"{repeats} rounds of >= {min_seconds:g} s windows, order rotated "
      "every round; median and its interval")
  timings = time_models(models, batches, repeats=repeats,
                        min_seconds=min_seconds,
                        progress=lambda s: log("    " + s))
  for row, entry in enumerate(entries):
    entry.update(_timing_fields(timings, row))
  return {
      "batch_sizes": list(batch_sizes),
      "timing": {
          "repeats": repeats, "min_seconds": min_seconds,
          "schedule": timings.schedule,
          "interval": "distribution-free confidence interval of the median "
                      "from order statistics (binomial ranks)",
          "confidence": CONFIDENCE, "coverage": timings.coverage,
      },
      "entries": entries,
  }


__all__ = [
    "speed_table",
    "compile_prediction",
    "compiled_costs",
    "compiled_flops",
    "median_interval",
    "rotation",
    "Timings",
    "time_models",
    "time_predictions",
]
