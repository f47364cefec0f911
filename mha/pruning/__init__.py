"""Which attention heads matter, and can the others go? The techniques.

Each module is a technique, importable and testable alone; none imports the
study (:mod:`mha.pruning.study`) that composes them:

* :mod:`mha.head_masks` (re-exported here): head masks, flat indices;
* :mod:`mha.pruning.core` (re-exported here): importance measures, curves,
  physical pruning;
* :mod:`mha.pruning.speed` (re-exported here): prediction timing;
* :mod:`mha.pruning.orderings`: the orderings of the heads from the measures;
* :mod:`mha.pruning.oracle`: every subset of heads, layer by layer; the best
  subsets; exact Shapley values;
* :mod:`mha.pruning.stats`: bootstrap, Benjamini-Hochberg, Fisher-z Spearman;
* :mod:`mha.pruning.export`: pruned models saved as workdirs;
* :mod:`mha.pruning.gates`: hard-concrete head gates;
* :mod:`mha.pruning.mean_ablation`: mean instead of zero ablation, folded
  into the output bias;
* :mod:`mha.pruning.retrain`: many pruned models fine-tuned at once;
* :mod:`mha.pruning.shapley`: sampled Shapley values, pairwise interactions;
* :mod:`mha.pruning.searches`: the layer-additive surrogate and beam search;
* :mod:`mha.pruning.ablation`: what a removed head outputs (zero, mean,
  mean per position, resample) for every mask evaluation and the oracle;
  attribution patching;
* :mod:`mha.pruning.kwon`: retraining-free pruning after Kwon et al. (2022):
  Fisher mask search, rearrangement, mask tuning.

So ``from mha import pruning; pruning.prune_heads(...)`` works.
"""

from mha.head_masks import *  # noqa: F401,F403
from mha.head_masks import __all__ as _masks_all
from mha.pruning.core import *  # noqa: F401,F403
from mha.pruning.core import __all__ as _core_all
from mha.pruning.speed import *  # noqa: F401,F403
from mha.pruning.speed import __all__ as _speed_all

__all__ = [*_masks_all, *_core_all, *_speed_all]
