"""``report.md`` and the PNG plots of the pruning experiment.

Reads the results dict of :func:`mha.pruning.experiment.run` (NumPy arrays
or the lists of its JSON form alike) and writes, beside ``results.json``:

* ``curves_token_accuracy.png``, ``curves_exact_match.png``: accuracy vs
  fraction of heads removed for every ordering, with spread bands;
* ``importance_seed<s>.png``: layers x heads heatmaps of every measure;
* ``ablation_seed<s>.png``: Michel et al.'s two tables as heatmaps;
* ``scatter_gradient_vs_leave_one_out.png``;
* ``speed.png`` (when the speed table ran);
* ``report.md``: the tables, with the plots inlined by relative path.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from mha.pruning import plots as pruning_plots

_CURVE_FILES = {"token_accuracy": "curves_token_accuracy.png",
                "exact_match": "curves_exact_match.png"}
_METRIC_LABELS = {"token_accuracy": "token accuracy",
                  "exact_match": "exact match"}


def _grid(value: Any) -> np.ndarray:
  rows = [[np.nan if v is None else v for v in row] for row in
          np.asarray(value, dtype=object).tolist()]
  return np.asarray(rows, np.float64)


def _fmt(mean: float, std: float | None = None, digits: int = 3) -> str:
  if mean is None or not np.isfinite(mean):
    return "n/a"
  if std is None:
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return lines + [""]


def _heads_table(grid: np.ndarray, fmt: str = "{:+.3f}") -> list[str]:
  header = ["layer"] + [f"head {h}" for h in range(grid.shape[1])]
  rows = [[str(layer)] + ["" if np.isnan(v) else fmt.format(v) for v in row]
          for layer, row in enumerate(grid)]
  return _table(header, rows)


def write(results: Mapping[str, Any], out_dir: str) -> list[str]:
  """Writes the plots and ``report.md`` to ``out_dir``; returns the paths."""
  paths: list[str] = []
  seeds = results["seeds"]
  labels = results["orderings"]
  fractions = np.asarray(seeds[0]["fractions"], np.float64)
  base_test = {m: float(np.mean([s["test"][m] for s in seeds]))
               for m in _CURVE_FILES}

  # -- plots -----------------------------------------------------------------
  for metric, name in _CURVE_FILES.items():
    curves = {}
    for key in labels:
      if key not in seeds[0]["curves"]:
        continue
      runs = [np.atleast_2d(np.asarray(s["curves"][key][metric], np.float64))
              for s in seeds]
      curves[labels[key]] = np.concatenate(runs)
    paths.append(pruning_plots.plot_pruning_curves(
        fractions, curves, os.path.join(out_dir, name),
        metric=_METRIC_LABELS[metric], baseline=base_test[metric],
        bands=(labels["gradient"], labels["leave_one_out"], labels["random"]),
        title=f"{results['task']}: test {_METRIC_LABELS[metric]} as heads are "
        f"removed ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"))

  first = seeds[0]
  imp = first["importance"]
  measures = {
      "gradient |dL/dξ|": _grid(imp["gradient"]),
      "gradient, L2 per layer": _grid(imp["gradient_l2"]),
      "leave-one-out loss increase": _grid(imp["leave_one_out"]),
      "leave-one-out token acc. drop":
          _grid(imp["leave_one_out_token_accuracy_drop"]),
      "confidence (mean max weight)": _grid(imp["confidence"]),
      "entropy (nats)": _grid(imp["entropy"]),
  }
  importance_png = f"importance_seed{first['seed']}.png"
  paths.append(pruning_plots.plot_importance_heatmaps(
      measures, os.path.join(out_dir, importance_png),
      title=f"Head importance on validation, seed {first['seed']}"))

  ablation = {
      "single head removed: Δ test token acc.":
          _grid(first["single_head_ablation"]["token_accuracy_change"]),
      "single head removed: Δ test exact match":
          _grid(first["single_head_ablation"]["exact_match_change"]),
      "only this head in its layer: test token acc.":
          _grid(first["all_but_one"]["test"]["token_accuracy"]),
  }
  ablation_png = f"ablation_seed{first['seed']}.png"
  paths.append(pruning_plots.plot_importance_heatmaps(
      ablation, os.path.join(out_dir, ablation_png),
      title=f"Michel et al.'s ablations on test, seed {first['seed']}"))

  xs = [np.ravel(_grid(s["importance"]["gradient"])) for s in seeds]
  ys = [np.ravel(_grid(s["importance"]["leave_one_out"])) for s in seeds]
  keep = [~(np.isnan(x) | np.isnan(y)) for x, y in zip(xs, ys)]
  spearman = [s["spearman"]["gradient_vs_leave_one_out"]["rho"]
              for s in seeds]
  scatter_png = "scatter_gradient_vs_leave_one_out.png"
  paths.append(pruning_plots.plot_importance_scatter(
      [x[k] for x, k in zip(xs, keep)], [y[k] for y, k in zip(ys, keep)],
      os.path.join(out_dir, scatter_png),
      xlabel="gradient importance E|dL/dξ| (validation)",
      ylabel="leave-one-out loss increase (validation)",
      labels=[f"seed {s['seed']} (Spearman {_fmt(r, digits=2)})"
              for s, r in zip(seeds, spearman)],
      title="Does the gradient rank heads as removing them does?"))

  speed = results.get("speed")
  if speed:
    entries = speed["entries"]
    batch_sizes = [int(b) for b in speed["batch_sizes"]]
    rates = np.asarray([[e["examples_per_sec"][str(b)] for b in batch_sizes]
                        for e in entries], np.float64)
    mid = str(batch_sizes[len(batch_sizes) // 2])
    paths.append(pruning_plots.plot_speed(
        batch_sizes, [e["fraction"] for e in entries], rates,
        os.path.join(out_dir, "speed.png"),
        flop_ratio=[e["flop_ratio"][mid] for e in entries],
        title=f"Prediction speed of physically pruned models "
        f"({results['jax']['backend']})"))

  # -- report.md -------------------------------------------------------------
  report = os.path.join(out_dir, "report.md")
  with open(report, "w", encoding="utf-8") as f:
    f.write("\n".join(_report_lines(results, importance_png, ablation_png,
                                    scatter_png, bool(speed))))
  paths.append(report)
  return paths


def _report_lines(results: Mapping[str, Any], importance_png: str,
                  ablation_png: str, scatter_png: str,
                  speed: bool) -> list[str]:
  seeds = results["seeds"]
  labels = results["orderings"]
  agg = results["aggregate"]
  model = results["model"]
  opts = results["options"]
  first = seeds[0]
  heads = model["num_heads"]
  lines = [
      f"# Head importance and head pruning: `{results['task']}`",
      "",
      f"Checkpoint: `{results['workdir']}`. Model: {model['num_layers']} "
      f"layers, heads {heads}, d_model {model['d_model']}, mlp "
      f"{model['mlp_dim']}. Seeds: "
      + ", ".join(f"{s['seed']} (step {s['step']})" for s in seeds) + ".",
      "",
      f"Importance is measured on **validation** "
      f"({results['splits']['sizes']['validation']} examples); every accuracy "
      f"below is on **test** ({results['splits']['sizes']['test']} examples). "
      f"{opts['num_random_orders']} random orders per seed. Unpruned test "
      "token accuracy / exact match per seed: "
      + ", ".join(f"{s['test']['token_accuracy']:.4f} / "
                  f"{s['test']['exact_match']:.4f}" for s in seeds) + ".",
      "",
      "## Pruning curves",
      "",
      "Heads are removed globally, least important first, "
      + ("one at a time" if not opts["step_fraction"] else
         f"in steps of {opts['step_fraction']:.0%}") + ". Lines: mean over "
      "seeds; bands (gradient, leave-one-out, random only, for legibility): "
      "min-max over seeds (random: 10th-90th percentile over seeds x "
      "orders).",
      "",
      "![token accuracy](curves_token_accuracy.png)",
      "",
      "![exact match](curves_exact_match.png)",
      "",
      f"AUC: area under the curve over the fraction removed (1 = no loss). "
      f"Prunable: the largest fraction up to which every point stays within "
      f"{opts['tolerance'] * 100:g} point(s) of the unpruned accuracy. "
      "Mean ± std over seeds.",
      "",
  ]
  rows = []
  for key, label in labels.items():
    summary = agg["curve_summary"].get(key)
    if summary is None:
      continue
    row = [label]
    for metric in ("token_accuracy", "exact_match"):
      auc = summary[f"auc_{metric}"]
      prunable = summary[f"max_prunable_{metric}"]
      row += [_fmt(auc["mean"], auc["std"]),
              _fmt(prunable["mean"], prunable["std"], 2)]
    rows.append(row)
  lines += _table(["ordering", "AUC token acc.", "prunable (token acc.)",
                   "AUC exact", "prunable (exact)"], rows)

  lines += [
      "### Does the order beat chance?",
      "",
      "Paired over seeds: the difference of token-accuracy AUC with the mean "
      "random order (and with the reverse gradient order), the number of "
      "seeds where it is better, a one-sample t-test on the differences, and "
      "per seed the share of random orders at least as good.",
      "",
  ]
  rows = []
  for key, label in labels.items():
    if key not in agg["vs_random"]:
      continue
    vr = agg["vs_random"][key]["token_accuracy"]
    vv = agg["vs_reverse_gradient"][key]["token_accuracy"]
    rows.append([
        label, f"{vr['mean_difference']:+.3f}",
        f"{vr['wins']}/{vr['seeds']}", _fmt(vr["p_two_sided"]),
        ", ".join(f"{p:.2f}" for p in
                  vr["per_seed_p_random_at_least_as_good"]),
        f"{vv['mean_difference']:+.3f}", f"{vv['wins']}/{vv['seeds']}"])
  lines += _table(["ordering", "Δ AUC vs random", "better (seeds)",
                   "t-test p", "share of random ≥ (per seed)",
                   "Δ AUC vs reverse", "better (seeds)"], rows)

  lines += [
      "## Is the ranking stable?",
      "",
      "Spearman correlations of per-head scores, mean ± std over seeds.",
      "",
  ]
  names = {
      "gradient_vs_leave_one_out": "gradient vs leave-one-out",
      "gradient_l2_vs_leave_one_out": "gradient (L2) vs leave-one-out",
      "gradient_halves": "gradient on two disjoint halves of validation",
      "confidence_vs_leave_one_out": "confidence vs leave-one-out",
  }
  rows = [[names.get(k, k), _fmt(v["mean"], v["std"], 2),
           ", ".join(_fmt(x, digits=2) for x in v["per_seed"])]
          for k, v in agg["spearman"].items()]
  lines += _table(["pair", "Spearman ρ", "per seed"], rows)
  lines += [f"![gradient vs leave-one-out]({scatter_png})", ""]

  lines += [
      f"## Importance of each head (seed {first['seed']}, validation)",
      "",
      f"![importance]({importance_png})",
      "",
      "Leave-one-out loss increase:",
      "",
  ]
  lines += _heads_table(_grid(first["importance"]["leave_one_out"]))
  lines += ["Gradient importance E|dL/dξ|:", ""]
  lines += _heads_table(_grid(first["importance"]["gradient"]), "{:.3g}")

  lines += [
      f"## Michel et al.'s tables (seed {first['seed']}, test)",
      "",
      "Single-head ablation: change of test token accuracy when that head "
      "alone is removed.",
      "",
  ]
  lines += _heads_table(
      _grid(first["single_head_ablation"]["token_accuracy_change"]))
  lines += ["All but one head per layer: test token accuracy when a layer "
            "keeps only that head (the other layers intact).", ""]
  lines += _heads_table(_grid(first["all_but_one"]["test"]["token_accuracy"]),
                        "{:.3f}")
  best = [b for b in first["all_but_one"]["best_head_per_layer"] if b]
  lines += _table(
      ["layer", "best head (chosen on validation)", "test token acc.",
       "test exact match"],
      [[b["layer"], b["head"], f"{b['test_token_accuracy']:.3f}",
        f"{b['test_exact_match']:.3f}"] for b in best])
  lines += [f"![ablation]({ablation_png})", ""]

  if speed:
    sp = results["speed"]
    sizes = [str(b) for b in sp["batch_sizes"]]
    lines += [
        "## Physical pruning and prediction speed",
        "",
        f"Heads removed by the `{labels[sp['order']]}` order of seed "
        f"{first['seed']}, sliced out of the parameters with `prune_heads`. "
        "Examples/s of the jitted prediction (fused attention, no weights), "
        f"median of {opts['speed_repeats']} interleaved repeats after "
        f"warm-up, on {results['jax']['backend']}; FLOPs from XLA's cost "
        "analysis of the compiled program.",
        "",
    ]
    header = (["removed", "heads per layer", "params", "FLOP ratio",
               "test token acc."] +
              [f"ex/s @ {b} (speed-up)" for b in sizes])
    rows = []
    for e in sp["entries"]:
      rows.append(
          [f"{e['fraction']:.0%} ({e['heads_removed']})",
           str(e["heads_per_layer"]), f"{e['params']:,}",
           f"{e['flop_ratio'][sizes[-1]]:.3f}",
           f"{e['test_token_accuracy']:.3f}"] +
          [f"{e['examples_per_sec'][b]:,.0f} (×{e['speedup'][b]:.2f})"
           for b in sizes])
    lines += _table(header, rows)
    lines += ["![speed](speed.png)", ""]
    diffs = [e["max_abs_logit_diff_pruned_vs_masked"] for e in sp["entries"]]
    lines += [f"Pruned vs masked model, largest logit difference: "
              f"{max(diffs):.2e}.", ""]

  if "custom_pruning" in results:
    c = results["custom_pruning"]
    lines += ["## Requested pruning", "",
              f"Removed {c['removed']}: heads per layer "
              f"{c['heads_per_layer']}, {c['params']:,} parameters, test "
              f"token accuracy {c['test_token_accuracy']:.4f}, exact match "
              f"{c['test_exact_match']:.4f}.", ""]

  t = first["timings"]
  lines += [
      "## Timings",
      "",
      f"Leave-one-out (seed {first['seed']}, every head's mask and the full "
      f"one), vmapped over chunks of masks: "
      f"{t['leave_one_out_vmapped_warm_s']:.3f} s; the same masks in a "
      f"Python loop of jitted calls: {t['leave_one_out_loop_s']:.3f} s "
      f"(×{t['leave_one_out_speedup']:.2f}, both compiled). On CPU each "
      "mask's evaluation is memory-bound compute, so batching masks saves "
      "little beyond the shared first attention layer.",
      "",
  ]
  rows = [[s["seed"]] + [f"{s['timings'].get(k, float('nan')):.2f}" for k in
                         ("gradient_s", "leave_one_out_vmapped_s",
                          "confidence_s", "gradient_iterative_s", "curves_s",
                          "tables_s", "total_s")] for s in seeds]
  lines += _table(["seed", "gradient", "leave-one-out", "confidence",
                   "re-estimated", "curves", "tables", "total (s)"], rows)
  tt = results["timings"]
  lines += [f"First seed with the speed table: "
            f"{tt['first_seed_with_speed_s']:.1f} s; the whole run: "
            f"{tt['total_s']:.1f} s.", ""]
  return lines
