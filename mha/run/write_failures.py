"""Writes that fail for want of space or permission, told in one line.

A full disk (ENOSPC), an exceeded quota (EDQUOT), a read-only filesystem
(EROFS), a lost permission (EACCES, EPERM) or a file size limit (EFBIG,
``ulimit -f``) during a checkpoint save or a ``metrics.jsonl``, event-file
or ``config.json`` write stops a training run with :class:`WriteFailure`,
whose message says what failed, which checkpoints are intact and what to
do:

    no space left on device while saving checkpoint 150 in runs/x/checkpoints;
    checkpoints 50, 100 are intact; free space and run the same command to
    resume

Python's own writes raise ``OSError``; tensorstore's (the arrays of an orbax
checkpoint) come back from orbax as a ``ValueError`` holding the status text,
e.g. ``RESOURCE_EXHAUSTED: ... [os_error_code='28']``. :func:`write_errno`
reads the errno out of either.

Orbax logs such a failure from its own threads (with tracebacks) before the
training loop hears of it; :class:`DropReportedFailures` drops exactly those
log records while a run reports the failure itself.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import traceback
import warnings
from typing import Iterator, Sequence

from mha.run import absl_logs

#: The errnos of a write failure, each with what the user can do about it.
REMEDIES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space within your quota",
    errno.EROFS: "make the filesystem writable",
    errno.EACCES: "restore write permission",
    errno.EPERM: "restore write permission",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
}

# Tensorstore's status text names the OS error: [os_error_code='28'] (or
# os_error_code=28).
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def nearest_existing(path: str | os.PathLike) -> str:
  """``path`` made absolute, or its nearest ancestor that exists (a link
  counts, broken or not): where making ``path`` would start, and what is
  in its way when that is not a folder."""
  probe = os.path.abspath(os.fspath(path))
  while not os.path.lexists(probe) and probe != os.path.dirname(probe):
    probe = os.path.dirname(probe)
  return probe


def os_error_reason(error: OSError) -> str:
  """Why an ``OSError`` happened, for one line: the file in the way of a
  path (``a/file/b``), or the system's reason and the path."""
  path = os.fspath(error.filename) if error.filename else ""
  if isinstance(error, (NotADirectoryError, FileExistsError)) and path:
    probe = nearest_existing(path)
    if not os.path.isdir(probe):
      return f"{probe} is a file, not a folder"
  reason = (error.strerror or type(error).__name__).lower()
  return f"{reason}: {path}" if path else reason


class WriteFailure(Exception):
  """A write of a training run failed for want of space or permission.

  Attributes:
    errno: the OS error (one of ``REMEDIES``).
    what: what was being written, e.g. ``saving checkpoint 150 in ...``.
    intact_steps: the checkpoints on disk, intact, once known (set by
      :func:`reported`); None before.
  """

  def __init__(self, code: int, what: str):
    super().__init__(code, what)
    self.errno, self.what = code, what
    self.intact_steps: Sequence[int] | None = None

  def __str__(self) -> str:
    message = f"{os.strerror(self.errno).lower()} while {self.what}"
    if self.intact_steps is None:
      return message
    steps = list(self.intact_steps)
    if not steps:
      return (f"{message}; no checkpoint is saved yet; "
              f"{REMEDIES[self.errno]} and run the same command to start "
              "again")
    intact = (f"checkpoint {steps[0]} is intact" if len(steps) == 1 else
              f"checkpoints {', '.join(map(str, steps))} are intact")
    return (f"{message}; {intact}; {REMEDIES[self.errno]} and run the same "
            "command to resume")


def write_errno(error: BaseException | None) -> int | None:
  """The errno of ``error`` (or of an error it was raised from) if it is a
  write failure of ``REMEDIES``, else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, WriteFailure):
      return error.errno
    if isinstance(error, OSError) and error.errno in REMEDIES:
      return error.errno
    match = _OS_ERROR_CODE.search(str(error))
    if match and int(match.group(1)) in REMEDIES:
      return int(match.group(1))
    error = error.__cause__ or error.__context__
  return None


def intact_steps(checkpoint_dir: str) -> list[int]:
  """The complete checkpoints in ``checkpoint_dir``: the step folders orbax
  has renamed from their temporary names (it does so once every file is
  written)."""
  if not os.path.isdir(checkpoint_dir):
    return []
  return sorted(int(name) for name in os.listdir(checkpoint_dir)
                if name.isdigit())


@contextlib.contextmanager
def reported(checkpoint_dir: str) -> Iterator[None]:
  """Raises a write failure inside as :class:`WriteFailure` naming the
  intact checkpoints in ``checkpoint_dir`` (listed once everything inside
  has been closed, i.e. when the failure leaves the block)."""
  try:
    yield
  except WriteFailure as e:
    e.intact_steps = intact_steps(checkpoint_dir)
    raise
  except OSError as e:
    code = write_errno(e)
    if code is None:
      raise
    failure = WriteFailure(code, f"writing {e.filename or 'the workdir'}")
    failure.intact_steps = intact_steps(checkpoint_dir)
    raise failure from e


class DropReportedFailures(logging.Filter):
  """Drops orbax's log records of a write failure (the run reports it in
  one line); every other record passes."""

  def filter(self, record: logging.LogRecord) -> bool:
    """False (dropped) for a record of a failure already reported."""
    orbax = f"{os.sep}orbax{os.sep}"
    # asyncio's "Task exception was never retrieved" (or a gathering
    # future's), logged when one of orbax's write tasks is collected (at the
    # latest at exit) after the save failed: the coroutine it names, its
    # traceback or the folder it wrote to is orbax's.
    unretrieved = record.name == "asyncio" and (
        orbax in record.getMessage()
        or ".orbax-checkpoint-tmp" in record.getMessage() or any(
            orbax in frame.filename for frame in traceback.extract_tb(
                record.exc_info[2] if record.exc_info else None)))
    if orbax not in record.pathname and not unretrieved:
      return True
    error = record.exc_info[1] if record.exc_info else None
    return (write_errno(error) is None
            and write_errno(Exception(record.getMessage())) is None)


@contextlib.contextmanager
def orbax_failures_unlogged() -> Iterator[None]:
  """Within: :class:`DropReportedFailures` on absl's logger (orbax logs
  through absl)."""
  with absl_logs.filtered(DropReportedFailures()):
    yield


def drop_unretrieved_orbax_failures() -> None:
  """:class:`DropReportedFailures` on asyncio's logger, for the rest of the
  process (once): orbax's write tasks that failed with the run's write
  failure are collected after the run reported it, up to the interpreter's
  exit, and asyncio logs each with its traceback (orbax's own threads log
  theirs through absl, also after the manager closed); and no warning for
  the write coroutines orbax never awaited once one had failed."""
  installed = False
  for name in ("asyncio", "absl"):  # absl: orbax's threads log after close
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropForGood) for f in logger.filters):
      logger.addFilter(_DropForGood())
      installed = True
  if installed:
    # The writes orbax never started once one failed: Python warns of each
    # such coroutine when it is collected.
    warnings.filterwarnings(
        "ignore", category=RuntimeWarning,
        message=r"coroutine 'async_serialize_from_host\.<locals>\."
                r"write_fragment' was never awaited")


class _DropForGood(DropReportedFailures):
  """:class:`DropReportedFailures` installed for the rest of the process."""
