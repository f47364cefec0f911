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
    # KV-cache head scores (causal models; duo_gates under streaming only).
    "retrieval_score": "retrieval score (Wu et al.)",
    "echo": "echo (RazorAttention)",
    "induction": "induction (RazorAttention)",
    "headkv": "HeadKV",
    "attention_distance": "mean attention distance",
    "duo_gates": "DuoAttention gates",
    "reverse_gradient": "reverse gradient",
    "random": "random",
}

#: The KV-cache head scores among :data:`ORDERINGS`: measured on causal
#: models (``duo_gates`` under a streaming ablation only), orders of which
#: heads keep a full cache, not of heads to cut out of a model.
KV_SCORES = ("retrieval_score", "echo", "induction", "headkv",
             "attention_distance", "duo_gates")

#: What a removed head outputs (:mod:`mha.pruning.ablation`), ``--ablation``'s
#: choices.
ABLATION_MODES = ("zero", "mean", "mean_position", "resample")
#: The mode ``streaming:SINKS,WINDOW``: a removed head keeps a streaming KV
#: cache (causal models).
ABLATION_STREAMING = "streaming"


def parse_ablation(spec: str) -> tuple[str, int, int]:
  """``(mode, sinks, window)`` of an ``--ablation`` value: one of
  :data:`ABLATION_MODES` (sinks and window 0) or ``streaming:SINKS,WINDOW``
  with integers ``SINKS, WINDOW >= 0`` and ``SINKS + WINDOW >= 1``; else
  ``ValueError``, naming what is wrong."""
  if spec in ABLATION_MODES:
    return spec, 0, 0
  name, sep, rest = spec.partition(":")
  choices = ", ".join(ABLATION_MODES
                      + (f"{ABLATION_STREAMING}:SINKS,WINDOW",))
  if name != ABLATION_STREAMING:
    raise ValueError(f"ablation {spec!r} is not one of: {choices}")
  parts = rest.split(",")
  if not sep or len(parts) != 2 or not all(
      p.strip().isdigit() for p in parts):
    raise ValueError(f"ablation {spec!r}: expected "
                     f"{ABLATION_STREAMING}:SINKS,WINDOW with two integers "
                     ">= 0, e.g. streaming:4,16")
  sinks, window = (int(p) for p in parts)
  if sinks + window < 1:
    raise ValueError(f"ablation {spec!r}: SINKS + WINDOW must be at least "
                     "1 (a streaming head keeps some positions)")
  return ABLATION_STREAMING, sinks, window


#: How :func:`mha.pruning.gates.train_exact_k` trains: an L0 Lagrangian on
#: the expected count kept, or Gumbel top-k with a straight-through estimator.
EXACT_K_METHODS = ("top_k", "lagrangian")

#: Training steps of DuoAttention's gates (:mod:`mha.pruning.duo_gates`).
DUO_GATES_STEPS = 200

# The timing protocol of :mod:`mha.pruning.speed`.
REPEATS = 10  # Rounds of timing: the floor (issue 14's).
MIN_SECONDS = 0.2  # Shortest timing window per model and round (fixed).
#: The adaptive protocol's defaults (the study's): windows of 0.02 s, a cell
#: stops once its speed-up's interval is within 10% of it, 40 rounds at most.
ADAPTIVE_MIN_SECONDS = 0.02
TARGET_WIDTH = 0.10
MAX_REPEATS = 40
CONFIDENCE = 0.95  # Nominal coverage of the median's interval.
