"""Which attention heads matter, and can the others go?

The core (:mod:`mha.pruning.core`: head masks, importance measures, orders,
curves, physical pruning) and prediction timing (:mod:`mha.pruning.speed`)
are re-exported here, so ``from mha import pruning; pruning.prune_heads(...)``
works. The rest is imported by name: :mod:`mha.pruning.oracle` (every
subset of heads, layer by layer; the best subsets; exact Shapley values),
:mod:`mha.pruning.stats` (bootstrap, Benjamini-Hochberg, Fisher-z Spearman),
:mod:`mha.pruning.export` (pruned models saved as workdirs),
:mod:`mha.pruning.gates` (hard-concrete head gates),
:mod:`mha.pruning.mean_ablation` (mean instead of zero ablation, folded into
the output bias), :mod:`mha.pruning.retrain` (many pruned models fine-tuned
at once), and the study:
:mod:`mha.pruning.experiment` (the protocol), :mod:`mha.pruning.summary`
(curve summaries with intervals), :mod:`mha.pruning.report` (``report.md``),
:mod:`mha.pruning.plots` (the figures), and beyond ranking heads
:mod:`mha.pruning.beyond` (gates, retraining and mean ablation on the
study's seeds) with :mod:`mha.pruning.report_beyond` (their report
sections). Imports point one way: the core never imports the study.
"""

from mha.pruning.core import *  # noqa: F401,F403
from mha.pruning.core import __all__ as _core_all
from mha.pruning.speed import *  # noqa: F401,F403
from mha.pruning.speed import __all__ as _speed_all

__all__ = [*_core_all, *_speed_all]
