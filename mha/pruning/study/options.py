"""The study's settings, :class:`StudyOptions`, and its flags made from them.

Each setting is one dataclass field whose metadata holds its help text; the
command line (``scripts/prune_heads.py``) defines its flags from these
fields with :func:`define_flags` and reads them back with
:func:`from_flags`, so a setting's name, default and help live here once.
Fields whose metadata says ``flag=False`` are settable from Python only.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping

from absl import flags

from mha.run import cli
from mha.run.figures import PLOT_FORMATS
from mha.pruning.constants import (ABLATION_STREAMING, ADAPTIVE_MIN_SECONDS,
                                   DUO_GATES_STEPS, EXACT_K_METHODS,
                                   KV_SCORES, MAX_REPEATS, ORDERINGS,
                                   REPEATS, TARGET_WIDTH, parse_ablation)

#: ``--shapley``: how the Shapley values are computed.
SHAPLEY_METHODS = ("auto", "exact", "sampled")


def _option(default: Any, help: str, *, flag: bool = True) -> Any:  # pylint: disable=redefined-builtin
  """A field of :class:`StudyOptions` with its command line help."""
  return dataclasses.field(default=default,
                           metadata={"help": help, "flag": flag})


@dataclasses.dataclass(frozen=True)
class StudyOptions:
  """Settings of the study (the flags of ``scripts/prune_heads.py``).

  Each field's help is in its metadata (``StudyOptions.help(name)``).
  """

  num_seeds: int = _option(
      5, "Models analysed: the workdir's and num_seeds-1 more trained with "
      "the next seeds.")
  retrain_seeds: bool = _option(
      False, "Retrain a seed directory that was trained with another config "
      "(otherwise that is an error).")
  oracle_max_heads: int = _option(
      16, "Evaluate every subset of heads (the oracle, Shapley values) up to "
      "this many heads, streamed (about 2.5 min at 16 heads on 2 CPU cores); "
      "skipped above it.")
  shapley: str = _option(
      "auto", "Shapley values: exact (from every subset; needs at most "
      "--oracle_max_heads heads), sampled (antithetic permutations, with "
      "intervals), or auto (exact where the oracle runs, sampled above).")
  shapley_pairs: int = _option(
      32, "Antithetic pairs of permutations of the sampled Shapley values.")
  searches: bool = _option(
      True, "Search for the best subset per number of heads removed, on "
      "validation: the layer-additive surrogate and beam search "
      "(searches.surrogate, searches.beam; curves 'surrogate' and 'beam'). "
      "Where the oracle runs, their gap to it is measured.")
  kwon: bool = _option(
      True, "Kwon et al.'s retraining-free pruning per number of heads "
      "removed, on validation: Fisher mask search with rearrangement within "
      "layers (searches.kwon); with the kept heads' mask values tuned by "
      "least squares as Kwon et al. do, to the layer output with the "
      "residual (searches.kwon_tuned), and to the attention output alone "
      "(searches.kwon_tuned_attention_output); and the oracle's subsets "
      "tuned as Kwon et al. do (searches.oracle_kwon_tuned).")
  beam_width: int = _option(
      8, "Subsets kept per level of the beam search.")
  surrogate_top: int = _option(
      8, "Combinations per number of heads removed that the layer-additive "
      "surrogate evaluates exactly.")
  search_polish_rounds: int = _option(
      2, "Rounds of swap local search polishing each surrogate subset.")
  num_bootstrap: int = _option(
      1000, "Bootstrap resamples of every 95% interval.")
  bootstrap_importance: bool = _option(
      True, "Re-estimate the gradient (raw, L2 per layer, reverse) and "
      "leave-one-out orderings in every bootstrap resample, from per-example "
      "values, so that their intervals include the orderings' own "
      "uncertainty (the other orderings' intervals are conditional on "
      "their order).")
  bootstrap_importance_max_masks: int = _option(
      1024, "At most this many masks evaluated for the re-estimated "
      "orderings per seed; an ordering that needs more stays conditional.")
  num_random_orders: int = _option(
      20, "Random orders per seed (the baseline).")
  step_fraction: float = _option(
      0.0, "Fraction of heads removed per curve point; 0 removes one head at "
      "a time.")
  reestimate: bool = _option(
      True, "Also prune re-estimating gradient importance after each "
      "removal.")
  tolerance: float = _option(
      0.01, "Accuracy loss counted as none (0.01 = 1 point).")
  loss_tolerance_bits: float = _option(
      0.05, "Loss increase counted as none by the level prunable by loss, "
      "in bits per scored token (a character LM's bits per character).")
  speed_fractions: tuple[float, ...] = _option(
      (0.25, 0.5, 0.75),
      "Fractions of heads physically pruned for the speed table.")
  batch_sizes: tuple[int, ...] = _option(
      (1, 16, 64, 256), "Batch sizes of the speed table.")
  speed_repeats: int = _option(
      REPEATS, "Timing rounds per model at least, the models' order "
      "rotated every round (median and its interval).")
  speed_max_repeats: int = _option(
      MAX_REPEATS, "Timing rounds per model at most: a cell stops "
      "earlier once its speed-up is known within --speed_target_width.")
  speed_target_width: float = _option(
      TARGET_WIDTH, "Adaptive timing: a cell stops once its speed-up's "
      "interval is at most this share of the speed-up wide; 0 runs exactly "
      "--speed_repeats rounds.")
  speed_min_seconds: float = _option(
      ADAPTIVE_MIN_SECONDS, "Shortest timing window per model and "
      "round, seconds.")
  speed_order: str = _option(
      "gradient_l2", "Ordering pruned for the speed table.")
  remove_heads: tuple[tuple[int, int], ...] = _option(
      (), "Also prune exactly these heads and report test accuracy, e.g. "
      "0:1,1:3 (LAYER:HEAD, 0-based).")
  batch_size: int = _option(1000, "Examples per evaluation call.")
  max_examples: int = _option(
      0, "Study at most this many examples of validation and of test, "
      "evenly spaced through each split (0: all); for a split of many long "
      "examples, such as the character LM's windows.")
  seed: int = _option(0, "Seed of the random orders.")
  speed: bool = _option(True, "Run the speed table.")
  plots: bool = _option(
      True, "Draw the report's figures (PNG files beside report.md); "
      "--noplots writes report.md without them, quicker where many studies "
      "run (a benchmark grid's cells).")
  plot_format: str = _option(
      "png", "File format of the report's figures: png, svg or pdf (vector "
      "graphics, for papers; report.md inlines PNG and SVG and links PDF).")
  attribution: bool = _option(
      True, "Attribution patching's three orderings (zero, mean per "
      "position and resample baselines) and their check against actual "
      "patching.")
  ablation: str = _option(
      "zero", "What a removed head outputs: zero, mean (its mean context "
      "over validation), mean_position (that mean at each position), "
      "resample (its context on another example of the same length) or, on "
      "a causal decoder, streaming:SINKS,WINDOW (it keeps a streaming KV "
      "cache: it attends to the first SINKS positions and the last WINDOW "
      "up to the query; e.g. streaming:4,16). The oracle, every curve, the "
      "searches, leave-one-out and Shapley values are computed under it "
      "(under streaming, gradient and Fisher too, and the curves gain "
      "kv_memory; on a GQA model whole key/value groups stream too).")
  gates: bool = _option(
      False, "Learn exact-K head gates, one per number of heads removed "
      "(--gate_targets, --gate_method; the gates' main result), and "
      "hard-concrete head gates (Voita et al.) for each "
      "--gate_lambdas strength, and evaluate their kept heads like every "
      "other subset.")
  gate_lambdas: tuple[float, ...] = _option(
      (0.1, 0.3, 1.0, 2.0, 3.0, 4.0, 6.0),
      "Strengths of the expected-L0 penalty of the gates (per head kept).")
  gate_targets: tuple[int, ...] = _option(
      (), "Heads removed (k) of the exact-K gates that --gates trains, one "
      "gate vector per k, each removing exactly k heads (searches.gates_k, "
      "curve 'gates_k', gates.exact_k); empty: every k from 1 to N - 1. A k "
      "left out takes the ranking of the nearest one given.")
  gate_method: str = _option(
      "top_k", "How the exact-K gates train: top_k (Gumbel top-k, exactly "
      "N - k heads kept in every step; Li et al. 2021) or lagrangian "
      "(hard-concrete gates, an L0 Lagrangian on the count kept; Wang et "
      "al. 2020).")
  gate_temperature: float = _option(
      0.5, "Temperature of the top-k relaxation of --gate_method=top_k.",
      flag=False)
  gate_steps: int = _option(200, "Training steps of the gates.")
  duo_gates_steps: int = _option(
      DUO_GATES_STEPS, "Training steps of DuoAttention's gates (under a "
      "streaming ablation: curve 'duo_gates').")
  gate_learning_rate: float = _option(
      0.1, "Learning rate of the gates (Adam).", flag=False)
  retrain: bool = _option(
      False, "Fine-tune pruned models (gradient order, oracle, gates, random) "
      "for --retrain_steps against the same architectures from scratch "
      "(Scratch-E: the run's steps; Scratch-B: the FLOPs of the run and the "
      "fine-tuning) and the kept heads rewound to step 0 (the run's steps) "
      "(trains the gates too).")
  retrain_steps: int = _option(
      100, "Steps of each fine-tuning (and of the old from-scratch "
      "control).")
  retrain_fractions: tuple[float, ...] = _option(
      (0.25, 0.5, 0.75), "Fractions of the heads removed before "
      "retraining.")
  retrain_random: int = _option(
      5, "Random subsets retrained per fraction and seed.")
  retrain_controls_random: bool = _option(
      False, "Also train the fair controls (Scratch-E, Scratch-B, rewind) "
      "of the random subsets, not only of the orderings' (gradient, oracle, "
      "gates): about twice their training time.")
  over_training: bool = _option(
      True, "Also analyse every other checkpoint step each seed's run "
      "keeps (the oracle's prunable level, each ordering's AUC gap to the "
      "oracle, the best ordering and the oracle by loss; no searches): "
      "checkpoints_over_training in results.json. --noover_training turns it "
      "off.")
  mean_ablation: bool = _option(
      False, "Also every curve with removed heads outputting their mean over "
      "validation instead of zero.")

  @classmethod
  def help(cls, name: str) -> str:
    """The help text of the field ``name``."""
    return _fields()[name].metadata["help"]

  def validate(self) -> None:
    """Raises ValueError naming the first bad setting."""
    if self.max_examples < 0:
      raise ValueError(
          f"--max_examples must be >= 0 (0: all), got {self.max_examples}")
    for name in ("num_seeds", "oracle_max_heads", "num_bootstrap",
                 "num_random_orders", "speed_repeats", "batch_size",
                 "beam_width", "surrogate_top"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
    if self.bootstrap_importance_max_masks < 0:
      raise ValueError("--bootstrap_importance_max_masks must be >= 0, got "
                       f"{self.bootstrap_importance_max_masks}")
    if self.search_polish_rounds < 0:
      raise ValueError("--search_polish_rounds must be >= 0, got "
                       f"{self.search_polish_rounds}")
    if self.shapley not in SHAPLEY_METHODS:
      raise ValueError(f"--shapley {self.shapley!r} is not one of: "
                       f"{', '.join(SHAPLEY_METHODS)}")
    if self.shapley_pairs < 2:
      raise ValueError(
          f"--shapley_pairs must be >= 2, got {self.shapley_pairs}")
    if not 0.0 <= self.step_fraction <= 1.0:
      raise ValueError(
          f"--step_fraction must be in [0, 1], got {self.step_fraction}")
    if not 0.0 <= self.tolerance <= 1.0:
      raise ValueError(f"--tolerance must be in [0, 1], got {self.tolerance}")
    if not 0.0 <= self.loss_tolerance_bits <= 100.0:
      raise ValueError("--loss_tolerance_bits must be in [0, 100], got "
                       f"{self.loss_tolerance_bits}")
    if self.speed_max_repeats < self.speed_repeats:
      raise ValueError(
          f"--speed_max_repeats ({self.speed_max_repeats}) must be >= "
          f"--speed_repeats ({self.speed_repeats})")
    for name in ("speed_target_width", "speed_min_seconds"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"--{name} must be >= 0, got {value}")
    for f in self.speed_fractions:
      if not 0.0 <= f <= 1.0:
        raise ValueError(
            f"--speed_fractions: {f} is outside [0, 1]")
    if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
      raise ValueError(
          f"--batch_sizes must be positive integers, got {self.batch_sizes}")
    if self.speed_order not in ORDERINGS or self.speed_order in (
        "random", "shapley") + KV_SCORES:
      valid = ", ".join(k for k in ORDERINGS
                        if k not in ("random", "shapley") + KV_SCORES)
      raise ValueError(
          f"--speed_order {self.speed_order!r} is not one of: {valid}")
    try:
      mode = parse_ablation(self.ablation)[0]
    except ValueError as e:
      raise ValueError(f"--{e}") from None
    if mode == ABLATION_STREAMING and self.extensions:
      raise ValueError(
          f"--ablation {self.ablation}: gates, retraining and mean ablation "
          "(--gates, --retrain, --mean_ablation, --full) assume removed "
          "heads output nothing; run them with --ablation zero")
    if self.plot_format not in PLOT_FORMATS:
      raise ValueError(f"--plot_format {self.plot_format!r} is not one of: "
                       f"{', '.join(PLOT_FORMATS)}")
    if self.speed_order == "gradient_iterative" and not self.reestimate:
      raise ValueError("--speed_order=gradient_iterative needs --reestimate")
    self._validate_extensions()

  def _validate_extensions(self) -> None:
    for name in ("gate_steps", "duo_gates_steps", "retrain_steps",
                 "retrain_random"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
    if not self.gate_lambdas or any(
        not (math.isfinite(x) and x >= 0) for x in self.gate_lambdas):
      raise ValueError("--gate_lambdas must be numbers >= 0, got "
                       f"{list(self.gate_lambdas)}")
    if any(t < 1 for t in self.gate_targets):
      raise ValueError("--gate_targets must be numbers of heads removed >= "
                       f"1, got {list(self.gate_targets)}")
    if self.gate_method not in EXACT_K_METHODS:
      raise ValueError(f"--gate_method {self.gate_method!r} is not one of: "
                       f"{', '.join(EXACT_K_METHODS)}")
    if not (math.isfinite(self.gate_temperature)
            and self.gate_temperature > 0):
      raise ValueError("--gate_temperature must be > 0, got "
                       f"{self.gate_temperature}")
    if not (math.isfinite(self.gate_learning_rate)
            and self.gate_learning_rate > 0):
      raise ValueError("--gate_learning_rate must be > 0, got "
                       f"{self.gate_learning_rate}")
    if not self.retrain_fractions or any(
        not 0.0 < f < 1.0 for f in self.retrain_fractions):
      raise ValueError("--retrain_fractions must be in (0, 1), got "
                       f"{list(self.retrain_fractions)}")

  @property
  def extensions(self) -> bool:
    """Whether any extension runs: gates, retraining or mean ablation."""
    return self.gates or self.retrain or self.mean_ablation


def _fields() -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(StudyOptions)}


def _field_types() -> dict[str, Any]:
  return typing.get_type_hints(StudyOptions)


#: The absl flag of each scalar field type.
_DEFINERS = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
             float: flags.DEFINE_float, str: flags.DEFINE_string}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS
                 ) -> dict[str, flags.FlagHolder]:
  """Defines one flag per :class:`StudyOptions` field (but those with
  ``flag=False``), its default and help the field's; returns the holders by
  field name. Lists (``--batch_sizes=1,16``) are comma-separated;
  ``--remove_heads`` is ``LAYER:HEAD,...``."""
  defaults, types, holders = StudyOptions(), _field_types(), {}
  for name, field in _fields().items():
    if not field.metadata["flag"]:
      continue
    default, kind, text = getattr(defaults, name), types[name], field.metadata[
        "help"]
    if name == "remove_heads":
      holders[name] = flags.DEFINE_string(
          name, ",".join(f"{l}:{h}" for l, h in default), text,
          flag_values=flag_values)
    elif kind in _DEFINERS:
      holders[name] = _DEFINERS[kind](name, default, text,
                                      flag_values=flag_values)
    else:  # tuple[int, ...] or tuple[float, ...]
      holders[name] = flags.DEFINE_list(name, [f"{v:g}" for v in default],
                                        text, flag_values=flag_values)
  return holders


def from_flags(holders: Mapping[str, flags.FlagHolder],
               **overrides: Any) -> StudyOptions:
  """The :class:`StudyOptions` of the parsed flags (``overrides`` win),
  validated.

  Raises:
    cli.UsageError: a value that does not parse, or a bad setting.
  """
  types, values = _field_types(), {}
  for name, holder in holders.items():
    value = holder.value
    if name == "remove_heads" and not value.strip():
      value = ()
    elif name == "remove_heads":
      # Imported here: mha.head_masks imports Flax, the flags do not.
      from mha.head_masks import parse_heads  # pylint: disable=import-outside-toplevel
      try:
        value = tuple(parse_heads(value))
      except ValueError as e:
        raise cli.UsageError(f"--remove_heads: {e}") from None
    elif typing.get_origin(types[name]) is tuple:
      value = cli.numbers(name, value, typing.get_args(types[name])[0])
    values[name] = value
  options = StudyOptions(**(values | overrides))
  try:
    options.validate()
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  return options


__all__ = ["StudyOptions", "define_flags", "from_flags"]
