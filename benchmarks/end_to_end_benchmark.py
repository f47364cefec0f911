r"""The default run end to end, from process start, beside the PyTorch peer.

    python benchmarks/end_to_end_benchmark.py            # 3 rounds, about 2 minutes
    python benchmarks/end_to_end_benchmark.py --quick    # the tiny config, one round
    python benchmarks/end_to_end_benchmark.py --peer_python=/path/to/venv/bin/python

Spawns ``train.py`` processes, cold (a fresh compilation cache) and warm (the
same config again, its programs loaded from that cache), beside the import
floor (a process that imports JAX, Flax, optax and orbax) and the PyTorch
peer (``benchmarks/torch_peer.py``: a plain ``nn.TransformerEncoder`` of the
same shape on the same arrays, batches, optimizer, schedule and evaluation
cadence), and times them from process start: to the end of the first step, to
the first validation with exact match >= 99%, and to exit; and the
milliseconds a train step takes between evaluations, as ``train.py``'s
progress lines time it (the peer's the same way).

torch is no dependency of ``mha``: the peer runs under ``--peer_python``
(default: this interpreter), an interpreter that can import torch and NumPy,
e.g. a virtual environment of its own. Where the default cannot import
torch the peer is left out (said on stderr and in the results); a
``--peer_python`` given that cannot is a mistake.

Prints the tables, writes every run to ``--out`` (JSON; by default
``benchmarks/results/<UTC date>_end_to_end_<commit>.json``) and the tables
beside it (``.md``). A bad flag is one line on stderr and exit code 2.
(``python benchmarks/benchmark.py --end_to_end`` runs this.)
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

# Run as a file, the path holds this folder, not the repository's root: put
# it first, for the ``benchmarks`` package (which is not installed) and this
# checkout's ``mha`` (whose commit the results record).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags
from absl import logging
import numpy as np

from configs import default
from mha import build
from mha import data
from mha.run import cli

from benchmarks.benchmarking import (
    checked_out, header_lines, load_average, record, write_results)

_QUICK = flags.DEFINE_bool(
    "quick", False, "The tiny config, one round: a smoke test of seconds "
    "whose numbers mean nothing.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_end_to_end_<commit>.json); the markdown tables go next to it "
    "(.md).")
_ROUNDS = flags.DEFINE_integer(
    "end_to_end_rounds", None, "Rounds (default 3; 1 with --quick); the "
    "figures are medians over them.", lower_bound=1)
_PEER = flags.DEFINE_bool(
    "peer", True, "Also run the PyTorch peer (benchmarks/torch_peer.py) "
    "under --peer_python.")
_PEER_PYTHON = flags.DEFINE_string(
    "peer_python", sys.executable, "The Python interpreter that runs the "
    "PyTorch peer: one that imports torch and NumPy (torch is no dependency "
    "of mha). Default: this interpreter, the peer left out if it cannot "
    "import torch.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "The TFDS data directory (default: the config's "
    "data.data_dir); the data is prepared before any run is timed.")

_PROG = "end_to_end_benchmark.py"

# --------------------------------------------------------------------------
# End to end: train.py processes from start to exit.
# --------------------------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PEER_SCRIPT = os.path.join(_ROOT, "benchmarks", "torch_peer.py")
EXACT_MATCH_GOAL = 0.99  # "trained": validation exact match at least this


def _spawn(command: Sequence[str], what: str) -> tuple[float, str]:
  """Runs ``command`` from the repository root; returns its start (Unix
  seconds, just before the fork) and its stdout. Raises if it fails."""
  start = time.time()
  result = subprocess.run(list(command), cwd=_ROOT, capture_output=True,
                          text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{what} exited with {result.returncode}: "
                       f"{result.stderr.strip()[-2000:]}")
  return start, result.stdout


def _timeline(start: float, end: float, workdir: str) -> dict[str, Any]:
  """Seconds from ``start`` to the end of the first step, to the first
  validation with exact match >= ``EXACT_MATCH_GOAL``, and to ``end``, read
  off ``workdir/metrics.jsonl`` (every row has its ``time``)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  first = next(r for r in rows if "startup/seconds_since_process_start" in r)
  trained = next((r for r in rows if r.get("validation/exact_match", 0)
                  >= EXACT_MATCH_GOAL), None)
  # The progress windows' milliseconds a step (evaluations and checkpoints
  # left out), but the first window's, which holds the start-up.
  windows = [1e3 / r["steps_per_sec"] for r in rows
             if r.get("steps_per_sec")][1:]
  return {
      "first_step_s": first["time"] - start,
      "trained_s": None if trained is None else trained["time"] - start,
      "trained_step": None if trained is None else trained["step"],
      "exit_s": end - start,
      "step_ms": statistics.median(windows) if windows else None,
      "programs": first.get("startup/programs_compiled"),
      "programs_from_cache": first.get("startup/programs_from_cache"),
  }


def _compiled(stdout: str) -> dict[str, int] | None:
  """The counts of train.py's line "Compiled in this run: ...": programs
  compiled, ``from_cache`` of them loaded from the compilation cache."""
  line = re.search(r"Compiled in this run: (.*)", stdout)
  if line is None:
    return None
  match = re.match(r"(\d+) programs?(?:, (all|\d+) of them loaded)?",
                   line.group(1))
  programs = int(match.group(1)) if match else 0
  hits = match.group(2) if match else None
  return {"programs": programs,
          "from_cache": programs if hits == "all" else int(hits or 0)}


def _train_run(arg: str, workdir: str, cache_dir: str,
               data_dir: str) -> dict[str, Any]:
  """One ``python train.py`` of ``get_config(arg)``, timed."""
  start, stdout = _spawn(
      [sys.executable, "train.py", f"--workdir={workdir}",
       f"--config=configs/default.py:{arg}",
       f"--config.compilation_cache_dir={cache_dir}",
       f"--config.data.data_dir={data_dir}"], "train.py")
  end = time.time()
  return {**_timeline(start, end, workdir), "run": _compiled(stdout)}


def _floor_run() -> dict[str, Any]:
  """The import floor: a process that imports JAX, Flax, optax and orbax."""
  start, _ = _spawn([sys.executable, "-c",
                     "import jax, flax, optax, orbax.checkpoint"], "floor")
  return {"exit_s": time.time() - start}


def _peer_inputs(config, splits: Mapping[str, Any], directory: str
                 ) -> tuple[str, str]:
  """The data (``.npz``) and config (JSON) of the PyTorch peer."""
  arrays = {f"{name}_{key}": getattr(split, key)
            for name, split in splits.items() for key in ("inputs", "targets")}
  data_path = os.path.join(directory, "peer_data.npz")
  np.savez(data_path, **arrays)
  keys = ("seed", "batch_size", "eval_batch_size", "num_train_steps",
          "learning_rate", "warmup_steps", "weight_decay", "adam_b2",
          "grad_clip_norm", "eval_every_steps")
  peer = {key: config[key] for key in keys}
  peer["model"] = config.model.to_dict()
  peer["vocab_size"] = data.vocab_size(config.task, config.data.num_symbols,
                                       config.data.max_len)
  config_path = os.path.join(directory, "peer_config.json")
  with open(config_path, "w", encoding="utf-8") as f:
    json.dump(peer, f)
  return data_path, config_path


def peer_problem(python: str) -> str | None:
  """Why ``python`` cannot run the peer (it cannot import torch and NumPy,
  or is no interpreter), or None when it can."""
  try:
    result = subprocess.run([python, "-c", "import numpy, torch"],
                            capture_output=True, text=True, timeout=300,
                            check=False)
  except OSError as e:
    return f"--peer_python {python}: {e.strerror or e}"
  except subprocess.TimeoutExpired:
    return f"--peer_python {python}: importing torch took over 300 s"
  if result.returncode:
    last = (result.stderr.strip().splitlines() or ["exit code "
                                                   f"{result.returncode}"])
    return f"--peer_python {python} cannot import torch: {last[-1]}"
  return None


def _peer_run(python: str, inputs: tuple[str, str], out: str
              ) -> dict[str, Any]:
  """One run of ``benchmarks/torch_peer.py`` under ``python``, timed like
  ``train.py``; with the peer's versions (``environment``)."""
  data_path, config_path = inputs
  start, _ = _spawn([python, _PEER_SCRIPT, f"--data={data_path}",
                     f"--config={config_path}", f"--out={out}"],
                    "torch_peer.py")
  timeline = _timeline(start, time.time(), out)
  with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
    header = json.loads(f.readline())
  return {**timeline, "environment": header.get("environment")}


def _median(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
  values = [r[key] for r in runs if r.get(key) is not None]
  return statistics.median(values) if len(values) == len(runs) else None


def end_to_end(arg: str, rounds: int, data_dir: str | None,
               peer_python: str | None,
               log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
  """Cold and warm ``train.py`` runs of ``get_config(arg)``, the import floor
  and (with a ``peer_python``) the PyTorch peer, ``rounds`` times.

  The data is prepared first. A cold run gets a fresh compilation cache
  directory, the warm run right after it the same one; every run a fresh
  workdir. The floor, the cold-warm pair and the peer take turns, in the
  reverse order every other round. Times are from just before the fork.
  """
  config = default.get_config(arg)
  data_dir = data_dir or config.data.data_dir
  splits = data.load_splits(build.data_spec(config), data_dir)
  peer = peer_python is not None
  runs: dict[str, list[dict[str, Any]]] = {
      "floor": [], "cold": [], "warm": [], **({"peer": []} if peer else {})}
  with tempfile.TemporaryDirectory(prefix="mha-end-to-end-") as tmp:
    inputs = _peer_inputs(config, splits, tmp) if peer else None
    for r in range(rounds):
      cache = os.path.join(tmp, f"cache{r}")
      steps = {
          "floor": _floor_run,
          "cold": lambda: _train_run(arg, os.path.join(tmp, f"cold{r}"),
                                     cache, data_dir),
          "warm": lambda: _train_run(arg, os.path.join(tmp, f"warm{r}"),
                                     cache, data_dir),
          "peer": lambda: _peer_run(peer_python, inputs,
                                    os.path.join(tmp, f"peer{r}")),
      }
      # A warm run right after its cold one; the rest in turns.
      blocks = [["floor"], ["cold", "warm"], *([["peer"]] if peer else [])]
      for block in blocks if r % 2 == 0 else reversed(blocks):
        for kind in block:
          log(f"end to end, round {r + 1}/{rounds}: {kind}")
          runs[kind].append(steps[kind]())
  return {"config_arg": arg, "rounds": rounds, "runs": runs,
          "summary": _end_to_end_summary(runs)}


def _end_to_end_summary(runs: Mapping[str, Sequence[Mapping[str, Any]]]
                        ) -> dict[str, Any]:
  """Medians of every kind and the ratios the goals are stated in."""
  medians = {kind: {key: _median(rs, key) for key in
                    ("first_step_s", "trained_s", "exit_s", "step_ms")
                    if key in rs[0]}
             for kind, rs in runs.items() if rs}
  ratio = lambda a, b: None if None in (a, b) else a / b
  warm, cold, floor = medians["warm"], medians["cold"], medians["floor"]
  summary = {"medians": medians, "ratios": {
      "warm_first_step_over_floor": ratio(warm["first_step_s"],
                                          floor["exit_s"]),
      "cold_first_step_over_floor": ratio(cold["first_step_s"],
                                          floor["exit_s"])}}
  if "peer" in medians:
    peer = medians["peer"]["trained_s"]
    summary["ratios"]["warm_trained_over_peer"] = ratio(warm["trained_s"],
                                                        peer)
    summary["ratios"]["cold_trained_over_peer"] = ratio(cold["trained_s"],
                                                        peer)
    # The per-step goal, as the progress lines show it: the warm
    # run's (the same program as the cold run's) against the peer's.
    summary["ratios"]["train_step_over_peer"] = ratio(
        warm.get("step_ms"), medians["peer"].get("step_ms"))
  return summary


def format_end_to_end(results: Mapping[str, Any]) -> str:
  """The markdown report of :func:`end_to_end` (header from ``run``'s)."""
  e2e = results["end_to_end"]
  summary = e2e["summary"]
  lines = header_lines(results, rounds="")[:1] + [
      f"End to end: `python train.py --config configs/default.py:"
      f"{e2e['config_arg']}`, data prepared; medians of {e2e['rounds']} "
      f"rounds, seconds from process start. Trained = the first validation "
      f"with exact match >= {EXACT_MATCH_GOAL}. Ms a step: the median of the "
      f"progress windows between evaluations (their time left out, as in "
      f"train.py's steps/s), the first window (start-up) aside.", *(
          ["Quick run (the tiny config, one round): a smoke test, not a "
           "measurement."] if results["quick"] else []), "",
      "| process | to end of first step | to trained | to exit | ms a step "
      "| each run (to trained; floor: to exit) |",
      "| --- | ---: | ---: | ---: | ---: | --- |"]
  labels = {"floor": "import floor (`import jax, flax, optax, "
                     "orbax.checkpoint`)",
            "cold": "train.py, cold (empty compilation cache)",
            "warm": "train.py, warm (same config again)",
            "peer": "PyTorch peer (`nn.TransformerEncoder`)"}
  cell = lambda v: "" if v is None else f"{v:.2f}"
  for kind, median in summary["medians"].items():
    per_run = " / ".join(cell(r.get("trained_s", r["exit_s"]))
                         for r in e2e["runs"][kind])
    lines.append(f"| {labels[kind]} | {cell(median.get('first_step_s'))} | "
                 f"{cell(median.get('trained_s'))} | "
                 f"{cell(median['exit_s'])} | {cell(median.get('step_ms'))} "
                 f"| {per_run} |")
  lines += ["", "| ratio | median |", "| --- | ---: |"]
  for name, value in summary["ratios"].items():
    lines.append(f"| {name.replace('_', ' ')} | {cell(value)} |")
  compiled = [(kind, r["run"]) for kind in ("cold", "warm")
              for r in e2e["runs"][kind][:1]]
  lines += ["", "Programs compiled: " + "; ".join(
      f"{kind} {c['programs']} ({c['from_cache']} from the cache)"
      for kind, c in compiled if c) + "."]
  if e2e.get("peer_note"):
    lines.append(f"No PyTorch peer: {e2e['peer_note']}.")
  elif e2e["runs"].get("peer"):
    env = e2e["runs"]["peer"][0].get("environment") or {}
    lines.append(f"PyTorch peer: torch {env.get('torch')}, "
                 f"{env.get('torch_threads')} threads, Python "
                 f"{env.get('python')}.")
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  name = "end_to_end_quick" if _QUICK.value else "end_to_end"
  out = checked_out(_PROG, _OUT.value, name)
  data_dir = cli.data_dir(_PROG, _DATA_DIR.value)
  logging.set_verbosity(logging.WARNING)
  log = lambda message: print(message, file=sys.stderr, flush=True)
  peer_python, peer_note = None, "--nopeer"
  if _PEER.value:
    peer_note = peer_problem(_PEER_PYTHON.value)
    if peer_note is None:
      peer_python = _PEER_PYTHON.value
    elif _PEER_PYTHON.present:
      cli.fail(_PROG, peer_note)
    else:
      log(f"Leaving out the PyTorch peer: {peer_note} (name an interpreter "
          "that can with --peer_python)")
  rounds = _ROUNDS.value or (1 if _QUICK.value else 3)
  results = record(name, quick=_QUICK.value)
  try:
    results["end_to_end"] = end_to_end(
        "tiny" if _QUICK.value else "", rounds, data_dir, peer_python, log)
  except data.DataDirError as e:  # One that cannot be used: before any run.
    cli.fail(_PROG, e)
  results["end_to_end"]["peer_python"] = peer_python
  results["end_to_end"]["peer_note"] = peer_note
  results["load_average_end"] = load_average()
  write_results(out, results, format_end_to_end(results), log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
