"""Training and evaluation: ``train_and_evaluate(config, workdir)``.

One jitted, buffer-donating train step; batches a pure function of
``(seed, step)``; orbax checkpoints of the whole train state, so a run
resumed from its workdir ends with bitwise the parameters of an
uninterrupted one (on CPU). Metrics go to the console (a progress line with
steps/s and ETA), TensorBoard event files and ``workdir/metrics.jsonl``.

A run never loses more than the steps since its last checkpoint and never
mixes with another: the config is checked before anything is compiled or
written (``mha.config_validation``), a workdir is only resumed with a config
that differs in ``RESUMABLE_KEYS``, SIGTERM/SIGINT stop after the current step
with a checkpoint of it, damaged checkpoints are set aside (``mha.checkpoint``)
and a non-finite loss, gradient or parameter stops the run before it is saved.

Every device trains (``mha.sharding``): each batch is split along the ``data``
axis of a mesh over all devices, the train state is replicated (or, with
``config.mesh.shard_params``, split too) and one jitted step runs on all of
them. Launched as several processes (``jax.distributed``), each process builds
only its rows of each batch; process 0 alone prints and writes
``config.json``, ``metrics.jsonl`` and the event files; all take part in the
checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
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
from mha import config_validation
from mha import data
from mha import evaluate as eval_lib
from mha import sharding as sharding_lib
from mha.metric_writers import MetricWriter, format_duration
from mha.model import Transformer

Array = jax.Array
TrainState = build.TrainState


# --------------------------------------------------------------------------
# Steps.
# --------------------------------------------------------------------------


def train_step(state: TrainState, batch: Mapping[str, Array], rng: Array, *,
               model: Transformer,
               schedule: optax.Schedule) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer update; returns the new state and metric sums.

  The dropout rng is ``fold_in(rng, step)``, so a resumed run draws the same
  dropout masks as an uninterrupted one.
  """
  dropout_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    logits, _ = model.apply({"params": params}, batch["inputs"],
                            deterministic=False, return_weights=False,
                            rngs={"dropout": dropout_rng})
    sums = eval_lib.metric_sums(logits, batch["targets"], batch["inputs"])
    return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  metrics = dict(sums, grad_norm=optax.tree.norm(grads),
                 learning_rate=schedule(state.step))
  return state.apply_gradients(grads=grads), metrics


class _TrainMetrics:
  """Host-side accumulator of train metric sums over a logging window."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.sums: dict[str, float] = {}
    self.steps = 0
    self.last: dict[str, float] = {}

  def add(self, metrics: Mapping[str, np.ndarray]):
    for key in ("loss_sum", "correct", "tokens", "exact", "sequences"):
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
  """Turns SIGTERM and SIGINT into a request to stop after the current step.

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
    print(f"Received {signal.Signals(signum).name}: stopping after this step "
          "with a checkpoint (send it again to stop at once)",
          file=sys.stderr, flush=True)

  def __exit__(self, *exc_info) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


@jax.jit
def _all_finite(tree: Any) -> Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves))


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
  the run after the current step, with a checkpoint of it.

  Returns:
    The final train state.

  Raises:
    ConfigError: a bad config or workdir, or another run's workdir.
    TrainingInterrupted: after SIGTERM or SIGINT (the checkpoint is saved).
    FloatingPointError: a non-finite loss, gradient or parameter; no
      checkpoint of it is written.
    DamagedCheckpointError: a save that cannot be read back.
  """
  start_time = time.time()
  config_validation.validate_config(config)
  config_validation.validate_devices(config, jax.device_count())
  workdir = os.path.abspath(os.path.expanduser(os.fspath(workdir)))
  config_validation.check_workdir(workdir)
  saved = ckpt_lib.saved_config(workdir)
  if saved is not None:
    config_validation.check_resume(saved, config, workdir)
  splits = _load_splits(config)
  model = build.make_model(config)
  mesh = sharding_lib.make_mesh(config.mesh.data)
  # Made by jit: with several processes, a key must be a global array.
  init_rng, dropout_rng = jax.jit(
      lambda: tuple(jax.random.split(jax.random.key(config.seed))),
      out_shardings=sharding_lib.replicated(mesh))()
  create = functools.partial(build.create_train_state, config, model)
  abstract_state = jax.eval_shape(create, init_rng)
  state_shardings = sharding_lib.state_shardings(
      abstract_state, mesh, shard_params=config.mesh.shard_params)
  # Jitted: eager initialisation runs op by op and takes seconds.
  init = jax.jit(create, out_shardings=state_shardings)
  main_process = sharding_lib.is_main_process()

  os.makedirs(workdir, exist_ok=True)
  checkpoints = ckpt_lib.TrainCheckpoints(
      workdir, keep=config.max_checkpoints_to_keep,
      abstract_state=sharding_lib.with_shardings(abstract_state,
                                                 state_shardings))
  with contextlib.ExitStack() as cleanup:
    cleanup.callback(checkpoints.close)  # Even on errors: finish the saves.
    restored = checkpoints.restore_latest()
    if restored is None:
      state = init(init_rng)
    else:
      state = restored[1]
      _log(f"Resumed from checkpoint at step {restored[0]} in {workdir}")
    start_step = int(state.step)
    if main_process:
      with open(os.path.join(workdir, "config.json"), "w",
                encoding="utf-8") as f:
        f.write(ckpt_lib.config_to_json(config) + "\n")

    writer = cleanup.enter_context(contextlib.closing(
        MetricWriter(workdir) if main_process else _NoWriter()))
    if start_step == 0:
      writer.write_text(0, "config", f"```\n{config}\n```")
      num_params = sum(p.size for p in jax.tree.leaves(state.params))
      _log(f"Training {config.task}: {num_params:,} parameters, "
           f"{config.num_train_steps} steps of batch {config.batch_size} on "
           f"{_describe_devices(mesh)}; workdir {workdir}")
    stop = cleanup.enter_context(_StopRequest())
    try:
      state = _train_loop(config, model, state, splits, dropout_rng, mesh,
                          state_shardings, checkpoints, writer, stop,
                          start_time)
    except FloatingPointError as e:
      raise FloatingPointError(
          f"{e}; stopped without saving it (newest checkpoint: "
          f"{_describe_latest(checkpoints)})") from e

    final_step = int(state.step)
    _evaluate_and_write(writer, model, state.params, splits["test"], "test",
                        final_step, config.eval_batch_size, start_time, mesh)
    checkpoints.verify()
  return state


class _NoWriter:
  """The ``MetricWriter`` of processes other than process 0: writes nothing."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    del step, scalars

  def write_text(self, step: int, tag: str, text: str) -> None:
    del step, tag, text

  def close(self) -> None:
    pass


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
  """The data; with several processes, process 0 prepares it first."""

  def load():
    try:
      return data.load_splits(build.data_spec(config), config.data.data_dir)
    except ValueError as e:  # e.g. too few distinct sequences for the splits
      raise config_validation.ConfigError(f"data: {e}") from e

  if jax.process_count() == 1:
    return load()
  splits = load() if sharding_lib.is_main_process() else None
  multihost_utils.sync_global_devices("mha: data prepared")
  return load() if splits is None else splits


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


def _train_loop(config: ml_collections.ConfigDict, model: Transformer,
                state: TrainState, splits: Mapping[str, data.Split],
                dropout_rng: Array, mesh: Mesh, state_shardings: Any,
                checkpoints: ckpt_lib.TrainCheckpoints,
                writer: MetricWriter, stop: _StopRequest,
                start_time: float) -> TrainState:
  """Steps from ``state.step`` to ``num_train_steps``, evaluating, logging and
  saving on the way; returns the final state (its checkpoint saved)."""
  batch_sharding = sharding_lib.batch_sharding(mesh)
  replicated = sharding_lib.replicated(mesh)
  step_fn = jax.jit(
      functools.partial(train_step, model=model,
                        schedule=build.learning_rate_schedule(config)),
      in_shardings=(state_shardings, batch_sharding, replicated),
      out_shardings=(state_shardings, replicated),
      donate_argnums=0)
  rows = sharding_lib.process_rows(batch_sharding, config.batch_size)
  start_step = int(state.step)
  total = config.num_train_steps
  window = _TrainMetrics()
  window_start, window_step = time.time(), start_step
  pending = None  # (step, metrics on device): fetched one step late.

  def process(step: int, metrics) -> None:
    nonlocal window_start, window_step
    metrics = jax.device_get(metrics)
    _check_finite(step, metrics)
    window.add(metrics)
    if step % config.log_every_steps == 0 or step == total:
      now = time.time()
      rate = (step - window_step) / max(now - window_start, 1e-9)
      summary = window.summary()
      writer.write_scalars(step, {**summary, "steps_per_sec": rate})
      _log(_log_line(step, total, summary, rate, now - start_time))
      window.reset()
      window_start, window_step = now, step

  for step in range(start_step + 1, total + 1):
    batch = sharding_lib.global_batch(
        process_train_batch(splits["train"], config, step - 1, rows),
        batch_sharding, config.batch_size)
    state, metrics = step_fn(state, batch, dropout_rng)
    if pending is not None:
      process(*pending)
    pending = (step, metrics)

    signum = _agreed_signal(stop.signum)
    stopping = signum is not None
    do_eval = step % config.eval_every_steps == 0 or step == total
    do_save = (step % config.checkpoint_every_steps == 0 or step == total
               or stopping)
    if do_eval or do_save:
      # Never evaluate or checkpoint before the finiteness check of this step.
      process(*pending)
      pending = None
    if do_eval and not stopping:
      _evaluate_and_write(writer, model, state.params, splits["validation"],
                          "validation", step, config.eval_batch_size,
                          start_time, mesh)
    if do_save:
      if not bool(_all_finite(state)):
        raise FloatingPointError(f"non-finite parameters after step {step}")
      checkpoints.save(step, state, config)
    if stopping:
      checkpoints.verify()
      raise TrainingInterrupted(signum, step, checkpoints.step_path(step))
    if do_eval or do_save:  # steps/s measures training: restart its clock
      window_start, window_step = time.time(), step

  if pending is not None:
    process(*pending)
  return state


def _evaluate_and_write(writer: MetricWriter, model: Transformer, params: Any,
                        split: data.Split, name: str, step: int,
                        batch_size: int, start_time: float,
                        mesh: Mesh) -> dict[str, float]:
  metrics = eval_lib.evaluate(model, params, split, batch_size, mesh=mesh)
  writer.write_scalars(step, {f"{name}/{k}": v for k, v in metrics.items()})
  _log(f"{name} @ step {step}: loss {metrics['loss']:.4f} | "
       f"tok_acc {metrics['token_accuracy']:.4f} | "
       f"exact {metrics['exact_match']:.4f} "
       f"({format_duration(time.time() - start_time)} since start)")
  return metrics
