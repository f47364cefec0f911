"""Metrics to the console, TensorBoard event files and ``metrics.jsonl``.

TensorFlow-free: event files are written by tensorboardX.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

import numpy as np
import tensorboardX


class MetricWriter:
  """Writes scalar metrics to TensorBoard and JSONL (one object per line).

  Each JSONL line holds ``step``, ``time`` (Unix seconds) and the metrics,
  eval metrics prefixed by their split (``validation/exact_match``).
  """

  def __init__(self, workdir: str | os.PathLike):
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a",
                       encoding="utf-8")
    self._tb = tensorboardX.SummaryWriter(logdir=os.fspath(workdir))

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
