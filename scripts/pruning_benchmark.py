r"""Pruning methods against the exact oracle over tasks x models: one table.

    python scripts/pruning_benchmark.py --workdir runs/pruning_benchmark
    python scripts/pruning_benchmark.py --workdir runs/pruning_benchmark \
        --models deep,deep64,wide   # the 16-head model added

Each cell (a task of ``--tasks`` with a model variant of ``--models``, both
from ``configs/default.py``) trains its first seed and runs the pruning
study (``scripts/prune_heads.py``'s, with its flags: ``--num_seeds``
defaults to 3 here and the speed table is off) in
``<workdir>/<task>-<model>/``. Then ``<workdir>/leaderboard.md``,
``leaderboard.png`` and ``results.json`` rank every method (each ordering,
the searches, ...) by its AUC gap to the oracle, with the prunable level and
the seconds per seed.

Run it again and it goes on where it stopped: finished cells are never
redone. Run it in several shells (or a SLURM job array, or on hosts sharing
the folder) and the processes share the cells: each claims one through the
cell folder's lock. A cell that fails is marked in the table and the grid
goes on; the next run tries it again. See mha/pruning/study/grid.py.

A user's mistake (an unknown task or model, a bad option, a folder holding a
grid with other settings) is one line on stderr and exit code 2, before
anything is trained.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from absl import app
from absl import flags
from absl import logging

from mha.run import cli
from mha.run import interrupt
from mha.run import write_failures
# The grid's module and the options import no JAX: --help, a mistyped flag
# or a bad option answer at once.
from mha.pruning.study import grid
from mha.pruning.study import options as study_options

_PROG = "pruning_benchmark.py"
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/pruning_benchmark",
    "The grid's folder: a subfolder per cell, the table at the top.")
_TASKS = flags.DEFINE_list("tasks", list(grid.TASKS), "Tasks of the grid.")
_MODELS = flags.DEFINE_list(
    "models", list(grid.MODELS),
    "Model variants of configs/default.py (deep: 3 x 4 heads, deep64: 3 x 4 "
    "of width 16, wide6: 2 x 6, wide: 2 x 8, deep8: 4 x 8, tiny).")
_OVERRIDES = flags.DEFINE_list(
    "overrides", [], "Config variants or key=value pairs applied to every "
    "cell (e.g. num_train_steps=300).")
_MAX_CELLS = flags.DEFINE_integer(
    "max_cells", None, "Run at most this many cells in this process, then "
    "write the table and stop.", lower_bound=1)
_TABLE_ONLY = flags.DEFINE_bool(
    "table_only", False, "Only write the table from the finished cells.")
_OPTIONS = study_options.define_flags()
flags.adopt_module_key_flags(study_options)
flags.FLAGS.set_default("num_seeds", 3)
flags.FLAGS.set_default("speed", False)


# What a cell's name (task-model) stands for: its task and its model's shape.
_CELL_KEYS = ("task", "model.num_layers", "model.num_heads", "model.d_model",
              "model.mlp_dim", "model.head_dim")


def _field(config, key: str):
  for part in key.split("."):
    config = config[part]
  return config


def _cells_in(root: str) -> list[grid.Cell]:
  """The cells whose folders ``root`` holds, task by task."""
  from configs import default  # pylint: disable=import-outside-toplevel
  found = []
  for name in sorted(os.listdir(root)):
    task, _, model = name.partition("-")
    if (task in default.TASKS and model
        and os.path.isdir(os.path.join(root, name))):
      found.append(grid.Cell(task, model))
  order = {t: i for i, t in enumerate(default.TASKS)}
  return sorted(found, key=lambda c: (order[c.task], c.model))


def _checked_cells(overrides: list[str]) -> list[grid.Cell]:
  """Every cell, each config built once to catch a mistake early."""
  from configs import default  # pylint: disable=import-outside-toplevel
  from mha.run import config_validation  # pylint: disable=import-outside-toplevel
  for task in _TASKS.value:
    if task not in default.TASKS:
      cli.fail(_PROG, f"--tasks: unknown task {task!r}; expected some of "
                      f"{', '.join(default.TASKS)}")
  if not _TASKS.value or not _MODELS.value:
    cli.fail(_PROG, "give at least one task and one model")
  cells = grid.cells(_TASKS.value, _MODELS.value)
  for cell in cells:
    try:
      config = default.get_config(cell.config_arg(overrides))
      problems = config_validation.config_problems(config)
      named = default.get_config(cell.config_arg(()))
    except Exception as e:  # pylint: disable=broad-except
      cli.fail(_PROG, f"cell {cell.name}: {cli.one_line(e)}")
    if problems:
      cli.fail(_PROG, f"cell {cell.name}: {problems[0]}")
    # The cell's name says its task and model: an override may not change
    # them (its results would be filed under another cell's name).
    for key in _CELL_KEYS:
      have, want = _field(config, key), _field(named, key)
      if have != want:
        cli.fail(_PROG, f"--overrides {','.join(overrides)} change cell "
                        f"{cell.name}'s {key} ({want!r} -> {have!r}): the "
                        "grid's tasks and models come from --tasks and "
                        "--models only")
  return cells


def main(argv: list[str]) -> None:
  del argv
  # SIGINT and SIGTERM mean one thing at any moment: one line, 130 / 143.
  with interrupt.stop_on_signals():
    try:
      _main()
    except interrupt.Interrupted as e:
      print(f"{_PROG}: stopped by {e}; finished cells are kept and never "
            "redone; the same command resumes (a cell under way goes on "
            "from its checkpoint and trained seeds): python "
            f"{shlex.join(sys.argv)}", file=sys.stderr, flush=True)
      sys.exit(e.exit_code)


def _main() -> None:
  logging.set_verbosity(logging.WARNING)
  root = os.path.abspath(os.path.expanduser(
      cli.nonempty_path(_PROG, _WORKDIR.value)))
  if os.path.exists(root) and not os.path.isdir(root):
    cli.fail(_PROG, f"--workdir {root} exists and is not a directory")
  try:
    options = study_options.from_flags(_OPTIONS)
  except cli.UsageError as e:
    cli.fail(_PROG, e)
  overrides = [o.strip() for o in _OVERRIDES.value if o.strip()]
  cells = _checked_cells(overrides)
  table_of_a_grid = _TABLE_ONLY.value and os.path.isfile(
      os.path.join(root, grid.GRID_FILE))
  if not table_of_a_grid:  # The table alone needs no settings of a study.
    try:
      grid.check_grid(root, grid.grid_settings(options, overrides))
    except grid.GridMismatchError as e:
      cli.fail(_PROG, e)
  _check_writable(root, cells)
  if _TABLE_ONLY.value:
    if not (flags.FLAGS["tasks"].present or flags.FLAGS["models"].present):
      cells = _cells_in(root)  # The grid's own cells, whatever they are.
    grid.write_table(root, cells)
    return
  # What the cells run (JAX, Flax, orbax, TFDS), imported once the command
  # line holds up.
  # pylint: disable=import-outside-toplevel
  from mha.run import compilation_cache
  import mha.pruning.study.experiment
  import mha.train
  # pylint: enable=import-outside-toplevel
  compilation_cache.configure(
      _default_config(overrides).compilation_cache_dir, _PROG)
  start = time.time()
  order = ", ".join(
      f"{c.name} (~{grid.expected_seconds(c, options, overrides) / 60:.0f} "
      "min)" for c in grid.schedule(cells, options, overrides))
  total = sum(grid.expected_seconds(c, options, overrides) for c in cells)
  print(f"Pruning benchmark: {len(cells)} cells in {root}, about "
        f"{total / 60:.0f} min in all (estimate, 2 CPU cores; the oracle "
        f"needs up to {_oracle_gib(cells, options, overrides):.2f} GiB), the "
        f"longest expected first: {order}", flush=True)
  counts = grid.run_grid(root, cells, options, overrides,
                         log=lambda m: print(m, flush=True),
                         max_cells=_MAX_CELLS.value)
  print(f"This process ran {counts['ran']} cells ({counts['failed']} "
        f"failed; {counts['done_before']} already done, "
        f"{counts['held_elsewhere']} held by another process) in "
        f"{time.time() - start:.0f} s", flush=True)
  if counts["failed"]:
    sys.exit(1)


def _oracle_gib(cells: list[grid.Cell], options, overrides: list[str]
                ) -> float:
  """The most memory the oracle of one cell needs (GiB; 0 without one)."""
  # pylint: disable=import-outside-toplevel
  from configs import default
  from mha import build
  from mha.pruning import oracle
  # pylint: enable=import-outside-toplevel
  models = [build.model_config(default.get_config(c.config_arg(overrides)))
            for c in cells]
  return max([oracle.oracle_bytes(m) / 2**30 for m in models
              if oracle.oracle_applies(m, options.oracle_max_heads)],
             default=0.0)


def _check_writable(root: str, cells: list[grid.Cell]) -> None:
  """Fails (one line, exit 2) where the grid cannot be written: ``--workdir``
  through a file, read-only, or a file where a cell's folder goes; with
  ``--table_only``, a folder that holds no grid. Creates ``root`` only where
  the grid would."""
  if _TABLE_ONLY.value and not os.path.isfile(os.path.join(root,
                                                           grid.GRID_FILE)):
    cli.fail(_PROG, f"--workdir {root} holds no grid ({grid.GRID_FILE} is "
                    "missing): run the grid first, without --table_only")
  for cell in cells:
    folder = os.path.join(root, cell.name)
    if os.path.exists(folder) and not os.path.isdir(folder):
      cli.fail(_PROG, f"cell {cell.name}: {folder} is a file, not a folder")
  try:
    os.makedirs(root, exist_ok=True)
  except OSError as e:
    cli.fail(_PROG, f"cannot write the grid in {root}: "
                    f"{write_failures.os_error_reason(e)}")
  cli.writable_dir(_PROG, root)


def _default_config(overrides: list[str]):
  from configs import default  # pylint: disable=import-outside-toplevel
  return default.get_config(",".join(["reverse", *overrides]))


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
