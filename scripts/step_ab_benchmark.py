r"""The train step with and without the custom derivatives, in one process.

    python scripts/step_ab_benchmark.py                      # about a minute
    python scripts/step_ab_benchmark.py --retrain_models=16  # + the vmapped
                                                             # retraining step
    python scripts/step_ab_benchmark.py --ab=options         # the step's
                                                             # fusion option
    python scripts/step_ab_benchmark.py --ab=level           # + level 1
    python scripts/step_ab_benchmark.py --ab=calls           # 50 steps a
                                                             # call

The Dense layers (``mha.model``) and ``QK^T`` (``mha.attention``) have
derivative rules of their own whose weight and key gradients XLA:CPU runs as
YNNPACK matmuls (docs/performance.md, "Compiling less"). This script compiles
the default config's train step twice in one process: "autodiff" with those
two rules swapped back for the plain ``lax.dot_general`` and ``jnp.einsum``
(the program of the commits before them), and "custom" as the package runs
it. It prints each program's compile time, kernels and plain ``dot``
kernels, the largest parameter difference after 20 steps, then times the two
in alternating windows (``--windows`` of ``--calls`` calls on one random
batch already on the device, the order reversed every other window) and
prints the medians and their ratio. With ``--retrain_models=R`` it does the
same for ``mha.pruning.retrain``'s step, R models vmapped. With
``--ab=options`` the two programs are instead the package's train step
compiled without and with ``mha.train.STEP_FUSION_OPTIONS`` ("plain",
"options": bitwise the same state); with ``--ab=level``, with the fusion
option and with the whole of ``mha.train.STEP_COMPILER_OPTIONS``, which adds
optimization level 1 ("fusion", "level 1": not bitwise, docs/performance.md);
with ``--ab=calls``, the train step called once a step against the run's
train program (``mha.train.train_steps``) running
``mha.train.STEPS_PER_CALL`` steps a call ("one a call", "50 a call": bitwise
the same), both with ``mha.train.STEP_COMPILER_OPTIONS``, each window
``STEPS_PER_CALL`` steps dispatched and then waited for, the state threaded
through (``--calls`` is not used); ``--config`` picks the config.

A shared machine moves both programs' times together; compare the ratio, and
repeat the script across processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import default
from mha import attention
from mha import benchmarking
from mha import build
from mha import cli
from mha import model as model_lib
from mha import train
from mha.pruning import retrain

_WINDOWS = flags.DEFINE_integer("windows", 30, "Alternating windows.",
                                lower_bound=2)
_CALLS = flags.DEFINE_integer("calls", 10, "Timed calls per window.",
                              lower_bound=1)
_RETRAIN = flags.DEFINE_integer("retrain_models", 0,
                                "Also the vmapped retraining step of this "
                                "many models (0: not).", lower_bound=0)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line instead.")
_AB = flags.DEFINE_enum("ab", "derivatives",
                        ["derivatives", "options", "level", "calls"],
                        "What the two programs differ in: the custom "
                        "derivatives (autodiff, custom), the train step's "
                        "fusion option (plain, options), its "
                        "optimization level (fusion, level 1), or the steps "
                        "a call (one a call, 50 a call).")
_CONFIG_ARG = flags.DEFINE_string("config", "", "get_config's argument "
                                  "(e.g. deep, wide).")

_PROG = "step_ab_benchmark.py"
VARIANTS = ("autodiff", "custom")
OPTION_VARIANTS = ("plain", "options")
LEVEL_VARIANTS = ("fusion", "level 1")
CALL_VARIANTS = ("one a call", f"{train.STEPS_PER_CALL} a call")
_AB_VARIANTS = {"derivatives": VARIANTS, "options": OPTION_VARIANTS,
                "level": LEVEL_VARIANTS, "calls": CALL_VARIANTS}
# The compiler options of each variant (None: XLA's defaults).
_VARIANT_OPTIONS = {"plain": None, "options": train.STEP_FUSION_OPTIONS,
                    "fusion": train.STEP_FUSION_OPTIONS,
                    "level 1": train.STEP_COMPILER_OPTIONS,
                    **dict.fromkeys(CALL_VARIANTS,
                                    train.STEP_COMPILER_OPTIONS)}


@contextlib.contextmanager
def variant(name: str):
  """Traces in it see the plain products (``autodiff``) or the package's
  (``custom``)."""
  saved = model_lib._dense_dot_general, attention._qk_einsum  # pylint: disable=protected-access
  if name == "autodiff":
    model_lib._dense_dot_general = jax.lax.dot_general  # pylint: disable=protected-access
    attention._qk_einsum = (  # pylint: disable=protected-access
        lambda subscripts, q, k, precision=None: jnp.einsum(
            subscripts, q, k, precision=precision))
  try:
    yield
  finally:
    model_lib._dense_dot_general, attention._qk_einsum = saved  # pylint: disable=protected-access


def _compile(fn, args, name: str, **jit_kwargs
             ) -> tuple[object, dict[str, float]]:
  with variant(name if name in VARIANTS else "custom"):
    # A fresh function each time: jit would reuse the other variant's trace.
    lowered = jax.jit(lambda *a: fn(*a), **jit_kwargs).lower(*args)
  start = time.process_time()
  compiled = lowered.compile(_VARIANT_OPTIONS.get(name))
  cpu = time.process_time() - start
  # The program's own computations (the entry and the bodies of its loops,
  # as a retraining step's scan has), not those inside fused kernels.
  program = "\n".join(
      block for block in compiled.as_text().split("\n\n")
      if "{" in block and "fus" not in block.split("{", 1)[0].split("(")[0])
  return compiled, {
      "compile_cpu_s": cpu,
      "kernels": len(re.findall(
          r" (?:fusion|dot|custom-call|scatter|gather)\(", program)),
      "plain_dots": len(re.findall(r" dot\(", program))}


def _time(compiled: dict[str, object], args, windows: int,
          calls: int) -> dict[str, float]:
  times = {name: [] for name in compiled}
  names = tuple(compiled)
  for w in range(windows):
    for name in names if w % 2 == 0 else names[::-1]:
      jax.block_until_ready(compiled[name](*args))
      for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(compiled[name](*args))
        times[name].append(time.perf_counter() - start)
  return {name: benchmarking.median_ms(t) for name, t in times.items()}


def measure_calls(windows: int, config_arg: str = "") -> dict:
  """``--ab=calls``: the train step called once a step against the run's
  train program, ``STEPS_PER_CALL`` steps a call (see the module doc)."""
  config = default.get_config(config_arg or None)
  model = build.make_model(config)
  schedule = build.learning_rate_schedule(config)
  make_state = jax.jit(lambda: build.create_train_state(
      config, model, jax.random.key(config.seed)))
  per_call = train.STEPS_PER_CALL
  tokens = np.random.RandomState(0).randint(
      1, config.data.num_symbols + 1,
      (per_call, config.batch_size, config.data.max_len)).astype(np.int32)
  batches = {"inputs": jnp.asarray(tokens),
             "targets": jnp.asarray(tokens[:, :, ::-1])}
  rows = [jax.tree.map(lambda x, i=i: x[i], batches) for i in range(per_call)]
  rng = jax.random.key(1)
  one_name, many_name = CALL_VARIANTS
  one = functools.partial(train.train_step, model=model, schedule=schedule)
  many = functools.partial(train.train_steps, model=model, schedule=schedule)
  count = jnp.int32(per_call)
  out = {"environment": benchmarking.environment(),
         "load_average_start": benchmarking.load_average()}
  info = {}
  one_c, info[one_name] = _compile(one, (make_state(), rows[0], rng),
                                   one_name, donate_argnums=0)
  many_c, info[many_name] = _compile(many, (make_state(), batches, count, rng),
                                     many_name, donate_argnums=0)
  # 20 steps: one at a time, and as calls of 1, 7 and 12 steps.
  state_one, state_many = make_state(), make_state()
  for i in range(20):
    state_one, _ = one_c(state_one, rows[i], rng)
  done = 0
  for steps in (1, 7, 12):
    block = jax.tree.map(lambda x, d=done: jnp.roll(x, -d, axis=0), batches)
    state_many, _ = many_c(state_many, block, jnp.int32(steps), rng)
    done += steps
  info["max_param_diff_20_steps"] = max(
      float(jnp.max(jnp.abs(a - b))) for a, b in zip(
          jax.tree.leaves(state_one.params),
          jax.tree.leaves(state_many.params)))

  def window_one(state):
    for batch in rows:
      state, metrics = one_c(state, batch, rng)
    jax.block_until_ready(metrics)
    return state

  def window_many(state):
    state, metrics = many_c(state, batches, count, rng)
    jax.block_until_ready(metrics)
    return state

  states = {one_name: make_state(), many_name: make_state()}
  runs = {one_name: window_one, many_name: window_many}
  times = {name: [] for name in runs}
  for w in range(windows + 1):  # the first pair of windows warms up
    for name in CALL_VARIANTS if w % 2 == 0 else CALL_VARIANTS[::-1]:
      start = time.perf_counter()
      states[name] = runs[name](states[name])
      if w:
        times[name].append((time.perf_counter() - start) / per_call)
  info["step_ms"] = {name: benchmarking.median_ms(t)
                     for name, t in times.items()}
  out["train_step"] = info
  out["load_average_end"] = benchmarking.load_average()
  return out


def measure(windows: int, calls: int, retrain_models: int,
            variants: tuple[str, str] = VARIANTS, config_arg: str = "") -> dict:
  config = default.get_config(config_arg or None)
  model = build.make_model(config)
  state = jax.jit(lambda: build.create_train_state(
      config, model, jax.random.key(config.seed)))()
  tokens = jnp.asarray(np.random.RandomState(0).randint(
      1, config.data.num_symbols + 1,
      (config.batch_size, config.data.max_len)), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens[:, ::-1]}
  rng = jax.random.key(1)
  step = functools.partial(train.train_step, model=model,
                           schedule=build.learning_rate_schedule(config))
  out = {"environment": benchmarking.environment(),
         "load_average_start": benchmarking.load_average()}
  compiled, info = {}, {}
  for name in variants:
    compiled[name], info[name] = _compile(step, (state, batch, rng), name)
  finals = {}
  for name in variants:
    s = state
    for i in range(20):
      s, _ = compiled[name](s, batch, jax.random.key(i))
    finals[name] = jax.tree.leaves(s.params)
  info["max_param_diff_20_steps"] = max(
      float(jnp.max(jnp.abs(a - b))) for a, b in zip(*finals.values()))
  info["step_ms"] = _time(compiled, (state, batch, rng), windows, calls)
  out["train_step"] = info
  if retrain_models:
    # retrain._step's arguments: every model active, a constant rate.
    hyper = tuple((k, config[k]) for k in retrain._HYPER)  # pylint: disable=protected-access
    params = jax.tree.map(jnp.asarray,
                          retrain.stack(state.params, retrain_models))
    opt_state = retrain._fresh_opt_state(params, hyper)  # pylint: disable=protected-access
    masks = jnp.asarray(np.random.RandomState(0).rand(
        retrain_models, config.model.num_layers, config.model.num_heads)
                        > 0.3, jnp.float32)
    rates = jnp.full((retrain_models, 8), config.learning_rate, jnp.float32)
    args = (params, opt_state, jnp.zeros(retrain_models, jnp.float32), masks,
            rates, retrain_models, 0, batch["inputs"], batch["targets"], rng)
    inner = functools.partial(retrain._step.__wrapped__, model, hyper)  # pylint: disable=protected-access
    compiled, rinfo = {}, {}
    for name in variants:
      compiled[name], rinfo[name] = _compile(inner, args, name)
    rinfo["step_ms"] = _time(compiled, args, max(windows // 2, 2),
                             max(calls // 2, 1))
    out[f"retrain_step_{retrain_models}_models"] = rinfo
  out["load_average_end"] = benchmarking.load_average()
  return out


def main(argv: list[str]) -> None:
  del argv
  variants = _AB_VARIANTS[_AB.value]
  cli.checked_config(_PROG, _CONFIG_ARG.value)  # a mistake: one line, exit 2
  if _AB.value == "calls":
    results = measure_calls(_WINDOWS.value, _CONFIG_ARG.value)
  else:
    results = measure(_WINDOWS.value, _CALLS.value, _RETRAIN.value,
                      variants, _CONFIG_ARG.value)
  if _JSON.value:
    print(json.dumps(results))
    return
  env = results["environment"]
  print(f"{env['cpu']}, {env['threads']} threads, JAX {env['jax']}; load "
        f"average {results['load_average_start']} -> "
        f"{results['load_average_end']}")
  for key, r in results.items():
    if not key.endswith(("step", "models")):
      continue
    ms = r["step_ms"]
    for name in variants:
      i = r[name]
      print(f"{key} {name}: {ms[name]:.2f} ms median, compile CPU "
            f"{i['compile_cpu_s']:.2f} s, {i['kernels']} kernels, "
            f"{i['plain_dots']} plain dots")
    print(f"{key} {variants[1]} / {variants[0]}: "
          f"{ms[variants[1]] / ms[variants[0]]:.3f}")
  print("max parameter difference after 20 steps: "
        f"{results['train_step']['max_param_diff_20_steps']:.3g}")


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
