"""Orbax checkpoints of a training run, and loading them from a notebook.

A checkpoint of step ``s`` (``s`` optimizer updates done) lives in
``workdir/checkpoints/<s>/`` and holds two items:

* ``state``: the train state pytree (``step``, ``params``, ``opt_state``);
* ``config``: the run's ml_collections config, as JSON.

The batch order is a pure function of ``(seed, step)`` (see
:func:`mha.data.train_batch`), so the step is the whole data position.

    ckpt = mha.load_checkpoint("runs/reverse")
    logits, attention = ckpt.model.apply({"params": ckpt.params}, tokens)

What survives what (see :class:`TrainCheckpoints`):

* Orbax writes a step into ``<s>.orbax-checkpoint-tmp`` and renames it to
  ``<s>`` only once every file is written, so a process killed at any moment
  leaves complete steps and temporary folders; the next run removes the
  temporary folders (``cleanup_tmp_directories``) and resumes from the newest
  complete step.
* A step is read back in full (verified) before any older one is deleted to
  keep ``max_checkpoints_to_keep``: an intact checkpoint never makes room for
  one that has not been verified.
* A damaged step (a file truncated or deleted) fails to restore: training
  warns, moves it to ``workdir/damaged_checkpoints/`` and resumes from the
  newest intact one; ``load_checkpoint`` skips it (or names it, when that step
  is asked for).
* A save that fails for want of space or permission (a full disk, a quota, a
  read-only filesystem) raises ``mha.run.write_failures.WriteFailure`` where
  orbax reports it (the next save's wait, ``verify`` or ``close``), once its
  temporary folder is removed; the older steps are untouched, and orbax's own
  log of it is dropped (the run reports it in one line).
* Readers (``load_checkpoint``, ``eval.py``) never see a step being written
  (orbax lists only renamed, complete steps) and never write to the
  checkpoints (``eval.py`` writes only its ``workdir/eval/`` folder), so
  they work while a run trains; writers hold ``mha.run.workdir_lock``.

Checkpoints do not depend on the device count: each array is restored into the
shardings of the mesh at hand (``mha.run.sharding``), so a run saved on 8 devices
resumes on 1 and the reverse, and ``load_checkpoint`` returns the parameters
replicated on every device. With several processes, every process takes part
in each save and restore (orbax coordinates them; its primary process writes
the shared files) and process 0 alone moves a damaged step aside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import glob
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Mapping, TypeVar

import jax
import ml_collections
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from configs import default
from mha import build
from mha.run import config_validation
from mha.run import kill_points
from mha.run import sharding as sharding_lib
from mha.run import write_failures
from mha.model import Transformer, TransformerConfig

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"

_T = TypeVar("_T")


class DamagedCheckpointError(ValueError):
  """A checkpoint that cannot be restored: a file missing, truncated, bad."""


class NoIntactCheckpointError(config_validation.ConfigError):
  """A workdir whose checkpoints are all damaged (kept in
  ``workdir/damaged_checkpoints/``): resuming would silently start over, so
  the run stops (exit code 2) until the user asks to start over."""


class DamagedConfigFileError(config_validation.ConfigError):
  """A workdir's ``config.json`` that cannot be read as a run config (not
  JSON, cut short, not a JSON object, unreadable): a workdir that cannot
  run (exit code 2), left as it is."""


def checkpoint_dir(workdir: str | os.PathLike) -> str:
  """The folder holding a workdir's step folders."""
  return os.path.join(os.path.abspath(os.path.expanduser(workdir)),
                      CHECKPOINT_DIR)


def make_manager(workdir: str | os.PathLike, *,
                 read_only: bool = False) -> ocp.CheckpointManager:
  """An orbax CheckpointManager for ``workdir/checkpoints``; keeps every step
  (``TrainCheckpoints`` deletes old ones once a newer one is verified).

  Saves are asynchronous; call ``wait_until_finished()`` before exiting.
  Unless ``read_only``, creating it removes the temporary folders of saves
  that never finished (in the background; a save waits for it).
  """
  # Loading only: no directory creation and no clean-up of others' files
  # (orbax's own read_only flag warns on every load).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=None,
      create=not read_only,
      cleanup_tmp_directories=not read_only,
  )
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                               item_names=("state", "config"))


def damaged_steps(workdir: str | os.PathLike) -> list[int]:
  """The steps of the checkpoints set aside in ``workdir/damaged_checkpoints/``
  (folders ``<step>-<time>``), each once, in order."""
  directory = os.path.join(os.path.abspath(os.path.expanduser(workdir)),
                           DAMAGED_DIR)
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted({int(name.split("-")[0]) for name in names
                 if name.split("-")[0].isdigit()})


def step_path(manager: ocp.CheckpointManager, step: int) -> str:
  """The folder of ``step``."""
  return os.path.join(os.fspath(manager.directory), str(step))


def save(manager: ocp.CheckpointManager, step: int, state: Any,
         config: ml_collections.ConfigDict) -> None:
  """Saves the train state and the config at ``step`` (asynchronously)."""
  saved = manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      config=ocp.args.JsonSave(config.to_dict()),
  ))
  if not saved:  # orbax skips, silently, a step not after its latest one.
    raise ValueError(f"orbax refused to save step {step} in "
                     f"{manager.directory} (steps saved: {manager.all_steps()})")


def restore_state(manager: ocp.CheckpointManager, step: int,
                  abstract_state: Any) -> Any:
  """Restores the train state of ``step`` into the structure, shapes and
  shardings of ``abstract_state`` (e.g. from ``jax.eval_shape``)."""
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state)))
  return restored["state"]


def complete_config(saved: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A saved config (as a dict) with every key of today's
  ``default.get_config()``, locked: a key added since the run was saved
  (``model.head_dim``, ``data.max_digits``) gets its default, which is what
  that run did; every saved value stays as saved (a pruned model's per-layer
  ``model.num_heads`` list included)."""

  def merge(defaults: dict[str, Any], values: Mapping[str, Any]) -> dict:
    merged = dict(defaults)
    for key, value in values.items():
      if isinstance(value, Mapping) and isinstance(defaults.get(key), dict):
        merged[key] = merge(defaults[key], value)
      else:
        merged[key] = value
    return merged

  if not isinstance(saved, Mapping):
    raise ValueError(f"the saved config is a {type(saved).__name__}, not a "
                     "mapping of config fields")
  config = ml_collections.ConfigDict(
      merge(default.get_config().to_dict(), saved))
  config.lock()
  return config


def restore_config(manager: ocp.CheckpointManager,
                   step: int) -> ml_collections.ConfigDict:
  """The config saved with ``step`` (:func:`complete_config`), locked."""
  restored = manager.restore(step, args=ocp.args.Composite(
      config=ocp.args.JsonRestore()))
  return complete_config(restored["config"])


#: Where orbax's asynchronous reads and writes run (orbax, tensorstore and
#: jax's array serialization): the code an abandoned restore leaves behind.
_ASYNC_CODE = tuple(f"{os.sep}{name}{os.sep}" for name in (
    "orbax", "tensorstore", "array_serialization"))

#: asyncio's reports of a future or task nobody awaits any more.
_ABANDONED = ("exception was never retrieved",
              "Task was destroyed but it is pending")


def _names_async_code(text: str, error: BaseException | None) -> bool:
  """Whether ``text`` names orbax's asynchronous code, or ``error`` was
  raised through it."""
  frames = traceback.extract_tb(error.__traceback__) if error else []
  return any(folder in where for folder in _ASYNC_CODE
             for where in [text, *(frame.filename for frame in frames)])


def _abandoned_async_report(unraisable: Any) -> bool:
  """Whether an unraisable exception is the echo of orbax's abandoned
  asynchronous work: ``Event loop is closed`` from a read or write that
  finished after orbax closed its loop, or a coroutine of orbax's code
  that failed as it was collected."""
  error = unraisable.exc_value
  if unraisable.exc_type is RuntimeError and str(error) == "Event loop is closed":
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return ((code is not None and _names_async_code(code.co_filename, None))
          or _names_async_code(repr(unraisable.object), error))


class _DropAbandonedAsyncLogs(logging.Filter):
  """Drops asyncio's reports of orbax's futures and tasks that a failed
  restore or save abandoned (``Future exception was never retrieved``,
  ``Task was destroyed but it is pending!``); every other record passes."""

  def filter(self, record: logging.LogRecord) -> bool:
    """False (dropped) for a report of orbax's abandoned work."""
    message = record.getMessage()
    if not any(kind in message for kind in _ABANDONED):
      return True
    error = record.exc_info[1] if record.exc_info else None
    # TensorStore's errors come from C++, without Python frames, as
    # ``DATA_LOSS: ...``.
    status = error is not None and re.match(r"[A-Z_]+: ", str(error))
    return not (status or _names_async_code(message, error))


def _drop_closed_loop_reports() -> None:
  """Silences the echo of a failed restore or save, once per process.

  When one array of a restore (or a save: a full disk) fails, orbax's
  ``asyncio.gather`` raises at once and orbax closes its event loop
  (``asyncio_utils.run_sync``) while tensorstore is still finishing the other
  reads or writes, without cancelling or awaiting them. What is left reports
  itself as it finishes or is collected, from tensorstore's threads, up to
  the interpreter's exit: ``RuntimeError: Event loop is closed`` and failing
  coroutines through ``sys.unraisablehook``, ``Future exception was never
  retrieved`` and ``Task was destroyed but it is pending!`` through asyncio's
  logger (thousands of tracebacks on a many-core machine, burying the one
  line that matters). The cause is inside orbax 0.12.8, so exactly the
  reports that name orbax's asynchronous code (or a TensorStore status) are
  dropped; everything else goes to the previous hook and the log.
  """
  logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropAbandonedAsyncLogs) for f in logger.filters):
    logger.addFilter(_DropAbandonedAsyncLogs())
  previous = sys.unraisablehook
  if getattr(previous, "drops_closed_loop_reports", False):
    return

  def hook(unraisable):
    if not _abandoned_async_report(unraisable):
      previous(unraisable)

  hook.drops_closed_loop_reports = True
  sys.unraisablehook = hook
  # TensorStore's callbacks into a closed loop may also report through
  # sys.excepthook (a bare "Traceback ... Event loop is closed"), or through
  # threading.excepthook from a Python thread.
  previous_except = sys.excepthook

  def excepthook(kind, error, trace):
    if not _closed_loop_error(error):
      previous_except(kind, error, trace)

  sys.excepthook = excepthook
  previous_thread = threading.excepthook

  def thread_hook(args):
    if not _closed_loop_error(args.exc_value):
      previous_thread(args)

  threading.excepthook = thread_hook


def _closed_loop_error(error: BaseException | None) -> bool:
  """Whether ``error`` is asyncio's ``Event loop is closed``, raised in its
  own ``call_soon_threadsafe`` (a callback into orbax's closed loop)."""
  if not (isinstance(error, RuntimeError)
          and str(error) == "Event loop is closed"):
    return False
  frames = traceback.extract_tb(error.__traceback__)
  return any(frame.name == "call_soon_threadsafe" for frame in frames)


def _damaged(manager: ocp.CheckpointManager, step: int,
             error: Exception) -> DamagedCheckpointError:
  _drop_closed_loop_reports()
  first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
  # TensorStore appends the repr of a bound method, not its details.
  first_line = first_line.split(" See full TensorStore details")[0].strip()
  return DamagedCheckpointError(
      f"checkpoint {step_path(manager, step)} is damaged: "
      f"{type(error).__name__}: {first_line[:300]}")


def _or_damaged(manager: ocp.CheckpointManager, step: int,
                restore: Callable[..., _T], *args: Any) -> _T:
  """``restore(manager, step, *args)``, raising ``DamagedCheckpointError``
  naming the step's folder when it fails."""
  # Before the attempt: what a failed restore abandons can report itself
  # from tensorstore's threads as soon as orbax closes its loop.
  _drop_closed_loop_reports()
  try:
    return restore(manager, step, *args)
  except Exception as e:  # orbax and tensorstore raise many kinds.
    damaged = _damaged(manager, step, e)
    # What orbax abandoned and is collectable now reports itself here,
    # under the filters _damaged installed, rather than at a random later
    # moment.
    _collect_abandoned()
    raise damaged from e


def _collect_abandoned() -> None:
  """``gc.collect()``, without the ``coroutine ... was never awaited``
  warnings of the orbax coroutines it collects (a failed restore abandons
  them; Python warns as each is collected). Every other warning is shown."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gc.collect()
  for caught_warning in caught:
    code = getattr(caught_warning.source, "cr_code", None)
    if code is not None and _names_async_code(code.co_filename, None):
      continue
    warnings.warn_explicit(caught_warning.message, caught_warning.category,
                           caught_warning.filename, caught_warning.lineno,
                           source=caught_warning.source)


def read_config(manager: ocp.CheckpointManager,
                step: int) -> ml_collections.ConfigDict:
  """``restore_config``, raising ``DamagedCheckpointError`` naming the step's
  folder when it cannot be read."""
  return _or_damaged(manager, step, restore_config)


def read_state(manager: ocp.CheckpointManager, step: int,
               abstract_state: Any) -> Any:
  """``restore_state``, raising ``DamagedCheckpointError`` naming the step's
  folder when any array cannot be read back."""
  return _or_damaged(manager, step, restore_state, abstract_state)


def saved_config(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """The config of the run in ``workdir`` (read only): the newest readable
  checkpoint's, else ``config.json``'s, else None (a new workdir).

  Raises:
    DamagedConfigFileError: no checkpoint is readable and ``config.json``
      is there but damaged or not a config (:func:`read_config_file`).
  """
  directory = checkpoint_dir(workdir)
  if os.path.isdir(directory):
    manager = make_manager(workdir, read_only=True)
    try:
      for step in sorted(manager.all_steps(), reverse=True):
        try:
          return read_config(manager, step).to_dict()
        except DamagedCheckpointError:
          continue
    finally:
      manager.close()
  path = os.path.join(os.path.abspath(os.path.expanduser(workdir)),
                      "config.json")
  if not os.path.lexists(path):
    return None
  return read_config_file(path)


def read_config_file(path: str) -> dict[str, Any]:
  """The run config a ``config.json`` holds, as a dict.

  Raises:
    DamagedConfigFileError: it cannot be read, is not JSON (cut short, say)
      or is not a JSON object; the message names the file.
  """
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    reason = (e.strerror or type(e).__name__).lower()
    raise DamagedConfigFileError(
        f"cannot read the run config {path}: {reason}") from None
  except UnicodeDecodeError:
    raise DamagedConfigFileError(
        f"the run config {path} is damaged: not UTF-8 text; move it away "
        "or use another workdir") from None
  try:
    saved = json.loads(text)
  except ValueError as e:
    raise DamagedConfigFileError(
        f"the run config {path} is damaged: not valid JSON ({e}); move it "
        "away or use another workdir") from None
  if not isinstance(saved, dict):
    raise DamagedConfigFileError(
        f"the run config {path} is not a config: a JSON "
        f"{_json_kind(saved)}, not an object of config fields; move it away "
        "or use another workdir")
  return saved


def _json_kind(value: Any) -> str:
  """What JSON calls the kind of a parsed ``value``."""
  return {list: "array", str: "string", bool: "boolean", int: "number",
          float: "number", type(None): "null"}.get(type(value),
                                                   type(value).__name__)


class TrainCheckpoints:
  """A training run's checkpoints: restore the newest intact one; save
  asynchronously; verify each save before older ones are deleted.

  Args:
    workdir: the run's folder (checkpoints go to ``workdir/checkpoints``).
    keep: how many checkpoints to keep (the newest, all verified).
    abstract_state: the train state's structure, shapes, dtypes and
      shardings (``jax.ShapeDtypeStruct`` leaves): restores lay the arrays
      out so, whatever the device count they were saved with.
  """

  def __init__(self, workdir: str | os.PathLike, *, keep: int,
               abstract_state: Any):
    self._workdir = os.path.abspath(os.path.expanduser(workdir))
    self._keep = keep
    self._abstract_state = abstract_state
    self._unverified: int | None = None
    self._manager = make_manager(workdir)
    # Orbax's own log of a write failure, which ``save``, ``verify`` and
    # ``close`` raise as one ``WriteFailure``.
    self._unlogged = contextlib.ExitStack()
    self._unlogged.enter_context(write_failures.orbax_failures_unlogged())
    # A failed write ends orbax's event loop while tensorstore still finishes
    # its other writes (as a failed read does, see _drop_closed_loop_reports),
    # and asyncio logs each failed write task it collects.
    _drop_closed_loop_reports()
    write_failures.drop_unretrieved_orbax_failures()

  @property
  def directory(self) -> str:
    """``workdir/checkpoints``."""
    return os.fspath(self._manager.directory)

  def step_path(self, step: int) -> str:
    """The folder of ``step``."""
    return step_path(self._manager, step)

  def latest_step(self) -> int | None:
    """The newest step on disk (saved or being saved)."""
    return self._manager.latest_step()

  def restore_latest(self) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest intact checkpoint, or None if none.

    Each damaged step on the way is reported on stderr and moved to
    ``workdir/damaged_checkpoints/`` (kept for inspection, and so that the run
    can save that step again).
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        read_config(self._manager, step)
        return step, read_state(self._manager, step, self._abstract_state)
      except DamagedCheckpointError as e:
        moved_to = self._move_aside(step)
        print(f"warning: {e}; moved it to {moved_to}; trying the next older "
              "checkpoint", file=sys.stderr, flush=True)
    return None

  def _move_aside(self, step: int) -> str:
    source = step_path(self._manager, step)
    target = os.path.join(self._workdir, DAMAGED_DIR,
                          f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
    if sharding_lib.is_main_process():
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.rename(source, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"mha: moved aside step {step}")
    self._manager.reload()  # Forget the step, or orbax would skip saving it.
    return target

  def save(self, step: int, state: Any,
           config: ml_collections.ConfigDict) -> None:
    """Verifies the previous save, then saves ``step`` (asynchronously)."""
    self.verify()
    with self._failed_save(step):
      self._probe()
      save(self._manager, step, state, config)
    kill_points.reached(step, "during_save")  # orbax writes in the background
    self._unverified = step

  def _probe(self) -> None:
    """Writes (and removes) a small file where the steps go, so that a
    folder that takes no writes at all (read-only, no permission, no space
    left) fails here: orbax, whose step folder creation fails in the
    background, would have its other threads wait 300 s for it first."""
    if not sharding_lib.is_main_process():
      return
    path = os.path.join(self.directory, f".write-probe.{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      os.write(fd, b"\0" * 4096)
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(path)

  def verify(self) -> None:
    """Waits for the last save, reads it back in full and only then deletes
    the checkpoints older than the ``keep`` newest.

    Raises:
      DamagedCheckpointError: the last save cannot be read back (nothing is
        deleted).
    """
    with self._failed_save(self._unverified):
      self.wait_until_finished()
    if self._unverified is None:
      return
    step, self._unverified = self._unverified, None
    read_config(self._manager, step)
    read_state(self._manager, step, self._abstract_state)
    verified = [s for s in sorted(self._manager.all_steps()) if s <= step]
    for old in verified[:-self._keep]:
      self._manager.delete(old)

  def wait_until_finished(self) -> None:
    """Waits for the last save to be written (not verified)."""
    self._manager.wait_until_finished()

  @contextlib.contextmanager
  def _failed_save(self, step: int | None):
    """Turns a write failure of the save of ``step`` into a
    ``WriteFailure``, once its temporary folder is removed (older steps are
    untouched); other errors pass."""
    try:
      yield
    except Exception as e:  # orbax and tensorstore raise many kinds.
      code = write_failures.write_errno(e)
      if code is None or step is None:
        raise
      self._unverified = None
      if sharding_lib.is_main_process():
        _remove_settled(f"{self.step_path(step)}.orbax-checkpoint-tmp*")
      self._manager.reload()
      raise write_failures.WriteFailure(
          code, f"saving checkpoint {step} in {self.directory}") from e

  def close(self) -> None:
    """Waits for the last save (unverified if not ``verify``-ed) and closes.

    Raises:
      WriteFailure: the last save failed for want of space or permission
        (its temporary folder removed).
    """
    try:
      with self._failed_save(self._unverified):
        self._manager.wait_until_finished()
    finally:
      self._manager.close()
      self._unlogged.close()


#: :func:`_remove_settled`: its looks at most, the looks in a row that must
#: find nothing, and the pause between looks (0.2 s to 2 s, on a failed save
#: only).
_SETTLE_LOOKS, _SETTLE_QUIET, _SETTLE_PAUSE_S = 100, 10, 0.02


def _remove_settled(pattern: str) -> None:
  """Removes the folders matching ``pattern`` until none has come back for
  :data:`_SETTLE_QUIET` looks in a row. Orbax reports a failed write while tensorstore still
  finishes the save's other writes, and removing the folder frees the space
  they lacked, so one of them can create it again (a full disk left a
  ``<step>.orbax-checkpoint-tmp`` behind in one of four runs of the
  suite on 2 cores)."""
  quiet = 0
  for _ in range(_SETTLE_LOOKS):
    found = glob.glob(pattern)
    for path in found:
      shutil.rmtree(path, ignore_errors=True)
    quiet = 0 if found else quiet + 1
    if quiet == _SETTLE_QUIET:
      return
    time.sleep(_SETTLE_PAUSE_S)


def config_to_json(config: ml_collections.ConfigDict) -> str:
  """The config as indented JSON (what ``workdir/config.json`` holds)."""
  return json.dumps(config.to_dict(), indent=2, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
  """A trained model, ready to apply.

  Attributes:
    config: the run's config (ml_collections, locked).
    model: the ``Transformer`` module.
    params: its parameters (``model.apply({"params": params}, tokens)``).
    step: the training step of the checkpoint.
  """

  config: ml_collections.ConfigDict
  model: Transformer
  params: Any
  step: int

  @property
  def model_config(self) -> TransformerConfig:
    """The model's static hyperparameters."""
    return self.model.config


def load_checkpoint(workdir: str | os.PathLike,
                    step: int | None = None) -> LoadedCheckpoint:
  """Loads a run's config and parameters; the newest intact step unless
  ``step``.

  Nothing but the workdir is needed: the config saved in the checkpoint
  rebuilds the model. Only the parameters are read (an orbax partial
  restore, :func:`restore_params`): no optimizer is built. The parameters
  come back replicated on every device (``mha.run.sharding.make_mesh()``),
  whatever the device count of the run that saved them. Reads only: a
  damaged step is skipped with a warning on stderr when no ``step`` is given.

  Raises:
    FileNotFoundError: the workdir has no checkpoint, or not ``step``.
    DamagedCheckpointError: ``step`` (or, without ``step``, every step) is
      damaged.
  """
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints in {workdir} ({directory} does "
                            "not exist)")
  manager = make_manager(workdir, read_only=True)
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise FileNotFoundError(f"no checkpoints in {directory}")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(
            f"no checkpoint of step {step} in {directory}; steps saved: "
            f"{', '.join(map(str, steps))}")
      return _load(manager, step)
    for candidate in reversed(steps):
      try:
        return _load(manager, candidate)
      except DamagedCheckpointError as e:
        print(f"warning: {e}; skipping it", file=sys.stderr, flush=True)
    raise DamagedCheckpointError(f"every checkpoint in {directory} is damaged")
  finally:
    manager.close()


def restore_params(manager: ocp.CheckpointManager, step: int,
                   abstract_params: Any) -> Any:
  """Restores only the ``params`` of the train state saved at ``step`` into
  the structure, shapes and shardings of ``abstract_params``.

  An orbax partial restore (``PyTreeRestore(partial_restore=True)``): the
  step counter and the optimizer state are neither read nor built, so no
  optimizer is needed to load a model.
  """
  # Read by name, the arrays restore even without the state's tree metadata
  # file; reading that first makes a step that lost it count as damaged, as
  # it does for a full restore (which needs it).
  handler = ocp.PyTreeCheckpointHandler()
  try:
    handler.metadata(manager.directory / str(step) / "state")
  finally:
    handler.close()
  item = {"params": abstract_params}
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
          item=item,
          restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True)))
  return restored["state"]["params"]


def read_params(manager: ocp.CheckpointManager, step: int,
                abstract_params: Any) -> Any:
  """``restore_params``, raising ``DamagedCheckpointError`` naming the step's
  folder when a parameter cannot be read back."""
  return _or_damaged(manager, step, restore_params, abstract_params)


def _replicated(abstract: Any) -> Any:
  """``abstract`` (``jax.eval_shape`` output) with every array replicated on
  every device of ``mha.run.sharding.make_mesh()``: what loads restore into."""
  return sharding_lib.with_shardings(abstract, sharding_lib.state_shardings(
      abstract, sharding_lib.make_mesh(), shard_params=False))


def abstract_params(config: ml_collections.ConfigDict) -> Any:
  """The parameters' structure, shapes and dtypes for ``config``, replicated
  on every device (what :func:`load_checkpoint` restores into)."""
  model = build.make_model(config)
  return _replicated(jax.eval_shape(
      lambda: build.init_params(model, jax.random.key(0))))


def abstract_train_state(config: ml_collections.ConfigDict
                         ) -> build.TrainState:
  """The whole train state's structure, shapes and dtypes for ``config``
  (optimizer included), replicated on every device: what a full restore of
  a checkpoint of ``config`` reads into (:func:`read_state`)."""
  model = build.make_model(config)
  return _replicated(jax.eval_shape(
      lambda: build.create_train_state(config, model, jax.random.key(0))))


def _load(manager: ocp.CheckpointManager, step: int) -> LoadedCheckpoint:
  config = read_config(manager, step)
  params = read_params(manager, step, abstract_params(config))
  return LoadedCheckpoint(config=config, model=build.make_model(config),
                          params=params, step=int(step))


def transformer_from_checkpoint(workdir: str | os.PathLike,
                                step: int | None = None, *,
                                rngs: Any = None) -> Any:
  """A trained :class:`mha.model.Transformer` as an NNX module.

  The workdir's model (``mha.load_checkpoint``) wrapped in
  ``flax.nnx.bridge.ToNNX``, holding the checkpoint's parameters as
  ``nnx.Param`` under the Linen names (``nnx.state(model, nnx.Param)`` is
  the checkpoint's tree). It is called as the Linen model is applied::

    model = transformer_from_checkpoint(workdir)
    logits, attention = model(tokens, head_mask=head_mask)
    x = model(tokens, method="embed")  # another method of the Linen model

  ``nnx.jit``, ``nnx.grad``, ``nnx.split``/``nnx.merge`` and NNX optimizers
  work on it as on any NNX module. Dropout (``deterministic=False``) needs a
  ``dropout`` stream: ``rngs`` here, or ``rngs=nnx.Rngs(dropout=...)`` in
  the call.

  The parameters are set on the wrapper directly rather than through
  ``ToNNX.lazy_init``, which would initialise a random model first and, in
  Flax 0.12.8, fails on our model: the wrapper takes the variable ``embed``
  for the Linen method ``Transformer.embed`` of the same name. (So
  ``model.embed`` is the embedding's parameters; the method is
  ``model(tokens, method="embed")``.)

  Args:
    workdir: a training run's folder (its newest intact step unless
      ``step``).
    step: the checkpoint's step.
    rngs: the ``nnx.Rngs`` the wrapper passes to every call (default:
      none).
  """
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  from flax.nnx.bridge import variables as bridge_variables

  loaded = load_checkpoint(workdir, step)
  model = bridge.ToNNX(loaded.model, rngs=rngs)
  attrs = bridge_variables.linen_vars_to_nnx_attrs({"params": loaded.params})
  for name, value in attrs.items():
    setattr(model, name, value)
  return model


def check_restart(checkpoints: TrainCheckpoints,
                  restored: tuple[int, Any] | None,
                  restart_from_scratch: bool, *,
                  log: Callable[[str], None] = print) -> None:
  """Refuses to start a run over without ``restart_from_scratch`` when its
  checkpoints are all damaged (``NoIntactCheckpointError``), and
  ``restart_from_scratch`` while one is intact (``ConfigError``); ``log``s
  a line when it starts over. ``restored``: ``restore_latest()``'s."""
  workdir = os.path.dirname(checkpoints.directory)
  damaged = damaged_steps(workdir)
  kept = (f"{', '.join(map(str, damaged))}, kept in "
          f"{os.path.join(workdir, DAMAGED_DIR)}")
  if restored is not None and restart_from_scratch:
    raise config_validation.ConfigError(
        f"--restart_from_scratch starts a run over only when no intact "
        f"checkpoint is left, and {checkpoints.step_path(restored[0])} is "
        "intact; run without it to resume, or use another workdir")
  if restored is not None or not damaged:
    return
  if not restart_from_scratch:
    raise NoIntactCheckpointError(
        f"no intact checkpoint left in {checkpoints.directory}: every one is "
        f"damaged (steps {kept}); to start the run over from step 0, run the "
        "same command with --restart_from_scratch")
  log(f"Starting over from step 0 with --restart_from_scratch: no intact "
       f"checkpoint left in {checkpoints.directory} (damaged steps {kept})")
