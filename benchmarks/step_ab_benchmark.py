r"""One step a call against ``STEPS_PER_CALL`` steps a call, in one process.

    python benchmarks/step_ab_benchmark.py --ab=calls              # about a minute
    python benchmarks/step_ab_benchmark.py --ab=calls --config=deep --windows=20

The run's train program (``mha.train._train_program``, as
``benchmarking.run_programs`` makes it) runs up to ``mha.train.STEPS_PER_CALL``
steps a call, a ``fori_loop`` over ``mha.train.train_step``. This script
compiles it twice in one process, ``mha.train.STEPS_PER_CALL`` assigned 1
("one a call") and left at its value N ("N a call"), and times them in
alternating windows of N steps each (N calls of one step, or one call of N),
on random batches already on the devices, the state threaded through, each
window dispatched and then waited for, the order reversed every other
window (the first pair warms up). It reports each side's compile CPU time,
kernels and median ms a step, their ratio, and whether one window from the
same state leaves both sides bitwise the same state (it should: the loop
runs the same steps).

A shared machine moves both sides' times together; compare the ratio, and
repeat the script across processes. Prints the table; writes it beside
``--out`` (JSON; by default ``benchmarks/results/<UTC
date>_step_ab_calls_<commit>.json``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterator

# Run as a file, the path holds this folder, not the repository's root: put
# it first, for the ``benchmarks`` package (which is not installed) and this
# checkout's ``mha`` (whose commit the results record).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from mha import train
from mha.run import cli

from benchmarks import benchmarking

_AB = flags.DEFINE_enum("ab", "calls", ["calls"],
                        "What the two sides differ in: the steps a call of "
                        "the train program (one, or STEPS_PER_CALL).")
_WINDOWS = flags.DEFINE_integer("windows", 30, "Timed windows of each side.",
                                lower_bound=1)
_CONFIG_ARG = flags.DEFINE_string("config", "", "get_config's argument "
                                  "(e.g. deep, wide).")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_step_ab_calls_<commit>.json); the table goes next to it (.md).")

_PROG = "step_ab_benchmark.py"


@contextlib.contextmanager
def steps_per_call(n: int) -> Iterator[None]:
  """``mha.train.STEPS_PER_CALL`` is ``n`` in it."""
  saved = train.STEPS_PER_CALL
  train.STEPS_PER_CALL = n
  try:
    yield
  finally:
    train.STEPS_PER_CALL = saved


def _side(run: benchmarking.RunPrograms, batches: dict[str, np.ndarray],
          per_call: int) -> dict[str, Any]:
  """The train program compiled for blocks of ``per_call`` steps, and the
  window's blocks on the devices."""
  with steps_per_call(per_call):
    size = train.STEPS_PER_CALL  # The block a call of the run gets.
    count = len(next(iter(batches.values())))
    blocks = [run.block({k: v[i:i + size] for k, v in batches.items()})
              for i in range(0, count, size)]
    lowered = run.train_program.lower(run.initial_state(), blocks[0],
                                      jnp.int32(size), run.dropout_rng)
    start = time.process_time()
    compiled = lowered.compile()
    compile_cpu_s = time.process_time() - start
  return {"compiled": compiled, "blocks": blocks, "count": jnp.int32(size),
          "info": {"steps_per_call": size, "compile_cpu_s": compile_cpu_s,
                   "kernels": benchmarking.kernels(compiled.as_text())}}


def _window(side: dict[str, Any], state: Any, rng: Any) -> Any:
  """One window: every block's call dispatched, then waited for."""
  for block in side["blocks"]:
    state, metrics = side["compiled"](state, block, side["count"], rng)
  jax.block_until_ready((state, metrics))
  return state


def measure_calls(config: Any, windows: int) -> dict[str, Any]:
  """``--ab=calls`` (see the module doc)."""
  run = benchmarking.run_programs(config)
  many = train.STEPS_PER_CALL
  batches = benchmarking.random_batches(config, many)
  sides = {"one a call": _side(run, batches, 1),
           f"{many} a call": _side(run, batches, many)}
  names = tuple(sides)
  # One window from the same state: the same steps, the same state.
  finals = {name: _window(side, run.initial_state(), run.dropout_rng)
            for name, side in sides.items()}
  pairs = list(zip(*(jax.tree.leaves(s) for s in finals.values())))
  differences = [float(np.max(np.abs(np.asarray(a, np.float64)
                                     - np.asarray(b, np.float64))))
                 for a, b in pairs if jnp.issubdtype(a.dtype, jnp.inexact)]
  bitwise = all(np.array_equal(a, b) for a, b in pairs)
  states = {name: run.initial_state() for name in names}
  times = {name: [] for name in names}
  for w in range(windows + 1):  # The first pair of windows warms up.
    for name in names if w % 2 == 0 else names[::-1]:
      start = time.perf_counter()
      states[name] = _window(sides[name], states[name], run.dropout_rng)
      if w:
        times[name].append((time.perf_counter() - start) / many)
  variants = {name: {**sides[name]["info"],
                     "step_ms": benchmarking.median_ms(times[name]),
                     "window_step_ms": [1e3 * t for t in times[name]]}
              for name in names}
  return {"steps_per_window": many, "windows": windows, "variants": variants,
          "ratio": variants[names[1]]["step_ms"]
                   / variants[names[0]]["step_ms"],
          "bitwise_equal": bitwise, "max_abs_difference": max(differences)}


def format_table(results: dict[str, Any]) -> str:
  """The markdown report of the results."""
  ab = results["calls"]
  names = list(ab["variants"])
  lines = benchmarking.header_lines(
      results, rounds=f"Medians of {ab['windows']} alternating windows of "
      f"{ab['steps_per_window']} steps a side (config "
      f"`{results['config_arg'] or 'default'}`).") + [
          "", "| train program | steps a call | compile CPU (s) | kernels | "
          "ms a step |", "| --- | ---: | ---: | ---: | ---: |"]
  for name, v in ab["variants"].items():
    lines.append(f"| {name} | {v['steps_per_call']} | "
                 f"{v['compile_cpu_s']:.2f} | {v['kernels']} | "
                 f"{v['step_ms']:.3f} |")
  lines += ["", f"{names[1]} / {names[0]}: {ab['ratio']:.3f}; after one "
            "window from the same state: " + (
                "bitwise the same state" if ab["bitwise_equal"] else
                f"states differ by up to {ab['max_abs_difference']:.3g}")]
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  config = cli.checked_config(_PROG, _CONFIG_ARG.value)
  name = f"step_ab_{_AB.value}"
  out = benchmarking.checked_out(_PROG, _OUT.value, name)
  logging.set_verbosity(logging.WARNING)
  results = benchmarking.record(name, config_arg=_CONFIG_ARG.value)
  results[_AB.value] = measure_calls(config, _WINDOWS.value)
  results["load_average_end"] = benchmarking.load_average()
  log = lambda message: print(message, file=sys.stderr, flush=True)
  benchmarking.write_results(out, results, format_table(results), log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
