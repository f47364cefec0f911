"""The study's outputs: ``results.json``, per-example sums, the report.

``results.json`` is the boundary between the study and its report: the
report (:mod:`mha.pruning.study.report`) is rendered from the JSON written
here, never from the objects in memory, so ``python -m
mha.pruning.study.report DIR`` renders the same ``report.md`` again.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import jax
import numpy as np

from mha.run import interrupt
from mha.pruning.study.options import StudyOptions


def jsonable(value: Any) -> Any:
  """``value`` as JSON can hold it: arrays as lists, NumPy scalars as Python
  ones, mapping keys as strings, non-finite floats as None."""
  if isinstance(value, Mapping):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, (np.ndarray, jax.Array)):
    return jsonable(np.asarray(value).tolist())
  if isinstance(value, (np.floating, float)):
    return None if not math.isfinite(float(value)) else float(value)
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.bool_,)):
    return bool(value)
  return value


def _write_examples(seed: Mapping[str, Any], out_dir: str) -> str:
  """The seed's per-example sums of every mask it evaluated (what a new
  resample needs): ``masks [M, L, H]``, ``validation_<sum>`` and
  ``test_<sum>`` ``[M, n]``."""
  examples = seed["examples"]
  arrays = {"masks": examples["masks"]}
  for split in ("validation", "test"):
    arrays.update({f"{split}_{k}": v for k, v in examples[split].items()})
  path = os.path.join(out_dir, f"examples_seed{seed['seed']}.npz")
  np.savez_compressed(path, **arrays)
  return path


def _old_figures(out_dir: str) -> list[str]:
  """The figure files the report of the study already in ``out_dir`` shows
  (from its ``results.json``); none if there is none or it does not read."""
  from mha.pruning.study import report  # Deferred: matplotlib.
  try:
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as f:
      return [os.path.join(out_dir, name)
              for name in report.figure_files(json.load(f))]
  except Exception:  # pylint: disable=broad-except
    return []  # No study there, or one whose report no longer renders.


def write_outputs(results: Mapping[str, Any], out_dir: str) -> list[str]:
  """Writes ``results.json``, each seed's ``examples_seed<s>.npz`` (when
  the results hold them), the plots and ``report.md``; returns the paths.

  A study written over an earlier one in ``out_dir`` removes the earlier
  report's figures that its own report does not show (``--noplots``, another
  ``--plot_format``, a figure of an option now off), so that no figure left
  there shows other results than ``results.json``'s."""
  from mha.pruning.study import report  # Deferred: matplotlib.

  os.makedirs(out_dir, exist_ok=True)
  old_figures = _old_figures(out_dir)
  written = [_write_examples(s, out_dir) for s in results["seeds"]
             if "examples" in s]
  results = dict(results, seeds=[{k: v for k, v in s.items()
                                  if k != "examples"}
                                 for s in results["seeds"]])
  path = os.path.join(out_dir, "results.json")
  text = json.dumps(jsonable(results), indent=1, allow_nan=False)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
  interrupt.reached("report")  # A test's signal while the report is made.
  # The report reads what was written, as a re-render from the file does.
  paths = written + [path] + report.write(json.loads(text), out_dir)
  for stale in set(old_figures) - set(paths):
    try:
      os.unlink(stale)
    except FileNotFoundError:
      pass
  return paths


def written(out_dir: str, options: StudyOptions) -> str:
  """The line that says what a study with ``options`` (its ``plots`` and
  ``plot_format``) wrote to ``out_dir``."""
  results = os.path.join(out_dir, "results.json")
  report = os.path.join(out_dir, "report.md")
  if options.plots:
    return (f"Wrote {results}, {report} and the report's "
            f"{options.plot_format.upper()} plots.")
  return f"Wrote {results} and {report} (no plots: --noplots)."


__all__ = ["jsonable", "write_outputs", "written"]
