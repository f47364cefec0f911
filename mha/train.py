"""Training and evaluation: ``train_and_evaluate(config, workdir)``.

One jitted, buffer-donating train program that runs up to
``STEPS_PER_CALL`` steps a call (``train_steps``: bitwise the steps of
``train_step`` one at a time); batches a pure function of ``(seed, step)``;
orbax checkpoints of the whole train state, so a run resumed from its
workdir ends with bitwise the parameters of an uninterrupted one (on CPU).
Metrics go to the console (a progress line with steps/s and ETA),
TensorBoard event files and ``workdir/metrics.jsonl``; at the end of the
first step, a line and ``startup/*`` scalars say how long start-up took and
how many programs were compiled (or loaded from the persistent compilation
cache, ``mha.compilation_cache``). A run compiles three programs: the
initial state, the train program, the evaluation step (the last two on
background threads while the run goes on).

A run never loses more than the steps since its last checkpoint and never
mixes with another: the config is checked before anything is compiled or
written (``mha.config_validation``), a workdir is only resumed with a config
that differs in ``RESUMABLE_KEYS`` and held by one run at a time
(``mha.workdir_lock``), SIGTERM/SIGINT stop once the train program's calls
under way are done (at most two) with a checkpoint of the last step,
damaged checkpoints are set aside (``mha.checkpoint``), a non-finite loss,
gradient or parameter stops the run before it is saved, and a full disk or a
read-only one stops it naming the intact checkpoints
(``mha.write_failures``).

Every device trains (``mha.sharding``): each batch is split along the ``data``
axis of a mesh over all devices, the train state is replicated (or, with
``config.mesh.shard_params``, split too) and one jitted train program runs
on all of them. Launched as several processes (``jax.distributed``), each
process builds only its rows of each batch; process 0 alone prints and writes
``config.json``, ``metrics.jsonl`` and the event files; all take part in the
checkpoints.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from mha import build
from mha import checkpoint as ckpt_lib
from mha import compilation_cache
from mha import config_validation
from mha import data
from mha import evaluate as eval_lib
from mha import executables
from mha import finetune
from mha import host_prng
from mha import metric_writers
from mha import sharding as sharding_lib
from mha import workdir_lock
from mha import write_failures
from mha.aliases import Array
from mha.metric_writers import MetricWriter, format_duration
from mha.model import Transformer

TrainState = build.TrainState


# --------------------------------------------------------------------------
# Steps.
# --------------------------------------------------------------------------


def train_step(state: TrainState, batch: Mapping[str, Array], rng: Array, *,
               model: Transformer,
               schedule: optax.Schedule) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer update; returns the new state and metric sums.

  The dropout rng is ``fold_in(rng, step)``, so a resumed run draws the same
  dropout masks as an uninterrupted one. The metrics are the sums of
  :func:`mha.evaluate.metric_sums`, ``grad_norm``, ``learning_rate`` and
  ``state_finite`` (whether every float of the new state, optimizer moments
  included, is finite).
  """
  dropout_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    logits, _ = model.apply({"params": params}, batch["inputs"],
                            deterministic=False, return_weights=False,
                            rngs={"dropout": dropout_rng})
    sums = eval_lib.metric_sums(logits, batch["targets"], batch["inputs"])
    return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  # Checked on the host before any save (``_check_finite``), in this program
  # rather than a second one to compile.
  metrics = dict(sums, grad_norm=optax.tree.norm(grads),
                 learning_rate=schedule(state.step),
                 state_finite=_all_finite(new_state))
  return new_state, metrics


# The most train steps one call of the run's train program runs
# (:func:`train_steps`); a call also ends at every logging, evaluation and
# checkpoint step. Each call of a program costs time beyond its kernels
# (its arguments and donated buffers, the hand-over to XLA's threads): for
# the default model on 2 CPU cores 0.37-0.64 ms, a sixth of a step called
# one at a time, shared here by up to 50 steps (the same numbers, bitwise;
# docs/performance.md, "Fifty steps a call").
STEPS_PER_CALL = 50


def train_steps(state: TrainState, batches: Mapping[str, Array],
                num_steps: int | Array, rng: Array, *, model: Transformer,
                schedule: optax.Schedule
                ) -> tuple[TrainState, dict[str, Array]]:
  """``num_steps`` :func:`train_step` calls in one program, back to back.

  ``batches`` is a block of batches, each value ``[K, ...]`` (``K`` batches
  of :func:`train_step`'s shapes); step ``i`` trains on batch ``i``. Only the
  first ``num_steps`` (at most ``K``, else a ValueError where it is known;
  it may be traced, so that one compiled program runs any count) are used.
  Returns the state after them and each step's metrics, stacked: ``[K]``
  each, zero from row ``num_steps`` on.
  Bitwise the state and metrics of ``num_steps`` calls of
  :func:`train_step` (tests/test_train.py).
  """
  steps = jax.tree.leaves(batches)[0].shape[0]
  if (not isinstance(num_steps, jax.core.Tracer)
      and not 0 <= num_steps <= steps):  # a traced count is the caller's
    raise ValueError(f"num_steps={num_steps} is not between 0 and the "
                     f"block's {steps} batches")
  # Jitted so that it is traced once: the loop's body finds the trace that
  # gave the metrics' shapes in jit's cache (the step traced twice took 0.3 s
  # longer, all of it on a cold start's path).
  step = jax.jit(functools.partial(train_step, model=model, schedule=schedule))
  metrics = step.eval_shape(state, jax.tree.map(lambda x: x[0], batches),
                            rng)[1]

  def body(i, carry):
    state, stacked = carry
    batch = jax.tree.map(
        lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batches)
    state, metrics = step(state, batch, rng)
    return state, jax.tree.map(lambda rows, m: rows.at[i].set(m), stacked,
                               metrics)

  stacked = jax.tree.map(lambda m: jnp.zeros((steps, *m.shape), m.dtype),
                         metrics)
  return jax.lax.fori_loop(0, num_steps, body, (state, stacked))


class _TrainMetrics:
  """Host-side accumulator of train metric sums over a logging window."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.sums: dict[str, float] = {}
    self.steps = 0
    self.last: dict[str, float] = {}

  def add(self, metrics: Mapping[str, np.ndarray]):
    for key in eval_lib.SUM_KEYS:
      self.sums[key] = self.sums.get(key, 0.0) + float(metrics[key])
    self.last = {k: float(metrics[k]) for k in ("grad_norm", "learning_rate")}
    self.steps += 1

  def summary(self) -> dict[str, float]:
    return {**eval_lib.summarize(self.sums), **self.last}


def _check_finite(step: int, metrics: Mapping[str, np.ndarray]) -> None:
  loss = float(metrics["loss_sum"])
  grad_norm = float(metrics["grad_norm"])
  if not (np.isfinite(loss) and np.isfinite(grad_norm)):
    raise FloatingPointError(
        f"non-finite training metrics at step {step}: loss sum {loss}, "
        f"gradient norm {grad_norm}")
  if not bool(metrics["state_finite"]):
    raise FloatingPointError(f"non-finite parameters after step {step}")


# --------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------


def _log_line(step: int, total: int, metrics: Mapping[str, float],
              steps_per_sec: float, elapsed: float) -> str:
  eta = (total - step) / steps_per_sec if steps_per_sec > 0 else 0.0
  return (f"step {step:>{len(str(total))}}/{total} | "
          f"loss {metrics['loss']:.4f} | tok_acc {metrics['token_accuracy']:.4f}"
          f" | exact {metrics['exact_match']:.4f} | "
          f"{steps_per_sec:.1f} steps/s | {format_duration(elapsed)} elapsed, "
          f"ETA {format_duration(eta)}")


class TrainingInterrupted(Exception):
  """Training stopped by SIGTERM or SIGINT, after saving a checkpoint.

  Attributes:
    signum: the signal.
    step: the step of the checkpoint saved; the run resumes from it.
  """

  def __init__(self, signum: int, step: int, checkpoint_path: str):
    self.signum, self.step = signum, step
    super().__init__(
        f"Interrupted by {signal.Signals(signum).name} at step {step}; "
        f"checkpoint saved in {checkpoint_path}")


class _StopRequest:
  """Turns SIGTERM and SIGINT into a request to stop once the train
  program's calls under way are done (two at most: the one running and the
  one queued behind it, :data:`STEPS_PER_CALL` steps each).

  A second signal of the same kind gets the handler that was there before
  (SIGINT: KeyboardInterrupt at once; SIGTERM: the process ends). Handlers can
  only be installed from the main thread; elsewhere this does nothing. A
  signal its caller ignores (``SIG_IGN``, e.g. SIGINT under ``nohup``) stays
  ignored.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "_StopRequest":
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        previous = signal.getsignal(signum)
        if previous is not signal.SIG_IGN:
          self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    self.signum = signum
    signal.signal(signum, self._previous[signum])
    print(f"Received {signal.Signals(signum).name}: stopping once the "
          "steps under way are done, with a checkpoint (send it again to "
          "stop at once)", file=sys.stderr, flush=True)

  def __exit__(self, *exc_info) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


def _all_finite(tree: Any) -> Array:
  """Whether every float in ``tree`` is finite (a bool scalar).

  One reduction over the concatenated leaves (of each float dtype) rather
  than one per leaf: the same answer in a few kernels instead of one per
  array of the parameters and both Adam moments (78 in the default model).
  """
  by_dtype: dict[Any, list[Array]] = {}
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      by_dtype.setdefault(x.dtype, []).append(jnp.ravel(x))
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(jnp.concatenate(leaves)))
                            for leaves in by_dtype.values()]))


class _NoWriter:
  """The ``MetricWriter`` of processes other than process 0: writes nothing."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    del step, scalars

  def write_text(self, step: int, tag: str, text: str) -> None:
    del step, tag, text

  def close(self) -> None:
    pass


class _CollectorPause:
  """Python's cyclic garbage collector off from its making to :meth:`end`.

  Start-up (tracing and lowering the programs, here and on the compile
  threads) allocates objects by the hundred thousand, most of them alive
  until it is over; the collector would walk them again and again, about a
  tenth of start-up's CPU time (docs/performance.md, "The warm start"). What
  it leaves behind is collected once the collector is back on. A collector
  its caller had turned off stays off.
  """

  def __init__(self):
    self._resume = gc.isenabled()
    gc.disable()

  def end(self) -> None:
    """Turns the collector back on (once; later calls do nothing)."""
    if self._resume:
      self._resume = False
      gc.enable()


@dataclasses.dataclass(frozen=True)
class _Run:
  """What every part of a training run works with, built once by
  :func:`train_and_evaluate` (instead of a dozen parameters passed on)."""

  config: ml_collections.ConfigDict
  workdir: str
  model: Transformer
  splits: Mapping[str, data.Split]
  mesh: Mesh
  state_shardings: Any  # of the train state, leaf by leaf
  dropout_rng: Array
  step: _StepFunction  # the jitted train program (train_steps)
  eval_program: _EvaluationProgram  # the evaluation step, compiled
  checkpoints: ckpt_lib.TrainCheckpoints
  writer: MetricWriter | _NoWriter
  stop: _StopRequest
  start_time: float  # time.time() when train_and_evaluate was called
  compiles_at_start: compilation_cache.CompileCounts  # before this run's
  collector_pause: _CollectorPause  # ended once the first step is done

  def log(self, message: str) -> None:
    """Prints ``message`` once: on process 0."""
    _log(message)

  def evaluate(self, params: Any, name: str, step: int) -> dict[str, float]:
    """Evaluates on split ``name`` and writes (and prints) the metrics."""
    metrics = eval_lib.evaluate(self.model, params, self.splits[name],
                                self.config.eval_batch_size, mesh=self.mesh,
                                compiled=self.eval_program.compiled())
    self.writer.write_scalars(step,
                              {f"{name}/{k}": v for k, v in metrics.items()})
    self.log(f"{name} @ step {step}: loss {metrics['loss']:.4f} | "
             f"tok_acc {metrics['token_accuracy']:.4f} | "
             f"exact {metrics['exact_match']:.4f} "
             f"({format_duration(time.time() - self.start_time)} since start)")
    return metrics


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike) -> TrainState:
  """Trains ``config`` in ``workdir``, resuming from its newest checkpoint.

  Evaluates on validation every ``eval_every_steps`` and on test at the end;
  saves checkpoints every ``checkpoint_every_steps`` and at the end. Trains on
  every device (every process's, after ``jax.distributed`` initialisation);
  the newest checkpoint resumes whatever the device count it was saved with.

  Before anything is compiled or written, the config is validated (also
  against the devices: ``batch_size`` must split across them) and, if
  ``workdir`` holds a run, compared with that run's config: only
  ``config_validation.RESUMABLE_KEYS`` may differ. SIGTERM and SIGINT stop
  the run once the train program's calls under way are done (at most two
  of :data:`STEPS_PER_CALL` steps), with a checkpoint of the last step.

  Returns:
    The final train state.

  Raises:
    ConfigError: a bad config or workdir, or another run's workdir
      (``WorkdirLockedError``: one that another run is training in).
    WriteFailure: a checkpoint, metrics or event-file write failed for want
      of space or permission (the message names the intact checkpoints).
    TrainingInterrupted: after SIGTERM or SIGINT (the checkpoint is saved).
    FloatingPointError: a non-finite loss, gradient or parameter; no
      checkpoint of it is written.
    DamagedCheckpointError: a save that cannot be read back.
  """
  start_time = time.time()
  compiles_at_start = compilation_cache.counts()
  collector_pause = _CollectorPause()
  with contextlib.ExitStack() as cleanup:
    cleanup.callback(collector_pause.end)  # At the latest, on any exit.
    config = finetune.resolve_config(config, workdir)  # init_from's model
    workdir = _checked_workdir(config, workdir)
    splits = _load_splits(config)
    model = build.make_model(config)
    mesh = sharding_lib.make_mesh(config.mesh.data)
    initial, abstract_state = _fresh_state(config, model)
    state_shardings = sharding_lib.state_shardings(
        abstract_state, mesh, shard_params=config.mesh.shard_params)
    cleanup.enter_context(write_failures.reported(
        ckpt_lib.checkpoint_dir(workdir)))
    # Released once everything is written; makes the workdir.
    cleanup.enter_context(workdir_lock.held(workdir))
    checkpoints = ckpt_lib.TrainCheckpoints(
        workdir, keep=config.max_checkpoints_to_keep,
        abstract_state=sharding_lib.with_shardings(abstract_state,
                                                   state_shardings))
    cleanup.callback(checkpoints.close)  # Even on errors: finish the saves.
    restored = checkpoints.restore_latest()
    # Compiles while the initial state is compiled and made.
    step = _StepFunction(config, model, mesh, state_shardings,
                         abstract_state if restored is None else restored[1])
    cleanup.callback(step.wait)  # No compiling left behind, even on errors.
    # Once the step is compiled: the evaluation program, while training.
    eval_program = _EvaluationProgram(config, model, mesh, state_shardings,
                                      abstract_state, after=step.wait)
    cleanup.callback(eval_program.join)
    state, dropout_rng = _initial_state(config, initial, restored, mesh,
                                        state_shardings)
    if restored is None and config.init_from is not None:
      state = finetune.initial_state(config, state, state_shardings)
    elif restored is not None:
      _log(f"Resumed from checkpoint at step {restored[0]} in {workdir}")
    main_process = sharding_lib.is_main_process()
    run = _Run(
        config=config, workdir=workdir, model=model, splits=splits,
        mesh=mesh, state_shardings=state_shardings, dropout_rng=dropout_rng,
        step=step, eval_program=eval_program,
        checkpoints=checkpoints,
        writer=cleanup.enter_context(contextlib.closing(
            MetricWriter(workdir) if main_process else _NoWriter())),
        stop=cleanup.enter_context(_StopRequest()), start_time=start_time,
        compiles_at_start=compiles_at_start, collector_pause=collector_pause)
    _write_run_header(run, state)
    try:
      state = _train_loop(run, state)
    except FloatingPointError as e:
      raise FloatingPointError(
          f"{e}; stopped without saving it (newest checkpoint: "
          f"{_describe_latest(checkpoints)})") from e
    final = int(state.step)
    if (restored is not None and restored[0] >= config.num_train_steps
        and _has_test_metrics(workdir, final)):
      # A finished run again: no second row of the same test metrics.
      run.log(f"Nothing to train: the run is at step {final} (num_train_steps"
              f"={config.num_train_steps}); its test metrics are in "
              f"{os.path.join(workdir, 'metrics.jsonl')}")
    else:
      run.evaluate(state.params, "test", final)
    checkpoints.verify()
    compiles = compilation_cache.counts() - compiles_at_start
    run.log(f"Compiled in this run: {compiles}")
  return state


def _has_test_metrics(workdir: str, step: int) -> bool:
  """Whether ``workdir/metrics.jsonl`` holds the test metrics of ``step``."""
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError):
    return False
  return any(row.get("step") == step and "test/loss" in row for row in rows)


def _fresh_state(config: ml_collections.ConfigDict, model: Transformer
                 ) -> tuple[Callable[[], tuple[list[Array], Array]], TrainState]:
  """``(initial, abstract_state)``: ``initial()`` makes a fresh train state
  (``build.create_train_state``, its leaves flat) and the dropout rng, both
  from ``config.seed``; ``abstract_state`` is the state's ``jax.eval_shape``.

  On a single CPU device its random numbers are hashed on the host
  (:func:`_rng_impl`, :mod:`mha.host_prng`: bitwise the same state, a
  program that compiles in about half the time). Traced once:
  ``jax.eval_shape(initial)`` traces it, and jitting the same
  function (:func:`_initial_state`) finds that trace in JAX's cache, so
  start-up traces the model's initialisation once rather than twice. The
  leaves come out flat because the state's tree holds its optimizer, a new
  (equal) object each time one is made, which jit would not match with the
  tree of the output shardings.
  """
  structure = []

  def initial_state_leaves():
    init_rng, dropout_rng = _run_rngs(config)
    state = build.create_train_state(config, model, init_rng)
    structure.append(jax.tree.structure(state))
    return jax.tree.leaves(state), dropout_rng

  leaves, _ = jax.eval_shape(initial_state_leaves)
  return initial_state_leaves, jax.tree.unflatten(structure[0], leaves)


def _initial_state(config: ml_collections.ConfigDict,
                   initial: Callable[[], tuple[list[Array], Array]],
                   restored: tuple[int, TrainState] | None, mesh: Mesh,
                   state_shardings: Any) -> tuple[TrainState, Array]:
  """The train state to start from (made by ``initial``, of
  :func:`_fresh_state`, or the restored one) and the dropout rng, both from
  ``config.seed``, in one program.

  Jitted: eager initialisation runs op by op and takes seconds. With several
  processes a key must be a global array, hence the output shardings.
  """
  replicated = sharding_lib.replicated(mesh)
  if restored is not None:
    return restored[1], _run_once(
        config, "dropout_rng", lambda: _run_rngs(config)[1], replicated)
  leaves, dropout_rng = _run_once(
      config, "initial_state", initial,
      (jax.tree.leaves(state_shardings), replicated))
  # Built on the structure of ``state_shardings`` (see _fresh_state).
  return jax.tree.unflatten(jax.tree.structure(state_shardings),
                            leaves), dropout_rng


# The XLA options of a program that runs once: optimization level 1 of the
# backend (LLVM) instead of the default 2. The initial state is thousands of
# lines of random-number generation (threefry for every parameter array); at
# level 1 it compiles in about half the time (docs/performance.md) into bitwise
# the same parameters (tests/test_train.py), and running it once takes
# milliseconds either way. Level 0 would be quicker still but changes the
# normal draws in the last bits.
RUN_ONCE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


# The XLA:CPU fusion option of the train step: its matrix products become
# YNNPACK fusions that take in the additions that follow them (a bias, a
# residual), rather than XLA's default of a library call per product. The
# same numbers, bitwise (the state after 30 steps of the default, `deep`,
# `wide` and `spell` configs; tests/test_train.py checks `tiny`), in a step
# 4-6% faster on 2 CPU cores (`spell` 0.5%; docs/performance.md). Not for
# the evaluation program, whose forward pass it made slower.
STEP_FUSION_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type":
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"}


# The train step's XLA:CPU options: the fusion option above, at backend
# optimization level 1 (LLVM's, as for the initial state above and the
# evaluation program below). The step compiles with 13-22% less CPU time
# (3.0-3.2 -> 2.5-2.6 s for the default model in one process) and runs as
# fast, so a cold run trains about 0.3 s sooner
# (docs/performance.md, "The train step at optimization level 1"). Not
# bitwise the level-2 program: the gradients are, but the global norm's
# sums of squares can round differently in the last bit, and gradient
# clipping then moves the run's later steps (the default config from step
# 180 of 500 on; trained to the same test exact match, 1.0000).
STEP_COMPILER_OPTIONS = {**STEP_FUSION_OPTIONS,
                         "xla_backend_optimization_level": 1}


# The XLA:CPU option of the evaluation program: optimization level 1 of the
# backend, as for a program that runs once. It compiles with about a fifth
# less CPU time (0.60-0.65 -> 0.46-0.51 s for the default model; it compiles
# while the first steps run, on their cores) into bitwise the same metric
# sums (the default, tiny, sort, histogram, spell, wide, deep, deep8,
# bfloat16, post-norm and sinusoidal configs, and the default model trained;
# tests/test_train.py checks tiny), which it computes as fast
# (docs/performance.md, "The initial state's random numbers on the host").
EVAL_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def _on_cpu(options: dict[str, Any]) -> dict[str, Any] | None:
  """``options`` (XLA:CPU's) where they apply: on a CPU backend, unless
  ``jax_disable_most_optimizations`` already asks for less (as the tests
  do); else None."""
  if (jax.config.read("jax_disable_most_optimizations")
      or jax.default_backend() != "cpu"):
    return None
  return options


def eval_compiler_options() -> dict[str, int] | None:
  """:data:`EVAL_COMPILER_OPTIONS` where they apply (:func:`_on_cpu`)."""
  return _on_cpu(EVAL_COMPILER_OPTIONS)


def step_compiler_options() -> dict[str, Any] | None:
  """:data:`STEP_COMPILER_OPTIONS` where they apply (:func:`_on_cpu`)."""
  return _on_cpu(STEP_COMPILER_OPTIONS)


# Whether an error is XLA refusing a compiler option
# (executables.compile_or_load then compiles without it, as the oracle's
# streamed program does): one test for every program with options of its own.
unknown_compiler_option = executables.unknown_compiler_option


def _run_once(config: ml_collections.ConfigDict, name: str,
              fn: Callable[[], Any], out_shardings: Any) -> Any:
  """``fn()`` (no arguments; program ``name`` of ``config``), jitted onto
  ``out_shardings`` and compiled with ``RUN_ONCE_COMPILER_OPTIONS`` (unless
  ``jax_disable_most_optimizations`` already asks for less, as the tests
  do), or its outputs as :mod:`mha.executables` kept them
  (``executables.run_or_load``)."""
  options = (None if jax.config.read("jax_disable_most_optimizations")
             else RUN_ONCE_COMPILER_OPTIONS)
  return executables.run_or_load(
      name, jax.jit(fn, out_shardings=out_shardings),
      parts=_store_parts(config), out_shardings=out_shardings,
      compiler_options=options)


def _rng_impl() -> Any:
  """The PRNG implementation of a run's initial state: JAX's threefry2x32
  with its hashes on the host (:mod:`mha.host_prng`, bitwise the same keys
  and bits) where XLA would compile each hash as a loop of its own: JAX's
  default implementation threefry2x32, on a single CPU device (with several,
  the host's outputs would be moved from the first to the others). Else
  None: JAX's default."""
  if (jax.config.jax_default_prng_impl == "threefry2x32"
      and jax.default_backend() == "cpu" and jax.device_count() == 1):
    return host_prng.impl()
  return None


def _run_rngs(config: ml_collections.ConfigDict) -> tuple[Array, Array]:
  """``build.run_rngs(config)``, the keys made with :func:`_rng_impl`: the
  parameters' key in it, the dropout key as JAX's default implementation's
  (the same bits either way)."""
  impl = _rng_impl()
  init_rng, dropout_rng = build.run_rngs(config, impl=impl)
  if impl is not None:
    dropout_rng = host_prng.as_threefry(dropout_rng)
  return init_rng, dropout_rng


def _checked_workdir(config: ml_collections.ConfigDict,
                     workdir: str | os.PathLike) -> str:
  """The absolute workdir, once the config, the devices and the workdir
  (another run's?) are checked; raises ``ConfigError`` otherwise."""
  config_validation.validate_config(config)
  config_validation.validate_devices(config, jax.device_count())
  config_validation.check_workdir(workdir)  # "" too, before abspath's cwd
  workdir = os.path.abspath(os.path.expanduser(os.fspath(workdir)))
  saved = ckpt_lib.saved_config(workdir)
  if saved is not None:
    config_validation.check_resume(saved, config, workdir)
  return workdir


def _write_run_header(run: _Run, state: TrainState) -> None:
  """``config.json`` (process 0, unless it holds this config already); at
  step 0 also the config as TensorBoard text and a line saying what trains
  where."""
  config = run.config
  if sharding_lib.is_main_process():
    path, text = (os.path.join(run.workdir, "config.json"),
                  ckpt_lib.config_to_json(config) + "\n")
    try:
      with open(path, encoding="utf-8") as f:
        unchanged = f.read() == text
    except OSError:
      unchanged = False
    if not unchanged:  # A resumed run leaves an unchanged config as it was.
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
  if int(state.step) == 0:
    run.writer.write_text(0, "config", f"```\n{config}\n```")
    num_params = sum(p.size for p in jax.tree.leaves(state.params))
    run.log(f"Training {config.task}: {num_params:,} parameters, "
            f"{config.num_train_steps} steps of batch {config.batch_size} on "
            f"{_describe_devices(run.mesh)}; workdir {run.workdir}")


def _log(message: str) -> None:
  """Prints ``message`` once: on process 0."""
  if sharding_lib.is_main_process():
    print(message, flush=True)


def _describe_devices(mesh: Mesh) -> str:
  devices = mesh.devices.flat
  kinds = sorted({d.device_kind for d in devices})
  processes = jax.process_count()
  return (f"{mesh.devices.size} {'/'.join(kinds)} device"
          f"{'s' if mesh.devices.size > 1 else ''}"
          + (f" in {processes} processes" if processes > 1 else ""))


def _load_splits(config: ml_collections.ConfigDict) -> _Splits:
  """The data, prepared (with several processes, by process 0 first) and
  then read on a background thread (:class:`_Splits`)."""
  spec = build.data_spec(config)

  def sources():
    try:
      return data.data_sources(spec, config.data.data_dir)
    except ValueError as e:  # e.g. too few distinct sequences for the splits
      raise config_validation.ConfigError(f"data: {e}") from e

  if jax.process_count() == 1:
    return _Splits(sources(), spec)
  prepared = sources() if sharding_lib.is_main_process() else None
  multihost_utils.sync_global_devices("mha: data prepared")
  return _Splits(sources() if prepared is None else prepared, spec)


class _Splits(Mapping[str, data.Split]):
  """A run's splits, read into memory (``mha.data.read_split``) one after the
  other on a background thread, train first, from the moment this is made.

  Reading the 22,000 examples of the default data takes about 0.2 s, much
  of it outside Python (ArrayRecord's readers, numpy); meanwhile the
  programs are traced and loaded. A split asked for waits for its reading,
  and an error in it is raised there.
  """

  def __init__(self, sources: Mapping[str, Any], spec: data.DataSpec):
    reader = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="mha-read-splits")
    self._splits = {name: reader.submit(data.read_split, source, spec)
                    for name, source in sources.items()}
    reader.shutdown(wait=False)  # Its thread ends once all are read.

  def __getitem__(self, name: str) -> data.Split:
    return self._splits[name].result()

  def __iter__(self) -> Iterator[str]:
    return iter(self._splits)

  def __len__(self) -> int:
    return len(self._splits)


def process_train_batch(split: data.Split, config: ml_collections.ConfigDict,
                        step: int, rows: slice) -> dict[str, np.ndarray]:
  """Rows ``rows`` of the global batch of ``step`` (0-based), built alone.

  The batches are consecutive windows of one order of the examples
  (:func:`mha.data.train_batch`), so with ``b`` rows a process and ``B`` in
  the global batch, these rows are batch ``step * B / b + rows.start / b`` of
  size ``b``: bitwise the same rows, without building the others'.
  """
  size = rows.stop - rows.start
  if config.batch_size % size or rows.start % size:
    raise ValueError(f"rows {rows.start}:{rows.stop} are not a block of a "
                     f"batch of {config.batch_size}")
  return data.train_batch(
      split, seed=config.seed,
      step=step * (config.batch_size // size) + rows.start // size,
      batch_size=size)


def _agreed_signal(signum: int | None) -> int | None:
  """The signal that stops the run: with several processes, one any process
  received (they must all stop, and save, at the same step)."""
  if jax.process_count() == 1:
    return signum
  received = multihost_utils.process_allgather(np.int32(signum or 0))
  return next((int(s) for s in np.ravel(received) if s), None)


def _describe_latest(checkpoints: ckpt_lib.TrainCheckpoints) -> str:
  step = checkpoints.latest_step()
  return "none" if step is None else f"step {step} in {checkpoints.directory}"


class _Progress:
  """Train metrics of a logging window: checked, summed, logged (and timed,
  for steps/s) as they are fetched from the device."""

  def __init__(self, run: _Run, step: int):
    self._run = run
    self._window = _TrainMetrics()
    self.restart(step)

  def restart(self, step: int, now: float | None = None) -> None:
    """Restarts the steps/s clock at ``step`` (after an evaluation or a
    save: steps/s measures training), at ``now`` (default: the time)."""
    self._start = time.time() if now is None else now
    self._step = step

  def record(self, first: int, num_steps: int,
             metrics: Mapping[str, Array]) -> None:
    """Fetches the metrics of a call of the train program (steps ``first``
    on, ``num_steps`` of them, stacked on the device), checks each step's in
    order, and writes a summary every ``log_every_steps`` and at the last
    step.

    A logging window is timed from the fetch of the call that ended the one
    before to the fetch of its own last call: the moments the host sees the
    device's progress (a call ends at most at one logging step). Timing the
    window after the host's work on the one before would leave out the steps
    the device ran meanwhile (a tiny model's window of 5 steps once logged
    24,000 steps/s that way).

    Raises:
      FloatingPointError: a non-finite loss or gradient norm (the first
        step's that has one).
    """
    fetched = jax.device_get(metrics)
    now = time.time()
    for i in range(num_steps):
      self._add(first + i, {key: rows[i] for key, rows in fetched.items()},
                now)

  def _add(self, step: int, metrics: Mapping[str, np.ndarray],
           now: float) -> None:
    _check_finite(step, metrics)
    self._window.add(metrics)
    config = self._run.config
    total = config.num_train_steps
    if step % config.log_every_steps == 0 or step == total:
      rate = (step - self._step) / max(now - self._start, 1e-9)
      summary = self._window.summary()
      self._run.writer.write_scalars(step,
                                     {**summary, "steps_per_sec": rate})
      self._run.log(_log_line(step, total, summary, rate,
                              now - self._run.start_time))
      self._window.reset()
      self.restart(step, now)


# Config keys that configure a run but not its train and evaluation
# programs: the executable store's key of those two programs leaves them out,
# so a run with another seed or cadence loads them whole. Not of the initial
# state's (the seed is baked into it). tests/test_startup.py lowers both
# programs with every one of these changed and finds the same text.
RUN_ONLY_KEYS = ("seed", "log_every_steps", "eval_every_steps",
                 "checkpoint_every_steps", "max_checkpoints_to_keep",
                 "compilation_cache_dir", "init_from", "data.data_dir")


def _store_parts(config: ml_collections.ConfigDict, *,
                 without: tuple[str, ...] = ()) -> dict[str, str]:
  """What the executable store's key needs of ``config``: all of it as JSON,
  less the keys ``without`` (dotted paths)."""
  values = config.to_dict()
  for path in without:
    *parents, leaf = path.split(".")
    node = values
    for parent in parents:
      node = node.get(parent, {})
    node.pop(leaf, None)
  return {"config": json.dumps(values, sort_keys=True, default=repr)}


def train_step_program(config: ml_collections.ConfigDict, model: Transformer,
                       mesh: Mesh, state_shardings: Any, state: Any
                       ) -> tuple[Any, tuple[Any, ...]]:
  """``(jitted, args)``: the run's train program, :func:`train_steps` for a
  block of :data:`STEPS_PER_CALL` batches, jitted for the run's shardings
  (state donated) on the state's leaves, a flat list in and out (a stored
  executable's argument tree must be serializable, and the state's holds its
  optimizer), and its arguments' types as the calls will see them,
  shardings included: ``(leaves, batches, num_steps, rng)``. ``state``: the
  first call's, or its ``jax.eval_shape``."""
  replicated = sharding_lib.replicated(mesh)
  state_tree = jax.tree.structure(state)
  steps = functools.partial(train_steps, model=model,
                            schedule=build.learning_rate_schedule(config))

  def train_steps_on_leaves(leaves, batches, num_steps, rng):
    new_state, metrics = steps(jax.tree.unflatten(state_tree, leaves),
                               batches, num_steps, rng)
    return jax.tree.leaves(new_state), metrics

  leaf_shardings = jax.tree.leaves(state_shardings)
  block_sharding = sharding_lib.block_sharding(mesh)
  jitted = jax.jit(
      train_steps_on_leaves,
      in_shardings=(leaf_shardings, block_sharding, replicated, replicated),
      out_shardings=(leaf_shardings, replicated),
      donate_argnums=0)
  tokens = _laid_out(jax.ShapeDtypeStruct(
      (STEPS_PER_CALL, config.batch_size, config.data.max_len), jnp.int32),
                     block_sharding)
  args = (list(map(_laid_out, jax.tree.leaves(state), leaf_shardings)),
          {"inputs": tokens, "targets": tokens},
          _laid_out(jax.ShapeDtypeStruct((), jnp.int32), replicated),
          _laid_out(jax.eval_shape(lambda: jax.random.key(0)), replicated))
  return jitted, args


def eval_step_program(config: ml_collections.ConfigDict, model: Transformer,
                      mesh: Mesh, state_shardings: Any, abstract_state: Any
                      ) -> tuple[Any, tuple[Any, ...]]:
  """``(jitted, args)``: ``mha.evaluate.eval_step`` and its arguments' types
  for the run's eval batches (of validation and test, each of
  ``data.num_eval_examples``: ``mha.sharding.eval_batch_rows``) and
  parameter shardings."""
  params = jax.tree.map(_laid_out, abstract_state.params,
                        state_shardings.params)
  rows = sharding_lib.eval_batch_rows(
      config.eval_batch_size, config.data.num_eval_examples, mesh)
  tokens = jax.ShapeDtypeStruct((rows, config.data.max_len), jnp.int32,
                                sharding=sharding_lib.batch_sharding(mesh))
  return eval_lib.eval_step, (model, params,
                              {"inputs": tokens, "targets": tokens})


def _laid_out(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                              weak_type=x.weak_type)


class _StepFunction:
  """The train program (:func:`train_step_program`), compiled on a
  background thread from the moment it is made.

  XLA compiles without holding the GIL, so on a machine with a second core
  the compilation overlaps with what the run does meanwhile (opening the
  checkpoints, compiling and running the initial state); the first call waits
  for it, then finds the program compiled (or loaded from the persistent
  cache, or loaded whole from :mod:`mha.executables`, untraced).
  """

  def __init__(self, config: ml_collections.ConfigDict, model: Transformer,
               mesh: Mesh, state_shardings: Any, state: Any):
    """``state``: the state of the first call, or its ``jax.eval_shape``."""
    self._state_tree = jax.tree.structure(state)
    self._jitted, args = train_step_program(config, model, mesh,
                                            state_shardings, state)
    self._compiled = None
    self._compiling = threading.Thread(
        target=self._compile, args=(config, args),
        name="mha-compile-train-step", daemon=True)
    self._compiling.start()

  def _compile(self, config: ml_collections.ConfigDict, args: Any) -> None:
    try:
      # Without the options where this jaxlib does not know them.
      self._compiled = executables.compile_or_load(
          "train_step", self._jitted, args,
          parts=_store_parts(config, without=RUN_ONLY_KEYS),
          compiler_options=step_compiler_options())
    except Exception:  # pylint: disable=broad-except
      pass  # The first call compiles again and raises it where it belongs.

  def wait(self) -> None:
    """Returns once the background compilation is over."""
    self._compiling.join()

  def __call__(self, state: TrainState, batches: Mapping[str, Array],
               num_steps: int, rng: Array
               ) -> tuple[TrainState, dict[str, Array]]:
    """:func:`train_steps` of ``num_steps`` steps on ``batches``."""
    self.wait()
    leaves, metrics = (self._compiled or self._jitted)(
        jax.tree.leaves(state), batches, np.int32(num_steps), rng)
    return jax.tree.unflatten(self._state_tree, leaves), metrics


class _EvaluationProgram:
  """The evaluation program (:func:`eval_step_program`), compiled (with
  :func:`eval_compiler_options`) on a background thread once ``after()``
  returns, or loaded whole from :mod:`mha.executables`.

  A run used to compile it at its first validation, with every step waiting;
  this way the first steps run meanwhile and the first validation finds it
  compiled. A failure is left to the first evaluation, which compiles again
  (through ``eval_step`` itself) and raises it where it belongs.
  """

  def __init__(self, config: ml_collections.ConfigDict, model: Transformer,
               mesh: Mesh, state_shardings: Any, abstract_state: Any, *,
               after: Callable[[], None]):
    jitted, args = eval_step_program(config, model, mesh, state_shardings,
                                     abstract_state)
    self._compiled = None

    def compile_it():
      after()
      try:
        self._compiled = executables.compile_or_load(
            "eval_step", jitted, args,
            parts=_store_parts(config, without=RUN_ONLY_KEYS),
            compiler_options=eval_compiler_options())
      except Exception:  # pylint: disable=broad-except
        pass

    self._thread = threading.Thread(target=compile_it, daemon=True,
                                    name="mha-compile-evaluation")
    self._thread.start()

  def join(self) -> None:
    """Returns once the background compilation is over."""
    self._thread.join()

  def compiled(self) -> Callable[..., Any] | None:
    """The program, ``(params, batch) -> metric sums``, once compiled; None
    if that failed."""
    self.join()
    return self._compiled


def _calls(config: ml_collections.ConfigDict, done: int) -> Iterator[int]:
  """The steps of each call of the train program after step ``done``: one
  first (start-up is reported once it is done), then up to the next
  logging, evaluation or checkpoint step or the last, at most
  :data:`STEPS_PER_CALL`."""
  steps = 1
  while done < config.num_train_steps:
    yield steps
    done += steps
    steps = min(STEPS_PER_CALL, config.num_train_steps - done)
    for every in (config.log_every_steps, config.eval_every_steps,
                  config.checkpoint_every_steps):
      steps = min(steps, every - done % every)


def _host_block(split: data.Split, config: ml_collections.ConfigDict,
                first: int, num_steps: int, rows: slice
                ) -> dict[str, np.ndarray]:
  """Rows ``rows`` of the batches of steps ``first`` to ``first + num_steps
  - 1`` (0-based; :func:`process_train_batch`), as a block of
  :data:`STEPS_PER_CALL` batches (the ones after them zero: a call does not
  use them)."""
  if not 1 <= num_steps <= STEPS_PER_CALL:
    raise ValueError(f"a block holds 1 to {STEPS_PER_CALL} steps' batches, "
                     f"not {num_steps}")
  block = None
  for i in range(num_steps):
    batch = process_train_batch(split, config, first + i, rows)
    if block is None:
      block = {key: np.zeros((STEPS_PER_CALL, *value.shape), value.dtype)
               for key, value in batch.items()}
    for key, value in batch.items():
      block[key][i] = value
  return block


def _train_loop(run: _Run, state: TrainState) -> TrainState:
  """Steps from ``state.step`` to ``num_train_steps``, evaluating, logging and
  saving on the way; returns the final state (its checkpoint saved)."""
  config = run.config
  step_fn = run.step
  block_sharding = sharding_lib.block_sharding(run.mesh)
  rows = sharding_lib.process_rows(sharding_lib.batch_sharding(run.mesh),
                                   config.batch_size)
  total = config.num_train_steps
  done = int(state.step)
  progress = _Progress(run, done)
  # (first step, steps, metrics on the device) of the call before the
  # newest, not yet fetched: a call's metrics are fetched once the next call
  # is dispatched (so that the host does not wait on the device, nor leaves
  # it idle), and before every evaluation and save.
  unfetched = None
  for call, num_steps in enumerate(_calls(config, done)):
    batches = sharding_lib.global_batch(
        _host_block(run.splits["train"], config, done, num_steps, rows),
        block_sharding, config.batch_size)
    state, metrics = step_fn(state, batches, num_steps, run.dropout_rng)
    if call == 0:
      _report_startup(run, done + 1, metrics)
    if unfetched is not None:
      progress.record(*unfetched)  # waits for that call, the newest runs on
    unfetched = (done + 1, num_steps, metrics)
    done += num_steps

    # Read after that wait: a signal stops the run once the call running
    # then has ended.
    signum = _agreed_signal(run.stop.signum)
    do_eval = done % config.eval_every_steps == 0 or done == total
    do_save = (done % config.checkpoint_every_steps == 0 or done == total
               or signum is not None)
    if do_eval or do_save:
      # Never evaluate or checkpoint before the finiteness check of this step.
      progress.record(*unfetched)
      unfetched = None
      _evaluate_and_save(run, state, done, do_eval, do_save, signum)
      progress.restart(done)
  # The last step always evaluates and saves, so nothing is left unfetched.
  return state


def _report_startup(run: _Run, step: int, metrics: Mapping[str, Array]
                    ) -> None:
  """Once the first step of this call is done: how long that took, from the
  process's start and from the call, and what was compiled on the way
  (``startup/*`` scalars at ``step``, and a line)."""
  jax.block_until_ready(metrics)
  now = time.time()
  run.collector_pause.end()
  since_process = now - metric_writers.process_start_time()
  compiles = compilation_cache.counts() - run.compiles_at_start
  run.writer.write_scalars(step, {
      "startup/seconds_since_process_start": since_process,
      "startup/seconds_since_call": now - run.start_time,
      "startup/programs_compiled": compiles.programs,
      "startup/programs_from_cache": compiles.cache_hits,
      "startup/programs_loaded_whole": compiles.executables})
  run.log(f"First step done {since_process:.1f}s after the process started, "
          f"{now - run.start_time:.1f}s after train_and_evaluate was called; "
          f"compiled so far: {compiles}")


def _evaluate_and_save(run: _Run, state: TrainState, step: int, do_eval: bool,
                       do_save: bool, signum: int | None) -> None:
  """What happens after step ``step`` besides training: validation, a
  checkpoint, and stopping on a signal (``TrainingInterrupted``)."""
  if do_eval and signum is None:
    run.evaluate(state.params, "validation", step)
  if do_save:  # The step's metrics, its state's finiteness too, are checked.
    run.checkpoints.save(step, state, run.config)
  if signum is not None:
    run.checkpoints.verify()
    raise TrainingInterrupted(signum, step, run.checkpoints.step_path(step))
