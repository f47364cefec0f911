"""The techniques' names and defaults that a command line needs before JAX.

The study's flags (:mod:`mha.pruning.study.options`) take their choices and
defaults from here, so that ``scripts/prune_heads.py --help`` or a mistyped
flag answers without importing JAX, Flax or orbax. Each technique module
re-exports its own (``mha.pruning.orderings.ORDERINGS``,
``mha.pruning.ablation.MODES``, ``mha.pruning.gates.EXACT_K_METHODS``,
``mha.pruning.speed.REPEATS`` ...): the same objects. Nothing here imports
more than the standard library.
"""

from __future__ import annotations

#: The orderings of the pruning curves (:mod:`mha.pruning.orderings`): key ->
#: label. Measures first, then baselines.
ORDERINGS = {
    "gradient": "gradient",
    "gradient_l2": "gradient (L2 per layer)",
    "gradient_iterative": "gradient (re-estimated)",
    "fisher": "Fisher (Kwon et al.)",
    "attribution_zero": "attribution patching (zero)",
    "attribution_mean": "attribution patching (mean per position)",
    "attribution_resample": "attribution patching (resample)",
    "leave_one_out": "leave-one-out",
    "confidence": "confidence",
    "entropy": "entropy",
    "shapley": "Shapley value",
    "reverse_gradient": "reverse gradient",
    "random": "random",
}

#: What a removed head outputs (:mod:`mha.pruning.ablation`), ``--ablation``'s
#: choices.
ABLATION_MODES = ("zero", "mean", "mean_position", "resample")

#: How :func:`mha.pruning.gates.train_exact_k` trains: an L0 Lagrangian on
#: the expected count kept, or Gumbel top-k with a straight-through estimator.
EXACT_K_METHODS = ("top_k", "lagrangian")

# The timing protocol of :mod:`mha.pruning.speed`.
REPEATS = 10  # Rounds of timing: the floor (issue 14's).
MIN_SECONDS = 0.2  # Shortest timing window per model and round (fixed).
#: The adaptive protocol's defaults (the study's): windows of 0.02 s, a cell
#: stops once its speed-up's interval is within 10% of it, 40 rounds at most.
ADAPTIVE_MIN_SECONDS = 0.02
TARGET_WIDTH = 0.10
MAX_REPEATS = 40
CONFIDENCE = 0.95  # Nominal coverage of the median's interval.
