r"""Which attention heads matter? The head-importance and pruning experiment.

    python scripts/prune_heads.py --workdir runs/reverse

Loads the trained checkpoint of ``--workdir``, trains ``--num_seeds - 1``
more seeds of its config (reused on a second run), measures every head's
importance on validation (gradient, leave-one-out, confidence, entropy),
prunes heads in each order and measures test accuracy, times physically
pruned models, and writes ``results.json``, ``report.md`` and PNG plots to
``--out`` (default ``<workdir>/pruning``). See mha/pruning_experiment.py.

A user's mistake (no checkpoint, a fraction outside [0, 1], a head that
does not exist) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app
from absl import flags
from absl import logging

_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Training workdir holding the checkpoint.")
_STEP = flags.DEFINE_integer(
    "step", None, "Checkpoint step to analyse (default: the newest).")
_OUT = flags.DEFINE_string("out", None,
                           "Output folder (default: <workdir>/pruning).")
_NUM_SEEDS = flags.DEFINE_integer(
    "num_seeds", 3, "Models analysed: the workdir's and num_seeds-1 more "
    "trained with the next seeds.")
_NUM_RANDOM = flags.DEFINE_integer("num_random_orders", 20,
                                   "Random orders per seed (the baseline).")
_STEP_FRACTION = flags.DEFINE_float(
    "step_fraction", 0.0, "Fraction of heads removed per curve point; 0 "
    "removes one head at a time.")
_REESTIMATE = flags.DEFINE_bool(
    "reestimate", True, "Also prune re-estimating gradient importance after "
    "each removal.")
_TOLERANCE = flags.DEFINE_float(
    "tolerance", 0.01, "Accuracy loss counted as none (0.01 = 1 point).")
_SPEED_FRACTIONS = flags.DEFINE_list(
    "speed_fractions", ["0.25", "0.5", "0.75"],
    "Fractions of heads physically pruned for the speed table.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "16", "64", "256"],
                                 "Batch sizes of the speed table.")
_SPEED_REPEATS = flags.DEFINE_integer("speed_repeats", 5,
                                      "Timing repeats (median).")
_SPEED_ORDER = flags.DEFINE_string(
    "speed_order", "gradient_l2", "Ordering pruned for the speed table.")
_SPEED = flags.DEFINE_bool("speed", True, "Run the speed table.")
_REMOVE_HEADS = flags.DEFINE_string(
    "remove_heads", "", "Also prune exactly these heads and report test "
    "accuracy, e.g. 0:1,1:3 (LAYER:HEAD, 0-based).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 1000,
                                   "Examples per evaluation call.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random orders.")


class UsageError(Exception):
  """A mistake in the command line: reported in one line, exit code 2."""


def _fail(message: str) -> None:
  print(f"prune_heads.py: error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def _numbers(name: str, values: list[str], kind: type) -> tuple:
  """The comma-separated values of flag ``name`` as ``kind`` (int or float)."""
  try:
    return tuple(kind(v) for v in values)
  except ValueError:
    what = "integers" if kind is int else "numbers"
    raise UsageError(f"--{name} must be {what}, got {','.join(values)}"
                     ) from None


def _options():
  from mha import pruning, pruning_experiment

  try:
    heads = tuple(pruning.parse_heads(_REMOVE_HEADS.value))
  except ValueError as e:
    raise UsageError(f"--remove_heads: {e}") from None
  options = pruning_experiment.Options(
      num_seeds=_NUM_SEEDS.value,
      num_random_orders=_NUM_RANDOM.value,
      step_fraction=_STEP_FRACTION.value,
      reestimate=_REESTIMATE.value,
      tolerance=_TOLERANCE.value,
      speed_fractions=_numbers("speed_fractions", _SPEED_FRACTIONS.value,
                                 float),
      batch_sizes=_numbers("batch_sizes", _BATCH_SIZES.value, int),
      speed_repeats=_SPEED_REPEATS.value,
      speed_order=_SPEED_ORDER.value,
      speed=_SPEED.value,
      remove_heads=heads,
      batch_size=_BATCH_SIZE.value,
      seed=_SEED.value,
  )
  try:
    options.validate()
  except ValueError as e:
    raise UsageError(str(e)) from None
  return options


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  if not _WORKDIR.value:
    _fail("--workdir is required")
  workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
  if not os.path.isdir(workdir):
    _fail(f"workdir {workdir} does not exist or is not a directory")
  out = os.path.abspath(os.path.expanduser(
      _OUT.value or os.path.join(workdir, "pruning")))
  if os.path.exists(out) and not os.path.isdir(out):
    _fail(f"--out {out} exists and is not a directory")

  try:
    options = _options()
  except UsageError as e:
    _fail(str(e))

  from mha import checkpoint as ckpt_lib, pruning, pruning_experiment

  try:  # Every user error is found before the long work starts.
    first = ckpt_lib.load_checkpoint(workdir, _STEP.value)
    pruning_experiment.check_step(first, _STEP.value, options.num_seeds)
    if options.remove_heads:
      pruning.prune_heads(first.params, first.model_config,
                          options.remove_heads)
  except (FileNotFoundError, ValueError) as e:
    _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

  start = time.time()
  print(f"Pruning experiment on {workdir} -> {out}", flush=True)
  results = pruning_experiment.run(workdir, out, options, _STEP.value)
  _print_summary(results, out, time.time() - start)


def _print_summary(results, out: str, seconds: float) -> None:
  agg = results["aggregate"]["curve_summary"]
  labels = results["orderings"]
  print("\nordering                   AUC tok.acc     prunable (<=1pt)")
  for key, label in labels.items():
    if key in agg:
      auc = agg[key]["auc_token_accuracy"]
      frac = agg[key]["max_prunable_token_accuracy"]
      print(f"  {label:<25}{auc['mean']:.3f} ± {auc['std']:.3f}   "
            f"{frac['mean']:.2f} ± {frac['std']:.2f}")
  rho = results["aggregate"]["spearman"]
  print(f"Spearman gradient vs leave-one-out: "
        f"{rho['gradient_vs_leave_one_out']['mean']:.2f}; gradient on two "
        f"validation halves: {rho['gradient_halves']['mean']:.2f}")
  t = results["seeds"][0]["timings"]
  print(f"Leave-one-out vmapped {t['leave_one_out_vmapped_warm_s']:.3f} s vs "
        f"loop {t['leave_one_out_loop_s']:.3f} s "
        f"(x{t['leave_one_out_speedup']:.1f})")
  if "speed" in results:
    for e in results["speed"]["entries"]:
      rates = ", ".join(f"bs {b}: x{s:.2f}"
                        for b, s in e["speedup"].items())
      print(f"  {e['fraction']:.0%} heads pruned: {rates} "
            f"(FLOP ratio {list(e['flop_ratio'].values())[-1]:.2f})")
  print(f"First seed incl. speed table: "
        f"{results['timings']['first_seed_with_speed_s']:.1f} s; total "
        f"{seconds:.1f} s")
  print(f"Wrote {os.path.join(out, 'results.json')}, "
        f"{os.path.join(out, 'report.md')} and plots.", flush=True)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # A bad flag value: one line, exit 2.
    _fail(str(e).splitlines()[0])
    raise  # Unreachable: _fail exits.


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
