"""A benchmark of pruning methods against the exact oracle: the study over a
grid of tasks x models, resumable and shared by several processes.

Each cell (a task and a model variant of ``configs/default.py``) is one
training run and one study (:func:`mha.pruning.study.run`) in
``<root>/<task>-<model>/``: ``train/`` holds the first seed's run,
``pruning/`` the study (its ``results.json``, the other seeds), and
``cell.json`` the cell's outcome (``done`` or ``failed``, the error, the
seconds it took, who ran it). The grid's table is made from the finished
cells' ``results.json`` only: the study's output is the boundary.

* **Resuming.** A cell whose ``cell.json`` says ``done`` is never redone. A
  cell interrupted half-way is taken up where it stopped: its training
  resumes from the newest checkpoint and the study reuses the seeds already
  trained. A failed cell is marked in the table and tried again on the next
  run (its error may have been fixed).
* **Several processes.** A process claims a cell through the cell folder's
  :class:`mha.run.workdir_lock.WorkdirLock` (``flock``, released by the kernel
  however the process ends) and skips a cell that another one holds; so
  several shells, a SLURM job array or hosts sharing a filesystem can run
  one grid together. Each process writes the table from the cells finished
  when it ends (atomically: a reader never sees half a file); while a cell
  is pending or running elsewhere that table says INTERIM in its first
  line, and the process that finishes the last cell writes the final one.
* **One grid per folder.** ``<root>/grid.json`` records the settings every
  cell must share (the study's options and the config overrides); a run
  with other settings is refused (:class:`GridMismatchError`). Tasks and
  models may be added to a grid later.

The leaderboard ranks each method by its AUC gap to the oracle (token
accuracy), averaged over the cells that have the oracle; its interval
combines the cells' intervals (each a two-level bootstrap over seeds and
examples) as independent normal errors: tasks and models are fixed, seeds
and examples are the random part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import socket
import tempfile
import time
import traceback
from typing import (TYPE_CHECKING, Any, Callable, Iterator, Mapping,
                    Sequence)

import numpy as np

from mha.run import config_validation
from mha.run import interrupt
from mha.run import workdir_lock
from mha.pruning.study import markdown as md
from mha.pruning.study.options import StudyOptions

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
  from matplotlib.figure import Figure

  from mha.aliases import Log  # Imports JAX, which the flags do without.

#: The default grid: the tasks, and two models of 12 heads with spare heads
#: (``wide6``, 2 x 6, and ``wide``, 2 x 8 = 16 heads, are added with
#: ``--models deep,deep64,wide6,wide``).
TASKS = ("reverse", "sort", "histogram", "spell")
MODELS = ("deep", "deep64")
CELL_FILE = "cell.json"
GRID_FILE = "grid.json"
TABLE_LOCK_FILE = "table.lock"
#: The method whose gap every other method's is measured against.
REFERENCE = "oracle"
#: A method's seconds per seed: the study's timing that computes it (the
#: leave-one-out values and exact Shapley values are read off the oracle's
#: subset sums, so their own time is that of the look-up).
TIMING_KEYS = {"gradient_l2": "gradient_s", "reverse_gradient": "gradient_s",
               "entropy": "confidence_s"}
_Z = 1.959963984540054  # The normal 97.5% quantile.


class GridMismatchError(config_validation.ConfigError):
  """The grid folder was started with other settings (a user's mistake)."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One task x model cell of the grid."""

  task: str
  model: str

  @property
  def name(self) -> str:
    """``task-model``: the cell's folder in the grid."""
    return f"{self.task}-{self.model}"

  def config_arg(self, overrides: Sequence[str]) -> str:
    """The argument of ``configs/default.py``'s ``get_config``."""
    return ",".join([self.task, self.model, *overrides])


def cells(tasks: Sequence[str], models: Sequence[str]) -> list[Cell]:
  """Every cell, task by task."""
  return [Cell(t, m) for t in tasks for m in models]


# The guess of a cell's seconds (:func:`expected_seconds`), per seed: about
# _SECONDS_PER_STEP_AND_LAYER a training step and a layer (at these sizes a
# step is bound by launches, not arithmetic); for the study,
# _SECONDS_PER_POSITION_AND_PARAMETER a position of the longest sequence and
# a parameter of the blocks; and the oracle's own guess,
# mha.pruning.oracle.expected_seconds (3.5 ms a subset of heads). Fitted to the grid of 2026-11-27 06:53 UTC
# (two processes sharing 2 cores, 3 seeds, the default study options): its
# eight cells took 338-934 s and are guessed at 322-1,111 s, each within 23%
# in sample (four distinct configs: reverse, sort and histogram look alike
# to the guess). On the next grid (08:11) the guesses ran from 3% under to
# 53% over its cells, and its order still finished 1.3 min after the best
# split of those cells between two processes (38.4 against 37.1 min).
_SECONDS_PER_STEP_AND_LAYER = 0.020
_SECONDS_PER_POSITION_AND_PARAMETER = 1.6e-4


def expected_seconds(cell: Cell, options: StudyOptions,
                     overrides: Sequence[str] = ()) -> float:
  """A rough guess of the cell's seconds on 2 cores, from its config alone.

  ``overrides`` are the grid's config overrides (``--overrides``), applied
  as the cell's run applies them. Of the study's options only
  ``num_seeds`` and ``oracle_max_heads`` count: the costly extras
  (``--retrain``, ``--gates``, ``--speed``) are not in the guess. Only the
  order of the cells depends on it (:func:`schedule`): a guess that is off
  by a third still puts the long cells first. ``0.0`` for a cell whose
  config cannot be built (it fails when it runs, and is marked).
  """
  # pylint: disable=import-outside-toplevel
  from configs import default
  from mha import build
  from mha.pruning import oracle
  # pylint: enable=import-outside-toplevel
  try:
    config = default.get_config(cell.config_arg(overrides))
    model = build.model_config(config)
  except Exception:  # pylint: disable=broad-except
    return 0.0
  heads = sum(model.heads_per_layer)
  width = heads * model.resolved_head_dim  # All heads' queries (keys, ...).
  parameters = (4 * model.d_model * width
                + 2 * model.num_layers * model.d_model * model.mlp_dim)
  per_seed = (_SECONDS_PER_STEP_AND_LAYER * config.num_train_steps
              * model.num_layers
              + _SECONDS_PER_POSITION_AND_PARAMETER * config.data.max_len
              * parameters)
  if heads <= options.oracle_max_heads:
    per_seed += oracle.expected_seconds(model)
  return options.num_seeds * per_seed


def schedule(grid_cells: Sequence[Cell], options: StudyOptions,
             overrides: Sequence[str] = ()) -> list[Cell]:
  """The order a process tries the cells in: the longest expected first.

  With several processes sharing a grid, each takes the next cell free in
  this order, so the longest cells start first and the short ones fill in
  at the end (the longest-processing-time rule), instead of a long cell
  starting last while the other processes sit idle: in the grid of
  2026-11-27 06:53 UTC, run task by task, the longest cell (`spell-deep64`,
  934 s) ran last and one of two processes sat idle for its last 11 minutes
  (47.6 min in all); its cell times in this order work out at 43 min, and
  the next grid, run in this order, took 38.4 min. Ties keep the given
  order.
  """
  guess = {cell: expected_seconds(cell, options, overrides)
           for cell in grid_cells}
  return sorted(grid_cells, key=lambda cell: -guess[cell])


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[str]:
  """A temporary file beside ``path`` (unique: several processes may write
  ``path`` at once), renamed to ``path`` when the block ends without error:
  a reader never sees half a file."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-",
                             suffix=os.path.splitext(path)[1])
  os.close(fd)
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _write_json(path: str, value: Any) -> None:
  """Writes ``value`` to ``path`` atomically."""
  with _replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1)


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def grid_settings(options: StudyOptions,
                  overrides: Sequence[str]) -> dict[str, Any]:
  """What every cell of one grid shares."""
  return {"options": json.loads(json.dumps(dataclasses.asdict(options))),
          "overrides": list(overrides)}


def check_grid(root: str, settings: Mapping[str, Any]) -> None:
  """Raises :class:`GridMismatchError` when ``root`` holds a grid started
  with other settings, or holds no grid but what a grid would overwrite or
  mix with (a ``results.json``, a training run's checkpoints); writes
  nothing."""
  recorded = _read_json(os.path.join(root, GRID_FILE))
  if recorded is None:
    _check_not_another_folder(root)
    return
  # An option added to the study after the grid started reads as its
  # default there (which is what the grid's cells ran with).
  defaults = grid_settings(StudyOptions(), ())["options"]
  recorded = dict(recorded, options={
      **{k: v for k, v in defaults.items() if k not in recorded["options"]},
      **recorded["options"]})
  for key in ("overrides", "options"):
    if recorded.get(key) != settings[key]:
      if key == "options":
        diff = sorted(k for k in settings[key]
                      if recorded[key].get(k) != settings[key][k])
        what = "study options " + ", ".join(
            f"{k} (grid: {recorded[key].get(k)!r}, here: "
            f"{settings[key][k]!r})" for k in diff[:3])
      else:
        what = (f"config overrides (grid: {recorded[key]!r}, here: "
                f"{settings[key]!r})")
      raise GridMismatchError(
          f"{root} holds a grid with other {what}; use another folder or "
          "the grid's settings")


def _check_not_another_folder(root: str) -> None:
  """Raises :class:`GridMismatchError` when ``root``, which holds no grid,
  holds what the grid would overwrite or mix with: a study's (or any)
  ``results.json``, or a training run (its checkpoints)."""
  if os.path.lexists(os.path.join(root, "results.json")):
    raise GridMismatchError(
        f"{root} holds a results.json but no grid ({GRID_FILE}), e.g. a "
        "pruning study's; the grid would overwrite it: use another folder")
  if os.path.isdir(os.path.join(root, "checkpoints")):
    raise GridMismatchError(
        f"{root} is a training run's workdir (it holds checkpoints/), not a "
        "grid's: use another folder")


def cell_status(root: str, cell: Cell) -> str:
  """``done``, ``failed`` or ``pending`` (not started, or interrupted)."""
  record = _read_json(os.path.join(root, cell.name, CELL_FILE)) or {}
  status = record.get("status")
  if status == "done" and os.path.exists(
      os.path.join(root, cell.name, "pruning", "results.json")):
    return "done"
  return "failed" if status == "failed" else "pending"


def _run_cell(root: str, cell: Cell, options: StudyOptions,
              overrides: Sequence[str], log: Log) -> None:
  """Trains the cell's first seed (resuming) and runs its study."""
  # pylint: disable=import-outside-toplevel
  from configs import default
  from mha.pruning import study
  from mha.pruning.study import seeds
  config = default.get_config(cell.config_arg(overrides))
  directory = os.path.join(root, cell.name)
  seeds.train_seed(config, os.path.join(directory, "train"),
                   "its first seed")
  study.run(os.path.join(directory, "train"),
            os.path.join(directory, "pruning"), options, log=log)


def run_grid(root: str, grid_cells: Sequence[Cell], options: StudyOptions,
             overrides: Sequence[str] = (), log: Log = print,
             max_cells: int | None = None,
             run_cell: Callable[..., None] = _run_cell) -> dict[str, int]:
  """Runs every cell of ``grid_cells`` not yet done (nor held by another
  process), at most ``max_cells`` of them, the longest expected first
  (:func:`schedule`); then writes the table (in the given order).

  A cell that raises is recorded as failed (its error's last line) and the
  grid goes on. Returns how many cells this process ran, found done, found
  held by another process, and saw fail.

  Raises:
    GridMismatchError: ``root`` holds a grid with other settings.
  """
  root = os.path.abspath(os.path.expanduser(root))
  settings = grid_settings(options, overrides)
  check_grid(root, settings)
  os.makedirs(root, exist_ok=True)
  if not os.path.exists(os.path.join(root, GRID_FILE)):
    _write_json(os.path.join(root, GRID_FILE), settings)
  counts = {"ran": 0, "done_before": 0, "held_elsewhere": 0, "failed": 0}
  for i, cell in enumerate(schedule(grid_cells, options, overrides)):
    if cell_status(root, cell) == "done":
      counts["done_before"] += 1
      continue
    if max_cells is not None and counts["ran"] >= max_cells:
      break
    lock = workdir_lock.WorkdirLock(os.path.join(root, cell.name))
    try:
      lock.acquire()
    except workdir_lock.WorkdirLockedError:
      log(f"[{i + 1}/{len(grid_cells)}] {cell.name}: another process runs "
          "it; next cell")
      counts["held_elsewhere"] += 1
      continue
    try:
      if cell_status(root, cell) == "done":  # Finished while we looked.
        counts["done_before"] += 1
        continue
      log(f"[{i + 1}/{len(grid_cells)}] {cell.name}: training and study "
          f"in {os.path.join(root, cell.name)}")
      start = time.perf_counter()
      record = {"task": cell.task, "model": cell.model,
                "config": cell.config_arg(overrides), "pid": os.getpid(),
                "host": socket.gethostname()}
      try:
        interrupt.reached("cell")  # A test's signal as a cell starts.
        run_cell(root, cell, options, overrides, log)
      except interrupt.Interrupted as e:  # Pending: the next run resumes it.
        raise interrupt.Interrupted(e.signum, f"cell {cell.name} under way"
                                    + (f"; {e.detail}" if e.detail else "")
                                    ) from None
      except Exception as e:  # pylint: disable=broad-except
        counts["failed"] += 1
        last = str(e).strip().splitlines()[-1:]
        error = ": ".join([type(e).__name__, *last])
        log(f"[{i + 1}/{len(grid_cells)}] {cell.name} FAILED ({error}); "
            "the grid goes on")
        _write_json(os.path.join(root, cell.name, CELL_FILE), record | {
            "status": "failed", "error": error,
            "traceback": traceback.format_exc(limit=8),
            "seconds": time.perf_counter() - start})
      else:
        counts["ran"] += 1
        seconds = time.perf_counter() - start
        log(f"[{i + 1}/{len(grid_cells)}] {cell.name} done in "
            f"{seconds:.0f} s")
        _write_json(os.path.join(root, cell.name, CELL_FILE), record | {
            "status": "done", "seconds": seconds,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                      time.gmtime())})
    finally:
      lock.release()
  write_table(root, grid_cells, log)
  return counts


# --------------------------------------------------------------------------
# The table, from the finished cells' results.json.
# --------------------------------------------------------------------------


def _method_seconds(results: Mapping[str, Any], method: str) -> float | None:
  """Mean seconds per seed of ``method``'s computation, if timed."""
  key = TIMING_KEYS.get(method, f"{method}_s")
  values = [s["timings"][key] for s in results["seeds"]
            if key in s.get("timings", {})]
  return float(np.mean(values)) if values else None


#: The counts of a method's ``cost`` (results.json) the grid averages.
COST_COUNTS = ("subset_evaluations", "forward_passes", "backward_passes")


def _method_cost(results: Mapping[str, Any], method: str) -> dict[str, Any]:
  """The mean per seed of ``method``'s ``cost`` counts (subsets evaluated,
  forward and backward passes), and its seconds as ``seconds_per_seed``
  where the cost has them; nothing where the results have no cost."""
  costs = [s["cost"][method] for s in results["seeds"]
           if method in s.get("cost", {})]
  if not costs:
    return {}
  out = {key: float(np.mean([c[key] for c in costs])) for key in COST_COUNTS}
  out["seconds_per_seed"] = float(np.mean([c["seconds"] for c in costs]))
  return out


def cell_summary(results: Mapping[str, Any], record: Mapping[str, Any]
                 ) -> dict[str, Any]:
  """One finished cell: its model, unpruned accuracy, and per method the AUC
  gap to the oracle, the prunable level and the seconds per seed."""
  agg = results["aggregate"]["curve_summary"]
  model = results.get("model", {})
  methods = {}
  for name, entry in agg.items():
    methods[name] = {
        "auc_token_accuracy": entry["auc_token_accuracy"],
        "auc_token_accuracy_ci": entry["auc_token_accuracy_ci"],
        "gap_to_oracle": entry.get("auc_token_accuracy_minus_oracle"),
        "gap_to_oracle_ci": entry.get("auc_token_accuracy_minus_oracle_ci"),
        "prunable_heads": entry["prunable_heads_token_accuracy"],
        "prunable_heads_ci": entry["prunable_heads_token_accuracy_ci"],
        "prunable_heads_half_split": entry.get(
            "prunable_heads_token_accuracy_half_split"),
        "prunable_heads_half_split_ci": entry.get(
            "prunable_heads_token_accuracy_half_split_ci"),
        "half_split_holds": entry.get("half_split_holds_token_accuracy"),
        "test_token_accuracy_at_prunable_half_split": entry.get(
            "test_token_accuracy_at_prunable_half_split"),
        "seconds_per_seed": _method_seconds(results, name),
        **_method_cost(results, name),
    }
  seeds = results["seeds"]
  return {
      "status": "done", "seconds": record.get("seconds"),
      "num_seeds": len(seeds),
      "num_heads": int(np.asarray(seeds[0]["counts"]).max()),
      "model_config": model,
      "test_exact_match": [float(s["test"]["exact_match"]) for s in seeds],
      "test_token_accuracy": [float(s["test"]["token_accuracy"])
                              for s in seeds],
      "has_oracle": REFERENCE in agg,
      "methods": methods,
  }


def leaderboard(summaries: Mapping[str, Mapping[str, Any]]
                ) -> list[dict[str, Any]]:
  """Per method, over the cells with the oracle: the mean AUC gap to it
  (interval: the cells' intervals combined as independent normal errors),
  the mean prunable levels and seconds per seed; best first."""
  with_oracle = {k: v for k, v in summaries.items() if v["has_oracle"]}
  names: list[str] = []
  for v in with_oracle.values():
    names += [n for n in v["methods"] if n not in names]
  rows = []
  for name in names:
    entries = [v["methods"][name] for v in with_oracle.values()
               if name in v["methods"] and (
                   name == REFERENCE
                   or v["methods"][name]["gap_to_oracle"] is not None)]
    if not entries:
      continue
    gaps = np.array([0.0 if name == REFERENCE else e["gap_to_oracle"]
                     for e in entries])
    ses = np.array([0.0 if name == REFERENCE else
                    (e["gap_to_oracle_ci"][1] - e["gap_to_oracle_ci"][0])
                    / (2 * _Z) for e in entries])
    half = _Z * math.sqrt(float((ses ** 2).sum())) / len(entries)
    seconds = [e["seconds_per_seed"] for e in entries
               if e["seconds_per_seed"] is not None]
    half_split = [e["prunable_heads_half_split"] for e in entries
                  if e["prunable_heads_half_split"] is not None]
    rows.append({
        "method": name, "cells": len(entries),
        "gap_to_oracle": float(gaps.mean()),
        "gap_to_oracle_ci": [float(gaps.mean() - half),
                             float(gaps.mean() + half)],
        "cells_gap_excludes_zero": int(sum(
            name != REFERENCE and e["gap_to_oracle_ci"][1] < 0
            for e in entries)),
        "prunable_heads": float(np.mean([e["prunable_heads"]
                                         for e in entries])),
        "prunable_heads_half_split": (float(np.mean(half_split))
                                      if half_split else None),
        "seconds_per_seed": float(np.mean(seconds)) if seconds else None,
        **{key: (float(np.mean([e[key] for e in entries if key in e]))
                 if any(key in e for e in entries) else None)
           for key in COST_COUNTS},
    })
  rows.sort(key=lambda r: (r["method"] != REFERENCE, -r["gap_to_oracle"]))
  return rows


def collect(root: str, grid_cells: Sequence[Cell]) -> dict[str, Any]:
  """Every cell's state (and, when done, its summary) and the leaderboard."""
  summaries: dict[str, Any] = {}
  labels: dict[str, str] = {}
  for cell in grid_cells:
    directory = os.path.join(root, cell.name)
    record = _read_json(os.path.join(directory, CELL_FILE)) or {}
    status = cell_status(root, cell)
    entry: dict[str, Any] = {"task": cell.task, "model": cell.model}
    if status == "done":
      results = _read_json(os.path.join(directory, "pruning", "results.json"))
      if results is None:
        status = "pending"
      else:
        labels.update(results.get("curve_labels", {}))
        entry |= cell_summary(results, record)
    if status != "done":
      held = _is_held(directory)
      entry["status"] = ("running" if held else status)
      if status == "failed":
        entry["error"] = record.get("error")
    summaries[cell.name] = entry
  done = {k: v for k, v in summaries.items() if v["status"] == "done"}
  return {"cells": summaries, "leaderboard": leaderboard(done),
          "labels": labels}


def _is_held(directory: str) -> bool:
  """Whether another process holds the cell's lock now."""
  if not os.path.exists(workdir_lock.lock_path(directory)):
    return False
  lock = workdir_lock.WorkdirLock(directory)
  try:
    lock.acquire()
  except workdir_lock.WorkdirLockedError:
    return True
  lock.release()
  return False


def _count(value: float | None) -> str:
  """A mean count (``1,234``, or ``1.5`` where it is not whole), or empty."""
  if value is None:
    return ""
  return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def table_markdown(grid: Mapping[str, Any],
                   settings: Mapping[str, Any]) -> str:
  """``leaderboard.md``: the cells, the leaderboard and the gap per cell."""
  cells_ = grid["cells"]
  labels = grid["labels"]
  done = {k: v for k, v in cells_.items() if v["status"] == "done"}
  options = settings["options"]
  title = "# Head-pruning methods against the exact oracle"
  if grid.get("interim"):
    title = (f"# INTERIM table ({len(done)} of {len(cells_)} cells "
             "finished; written again when the last cell ends): "
             "head-pruning methods against the exact oracle")
  lines = [
      title, "",
      f"{len(done)} of {len(cells_)} cells finished; "
      f"{options['num_seeds']} seeds per cell, tolerance "
      f"{options['tolerance']:g} (token accuracy), config overrides "
      f"{settings['overrides'] or 'none'}. Written "
      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; each cell's "
      "full report is `<cell>/pruning/report.md`.", "",
      "## Cells", ""]
  rows = []
  for name, c in cells_.items():
    if c["status"] != "done":
      rows.append([name, c["status"] + (f": {c['error']}" if c.get("error")
                                        else ""), "", "", "", "", ""])
      continue
    oracle = c["methods"].get(REFERENCE, {})
    rows.append([
        name, "done", c["num_heads"],
        f"{min(c['test_exact_match']):.3f}",
        md.ci(oracle, "prunable_heads", 1) if oracle else "no oracle",
        md.ci(oracle, "prunable_heads_half_split", 1) if oracle else "",
        f"{c['seconds']:.0f}" if c.get("seconds") else ""])
  lines += md.table(["cell", "status", "heads", "test exact match (worst "
                     "seed)", "oracle: prunable heads (val.)",
                     "same, chosen on half, checked on the other",
                     "seconds"], rows)
  board = grid["leaderboard"]
  if board:
    lines += [
        "## Leaderboard", "",
        f"AUC gap to the oracle (test token accuracy), mean over the "
        f"{board[0]['cells']} cells with the oracle; 0 is the oracle and "
        "more negative is worse. Intervals: the cells' 95% intervals "
        "combined as independent normal errors. Cost, per seed and mean "
        "over the cells: subsets of heads evaluated, passes of the model "
        "over validation (forward / backward) and the measured seconds of "
        "the computation that produces the method's order or subsets (what "
        "it reads off the oracle's table, the oracle's seconds included; "
        "`cost` in each cell's results.json).", ""]
    lines += md.table(
        ["rank", "method", "AUC gap to the oracle",
         "prunable heads (val.)", "prunable, half-split",
         "subsets evaluated / seed", "passes (fwd / bwd)", "seconds / seed"],
        [[i + 1, labels.get(r["method"], r["method"]),
          md.ci(r, "gap_to_oracle", 3, sign=True),
          f"{r['prunable_heads']:.1f}",
          ("n/a" if r["prunable_heads_half_split"] is None
           else f"{r['prunable_heads_half_split']:.1f}"),
          _count(r.get("subset_evaluations")),
          ("" if r.get("forward_passes") is None else
           f"{_count(r['forward_passes'])} / "
           f"{_count(r['backward_passes'])}"),
          ("" if r["seconds_per_seed"] is None
           else f"{r['seconds_per_seed']:.2f}")]
         for i, r in enumerate(board)])
    names = [r["method"] for r in board if r["method"] != REFERENCE]
    with_oracle = [k for k, v in done.items() if v["has_oracle"]]
    lines += ["## AUC gap to the oracle, per cell", ""]
    lines += md.table(
        ["method"] + with_oracle,
        [[labels.get(n, n)] + [
            md.ci(done[k]["methods"][n], "gap_to_oracle", 3, sign=True)
            if n in done[k]["methods"] else "" for k in with_oracle]
         for n in names])
  return "\n".join(lines) + "\n"


def leaderboard_figure(grid: Mapping[str, Any]) -> Figure:
  """Each method's AUC gap to the oracle per cell (a marker per cell, its
  interval a line; colour: task, marker: model) and its mean (black)."""
  # pylint: disable=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  board = [r for r in grid["leaderboard"] if r["method"] != REFERENCE]
  done = {k: v for k, v in grid["cells"].items()
          if v["status"] == "done" and v["has_oracle"]}
  labels = grid["labels"]
  fig = Figure(figsize=(7.5, 0.45 * len(board) + 1.6), dpi=150,
               layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  tasks = sorted({v["task"] for v in done.values()})
  models = sorted({v["model"] for v in done.values()})
  colours = {t: f"C{i}" for i, t in enumerate(tasks)}
  markers = dict(zip(models, "osD^v<>px"))
  ys = np.arange(len(board))[::-1]
  # The cells' markers below each method's line, its mean above them.
  offsets = np.linspace(-0.38, 0.12, max(len(done), 1))
  for y, row in zip(ys, board):
    for off, (name, c) in zip(offsets, done.items()):
      m = c["methods"].get(row["method"])
      if m is None or m["gap_to_oracle"] is None:
        continue
      lo, hi = m["gap_to_oracle_ci"]
      ax.plot([lo, hi], [y + off] * 2, color=colours[c["task"]], lw=0.8,
              alpha=0.7)
      ax.plot(m["gap_to_oracle"], y + off, markers[c["model"]],
              color=colours[c["task"]], ms=4)
    ax.errorbar(row["gap_to_oracle"], y + 0.3, xerr=[
        [row["gap_to_oracle"] - row["gap_to_oracle_ci"][0]],
        [row["gap_to_oracle_ci"][1] - row["gap_to_oracle"]]],
                fmt="D", color="black", ms=6, capsize=3, zorder=5)
  ax.axvline(0, color="grey", lw=0.8, ls="--")
  ax.set_yticks(ys, [labels.get(r["method"], r["method"]) for r in board])
  ax.set_xlabel("AUC gap to the exact oracle (test token accuracy; 0 = "
                "oracle)")
  handles = ([ax.plot([], [], "o", color=colours[t], label=t)[0]
              for t in tasks] +
             [ax.plot([], [], markers[m], color="grey", label=m)[0]
              for m in models] +
             [ax.plot([], [], "D", color="black", label="mean over cells")[0]])
  fig.legend(handles=handles, fontsize=7, loc="outside lower center",
             ncol=min(len(handles), 6))
  ax.set_title(f"Pruning methods against the oracle over {len(done)} "
               "cells (95% intervals)", fontsize=10)
  return fig


def write_table(root: str, grid_cells: Sequence[Cell], log: Log = print
                ) -> dict[str, Any]:
  """Writes ``results.json``, ``leaderboard.md`` and ``leaderboard.png`` in
  ``root`` from the cells finished now; returns the grid's results. While
  a cell is pending or running elsewhere the table is interim: its
  ``results.json`` says ``"interim": true`` and ``leaderboard.md``'s first
  line says INTERIM."""
  with _table_lock(root):  # The last writer reads the newest cells.
    return _write_table(root, grid_cells, log)


@contextlib.contextmanager
def _table_lock(root: str) -> Iterator[None]:
  """Serialises the table writers of one grid (a blocking ``flock``)."""
  fd = os.open(os.path.join(root, TABLE_LOCK_FILE), os.O_RDWR | os.O_CREAT,
               0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def _write_table(root: str, grid_cells: Sequence[Cell], log: Log
                 ) -> dict[str, Any]:
  settings = _read_json(os.path.join(root, GRID_FILE)) or {}
  grid = collect(root, grid_cells)
  # Final once no cell is pending or running: the process that finishes
  # the last cell writes it; one that ends before writes an interim table.
  grid["interim"] = any(c["status"] in ("pending", "running")
                        for c in grid["cells"].values())
  grid["settings"] = settings
  _write_json(os.path.join(root, "results.json"), grid)
  with _replacing(os.path.join(root, "leaderboard.md")) as tmp, open(
      tmp, "w", encoding="utf-8") as f:
    f.write(table_markdown(grid, settings))
  written = ["results.json", "leaderboard.md"]
  if grid["leaderboard"]:
    with _replacing(os.path.join(root, "leaderboard.png")) as tmp:
      leaderboard_figure(grid).savefig(tmp, format="png",
                                       bbox_inches="tight", pad_inches=0.1)
    written.append("leaderboard.png")
  log(f"Wrote {', '.join(os.path.join(root, w) for w in written)}"
      + (" (an interim table: cells are pending or running elsewhere)"
         if grid["interim"] else ""))
  return grid


__all__ = ["TASKS", "MODELS", "Cell", "GridMismatchError", "cells",
           "grid_settings", "check_grid", "cell_status", "run_grid",
           "cell_summary", "leaderboard", "collect", "table_markdown",
           "leaderboard_figure", "write_table"]
