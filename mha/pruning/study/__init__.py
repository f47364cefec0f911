"""The head-importance and head-pruning study behind ``scripts/prune_heads.py``.

It composes the techniques of :mod:`mha.pruning` (importance measures,
orderings, the oracle, gates, retraining, mean ablation, timing) into one
experiment and writes ``results.json``; the report reads only that file.
Imports point one way: this package imports the techniques, never the
reverse.

* :mod:`~mha.pruning.study.options`: :class:`StudyOptions`, the settings,
  and the command line flags made from them;
* :mod:`~mha.pruning.study.experiment`: :func:`run`, the whole study;
* :mod:`~mha.pruning.study.seeds`: the models (the only module that trains);
* :mod:`~mha.pruning.study.analysis`: one seed (curves, the oracle, tables);
* :mod:`~mha.pruning.study.extensions`: gates, retraining, mean ablation;
* :mod:`~mha.pruning.study.summary`: bootstrap statistics of the curves;
* :mod:`~mha.pruning.study.outputs`: ``results.json`` and per-example sums;
* :mod:`~mha.pruning.study.kept_analyses`: each finished seed's analysis,
  kept in the output folder and reused by a rerun;
* :mod:`~mha.pruning.study.report`, :mod:`~mha.pruning.study.report_extensions`,
  :mod:`~mha.pruning.study.plots`, :mod:`~mha.pruning.study.markdown`:
  ``report.md`` and its figures.

    from mha.pruning.study import StudyOptions, run
    results = run("runs/reverse", "runs/reverse/pruning",
                  StudyOptions(num_seeds=1, speed=False))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mha.run import lazy

if TYPE_CHECKING:  # For type checkers and IDEs; at run time, on first use.
  from mha.pruning.study.experiment import check_inputs, check_out_dir, run
  from mha.pruning.study.options import StudyOptions

# Imported on first use (PEP 562): the command line's flags need only
# mha.pruning.study.options, which imports no JAX.
_PUBLIC = {
    "StudyOptions": "mha.pruning.study.options",
    "check_inputs": "mha.pruning.study.experiment",
    "check_out_dir": "mha.pruning.study.experiment",
    "run": "mha.pruning.study.experiment",
}

__getattr__, __dir__, __all__ = lazy.attach(__name__, _PUBLIC)
