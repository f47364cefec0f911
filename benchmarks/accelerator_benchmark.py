r"""The accelerator benchmark: the layer on a GPU, the fused path, vmapped seeds.

    python benchmarks/accelerator_benchmark.py                  # on a GPU: everything below
    python benchmarks/accelerator_benchmark.py --quick          # tiny shapes, any device
    python benchmarks/accelerator_benchmark.py --vmapped_seeds  # the vmapped-seeds rows only

(``python benchmarks/benchmark.py --gpu`` and ``--vmapped_seeds`` run this.)

On the default device, for float32 and bfloat16 and self-attention lengths up
to 4096 (width 512, 8 heads of 64, batch x length = 16384 tokens):

1. One layer, forward + backward returning the weights: ours (unfused, and
   with ``weights_from_lse``) against Flax's ``MultiHeadDotProductAttention``
   with ``sow_weights=True`` and ``torch.nn.MultiheadAttention`` with
   ``need_weights=True, average_attn_weights=False`` (when torch is
   importable and runs on the same kind of device), same parameters.
2. Inference without weights: ours (``return_weights=False``: the fused
   path), Flax without sowing, torch with ``need_weights=False``.
3. Our fused path (``fused_dot_product_attention``) against calling
   ``jax.nn.dot_product_attention(implementation="cudnn")`` directly on the
   same projected arrays ("xla" where cuDNN does not apply, e.g. float32),
   forward and forward + backward, without a mask and with key lengths.
4. The pruning study's seeds: the default config's train step for one model
   against ``num_seeds`` models trained together in one vmapped program
   (stacked parameters and optimizer states, one batch each).

The compared functions run interleaved (``benchmarking.time_interleaved``,
passed in as ``timer``); figures are medians; a ratio is ours / theirs. The
results go to ``--out`` (JSON; by default ``benchmarks/results/<UTC
date>_accelerator_<commit>.json``: ``accelerator_quick``, ``seeds``), the
tables beside it (``.md``).
"""

from __future__ import annotations

import dataclasses
import functools
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
from mha import attention_kernels
from mha import build
from mha import train
from mha.aliases import Log
from mha.attention import MultiHeadAttention, fused_dot_product_attention
from mha.run import cli

from benchmarks.benchmarking import (
    LayerShape, Timer, checked_out, header_lines, load_average,
    max_relative_diff, median_ms, record, time_interleaved, write_results)


@dataclasses.dataclass(frozen=True)
class AcceleratorPlan:
  """What the accelerator section measures.

  Attributes:
    name: "gpu", "quick" or "seeds".
    shapes: layer shapes of parts 1-3.
    dtypes: compute dtypes of parts 1-3.
    repeats: timed interleaved rounds of each comparison.
    seeds_config: ``get_config`` argument of part 4.
    num_seeds: models trained together in part 4 (0: no part 4).
    seeds_window_s: about how long a timed window of train steps lasts.
    seeds_windows: timed windows (the rate is their median).
    fused_masks: mask forms of part 3: "none" and/or "lengths".
  """
  name: str
  shapes: tuple[LayerShape, ...]
  dtypes: tuple[str, ...]
  repeats: int
  seeds_config: str = ""
  num_seeds: int = 4
  seeds_window_s: float = 2.0
  seeds_windows: int = 5
  fused_masks: tuple[str, ...] = ("none", "lengths")


GPU = AcceleratorPlan(
    name="gpu",
    shapes=tuple(LayerShape(16384 // n, n, 512, 8)
                 for n in (512, 1024, 2048, 4096)),
    dtypes=("float32", "bfloat16"),
    repeats=20,
)
QUICK = AcceleratorPlan(name="quick", shapes=(LayerShape(2, 16, 32, 4),),
                        dtypes=("float32", "bfloat16"), repeats=2,
                        seeds_config="tiny", num_seeds=2,
                        seeds_window_s=0.01, seeds_windows=2)
SEEDS = AcceleratorPlan(name="seeds", shapes=(), dtypes=(), repeats=0)


def torch_device() -> tuple[Any, str | None]:
  """``(torch, device)`` of the torch peer: the device kind JAX runs on, or
  ``(None, reason)`` when there is none."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None, "torch is not installed"
  platform = jax.devices()[0].platform
  if platform == "cpu":
    return torch, "cpu"
  if platform == "gpu" and torch.cuda.is_available():
    # XLA's default float32 matrix products on a GPU are TF32; torch's are
    # full float32 unless asked. The peer gets the same precision as ours.
    torch.set_float32_matmul_precision(
        "highest" if jax.config.jax_default_matmul_precision in (
            "highest", "float32") else "high")
    return torch, "cuda"
  return None, f"torch {torch.__version__} cannot run on this {platform}"


def torch_layer(torch: Any, device: str, params: Any, shape: LayerShape,
                dtype: str) -> Any:
  """A ``torch.nn.MultiheadAttention`` holding ``params`` (ours/Flax's)."""
  p = jax.tree.map(np.array, params["params"])  # writable copies for torch
  width = shape.width
  layer = torch.nn.MultiheadAttention(width, shape.heads, batch_first=True)
  kernel = lambda name: p[name]["kernel"].reshape(width, width).T
  bias = lambda name: p[name]["bias"].reshape(width)
  with torch.no_grad():
    layer.in_proj_weight.copy_(torch.from_numpy(np.concatenate(
        [kernel(n) for n in ("query", "key", "value")])))
    layer.in_proj_bias.copy_(torch.from_numpy(np.concatenate(
        [bias(n) for n in ("query", "key", "value")])))
    layer.out_proj.weight.copy_(torch.from_numpy(
        p["out"]["kernel"].reshape(width, width).T.copy()))
    layer.out_proj.bias.copy_(torch.from_numpy(p["out"]["bias"]))
  return layer.to(device=device, dtype=getattr(torch, dtype))


def _torch_calls(torch: Any, device: str, params: Any, x: Any,
                 shape: LayerShape, dtype: str) -> dict[str, Callable]:
  layer = torch_layer(torch, device, params, shape, dtype)
  tx = torch.from_numpy(np.array(x, np.float32)).to(
      device=device, dtype=getattr(torch, dtype)).requires_grad_(True)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def fwd_bwd():
    layer.zero_grad(set_to_none=True)
    out, weights = layer(tx, tx, tx, need_weights=True,
                         average_attn_weights=False)
    out.float().sum().backward()
    sync()
    return out.detach(), weights.detach()

  def inference():
    with torch.no_grad():
      out, _ = layer(tx, tx, tx, need_weights=False)
    sync()
    return out

  return {"fwd_bwd": fwd_bwd, "inference": inference}


# --------------------------------------------------------------------------
# 1-2. One layer: ours, Flax, torch.
# --------------------------------------------------------------------------


def _jax_calls(shape: LayerShape, dtype: str):
  """Our layer's and Flax's jitted calls, the input and the parameters."""
  kwargs = dict(num_heads=shape.heads, dtype=jnp.dtype(dtype))
  ours = MultiHeadAttention(**kwargs)
  lse = MultiHeadAttention(**kwargs, weights_from_lse=True)
  theirs = nn.MultiHeadDotProductAttention(**kwargs)
  x = jax.random.normal(jax.random.key(0),
                        (shape.batch, shape.length, shape.width), dtype)
  params = jax.jit(ours.init)(jax.random.key(1), x)

  def loss(layer):
    def fn(params, x):
      out, weights = layer.apply(params, x)
      return jnp.sum(out.astype(jnp.float32)), weights
    return fn

  def flax_loss(params, x):
    out, state = theirs.apply(params, x, sow_weights=True,
                              mutable=["intermediates"])
    return (jnp.sum(out.astype(jnp.float32)),
            state["intermediates"]["attention_weights"][0])

  grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))
  fwd_bwd = {"ours": grad(loss(ours)), "ours_lse": grad(loss(lse)),
             "flax": grad(flax_loss)}
  infer = {
      "ours": jax.jit(lambda p, x: ours.apply(p, x, return_weights=False)[0]),
      "flax": jax.jit(theirs.apply)}
  return fwd_bwd, infer, x, params


def layer_rows(shape: LayerShape, dtype: str, repeats: int,
               timer: Timer) -> dict[str, Any]:
  """Forward+backward with weights and inference without, every side."""
  fwd_bwd, infer, x, params = _jax_calls(shape, dtype)
  calls = {f"fwd_bwd/{k}": functools.partial(f, params, x)
           for k, f in fwd_bwd.items()}
  calls |= {f"inference/{k}": functools.partial(f, params, x)
            for k, f in infer.items()}
  torch, device = torch_device()
  if torch is not None:
    for kind, call in _torch_calls(torch, device, params, x, shape,
                                   dtype).items():
      calls[f"{kind}/torch"] = call
  outputs = {name: call() for name, call in calls.items()}  # also compiles
  times = timer(calls, repeats)
  result = {"shape": dataclasses.asdict(shape), "dtype": dtype,
            "torch": device if torch is not None else None,
            "torch_note": None if torch is not None else device,
            "ms": {name: median_ms(t) for name, t in times.items()},
            "times_ms": {name: [1e3 * s for s in t]
                         for name, t in times.items()}}
  ours_w = outputs["fwd_bwd/ours"][1]
  result["max_relative_diff"] = {
      "weights_flax": max_relative_diff(ours_w, outputs["fwd_bwd/flax"][1]),
      "weights_lse": max_relative_diff(outputs["fwd_bwd/ours_lse"][1],
                                        ours_w),
      "inference_flax": max_relative_diff(outputs["inference/ours"],
                                           outputs["inference/flax"])}
  if torch is not None:
    result["max_relative_diff"]["weights_torch"] = max_relative_diff(
        outputs["fwd_bwd/torch"][1].float().cpu().numpy(), ours_w)
  return result


# --------------------------------------------------------------------------
# 3. Our fused path against jax.nn.dot_product_attention called directly.
# --------------------------------------------------------------------------


def fused_vs_direct(shape: LayerShape, dtype: str, repeats: int,
                    timer: Timer,
                    masks: Sequence[str] = ("none", "lengths")
                    ) -> dict[str, Any]:
  """Our fused path vs ``jax.nn.dot_product_attention`` with the
  implementation :func:`select_implementation` gives, same arrays (where that
  is ``"xla"``, ours is the layer's own math)."""
  head_dim = shape.width // shape.heads
  q, k, v = (jax.random.normal(
      jax.random.key(s), (shape.batch, shape.length, shape.heads, head_dim),
      dtype) for s in range(3))
  lengths = jnp.full((shape.batch,), shape.length * 3 // 4, jnp.int32)
  choice = attention_kernels.select_implementation(
      attention_kernels.device_facts(), dtype=dtype, head_dim=head_dim,
      value_head_dim=head_dim, q_len=shape.length, kv_len=shape.length,
      mask_form="lengths")
  ours = lambda q, k, v, n: fused_dot_product_attention(q, k, v,
                                                        kv_lengths=n)
  direct = lambda q, k, v, n: jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, implementation=choice)
  loss = lambda f: lambda q, k, v, n: jnp.sum(f(q, k, v, n).astype(
      jnp.float32))
  calls = {}
  for suffix in masks:
    n = lengths if suffix == "lengths" else None
    for side, f in (("ours", ours), ("direct", direct)):
      calls[f"forward/{suffix}/{side}"] = functools.partial(
          jax.jit(f), q, k, v, n)
      calls[f"fwd_bwd/{suffix}/{side}"] = functools.partial(
          jax.jit(jax.grad(loss(f), argnums=(0, 1, 2))), q, k, v, n)
  outputs = {name: call() for name, call in calls.items()}
  times = timer(calls, repeats)
  diff = {name.replace("/ours", ""): max_relative_diff(
      outputs[name], outputs[name.replace("ours", "direct")])
          for name in calls if name.endswith("/ours")
          and name.startswith("forward")}
  return {"shape": dataclasses.asdict(shape), "dtype": dtype,
          "implementation": choice,
          "ms": {name: median_ms(t) for name, t in times.items()},
          "max_relative_diff": diff}


# --------------------------------------------------------------------------
# 4. Seeds trained together.
# --------------------------------------------------------------------------


def _random_batches(config: Any, num: int) -> dict[str, Any]:
  rng = np.random.default_rng(0)
  shape = (num, config.batch_size, config.data.max_len)
  lengths = rng.integers(config.data.min_len, config.data.max_len + 1,
                         shape[:2] + (1,))
  valid = np.arange(config.data.max_len) < lengths
  inputs = np.where(valid, rng.integers(1, config.data.num_symbols + 1,
                                        shape), 0)
  return {"inputs": jnp.asarray(inputs, jnp.int32),
          "targets": jnp.asarray(inputs[..., ::-1], jnp.int32)}


def _interleaved_rates(sides: dict[str, list], window_s: float,
                       windows: int) -> dict[str, list[float]]:
  """Steps/s of each ``[step, state, batch, rng]`` in ``sides`` over
  ``windows`` windows of about ``window_s``, the sides alternating (in turn
  first and last) so that both see the same machine."""

  def steps_per_s(name, steps):
    step, state, batch, rng = sides[name]
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = step(state, batch, rng)
    jax.block_until_ready((state, metrics))
    sides[name][1] = state
    return steps / (time.perf_counter() - start)

  for name in sides:
    steps_per_s(name, 1)  # Compiles.
  steps = {name: max(2, round(window_s * steps_per_s(name, 3)))
           for name in sides}
  rates = {name: [] for name in sides}
  for w in range(windows):
    for name in list(sides) if w % 2 == 0 else reversed(list(sides)):
      rates[name].append(steps_per_s(name, steps[name]))
  return rates


def vmapped_seeds(arg: str, num_seeds: int, window_s: float,
                  windows: int) -> dict[str, Any]:
  """Train steps/s of one model against ``num_seeds`` models trained in one
  vmapped program (stacked parameters and optimizer states, own batches
  and dropout keys); the throughput ratio counts seed-steps."""
  config = default.get_config(arg)
  model = build.make_model(config)
  step = functools.partial(train.train_step, model=model,
                           schedule=build.learning_rate_schedule(config))
  create = functools.partial(build.create_train_state, config, model)
  keys = jax.random.split(jax.random.key(config.seed), num_seeds)
  batches = _random_batches(config, num_seeds)
  rates = _interleaved_rates({
      "single": [jax.jit(step, donate_argnums=0), jax.jit(create)(keys[0]),
                 jax.tree.map(lambda a: a[0], batches), keys[0]],
      "vmapped": [jax.jit(jax.vmap(step), donate_argnums=0),
                  jax.jit(jax.vmap(create))(keys), batches, keys],
  }, window_s, windows)
  single = statistics.median(rates["single"])
  stacked = statistics.median(rates["vmapped"])
  return {"config_arg": arg, "num_seeds": num_seeds,
          "single_steps_per_s": single,
          "vmapped_steps_per_s": stacked,
          "throughput_ratio": num_seeds * stacked / single,
          "single_window_rates": rates["single"],
          "vmapped_window_rates": rates["vmapped"]}


# --------------------------------------------------------------------------
# The section and its tables.
# --------------------------------------------------------------------------


def run(plan: AcceleratorPlan, timer: Timer,
        log: Log = lambda _: None) -> dict[str, Any]:
  """Every measurement of ``plan``."""
  results = {"plan": dataclasses.asdict(plan), "layers": [], "fused": []}
  for dtype in plan.dtypes:
    for shape in plan.shapes:
      log(f"accelerator: layer {shape} {dtype}: ours / Flax / torch")
      results["layers"].append(layer_rows(shape, dtype, plan.repeats, timer))
      # Each row as soon as it is measured: a run stopped at a time limit
      # still leaves the rows it finished.
      log("\n".join(format_tables({"layers": results["layers"][-1:],
                                    "fused": []})))
      log(f"accelerator: fused path vs direct call, {shape} {dtype}")
      results["fused"].append(fused_vs_direct(shape, dtype, plan.repeats,
                                              timer, plan.fused_masks))
      log("\n".join(format_tables({"layers": [],
                                    "fused": results["fused"][-1:]})))
  if plan.num_seeds:
    log(f"accelerator: {plan.num_seeds} vmapped seeds vs one "
        f"({plan.seeds_config or 'default'} config)")
    results["seeds"] = vmapped_seeds(plan.seeds_config, plan.num_seeds,
                                     plan.seeds_window_s, plan.seeds_windows)
  return results


def _ratio(ms: Mapping[str, float], a: str, b: str) -> str:
  return f"{ms[a] / ms[b]:.3f}" if a in ms and b in ms else "-"


def _cell(ms: Mapping[str, float], name: str) -> str:
  return f"{ms[name]:.2f}" if name in ms else "-"


def format_tables(results: Mapping[str, Any]) -> list[str]:
  """Markdown lines of :func:`run`'s results."""
  lines = []
  if results["layers"]:
    lines += ["", "| one layer | dtype | B / L / D / H | ours (ms) | ours, "
              "weights from lse (ms) | Flax (ms) | torch (ms) | ours / Flax "
              "| ours / torch |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, label in (("fwd_bwd", "forward+backward, weights out"),
                        ("inference", "inference, no weights")):
      for row in results["layers"]:
        ms = {k.split("/")[1]: v for k, v in row["ms"].items()
              if k.startswith(kind)}
        lines.append(
            f"| {label} | {row['dtype']} | {LayerShape(**row['shape'])} | "
            f"{_cell(ms, 'ours')} | {_cell(ms, 'ours_lse')} | "
            f"{_cell(ms, 'flax')} | {_cell(ms, 'torch')} | "
            f"{_ratio(ms, 'ours', 'flax')} | {_ratio(ms, 'ours', 'torch')} |")
    notes = {row["torch_note"] for row in results["layers"]
             if row["torch_note"]}
    lines += [f"torch: {note}." for note in sorted(notes)]
  if results["fused"]:
    lines += ["", "| fused path vs direct jax.nn.dot_product_attention | "
              "dtype | B / L / D / H | implementation | mask | ours (ms) | "
              "direct (ms) | ours / direct |",
              "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for row in results["fused"]:
      for kind in ("forward", "fwd_bwd"):
        for mask in [m for m in ("none", "lengths")
                     if f"{kind}/{m}/ours" in row["ms"]]:
          ms = row["ms"]
          a, b = f"{kind}/{mask}/ours", f"{kind}/{mask}/direct"
          lines.append(
              f"| {kind} | {row['dtype']} | {LayerShape(**row['shape'])} | "
              f"{row['implementation']} | {mask} | {ms[a]:.2f} | "
              f"{ms[b]:.2f} | {ms[a] / ms[b]:.3f} |")
  if "seeds" not in results:
    return lines
  s = results["seeds"]
  lines += ["", "| seeds trained together | config | one model (steps/s) | "
            "vmapped (steps/s) | seed-steps/s vs one |",
            "| --- | --- | ---: | ---: | ---: |",
            f"| {s['num_seeds']} seeds, vmapped | "
            f"{s['config_arg'] or 'default'} | {s['single_steps_per_s']:.1f} | "
            f"{s['vmapped_steps_per_s']:.1f} | {s['throughput_ratio']:.2f}x |"]
  return lines


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------

_PROG = "accelerator_benchmark.py"


def _define_flags() -> dict[str, flags.FlagHolder]:
  """The command line's flags, defined only when run as a script (the tests
  import this module beside ``cpu_benchmark``, whose flags share names)."""
  return {
      "quick": flags.DEFINE_bool(
          "quick", False, "Tiny shapes on any device: a smoke test of "
          "seconds whose numbers mean nothing."),
      "out": flags.DEFINE_string(
          "out", None, "JSON output path (default: benchmarks/results/<UTC "
          "date>_accelerator_<commit>.json); the markdown tables go next to "
          "it (.md)."),
      "repeats": flags.DEFINE_integer(
          "repeats", None, "Timed rounds per comparison (default: the "
          "plan's).", lower_bound=1),
      "vmapped_seeds": flags.DEFINE_bool(
          "vmapped_seeds", False, "Run only the vmapped-seeds rows: the "
          "default config's train step, one model vs 4 trained together (any "
          "device)."),
  }


def main(argv: list[str], flag: Mapping[str, flags.FlagHolder]) -> None:
  """Runs the plan the flags choose; writes and prints its tables."""
  del argv
  name = ("seeds" if flag["vmapped_seeds"].value else "accelerator") + (
      "_quick" if flag["quick"].value else "")
  out = checked_out(_PROG, flag["out"].value, name)
  logging.set_verbosity(logging.WARNING)
  if not flag["vmapped_seeds"].value and not flag["quick"].value and (
      jax.devices()[0].platform != "gpu"):
    cli.fail(_PROG, f"--gpu needs a GPU (this device is "
             f"{jax.devices()[0].platform}); --gpu --quick runs a smoke test "
             "on any device")
  if flag["quick"].value:
    jax.config.update("jax_disable_most_optimizations", True)
  plan = (SEEDS if flag["vmapped_seeds"].value else
          QUICK if flag["quick"].value else GPU)
  if plan is SEEDS and flag["quick"].value:  # QUICK's seeds rows alone.
    plan = dataclasses.replace(
        QUICK, shapes=(), dtypes=(), repeats=0)
  if flag["repeats"].value is not None:
    plan = dataclasses.replace(plan, repeats=flag["repeats"].value)
  log = lambda message: print(message, file=sys.stderr, flush=True)
  results = record(name, quick=flag["quick"].value,
                   plan=dataclasses.asdict(plan), repeats=plan.repeats)
  results["accelerator"] = run(plan, time_interleaved, log)
  results["load_average_end"] = load_average()
  lines = header_lines(
      results, ", ".join(plan.dtypes) or "float32",
      None if plan.shapes else  # The vmapped-seeds rows alone.
      f"Train steps/s: medians of {plan.seeds_windows} windows of about "
      f"{plan.seeds_window_s:g} s.")
  lines += format_tables(results["accelerator"])
  write_results(out, results, "\n".join(lines) + "\n", log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  _FLAGS = _define_flags()
  app.run(functools.partial(main, flag=_FLAGS),
          flags_parser=cli.flags_parser(_PROG))
