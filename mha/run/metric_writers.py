"""Metrics to the console, TensorBoard event files and ``metrics.jsonl``.

TensorFlow-free: event files are written by tensorboardX, imported when the
first writer is made (importing ``mha.train`` does not import it).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import Any, Mapping

import numpy as np

from mha.run import write_failures


def _tensorboardx_parts():
  """tensorboardX's ``summary``, ``event_pb2`` and ``RecordWriter``, imported
  without the optional integrations tensorboardX tries at import.

  tensorboardX imports torch (for ``torch.Tensor`` type checks) and boto3
  (for ``s3://`` logdirs) when they are installed: a second or more of start-
  up for nothing, as we write numpy scalars to local files. Both are hidden
  while it is imported (``None`` in ``sys.modules`` makes an import fail);
  one already imported stays as it is.
  """
  hidden = [name for name in ("torch", "boto3") if name not in sys.modules]
  with contextlib.ExitStack() as restore:
    for name in hidden:
      sys.modules[name] = None
      restore.callback(sys.modules.pop, name, None)
    # pylint: disable=g-import-not-at-top
    from tensorboardX import summary
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import RecordWriter
  return summary, event_pb2, RecordWriter


class MetricWriter:
  """Writes scalar metrics to TensorBoard and JSONL (one object per line).

  Each JSONL line holds ``step``, ``time`` (Unix seconds) and the metrics,
  eval metrics prefixed by their split (``validation/exact_match``).

  Every write reaches the files before it returns: the event file is
  written in this thread with tensorboardX's ``RecordWriter`` (the file
  format of its ``SummaryWriter``, whose background thread dies on a full
  disk and leaves the next write waiting forever). So a failed write raises
  here: ``WriteFailure`` for want of space or permission, with a partly
  written ``metrics.jsonl`` line taken back.

  A run resumed from a checkpoint redoes the steps after it: with
  ``purge_step``, the metric rows of steps from ``purge_step`` on are first
  dropped from ``metrics.jsonl`` (:func:`drop_rows_from`; provenance rows
  stay), and the event file starts with a ``SessionLog.START`` at
  ``purge_step``, on which TensorBoard drops the older files' events of
  those steps (what tensorboardX's ``SummaryWriter(purge_step=...)`` writes).
  So each step has one row.
  """

  def __init__(self, workdir: str | os.PathLike, *,
               purge_step: int | None = None):
    self._failed = False
    self._purge_step = purge_step
    self._jsonl_path = os.path.join(workdir, "metrics.jsonl")
    # SummaryWriter's name (and the pid): one new event file per writer.
    self._events_path = os.path.join(
        workdir, f"events.out.tfevents.{int(time.time())}."
        f"{socket.gethostname()}.{os.getpid()}")
    with self._writing(self._jsonl_path):
      if purge_step is not None:
        drop_rows_from(self._jsonl_path, purge_step)
      # Unbuffered: each line is written whole, or taken back.
      self._jsonl = open(self._jsonl_path, "ab", buffering=0)
    # The event file is made with the first event: a run that writes
    # nothing (a finished run started again) leaves no empty one behind.
    self._events = None
    summary, event_pb2, self._record_writer = _tensorboardx_parts()
    self._summary, self._event_pb2 = summary, event_pb2

  def write_header(self, step: int, header: Mapping[str, Any]) -> None:
    """Writes ``{"step", "time", "provenance": header}`` to ``metrics.jsonl``
    alone: what produced the rows after it (``mha.run.provenance``)."""
    self._write_row({"step": int(step), "time": time.time(),
                     "provenance": dict(header)})

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes one step's scalars to both sinks."""
    values = {k: float(np.asarray(v)) for k, v in scalars.items()}
    self._write_row({"step": int(step), "time": time.time(), **values})
    self._write_event(*(
        self._event_pb2.Event(wall_time=time.time(), step=int(step),
                              summary=self._summary.scalar(key, value))
        for key, value in values.items()))

  def _write_row(self, record: Mapping[str, Any]) -> None:
    """One line of ``metrics.jsonl``, written whole or not at all."""
    line = memoryview((json.dumps(record) + "\n").encode("utf-8"))
    start = self._jsonl.seek(0, os.SEEK_END)
    with self._writing(self._jsonl_path):
      try:
        while line:
          line = line[self._jsonl.write(line):]
      except OSError:
        with contextlib.suppress(OSError):  # No half line left behind.
          os.ftruncate(self._jsonl.fileno(), start)
        raise

  def write_text(self, step: int, tag: str, text: str) -> None:
    """Writes a text summary (the config, at step 0) to TensorBoard."""
    self._write_event(self._event_pb2.Event(
        wall_time=time.time(), step=int(step),
        summary=self._summary.text(tag, text)))

  def _write_event(self, *events: Any) -> None:
    with self._writing(self._events_path):
      if self._events is None:
        self._events = self._record_writer(self._events_path)
        first = [self._event_pb2.Event(wall_time=time.time(),
                                       file_version="brain.Event:2")]
        if self._purge_step is not None:
          first.append(self._event_pb2.Event(
              wall_time=time.time(), step=self._purge_step,
              session_log=self._event_pb2.SessionLog(
                  status=self._event_pb2.SessionLog.START)))
        events = (*first, *events)
      for event in events:
        self._events.write(event.SerializeToString())
      self._events.flush()

  @contextlib.contextmanager
  def _writing(self, path: str):
    """An ``OSError`` of a write failure inside becomes ``WriteFailure``."""
    try:
      yield
    except OSError as e:
      code = write_failures.write_errno(e)
      if code is None:
        raise
      self._failed = True
      raise write_failures.WriteFailure(code, f"writing {path}") from e

  def close(self) -> None:
    """Flushes and closes both sinks (after a failed write, quietly: the
    failure is reported already)."""
    self._jsonl.close()
    if self._events is None:
      return
    try:
      with self._writing(self._events_path):
        self._events.close()  # Closes the file even when its flush fails.
    except write_failures.WriteFailure:
      if not self._failed:
        raise


def drop_rows_from(path: str, step: int) -> int:
  """Drops the metric rows of steps ``step`` and later from the JSONL file
  ``path``; returns how many. Provenance rows stay (each says what produced
  the rows after it), and so does a line that is not a JSON object.

  Safe at any moment: the kept lines go to a new file, flushed to disk, that
  then replaces ``path`` in one rename; a process killed on the way leaves
  ``path`` as it was (and a ``.tmp`` file the next call replaces).
  """
  try:
    with open(path, "rb") as f:
      lines = f.read().splitlines(keepends=True)
  except FileNotFoundError:
    return 0

  def redone(line: bytes) -> bool:
    try:
      row = json.loads(line)
    except ValueError:
      return False
    return (isinstance(row, dict) and "provenance" not in row
            and isinstance(row.get("step"), int) and row["step"] >= step)

  kept = [line if line.endswith(b"\n") else line + b"\n"
          for line in lines if not redone(line)]
  if len(kept) == len(lines):
    return 0
  temporary = f"{path}.tmp"
  try:
    with open(temporary, "wb") as f:
      f.writelines(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except OSError:  # A full disk, say: the old file stays whole.
    with contextlib.suppress(OSError):
      os.remove(temporary)
    raise
  folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
  try:
    os.fsync(folder)  # The rename itself, on disk.
  finally:
    os.close(folder)
  return len(lines) - len(kept)


def format_duration(seconds: float) -> str:
  """``75`` -> ``'1m15s'``; short and human."""
  seconds = int(round(max(seconds, 0)))
  minutes, seconds = divmod(seconds, 60)
  hours, minutes = divmod(minutes, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def process_start_time() -> float:
  """When this process started, in Unix seconds (``time.time()``'s clock).

  From ``/proc`` on Linux (10 ms resolution); elsewhere the time
  ``mha.run.metric_writers`` was first imported, which misses the interpreter's
  own start-up (tens of milliseconds) and the imports before it.
  """
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      # Field 22, after the parenthesised name (which may hold spaces).
      start_ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
    age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - max(age, 0.0)
  except (OSError, ValueError, IndexError):
    return _IMPORT_TIME


_IMPORT_TIME = time.time()


class NoWriter:
  """The ``MetricWriter`` of processes other than process 0: writes nothing."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    del step, scalars

  def write_text(self, step: int, tag: str, text: str) -> None:
    del step, tag, text

  def write_header(self, step: int, header: Mapping[str, Any]) -> None:
    del step, header

  def close(self) -> None:
    pass
