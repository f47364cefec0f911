"""Metrics to the console, TensorBoard event files and ``metrics.jsonl``.

TensorFlow-free: event files are written by tensorboardX.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any, Mapping

import numpy as np
from tensorboardX import summary as tb_summary
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import RecordWriter

from mha import write_failures


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
  """

  def __init__(self, workdir: str | os.PathLike):
    self._failed = False
    self._jsonl_path = os.path.join(workdir, "metrics.jsonl")
    # SummaryWriter's name (and the pid): one new event file per writer.
    self._events_path = os.path.join(
        workdir, f"events.out.tfevents.{int(time.time())}."
        f"{socket.gethostname()}.{os.getpid()}")
    with self._writing(self._jsonl_path):
      # Unbuffered: each line is written whole, or taken back.
      self._jsonl = open(self._jsonl_path, "ab", buffering=0)
    self._events = None
    with self._writing(self._events_path):
      self._events = RecordWriter(self._events_path)
    self._write_event(event_pb2.Event(wall_time=time.time(),
                                      file_version="brain.Event:2"))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes one step's scalars to both sinks."""
    values = {k: float(np.asarray(v)) for k, v in scalars.items()}
    record = {"step": int(step), "time": time.time(), **values}
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
    self._write_event(*(
        event_pb2.Event(wall_time=time.time(), step=int(step),
                        summary=tb_summary.scalar(key, value))
        for key, value in values.items()))

  def write_text(self, step: int, tag: str, text: str) -> None:
    """Writes a text summary (the config, at step 0) to TensorBoard."""
    self._write_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=tb_summary.text(tag, text)))

  def _write_event(self, *events: Any) -> None:
    with self._writing(self._events_path):
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


def format_duration(seconds: float) -> str:
  """``75`` -> ``'1m15s'``; short and human."""
  seconds = int(round(max(seconds, 0)))
  minutes, seconds = divmod(seconds, 60)
  hours, minutes = divmod(minutes, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
