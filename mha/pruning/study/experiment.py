"""The head-importance and head-pruning study, end to end: :func:`run`.

``scripts/prune_heads.py`` is a thin command line over :func:`run`:

1. Load the trained checkpoint of ``workdir`` and the other seeds
   (:mod:`mha.pruning.study.seeds`, the only module that trains).
2. Per seed: importance, orders, the oracle, curves and Michel et al.'s
   tables (:mod:`mha.pruning.study.analysis`), then the extensions asked
   for (:mod:`mha.pruning.study.extensions`: gates, retraining, mean
   ablation).
3. Across seeds: means with two-level bootstrap intervals; with
   ``over_training`` (on by default), every other checkpoint each seed's
   run keeps, analysed the same way (:mod:`mha.pruning.study.over_training`).
4. On the first seed: physical pruning at ``speed_fractions`` of the heads,
   examples/s at ``batch_sizes`` against parameter and FLOP counts
   (:mod:`mha.pruning.speed`).

Everything lands in ``out``: ``results.json``, ``report.md``, PNG plots and
each seed's per-example sums of every mask it evaluated
(``examples_seed<s>.npz``): :mod:`mha.pruning.study.outputs`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Mapping, Sequence

import jax
import ml_collections
import numpy as np

from mha import build
from mha import checkpoint as ckpt_lib
from mha.run import cli
from mha.run import config_validation
from mha.run import interrupt
from mha.run import provenance
from mha import data
from mha.aliases import Log
from mha.run.progress import timed
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.pruning import export
from mha.pruning import gates
from mha.pruning import oracle
from mha.pruning import orderings
from mha.pruning import speed
from mha.pruning import stats
from mha.pruning.study import analysis
from mha.pruning.study import extensions
from mha.pruning.study import kept_analyses
from mha.pruning.study import outputs
from mha.pruning.study import over_training
from mha.pruning.study import seeds as seeds_lib
from mha.pruning.study.options import StudyOptions


RESULTS_FILE = "results.json"


def _real(path: str) -> str:
  return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _recorded_study(out: str) -> dict[str, Any] | None:
  """The ``results.json`` in ``out`` (None when there is none).

  Raises:
    ConfigError: it is not a study's results (unreadable, or no
      ``workdir``).
  """
  path = os.path.join(out, RESULTS_FILE)
  if not os.path.lexists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      results = json.load(f)
  except (OSError, ValueError) as e:
    raise config_validation.ConfigError(
        f"--out {out} holds a {RESULTS_FILE} that does not read as a study's "
        f"({cli.one_line(e)}); refusing to overwrite it: delete it or choose "
        "another --out") from None
  if not isinstance(results, dict) or not isinstance(
      results.get("workdir"), str):
    raise config_validation.ConfigError(
        f"--out {out} holds a {RESULTS_FILE} that is not a study's (it names "
        "no workdir); refusing to overwrite it: delete it or choose another "
        "--out")
  return results


def check_out_dir(workdir: str, out_dir: str,
                  first: ckpt_lib.LoadedCheckpoint | None = None) -> None:
  """Checks that the study of ``workdir`` may write to ``out_dir``; writes
  nothing.

  Refused: an empty path, a file (or a file in the way of the path), a
  folder that cannot be written, a folder inside a run's checkpoints (a
  resume of that run would delete it:
  ``mha.pruning.export.run_checkpoints_of``), and a folder whose
  ``results.json`` is the study of another run: another workdir, or (with
  ``first``, the workdir's checkpoint) a config that differs beyond what a
  resumed run may change (``config_validation.RESUMABLE_KEYS``). The same
  study again into the same folder is allowed (it is replaced).

  Raises:
    ConfigError: any of the above (``workdir_lock.WorkdirUnusableError``
      for a folder that cannot be made or written).
  """
  out = export.check_writable_target(out_dir, "--out")
  recorded = _recorded_study(out)
  if recorded is None:
    return
  # A study inside its workdir (the default --out, workdir/pruning) moves
  # with it: a copied or renamed workdir is the same run (its config is
  # compared below).
  inside = os.path.dirname(out) == _real(workdir)
  if not inside and _real(recorded["workdir"]) != _real(workdir):
    raise config_validation.ConfigError(
        f"--out {out} holds the study of another workdir "
        f"({recorded['workdir']}); refusing to mix it with this one's: "
        "choose another --out, or delete that study")
  seeds = recorded.get("seeds")
  saved = (seeds[0].get("config") if isinstance(seeds, list) and seeds
           and isinstance(seeds[0], dict) else None)
  if first is not None and isinstance(saved, dict):
    keys = [c.split(" ", 1)[0] for c in
            config_validation.resume_conflicts(saved, first.config)]
    if keys:
      raise config_validation.ConfigError(
          f"--out {out} holds the study of another run of {workdir} (its "
          f"config differs in {', '.join(keys)}); refusing to mix it with "
          "this one's: choose another --out, or delete that study")


def study_splits(config: ml_collections.ConfigDict, options: StudyOptions
                 ) -> dict[str, data.Split]:
  """The splits the study reads: a next-token task's weights folded into
  its targets (``data.scored_targets``: every technique then scores the
  positions the task scores, a recall task's answers), and validation and
  test cut to ``options.max_examples`` evenly spaced examples where set.
  :func:`check_inputs` and :func:`run` ask for the same splits: the last
  ones read are kept, so they are read once."""
  return dict(_read_splits(build.data_spec(config), config.data.data_dir,
                           options.max_examples))


@functools.lru_cache(maxsize=1)
def _read_splits(spec: data.DataSpec, data_dir: str,
                 max_examples: int) -> dict[str, data.Split]:
  """:func:`study_splits` of a data spec (its arrays are read-only)."""
  splits = {name: data.scored_targets(split) for name, split in
            data.load_splits(spec, data_dir).items()}
  if max_examples:
    for name in ("validation", "test"):
      split = splits[name]
      if len(split) > max_examples:
        keep = np.linspace(0, len(split) - 1, max_examples).round()
        splits[name] = _take(split, keep.astype(np.int64))
  return splits


def _take(split: data.Split, rows: np.ndarray) -> data.Split:
  """The examples ``rows`` of ``split`` (every per-example field)."""
  pick = lambda a: None if a is None else np.asarray(a)[rows]
  return dataclasses.replace(split, inputs=pick(split.inputs),
                             targets=pick(split.targets),
                             weights=pick(split.weights),
                             distances=pick(split.distances))


def check_inputs(workdir: str, out_dir: str, options: StudyOptions,
                 step: int | None = None,
                 checkpoint: ckpt_lib.LoadedCheckpoint | None = None,
                 accept_estimate: bool = False
                 ) -> ckpt_lib.LoadedCheckpoint:
  """Every check of the user's input before the long work: the options,
  the output folder (:func:`check_out_dir`), the workdir's checkpoint (of
  ``step``), the seeds (:func:`check_seeds`), the heads to remove. Returns
  the checkpoint. Writes nothing.

  Args:
    workdir: the trained run.
    out_dir: where the study goes.
    options: the study's options.
    step: the step to analyse (default: the newest intact one).
    checkpoint: what an earlier call returned for the same ``workdir`` and
      ``step``: checked again without loading it again (nor repeating a
      warning of a damaged newest step).
    accept_estimate: run an oracle estimated above
      ``oracle.ACCEPT_ABOVE_S`` (30 minutes, all seeds); refused otherwise.

  Raises:
    FileNotFoundError: no checkpoint (of ``step``) in ``workdir``.
    ValueError: any other mistake, naming it (``ConfigError`` for the
      output folder).
  """
  options.validate()
  if checkpoint is None:
    check_out_dir(workdir, out_dir)  # Before the checkpoint is read.
  first = (checkpoint if checkpoint is not None
           else ckpt_lib.load_checkpoint(workdir, step))
  check_out_dir(workdir, out_dir, first)  # Its config compared too.
  seeds_lib.check_seeds(first, out_dir, options.num_seeds, options.retrain_seeds)
  if options.remove_heads:
    core.prune_heads(first.params, first.model_config, options.remove_heads)
  if options.ablation != "zero":
    context = study_splits(first.config, options)["validation"].inputs.shape[1]
    try:
      ablation_lib.check_streaming(options.ablation, first.model_config,
                                   context)
    except ValueError as e:
      raise ValueError(f"--{e}") from None
  if options.gates and options.gate_targets:
    try:
      gates.check_targets(first.model_config, options.gate_targets)
    except ValueError as e:
      raise ValueError(f"--gate_targets: {e}") from None
  heads = oracle.num_heads(first.model_config)
  needed = oracle.oracle_bytes(first.model_config)
  memory = oracle.machine_memory_bytes()
  if (oracle.oracle_applies(first.model_config, options.oracle_max_heads)
      and memory is not None and needed > memory):
    raise ValueError(
        f"--oracle_max_heads={options.oracle_max_heads}: every subset of this "
        f"model's {heads} heads needs about {needed / 2**30:.1f} GiB (2**"
        f"{heads} subsets, streamed over the examples), more than this "
        f"machine's {memory / 2**30:.1f} GiB; lower --oracle_max_heads below "
        f"{heads}")
  applies = oracle.oracle_applies(first.model_config,
                                 options.oracle_max_heads)
  positions = examples = None
  if applies:
    validation = study_splits(first.config, options)["validation"]
    positions, examples = oracle.tokens(validation), len(validation)
  seconds = (oracle.expected_seconds(first.model_config, positions, examples)
             * options.num_seeds)
  if applies and seconds > oracle.ACCEPT_ABOVE_S and not accept_estimate:
    cost = oracle.describe_cost(first.model_config, options.num_seeds,
                                positions, examples)
    raise ValueError(
        f"--oracle_max_heads={options.oracle_max_heads}: the oracle is "
        f"{cost}, "
        f"over {oracle.ACCEPT_ABOVE_S // 60} min; to run it, give "
        "--oracle_max_heads explicitly with --accept_estimate, or lower "
        f"--oracle_max_heads below {heads}")
  if options.shapley == "exact" and not oracle.oracle_applies(
      first.model_config, options.oracle_max_heads):
    raise ValueError(
        f"--shapley=exact needs every subset of heads: the model has {heads} "
        f"heads > --oracle_max_heads={options.oracle_max_heads}; use "
        "--shapley=sampled or a larger --oracle_max_heads")
  return first


def estimate(first: ckpt_lib.LoadedCheckpoint, options: StudyOptions,
             positions: int | None = None,
             examples: int | None = None) -> str:
  """One line: the study's estimated time and memory of the oracle, the
  part whose cost grows as ``2**N`` (the rest takes seconds to minutes at
  these sizes), or that the oracle is skipped (``positions`` scored in
  ``examples`` windows of validation: :func:`oracle.expected_seconds`)."""
  config = first.model_config
  if not oracle.oracle_applies(config, options.oracle_max_heads):
    return (f"Estimate: the oracle is skipped ({oracle.num_heads(config)} "
            f"heads > --oracle_max_heads={options.oracle_max_heads})")
  return ("Estimate: the oracle is "
          + oracle.describe_cost(config, options.num_seeds, positions,
                                 examples))


def _analyze_all(checkpoints: Sequence[ckpt_lib.LoadedCheckpoint],
                 splits: Mapping[str, data.Split], options: StudyOptions,
                 log: Log, out_dir: str, workdir: str
                 ) -> tuple[list[dict[str, Any]], dict[str, Any],
                            dict[str, Any]]:
  """Every seed's analysis (each kept in ``out_dir`` as it ends, and one
  kept by an earlier run of the same study reused:
  :mod:`mha.pruning.study.kept_analyses`), then their aggregates; with
  ``options.over_training``, every seed's other checkpoints
  (:mod:`mha.pruning.study.over_training`; the first seed's run is
  ``workdir``, the others' under ``out_dir/seeds``)."""
  rng = np.random.default_rng(options.seed)
  resamples = analysis.Resamples.draw(splits, len(checkpoints), options.num_bootstrap,
                             np.random.default_rng([options.seed, 1]))
  seeds, statistics, extras = [], [], []
  for ckpt in checkpoints:
    log(f"Seed {ckpt.config.seed} (step {ckpt.step}, "
        f"{core.count_params(ckpt.params):,} parameters):")
    path = os.path.join(seeds_lib.seed_dir(out_dir, int(ckpt.config.seed)),
                        kept_analyses.FILE)
    digest = kept_analyses.key(options, ckpt.step, ckpt.params, splits,
                               resamples, rng)
    kept = kept_analyses.load(path, digest, rng, log)
    if kept is not None:
      log(f"  reusing its analysis kept in {path}")
    else:
      kept = _analyze_seed(ckpt, splits, options, rng, resamples, log)
      try:
        kept_analyses.save(path, digest, kept, rng)
      except TypeError as e:  # Computed, but a rerun will compute it again.
        log(f"  its analysis could not be kept ({e})")
    seeds.append(kept["result"])
    statistics.append(kept["statistics"])
    if options.extensions:
      extras.append(kept["extras"])
  extra = (extensions.aggregate(extras, statistics, seeds, resamples.seeds,
                            options) if extras else {})
  agg = analysis.aggregate(seeds, statistics, resamples.seeds)
  if options.over_training:
    directories = [workdir] + [seeds_lib.seed_dir(out_dir, int(c.config.seed))
                               for c in checkpoints[1:]]
    start = time.perf_counter()
    agg["checkpoints_over_training"] = over_training.run(
        directories, seeds, statistics, splits, options, resamples, out_dir,
        log)
    for result in seeds:  # Shared by the seeds: the whole, in each.
      result["timings"]["over_training_s"] = time.perf_counter() - start
  return seeds, agg, extra


def _analyze_seed(ckpt: ckpt_lib.LoadedCheckpoint,
                  splits: Mapping[str, data.Split], options: StudyOptions,
                  rng: np.random.Generator, resamples: analysis.Resamples,
                  log: Log) -> dict[str, Any]:
  """One seed's analysis and its extensions: ``result``, ``statistics``
  and (with extensions) ``extras``."""
  seed_start = time.perf_counter()
  interrupt.reached("analysis")  # A test's signal during the analysis.
  result, stat = analysis.analyze_seed(ckpt.model, ckpt.params, splits, options,
                              rng, resamples, log, run_config=ckpt.config)
  result["seed"] = int(ckpt.config.seed)
  result["step"] = int(ckpt.step)
  result["config"] = ckpt.config.to_dict()
  result["timings"]["total_s"] = time.perf_counter() - seed_start
  kept: dict[str, Any] = {"result": result, "statistics": stat}
  if options.extensions:
    kept["extras"] = extensions.analyze_seed(ckpt, result, splits, options,
                                             resamples, log)
    result["timings"]["beyond_s"] = (time.perf_counter() - seed_start
                                     - result["timings"]["total_s"])
  return kept


def _header(workdir: str, first: ckpt_lib.LoadedCheckpoint,
            options: StudyOptions, splits: Mapping[str, data.Split]
            ) -> dict[str, Any]:
  return {
      "workdir": os.path.abspath(os.path.expanduser(workdir)),
      "task": first.config.task,
      "model": dataclasses.asdict(first.model_config) | {"dtype": str(
          first.model_config.dtype)},
      "options": dataclasses.asdict(options),
      # The versions, backend and numeric settings that produced the
      # figures (the code passes no compiler option to any program).
      "provenance": provenance.environment(),
      "orderings": orderings.ORDERINGS,
      "curve_labels": analysis.CURVE_LABELS,
      "splits": {"importance": "validation", "accuracy": "test",
                 "sizes": {k: len(v) for k, v in splits.items()}},
      "definitions": {
          "auc": "trapezoid area under the test curve over the fraction of "
                 "heads removed, divided by the fraction range",
          "max_prunable": "largest fraction of heads removed up to which "
                          "every validation point is within `tolerance` of "
                          "the unpruned validation value (chosen on "
                          "validation; test_<metric>_at_prunable is its test "
                          "value)",
          "half_split": "prunable_heads_<metric>_half_split: the level "
                        "chosen on the first half of validation (the oracle "
                        "chosen there too); half_split_holds_<metric>: 1 "
                        "when every point up to it is within `tolerance` on "
                        "the second half as well (mean over orders and "
                        "seeds); half_split_second_half_loss_<metric>: the "
                        "second half's loss at that level; "
                        "test_<metric>_at_prunable_half_split: test's value "
                        "there",
          "ci": "95% interval of a paired bootstrap over validation and "
                "test examples (one seed: its percentile interval); across "
                "seeds, the examples' bootstrap of the mean over seeds plus "
                "a seed-level Student t term with S - 1 degrees of freedom "
                "(see interval_method)",
          "simultaneous_ci": "auc_<metric>_minus_<oracle|random>_"
                             "simultaneous_ci: max-t simultaneous 95% "
                             "intervals over the family of every curve's "
                             "gap to that reference, from the same "
                             "replicates (simultaneous_critical_values: "
                             "the family's critical value c, in half-widths "
                             "of the marginal interval)",
          "oracle": "for each k, the subset with k heads removed of best "
                    "validation token accuracy (ties: lower loss)",
          "half_split_candidates": "the half-split statistics choose the "
                                   "level, and the oracle's subset among "
                                   "its candidates, on the first half of "
                                   "validation; the oracle's candidates "
                                   "there are ranked on the first half "
                                   "alone (the streamed oracle runs half by "
                                   "half), so the second half is held out "
                                   "from the oracle; every ordering was "
                                   "fitted on the whole of validation (both "
                                   "halves), so not from the orderings "
                                   "(nor from mean ablation's oracle, whose "
                                   "candidates are ranked on all of it); "
                                   "test is held out from everything",
          "oracle_by_loss": "for each k, the subset with k heads removed of "
                            "lowest validation loss (chosen again by loss "
                            "among its candidates in each replicate); "
                            "auc_loss: the area under the test loss curve "
                            "over the fraction removed (lower is better); "
                            "auc_loss_minus_oracle_by_loss: a curve's excess "
                            "of it over the oracle by loss's",
          "best_ordering": "the nested chain of subsets (one head removed at "
                           "a time) of highest validation AUC (the AUC's "
                           "trapezoid weights over the curve's points) "
                           "among all N! orders, from the oracle's table by "
                           "a dynamic program over the subset lattice; an "
                           "ordering (chosen once on validation, reported on "
                           "test)",
          "ranking_error_and_price_of_nesting": "an ordering's "
                                                "auc_<metric>_minus_oracle is "
                                                "its auc_<metric>_minus_"
                                                "best_ordering (the ranking "
                                                "error) plus the best "
                                                "ordering's auc_<metric>_"
                                                "minus_oracle (the price of "
                                                "nesting)",
          "test_at_fraction_removed": "test_<metric>_at_<p>pct_removed: "
                                      "the test value at the curve's point "
                                      "with the most heads removed not "
                                      "beyond p% of them",
          "cost": analysis.COST_UNITS,
          "checkpoints_over_training": "per seed, per checkpoint step its "
                                       "run holds: the unpruned metrics, the "
                                       "oracle's prunable level and each "
                                       "ordering's AUC gaps (the study's "
                                       "analysis of that checkpoint, without "
                                       "searches, Kwon et al., gates or "
                                       "re-estimated orderings); the "
                                       "aggregate's: the mean over seeds at "
                                       "the steps every seed holds",
          "no_layer_emptied": "the same orderings, skipping the last head "
                              "of a layer (and the oracle among subsets "
                              "keeping one head per layer)",
      },
  }


def run(workdir: str, out_dir: str, options: StudyOptions,
        step: int | None = None, log: Log = print,
        checkpoint: ckpt_lib.LoadedCheckpoint | None = None,
        accept_estimate: bool = False) -> dict[str, Any]:
  """The whole experiment on the checkpoint of ``workdir`` (its newest, or
  ``step``; or ``checkpoint``, what :func:`check_inputs` returned for
  them); writes ``results.json``, ``report.md``, the plots and each
  seed's per-example results (``examples_seed<s>.npz``) to ``out_dir`` and
  returns the results (an oracle estimated above 30 minutes only with
  ``accept_estimate``; the plots only with ``options.plots``; the returned
  results also hold each seed's per-example arrays, ``seeds[i]["examples"]``,
  which ``results.json`` leaves to the ``.npz`` files).

  Raises:
    FileNotFoundError: no checkpoint (of ``step``) in ``workdir``.
    ValueError: bad options, an output folder that may not be written, a
      head to remove that does not exist, a step the other seeds will not
      have, or a seed directory trained with another config (without
      ``retrain_seeds``): :func:`check_inputs`.
    WriteFailure, TrainingInterrupted, FloatingPointError: from training the
      study's other seeds (:func:`mha.train.train_and_evaluate`).
  """
  start = time.perf_counter()
  kept_analyses.code_digest()  # the source this process runs, read now
  first = check_inputs(workdir, out_dir, options, step, checkpoint,
                       accept_estimate)
  config = first.config
  splits = study_splits(config, options)
  log(estimate(first, options, oracle.tokens(splits["validation"]),
               len(splits["validation"])))
  os.makedirs(out_dir, exist_ok=True)
  checkpoints = seeds_lib.seed_models(first, out_dir, options.num_seeds, log,
                            retrain=options.retrain_seeds)
  experiment_start = time.perf_counter()
  seeds, agg, extra = _analyze_all(checkpoints, splits, options, log,
                                   out_dir, workdir)
  results = _header(workdir, first, options, splits) | extra | {
      "interval_method": stats.interval_method(len(seeds)),
      "ablation": options.ablation,
      "seeds": seeds, "aggregate": agg,
      "jax": {"version": jax.__version__, "backend": jax.default_backend(),
              "devices": [str(d) for d in jax.devices()]}}
  if options.speed and ablation_lib.parse(options.ablation)[0] == (
      ablation_lib.STREAMING):
    log("Speed of physically pruned models: skipped under --ablation "
        f"{options.ablation} (its heads are kept, with a shorter cache)")
  elif options.speed:
    log("Speed of physically pruned models (first seed):")
    order = np.asarray(seeds[0]["orders"][options.speed_order])
    results["speed"], seconds = timed(
        log, "speed table",
        lambda: speed.speed_table(
            first.model, first.params, order, splits["test"],
            fractions=options.speed_fractions,
            batch_sizes=options.batch_sizes, repeats=options.speed_repeats,
            min_seconds=options.speed_min_seconds,
            target_width=options.speed_target_width or None,
            max_repeats=options.speed_max_repeats, log=log)
        | {"order": options.speed_order})
    seeds[0]["timings"]["speed_s"] = seconds
  if options.remove_heads:
    results["custom_pruning"] = analysis.custom_pruning(
        first.model, first.params, splits["test"], options.remove_heads,
        options.batch_size)
  results["timings"] = {
      "experiment_s": time.perf_counter() - experiment_start,
      "first_seed_with_speed_s": seeds[0]["timings"]["total_s"] +
                                 seeds[0]["timings"].get("speed_s", 0.0),
      "total_s": time.perf_counter() - start,
  }
  outputs.write_outputs(results, out_dir)
  return results


__all__ = ["RESULTS_FILE", "check_out_dir", "check_inputs", "estimate",
           "run"]
