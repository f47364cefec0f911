"""Prediction speed of (physically pruned) models: compiled once, timed fairly.

    rates, flops = time_predictions([(model, params), (pruned, p)],
                                    {1: inputs_1, 64: inputs_64})
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import evaluate as eval_lib
from mha.model import Transformer
from mha.pruning import core

Array = jax.Array
Params = Any



def compile_prediction(model: Transformer, params: Params,
                       inputs: Array) -> Any:
  """The AOT-compiled prediction ``(params, inputs) -> logits`` (fused
  attention, no weights) for these shapes."""
  predict = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                             return_weights=False)[0])
  return predict.lower(params, inputs).compile()


def compiled_flops(compiled: Any) -> float:
  """FLOPs of a compiled program from XLA's cost analysis (NaN if the
  backend reports none)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", float("nan")))


def time_predictions(models: Sequence[tuple[Transformer, Params]],
                     inputs_by_batch: Mapping[int, np.ndarray], *,
                     repeats: int = 5, min_seconds: float = 0.02,
                     progress: Callable[[str], None] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Examples per second and FLOPs of each model at each batch size.

  Per batch size, every model is compiled once (the same executable gives
  the FLOP count) and warmed up; then the models are timed in alternation,
  so machine noise hits them alike. Each repeat runs as many calls as take
  about ``min_seconds``, blocking on every result; the figure is the median
  over ``repeats``.

  Returns:
    ``(examples_per_sec, flops)``, both ``[len(models), len(batch sizes)]``.
  """
  rates = np.zeros((len(models), len(inputs_by_batch)))
  flops = np.zeros_like(rates)
  for col, (batch_size, inputs) in enumerate(inputs_by_batch.items()):
    inputs = jax.device_put(inputs)
    fns, calls = [], []
    for row, (model, params) in enumerate(models):
      compiled = compile_prediction(model, params, inputs)
      flops[row, col] = compiled_flops(compiled)
      compiled(params, inputs).block_until_ready()  # warm-up
      start = time.perf_counter()
      compiled(params, inputs).block_until_ready()
      once = max(time.perf_counter() - start, 1e-6)
      fns.append(compiled)
      calls.append(max(1, int(min_seconds / once)))
    samples: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
      for row, (fn, (_, params)) in enumerate(zip(fns, models)):
        start = time.perf_counter()
        for _ in range(calls[row]):
          fn(params, inputs).block_until_ready()
        samples[row].append(calls[row] * batch_size /
                            (time.perf_counter() - start))
    rates[:, col] = [np.median(s) for s in samples]
    if progress:
      progress(f"batch {batch_size}: " + ", ".join(
          f"{r:,.0f}" for r in rates[:, col]) + " examples/s")
  return rates, flops


def speed_table(model: Transformer, params: Params, order: np.ndarray,
                test: data.Split, *, fractions: Sequence[float],
                batch_sizes: Sequence[int], repeats: int = 5,
                log: Callable[[str], None] = print) -> dict[str, Any]:
  """Prunes the first ``fraction`` of ``order`` physically for every one of
  ``fractions`` (and 0), checks each pruned model against the masked one on
  ``test``, and times prediction at every batch size."""
  config = model.config
  num_heads = int(core.existing_heads(config).sum())
  fractions = sorted({0.0, *fractions})
  masked_logits = jax.jit(functools.partial(core.masked_logits, model))
  inputs = jnp.asarray(test.inputs)
  entries, models = [], []
  for fraction in fractions:
    k = int(round(fraction * num_heads))
    removed = core.flat_to_pairs(config, order[:k])
    p, c = core.prune_heads(params, config, removed)
    pruned = Transformer(c)
    # One whole-split call each (tiny data): the pruned model, and the
    # original one under the equivalent mask.
    logits = compile_prediction(pruned, p, inputs)(p, inputs)
    reference = masked_logits(params, inputs,
                              jnp.asarray(core.mask_without(config,
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

  batches = {}
  for bs in batch_sizes:
    batches[bs] = np.tile(test.inputs, (-(-bs // len(test)), 1))[:bs]
  log(f"  timing {len(models)} models x {len(batches)} batch sizes, "
      f"median of {repeats}, interleaved")
  rates, flops = time_predictions(
      models, batches, repeats=repeats,
      progress=lambda s: log("    " + s))
  for entry, rate, flop in zip(entries, rates, flops):
    entry["examples_per_sec"] = {str(bs): float(r)
                                 for bs, r in zip(batches, rate)}
    entry["speedup"] = {str(bs): float(r / base)
                        for bs, r, base in zip(batches, rate, rates[0])}
    entry["flops"] = {str(bs): float(f) for bs, f in zip(batches, flop)}
    entry["flop_ratio"] = {str(bs): float(f / base)
                           for bs, f, base in zip(batches, flop, flops[0])}
  return {"batch_sizes": list(batch_sizes), "entries": entries}


__all__ = [
    "speed_table",
    "compile_prediction",
    "compiled_flops",
    "time_predictions",
]
