"""What the benchmark scripts share: interleaved timing, the environment,
the header of every table, and writing the results.

Used by ``scripts/cpu_benchmark.py``, ``scripts/end_to_end_benchmark.py``
and ``scripts/accelerator_benchmark.py`` (``scripts/benchmark.py``
dispatches to them). Machines are noisy, so compared functions run
interleaved, in alternating order, and the figures are medians.

    times = time_interleaved({"ours": f, "flax": g}, repeats=20)
    median_ms(times["ours"]) / median_ms(times["flax"])
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from mha import cli

if TYPE_CHECKING:  # JAX is imported where it is used: a mistyped flag of a
  # benchmark script answers without it.
  from mha.aliases import Log

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


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def load_average() -> float | None:
  """The 1-minute load average, or None where there is none."""
  try:
    return os.getloadavg()[0]
  except OSError:
    return None


def environment() -> dict[str, Any]:
  """The device, versions and thread count of this run."""
  import flax  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  return {
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M"),
      "platform": device.platform,
      "device": device.device_kind,
      "num_devices": jax.device_count(),
      "cpu": _cpu_model(),
      "threads": len(os.sched_getaffinity(0)) if hasattr(
          os, "sched_getaffinity") else os.cpu_count(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "dtype": "float32",
  }


def header_lines(results: Mapping[str, Any]) -> list[str]:
  """The first lines of every table: the device, versions, date and load
  (``results``: ``environment``, ``load_average_start``/``_end``,
  ``repeats`` and ``plan["name"]``)."""
  env = results["environment"]
  device = (f"{env['platform']} ({env['cpu']}, {env['threads']} threads)"
            if env["platform"] == "cpu" else
            f"{env['platform']} ({env['device']} x {env['num_devices']})")
  load = results["load_average_start"], results["load_average_end"]
  load_text = ("" if None in load else
               f", 1-min load average {load[0]:.1f} at start, {load[1]:.1f} "
               "at end")
  lines = [
      f"Device: {device}; JAX {env['jax']} (jaxlib {env['jaxlib']}), Flax "
      f"{env['flax']}, {env['dtype']}; {env['date_utc']} UTC{load_text}.",
      f"Medians of {results['repeats']} interleaved repeats; ratio = ours / "
      "Flax (below 1: ours is faster).",
  ]
  if results["plan"]["name"] == "quick":
    lines.append("Quick run (tiny shapes, XLA optimizations off): a smoke "
                 "test, not a measurement.")
  return lines


def output_path(out: str, example: str = "benchmark.json") -> str:
  """``out`` expanded and made absolute, checked before any work.

  Raises:
    ValueError: ``out`` is empty or a directory, ends in ``.md`` or ``.png``
      (the table and plot go beside the JSON, under the same name with
      those: one would replace the JSON), or its folder cannot be made or
      written (a file in the way, no permission).
  """
  if not out or not out.strip():
    raise ValueError(f"--out is empty; give a file path such as {example}")
  path = os.path.abspath(os.path.expanduser(out))
  if os.path.isdir(path):
    raise ValueError(f"--out {path} is a directory; give a file path such as "
                     f"{os.path.join(path, example)}")
  suffix = os.path.splitext(path)[1].lower()
  if suffix in (".md", ".png"):
    raise ValueError(f"--out {path} ends in {suffix}, the name of the table or "
                     "plot written beside the results: give a .json path")
  existing = os.path.dirname(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"--out {path}: {existing} is a file, not a folder")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"--out {path}: {existing} is not writable")
  return path


def checked_workdirs_and_out(prog: str, workdirs: Sequence[str] | None,
                             out: str, example: str = "benchmark.json",
                             *, load: bool = False) -> str:
  """The checks of a benchmark over trained runs, before any work: at least
  one workdir, each holding checkpoints (with ``load``, one that loads: not
  every one damaged), and ``out`` not a directory (``example``: the file
  name a message suggests). A mistake is one line and exit 2
  (:func:`mha.cli.fail`). Returns ``out`` made absolute
  (:func:`output_path`)."""
  if not workdirs:
    cli.fail(prog, "give at least one --workdir")
  for workdir in workdirs:
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints) or not any(
        name.isdigit() for name in os.listdir(checkpoints)):
      cli.fail(prog, f"--workdir {workdir} holds no checkpoints")
  out = checked_output_path(prog, out, example)
  if load:
    from mha import checkpoint  # pylint: disable=import-outside-toplevel
    from mha import config_validation  # pylint: disable=import-outside-toplevel
    for workdir in workdirs:
      try:
        checkpoint.load_checkpoint(workdir)
      except (checkpoint.DamagedCheckpointError,
              config_validation.ConfigError) as e:
        cli.fail(prog, f"--workdir {workdir}: {e}")
  return out


def checked_output_path(prog: str, out: str,
                        example: str = "benchmark.json") -> str:
  """:func:`output_path`, a mistake in it one line and exit 2
  (:func:`mha.cli.fail`)."""
  try:
    return output_path(out, example)
  except ValueError as e:
    cli.fail(prog, e)


def write_results(out: str, results: Mapping[str, Any], table: str,
                  log: Log) -> None:
  """Writes ``results`` to ``out`` (JSON) and ``table`` beside it (.md), and
  prints the table."""
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
    f.write(table)
  print(table, end="", flush=True)
  log(f"Wrote {out} and {os.path.splitext(out)[0] + '.md'}")


__all__ = ["Timer", "LayerShape", "time_interleaved", "median_ms",
           "max_relative_diff", "load_average", "environment", "header_lines",
           "output_path", "checked_output_path", "checked_workdirs_and_out",
           "write_results"]
