r"""Compile time of a run's three programs, and the train step's speed.

    python benchmarks/compile_benchmark.py                # the default config
    python benchmarks/compile_benchmark.py --config_arg=tiny --rounds=1

The three programs ``train.py`` compiles, as ``mha.train.train_and_evaluate``
makes them (``benchmarking.run_programs``: the mesh over every device): the
initial state (``build.create_train_state``, jitted onto the run's
shardings), the train program (``mha.train._train_program``: the train
step, one step a call) and the evaluation step
(``mha.evaluate.eval_step``). Each is lowered and compiled ``--rounds``
times, in turns, with the persistent compilation cache off and JAX's
in-memory caches cleared before every lowering. For each: the median wall
time and CPU time (the process's, XLA's compiler threads included: less
sensitive than wall time to a machine shared with other work), the
optimized HLO's lines and the kernels (fusions and library calls) of its
own computations. Then the train step's time: ``--steps`` steps on a random
batch already on the devices, one call a step and each step's metrics
fetched once the next step is dispatched, as a run makes them; timed in
windows of up to ``WINDOW`` steps, the median window's time a step, as ms and
as the steps/s of the progress line.

Prints the table; writes it beside ``--out`` (JSON; by default
``benchmarks/results/<UTC date>_compile_<commit>.json``). To compare two
versions of the code, run each checkout's copy of this script in turn,
alternating, and compare their result files.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

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

from mha import evaluate as eval_lib
from mha.run import cli

from benchmarks import benchmarking

_CONFIG_ARG = flags.DEFINE_string("config_arg", "",
                                  "The argument of configs/default.py.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Compilations of each program.",
                               lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 300, "Timed train steps.",
                              lower_bound=1)
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_compile_<commit>.json); the table goes next to it (.md).")

_PROG = "compile_benchmark.py"

#: The most steps of a timed window of train steps.
WINDOW = 10


def programs(config) -> dict[str, tuple]:
  """``{name: (jitted, args)}`` of the three programs of a run."""
  run = benchmarking.run_programs(config)
  state = run.initial_state()
  batch = run.batch({key: value[0] for key, value in
                     benchmarking.random_batches(config, 1).items()})
  eval_tokens = jnp.ones((config.eval_batch_size, config.data.max_len),
                         jnp.int32)
  return {
      "initial state": (run.initial_state, ()),
      "train step": (run.train_program, (state, batch, run.dropout_rng)),
      "evaluation": (eval_lib.eval_step, (run.model, state.params, {
          "inputs": eval_tokens, "targets": eval_tokens})),
  }


def measure(config, rounds: int, steps: int) -> dict[str, dict[str, float]]:
  """Compile times, HLO lines and kernels of each program; the train step's
  ms and steps/s."""
  progs = programs(config)
  wall = {name: [] for name in progs}
  cpu = {name: [] for name in progs}
  out = {}
  for _ in range(rounds):
    for name, (fn, args) in progs.items():
      jax.clear_caches()  # Else a program compiled before is not compiled.
      low = fn.lower(*args)
      w, c = time.perf_counter(), time.process_time()
      compiled = low.compile()
      wall[name].append(time.perf_counter() - w)
      cpu[name].append(time.process_time() - c)
      text = compiled.as_text()
      out[name] = {"hlo_lines": len(text.splitlines()),
                   "kernels": benchmarking.kernels(text)}
  for name in progs:
    out[name]["compile_wall_s"] = statistics.median(wall[name])
    out[name]["compile_cpu_s"] = statistics.median(cpu[name])
  # The train step on a device-resident batch (a step's speed does not
  # depend on the data), its state threaded through: one call a step, each
  # step's metrics fetched once the next step is dispatched (the run's loop).
  fn, (state, *rest) = progs["train step"]
  state, metrics = fn(state, *rest)
  jax.block_until_ready(metrics)
  window = min(steps, WINDOW)
  times = []
  for _ in range(max(1, steps // window)):
    start = time.perf_counter()
    unfetched = None
    for _ in range(window):
      state, metrics = fn(state, *rest)
      if unfetched is not None:
        jax.device_get(unfetched)
      unfetched = metrics
    jax.device_get(unfetched)
    times.append((time.perf_counter() - start) / window)
  step_ms = 1e3 * statistics.median(times)
  out["train step"].update(step_ms=step_ms, steps_per_s=1e3 / step_ms,
                           steps_per_window=window, windows_timed=len(times))
  return out


def format_table(results) -> str:
  """The markdown report of the results."""
  programs_ = results["programs"]
  lines = benchmarking.header_lines(
      results, rounds=f"Medians of {results['rounds']} compilations of each "
      f"program (config `{results['config_arg'] or 'default'}`), in turns, "
      "caches cleared.") + [
          "", "| program | compile wall (s) | compile CPU (s) | HLO lines | "
          "kernels |", "| --- | ---: | ---: | ---: | ---: |"]
  for name, r in programs_.items():
    lines.append(f"| {name} | {r['compile_wall_s']:.2f} | "
                 f"{r['compile_cpu_s']:.2f} | {r['hlo_lines']:,} | "
                 f"{r['kernels']} |")
  step = programs_["train step"]
  lines += ["", f"train step: {step['step_ms']:.2f} ms "
            f"({step['steps_per_s']:.1f} steps/s), one call a step: the "
            f"median of {step['windows_timed']} windows of "
            f"{step['steps_per_window']} steps"]
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  config = cli.checked_config(_PROG, _CONFIG_ARG.value, "config_arg")
  out = benchmarking.checked_out(_PROG, _OUT.value, "compile")
  logging.set_verbosity(logging.WARNING)
  config.unlock()
  config.compilation_cache_dir = ""
  jax.config.update("jax_enable_compilation_cache", False)
  results = benchmarking.record("compile", config_arg=_CONFIG_ARG.value,
                                rounds=_ROUNDS.value, steps=_STEPS.value)
  results["programs"] = measure(config, _ROUNDS.value, _STEPS.value)
  results["load_average_end"] = benchmarking.load_average()
  log = lambda message: print(message, file=sys.stderr, flush=True)
  benchmarking.write_results(out, results, format_table(results), log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
