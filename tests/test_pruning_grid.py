"""The benchmark grid (mha/pruning/study/grid.py, scripts/pruning_benchmark.py):
it resumes cell by cell, processes share it through the cells' locks, a
failed cell is marked and the grid goes on, and mistakes are one line."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from conftest import start

from mha.run import interrupt
from mha.run import workdir_lock
from mha.pruning.study import StudyOptions
from mha.pruning.study import grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pruning_benchmark.py")


def _script(*args: str, env: dict[str, str]):
  return start([sys.executable, SCRIPT, *args], env=env)


def _args(root, data_dir) -> list[str]:
  # Two tiny cells, one seed each, few resamples, no figures but the
  # leaderboard's, none of the study's parts the grid only passes on (Kwon
  # et al., attribution, the analysis over training, re-estimated orderings:
  # the study's tests cover them): seconds per cell.
  return [f"--workdir={root}", "--tasks=reverse,sort",
          "--models=tiny", "--num_seeds=1", "--num_bootstrap=20",
          "--num_random_orders=4", "--noplots", "--nokwon", "--noattribution",
          "--noover_training", "--nobootstrap_importance", "--noreestimate",
          f"--overrides=data.data_dir={data_dir}"]


def _one_line(stderr: str, signame: str) -> None:
  assert "Traceback" not in stderr, stderr[-3000:]
  lines = [l for l in stderr.splitlines()
           if l.startswith("pruning_benchmark.py: ")]
  assert len(lines) == 1, stderr[-3000:]
  assert lines[0].startswith(f"pruning_benchmark.py: stopped by {signame}")
  assert "the same command resumes" in lines[0], lines


@pytest.mark.slow
def test_an_interrupted_grid_resumes_and_two_processes_share_it(
    tmp_path, data_dir, subprocess_env):
  root = tmp_path / "grid"
  # SIGTERM while the second cell's first seed trains (the tiny config has
  # 20 steps, one call of the train step each, so the 21st call is the
  # second cell's first): the first cell done, the second under way.
  first = _script(*_args(root, data_dir), env=dict(
      subprocess_env, **{interrupt.TEST_ENV: "train#21"})).wait()
  assert first.returncode == 143, first.stderr[-3000:]
  _one_line(first.stderr, "SIGTERM")
  assert grid.cell_status(str(root), grid.Cell("reverse", "tiny")) == "done"
  assert grid.cell_status(str(root), grid.Cell("sort", "tiny")) == "pending"
  assert "cell sort-tiny under way" in first.stderr
  # The training under way kept its checkpoint.
  assert os.listdir(root / "sort-tiny" / "train" / "checkpoints")
  done_file = root / "reverse-tiny" / "pruning" / "results.json"
  before = done_file.stat().st_mtime_ns
  # Two processes run the rest together: one claims the cell left, the
  # other finds it held (or done) and skips it.
  both = [_script(*_args(root, data_dir), env=subprocess_env)
          for _ in range(2)]
  results = [p.wait() for p in both]
  for result in results:
    assert result.returncode == 0, result.stderr[-2000:]
  started = "".join(r.stdout for r in results)
  # No finished cell is redone; each other cell ran exactly once.
  assert done_file.stat().st_mtime_ns == before
  assert "reverse-tiny: training and study" not in started
  assert started.count("sort-tiny: training and study") == 1, started
  table = json.loads((root / "results.json").read_text())
  assert table["interim"] is False
  assert {k: v["status"] for k, v in table["cells"].items()} == {
      "reverse-tiny": "done", "sort-tiny": "done"}
  board = {r["method"]: r for r in table["leaderboard"]}
  assert board["oracle"]["gap_to_oracle"] == 0
  assert board["beam"]["cells"] == 2
  for row in board.values():  # The oracle is the best subset on validation.
    assert row["prunable_heads"] <= board["oracle"]["prunable_heads"] + 1e-9
  text = (root / "leaderboard.md").read_text()
  assert "2 of 2 cells finished" in text and "## Leaderboard" in text
  assert not text.startswith("# INTERIM")
  assert (root / "leaderboard.png").stat().st_size > 10_000
  # --noplots: each cell's report.md, without figures.
  cell_out = root / "sort-tiny" / "pruning"
  assert "## Searches for the best subset" in (
      cell_out / "report.md").read_text()
  assert "![" not in (cell_out / "report.md").read_text()
  assert not list(cell_out.glob("*.png"))
  # A second run finds everything done and only rewrites the table.
  again = _script(*_args(root, data_dir), env=subprocess_env).wait()
  assert again.returncode == 0, again.stderr[-2000:]
  assert "training and study" not in again.stdout
  assert "2 already done" in again.stdout
  # The table alone, without the grid's flags: of the cells it holds.
  (root / "leaderboard.md").unlink()
  table = _script(f"--workdir={root}", "--table_only",
                  env=subprocess_env).wait()
  assert table.returncode == 0, table.stderr[-2000:]
  assert "2 of 2 cells finished" in (root / "leaderboard.md").read_text()


def test_a_failed_cell_is_marked_and_the_grid_goes_on_a_held_one_skipped(
    tmp_path):
  root = str(tmp_path / "grid")
  cells = grid.cells(["reverse", "sort", "histogram"], ["tiny"])
  ran = []

  def run_cell(root_, cell, options, overrides, log):
    ran.append(cell.name)
    if cell.task == "reverse":
      raise ValueError("first line\nthe reason on its last line")

  holder = workdir_lock.WorkdirLock(os.path.join(root, "sort-tiny"))
  holder.acquire()  # Another process's cell, as far as the grid can tell.
  try:
    counts = grid.run_grid(root, cells, StudyOptions(num_seeds=1),
                           log=lambda m: None, run_cell=run_cell)
    table = grid.collect(root, cells)
  finally:
    holder.release()
  assert ran == ["reverse-tiny", "histogram-tiny"]
  assert counts == {"ran": 1, "done_before": 0, "held_elsewhere": 1,
                    "failed": 1}
  assert table["cells"]["reverse-tiny"] == {
      "task": "reverse", "model": "tiny", "status": "failed",
      "error": "ValueError: the reason on its last line"}
  assert table["cells"]["sort-tiny"]["status"] == "running"
  # The cell ran without writing results: not done, run again next time.
  assert table["cells"]["histogram-tiny"]["status"] == "pending"
  text = (tmp_path / "grid" / "leaderboard.md").read_text()
  assert "failed: ValueError: the reason on its last line" in text
  # The next run tries the failed cell again.
  ran.clear()
  grid.run_grid(root, cells, StudyOptions(num_seeds=1), log=lambda m: None,
                run_cell=run_cell)
  assert ran == ["reverse-tiny", "sort-tiny", "histogram-tiny"]


def test_the_longest_expected_cells_run_first(tmp_path):
  options = StudyOptions(num_seeds=3)
  given = grid.cells(grid.TASKS, grid.MODELS)
  order = [c.name for c in grid.schedule(given, options)]
  assert sorted(order) == sorted(c.name for c in given)
  # spell trains 2000 steps, the others 500; deep64 is deep 4x wider. Ties
  # keep the given (task by task) order.
  assert order == ["spell-deep64", "reverse-deep64", "sort-deep64",
                   "histogram-deep64", "spell-deep", "reverse-deep",
                   "sort-deep", "histogram-deep"]
  wide = grid.Cell("reverse", "wide")  # 16 heads: 2^16 oracle subsets
  assert (grid.expected_seconds(wide, options)
          > grid.expected_seconds(grid.Cell("spell", "deep64"), options))
  beyond = dataclasses.replace(options, oracle_max_heads=12)
  assert (grid.expected_seconds(wide, beyond)
          < grid.expected_seconds(wide, options) / 2)
  assert grid.expected_seconds(grid.Cell("reverse", "no_such_model"),
                               options) == 0.0
  # run_grid tries the cells in that order.
  ran = []
  grid.run_grid(str(tmp_path / "grid"), given, options, log=lambda m: None,
                run_cell=lambda root, cell, *args: ran.append(cell.name))
  assert ran == order
  # At most max_cells of them in one process, the first in that order.
  ran.clear()
  counts = grid.run_grid(
      str(tmp_path / "other"), given, options, log=lambda m: None,
      max_cells=2, run_cell=lambda root, cell, *args: ran.append(cell.name))
  assert ran == order[:2] and counts["ran"] == 2


def test_a_grid_with_other_settings_is_refused(tmp_path):
  root = str(tmp_path / "grid")
  cells = grid.cells(["reverse"], ["tiny"])
  grid.run_grid(root, cells, StudyOptions(num_seeds=1), log=lambda m: None,
                run_cell=lambda *a: None)
  with pytest.raises(grid.GridMismatchError, match="num_seeds"):
    grid.run_grid(root, cells, StudyOptions(num_seeds=2), log=lambda m: None)
  with pytest.raises(grid.GridMismatchError, match="config overrides"):
    grid.run_grid(root, cells, StudyOptions(num_seeds=1), ["seed=3"],
                  log=lambda m: None)


@pytest.mark.parametrize("args, message", [
    (["--tasks=nope"], "--tasks: unknown task 'nope'"),
    (["--models=nope"], "cell reverse-nope: unknown config variant 'nope'"),
    (["--num_seeds=0"], "--num_seeds must be >= 1"),
    (["--workdir="], "--workdir is empty"),
    # An override that changes a cell's task or model: its results would be
    # filed under another cell's name (also with one task and one model).
    (["--tasks=reverse", "--models=tiny", "--overrides=task=sort"],
     "--overrides task=sort change cell reverse-tiny's task ('reverse' -> "
     "'sort')"),
    (["--tasks=reverse", "--models=tiny", "--overrides=sort"],
     "change cell reverse-tiny's task"),
    (["--tasks=reverse", "--models=tiny,deep", "--overrides=model.num_heads=4"],
     "change cell reverse-tiny's model.num_heads (2 -> 4)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message,
                                          subprocess_env):
  root = tmp_path / "grid"
  result = _script(f"--workdir={root}", *args, env=subprocess_env).wait()
  err = result.stderr
  assert result.returncode == 2
  assert err.strip().splitlines() == [f"pruning_benchmark.py: error: "
                                      f"{err.split('error: ', 1)[1].strip()}"]
  assert message in err
  assert not root.exists()


@pytest.mark.parametrize("case", ["table_only_without_a_grid",
                                  "a_file_where_a_cell_goes",
                                  "a_pruning_studys_folder"])
def test_an_unwritable_grid_is_one_line_and_exit_2(tmp_path, case,
                                                    subprocess_env):
  root = tmp_path / "grid"
  args = ["--tasks=reverse", "--models=tiny"]
  if case == "table_only_without_a_grid":  # e.g. a typo in --workdir
    args.append("--table_only")
    message = f"--workdir {root} holds no grid (grid.json is missing)"
  elif case == "a_file_where_a_cell_goes":
    root.mkdir()
    (root / "reverse-tiny").write_text("not a folder")
    message = (f"cell reverse-tiny: {root / 'reverse-tiny'} is a file, not "
               "a folder")
  else:  # the grid's results.json would replace the study's
    root.mkdir()
    (root / "results.json").write_text('{"workdir": "runs/x"}')
    message = f"{root} holds a results.json but no grid (grid.json)"
  before = sorted(p.name for p in root.iterdir()) if root.exists() else None
  result = _script(f"--workdir={root}", *args, env=subprocess_env).wait()
  err = result.stderr
  assert result.returncode == 2, err[-2000:]
  lines = err.strip().splitlines()
  assert len(lines) == 1, err[-2000:]
  assert lines[0].startswith(f"pruning_benchmark.py: error: {message}")
  after = sorted(p.name for p in root.iterdir()) if root.exists() else None
  assert after == before  # nothing written, nothing created


def test_a_folder_that_holds_a_study_or_a_run_is_not_a_grid(tmp_path):
  cells = grid.cells(["reverse"], ["tiny"])
  study = tmp_path / "study"
  study.mkdir()
  (study / "results.json").write_text('{"workdir": "runs/x"}')
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  for root, message in ((study, "holds a results.json but no grid"),
                        (run, "is a training run's workdir")):
    with pytest.raises(grid.GridMismatchError, match=message):
      grid.run_grid(str(root), cells, StudyOptions(num_seeds=1),
                    log=lambda m: None, run_cell=lambda *a: None)
    assert not (root / grid.GRID_FILE).exists()
  assert (study / "results.json").read_text() == '{"workdir": "runs/x"}'


def test_an_option_added_after_the_grid_started_reads_as_its_default(
    tmp_path):
  root = str(tmp_path / "grid")
  cells = grid.cells(["reverse"], ["tiny"])
  grid.run_grid(root, cells, StudyOptions(num_seeds=1), log=lambda m: None,
                run_cell=lambda *a: None)
  path = os.path.join(root, grid.GRID_FILE)
  with open(path, encoding="utf-8") as f:
    recorded = json.load(f)
  del recorded["options"]["plots"]  # as a grid started before --plots
  with open(path, "w", encoding="utf-8") as f:
    json.dump(recorded, f)
  grid.run_grid(root, cells, StudyOptions(num_seeds=1), log=lambda m: None,
                run_cell=lambda *a: None)  # the same settings: accepted
  with pytest.raises(grid.GridMismatchError, match="plots"):
    grid.run_grid(root, cells, StudyOptions(num_seeds=1, plots=False),
                  log=lambda m: None)


def test_the_leaderboard_has_a_cost_column_and_no_cell_counts():
  def method(gap, subsets, seconds):
    return {"auc_token_accuracy": 0.5, "auc_token_accuracy_ci": [0.4, 0.6],
            "gap_to_oracle": gap, "gap_to_oracle_ci": (
                None if gap is None else [gap - .01, gap + .01]),
            "prunable_heads": 2.0, "prunable_heads_ci": [1.0, 3.0],
            "prunable_heads_half_split": 2.0,
            "prunable_heads_half_split_ci": [1.0, 3.0],
            "half_split_holds": 1.0,
            "test_token_accuracy_at_prunable_half_split": 0.9,
            "seconds_per_seed": seconds, "subset_evaluations": subsets,
            "forward_passes": subsets or 1.0, "backward_passes": 1.0}
  cell = {"status": "done", "seconds": 10.0, "num_seeds": 2, "num_heads": 8,
          "model_config": {}, "test_exact_match": [0.9, 0.9],
          "test_token_accuracy": [0.95, 0.95], "has_oracle": True,
          "methods": {"oracle": method(None, 256.0, 3.0),
                      "beam": method(-0.001, 25.5, 1.0),
                      "gradient": method(-0.02, 0.0, 0.5)}}
  board = grid.leaderboard({"a-x": cell, "b-y": cell})
  beam = next(r for r in board if r["method"] == "beam")
  assert beam["subset_evaluations"] == 25.5
  text = grid.table_markdown(
      {"cells": {"a-x": cell, "b-y": cell}, "leaderboard": board,
       "labels": {}}, {"options": {"num_seeds": 2, "tolerance": 0.01},
                       "overrides": []})
  row = next(l for l in text.splitlines() if l.startswith("| 2 | beam"))
  assert "| 25.5 | 25.5 / 1 | 1.00 |" in row
  assert "cells below 0" not in text and " of 2 |" not in text
