"""The head-importance and head-pruning experiment, end to end.

``scripts/prune_heads.py`` is a thin command line over :func:`run`:

1. Load the trained checkpoint of ``workdir`` and, for ``num_seeds > 1``,
   train the same config with other seeds (``out/seeds/seed_<s>/``; a seed
   already trained there is reused).
2. Per seed, on the *validation* split: gradient importance (Michel et al.,
   per-example ``|dL/d xi|``, raw, L2-normalised per layer, and re-estimated
   after each removal), leave-one-out loss increase (every mask in one
   vmapped call), attention confidence and entropy (Voita et al.); the
   Spearman correlations between them and between two disjoint halves.
3. Per seed, on the *test* split: pruning curves for every order (each
   measure, ``num_random_orders`` random orders, the reverse of the gradient
   order), their areas and the largest fraction prunable within
   ``tolerance``; Michel et al.'s single-head ablation and all-but-one
   tables.
4. Across seeds: mean and spread of every curve summary, and paired
   comparisons of each measure with the random and reverse orders.
5. On the first seed: physical pruning (:func:`mha.pruning.prune_heads`) at
   ``speed_fractions`` of the heads, examples/s at ``batch_sizes`` against
   the parameter and FLOP counts.

Everything lands in ``out``: ``results.json``, ``report.md`` and PNG plots.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from scipy import stats

from mha import checkpoint as ckpt_lib
from mha import data
from mha import train
from mha import build
from mha.pruning import core as pruning
from mha.pruning import speed
from mha.model import Transformer

# Orders of the pruning curves: key -> label. Measures first, then baselines.
ORDERINGS = {
    "gradient": "gradient",
    "gradient_l2": "gradient (L2 per layer)",
    "gradient_iterative": "gradient (re-estimated)",
    "leave_one_out": "leave-one-out",
    "confidence": "confidence",
    "entropy": "entropy",
    "reverse_gradient": "reverse gradient",
    "random": "random",
}
BASELINES = ("random", "reverse_gradient")
CURVE_METRICS = ("token_accuracy", "exact_match")


@dataclasses.dataclass(frozen=True)
class Options:
  """Settings of the experiment (the script's flags).

  Attributes:
    num_seeds: models analysed: the workdir's, then ``num_seeds - 1`` more
      trained with seeds ``config.seed + 1, ...``.
    num_random_orders: random orders per seed (the baseline).
    step_fraction: fraction of the heads removed per curve point; 0 removes
      one head at a time.
    reestimate: include the order that re-estimates gradient importance
      after each removal.
    tolerance: "prunable" means every point up to there is within this much
      of the unpruned accuracy (0.01 = 1 point).
    speed_fractions: fractions of heads physically pruned for the speed
      table (0 is always added).
    batch_sizes: batch sizes of the speed table.
    speed_repeats: timing repeats per model and batch size (median).
    speed_order: the ordering whose least important heads are pruned for
      the speed table.
    remove_heads: extra ``(layer, head)`` set to prune physically and
      evaluate (reported as ``custom_pruning``).
    batch_size: examples per evaluation call.
    seed: seed of the random orders.
    speed: whether to run the speed table.
  """

  num_seeds: int = 3
  num_random_orders: int = 20
  step_fraction: float = 0.0
  reestimate: bool = True
  tolerance: float = 0.01
  speed_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)
  batch_sizes: tuple[int, ...] = (1, 16, 64, 256)
  speed_repeats: int = 5
  speed_order: str = "gradient_l2"
  remove_heads: tuple[tuple[int, int], ...] = ()
  batch_size: int = 1000
  seed: int = 0
  speed: bool = True

  def validate(self) -> None:
    """Raises ValueError naming the first bad setting."""
    if self.num_seeds < 1:
      raise ValueError(f"--num_seeds must be >= 1, got {self.num_seeds}")
    if self.num_random_orders < 1:
      raise ValueError(
          f"--num_random_orders must be >= 1, got {self.num_random_orders}")
    if not 0.0 <= self.step_fraction <= 1.0:
      raise ValueError(
          f"--step_fraction must be in [0, 1], got {self.step_fraction}")
    if not 0.0 <= self.tolerance <= 1.0:
      raise ValueError(f"--tolerance must be in [0, 1], got {self.tolerance}")
    for f in self.speed_fractions:
      if not 0.0 <= f <= 1.0:
        raise ValueError(
            f"--speed_fractions: {f} is outside [0, 1]")
    if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
      raise ValueError(
          f"--batch_sizes must be positive integers, got {self.batch_sizes}")
    if self.speed_repeats < 1:
      raise ValueError(
          f"--speed_repeats must be >= 1, got {self.speed_repeats}")
    if self.batch_size < 1:
      raise ValueError(f"--batch_size must be >= 1, got {self.batch_size}")
    if self.speed_order not in ORDERINGS or self.speed_order == "random":
      valid = ", ".join(k for k in ORDERINGS if k != "random")
      raise ValueError(
          f"--speed_order {self.speed_order!r} is not one of: {valid}")
    if self.speed_order == "gradient_iterative" and not self.reestimate:
      raise ValueError("--speed_order=gradient_iterative needs --reestimate")


Log = Callable[[str], None]


# --------------------------------------------------------------------------
# One seed.
# --------------------------------------------------------------------------


def _halves(split: data.Split) -> tuple[data.Split, data.Split]:
  n = len(split) // 2
  first = data.Split(split.inputs[:n], split.targets[:n])
  second = data.Split(split.inputs[n:], split.targets[n:])
  return first, second


def _spearman(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
  a, b = np.ravel(a), np.ravel(b)
  keep = ~(np.isnan(a) | np.isnan(b))
  if keep.sum() < 3 or np.ptp(a[keep]) == 0 or np.ptp(b[keep]) == 0:
    return {"rho": float("nan"), "p": float("nan")}
  result = stats.spearmanr(a[keep], b[keep])
  return {"rho": float(result.statistic), "p": float(result.pvalue)}


def _timed(log: Log, what: str, fn: Callable[[], Any]) -> tuple[Any, float]:
  start = time.perf_counter()
  out = fn()
  seconds = time.perf_counter() - start
  log(f"  {what}: {seconds:.2f} s")
  return out, seconds


def analyze_seed(model: Transformer, params: Any,
                 splits: Mapping[str, data.Split], options: Options,
                 rng: np.random.Generator, log: Log = print) -> dict[str, Any]:
  """Importance measures (validation) and pruning curves (test) of one
  model. Returns a JSON-able dict of arrays and numbers."""
  config = model.config
  val, test = splits["validation"], splits["test"]
  bs = options.batch_size
  timings: dict[str, float] = {}
  out: dict[str, Any] = {}

  # -- importance, on validation ------------------------------------------
  grad, timings["gradient_s"] = _timed(
      log, "gradient importance (vmap of grad, per-example |.|)",
      lambda: pruning.gradient_importance(model, params, val, batch_size=bs))
  masks = pruning.leave_one_out_masks(config)
  loo, timings["leave_one_out_vmapped_s"] = _timed(
      log, f"leave-one-out, {len(masks)} masks in vmapped calls",
      lambda: pruning.leave_one_out(model, params, val, batch_size=bs))
  # The same masks (plus the full one), one jitted call per mask: the loop
  # the vmapped version replaces. Warm both first, then time both.
  all_masks = np.concatenate([pruning.full_head_mask(config)[None], masks])
  pruning.evaluate_masks_loop(model, params, val, all_masks[:1],
                              batch_size=bs)
  loop, timings["leave_one_out_loop_s"] = _timed(
      log, "leave-one-out, the same masks in a Python loop",
      lambda: pruning.evaluate_masks_loop(model, params, val, all_masks,
                                          batch_size=bs))
  _, timings["leave_one_out_vmapped_warm_s"] = _timed(
      log, "leave-one-out, vmapped again (compiled)",
      lambda: pruning.evaluate_masks(model, params, val, all_masks,
                                     batch_size=bs))
  timings["leave_one_out_speedup"] = (timings["leave_one_out_loop_s"] /
                                      timings["leave_one_out_vmapped_warm_s"])
  loop_loss = pruning.heads_to_array(config, loop["loss"][1:])
  out["leave_one_out_loop_max_abs_diff"] = float(
      np.nanmax(np.abs(loop_loss - loo["loss"])))
  attn, timings["confidence_s"] = _timed(
      log, "attention confidence and entropy",
      lambda: pruning.attention_confidence(model, params, val, batch_size=bs))
  half_a, half_b = _halves(val)
  grad_a = pruning.gradient_importance(model, params, half_a, batch_size=bs)
  grad_b = pruning.gradient_importance(model, params, half_b, batch_size=bs)

  importance = {
      "gradient": grad,
      "gradient_l2": pruning.normalize_per_layer(grad),
      "leave_one_out": loo["loss_increase"],
      "confidence": attn["confidence"],
      "entropy": attn["entropy"],
  }
  out["importance"] = {
      **importance,
      "leave_one_out_token_accuracy_drop":
          loo["base"]["token_accuracy"] - loo["token_accuracy"],
      "gradient_validation_half_a": grad_a,
      "gradient_validation_half_b": grad_b,
  }
  out["validation"] = loo["base"]
  out["spearman"] = {
      "gradient_vs_leave_one_out": _spearman(grad, loo["loss_increase"]),
      "gradient_l2_vs_leave_one_out": _spearman(importance["gradient_l2"],
                                                loo["loss_increase"]),
      "gradient_halves": _spearman(grad_a, grad_b),
      "confidence_vs_leave_one_out": _spearman(attn["confidence"],
                                               loo["loss_increase"]),
  }

  # -- orders ----------------------------------------------------------------
  orders = {
      "gradient": pruning.order_from_importance(grad),
      "gradient_l2": pruning.order_from_importance(importance["gradient_l2"]),
      "leave_one_out": pruning.order_from_importance(loo["loss_increase"]),
      "confidence": pruning.order_from_importance(attn["confidence"]),
      # Low entropy = focused = important: remove the most diffuse first.
      "entropy": pruning.order_from_importance(-attn["entropy"]),
  }
  if options.reestimate:
    orders["gradient_iterative"], timings["gradient_iterative_s"] = _timed(
        log, "gradient importance re-estimated after each removal",
        lambda: pruning.iterative_gradient_order(model, params, val,
                                                 batch_size=bs))
  orders["reverse_gradient"] = orders["gradient"][::-1].copy()
  random_orders = pruning.random_orders(config, options.num_random_orders, rng)
  out["orders"] = {**orders, "random": random_orders}

  # -- curves, on test -------------------------------------------------------
  num_heads = int(pruning.existing_heads(config).sum())
  counts = pruning.pruning_counts(num_heads, options.step_fraction)
  fractions = counts / max(num_heads, 1)
  named = [(name, order) for name, order in orders.items()]
  named += [("random", order) for order in random_orders]
  masks = np.concatenate([pruning.masks_from_order(config, order, counts)
                          for _, order in named])
  unique, inverse = np.unique(masks.reshape(len(masks), -1), axis=0,
                              return_inverse=True)
  metrics, timings["curves_s"] = _timed(
      log, f"pruning curves on test: {len(named)} orders x {len(counts)} "
      f"points = {len(unique)} distinct masks, vmapped",
      lambda: pruning.evaluate_masks(
          model, params, test, unique.reshape((-1,) + masks.shape[1:]),
          batch_size=bs))
  curves: dict[str, dict[str, np.ndarray]] = {}
  per_order = {k: v[np.ravel(inverse)].reshape(len(named), len(counts))
               for k, v in metrics.items()}
  for i, (name, _) in enumerate(named):
    for key, values in per_order.items():
      curves.setdefault(name, {}).setdefault(key, []).append(values[i])
  curves = {name: {k: np.asarray(v) if name == "random" else np.asarray(v[0])
                   for k, v in by_metric.items()}
            for name, by_metric in curves.items()}
  out["counts"] = counts
  out["fractions"] = fractions
  out["curves"] = curves
  out["test"] = {k: float(v[0]) for k, v in curves["gradient"].items()}
  out["curve_summary"] = _curve_summaries(fractions, curves, options.tolerance)

  # -- Michel's tables, on test (all-but-one selects on validation) ----------
  def tables():
    single = pruning.leave_one_out(model, params, test, batch_size=bs)
    abo_val = pruning.all_but_one(model, params, val, batch_size=bs)
    abo_test = pruning.all_but_one(model, params, test, batch_size=bs)
    return single, abo_val, abo_test

  (single, abo_val, abo_test), timings["tables_s"] = _timed(
      log, "single-head ablation and all-but-one tables", tables)
  out["single_head_ablation"] = {
      f"{k}_change": single[k] - single["base"][k]
      for k in ("token_accuracy", "exact_match", "loss")}
  best = []
  for layer, count in enumerate(config.heads_per_layer):
    if count == 0:
      best.append(None)
      continue
    head = int(np.nanargmax(abo_val["token_accuracy"][layer]))
    best.append({
        "layer": layer, "head": head,
        "validation_token_accuracy": float(abo_val["token_accuracy"][layer,
                                                                      head]),
        **{f"test_{k}": float(abo_test[k][layer, head])
           for k in ("token_accuracy", "exact_match", "loss")},
    })
  out["all_but_one"] = {"test": abo_test, "validation": abo_val,
                        "best_head_per_layer": best}
  out["timings"] = timings
  return out


def _curve_summaries(fractions: np.ndarray,
                     curves: Mapping[str, Mapping[str, np.ndarray]],
                     tolerance: float) -> dict[str, dict[str, Any]]:
  summary: dict[str, dict[str, Any]] = {}
  for name, by_metric in curves.items():
    entry: dict[str, Any] = {}
    for metric in CURVE_METRICS:
      values = np.atleast_2d(by_metric[metric])
      aucs = [pruning.curve_auc(fractions, v) for v in values]
      prunable = [pruning.max_prunable_fraction(fractions, v, tolerance)
                  for v in values]
      entry[f"auc_{metric}"] = float(np.mean(aucs))
      entry[f"max_prunable_{metric}"] = float(np.mean(prunable))
      if name == "random":
        entry[f"auc_{metric}_per_order"] = aucs
        entry[f"max_prunable_{metric}_per_order"] = prunable
    summary[name] = entry
  return summary


# --------------------------------------------------------------------------
# Across seeds.
# --------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> dict[str, float]:
  values = np.asarray(values, np.float64)
  return {"mean": float(np.nanmean(values)),
          "std": float(np.nanstd(values, ddof=1)) if len(values) > 1 else 0.0,
          "min": float(np.nanmin(values)), "max": float(np.nanmax(values)),
          "per_seed": [float(v) for v in values]}


def _paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
  """Paired comparison of per-seed ``a - b``: mean, wins, t-test."""
  diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  result: dict[str, Any] = {
      "mean_difference": float(np.mean(diff)),
      "per_seed_difference": [float(d) for d in diff],
      "wins": int(np.sum(diff > 0)), "seeds": int(len(diff)),
      "t": float("nan"), "p_two_sided": float("nan"),
  }
  if len(diff) > 1 and np.ptp(diff) > 0:
    test = stats.ttest_1samp(diff, 0.0)
    result["t"], result["p_two_sided"] = float(test.statistic), float(
        test.pvalue)
  return result


def aggregate(seed_results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Mean and spread of every curve summary across seeds, and the paired
  comparisons of each measure with the random and reverse baselines."""
  names = list(seed_results[0]["curve_summary"])
  out: dict[str, Any] = {"curve_summary": {}, "vs_random": {},
                         "vs_reverse_gradient": {}, "spearman": {}}
  for name in names:
    out["curve_summary"][name] = {
        key: _mean_std([r["curve_summary"][name][key] for r in seed_results])
        for key in seed_results[0]["curve_summary"][name]
        if not key.endswith("_per_order")}
  for metric in CURVE_METRICS:
    key = f"auc_{metric}"
    random_auc = [r["curve_summary"]["random"][key] for r in seed_results]
    reverse_auc = [r["curve_summary"]["reverse_gradient"][key]
                   for r in seed_results]
    for name in names:
      if name in BASELINES:
        continue
      auc = [r["curve_summary"][name][key] for r in seed_results]
      vs_random = _paired(auc, random_auc)
      # Per seed: the share of random orders at least as good (a one-sided
      # permutation p-value of "this order is no better than chance").
      vs_random["per_seed_p_random_at_least_as_good"] = [
          float((1 + np.sum(np.asarray(
              r["curve_summary"]["random"][f"{key}_per_order"]) >= a)) /
                (1 + len(r["curve_summary"]["random"][f"{key}_per_order"])))
          for r, a in zip(seed_results, auc)]
      out["vs_random"].setdefault(name, {})[metric] = vs_random
      out["vs_reverse_gradient"].setdefault(name, {})[metric] = _paired(
          auc, reverse_auc)
  for key in seed_results[0]["spearman"]:
    out["spearman"][key] = _mean_std(
        [r["spearman"][key]["rho"] for r in seed_results])
  return out


# --------------------------------------------------------------------------
# Physical pruning and speed.
# --------------------------------------------------------------------------


def custom_pruning(model: Transformer, params: Any, test: data.Split,
                   heads: Sequence[tuple[int, int]],
                   batch_size: int) -> dict[str, Any]:
  """Test metrics of the model with ``heads`` physically pruned."""
  p, c = pruning.prune_heads(params, model.config, heads)
  metrics = pruning.evaluate_masks(Transformer(c), p, test,
                                   pruning.full_head_mask(c)[None],
                                   batch_size=batch_size)
  return {"removed": [list(h) for h in heads],
          "heads_per_layer": list(c.heads_per_layer),
          "params": pruning.count_params(p),
          **{f"test_{k}": float(v[0]) for k, v in metrics.items()}}


# --------------------------------------------------------------------------
# Seeds, the whole run, outputs.
# --------------------------------------------------------------------------


def kept_steps(config: Any) -> list[int]:
  """The checkpoint steps a finished run of ``config`` keeps."""
  every, total = config.checkpoint_every_steps, config.num_train_steps
  steps = sorted({*range(every, total + 1, every), total})
  keep = config.max_checkpoints_to_keep
  return steps[-keep:] if keep and keep > 0 else steps


def check_step(first: ckpt_lib.LoadedCheckpoint, step: int | None,
               num_seeds: int) -> None:
  """Raises ValueError when the other seeds cannot be analysed at ``step``
  (the step of the workdir's checkpoint that was asked for)."""
  if step is None or num_seeds == 1:
    return
  steps = kept_steps(first.config)
  if step not in steps:
    raise ValueError(
        f"--step={step}: the seeds this script trains keep steps "
        f"{', '.join(map(str, steps))}; pick one of them or --num_seeds=1")


def seed_models(workdir: str, out_dir: str, num_seeds: int,
                step: int | None = None,
                log: Log = print) -> list[ckpt_lib.LoadedCheckpoint]:
  """The workdir's checkpoint (its newest, or ``step``), then
  ``num_seeds - 1`` models of the same config trained with the next seeds
  under ``out_dir/seeds/`` (reused when already trained), at the same step."""
  first = ckpt_lib.load_checkpoint(workdir, step)
  check_step(first, step, num_seeds)
  loaded = [first]
  for i in range(1, num_seeds):
    config = copy.deepcopy(first.config)
    config.seed = first.config.seed + i
    seed_dir = os.path.join(out_dir, "seeds", f"seed_{config.seed}")
    try:
      done = ckpt_lib.load_checkpoint(seed_dir).step >= config.num_train_steps
    except FileNotFoundError:
      done = False
    if done:
      log(f"Reusing seed {config.seed} from {seed_dir}")
    else:
      log(f"Training seed {config.seed} in {seed_dir} ...")
      train.train_and_evaluate(config, seed_dir)
    loaded.append(ckpt_lib.load_checkpoint(seed_dir, step))
  return loaded


def run(workdir: str, out_dir: str, options: Options,
        step: int | None = None, log: Log = print) -> dict[str, Any]:
  """The whole experiment on the checkpoint of ``workdir`` (its newest, or
  ``step``); writes ``results.json``, ``report.md`` and the plots to
  ``out_dir`` and returns the results.

  Raises:
    FileNotFoundError: no checkpoint (of ``step``) in ``workdir``.
    ValueError: bad options, a head to remove that does not exist, or a
      ``step`` the other seeds will not have.
  """
  options.validate()
  start = time.perf_counter()
  first = ckpt_lib.load_checkpoint(workdir, step)
  check_step(first, step, options.num_seeds)
  if options.remove_heads:  # Check before any long work.
    pruning.prune_heads(first.params, first.model_config, options.remove_heads)
  os.makedirs(out_dir, exist_ok=True)
  checkpoints = seed_models(workdir, out_dir, options.num_seeds, step, log)
  config = first.config
  splits = data.load_splits(build.data_spec(config), config.data.data_dir)
  rng = np.random.default_rng(options.seed)

  seeds = []
  experiment_start = time.perf_counter()
  for ckpt in checkpoints:
    log(f"Seed {ckpt.config.seed} (step {ckpt.step}, "
        f"{pruning.count_params(ckpt.params):,} parameters):")
    seed_start = time.perf_counter()
    result = analyze_seed(ckpt.model, ckpt.params, splits, options, rng, log)
    result["seed"] = int(ckpt.config.seed)
    result["step"] = int(ckpt.step)
    result["timings"]["total_s"] = time.perf_counter() - seed_start
    seeds.append(result)

  results: dict[str, Any] = {
      "workdir": os.path.abspath(os.path.expanduser(workdir)),
      "task": config.task,
      "model": dataclasses.asdict(first.model_config) | {"dtype": str(
          first.model_config.dtype)},
      "options": dataclasses.asdict(options),
      "orderings": ORDERINGS,
      "splits": {"importance": "validation", "accuracy": "test",
                 "sizes": {k: len(v) for k, v in splits.items()}},
      "definitions": {
          "auc": "trapezoid area under the curve over the fraction of "
                 "heads removed, divided by the fraction range",
          "max_prunable": "largest fraction of heads removed up to which "
                          "every point is within `tolerance` of the "
                          "unpruned value",
      },
      "seeds": seeds,
      "aggregate": aggregate(seeds),
      "jax": {"version": jax.__version__, "backend": jax.default_backend(),
              "devices": [str(d) for d in jax.devices()]},
  }
  if options.speed:
    log("Speed of physically pruned models (first seed):")
    order = np.asarray(seeds[0]["orders"][options.speed_order])
    results["speed"], seconds = _timed(
        log, "speed table",
        lambda: speed.speed_table(
            first.model, first.params, order, splits["test"],
            fractions=options.speed_fractions,
            batch_sizes=options.batch_sizes, repeats=options.speed_repeats,
            log=log) | {"order": options.speed_order})
    seeds[0]["timings"]["speed_s"] = seconds
  if options.remove_heads:
    results["custom_pruning"] = custom_pruning(
        first.model, first.params, splits["test"], options.remove_heads,
        options.batch_size)
  results["timings"] = {
      "experiment_s": time.perf_counter() - experiment_start,
      "first_seed_with_speed_s": seeds[0]["timings"]["total_s"] +
                                 seeds[0]["timings"].get("speed_s", 0.0),
      "total_s": time.perf_counter() - start,
  }
  write_outputs(results, out_dir)
  return results


def _jsonable(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.ndarray, jax.Array)):
    return _jsonable(np.asarray(value).tolist())
  if isinstance(value, (np.floating, float)):
    return None if not math.isfinite(float(value)) else float(value)
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.bool_,)):
    return bool(value)
  return value


def write_outputs(results: Mapping[str, Any], out_dir: str) -> list[str]:
  """Writes ``results.json``, the plots and ``report.md``; returns the
  paths."""
  from mha.pruning import report  # Deferred: matplotlib.

  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "results.json")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(_jsonable(results), f, indent=1, allow_nan=False)
  os.replace(path + ".tmp", path)
  return [path] + report.write(results, out_dir)


def load_options(values: Mapping[str, Any]) -> Options:
  """Options from a mapping of the script's flag values."""
  fields = {f.name for f in dataclasses.fields(Options)}
  return Options(**{k: v for k, v in values.items() if k in fields})


__all__ = ["Options", "ORDERINGS", "aggregate", "analyze_seed",
           "custom_pruning", "run", "seed_models",
           "write_outputs"]
