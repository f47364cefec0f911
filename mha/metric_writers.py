"""Metrics to the console, TensorBoard event files and ``metrics.jsonl``.

TensorFlow-free: event files are written by tensorboardX, imported when the
first writer is made (importing ``mha.train`` does not import it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any, Mapping

import numpy as np


def _import_tensorboardx():
  """tensorboardX, without the optional integrations it tries at import.

  tensorboardX imports torch (for ``torch.Tensor`` type checks) and boto3
  (for ``s3://`` logdirs) when they are installed: a second or more of start-
  up for nothing, as we write numpy scalars to local files. Both are hidden
  while it is imported (``None`` in ``sys.modules`` makes an import fail);
  one already imported stays as it is.
  """
  if "tensorboardX" in sys.modules:
    return sys.modules["tensorboardX"]
  hidden = [name for name in ("torch", "boto3") if name not in sys.modules]
  with contextlib.ExitStack() as restore:
    for name in hidden:
      sys.modules[name] = None
      restore.callback(sys.modules.pop, name, None)
    import tensorboardX  # pylint: disable=g-import-not-at-top
  return tensorboardX


class MetricWriter:
  """Writes scalar metrics to TensorBoard and JSONL (one object per line).

  Each JSONL line holds ``step``, ``time`` (Unix seconds) and the metrics,
  eval metrics prefixed by their split (``validation/exact_match``).
  """

  def __init__(self, workdir: str | os.PathLike):
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a",
                       encoding="utf-8")
    self._tb = _import_tensorboardx().SummaryWriter(logdir=os.fspath(workdir))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes one step's scalars to both sinks."""
    values = {k: float(np.asarray(v)) for k, v in scalars.items()}
    record = {"step": int(step), "time": time.time(), **values}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for key, value in values.items():
      self._tb.add_scalar(key, value, global_step=int(step))

  def write_text(self, step: int, tag: str, text: str) -> None:
    """Writes a text summary (the config, at step 0) to TensorBoard."""
    self._tb.add_text(tag, text, global_step=int(step))

  def close(self) -> None:
    """Flushes and closes both sinks."""
    self._jsonl.close()
    self._tb.close()


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
  ``mha.metric_writers`` was first imported, which misses the interpreter's
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
