r"""Speed of the attention layer and the train step, side by side with Flax.

    python scripts/benchmark.py            # about 2 minutes on 2 CPU cores
    python scripts/benchmark.py --quick    # tiny shapes, seconds (for tests)

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
Prints the tables (markdown) to stdout, writes them to ``<out>.md`` and every
number, raw timings included, to ``--out`` (JSON). A bad flag is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

from absl import app
from absl import flags
from absl import logging
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from configs import default
from mha import build
from mha import cli
from mha import data
from mha import train
from mha.attention import MultiHeadAttention
from mha.pruning import core as pruning
from mha.pruning import oracle
try:
  from scripts import accelerator_benchmark as accelerator
except ImportError:  # Run as a file: this folder is sys.path[0], not its parent.
  import accelerator_benchmark as accelerator  # pylint: disable=g-import-not-at-top

_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny shapes, few repeats and XLA optimizations off: a "
    "smoke test of seconds whose numbers mean nothing.")
_OUT = flags.DEFINE_string(
    "out", "runs/benchmark/benchmark.json",
    "JSON output path; the markdown tables go next to it (.md).")
_REPEATS = flags.DEFINE_integer(
    "repeats", None, "Timed rounds per comparison (default 20; 3 with "
    "--quick).", lower_bound=1)

_GPU = flags.DEFINE_bool(
    "gpu", False, "Run the accelerator section instead "
    "(scripts/accelerator_benchmark.py): ours vs Flax vs torch in float32 and "
    "bfloat16 up to length 4096, the fused path vs a direct cuDNN call, "
    "vmapped seeds. Needs a GPU; with --quick, tiny shapes on any device.")
_VMAPPED_SEEDS = flags.DEFINE_bool(
    "vmapped_seeds", False, "Run only the vmapped-seeds rows: the default "
    "config's train step, one model vs 4 trained together (any device).")
_END_TO_END = flags.DEFINE_bool(
    "end_to_end", False, "Instead of the timings above: spawn train.py "
    "processes, cold (a fresh compilation cache) and warm (the same config "
    "again), beside the import floor and the PyTorch peer, and time them "
    "from process start (with --quick: the tiny config, one round).")
_ROUNDS = flags.DEFINE_integer(
    "end_to_end_rounds", None, "Rounds of --end_to_end (default 3; 1 with "
    "--quick); the figures are medians over them.", lower_bound=1)
_PEER = flags.DEFINE_bool(
    "peer", True, "--end_to_end: also run the PyTorch peer "
    "(scripts/torch_peer.py) when torch can be imported.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "--end_to_end: the TFDS data directory (default: the "
    "config's data.data_dir); the data is prepared before any run is timed.")

_PROG = "benchmark.py"


# A self-attention layer's input ``[batch, length, width]`` and heads: one
# class for both sections.
Shape = accelerator.LayerShape


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


def time_interleaved(fns: Mapping[str, Callable[[], Any]],
                     repeats: int) -> dict[str, list[float]]:
  """Seconds per call of each function over ``repeats`` interleaved rounds.

  Every function is called once untimed first (compilation). Round ``r`` calls
  them in the given order when ``r`` is even and in reverse when odd, so that
  none always runs right after another (whose freed memory or warm caches it
  would inherit).
  """
  for fn in fns.values():
    jax.block_until_ready(fn())
  names = list(fns)
  times = {name: [] for name in names}
  for r in range(repeats):
    for name in names if r % 2 == 0 else reversed(names):
      start = time.perf_counter()
      jax.block_until_ready(fns[name]())
      times[name].append(time.perf_counter() - start)
  return times


def _ms(seconds: Sequence[float]) -> float:
  return 1e3 * statistics.median(seconds)


def _comparison(times: Mapping[str, list[float]]) -> dict[str, Any]:
  ours, theirs = _ms(times["ours"]), _ms(times["flax"])
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
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
    cost = cost[0] if cost else None
  return None if not cost or "flops" not in cost else float(cost["flops"])


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

  matmul = {n: {"ms": _ms(times[f"matmul_{n}"]),
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
        "ms": _ms(times[name]),
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
          "masks": len(loo), "vmapped_ms": _ms(loo_times["vmapped"]),
          "loop_ms": _ms(loo_times["loop"]),
          "speedup": _ms(loo_times["loop"]) / _ms(loo_times["vmapped"]),
          "max_abs_loss_diff": diff("vmapped", "loop")},
      "subsets": {
          "masks": len(subsets),
          "layer_by_layer_ms": _ms(subset_times["layer_by_layer"]),
          "evaluate_masks_ms": _ms(subset_times["evaluate_masks"]),
          "speedup": _ms(subset_times["evaluate_masks"]) /
                     _ms(subset_times["layer_by_layer"]),
          "max_abs_loss_diff": diff("layer_by_layer", "evaluate_masks")},
  }


# --------------------------------------------------------------------------
# The run and its report.
# --------------------------------------------------------------------------


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _load() -> float | None:
  try:
    return os.getloadavg()[0]
  except OSError:
    return None


def environment() -> dict[str, Any]:
  """The device, versions and thread count of this run."""
  device = jax.devices()[0]
  return {
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M"),
      "platform": device.platform,
      "device": device.device_kind,
      "num_devices": jax.device_count(),
      "cpu": _cpu_model(),
      "threads": len(os.sched_getaffinity(0)) if hasattr(
          os, "sched_getaffinity") else os.cpu_count(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "dtype": "float32",
  }


def run(plan: Plan, log: Callable[[str], None] = lambda _: None
        ) -> dict[str, Any]:
  """Every measurement of ``plan``; ``log`` hears what is being timed."""
  results = {"environment": environment(), "load_average_start": _load(),
             "plan": dataclasses.asdict(plan), "repeats": plan.repeats}
  results["layer"] = []
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
  results["load_average_end"] = _load()
  return results


def _shape_cell(shape: Mapping[str, int]) -> str:
  return str(Shape(**shape))


def format_tables(results: Mapping[str, Any]) -> str:
  """The markdown report of :func:`run`'s results."""
  lines = (_header_lines(results) + _layer_lines(results["layer"])
           + _flop_rate_lines(results["flop_rate"])
           + _train_lines(results["train"])
           + _pruning_lines(results["pruning_masks"]))
  return "\n".join(lines) + "\n"


def _header_lines(results: Mapping[str, Any]) -> list[str]:
  env = results["environment"]
  device = (f"{env['platform']} ({env['cpu']}, {env['threads']} threads)"
            if env["platform"] == "cpu" else
            f"{env['platform']} ({env['device']} x {env['num_devices']})")
  load = results["load_average_start"], results["load_average_end"]
  load_text = ("" if None in load else
               f", 1-min load average {load[0]:.1f} at start, {load[1]:.1f} "
               "at end")
  lines = [
      f"Device: {device}; JAX {env['jax']} (jaxlib {env['jaxlib']}), Flax "
      f"{env['flax']}, {env['dtype']}; {env['date_utc']} UTC{load_text}.",
      f"Medians of {results['repeats']} interleaved repeats; ratio = ours / "
      "Flax (below 1: ours is faster).",
  ]
  if results["plan"]["name"] == "quick":
    lines.append("Quick run (tiny shapes, XLA optimizations off): a smoke "
                 "test, not a measurement.")
  return lines


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
# End to end: train.py processes from start to exit.
# --------------------------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT_MATCH_GOAL = 0.99  # "trained": validation exact match at least this


def _spawn(command: Sequence[str], what: str) -> tuple[float, str]:
  """Runs ``command`` from the repository root; returns its start (Unix
  seconds, just before the fork) and its stdout. Raises if it fails."""
  start = time.time()
  result = subprocess.run(list(command), cwd=_ROOT, capture_output=True,
                          text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{what} exited with {result.returncode}: "
                       f"{result.stderr.strip()[-2000:]}")
  return start, result.stdout


def _timeline(start: float, end: float, workdir: str) -> dict[str, Any]:
  """Seconds from ``start`` to the end of the first step, to the first
  validation with exact match >= ``EXACT_MATCH_GOAL``, and to ``end``, read
  off ``workdir/metrics.jsonl`` (every row has its ``time``)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  first = next(r for r in rows if "startup/seconds_since_process_start" in r)
  trained = next((r for r in rows if r.get("validation/exact_match", 0)
                  >= EXACT_MATCH_GOAL), None)
  return {
      "first_step_s": first["time"] - start,
      "trained_s": None if trained is None else trained["time"] - start,
      "trained_step": None if trained is None else trained["step"],
      "exit_s": end - start,
      "programs": first.get("startup/programs_compiled"),
      "programs_from_cache": first.get("startup/programs_from_cache"),
  }


def _compiled(stdout: str) -> dict[str, int] | None:
  """The counts of train.py's line "Compiled in this run: ..."."""
  match = re.search(r"Compiled in this run: (\d+) programs?"
                    r"(?:, (all|\d+) of them loaded)?", stdout)
  if match is None:
    return None
  programs = int(match.group(1))
  hits = match.group(2)
  return {"programs": programs, "from_cache": programs if hits == "all"
          else int(hits or 0)}


def _train_run(arg: str, workdir: str, cache_dir: str,
               data_dir: str) -> dict[str, Any]:
  """One ``python train.py`` of ``get_config(arg)``, timed."""
  start, stdout = _spawn(
      [sys.executable, "train.py", f"--workdir={workdir}",
       f"--config=configs/default.py:{arg}",
       f"--config.compilation_cache_dir={cache_dir}",
       f"--config.data.data_dir={data_dir}"], "train.py")
  end = time.time()
  return {**_timeline(start, end, workdir), "run": _compiled(stdout)}


def _floor_run() -> dict[str, Any]:
  """The import floor: a process that imports JAX, Flax, optax and orbax."""
  start, _ = _spawn([sys.executable, "-c",
                     "import jax, flax, optax, orbax.checkpoint"], "floor")
  return {"exit_s": time.time() - start}


def _peer_inputs(config, splits: Mapping[str, Any], directory: str
                 ) -> tuple[str, str]:
  """The data (``.npz``) and config (JSON) of the PyTorch peer."""
  arrays = {f"{name}_{key}": getattr(split, key)
            for name, split in splits.items() for key in ("inputs", "targets")}
  data_path = os.path.join(directory, "peer_data.npz")
  np.savez(data_path, **arrays)
  keys = ("seed", "batch_size", "eval_batch_size", "num_train_steps",
          "learning_rate", "warmup_steps", "weight_decay", "adam_b2",
          "grad_clip_norm", "eval_every_steps")
  peer = {key: config[key] for key in keys}
  peer["model"] = config.model.to_dict()
  peer["vocab_size"] = data.vocab_size(config.task, config.data.num_symbols,
                                       config.data.max_len)
  config_path = os.path.join(directory, "peer_config.json")
  with open(config_path, "w", encoding="utf-8") as f:
    json.dump(peer, f)
  return data_path, config_path


def _peer_run(inputs: tuple[str, str], out: str) -> dict[str, Any]:
  """One run of ``scripts/torch_peer.py``, timed like ``train.py``."""
  data_path, config_path = inputs
  start, _ = _spawn([sys.executable, os.path.join("scripts", "torch_peer.py"),
                     f"--data={data_path}", f"--config={config_path}",
                     f"--out={out}"], "torch_peer.py")
  return _timeline(start, time.time(), out)


def _median(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
  values = [r[key] for r in runs if r.get(key) is not None]
  return statistics.median(values) if len(values) == len(runs) else None


def end_to_end(arg: str, rounds: int, data_dir: str | None, peer: bool,
               log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
  """Cold and warm ``train.py`` runs of ``get_config(arg)``, the import floor
  and (``peer`` and torch importable) the PyTorch peer, ``rounds`` times.

  The data is prepared first. A cold run gets a fresh compilation cache
  directory, the warm run right after it the same one; every run a fresh
  workdir. The floor, the cold-warm pair and the peer take turns, in the
  reverse order every other round. Times are from just before the fork.
  """
  config = default.get_config(arg)
  data_dir = data_dir or config.data.data_dir
  splits = data.load_splits(build.data_spec(config), data_dir)
  peer = peer and importlib.util.find_spec("torch") is not None
  runs: dict[str, list[dict[str, Any]]] = {
      "floor": [], "cold": [], "warm": [], **({"peer": []} if peer else {})}
  with tempfile.TemporaryDirectory(prefix="mha-end-to-end-") as tmp:
    inputs = _peer_inputs(config, splits, tmp) if peer else None
    for r in range(rounds):
      cache = os.path.join(tmp, f"cache{r}")
      steps = {
          "floor": _floor_run,
          "cold": lambda: _train_run(arg, os.path.join(tmp, f"cold{r}"),
                                     cache, data_dir),
          "warm": lambda: _train_run(arg, os.path.join(tmp, f"warm{r}"),
                                     cache, data_dir),
          "peer": lambda: _peer_run(inputs, os.path.join(tmp, f"peer{r}")),
      }
      # A warm run right after its cold one; the rest in turns.
      blocks = [["floor"], ["cold", "warm"], *([["peer"]] if peer else [])]
      for block in blocks if r % 2 == 0 else reversed(blocks):
        for kind in block:
          log(f"end to end, round {r + 1}/{rounds}: {kind}")
          runs[kind].append(steps[kind]())
  return {"config_arg": arg, "rounds": rounds, "runs": runs,
          "summary": _end_to_end_summary(runs)}


def _end_to_end_summary(runs: Mapping[str, Sequence[Mapping[str, Any]]]
                        ) -> dict[str, Any]:
  """Medians of every kind and the ratios the goals are stated in."""
  medians = {kind: {key: _median(rs, key) for key in
                    ("first_step_s", "trained_s", "exit_s") if key in rs[0]}
             for kind, rs in runs.items() if rs}
  ratio = lambda a, b: None if None in (a, b) else a / b
  warm, cold, floor = medians["warm"], medians["cold"], medians["floor"]
  summary = {"medians": medians, "ratios": {
      "warm_first_step_over_floor": ratio(warm["first_step_s"],
                                          floor["exit_s"]),
      "cold_first_step_over_floor": ratio(cold["first_step_s"],
                                          floor["exit_s"])}}
  if "peer" in medians:
    peer = medians["peer"]["trained_s"]
    summary["ratios"]["warm_trained_over_peer"] = ratio(warm["trained_s"],
                                                        peer)
    summary["ratios"]["cold_trained_over_peer"] = ratio(cold["trained_s"],
                                                        peer)
  return summary


def format_end_to_end(results: Mapping[str, Any]) -> str:
  """The markdown report of :func:`end_to_end` (header from ``run``'s)."""
  e2e = results["end_to_end"]
  summary = e2e["summary"]
  lines = _header_lines({**results, "plan": {"name": results["plan_name"]},
                         "repeats": e2e["rounds"]})[:1] + [
      f"End to end: `python train.py --config configs/default.py:"
      f"{e2e['config_arg']}`, data prepared; medians of {e2e['rounds']} "
      f"rounds, seconds from process start. Trained = the first validation "
      f"with exact match >= {EXACT_MATCH_GOAL}.", "",
      "| process | to end of first step | to trained | to exit | each run "
      "(to trained; floor: to exit) |",
      "| --- | ---: | ---: | ---: | --- |"]
  labels = {"floor": "import floor (`import jax, flax, optax, "
                     "orbax.checkpoint`)",
            "cold": "train.py, cold (empty compilation cache)",
            "warm": "train.py, warm (same config again)",
            "peer": "PyTorch peer (`nn.TransformerEncoder`)"}
  cell = lambda v: "" if v is None else f"{v:.2f}"
  for kind, median in summary["medians"].items():
    per_run = " / ".join(cell(r.get("trained_s", r["exit_s"]))
                         for r in e2e["runs"][kind])
    lines.append(f"| {labels[kind]} | {cell(median.get('first_step_s'))} | "
                 f"{cell(median.get('trained_s'))} | "
                 f"{cell(median['exit_s'])} | {per_run} |")
  lines += ["", "| ratio | median |", "| --- | ---: |"]
  for name, value in summary["ratios"].items():
    lines.append(f"| {name.replace('_', ' ')} | {cell(value)} |")
  compiled = [(kind, r["run"]) for kind in ("cold", "warm")
              for r in e2e["runs"][kind][:1]]
  lines += ["", "Programs compiled: " + "; ".join(
      f"{kind} {c['programs']} ({c['from_cache']} from the cache)"
      for kind, c in compiled if c) + "."]
  return "\n".join(lines) + "\n"


def _main_end_to_end(out: str) -> None:
  """``--end_to_end``: :func:`end_to_end`, its tables to stdout, ``out``
  (JSON) and ``out``'s ``.md``."""
  log = lambda message: print(message, file=sys.stderr, flush=True)
  rounds = _ROUNDS.value or (1 if _QUICK.value else 3)
  results = {"environment": environment(), "load_average_start": _load(),
             "plan_name": "quick" if _QUICK.value else "full"}
  results["end_to_end"] = end_to_end("tiny" if _QUICK.value else "", rounds,
                                     _DATA_DIR.value, _PEER.value, log)
  results["load_average_end"] = _load()
  table = format_end_to_end(results)
  _write_results(out, results, table, log)


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------


def run_accelerator(log: Callable[[str], None]) -> tuple[dict[str, Any], str]:
  """The accelerator section (``--gpu``, ``--vmapped_seeds``): results and
  tables."""
  if _GPU.value and not _QUICK.value and jax.devices()[0].platform != "gpu":
    cli.fail(_PROG, f"--gpu needs a GPU (this device is "
             f"{jax.devices()[0].platform}); --gpu --quick runs a smoke test "
             "on any device")
  plan = (accelerator.QUICK if _GPU.value and _QUICK.value else
          accelerator.GPU if _GPU.value else accelerator.SEEDS)
  if _REPEATS.value is not None:
    plan = dataclasses.replace(plan, repeats=_REPEATS.value)
  results = {"environment": environment() | {
      "dtype": ", ".join(plan.dtypes) or "float32"},
             "load_average_start": _load(), "plan": {"name": plan.name},
             "repeats": plan.repeats}
  results["accelerator"] = accelerator.run(plan, time_interleaved, log)
  results["load_average_end"] = _load()
  lines = _header_lines(results)
  if plan is accelerator.SEEDS:
    lines[1] = (f"Train steps/s: medians of {plan.seeds_windows} windows of "
                f"about {plan.seeds_window_s:g} s.")
  lines += accelerator.format_tables(results["accelerator"])
  return results, "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  out = os.path.abspath(os.path.expanduser(_OUT.value))
  if os.path.isdir(out):
    cli.fail(_PROG, f"--out {out} is a directory; give a file path such as "
             f"{os.path.join(out, 'benchmark.json')}")
  logging.set_verbosity(logging.WARNING)
  if _END_TO_END.value:
    if not flags.FLAGS["out"].present:
      out = os.path.join(os.path.dirname(out), "end_to_end.json")
    _main_end_to_end(out)
    return
  plan = QUICK if _QUICK.value else FULL
  if _QUICK.value:
    jax.config.update("jax_disable_most_optimizations", True)
  if _REPEATS.value is not None:
    plan = dataclasses.replace(plan, repeats=_REPEATS.value)

  log = lambda message: print(message, file=sys.stderr, flush=True)
  if _GPU.value or _VMAPPED_SEEDS.value:
    results, table = run_accelerator(log)
  else:
    results = run(plan, log)
    table = format_tables(results)
  _write_results(out, results, table, log)



def _write_results(out: str, results: Mapping[str, Any], table: str,
                   log: Callable[[str], None]) -> None:
  """Writes ``results`` to ``out`` (JSON) and ``table`` beside it (.md), and
  prints the table."""
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
    f.write(table)
  print(table, end="", flush=True)
  log(f"Wrote {out} and {os.path.splitext(out)[0] + '.md'}")

if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROG))
