"""Progress lines of long work: a step timed and reported through a ``Log``.

    value, seconds = timed(print, "leave-one-out", lambda: work())
    # prints "  leave-one-out: 1.23 s"

    tenths = Tenths(print, "subsets", total=63, after_s=10.0)
    tenths(6, "batches of 16 examples")
    # after 10 s, at each tenth: "    subsets: 6/63 batches of 16 examples,
    # 38 s, ETA 361 s"
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


class Tenths:
  """Progress of long work in ``total`` parts: a line at each tenth of
  them, none before ``after_s`` seconds nor at the end."""

  def __init__(self, log: Log, what: str, total: int, after_s: float):
    self.log, self.what, self.total, self.after_s = log, what, total, after_s
    self.start = time.perf_counter()

  def __call__(self, done: int, detail: str) -> None:
    """``done`` parts finished; ``detail`` follows ``done/total``."""
    elapsed = time.perf_counter() - self.start
    if (elapsed > self.after_s and 0 < done < self.total
        and done % max(1, self.total // 10) == 0):
      self.log(f"    {self.what}: {done}/{self.total} {detail}, "
               f"{elapsed:.0f} s, ETA "
               f"{elapsed * (self.total - done) / done:.0f} s")


__all__ = ["quiet", "timed", "Tenths"]
