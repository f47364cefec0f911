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

What runs on the model (masked logits, metric sums, head-mask gradients,
ablations, gates, ``prune_heads``) is pure JAX: ``jit``, ``grad`` and
``vmap`` (over head masks, over stacked parameters) pass through it. The
drivers that loop over a split's batches, the searches over subsets and
the small post-processing of their results (normalising, ordering,
Möbius transforms, Shapley values of a subset table) are NumPy on the
host, in float64 where the statistics need it, and say so.

So ``from mha import pruning; pruning.prune_heads(...)`` works. The names
are imported on first use (PEP 562, as :mod:`mha` does), so that the study's
command line answers ``--help`` or a mistyped flag without importing JAX:
its flags read only :mod:`mha.pruning.constants`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mha.run import lazy

if TYPE_CHECKING:  # For type checkers and IDEs; at run time, on first use.
  from mha.head_masks import *  # noqa: F401,F403
  from mha.pruning.core import *  # noqa: F401,F403
  from mha.pruning.speed import *  # noqa: F401,F403

#: The modules whose ``__all__`` this package re-exports.
_REEXPORTED = ("mha.head_masks", "mha.pruning.core", "mha.pruning.speed")


def _public() -> list[str]:
  """Every re-exported name (imports the three modules)."""
  return [name for module in _REEXPORTED
          for name in importlib.import_module(module).__all__]


def __getattr__(name: str) -> Any:
  # A submodule first (``from mha.pruning import constants`` asks here
  # before importing it), so that it does not import the three below.
  if lazy.submodule(__name__, name):
    return importlib.import_module(f"{__name__}.{name}")
  if name.startswith("__") and name != "__all__":  # Probes (inspect, ...).
    raise AttributeError(f"module 'mha.pruning' has no attribute {name!r}")
  if name == "__all__":  # from mha.pruning import *
    value = _public()
  else:
    for module_name in _REEXPORTED:
      module = importlib.import_module(module_name)
      if name in module.__all__:
        value = getattr(module, name)
        break
    else:
      raise AttributeError(
          f"module 'mha.pruning' has no attribute {name!r}")
  globals()[name] = value  # Later look-ups skip this function.
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_public()))
