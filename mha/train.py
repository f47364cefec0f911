"""Training and evaluation: ``train_and_evaluate(config, workdir)``.

The loop of the Flax examples: one jitted, buffer-donating train step,
batches a pure function of ``(seed, step)``, metrics fetched one step late
so that the device never waits for Python, orbax checkpoints of the whole
train state (a run resumed from its workdir ends with bitwise the parameters
of an uninterrupted one, on CPU).

Metrics go to the console (a progress line with steps/s and ETA), TensorBoard
event files and ``workdir/metrics.jsonl``, whose first row of each start
records what produced the run (``mha.run.provenance``). At the end of the
first step a line and ``startup/*`` scalars say how long start-up took and
how many programs were compiled (or loaded from JAX's persistent compilation
cache, ``mha.run.compilation_cache``).

A run never loses more than the steps since its last checkpoint and never
mixes with another: the config is checked before anything is compiled or
written (``mha.run.config_validation``), a workdir is only resumed with a
config that differs in ``RESUMABLE_KEYS`` and held by one run at a time
(``mha.run.workdir_lock``), SIGTERM/SIGINT stop once the steps under way
are done (at most two) with a checkpoint of the last step,
damaged checkpoints are set aside (``mha.checkpoint``), a non-finite loss,
gradient or parameter stops the run before it is saved, and a full disk or a
read-only one stops it naming the intact checkpoints
(``mha.run.write_failures``).

Every device trains (``mha.run.sharding``): each batch is split along the
``data`` axis of a mesh over all devices, the train state is replicated (or,
with ``config.mesh.shard_params``, split too). Launched as several processes
(``jax.distributed``), each process builds only its rows of each batch;
process 0 alone prints and writes ``config.json``, ``metrics.jsonl`` and the
event files; all take part in the checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from mha import build
from mha import checkpoint as ckpt_lib
from mha import data
from mha import evaluate as eval_lib
from mha import finetune
from mha.aliases import Array
from mha.model import Transformer
from mha.run import compilation_cache
from mha.run import config_validation
from mha.run import interrupt
from mha.run import kill_points
from mha.run import metric_writers
from mha.run import provenance
from mha.run import sharding as sharding_lib
from mha.run import workdir_lock
from mha.run import write_failures
from mha.run.metric_writers import MetricWriter, format_duration

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
    sums = eval_lib.batch_metric_sums(logits, batch)
    return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  new_state = state.apply_gradients(grads=grads)
  finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_state)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  metrics = dict(sums, grad_norm=optax.tree.norm(grads),
                 learning_rate=schedule(state.step),
                 state_finite=jnp.all(jnp.stack(finite)))
  return new_state, metrics


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
# Signals.
# --------------------------------------------------------------------------


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
  """Turns SIGTERM and SIGINT into a request to stop once the steps under
  way are done (two at most: the one running and the one queued behind
  it).

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


def _agreed_signal(signum: int | None) -> int | None:
  """The signal that stops the run: with several processes, one any process
  received (they must all stop, and save, at the same step)."""
  if jax.process_count() == 1:
    return signum
  received = multihost_utils.process_allgather(np.int32(signum or 0))
  return next((int(s) for s in np.ravel(received) if s), None)


# --------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Run:
  """What every part of a training run works with, built once by
  :func:`train_and_evaluate` (instead of a dozen parameters passed on)."""

  config: ml_collections.ConfigDict
  workdir: str
  model: Transformer
  splits: Mapping[str, data.Split]
  mesh: Mesh
  dropout_rng: Array
  train_program: Any  # jitted train_step, state donated
  checkpoints: ckpt_lib.TrainCheckpoints
  writer: MetricWriter | metric_writers.NoWriter
  stop: _StopRequest
  start_time: float  # time.time() when train_and_evaluate was called
  compiles_at_start: compilation_cache.CompileCounts

  def log(self, message: str) -> None:
    """Prints ``message`` once: on process 0."""
    _log(message)

  def evaluate(self, params: Any, name: str, step: int) -> dict[str, float]:
    """Evaluates on split ``name`` and writes (and prints) the metrics."""
    metrics = eval_lib.evaluate(self.model, params, self.splits[name],
                                self.config.eval_batch_size, mesh=self.mesh)
    if self.config.task in data.LANGUAGE_MODEL_TASKS:
      metrics["bits_per_char"] = data.bits_per_char(metrics["loss"])
    self.writer.write_scalars(step,
                              {f"{name}/{k}": v for k, v in metrics.items()})
    self.log(f"{name} @ step {step}: loss {metrics['loss']:.4f} | "
             f"tok_acc {metrics['token_accuracy']:.4f} | "
             f"exact {metrics['exact_match']:.4f} "
             + (f"| {metrics['bits_per_char']:.4f} bits/char "
                if "bits_per_char" in metrics else "") +
             f"({format_duration(time.time() - self.start_time)} since start)")
    return metrics


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike, *,
                       restart_from_scratch: bool = False) -> TrainState:
  """Trains ``config`` in ``workdir``, resuming from its newest checkpoint.

  Evaluates on validation every ``eval_every_steps`` and on test at the end;
  saves checkpoints every ``checkpoint_every_steps`` and at the end. Trains on
  every device (every process's, after ``jax.distributed`` initialisation);
  the newest checkpoint resumes whatever the device count it was saved with.

  Before anything is compiled or written, the config is validated (also
  against the devices: ``batch_size`` must split across them) and, if
  ``workdir`` holds a run, compared with that run's config: only
  ``config_validation.RESUMABLE_KEYS`` may differ. SIGTERM and SIGINT stop
  the run once the steps under way are done, with a checkpoint of the last
  step.

  A workdir whose checkpoints are all damaged (set aside in
  ``workdir/damaged_checkpoints/``) is not silently trained from step 0:
  that takes ``restart_from_scratch`` (which deletes nothing; it is refused
  while an intact checkpoint is left). Resumed from step ``s``, the run
  drops the metric rows of steps after ``s`` (it writes them again).

  Returns:
    The final train state.

  Raises:
    ConfigError: a bad config or workdir, or another run's workdir
      (``WorkdirLockedError``: one that another run is training in); no
      intact checkpoint left and no ``restart_from_scratch``
      (``NoIntactCheckpointError``), or ``restart_from_scratch`` with one.
    WriteFailure: a checkpoint, metrics or event-file write failed for want
      of space or permission (the message names the intact checkpoints).
    TrainingInterrupted: after SIGTERM or SIGINT (the checkpoint is saved).
    FloatingPointError: a non-finite loss, gradient or parameter; no
      checkpoint of it is written.
    DamagedCheckpointError: a save that cannot be read back.
  """
  start_time = time.time()
  compiles_at_start = compilation_cache.counts()
  with contextlib.ExitStack() as cleanup:
    config = finetune.resolve_config(config, workdir)  # init_from's model
    workdir = _checked_workdir(config, workdir)
    splits = _load_splits(config)
    model = build.make_model(config)
    mesh = sharding_lib.make_mesh(config.mesh.data)
    # One optimizer object: the states' trees (and their shardings') match.
    fresh_state = functools.partial(build.create_train_state, config, model,
                                    tx=build.make_optimizer(config))
    abstract_state = jax.eval_shape(
        lambda: fresh_state(build.run_rngs(config)[0]))
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
    ckpt_lib.check_restart(checkpoints, restored, restart_from_scratch,
                           log=_log)
    replicated = sharding_lib.replicated(mesh)
    # Jitted (eager initialisation runs op by op and takes seconds), onto
    # the run's shardings (with several processes a key must be global).
    dropout_rng = jax.jit(lambda: build.run_rngs(config)[1],
                          out_shardings=replicated)()
    if restored is None:
      state = jax.jit(lambda: fresh_state(build.run_rngs(config)[0]),
                      out_shardings=state_shardings)()
      if config.init_from is not None:
        state = finetune.initial_state(config, state, state_shardings)
    else:
      state = restored[1]
      _log(f"Resumed from checkpoint at step {restored[0]} in {workdir}")
    main_process = sharding_lib.is_main_process()
    run = _Run(
        config=config, workdir=workdir, model=model, splits=splits,
        mesh=mesh, dropout_rng=dropout_rng,
        train_program=_train_program(config, model, mesh, state_shardings),
        checkpoints=checkpoints,
        writer=cleanup.enter_context(contextlib.closing(
            MetricWriter(workdir, purge_step=int(state.step) + 1)
            if main_process else metric_writers.NoWriter())),
        stop=cleanup.enter_context(_StopRequest()), start_time=start_time,
        compiles_at_start=compiles_at_start)
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


def _train_program(config: ml_collections.ConfigDict, model: Transformer,
                   mesh: Mesh, state_shardings: Any) -> Any:
  """:func:`train_step` jitted for the run's shardings, the state donated:
  ``(state, batch, rng) -> (state, metrics)``."""
  replicated = sharding_lib.replicated(mesh)
  step = functools.partial(train_step, model=model,
                           schedule=build.learning_rate_schedule(config))
  return jax.jit(
      step,
      in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh),
                    replicated),
      out_shardings=(state_shardings, replicated),
      donate_argnums=0)


def _has_test_metrics(workdir: str, step: int) -> bool:
  """Whether ``workdir/metrics.jsonl`` holds the test metrics of ``step``."""
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError):
    return False
  return any(row.get("step") == step and "test/loss" in row for row in rows)


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
  try:
    data.check_corpus(config.task, workdir)
  except data.CorpusChangedError as e:
    raise config_validation.ConfigError(str(e)) from None
  return workdir


def _write_run_header(run: _Run, state: TrainState) -> None:
  """``config.json`` (process 0, unless it holds this config already) and
  the provenance row of ``metrics.jsonl``; at step 0 also the config as
  TensorBoard text and a line saying what trains where."""
  config = run.config
  step = int(state.step)
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
    data.write_corpus_record(config.task, run.workdir)
  if step < config.num_train_steps:
    run.writer.write_header(step, provenance.environment())
  if step == 0:
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


def _load_splits(config: ml_collections.ConfigDict) -> dict[str, data.Split]:
  """The run's splits, in memory (with several processes, prepared by
  process 0 first)."""
  spec = build.data_spec(config)

  def sources():
    try:
      return data.data_sources(spec, config.data.data_dir)
    except ValueError as e:  # e.g. too few distinct sequences for the splits
      raise config_validation.ConfigError(f"data: {e}") from e

  if jax.process_count() == 1:
    prepared = sources()
  else:
    prepared = sources() if sharding_lib.is_main_process() else None
    multihost_utils.sync_global_devices("mha: data prepared")
    prepared = sources() if prepared is None else prepared
  return {name: data.read_split(source, spec)
          for name, source in prepared.items()}


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


def _describe_latest(checkpoints: ckpt_lib.TrainCheckpoints) -> str:
  step = checkpoints.latest_step()
  return "none" if step is None else f"step {step} in {checkpoints.directory}"


# --------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------


def _train_loop(run: _Run, state: TrainState) -> TrainState:
  """Steps from ``state.step`` to ``num_train_steps``, evaluating, logging and
  saving on the way; returns the final state (its checkpoint saved)."""
  config = run.config
  batch_sharding = sharding_lib.batch_sharding(run.mesh)
  rows = sharding_lib.process_rows(batch_sharding, config.batch_size)
  total = config.num_train_steps
  first = int(state.step)
  progress = _Progress(run, first)
  # (step, metrics on the device) of the step before the newest, not yet
  # fetched: a step's metrics are fetched once the next step is dispatched
  # (the host does not wait on the device, nor leaves it idle), and before
  # every evaluation and save.
  unfetched = None
  for step in range(first + 1, total + 1):
    batch = sharding_lib.global_batch(
        process_train_batch(run.splits["train"], config, step - 1, rows),
        batch_sharding, config.batch_size)
    state, metrics = run.train_program(state, batch, run.dropout_rng)
    if step == first + 1:
      _report_startup(run, step, metrics)
    kill_points.reached(step, "after_step")
    if unfetched is not None:
      progress.record(*unfetched)  # waits for that step, the newest runs on
    unfetched = (step, metrics)
    interrupt.reached("train")  # A test's signal while steps run.

    # Read after that wait: a signal stops the run once the step running
    # then has ended.
    signum = _agreed_signal(run.stop.signum)
    do_eval = step % config.eval_every_steps == 0 or step == total
    do_save = (step % config.checkpoint_every_steps == 0 or step == total
               or signum is not None)
    if do_eval or do_save:
      # Never evaluate or checkpoint before the finiteness check of this step.
      progress.record(*unfetched)
      unfetched = None
      _evaluate_and_save(run, state, step, do_eval, do_save, signum)
      progress.restart(step)
  # The last step always evaluates and saves, so nothing is left unfetched.
  return state


def _report_startup(run: _Run, step: int, metrics: Mapping[str, Array]
                    ) -> None:
  """Once the run's first step is done: how long that took, from the
  process's start and from train_and_evaluate's call, and what was compiled
  on the way (``startup/*`` scalars at ``step``, and a line)."""
  jax.block_until_ready(metrics)
  now = time.time()
  since_process = now - metric_writers.process_start_time()
  compiles = compilation_cache.counts() - run.compiles_at_start
  run.writer.write_scalars(step, {
      "startup/seconds_since_process_start": since_process,
      "startup/seconds_since_call": now - run.start_time,
      "startup/programs_compiled": compiles.programs,
      "startup/programs_from_cache": compiles.cache_hits})
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


def _log_line(step: int, total: int, metrics: Mapping[str, float],
              steps_per_sec: float, elapsed: float) -> str:
  eta = (total - step) / steps_per_sec if steps_per_sec > 0 else 0.0
  return (f"step {step:>{len(str(total))}}/{total} | "
          f"loss {metrics['loss']:.4f} | tok_acc {metrics['token_accuracy']:.4f}"
          f" | exact {metrics['exact_match']:.4f} | "
          f"{steps_per_sec:.1f} steps/s | {format_duration(elapsed)} elapsed, "
          f"ETA {format_duration(eta)}")


class _Progress:
  """Train metrics of a logging window: checked, summed, logged (and timed,
  for steps/s) as they are fetched from the device."""

  def __init__(self, run: _Run, step: int):
    self._run = run
    self._sums: dict[str, float] = {}
    self._last: dict[str, float] = {}
    self.restart(step)

  def restart(self, step: int, now: float | None = None) -> None:
    """Restarts the steps/s clock at ``step`` (after an evaluation or a
    save: steps/s measures training), at ``now`` (default: the time)."""
    self._start = time.time() if now is None else now
    self._step = step

  def record(self, step: int, metrics: Mapping[str, Array]) -> None:
    """Fetches the metrics of ``step`` from the device, checks them, and
    writes a summary every ``log_every_steps`` and at the last step.

    A logging window is timed from the fetch that ended the one before to
    its own last fetch: the moments the host sees the device's progress.

    Raises:
      FloatingPointError: a non-finite loss, gradient norm or state.
    """
    self._add(step, jax.device_get(metrics), time.time())

  def _add(self, step: int, metrics: Mapping[str, np.ndarray],
           now: float) -> None:
    _check_finite(step, metrics)
    for key in eval_lib.SUM_KEYS:
      self._sums[key] = self._sums.get(key, 0.0) + float(metrics[key])
    self._last = {k: float(metrics[k]) for k in ("grad_norm", "learning_rate")}
    config = self._run.config
    total = config.num_train_steps
    if step % config.log_every_steps == 0 or step == total:
      rate = (step - self._step) / max(now - self._start, 1e-9)
      summary = {**eval_lib.summarize(self._sums), **self._last}
      self._run.writer.write_scalars(step,
                                     {**summary, "steps_per_sec": rate})
      self._run.log(_log_line(step, total, summary, rate,
                              now - self._run.start_time))
      self._sums = {}
      self.restart(step, now)
