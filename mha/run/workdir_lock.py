"""One run per workdir: an exclusive OS lock, held for the whole run.

``train_and_evaluate`` (so ``train.py``) holds it on its workdir and
``scripts/prune_heads.py`` on its output folder. The lock is ``flock`` on
``<dir>/run.lock``: the kernel releases it when the process ends, however it
ends (kill -9 included), so there is never a stale lock to remove by hand.
The file itself stays; it records the holder (pid, host, start time, in
JSON) so that a second run can say who holds it:

    train.py: error: /home/me/runs/x is in use by another run (pid 4242 on
    host gpu-3, started 2026-11-21 15:22:07 UTC); lock file
    /home/me/runs/x/run.lock; wait for it to end, or stop it

That second run exits 2 and writes nothing. Readers (``eval.py``,
``mha.load_checkpoint``) take no lock: they never write to the checkpoints
(``eval.py`` writes only ``workdir/eval/``), and orbax never lists a
checkpoint before it is complete (it writes ``<step>.orbax-checkpoint-tmp``
and renames it when done).

With several processes, process 0 alone holds the lock (the others run in
step with it); they all learn whether it got it, and stop together if not.
On NFS, Linux maps ``flock`` to a lock the server knows of, so the lock
holds across hosts too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Any, Iterator

import numpy as np

from mha.run import config_validation
from mha.run import write_failures

LOCK_FILE = "run.lock"


class WorkdirLockedError(config_validation.ConfigError):
  """The folder is locked by another run (a user's mistake: exit code 2)."""


class WorkdirUnusableError(config_validation.ConfigError):
  """The folder cannot be made or written (a path through a file, a
  read-only file system, no permission): exit code 2, nothing written."""


def lock_path(directory: str | os.PathLike) -> str:
  """The lock file of ``directory``."""
  return os.path.join(os.fspath(directory), LOCK_FILE)


def holder(directory: str | os.PathLike) -> dict[str, Any] | None:
  """What the lock file records of its last holder (``pid``, ``host``,
  ``started``), or None when there is none to read."""
  try:
    with open(lock_path(directory), encoding="utf-8") as f:
      return json.loads(f.read())
  except (OSError, ValueError):
    return None


def _describe_holder(directory: str) -> str:
  record = holder(directory) or {}
  if "pid" not in record:  # It has taken the lock and not written it yet.
    who = "another run, which is just starting"
  else:
    who = (f"another run (pid {record['pid']} on host {record.get('host')}, "
           f"started {record.get('started')})")
  return (f"{directory} is in use by {who}; lock file "
          f"{lock_path(directory)}; wait for it to end, or stop it")


#: Why a folder could not be made or written, for one line
#: (:func:`mha.run.write_failures.os_error_reason`).
unusable_reason = write_failures.os_error_reason


class WorkdirLock:
  """An exclusive lock on ``directory`` (created if missing) for one run.

  ``acquire`` raises ``WorkdirLockedError`` naming the holder, having written
  nothing, when another process holds it; ``release`` (or the end of the
  process) lets it go.
  """

  def __init__(self, directory: str | os.PathLike):
    self.directory = os.path.abspath(os.path.expanduser(
        os.fspath(directory)))
    self._fd: int | None = None

  def acquire(self) -> None:
    """Takes the lock and records this process as its holder.

    Raises:
      WorkdirLockedError: another process holds it.
      WorkdirUnusableError: the folder or its lock file cannot be made.
    """
    try:
      os.makedirs(self.directory, exist_ok=True)
      fd = os.open(lock_path(self.directory), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirUnusableError(
          f"cannot use {self.directory}: {unusable_reason(e)}; choose a "
          "folder this process can write") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise WorkdirLockedError(_describe_holder(self.directory)) from None
    self._fd = fd
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                       time.gmtime())}
    with contextlib.suppress(OSError):  # A full disk: the lock holds anyway.
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)

  def release(self) -> None:
    """Lets the lock go (the file stays, for the next holder to reuse)."""
    if self._fd is not None:
      fd, self._fd = self._fd, None
      os.close(fd)  # Closing the only descriptor releases the flock.

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


@contextlib.contextmanager
def held(directory: str | os.PathLike) -> Iterator[None]:
  """Holds ``directory``'s lock within; with several processes, process 0
  holds it and every process raises ``WorkdirLockedError`` if it could not
  (or ``WorkdirUnusableError`` where the folder cannot be made: every
  process learns of it, none waits for the others)."""
  # Imported here: mha.pruning.study.grid imports this module for its
  # command line's checks, before JAX is needed.
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  lock, error = None, None
  if jax.process_index() == 0:
    lock = WorkdirLock(directory)
    try:
      lock.acquire()
    except config_validation.ConfigError as e:  # Locked, or unusable.
      error = e
  if jax.process_count() > 1:
    got = multihost_utils.process_allgather(np.int32(error is None))
    if error is None and not np.all(got):
      error = WorkdirLockedError(
          f"{directory} could not be locked by process 0 (in use by another "
          "run, or a folder it cannot write: its message says which)")
  if error is not None:
    if lock is not None:
      lock.release()
    raise error
  try:
    yield
  finally:
    if lock is not None:
      lock.release()
