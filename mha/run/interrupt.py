"""SIGINT and SIGTERM during long work that is not training: one meaning.

The study and the grid (``scripts/prune_heads.py``,
``scripts/pruning_benchmark.py``) run inside :func:`stop_on_signals`: a
signal at any moment raises :class:`Interrupted` in the main thread (a
``BaseException``, so no ``except Exception`` on the way swallows it), and
the script prints one line and exits with 128 + the signal's number, as
``train.py`` does. While a seed trains, ``mha.train``'s own handlers take
over for the duration of ``train_and_evaluate`` (the steps under way finish
and a checkpoint is saved); its ``TrainingInterrupted`` is turned into
:class:`Interrupted` by the study.

Tests stop a process at a named point with
``MHA_TEST_SIGNAL_AT=<phase>[#<n>][:<SIGNAL>]`` (e.g. ``analysis``,
``cell#2:SIGINT``): :func:`reached` sends the signal (SIGTERM by default) to
the process itself the ``n``-th time (default: the first) that phase is
reached. No timing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: The environment variable of :func:`reached`.
TEST_ENV = "MHA_TEST_SIGNAL_AT"
_times_reached: dict[str, int] = {}


class Interrupted(BaseException):
  """Long work stopped by SIGINT or SIGTERM.

  Attributes:
    signum: the signal.
    detail: what was under way, when known (e.g. a seed's training stopped
      at step N with a checkpoint).
  """

  def __init__(self, signum: int, detail: str = ""):
    self.signum = signum
    self.detail = detail
    super().__init__(f"{signal.Signals(signum).name}"
                     + (f" ({detail})" if detail else ""))

  @property
  def exit_code(self) -> int:
    """128 + the signal's number (130 SIGINT, 143 SIGTERM), as a shell
    reports a process its signal ended."""
    return 128 + self.signum


def _raise(signum: int, frame: Any) -> None:
  del frame
  raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
  """SIGINT and SIGTERM raise :class:`Interrupted` while the block runs; the
  handlers before are put back after. Only in the main thread (elsewhere
  this does nothing); a signal ignored (``SIG_IGN``, e.g. SIGINT under
  ``nohup``) stays ignored."""
  previous = {}
  if threading.current_thread() is threading.main_thread():
    for signum in SIGNALS:
      if signal.getsignal(signum) is not signal.SIG_IGN:
        previous[signum] = signal.signal(signum, _raise)
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def reached(phase: str) -> None:
  """A named point of long work: with
  ``MHA_TEST_SIGNAL_AT=<phase>[#<n>][:<SIGNAL>]`` in the environment, the
  process sends itself the signal (SIGTERM by default) here, the ``n``-th
  time (default 1) ``phase`` is reached. Does nothing otherwise."""
  wanted, _, name = os.environ.get(TEST_ENV, "").partition(":")
  wanted, _, n = wanted.partition("#")
  if wanted != phase:
    return
  _times_reached[phase] = _times_reached.get(phase, 0) + 1
  if _times_reached[phase] == int(n or 1):
    signal.raise_signal(signal.Signals[name or "SIGTERM"])


__all__ = ["Interrupted", "SIGNALS", "TEST_ENV", "stop_on_signals",
           "reached"]
