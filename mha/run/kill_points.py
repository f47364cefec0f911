"""Kill points for the chaos test: ``MHA_TEST_KILL_AT=STEP:PHASE`` makes a
training process kill itself (SIGKILL, as ``kill -9``) at a chosen moment,
so that a test interrupts a run where it means to, not at a wall-clock time.

Phases: ``after_step`` (the train program's call that runs step ``STEP`` has
been dispatched) and ``during_save`` (orbax has begun the asynchronous save
of step ``STEP`` and not been waited for). Unset, nothing happens; the
variable is read at each point, never on import.
"""

from __future__ import annotations

import os
import signal

ENV = "MHA_TEST_KILL_AT"
PHASES = ("after_step", "during_save")


def reached(step: int, phase: str, *, last: int | None = None) -> None:
  """Kills this process if ``MHA_TEST_KILL_AT`` names ``phase`` and a step
  from ``step`` to ``last`` (default: ``step`` alone)."""
  wanted = os.environ.get(ENV)
  if not wanted:
    return
  kill_step, _, kill_phase = wanted.partition(":")
  if kill_phase not in PHASES or not kill_step.isdigit():
    raise ValueError(f"{ENV}={wanted!r} is not STEP:PHASE with a phase of "
                     f"{', '.join(PHASES)}")
  if kill_phase == phase and step <= int(kill_step) <= (last or step):
    os.kill(os.getpid(), signal.SIGKILL)
