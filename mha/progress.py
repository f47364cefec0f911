"""Progress lines of long work: a step timed and reported through a ``Log``.

    value, seconds = timed(print, "leave-one-out", lambda: work())
    # prints "  leave-one-out: 1.23 s"
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from mha.aliases import Log

T = TypeVar("T")


def quiet(_: str) -> None:
  """A :data:`mha.aliases.Log` that prints nothing."""


def timed(log: Log, what: str, fn: Callable[[], T]) -> tuple[T, float]:
  """Runs ``fn``; logs ``  <what>: <seconds> s``; returns its result and the
  seconds it took."""
  start = time.perf_counter()
  out = fn()
  seconds = time.perf_counter() - start
  log(f"  {what}: {seconds:.2f} s")
  return out, seconds


__all__ = ["quiet", "timed"]
