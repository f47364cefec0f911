r"""Which attention heads matter? The head-importance and pruning experiment.

    python scripts/prune_heads.py --workdir runs/reverse

Loads the trained checkpoint of ``--workdir``, trains ``--num_seeds - 1``
more seeds of its config (reused on a second run when their recorded
config matches; otherwise refused, or retrained with ``--retrain_seeds``),
measures every head's importance on validation (gradient, leave-one-out,
confidence, entropy, and with at most ``--oracle_max_heads`` heads every
subset of heads: the oracle and exact Shapley values), prunes heads in each
order and measures test accuracy with 95% bootstrap intervals
(``--num_bootstrap``), times physically pruned models, and writes
``results.json``, ``report.md`` and PNG plots to ``--out`` (default
``<workdir>/pruning``). See mha/pruning/study/.

Beyond ranking heads (off by default; ``--full`` = all three):
``--gates`` learns exact-K head gates for every number of heads removed
(``--gate_targets``, ``--gate_method``) and hard-concrete gates for each
``--gate_lambdas`` strength, ``--retrain`` fine-tunes pruned models for
``--retrain_steps`` against the same architectures from scratch (Scratch-E,
Scratch-B) and the kept heads rewound to step 0, ``--mean_ablation``
redraws every curve with removed heads outputting their mean
(mha/pruning/study/extensions.py).

A user's mistake (no checkpoint, a fraction outside [0, 1], a head that
does not exist, ``--oracle_max_heads`` below 1, a seed directory trained
with another config, an ``--out`` that another study is writing: it is
locked for the whole study, ``mha.run.workdir_lock``) is one line on stderr and
exit code 2, found before anything is written. So are the output folders
that may not be written: an empty ``--workdir``, ``--out`` or
``--save_pruned``; a folder that cannot be made or written (a file in the
way, a read-only file system); a folder inside a run's ``checkpoints/``
(a resume of that run would delete it); an ``--out`` holding the study of
another run (its ``results.json``); a ``--save_pruned`` that is, or holds,
the current directory or the source workdir (it is replaced whole).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time

from absl import app
from absl import flags
from absl import logging

from mha.run import cli
from mha.run import interrupt
# The flags need only the options, which import no JAX: --help, a mistyped
# flag, most bad options and a missing workdir answer at once. What runs the
# study (JAX, Flax, orbax, TFDS) is imported by _import_the_study, once the
# command line holds up.
from mha.pruning.study import options as study_options
from mha.pruning.study.options import StudyOptions

# The modules that _import_the_study binds.
build = ckpt_lib = compilation_cache = config_validation = data = None
evaluate = pruning = workdir_lock = export = study = study_outputs = None

_PROG = "prune_heads.py"
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Training workdir holding the checkpoint.",
                               required=True)
_STEP = flags.DEFINE_integer(
    "step", None, "Checkpoint step to analyse (default: the newest).")
_OUT = flags.DEFINE_string("out", None,
                           "Output folder (default: <workdir>/pruning).")
# One flag per StudyOptions field: its name, default and help live there.
_OPTIONS = study_options.define_flags()
flags.adopt_module_key_flags(study_options)
_FULL = flags.DEFINE_bool(
    "full", False, "All of the above: --gates --retrain --mean_ablation.")
_ACCEPT_ESTIMATE = flags.DEFINE_bool(
    "accept_estimate", False, "Run an oracle estimated above 30 minutes "
    "(all seeds); needs --oracle_max_heads given explicitly.")
_SAVE_PRUNED = flags.DEFINE_string(
    "save_pruned", None, "Instead of the study: save the model with "
    "--remove_heads (or --prune_fraction of --order) removed as a workdir "
    "here, print its test metrics and exit.")
_PRUNE_FRACTION = flags.DEFINE_float(
    "prune_fraction", None, "With --save_pruned: the fraction of the heads "
    "removed, the least important first in --order.")
_ORDER = flags.DEFINE_string(
    "order", None, "With --prune_fraction: an ordering of the study (not "
    "random), or oracle (the best subset on validation with the heads "
    "removed, as the saved model has them: zero ablation, whatever "
    "--ablation says).")


def _options() -> StudyOptions:
  """The study's options of the flags (``--full`` turns on every
  extension); ``cli.UsageError`` for a bad one."""
  full = {name: True for name in ("gates", "retrain", "mean_ablation")
          } if _FULL.value else {}
  return study_options.from_flags(_OPTIONS, **full)


def main(argv: list[str]) -> None:
  del argv
  # SIGINT and SIGTERM mean one thing at any moment: one line, 130 / 143.
  with interrupt.stop_on_signals():
    try:
      _main()
    except interrupt.Interrupted as e:
      out = _OUT.value or os.path.join(_WORKDIR.value or ".", "pruning")
      print(f"{_PROG}: stopped by {e}; kept: the seeds trained and "
            f"analysed so far in {os.path.join(out, 'seeds')} and any "
            f"earlier results in {out}; the same command resumes (trained "
            f"seeds and finished analyses are reused, the seed under way "
            f"resumes from its checkpoint): python "
            f"{shlex.join(sys.argv)}", file=sys.stderr, flush=True)
      sys.exit(e.exit_code)


def _main() -> None:
  logging.set_verbosity(logging.WARNING)
  if _OUT.value is not None:  # "" is no folder at all.
    cli.nonempty_path(_PROG, _OUT.value.strip(), "out")
  workdir = cli.existing_dir(_PROG, _WORKDIR.value)
  save = (_SAVE_PRUNED.value is not None or _PRUNE_FRACTION.value is not None
          or _ORDER.value is not None)
  if not save:
    try:  # Before JAX is imported: a bad option answers at once.
      options = _options()
    except cli.UsageError as e:
      cli.fail(_PROG, e)
    if _ACCEPT_ESTIMATE.value and not flags.FLAGS["oracle_max_heads"].present:
      cli.fail(_PROG, "--accept_estimate needs --oracle_max_heads given "
                      "explicitly (the number of heads whose oracle you "
                      "accept)")
  _import_the_study()
  try:
    _configure_compilation_cache(workdir)
  except config_validation.ConfigError as e:  # A damaged config.json.
    cli.fail(_PROG, e)
  if save:
    _save_pruned(workdir)
    return
  out = os.path.abspath(os.path.expanduser(
      _OUT.value or os.path.join(workdir, "pruning")))

  try:  # Every user error is found before the long work starts.
    first = study.check_inputs(workdir, out, options, _STEP.value,
                               accept_estimate=_ACCEPT_ESTIMATE.value)
  except (FileNotFoundError, ValueError) as e:
    cli.fail(_PROG, str(e).splitlines()[0] if str(e) else type(e).__name__)

  start = time.time()
  lock = workdir_lock.WorkdirLock(out)  # One study per folder at a time.
  try:
    lock.acquire()
  except config_validation.ConfigError as e:  # Locked, or cannot be made.
    cli.fail(_PROG, e)
  try:
    print(f"Pruning experiment on {workdir} -> {out}", flush=True)
    try:  # Checked again under the lock, the checkpoint not read again.
      results = study.run(workdir, out, options, _STEP.value,
                          checkpoint=first,
                          accept_estimate=_ACCEPT_ESTIMATE.value)
    except config_validation.ConfigError as e:
      cli.fail(_PROG, e)
  finally:
    lock.release()
  _print_summary(results, out, time.time() - start, options)


def _import_the_study() -> None:
  """Imports what runs the study into this module's namespace (deferred, so
  that a mistyped flag answers without importing JAX)."""
  # pylint: disable=global-statement,import-outside-toplevel,redefined-outer-name
  global build, ckpt_lib, compilation_cache, config_validation, data
  global evaluate, pruning, workdir_lock, export, study, study_outputs
  from mha import build
  from mha import checkpoint as ckpt_lib
  from mha.run import compilation_cache
  from mha.run import config_validation
  from mha import data
  from mha import evaluate
  from mha import pruning
  from mha.run import workdir_lock
  from mha.pruning import export
  from mha.pruning import study
  from mha.pruning.study import outputs as study_outputs
  import mha.pruning.study.experiment  # The study's own modules too.
  # pylint: enable=global-statement,import-outside-toplevel,redefined-outer-name


def _configure_compilation_cache(workdir: str) -> None:
  """The persistent compilation cache of the workdir's run config (its
  ``compilation_cache_dir``), before anything is compiled."""
  saved = ckpt_lib.saved_config(workdir) or {}
  compilation_cache.configure(
      ckpt_lib.complete_config(saved).compilation_cache_dir, _PROG)


def _save_pruned(workdir: str) -> None:
  """--save_pruned: write the pruned model, print its test metrics."""
  try:
    heads, order = export.check_request(
        _SAVE_PRUNED.value, workdir,
        remove_heads=_OPTIONS["remove_heads"].value,
        prune_fraction=_PRUNE_FRACTION.value, order=_ORDER.value)
    ckpt = ckpt_lib.load_checkpoint(workdir, _STEP.value)
    if order is not None:
      heads = _heads_of_order(ckpt, order, _PRUNE_FRACTION.value)
    # A head that does not exist fails here, before anything is written.
    pruning.prune_heads(ckpt.params, ckpt.model_config, heads)
  except (cli.UsageError, FileNotFoundError, ValueError) as e:
    cli.fail(_PROG, e)
  details = ({"order": order, "prune_fraction": _PRUNE_FRACTION.value}
             if order is not None else {})
  try:  # Checked again just before writing; a folder that cannot be made.
    provenance = export.save_pruned(ckpt, heads, _SAVE_PRUNED.value,
                                    source=workdir, details=details)
  except config_validation.ConfigError as e:
    cli.fail(_PROG, e)
  out = os.path.abspath(os.path.expanduser(_SAVE_PRUNED.value))
  pruned = ckpt_lib.load_checkpoint(out)  # Evaluate what was written.
  test = data.load_splits(build.data_spec(ckpt.config),
                          ckpt.config.data.data_dir)["test"]
  batch = ckpt.config.eval_batch_size
  metrics = evaluate.evaluate(pruned.model, pruned.params, test, batch)
  before = evaluate.evaluate(ckpt.model, ckpt.params, test, batch)
  removed = ", ".join(f"{l}:{h}" for l, h in provenance["removed"]) or "none"
  print(f"Wrote the model of {workdir} (step {ckpt.step}) without heads "
        f"{removed} (heads per layer {provenance['heads_per_layer']}) to {out}")
  print("Test: " + ", ".join(
      f"{k} {metrics[k]:.4f} (unpruned {before[k]:.4f})"
      for k in ("token_accuracy", "exact_match", "loss")))
  print(json.dumps({"out": out, **provenance, "test": metrics,
                    "test_unpruned": before}), flush=True)


def _heads_of_order(ckpt, order: str, fraction: float
                    ) -> list[tuple[int, int]]:
  """The --prune_fraction least important heads of ``order`` (computed on
  validation); a model too big for ``order`` is refused before any data is
  loaded."""
  options = _options()
  export.check_order(ckpt.model_config, order,
                     oracle_max_heads=options.oracle_max_heads)
  config = ckpt.config
  validation = data.scored_targets(data.load_splits(
      build.data_spec(config), config.data.data_dir)["validation"])
  return export.heads_of_order(
      ckpt.model, ckpt.params, validation, order, fraction,
      batch_size=options.batch_size,
      oracle_max_heads=options.oracle_max_heads)


def _print_summary(results, out: str, seconds: float,
                   options: StudyOptions) -> None:
  agg = results["aggregate"]["curve_summary"]
  labels = results["curve_labels"]
  width = max(len(label) for key, label in labels.items() if key in agg) + 2
  print(f"\n{'curve':<{width + 2}}AUC tok.acc [95% CI]   prunable heads "
        "(validation) [95% CI]")
  for key, label in labels.items():
    if key in agg:
      auc, ci = agg[key]["auc_token_accuracy"], agg[key][
          "auc_token_accuracy_ci"]
      heads = agg[key]["prunable_heads_token_accuracy"]
      hci = agg[key]["prunable_heads_token_accuracy_ci"]
      print(f"  {label:<{width}}{auc:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]   "
            f"{heads:.1f} [{hci[0]:.1f}, {hci[1]:.1f}]")
  rho = results["aggregate"]["spearman"]
  print(f"Spearman gradient vs leave-one-out (Fisher mean over seeds): "
        f"{rho['gradient_vs_leave_one_out']['rho']:.2f}; gradient on two "
        f"validation halves: {rho['gradient_halves']['rho']:.2f}")
  for s in results["seeds"]:
    t = s["timings"]
    oracle = (f"oracle {t['oracle_s']:.1f} s" if "oracle_s" in t else
              "oracle skipped")
    print(f"Seed {s['seed']}: analysis {t['total_s']:.1f} s ({oracle})")
  if "speed" in results:
    for e in results["speed"]["entries"]:
      rates = ", ".join(f"bs {b}: x{s:.2f}"
                        for b, s in e["speedup"].items())
      print(f"  {e['fraction']:.0%} heads pruned: {rates} "
            f"(FLOP ratio {list(e['flop_ratio'].values())[-1]:.2f})")
  _print_extensions(results)
  print(f"First seed{' incl. speed table' if results.get('speed') else ''}: "
        f"{results['timings']['first_seed_with_speed_s']:.1f} s; total "
        f"{seconds:.1f} s")
  print(study_outputs.written(out, options), flush=True)


def _print_extensions(results) -> None:
  """One line per gate strength and per retrained ordering and fraction."""
  for g in results.get("gates", {}).get("all", []):
    gap = g["minus_oracle_token_accuracy"]
    ci = g["minus_oracle_token_accuracy_ci"]
    versus = (f"minus the oracle {gap:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"
              if gap is not None and math.isfinite(gap) else "no oracle")
    print(f"  gates lambda {g['lambda']:g}: {g['heads_removed']:.1f} heads "
          f"removed, test tok.acc {g['test_token_accuracy']:.3f}, {versus}")
  retraining = results.get("retraining", {}).get("orderings", {})
  for name, by_fraction in retraining.items():
    for fraction, e in by_fraction.items():
      print(f"  retrain {name:<9} {float(fraction):.0%} removed: before "
            f"{e['before']:.3f}, after {e['after']:.3f} "
            f"[{e['after_ci'][0]:.3f}, {e['after_ci'][1]:.3f}]"
            + "".join(f", {label} {e[key]:.3f}" for key, label in (
                ("scratch_e", "Scratch-E"), ("scratch_b", "Scratch-B"),
                ("rewind", "rewind")) if key in e))
  mean = results.get("mean_ablation", {}).get("curve_summary", {})
  if "oracle" in mean:
    m = mean["oracle"]
    print(f"  mean ablation: oracle AUC {m['auc_token_accuracy']:.3f}, "
          f"minus zero ablation {m['auc_token_accuracy_mean_minus_zero']:+.3f}")


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
