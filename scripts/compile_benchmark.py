r"""Compile time of a run's three programs, and the train step's speed.

    python scripts/compile_benchmark.py                # the default config
    python scripts/compile_benchmark.py --config_arg=tiny --rounds=1

The three programs ``train.py`` compiles (the initial state, the train step
and the evaluation step, as ``mha.train`` jits and compiles them, on one
device) are
lowered and compiled ``--rounds`` times each, in turns, with the persistent
compilation cache off and JAX's in-memory caches cleared before every
lowering. For each: the median wall time and CPU time (the process's,
XLA's compiler threads included: less sensitive than wall time to a machine
shared with other work), the optimized HLO's lines and the kernels (fusions
and library calls) of its entry computation. Then the train step's time:
``--steps`` steps on a batch already on the device, in calls of
``mha.train.STEPS_PER_CALL`` steps as a run makes them, the median call's
time a step, as ms and as the steps/s of the progress line.

To compare two versions of the code, run this script with ``PYTHONPATH`` set
to each checkout in turn, alternating; it only uses names both have.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from mha import build
from mha import cli
from mha import data
from mha import evaluate as eval_lib
from mha import train

_CONFIG_ARG = flags.DEFINE_string("config_arg", "",
                                  "The argument of configs/default.py.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Compilations of each program.",
                               lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 300, "Timed train steps.",
                              lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line instead.")

_PROG = "compile_benchmark.py"


def kernels(hlo_text: str) -> int:
  """Fusions and calls of the program's own computations in an optimized HLO
  module (the entry, and the bodies of its loops, as the train program's
  loop over its steps; not the computations inside fused kernels): roughly,
  the kernels XLA:CPU compiles and launches."""
  program = "\n".join(
      block for block in hlo_text.split("\n\n")
      if "{" in block and "fus" not in block.split("{", 1)[0].split("(")[0])
  return len(re.findall(r" (?:fusion|dot|custom-call|scatter|gather)\(",
                        program))


def programs(config) -> dict[str, tuple]:
  """``{name: (jitted, args)}`` of the three programs of a run."""
  model = build.make_model(config)
  # The initial state as mha.train makes it (its random numbers hashed on
  # the host where it does that: mha.host_prng); older code: plainly.
  if hasattr(train, "_rng_impl"):
    fresh = train._fresh_state  # pylint: disable=protected-access
    initial, abstract_state = fresh(config, model)
    init = jax.jit(lambda: initial()[0])
    state = jax.tree.unflatten(jax.tree.structure(abstract_state), init())
  else:
    create = functools.partial(build.create_train_state, config, model)
    init = jax.jit(lambda: create(jax.random.key(config.seed)))
    state = init()
  schedule = build.learning_rate_schedule(config)
  if hasattr(train, "train_steps"):
    # The run's train program: STEPS_PER_CALL steps a call (older code: one).
    tokens = jnp.ones((train.STEPS_PER_CALL, config.batch_size,
                       config.data.max_len), jnp.int32)
    # The count of steps an argument, as the run passes it (a while loop).
    step_args = (jnp.int32(train.STEPS_PER_CALL),)
    step = jax.jit(functools.partial(train.train_steps, model=model,
                                     schedule=schedule), donate_argnums=0)
  else:
    tokens = jnp.ones((config.batch_size, config.data.max_len), jnp.int32)
    step_args = ()
    step = jax.jit(functools.partial(train.train_step, model=model,
                                     schedule=schedule), donate_argnums=0)
  eval_tokens = jnp.ones((config.eval_batch_size, config.data.max_len),
                         jnp.int32)
  evaluate = jax.jit(functools.partial(eval_lib.eval_step.__wrapped__, model))
  return {
      "initial state": (init, ()),
      "train step": (step, (state, {"inputs": tokens, "targets": tokens},
                            *step_args, jax.random.key(1))),
      "evaluation": (evaluate, (state.params, {"inputs": eval_tokens,
                                               "targets": eval_tokens})),
  }


def measure(config, rounds: int, steps: int) -> dict[str, dict[str, float]]:
  progs = programs(config)
  wall = {name: [] for name in progs}
  cpu = {name: [] for name in progs}
  out = {}
  for _ in range(rounds):
    for name, (fn, args) in progs.items():
      jax.clear_caches()  # Else a program compiled before is not compiled.
      low = fn.lower(*args)
      # As mha.train compiles each program (older code: plainly).
      options = None
      if name == "initial state":
        options = getattr(train, "RUN_ONCE_COMPILER_OPTIONS", None)
      elif name == "train step" and hasattr(train, "step_compiler_options"):
        options = train.step_compiler_options()
      elif name == "evaluation" and hasattr(train, "eval_compiler_options"):
        options = train.eval_compiler_options()
      w, c = time.perf_counter(), time.process_time()
      compiled = low.compile(options)
      wall[name].append(time.perf_counter() - w)
      cpu[name].append(time.process_time() - c)
      text = compiled.as_text()
      out[name] = {"hlo_lines": len(text.splitlines()),
                   "kernels": kernels(text)}
  for name in progs:
    out[name]["compile_wall_s"] = statistics.median(wall[name])
    out[name]["compile_cpu_s"] = statistics.median(cpu[name])
  # The train step, on the device-resident batch, its state threaded
  # through: calls of STEPS_PER_CALL steps (older code: one).
  fn, (state, *rest) = progs["train step"]
  per_call = getattr(train, "STEPS_PER_CALL", 1)
  state, metrics = fn(state, *rest)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(max(1, steps // per_call)):
    start = time.perf_counter()
    state, metrics = fn(state, *rest)
    jax.block_until_ready(metrics)
    times.append((time.perf_counter() - start) / per_call)
  step_ms = 1e3 * statistics.median(times)
  out["train step"].update(step_ms=step_ms, steps_per_s=1e3 / step_ms)
  return out


def main(argv: list[str]) -> None:
  del argv
  config = cli.checked_config(_PROG, _CONFIG_ARG.value, "config_arg")
  config.unlock()
  config.compilation_cache_dir = ""
  results = measure(config, _ROUNDS.value, _STEPS.value)
  if _JSON.value:
    print(json.dumps(results))
    return
  print("| program | compile wall (s) | compile CPU (s) | HLO lines | kernels "
        "|\n| --- | ---: | ---: | ---: | ---: |")
  for name, r in results.items():
    print(f"| {name} | {r['compile_wall_s']:.2f} | {r['compile_cpu_s']:.2f} "
          f"| {r['hlo_lines']:,} | {r['kernels']} |")
  step = results["train step"]
  print(f"\ntrain step: {step['step_ms']:.2f} ms median "
        f"({step['steps_per_s']:.1f} steps/s)")
  sys.stdout.flush()


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
