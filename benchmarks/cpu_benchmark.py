r"""Speed of the attention layer and the train step, side by side with Flax.

    python benchmarks/cpu_benchmark.py           # about 2 minutes on 2 CPU cores
    python benchmarks/cpu_benchmark.py --quick   # tiny shapes, seconds (for tests)

(``python benchmarks/benchmark.py`` with no section flag runs this.)

Measures in one process, float32, on JAX's default device:

1. One attention layer, forward + backward returning the attention weights:
   ``mha.MultiHeadAttention`` against Flax's ``MultiHeadDotProductAttention``
   with ``sow_weights=True``, on the same parameters, at several shapes.
2. Inference without weights: ``return_weights=False`` against Flax's module
   without sowing.
3. Our forward FLOP rate at a large shape as a fraction of the float32 matmul
   peak, measured in the same run with ``jnp.dot`` on square matrices.
4. Train-step throughput (``mha.train.train_step``) at the default config and
   at a larger one, on random batches already on the device.
5. The pruning study's mask evaluations, on a model of the default config
   (random weights: the speed does not depend on them) and random examples:
   leave-one-out (every single-head mask and the full one) vmapped over masks
   against a Python loop of one jitted call per mask; and every subset of
   heads (the oracle) layer by layer with shared prefixes
   (``mha.pruning.oracle.evaluate_subsets``) against ``evaluate_masks`` over
   the same ``2**N`` masks.

Machines are noisy, so the compared functions run interleaved, in alternating
order (ours first in even rounds, Flax first in odd ones), and the figures are
medians; a ratio is ours / Flax of the medians (below 1: ours is faster).
Prints the tables (markdown) to stdout, writes every number, raw timings
included, to ``--out`` (JSON; by default ``benchmarks/results/<UTC
date>_cpu_<commit>.json``, ``cpu_quick`` with ``--quick``) and the tables
beside it (``.md``). A bad flag is one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

# Run as a file, the path holds this folder, not the repository's root: put
# it first, for the ``benchmarks`` package (which is not installed) and this
# checkout's ``mha`` (whose commit the results record).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from configs import default
from mha import build
from mha import data
from mha import train
from mha.attention import MultiHeadAttention
from mha.pruning import core as pruning
from mha.pruning import oracle
from mha.pruning import speed
from mha.run import cli

from benchmarks.benchmarking import (
    LayerShape, checked_out, header_lines, load_average, median_ms, record,
    time_interleaved, write_results)

_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny shapes, few repeats and XLA optimizations off: a "
    "smoke test of seconds whose numbers mean nothing.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_cpu_<commit>.json); the markdown tables go next to it (.md).")
_REPEATS = flags.DEFINE_integer(
    "repeats", None, "Timed rounds per comparison (default 20; 3 with "
    "--quick).", lower_bound=1)

_PROG = "cpu_benchmark.py"


# A self-attention layer's input ``[batch, length, width]`` and heads.
Shape = LayerShape


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run measures.

  Attributes:
    name: "full" or "quick".
    layer_shapes: shapes of the ours-vs-Flax layer comparisons.
    flop_shape: the shape of the FLOP-rate measurement.
    matmul_sizes: sizes N of the ``[N, N] @ [N, N]`` peak measurements (the
      peak is the best of them).
    repeats: timed rounds of each comparison.
    train_configs: ``(label, get_config argument)`` of the train steps timed.
    train_window_s: about how long a timed window of train steps lasts.
    train_windows: timed windows (the rate is their median).
    pruning_config: ``get_config`` argument of the pruning-mask timings.
    pruning_examples: examples evaluated under each mask.
    pruning_repeats: timed rounds of the pruning-mask timings.
  """
  name: str
  layer_shapes: tuple[Shape, ...]
  flop_shape: Shape
  matmul_sizes: tuple[int, ...]
  repeats: int
  train_configs: tuple[tuple[str, str], ...]
  train_window_s: float
  train_windows: int
  pruning_config: str = ""
  pruning_examples: int = 1000
  pruning_repeats: int = 5


# The larger train-step config: 4 layers of width 128, 8 heads, MLP 512.
LARGER = ("model.num_layers=4,model.d_model=128,model.num_heads=8,"
          "model.mlp_dim=512")

FULL = Plan(
    name="full",
    layer_shapes=(Shape(32, 64, 256, 8), Shape(8, 512, 512, 8),
                  Shape(256, 16, 64, 4)),
    flop_shape=Shape(8, 512, 512, 8),
    matmul_sizes=(1024, 2048),
    repeats=20,
    train_configs=(("default", ""), ("larger", LARGER)),
    train_window_s=2.0,
    train_windows=5,
)

QUICK = Plan(
    name="quick",
    layer_shapes=(Shape(2, 8, 16, 2),),
    flop_shape=Shape(2, 16, 32, 4),
    matmul_sizes=(64, 128),
    repeats=3,
    train_configs=(("tiny", "tiny"),),
    train_window_s=0.01,
    train_windows=2,
    pruning_config="tiny",
    pruning_examples=64,
    pruning_repeats=2,
)


# --------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------


def _comparison(times: Mapping[str, list[float]]) -> dict[str, Any]:
  ours, theirs = median_ms(times["ours"]), median_ms(times["flax"])
  paired = [a / b for a, b in zip(times["ours"], times["flax"])]
  return {
      "ours_ms": ours,
      "flax_ms": theirs,
      "ratio": ours / theirs,
      "paired_ratio_median": statistics.median(paired),
      "ours_times_ms": [1e3 * t for t in times["ours"]],
      "flax_times_ms": [1e3 * t for t in times["flax"]],
  }


# --------------------------------------------------------------------------
# The attention layer against Flax's.
# --------------------------------------------------------------------------


def _layers(shape: Shape):
  """Ours and Flax's layer, an input and the (shared) parameters."""
  ours = MultiHeadAttention(num_heads=shape.heads)
  theirs = nn.MultiHeadDotProductAttention(num_heads=shape.heads)
  x = jax.random.normal(jax.random.key(0),
                        (shape.batch, shape.length, shape.width))
  params = jax.jit(ours.init)(jax.random.key(1), x)
  return ours, theirs, x, params


def _relative_diff(ours: Any, theirs: Any) -> float:
  """Largest ``|ours - theirs|`` over two pytrees, over the largest
  ``|theirs|``."""
  pairs = list(zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
  diff = max(float(np.max(np.abs(a - b))) for a, b in pairs)
  scale = max(float(np.max(np.abs(b))) for _, b in pairs)
  return diff / max(scale, 1e-30)


def compare_layer(shape: Shape, repeats: int) -> dict[str, Any]:
  """Ours vs Flax at ``shape``: forward+backward with weights, inference."""
  ours, theirs, x, params = _layers(shape)

  def ours_loss(params, x):
    out, weights = ours.apply(params, x)
    return jnp.sum(out), weights

  def flax_loss(params, x):
    out, state = theirs.apply(params, x, sow_weights=True,
                              mutable=["intermediates"])
    return jnp.sum(out), state["intermediates"]

  grad = lambda loss: jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
  fwd_bwd = {"ours": grad(ours_loss), "flax": grad(flax_loss)}
  infer = {
      "ours": jax.jit(lambda p, x: ours.apply(p, x, return_weights=False)[0]),
      "flax": jax.jit(theirs.apply),
  }

  # The two sides compute the same function: check it on the way.
  ours_grads, ours_weights = fwd_bwd["ours"](params, x)
  flax_grads, flax_state = fwd_bwd["flax"](params, x)
  (flax_weights,) = flax_state["attention_weights"]
  return {
      "shape": dataclasses.asdict(shape),
      "fwd_bwd_weights": _comparison(time_interleaved(
          {k: functools.partial(f, params, x) for k, f in fwd_bwd.items()},
          repeats)),
      "inference": _comparison(time_interleaved(
          {k: functools.partial(f, params, x) for k, f in infer.items()},
          repeats)),
      "max_relative_diff": {
          "gradients": _relative_diff(ours_grads, flax_grads),
          "weights": _relative_diff(ours_weights, flax_weights),
          "inference": _relative_diff(infer["ours"](params, x),
                                      infer["flax"](params, x)),
      },
  }


# --------------------------------------------------------------------------
# FLOP rate against the matmul peak.
# --------------------------------------------------------------------------


def forward_flops(shape: Shape) -> int:
  """Multiply-adds x 2 of one self-attention layer's forward pass.

  The four ``[D, D]`` projections (query, key, value, out) on ``B * L``
  tokens, plus ``QK^T`` and weights x values: ``2 * B * L * L * D`` each
  (``H`` heads of width ``D / H``). Softmax, biases and scaling are left out:
  they are O(B * H * L * L) and O(B * L * D), not matmuls.
  """
  tokens = shape.batch * shape.length
  projections = 4 * 2 * tokens * shape.width * shape.width
  attention = 2 * 2 * tokens * shape.length * shape.width
  return projections + attention


def _xla_flops(compiled) -> float | None:
  """XLA's FLOP count of ``compiled``; None where it counts none, or leaves
  out the matrix products (``speed.compiled_costs``)."""
  flops = speed.compiled_flops(compiled)
  return None if math.isnan(flops) else flops


def flop_rate(shape: Shape, matmul_sizes: Sequence[int],
              repeats: int) -> dict[str, Any]:
  """Our forward's FLOP rate at ``shape`` against the measured matmul peak.

  The peak is ``jnp.dot`` of square float32 matrices, timed interleaved with
  the forward passes so that both see the same machine.
  """
  ours, _, x, params = _layers(shape)
  forwards = {
      "forward": jax.jit(lambda p, x: ours.apply(p, x)),
      "forward_no_weights": jax.jit(
          lambda p, x: ours.apply(p, x, return_weights=False)[0]),
  }
  fns = {name: functools.partial(f, params, x) for name, f in forwards.items()}
  dot = jax.jit(jnp.dot)
  for n in matmul_sizes:
    a, b = jax.random.normal(jax.random.key(n), (2, n, n))
    fns[f"matmul_{n}"] = functools.partial(dot, a, b)
  times = time_interleaved(fns, repeats)

  matmul = {n: {"ms": median_ms(times[f"matmul_{n}"]),
                "gflops": 2 * n**3 / statistics.median(times[f"matmul_{n}"])
                / 1e9} for n in matmul_sizes}
  peak_n = max(matmul, key=lambda n: matmul[n]["gflops"])
  peak = matmul[peak_n]["gflops"]
  flops = forward_flops(shape)
  result = {"shape": dataclasses.asdict(shape), "flops": flops,
            "matmul": {str(n): v for n, v in matmul.items()},
            "peak_gflops": peak, "peak_n": peak_n}
  for name, f in forwards.items():
    gflops = flops / statistics.median(times[name]) / 1e9
    result[name] = {
        "ms": median_ms(times[name]),
        "gflops": gflops,
        "fraction_of_peak": gflops / peak,
        "xla_flops": _xla_flops(f.lower(params, x).compile()),
        "times_ms": [1e3 * t for t in times[name]],
    }
  return result


# --------------------------------------------------------------------------
# Train-step throughput.
# --------------------------------------------------------------------------


def _random_batch(config, seed: int = 0) -> dict[str, Any]:
  """A batch of the config's shape: random lengths, symbols and targets."""
  rng = np.random.default_rng(seed)
  shape = (config.batch_size, config.data.max_len)
  lengths = rng.integers(config.data.min_len, config.data.max_len + 1,
                         size=(config.batch_size, 1))
  valid = np.arange(config.data.max_len)[None, :] < lengths
  vocab = data.vocab_size(config.task, config.data.num_symbols,
                          config.data.max_len)
  inputs = rng.integers(1, config.data.num_symbols + 1, size=shape)
  targets = rng.integers(1, vocab, size=shape)
  return {"inputs": jnp.asarray(np.where(valid, inputs, 0), jnp.int32),
          "targets": jnp.asarray(np.where(valid, targets, 0), jnp.int32)}


def train_throughput(label: str, arg: str, window_s: float,
                     windows: int) -> dict[str, Any]:
  """Steps/s of the jitted, buffer-donating train step of ``get_config(arg)``.

  The batch is already on the device (the data pipeline is not timed). After
  compilation, a few steps estimate the step time; the rate is the median
  over ``windows`` windows of as many steps as take about ``window_s``.
  """
  config = default.get_config(arg)
  model = build.make_model(config)
  rng = jax.random.key(config.seed)
  state = jax.jit(functools.partial(build.create_train_state, config, model))(
      rng)
  step_fn = jax.jit(
      functools.partial(train.train_step, model=model,
                        schedule=build.learning_rate_schedule(config)),
      donate_argnums=0)
  batch = _random_batch(config)
  num_params = sum(p.size for p in jax.tree.leaves(state.params))

  def steps_per_s(steps: int) -> float:
    nonlocal state
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = step_fn(state, batch, rng)
    jax.block_until_ready((state, metrics))
    return steps / (time.perf_counter() - start)

  steps_per_s(1)  # Compiles.
  steps = max(2, round(window_s * steps_per_s(3)))
  rates = [steps_per_s(steps) for _ in range(windows)]
  rate = statistics.median(rates)
  positions = config.batch_size * config.data.max_len
  return {
      "label": label,
      "config_arg": arg,
      "parameters": int(num_params),
      "batch_size": config.batch_size,
      "length": config.data.max_len,
      "model": dict(config.model),
      "steps_per_s": rate,
      "tokens_per_s": rate * positions,
      "steps_per_window": steps,
      "window_steps_per_s": rates,
  }


# --------------------------------------------------------------------------
# The pruning study's mask evaluations.
# --------------------------------------------------------------------------


def _random_model_and_split(arg: str, examples: int, seed: int = 0):
  config = default.get_config(arg)
  model = build.make_model(config)
  params = jax.jit(model.init)(
      jax.random.key(seed), jnp.ones((1, config.data.max_len), jnp.int32)
  )["params"]
  rng = np.random.default_rng(seed)
  inputs = rng.integers(1, config.data.num_symbols + 1,
                        (examples, config.data.max_len))
  lengths = rng.integers(config.data.min_len, config.data.max_len + 1,
                         (examples, 1))
  inputs = np.where(np.arange(config.data.max_len)[None] < lengths, inputs, 0)
  targets = np.where(inputs != 0, inputs[:, ::-1], 0)
  return model, params, data.Split(inputs.astype(np.int32),
                                   targets.astype(np.int32))


def pruning_masks(arg: str, examples: int, repeats: int) -> dict[str, Any]:
  """Seconds per evaluation of the study's mask sets, two ways each:
  leave-one-out vmapped vs a loop of jitted calls, and all ``2**N`` subsets
  layer by layer vs ``evaluate_masks``; with the largest difference in loss
  between the two ways (they compute the same numbers)."""
  model, params, split = _random_model_and_split(arg, examples)
  config = model.config
  loo = np.concatenate([pruning.full_head_mask(config)[None],
                        pruning.leave_one_out_masks(config)])
  subsets = oracle.subset_masks(config)
  outs: dict[str, Any] = {}

  def keep(name, fn):
    def call():
      outs[name] = fn()
      return 0
    return call

  loo_times = time_interleaved({
      "vmapped": keep("vmapped", lambda: pruning.evaluate_masks(
          model, params, split, loo)),
      "loop": keep("loop", lambda: pruning.evaluate_masks_loop(
          model, params, split, loo))}, repeats)
  subset_times = time_interleaved({
      "layer_by_layer": keep("layer_by_layer", lambda: oracle.evaluate_subsets(
          model, params, split)),
      "evaluate_masks": keep("evaluate_masks", lambda: pruning.evaluate_masks(
          model, params, split, subsets))}, repeats)
  diff = lambda a, b: float(np.max(np.abs(outs[a]["loss"] - outs[b]["loss"])))
  return {
      "config_arg": arg, "examples": examples, "heads": len(loo) - 1,
      "leave_one_out": {
          "masks": len(loo), "vmapped_ms": median_ms(loo_times["vmapped"]),
          "loop_ms": median_ms(loo_times["loop"]),
          "speedup": median_ms(loo_times["loop"]) / median_ms(loo_times["vmapped"]),
          "max_abs_loss_diff": diff("vmapped", "loop")},
      "subsets": {
          "masks": len(subsets),
          "layer_by_layer_ms": median_ms(subset_times["layer_by_layer"]),
          "evaluate_masks_ms": median_ms(subset_times["evaluate_masks"]),
          "speedup": median_ms(subset_times["evaluate_masks"]) /
                     median_ms(subset_times["layer_by_layer"]),
          "max_abs_loss_diff": diff("layer_by_layer", "evaluate_masks")},
  }


# --------------------------------------------------------------------------
# The run and its report.
# --------------------------------------------------------------------------


def run(plan: Plan, log: Callable[[str], None] = lambda _: None
        ) -> dict[str, Any]:
  """Every measurement of ``plan``; ``log`` hears what is being timed."""
  results = {"layer": []}
  for shape in plan.layer_shapes:
    log(f"layer {shape} (B / L / D / H): ours vs Flax")
    results["layer"].append(compare_layer(shape, plan.repeats))
  log(f"forward FLOP rate at {plan.flop_shape}, matmul peak "
      f"N = {', '.join(map(str, plan.matmul_sizes))}")
  results["flop_rate"] = flop_rate(plan.flop_shape, plan.matmul_sizes,
                                   plan.repeats)
  results["train"] = []
  for label, arg in plan.train_configs:
    log(f"train step: {label}")
    results["train"].append(
        train_throughput(label, arg, plan.train_window_s, plan.train_windows))
  log(f"pruning masks: {plan.pruning_config or 'default'} config, "
      f"{plan.pruning_examples} examples")
  results["pruning_masks"] = pruning_masks(
      plan.pruning_config, plan.pruning_examples, plan.pruning_repeats)
  return results


def _shape_cell(shape: Mapping[str, int]) -> str:
  return str(Shape(**shape))


def format_tables(results: Mapping[str, Any]) -> str:
  """The markdown report of :func:`run`'s results."""
  lines = (header_lines(results) + _layer_lines(results["layer"])
           + _flop_rate_lines(results["flop_rate"])
           + _train_lines(results["train"])
           + _pruning_lines(results["pruning_masks"]))
  return "\n".join(lines) + "\n"


def _layer_lines(layer: Sequence[Mapping[str, Any]]) -> list[str]:
  lines = [
      "",
      "| one attention layer | B / L / D / H | ours (ms) | Flax (ms) | "
      "ours / Flax |",
      "| --- | --- | ---: | ---: | ---: |",
  ]
  for kind, label in (("fwd_bwd_weights", "forward+backward, weights out"),
                      ("inference", "inference, no weights")):
    for entry in layer:
      c = entry[kind]
      lines.append(f"| {label} | {_shape_cell(entry['shape'])} | "
                   f"{c['ours_ms']:.2f} | {c['flax_ms']:.2f} | "
                   f"{c['ratio']:.3f} |")
  return lines


def _flop_rate_lines(fr: Mapping[str, Any]) -> list[str]:
  lines = [
      "",
      f"| forward FLOP rate | B / L / D / H | GFLOP | ms | GFLOP/s | "
      f"matmul peak GFLOP/s (N = {fr['peak_n']}) | of peak |",
      "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, label in (("forward", "weights out"),
                      ("forward_no_weights", "no weights")):
    f = fr[name]
    lines.append(
        f"| {label} | {_shape_cell(fr['shape'])} | {fr['flops'] / 1e9:.2f} | "
        f"{f['ms']:.1f} | {f['gflops']:.1f} | {fr['peak_gflops']:.1f} | "
        f"{f['fraction_of_peak']:.0%} |")
  return lines


def _train_lines(train: Sequence[Mapping[str, Any]]) -> list[str]:
  lines = [
      "",
      "| train step | model (layers / width / heads / MLP) | parameters | "
      "batch x length | steps/s | tokens/s |",
      "| --- | --- | ---: | --- | ---: | ---: |",
  ]
  for t in train:
    m = t["model"]
    lines.append(
        f"| {t['label']} | {m['num_layers']} / {m['d_model']} / "
        f"{m['num_heads']} / {m['mlp_dim']} | {t['parameters']:,} | "
        f"{t['batch_size']} x {t['length']} | {t['steps_per_s']:.1f} | "
        f"{t['tokens_per_s']:,.0f} |")
  return lines + ["", "tokens/s counts positions, padding included; the "
                  "train batch is already on the device."]


def _pruning_lines(p: Mapping[str, Any]) -> list[str]:
  loo, sub = p["leave_one_out"], p["subsets"]
  return [
      "",
      f"| pruning masks ({p['heads']} heads, {p['examples']} examples) | "
      "masks | batched (ms) | baseline (ms) | speed-up | max loss diff |",
      "| --- | ---: | ---: | ---: | ---: | ---: |",
      f"| leave-one-out: vmapped vs loop of jitted calls | {loo['masks']} | "
      f"{loo['vmapped_ms']:.1f} | {loo['loop_ms']:.1f} | "
      f"{loo['speedup']:.2f} | {loo['max_abs_loss_diff']:.1e} |",
      f"| every subset: layer by layer vs evaluate_masks | {sub['masks']} | "
      f"{sub['layer_by_layer_ms']:.1f} | {sub['evaluate_masks_ms']:.1f} | "
      f"{sub['speedup']:.2f} | {sub['max_abs_loss_diff']:.1e} |",
  ]


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------


def main(argv: list[str]) -> None:
  del argv
  name = "cpu_quick" if _QUICK.value else "cpu"
  out = checked_out(_PROG, _OUT.value, name)
  logging.set_verbosity(logging.WARNING)
  plan = QUICK if _QUICK.value else FULL
  if _QUICK.value:
    jax.config.update("jax_disable_most_optimizations", True)
  if _REPEATS.value is not None:
    plan = dataclasses.replace(plan, repeats=_REPEATS.value)
  log = lambda message: print(message, file=sys.stderr, flush=True)
  results = record(name, quick=_QUICK.value, plan=dataclasses.asdict(plan),
                   repeats=plan.repeats)
  results |= run(plan, log)
  results["load_average_end"] = load_average()
  write_results(out, results, format_tables(results), log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
