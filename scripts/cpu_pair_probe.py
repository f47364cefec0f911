r"""Whether this machine's two CPUs are near or far, beside the train step.

    python scripts/cpu_pair_probe.py                # about 2 minutes
    python scripts/cpu_pair_probe.py --seconds=600  # a longer watch
    python scripts/cpu_pair_probe.py --quick        # tiny config, a second

A virtual machine's CPUs run where its host puts them. On the 2-CPU machine
of 2026-11-27 the default train step ran at two speeds, about 4 ms and 6.5
ms a step, switching within seconds; each CPU alone computed and streamed
memory as fast in both (docs/performance.md, "The two speeds"). This script
times the default train step (as ``mha.train`` compiles it, on an all-ones
batch already on the device) in windows of ``--calls`` calls, and after each
window probes the pair of CPUs, without JAX:

* a process on the first CPU reads 1 MB that a process on the second has
  just written, then reads it again (now in its own cache): ``cross /
  local``, the cost of moving the other CPU's writes over;
* a round trip of one byte through two pipes between those processes (µs).

It prints the windows split by the first probe (``far``: the other CPU's
writes at least 5% slower to read than one's own), with the step's median in
each, and writes every window to ``--out`` (JSON; the table next to it,
``.md``). A bad flag, or fewer than two CPUs, is one line on stderr and exit
code 2.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import statistics
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any, Callable

from absl import app
from absl import flags
import jax
import numpy as np

from configs import default
from mha import build
from mha import cli
from mha import sharding as sharding_lib
from mha import train
from mha.benchmarking import (checked_output_path, environment,
                              header_lines, load_average, median_ms,
                              write_results)

_SECONDS = flags.DEFINE_float("seconds", 120.0, "How long to watch (at "
                              "least one window runs).", lower_bound=0.0)
_CALLS = flags.DEFINE_integer("calls", 100, "Train steps a window.",
                              lower_bound=1)
_QUICK = flags.DEFINE_bool("quick", False, "The tiny config, 10 calls a "
                           "window, one second (in place of --seconds and "
                           "--calls): a smoke test.")
_OUT = flags.DEFINE_string("out", "runs/benchmark/cpu_pair_probe.json",
                           "JSON output path; the table goes next to it "
                           "(.md).")

_PROG = "cpu_pair_probe.py"
_BYTES = 1 << 20  # The buffer one CPU writes and the other reads.
FAR = 1.05  # cross / local at or above it: a far pair.


def _partner(cpu: int, name: str, conn: Connection) -> None:
  """The second CPU's process: says it is ready, then on ``b"w"`` dirties
  every line of the shared buffer, on ``b"p"`` answers at once, and on
  ``b"q"`` (or when this process's end of the pipe closes) ends."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main one ends it
  os.sched_setaffinity(0, {cpu})
  memory = shared_memory.SharedMemory(name=name)
  buffer = np.ndarray((_BYTES // 4,), np.float32, buffer=memory.buf)
  try:
    conn.send_bytes(b"r")
    while (command := conn.recv_bytes()) != b"q":
      if command == b"w":
        buffer += 1.0
      conn.send_bytes(b".")
  except (EOFError, OSError):
    pass  # The main process has gone.
  finally:
    del buffer
    memory.close()


class _Pair:
  """The probes of a pair of CPUs: this process (pinned to ``first`` while
  it probes) and a partner process on ``second``."""

  def __init__(self, first: int, second: int):
    self._first = first
    self._memory = shared_memory.SharedMemory(create=True, size=_BYTES)
    self._buffer = np.ndarray((_BYTES // 4,), np.float32,
                              buffer=self._memory.buf)
    self._buffer[:] = 0.0
    self._conn, theirs = multiprocessing.Pipe()
    # Spawned, not forked: this process runs JAX's threads. The partner
    # imports this script (JAX and all) before it says it is ready, so
    # that import is over before anything is timed.
    self._process = multiprocessing.get_context("spawn").Process(
        target=_partner, args=(second, self._memory.name, theirs),
        daemon=True)
    try:
      self._process.start()
      theirs.close()
      if self._conn.recv_bytes() != b"r":
        raise RuntimeError("the partner process did not start")
    except BaseException:
      self.close()
      raise

  def probe(self, rounds: int = 30) -> dict[str, float]:
    """Medians over ``rounds``: µs to read the buffer the partner has just
    written, to read it again, and of a pipe round trip."""
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {self._first})
    cross, local, trip = [], [], []
    try:
      for _ in range(rounds):
        self._conn.send_bytes(b"w")
        self._conn.recv_bytes()
        start = time.perf_counter()
        self._buffer.sum()
        cross.append(time.perf_counter() - start)
        start = time.perf_counter()
        self._buffer.sum()
        local.append(time.perf_counter() - start)
        start = time.perf_counter()
        self._conn.send_bytes(b"p")
        self._conn.recv_bytes()
        trip.append(time.perf_counter() - start)
    finally:
      os.sched_setaffinity(0, everywhere)
    cross_us, local_us = (1e6 * statistics.median(cross),
                          1e6 * statistics.median(local))
    return {"cross_read_us": cross_us, "local_read_us": local_us,
            "cross_over_local": cross_us / local_us,
            "round_trip_us": 1e6 * statistics.median(trip)}

  def close(self) -> None:
    """Ends the partner (killed if it does not end) and frees the buffer;
    raises nothing, so that an error on the way out stays the one seen."""
    try:
      self._conn.send_bytes(b"q")
    except OSError:
      pass  # The partner has gone already.
    if self._process.pid is not None:
      self._process.join(timeout=10)
      if self._process.is_alive():
        self._process.kill()
        self._process.join()
    self._conn.close()
    del self._buffer
    self._memory.close()
    self._memory.unlink()


def _train_step(config: Any) -> Callable[[], None]:
  """``step()``: one call of the train program as ``mha.train`` compiles it,
  running one step (a run's calls run up to ``STEPS_PER_CALL``: this times
  a step with a call's own cost), its state threaded through, waited for."""
  model = build.make_model(config)
  state = jax.jit(functools.partial(build.create_train_state, config, model))(
      jax.random.key(config.seed))
  mesh = sharding_lib.make_mesh()
  shardings = sharding_lib.state_shardings(state, mesh, shard_params=False)
  jitted, args = train.train_step_program(config, model, mesh, shardings,
                                          state)
  compiled = jitted.lower(*args).compile(train.step_compiler_options())
  tokens = jax.device_put(
      np.ones((train.STEPS_PER_CALL, config.batch_size, config.data.max_len),
              np.int32), sharding_lib.block_sharding(mesh))
  batches = {"inputs": tokens, "targets": tokens}
  rng = jax.device_put(jax.random.key(1), sharding_lib.replicated(mesh))
  leaves = [jax.device_put(x, s) for x, s in
            zip(jax.tree.leaves(state), jax.tree.leaves(shardings))]

  def step() -> None:  # a call of one step
    nonlocal leaves
    leaves, metrics = compiled(leaves, batches, np.int32(1), rng)
    jax.block_until_ready(metrics)

  step()  # The first call sets its kernels up.
  return step


def watch(config: Any, seconds: float, calls: int, cpus: tuple[int, int]
          ) -> list[dict[str, Any]]:
  """Windows of ``calls`` train steps, each followed by the pair's probe,
  for ``seconds`` (at least one window)."""
  step = _train_step(config)
  pair = _Pair(*cpus)
  windows = []
  try:
    end = time.perf_counter() + seconds
    while not windows or time.perf_counter() < end:
      times = []
      for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
      windows.append({"time_utc": time.strftime("%H:%M:%S", time.gmtime()),
                      "step_ms": median_ms(times),
                      **pair.probe()})
  finally:
    pair.close()
  return windows


def summary(windows: list[dict[str, Any]]
            ) -> dict[str, dict[str, float | None]]:
  """Per kind of window (``near``, ``far``): how many, and the medians."""
  out = {}
  for kind, group in (
      ("near", [w for w in windows if w["cross_over_local"] < FAR]),
      ("far", [w for w in windows if w["cross_over_local"] >= FAR])):
    out[kind] = {"windows": len(group)}
    for key in ("step_ms", "cross_over_local", "round_trip_us"):
      out[kind][key] = (statistics.median(w[key] for w in group)
                        if group else None)
  return out


def table(results: dict[str, Any]) -> str:
  """The markdown table of :func:`summary`."""
  lines = header_lines({**results, "plan": {"name": results["plan_name"]},
                        "repeats": len(results["windows"])})[:1]
  if results["plan_name"] == "quick":
    lines.append("Quick run (the tiny config, a second): a smoke test, not a "
                 "measurement.")
  lines += [
      f"The train step of `configs/default.py:{results['config_arg']}` in "
      f"windows of {results['calls']} calls, each followed by the CPU pair's "
      f"probe (CPUs {results['cpus'][0]} and {results['cpus'][1]}); medians "
      f"over the windows; far: a read of 1 MB the other CPU just wrote takes "
      f">= {FAR:.2f}x a read of it from one's own cache.", "",
      "| CPU pair | windows | train step, ms | other's writes / own, read "
      "time | pipe round trip, us |",
      "| --- | ---: | ---: | ---: | ---: |"]
  for kind, row in results["summary"].items():
    cells = ["" if row[key] is None else format(row[key], spec)
             for key, spec in (("step_ms", ".2f"), ("cross_over_local", ".3f"),
                               ("round_trip_us", ".1f"))]
    lines.append(f"| {kind} | {row['windows']} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  out = checked_output_path(_PROG, _OUT.value, "cpu_pair_probe.json")
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < 2:
    cli.fail(_PROG, f"needs two CPUs to probe; this process may run on "
             f"{len(cpus)}")
  config_arg = "tiny" if _QUICK.value else ""
  config = default.get_config(config_arg)
  seconds = 1.0 if _QUICK.value else _SECONDS.value
  calls = 10 if _QUICK.value else _CALLS.value
  results = {"environment": environment(), "load_average_start":
             load_average(), "plan_name": "quick" if _QUICK.value else "full",
             "config_arg": config_arg, "calls": calls,
             "cpus": cpus[:2]}
  windows = watch(config, seconds, calls, (cpus[0], cpus[1]))
  results.update(load_average_end=load_average(), windows=windows,
                 summary=summary(windows))
  write_results(out, results, table(results), print)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
