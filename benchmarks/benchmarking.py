"""What the benchmarks share: interleaved timing, the record of a run (date,
commit, environment) and writing it to ``benchmarks/results/``.

Machines are noisy, so compared functions run interleaved, in alternating
order, and the figures are medians:

    times = time_interleaved({"ours": f, "flax": g}, repeats=20)
    median_ms(times["ours"]) / median_ms(times["flax"])

Every benchmark writes one JSON file, by default
``benchmarks/results/<UTC date>_<name>_<short commit>.json``
(:func:`default_out`), holding :func:`record`'s fields and its figures, and
its table beside it (``.md``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from mha.run import cli

if TYPE_CHECKING:  # JAX is imported where it is used: a mistyped flag of a
  # benchmark script answers without it.
  from mha.aliases import Log

#: The repository's root, and the folder of the results.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

#: The signature of :func:`time_interleaved`.
Timer = Callable[[Mapping[str, Callable[[], Any]], int], dict[str, list]]


@dataclasses.dataclass(frozen=True)
class LayerShape:
  """A self-attention layer's input ``[batch, length, width]`` and heads."""
  batch: int
  length: int
  width: int
  heads: int

  def __str__(self) -> str:
    return f"{self.batch} / {self.length} / {self.width} / {self.heads}"


# --------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------


def time_interleaved(fns: Mapping[str, Callable[[], Any]],
                     repeats: int) -> dict[str, list[float]]:
  """Seconds per call of each function over ``repeats`` interleaved rounds.

  Every function is called once untimed first (compilation). Round ``r`` calls
  them in the given order when ``r`` is even and in reverse when odd, so that
  none always runs right after another (whose freed memory or warm caches it
  would inherit).
  """
  import jax  # pylint: disable=import-outside-toplevel
  for fn in fns.values():
    jax.block_until_ready(fn())
  names = list(fns)
  times = {name: [] for name in names}
  for r in range(repeats):
    for name in names if r % 2 == 0 else reversed(names):
      start = time.perf_counter()
      jax.block_until_ready(fns[name]())
      times[name].append(time.perf_counter() - start)
  return times


def median_ms(seconds: Sequence[float]) -> float:
  """The median of ``seconds``, in milliseconds."""
  return 1e3 * statistics.median(seconds)


def max_relative_diff(a: Any, b: Any) -> float:
  """``max |a - b| / max |b|`` in float32."""
  a, b = (np.asarray(x, np.float32) for x in (a, b))
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def kernels(hlo_text: str) -> int:
  """Fusions and calls of the program's own computations in an optimized HLO
  module (the entry, and the bodies of any loops in it; not the computations
  inside fused kernels): roughly, the kernels XLA compiles and launches."""
  program = "\n".join(
      block for block in hlo_text.split("\n\n")
      if "{" in block and "fus" not in block.split("{", 1)[0].split("(")[0])
  return len(re.findall(r" (?:fusion|dot|custom-call|scatter|gather)\(",
                        program))


def load_average() -> float | None:
  """The 1-minute load average, or None where there is none."""
  try:
    return os.getloadavg()[0]
  except OSError:
    return None


# --------------------------------------------------------------------------
# The run's programs.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunPrograms:
  """A training run's programs as ``mha.train.train_and_evaluate`` makes
  them, over every device.

  Attributes:
    model: the config's model.
    mesh: the run's mesh.
    initial_state: jitted ``() -> state``, onto the run's shardings.
    train_program: ``mha.train._train_program``: the train step jitted
      ``(state, batch, rng) -> (state, metrics)``, one step a call, the state
      donated.
    dropout_rng: the run's dropout key.
  """
  model: Any
  mesh: Any
  initial_state: Any
  train_program: Any
  dropout_rng: Any

  def batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """One batch ``{"inputs", "targets"}`` of ``[batch, length]`` on the
    devices, split as the run splits its batches
    (``mha.run.sharding.batch_sharding``)."""
    from mha.run import sharding  # pylint: disable=import-outside-toplevel
    return sharding.global_batch(batch, sharding.batch_sharding(self.mesh),
                                 next(iter(batch.values())).shape[0])


def run_programs(config: Any) -> RunPrograms:
  """The programs of a run of ``config`` (:class:`RunPrograms`)."""
  # pylint: disable=import-outside-toplevel
  import functools
  import jax
  from mha import build
  from mha import train
  from mha.run import sharding
  # pylint: enable=import-outside-toplevel
  model = build.make_model(config)
  mesh = sharding.make_mesh(config.mesh.data)
  fresh = functools.partial(build.create_train_state, config, model,
                            tx=build.make_optimizer(config))
  abstract = jax.eval_shape(lambda: fresh(build.run_rngs(config)[0]))
  shardings = sharding.state_shardings(abstract, mesh,
                                       shard_params=config.mesh.shard_params)
  return RunPrograms(
      model=model, mesh=mesh,
      initial_state=jax.jit(lambda: fresh(build.run_rngs(config)[0]),
                            out_shardings=shardings),
      train_program=train._train_program(  # pylint: disable=protected-access
          config, model, mesh, shardings),
      dropout_rng=jax.jit(lambda: build.run_rngs(config)[1],
                          out_shardings=sharding.replicated(mesh))())


def random_batches(config: Any, steps: int, seed: int = 0
                   ) -> dict[str, np.ndarray]:
  """``steps`` batches of the config's shape ``[steps, batch, length]``:
  random lengths and symbols, the targets the inputs reversed (the speed of a
  step does not depend on the task)."""
  rng = np.random.default_rng(seed)
  shape = (steps, config.batch_size, config.data.max_len)
  lengths = rng.integers(config.data.min_len, config.data.max_len + 1,
                         shape[:2] + (1,))
  inputs = np.where(np.arange(config.data.max_len) < lengths,
                    rng.integers(1, config.data.num_symbols + 1, shape), 0)
  targets = np.where(inputs != 0, inputs[..., ::-1], 0)
  return {"inputs": inputs.astype(np.int32),
          "targets": targets.astype(np.int32)}


# --------------------------------------------------------------------------
# The record of a run.
# --------------------------------------------------------------------------


def _git(*args: str) -> str | None:
  try:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=30, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return result.stdout.strip() if result.returncode == 0 else None


def commit() -> str:
  """``git rev-parse --short HEAD`` of the repository, "unknown" outside git."""
  return _git("rev-parse", "--short", "HEAD") or "unknown"


def uncommitted_changes() -> bool | None:
  """Whether tracked files differ from the commit (None outside git): the
  figures are then of the commit plus those changes."""
  status = _git("status", "--porcelain", "--untracked-files=no")
  return None if status is None else bool(status)


def _utc_now() -> datetime.datetime:
  return datetime.datetime.now(datetime.timezone.utc)


def default_out(name: str, now: datetime.datetime | None = None) -> str:
  """``benchmarks/results/<UTC date>_<name>_<short commit>.json``; a run of
  the same name, day and commit before this one gets ``_2``, ``_3``, ...
  (a result is never overwritten)."""
  date = (now or _utc_now()).strftime("%Y-%m-%d")
  stem = os.path.join(RESULTS, f"{date}_{name}_{commit()}")
  path, n = f"{stem}.json", 1
  while os.path.exists(path):
    n += 1
    path = f"{stem}_{n}.json"
  return path


def checked_out(prog: str, out: str | None, name: str) -> str:
  """The JSON path of a run: ``--out`` when given, else :func:`default_out`;
  checked before any work (a mistake is one line and exit 2:
  :func:`mha.run.cli.checked_output_path`)."""
  return cli.checked_output_path(prog, out or default_out(name),
                                 f"{name}.json")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def host() -> dict[str, Any]:
  """The machine: its CPU and the CPUs this process may use."""
  return {"cpu": _cpu_model(),
          "threads": len(os.sched_getaffinity(0)) if hasattr(
              os, "sched_getaffinity") else os.cpu_count()}


def record(name: str, **fields: Any) -> dict[str, Any]:
  """The head of a result file: ``benchmark`` (``name``), ``date_utc``,
  ``commit``, ``uncommitted_changes``, ``command``, ``environment``
  (:func:`mha.run.provenance.environment`), ``host`` and
  ``load_average_start``; then ``fields``. :func:`write_results` adds
  ``load_average_end``."""
  from mha.run import provenance  # pylint: disable=import-outside-toplevel
  return {
      "benchmark": name,
      "date_utc": _utc_now().strftime("%Y-%m-%dT%H:%M:%SZ"),
      "commit": commit(),
      "uncommitted_changes": uncommitted_changes(),
      "command": [os.path.relpath(os.path.abspath(sys.argv[0]), ROOT),
                  *sys.argv[1:]],
      "environment": provenance.environment(),
      "host": host(),
      "load_average_start": load_average(),
      **fields,
  }


def header_lines(results: Mapping[str, Any], dtype: str = "float32",
                 rounds: str | None = None) -> list[str]:
  """The first lines of a table: the device, versions, commit, date and
  load (from :func:`record`'s fields), then what the figures are
  (``rounds``; by default medians of ``results["repeats"]`` interleaved
  repeats, ours / Flax)."""
  env, machine = results["environment"], results["host"]
  device = (f"cpu ({machine['cpu']}, {machine['threads']} threads)"
            if env["backend"] == "cpu" else
            f"{env['backend']} ({env['device_kind']} x {env['device_count']})")
  load = results["load_average_start"], results.get("load_average_end")
  load_text = ("" if None in load else
               f", 1-min load average {load[0]:.1f} at start, {load[1]:.1f} "
               "at end")
  dirty = " + uncommitted changes" if results["uncommitted_changes"] else ""
  lines = [
      f"Device: {device}; JAX {env['jax']} (jaxlib {env['jaxlib']}), Flax "
      f"{env['flax']}, {dtype}; commit {results['commit']}{dirty}; "
      f"{results['date_utc']}{load_text}.",
  ]
  lines.append(rounds if rounds is not None else (
      f"Medians of {results['repeats']} interleaved repeats; ratio = ours / "
      "Flax (below 1: ours is faster)."))
  if results.get("quick"):
    lines.append("Quick run (tiny shapes, XLA optimizations off): a smoke "
                 "test, not a measurement.")
  return lines


def write_results(out: str, results: dict[str, Any], table: str,
                  log: Log) -> None:
  """Writes ``results`` to ``out`` (JSON; ``load_average_end`` added unless
  there) and ``table`` beside it (.md), and prints the table."""
  results.setdefault("load_average_end", load_average())
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
    f.write("\n")
  with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
    f.write(table)
  print(table, end="", flush=True)
  log(f"Wrote {out} and {os.path.splitext(out)[0] + '.md'}")


__all__ = ["ROOT", "RESULTS", "Timer", "LayerShape", "time_interleaved",
           "median_ms", "max_relative_diff", "kernels", "load_average",
           "RunPrograms",
           "run_programs", "random_batches", "commit",
           "uncommitted_changes", "default_out", "checked_out", "host",
           "record", "header_lines", "write_results"]
