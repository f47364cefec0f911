"""Prediction speed of (physically pruned) models: compiled once, timed fairly.

The protocol (:func:`time_models`): per batch size, every model is compiled
once ahead of time (the same executable gives XLA's cost analysis: FLOPs,
bytes accessed, transcendental functions) and warmed up; then rounds each
time every model for one window of at least ``min_seconds`` (a fixed number
of calls, calibrated per model), the models' order rotated by one every
round, so that neither a slot in the round nor a drift of the machine favours
one model. A model's figure is the median of its rounds, with a
distribution-free confidence interval of the median from order statistics
(:func:`median_interval`); its speed-up is the median of the per-round ratios
to the unpruned model (paired: the same round, seconds apart), with the same
kind of interval.

How many rounds: at least ``repeats`` (10 by default) for every model. With
a ``target_width`` (the study's default), timing is adaptive: after the
floor, a cell (one model at one batch size) stops once its speed-up's
interval is at most ``target_width`` of the speed-up wide, or at
``max_repeats`` rounds; the unpruned model runs while any other does, so
every ratio stays paired. The rule looks at the interval's width only, never
at where it lies; :func:`stopping_coverage` measures, by simulation, that the
intervals keep their coverage under it. Without a ``target_width`` every cell
runs exactly ``repeats`` rounds (the fixed protocol).

    timings = time_models([(model, params), (pruned, p)],
                          {1: inputs_1, 64: inputs_64}, target_width=0.1)
    timings.examples_per_sec, timings.speedup_ci, timings.costs["flops"]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
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
from mha.pruning.constants import (ADAPTIVE_MIN_SECONDS, CONFIDENCE,
                                   MAX_REPEATS, MIN_SECONDS, REPEATS,
                                   TARGET_WIDTH)
from mha.run import arguments


# The timing protocol's defaults are in mha.pruning.constants (the flags
# read them without JAX): REPEATS, MIN_SECONDS, ADAPTIVE_MIN_SECONDS,
# TARGET_WIDTH, MAX_REPEATS, CONFIDENCE.
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


def gpu_products_uncounted() -> bool:
  """Whether XLA's cost analysis leaves out this process's GPU matrix
  products: on a GPU under ``--xla_gpu_deterministic_ops`` (in
  ``XLA_FLAGS``) it sends them to cuBLAS calls that report no FLOPs (an
  H100 with JAX 0.11.2: a ``jnp.exp(a) @ a`` reported -1 FLOPs, an
  attention layer 4% of its products'; docs/training.md)."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return jax.default_backend() == "gpu" and any(
      flag in ("--xla_gpu_deterministic_ops", "--xla_gpu_deterministic_ops=true")
      for flag in flags)


def compiled_costs(compiled: Any) -> dict[str, float]:
  """XLA's static cost analysis of a compiled program: ``flops``,
  ``bytes_accessed`` (every operand and result of every HLO op, summed) and
  ``transcendentals`` (exp, log, tanh, ... evaluations); NaN where the
  backend reports none, a negative count (XLA's "unknown"), or, for
  ``flops``, where it leaves out the matrix products
  (:func:`gpu_products_uncounted`)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older jax: one dict per program.
    cost = cost[0] if cost else {}
  cost = cost or {}
  costs = {name: float(cost.get(key, float("nan")))
           for key, name in COST_KEYS.items()}
  if gpu_products_uncounted():
    costs["flops"] = float("nan")
  return {name: value if value >= 0 else float("nan")
          for name, value in costs.items()}


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
  arguments.check_count("num_models", num_models)
  arguments.check_count("repeats", repeats)
  return [[(r + i) % num_models for i in range(num_models)]
          for r in range(repeats)]


@dataclasses.dataclass(frozen=True)
class Timings:
  """What :func:`time_models` measured; arrays are ``[models, batch sizes]``
  (``..., 2]`` for intervals ``[low, high]``, ``..., rounds]`` for rounds).

  Attributes:
    batch_sizes: the batch sizes, in column order.
    examples_per_sec: median over the rounds.
    examples_per_sec_ci: its interval (:func:`median_interval`).
    rounds: examples/s of every round, NaN after a cell stopped (a cell's
      rounds are the first ``rounds_run`` ones).
    speedup: median over the rounds of the ratio to model 0 in that round.
    speedup_ci: its interval.
    costs: XLA's ``flops``, ``bytes_accessed``, ``transcendentals``.
    calls_per_window: calls timed together in one window.
    schedule: the models' order in every round of the first batch size
      (:func:`rotation` for the fixed protocol).
    coverage: the smallest exact coverage of a cell's interval for its
      number of rounds (for a fixed number of rounds; under adaptive
      stopping see :func:`stopping_coverage`).
    rounds_run: rounds each cell ran.
    tight: whether a cell's speed-up interval met ``target_width`` (always
      False without one; model 0, the reference, follows the others).
    schedules: the order of every round, per batch size.
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
  rounds_run: np.ndarray | None = None
  tight: np.ndarray | None = None
  schedules: list[list[list[int]]] | None = None


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


def is_tight(ratios: Sequence[float], target_width: float) -> bool:
  """Whether the median interval of ``ratios`` has its full coverage
  (``CONFIDENCE``: at least 6 rounds at 95%) and is at most
  ``target_width`` of their median wide (the adaptive protocol's stopping
  rule)."""
  median, low, high, coverage = median_interval(ratios)
  return bool(coverage >= CONFIDENCE
              and high - low <= target_width * abs(median))


def run_rounds(window: Callable[[int], float], num_models: int, *,
               repeats: int, max_repeats: int,
               target_width: float | None
               ) -> tuple[list[list[float]], list[list[int]]]:
  """The rounds of one batch size: ``window(row)`` times model ``row`` once
  and returns its rate. Every model runs ``repeats`` rounds, the order
  rotated by one each round; with a ``target_width``, a model other than 0
  then stops once :func:`is_tight` holds for its ratios to model 0 (paired
  by round), or after ``max_repeats`` rounds, and model 0 runs while any
  other does.

  Returns:
    Every model's rates, round by round, and the order of every round.
  """
  arguments.check_count("num_models", num_models)
  arguments.check_count("repeats", repeats)
  arguments.check_count("max_repeats", max_repeats)
  rates: list[list[float]] = [[] for _ in range(num_models)]
  orders: list[list[int]] = []
  active = list(range(num_models))
  last = repeats if target_width is None else max(repeats, max_repeats)
  while active and len(orders) < last:
    shift = len(orders) % len(active)
    order = active[shift:] + active[:shift]
    for row in order:
      rates[row].append(window(row))
    orders.append(order)
    if len(orders) >= repeats:
      if target_width is None:
        break
      others = [row for row in active[1:] if not is_tight(
          np.asarray(rates[row]) / np.asarray(rates[0][:len(rates[row])]),
          target_width)]
      active = [0] + others if others else []
  return rates, orders


def time_models(models: Sequence[tuple[Transformer, Params]],
                inputs_by_batch: Mapping[int, np.ndarray], *,
                repeats: int = REPEATS, min_seconds: float = MIN_SECONDS,
                target_width: float | None = None,
                max_repeats: int = MAX_REPEATS,
                progress: Callable[[str], None] | None = None) -> Timings:
  """Times prediction of every model at every batch size (see the module
  docstring for the protocol): ``repeats`` rounds of windows of at least
  ``min_seconds``, and with a ``target_width`` more rounds, up to
  ``max_repeats``, for the cells whose speed-up interval is wider than that
  share of the speed-up. ``repeats`` below 10 or ``min_seconds`` below 0.02
  are for tests only."""
  arguments.check_count("repeats", repeats)
  arguments.check_count("max_repeats", max_repeats)
  m, b = len(models), len(inputs_by_batch)
  per_column: list[list[list[float]]] = []
  schedules: list[list[list[int]]] = []
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
    window = lambda row, col=col, fns=fns, inputs=inputs, bs=batch_size: (
        calls[row, col] * bs / _window(fns[row], models[row][1], inputs,
                                       calls[row, col]))
    rates, orders = run_rounds(window, m, repeats=repeats,
                               max_repeats=max_repeats,
                               target_width=target_width)
    per_column.append(rates)
    schedules.append(orders)
    if progress:
      progress(f"batch {batch_size}: " + ", ".join(
          f"{np.median(r):,.0f}" for r in rates) + " examples/s, "
          + "/".join(str(len(r)) for r in rates) + " rounds")
  longest = max((len(o) for o in schedules), default=0)
  rounds = np.full((m, b, longest), np.nan)
  rounds_run = np.zeros((m, b), np.int64)
  tight = np.zeros((m, b), bool)
  stats = np.zeros((m, b, 4))
  ratio = np.zeros((m, b, 4))
  for col, rates in enumerate(per_column):
    for row in range(m):
      r = np.asarray(rates[row])
      rounds[row, col, :len(r)] = r
      rounds_run[row, col] = len(r)
      ratios = r / np.asarray(rates[0][:len(r)])
      stats[row, col] = median_interval(r)
      ratio[row, col] = median_interval(ratios)
      if target_width is not None and row:
        tight[row, col] = is_tight(ratios, target_width)
    if target_width is not None and m > 1:
      tight[0, col] = bool(tight[1:, col].all())
  return Timings(
      batch_sizes=tuple(inputs_by_batch), examples_per_sec=stats[..., 0],
      examples_per_sec_ci=stats[..., 1:3], rounds=rounds,
      speedup=ratio[..., 0], speedup_ci=ratio[..., 1:3], costs=costs,
      calls_per_window=calls, schedule=schedules[0] if schedules else [],
      coverage=float(stats[..., 3].min()) if m and b else float("nan"),
      rounds_run=rounds_run, tight=tight, schedules=schedules)


def stopping_coverage(simulations: int = 2000, *, repeats: int = REPEATS,
                      max_repeats: int = MAX_REPEATS,
                      target_width: float = TARGET_WIDTH,
                      noise: float = 0.08, spikes: float = 0.1,
                      speedup: float = 1.5, seed: int = 0
                      ) -> dict[str, float]:
  """How often the speed-up's interval covers the true median speed-up
  under the adaptive protocol, by simulation of :func:`run_rounds` on two
  models.

  A window's time is ``base * drift * exp(noise * Z) * spike``: the drift
  (one per round, shared by both models, as a machine's load is) cancels in
  the paired ratio; ``Z`` is standard normal; with probability ``spikes``
  the window is slowed by a factor uniform in [1.2, 3] (another process
  taking the core), which makes the rates skewed and heavy-tailed. The true
  median ratio is taken from 10^6 simulated rounds.

  Returns:
    ``coverage`` (share of simulations whose interval holds the true
    median), ``mean_rounds`` and ``tight`` (share that met the target).
  """
  rng = np.random.default_rng(seed)

  def times(size):
    spike = np.where(rng.random(size) < spikes,
                     rng.uniform(1.2, 3.0, size), 1.0)
    return np.exp(noise * rng.standard_normal(size)) * spike

  base = np.array([1.0, 1.0 / speedup])
  truth = float(np.median(times(10 ** 6) / times(10 ** 6) * speedup))
  hits = rounds = tight = 0
  for _ in range(simulations):
    drift = np.exp(0.2 * rng.standard_normal(max(repeats, max_repeats)))
    count = [0]  # Windows so far; both models run in every round.

    def window(row, drift=drift, count=count):
      count[0] += 1
      return 1.0 / (base[row] * drift[(count[0] - 1) // 2] * times(1)[0])

    rates, _ = run_rounds(window, 2, repeats=repeats,
                          max_repeats=max_repeats, target_width=target_width)
    ratios = np.asarray(rates[1]) / np.asarray(rates[0][:len(rates[1])])
    _, low, high, _ = median_interval(ratios)
    hits += low <= truth <= high
    rounds += len(ratios)
    tight += is_tight(ratios, target_width)
  return {"coverage": hits / simulations, "mean_rounds": rounds / simulations,
          "tight": tight / simulations, "truth": truth}


def time_predictions(models: Sequence[tuple[Transformer, Params]],
                     inputs_by_batch: Mapping[int, np.ndarray], *,
                     repeats: int = REPEATS, min_seconds: float = MIN_SECONDS,
                     progress: Callable[[str], None] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Examples per second (median) and FLOPs of each model at each batch
  size, both ``[len(models), len(batch sizes)]``: :func:`time_models`
  without the intervals and the other costs."""
  arguments.check_count("repeats", repeats)
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
  if timings.rounds_run is not None:
    fields["rounds"] = per_bs([int(n) for n in timings.rounds_run[row]])
    fields["tight"] = per_bs([bool(t) for t in timings.tight[row]])
    fields["examples_per_sec_rounds"] = per_bs(
        [[float(v) for v in r[:n]] for r, n in
         zip(timings.rounds[row], timings.rounds_run[row])])
  for name, values in timings.costs.items():
    ratio = "flop_ratio" if name == "flops" else f"{name}_ratio"
    fields[name] = floats(values[row])
    fields[ratio] = floats(values[row] / values[0])
  return fields


def speed_table(model: Transformer, params: Params, order: np.ndarray,
                test: data.Split, *, fractions: Sequence[float],
                batch_sizes: Sequence[int], repeats: int = REPEATS,
                min_seconds: float = MIN_SECONDS,
                target_width: float | None = None,
                max_repeats: int = MAX_REPEATS,
                log: Callable[[str], None] = print) -> dict[str, Any]:
  """Prunes the first ``fraction`` of ``order`` physically for every one of
  ``fractions`` (and 0), checks each pruned model against the masked one on
  ``test``, and times prediction at every batch size (:func:`time_models`).

  Returns:
    ``batch_sizes``; ``timing``: the protocol (``repeats``, the floor;
    ``min_seconds``; ``adaptive`` with its ``target_width`` and
    ``max_repeats``; the rotation ``schedule`` of the first batch size, the
    ``interval`` method and the smallest exact ``coverage`` for the rounds
    run); ``entries``: one per fraction, with the pruned model's heads,
    parameters and test metrics and, per batch size, ``examples_per_sec``
    (median) and ``examples_per_sec_ci``, ``examples_per_sec_rounds``,
    ``rounds`` (how many) and ``tight`` (the target met), ``speedup``
    (median of per-round ratios to the unpruned model) and ``speedup_ci``,
    ``calls_per_window``, and XLA's
    ``flops``, ``bytes_accessed``, ``transcendentals`` with their ratios to
    the unpruned model (``flop_ratio``, ``bytes_accessed_ratio``,
    ``transcendentals_ratio``).
  """
  arguments.check_counts("batch_sizes", batch_sizes)
  arguments.check_count("repeats", repeats)
  arguments.check_count("max_repeats", max_repeats)
  fractions = sorted({0.0, *fractions})
  entries, models = _pruned_entries(model, params, np.asarray(order), test,
                                    fractions)
  batches = {}
  for bs in batch_sizes:
    batches[bs] = np.tile(test.inputs, (-(-bs // len(test)), 1))[:bs]
  rounds = (f"{repeats} rounds" if target_width is None else
            f"{repeats} to {max(repeats, max_repeats)} rounds (a cell stops "
            f"once its speed-up is known within {target_width:.0%})")
  log(f"  timing {len(models)} models x {len(batches)} batch sizes: "
      f"{rounds} of >= {min_seconds:g} s windows, order rotated every "
      "round; median and its interval")
  timings = time_models(models, batches, repeats=repeats,
                        min_seconds=min_seconds, target_width=target_width,
                        max_repeats=max_repeats,
                        progress=lambda s: log("    " + s))
  for row, entry in enumerate(entries):
    entry.update(_timing_fields(timings, row))
  return {
      "batch_sizes": list(batch_sizes),
      "timing": {
          "repeats": repeats, "min_seconds": min_seconds,
          "adaptive": target_width is not None,
          "target_width": target_width,
          "max_repeats": (max(repeats, max_repeats) if target_width is not None
                          else repeats),
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
    "gpu_products_uncounted",
    "median_interval",
    "rotation",
    "is_tight",
    "run_rounds",
    "stopping_coverage",
    "Timings",
    "time_models",
    "time_predictions",
]
