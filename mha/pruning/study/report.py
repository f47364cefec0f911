"""``report.md`` and the PNG plots of the pruning experiment.

Reads the results of :func:`mha.pruning.study.run` (the JSON form of
``results.json``; NumPy arrays work alike) and writes, beside ``results.json``:

* ``curves_token_accuracy.png``, ``curves_exact_match.png``: test accuracy
  vs fraction of heads removed of the oracle, the best ordering, the best
  search, the three best orderings and random (:func:`lead_curves`), with
  95% bootstrap intervals of the oracle and random;
* ``curves_token_accuracy_families.png``: every curve, one panel per family
  (:data:`CURVE_FAMILIES`), each with the oracle and random;
* ``curves_no_layer_emptied.png``: the same orderings never emptying a layer;
* ``importance_seed<s>.png``: layers x heads heatmaps of every measure;
* ``ablation_seed<s>.png``: Michel et al.'s two tables as heatmaps;
* ``scatter_gradient_vs_leave_one_out.png``;
* ``speed.png`` (when the speed table ran);
* ``report.md``: every number with its 95% interval, the plots inlined.

Re-render both from a study's folder without recomputing anything:

    python -m mha.pruning.study.report runs/reverse/pruning
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from mha import head_roles
from mha.pruning import stats
from mha.pruning.constants import (ABLATION_STREAMING, KV_SCORES, ORDERINGS,
                                   parse_ablation)
from mha.pruning.study import markdown as md
from mha.pruning.study import plots as pruning_plots
from mha.pruning.study import report_extensions
from mha.pruning.study.summary import UNTUNED

_CURVE_FILES = {"token_accuracy": "curves_token_accuracy.png",
                "exact_match": "curves_exact_match.png"}
_NO_LAYER_EMPTIED_PNG = "curves_no_layer_emptied.png"
_FAMILIES_PNG = "curves_token_accuracy_families.png"
#: Accuracies this close are equal (float rounding of means and sums).
_TIE = 1e-12
_METRIC_LABELS = {"token_accuracy": "token accuracy",
                  "exact_match": "exact match"}
#: Curves drawn with their interval band (the others: lines only).
_BANDS = ("gradient", "leave_one_out", "shapley", "random", "oracle")


def _labels(results: Mapping[str, Any]) -> dict[str, str]:
  return dict(results.get("curve_labels") or results["orderings"])


# --------------------------------------------------------------------------
# Plots.
# --------------------------------------------------------------------------


def _curve_plot(results: Mapping[str, Any], group: Mapping[str, Any],
                fractions: np.ndarray, metric: str, path: str,
                title: str, points: Mapping[str, Any] | None = None,
                keys: Sequence[str] | None = None,
                bands: Sequence[str] = _BANDS) -> str:
  """One figure of ``group`` (an aggregate variant): the mean over seeds of
  each curve (of ``keys``, in that order; default every one) and, for those
  in ``bands``, its 95% interval."""
  labels = _labels(results)
  curves, intervals = {}, {}
  for key in labels if keys is None else keys:
    entry = group["curves"].get(key)
    if entry is None:
      continue
    label = labels.get(key, key)
    curves[label] = np.asarray(entry[metric], np.float64)
    if key in bands:
      ci = np.asarray(entry[f"{metric}_ci"], np.float64)
      intervals[label] = (ci[:, 0], ci[:, 1])
  first = results["seeds"][0]
  return pruning_plots.plot_pruning_curves(
      fractions, curves, path, metric=_METRIC_LABELS[metric],
      baseline=_unpruned(results, metric), intervals=intervals, title=title,
      points=points, xlabel=_x_label(results),
      kv_axis=((first["kv_memory"][0], first["kv_memory"][-1])
               if _streaming(results) else None))


def _streaming(results: Mapping[str, Any]) -> bool:
  """Whether the study ran under ``--ablation streaming`` (its seeds carry
  ``kv_memory``)."""
  return "kv_memory" in results["seeds"][0]


def _x_label(results: Mapping[str, Any]) -> str:
  """The curves' x-axis: heads removed, or given a streaming cache."""
  return ("fraction of heads given a streaming cache" if _streaming(results)
          else "fraction of heads removed")


def _unpruned(results: Mapping[str, Any], metric: str) -> float:
  """The unpruned model's test ``metric``, the mean over seeds."""
  return float(np.mean([s["test"][metric] for s in results["seeds"]]))


#: The small multiples' panels: the families of curves, by key. A curve of
#: no family gets a panel "other".
CURVE_FAMILIES = {
    "gradient": ("gradient", "gradient_l2", "gradient_iterative",
                 "reverse_gradient"),
    "patching and ablation": ("leave_one_out", "shapley", "attribution_zero",
                              "attribution_mean", "attribution_resample"),
    "Kwon et al.": ("fisher", "kwon", "kwon_tuned",
                    "kwon_tuned_attention_output", "oracle_kwon_tuned"),
    "heuristics": ("confidence", "entropy"),
    "searches": ("best_ordering", "surrogate", "beam", "gates_k"),
}
#: Drawn in every panel of the small multiples, and in the lead figure.
_REFERENCES = ("oracle", "random")
#: Curves the lead figure never picks as "an ordering" or "a search": the
#: references, the best ordering (drawn as itself) and the tuned oracle
#: (a ceiling of tuning, not a search).
_NOT_CANDIDATES = _REFERENCES + ("best_ordering", "oracle_kwon_tuned",
                                 "reverse_gradient")
#: How many of the orderings the lead figure draws, best AUC first.
LEAD_ORDERINGS = 3


def lead_curves(results: Mapping[str, Any]) -> list[str]:
  """The curves of the lead figure, at most 7: the oracle, the best ordering
  (``best_ordering``, when the results hold it), the search of best test
  token-accuracy AUC, the :data:`LEAD_ORDERINGS` orderings of best AUC, and
  random (each when present)."""
  summary = results["aggregate"]["curve_summary"]
  searches = set(_search_names(results))
  auc = lambda k: summary[k].get("auc_token_accuracy", -np.inf)
  present = [k for k in _labels(results) if k in summary]
  candidates = [k for k in present if k not in _NOT_CANDIDATES]
  best_search = sorted((k for k in candidates if k in searches), key=auc,
                       reverse=True)[:1]
  orderings = sorted((k for k in candidates if k not in searches), key=auc,
                     reverse=True)[:LEAD_ORDERINGS]
  lead = (["oracle", "best_ordering"] + best_search + orderings + ["random"])
  return [k for k in lead if k in summary or k in results["aggregate"][
      "curves"]]


def _families_plot(results: Mapping[str, Any], metric: str, path: str,
                   title: str) -> str:
  """The small multiples: a panel per family (:data:`CURVE_FAMILIES`) of
  the curves present, the references in each."""
  group, labels = results["aggregate"], _labels(results)
  drawn = [k for k in list(labels) + list(group["curves"])
           if k in group["curves"] and k not in _REFERENCES]
  drawn = list(dict.fromkeys(drawn))
  families = {name: [k for k in keys if k in drawn]
              for name, keys in CURVE_FAMILIES.items()}
  known = {k for keys in CURVE_FAMILIES.values() for k in keys}
  families["other"] = [k for k in drawn if k not in known]
  values = lambda k: np.asarray(group["curves"][k][metric], np.float64)
  panels = {name: {labels.get(k, k): values(k) for k in keys}
            for name, keys in families.items() if keys}
  references = {labels.get(k, k): values(k) for k in _REFERENCES
                if k in group["curves"]}
  return pruning_plots.plot_pruning_curve_panels(
      np.asarray(results["seeds"][0]["fractions"], np.float64), panels,
      references, path, metric=_METRIC_LABELS[metric],
      baseline=_unpruned(results, metric), title=title,
      xlabel=_x_label(results))


def _importance_plot(results: Mapping[str, Any], out_dir: str) -> str:
  first = results["seeds"][0]
  imp = first["importance"]
  measures = {
      "gradient |dL/dξ|": md.grid(imp["gradient"]),
      "gradient, L2 per layer": md.grid(imp["gradient_l2"]),
      **({"Fisher E[(dL/dξ)²] (Kwon et al.)": md.grid(imp["fisher"])}
         if "fisher" in imp else {}),
      "leave-one-out loss increase": md.grid(imp["leave_one_out"]),
      "leave-one-out token acc. drop":
          md.grid(imp["leave_one_out_token_accuracy_drop"]),
      "Shapley value (val. token acc.)":
          md.grid(imp["shapley_token_accuracy"]),
      "confidence (mean max weight)": md.grid(imp["confidence"]),
      "entropy (nats)": md.grid(imp["entropy"]),
  }
  measures = {k: v for k, v in measures.items() if not np.all(np.isnan(v))}
  return pruning_plots.plot_importance_heatmaps(
      measures, os.path.join(
          out_dir, md.figure(results, f"importance_seed{first['seed']}.png")),
      title=f"Head importance on validation, seed {first['seed']}")


def _ablation_plot(results: Mapping[str, Any], out_dir: str) -> str:
  first = results["seeds"][0]
  single = first["single_head_ablation"]
  ablation = {
      "single head removed: Δ test token acc.":
          md.grid(single["token_accuracy_change"]),
      "single head removed: Δ test exact match":
          md.grid(single["exact_match_change"]),
      "only this head in its layer: test token acc.":
          md.grid(first["all_but_one"]["test"]["token_accuracy"]),
  }
  return pruning_plots.plot_importance_heatmaps(
      ablation, os.path.join(
          out_dir, md.figure(results, f"ablation_seed{first['seed']}.png")),
      title=f"Michel et al.'s ablations on test, seed {first['seed']}")


def _scatter_plot(results: Mapping[str, Any], out_dir: str) -> str:
  seeds = results["seeds"]
  xs = [np.ravel(md.grid(s["importance"]["gradient"])) for s in seeds]
  ys = [np.ravel(md.grid(s["importance"]["leave_one_out"])) for s in seeds]
  keep = [~(np.isnan(x) | np.isnan(y)) for x, y in zip(xs, ys)]
  spearman = [s["spearman"]["gradient_vs_leave_one_out"]["rho"]
              for s in seeds]
  return pruning_plots.plot_importance_scatter(
      [x[k] for x, k in zip(xs, keep)], [y[k] for y, k in zip(ys, keep)],
      os.path.join(out_dir, md.figure(
          results, "scatter_gradient_vs_leave_one_out.png")),
      xlabel="gradient importance E|dL/dξ| (validation)",
      ylabel="leave-one-out loss increase (validation)",
      labels=[f"seed {s['seed']} (Spearman {md.fmt(r, 2)})"
              for s, r in zip(seeds, spearman)],
      title="Does the gradient rank heads as removing them does?")


def _speed_plot(results: Mapping[str, Any], out_dir: str) -> str:
  speed = results["speed"]
  entries = speed["entries"]
  batch_sizes = [int(b) for b in speed["batch_sizes"]]
  rates = np.asarray([[e["examples_per_sec"][str(b)] for b in batch_sizes]
                      for e in entries], np.float64)
  mid = str(batch_sizes[len(batch_sizes) // 2])
  speedup = np.asarray([[e["speedup"][str(b)] for b in batch_sizes]
                        for e in entries], np.float64)
  ci = None
  if all("speedup_ci" in e for e in entries):
    ci = np.asarray([[e["speedup_ci"][str(b)] for b in batch_sizes]
                     for e in entries], np.float64)
  return pruning_plots.plot_speed(
      batch_sizes, [e["fraction"] for e in entries], rates,
      os.path.join(out_dir, md.figure(results, "speed.png")),
      speedup=speedup, speedup_ci=ci,
      flop_ratio=[e["flop_ratio"][mid] for e in entries],
      title=f"Prediction speed of physically pruned models "
      f"({results['jax']['backend']})")


#: Names a study's results.json once used for what is now another name:
#: before Kwon et al.'s own mask tuning became ``kwon_tuned``, that name held
#: the attention-output fit, now ``kwon_tuned_attention_output``.
RENAMED = {"kwon_tuned": "kwon_tuned_attention_output",
           "kwon_tuned_s": "kwon_tuned_attention_output_s"}
_RENAMED_LABELS = {"Kwon et al., mask tuned":
                   "Kwon et al., mask tuned (attention output)"}


def upgrade(results: dict[str, Any]) -> dict[str, Any]:
  """``results`` read from an older results.json with its curves under
  today's names (:data:`RENAMED`): a study whose ``kwon_tuned`` was the
  attention-output fit has no ``kwon_tuned_attention_output`` beside it.
  A study of today comes back as it is."""
  searches = [set(s.get("searches", {})) for s in results.get("seeds", [])]
  if not any("kwon_tuned" in s for s in searches) or any(
      "kwon_tuned_attention_output" in s for s in searches):
    return results

  def rename(value: Any) -> Any:
    if isinstance(value, dict):
      return {RENAMED.get(k, k): rename(v) for k, v in value.items()}
    if isinstance(value, list):
      return [rename(v) for v in value]
    return value
  out = rename(results)
  for group in ("curve_labels", "orderings"):
    if isinstance(out.get(group), dict):
      out[group] = {k: _RENAMED_LABELS.get(v, v) for k, v in out[group].items()}
  return out


# The top-level keys of every study's results.json (outputs.write_outputs).
STUDY_KEYS = ("workdir", "task", "options", "seeds", "aggregate", "timings")


def write(results: Mapping[str, Any], out_dir: str, *,
          figures: bool = True) -> list[str]:
  """Writes the plots and ``report.md`` to ``out_dir``; returns the paths.

  With the study's ``plots`` option off, ``report.md`` alone, without its
  figures' lines; with ``figures=False``, ``report.md`` alone, its figures'
  lines kept (the figures already written stay as they are)."""
  plots = results["options"].get("plots", True)
  # The text first: a report that fails to render leaves the old one as it
  # was, and a reader never finds half of one.
  text = "\n".join(line for line in report_lines(results)
                   if plots or not md.is_image(line))
  paths = _write_plots(results, out_dir) if plots and figures else []
  report = os.path.join(out_dir, "report.md")
  with open(report + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(report + ".tmp", report)
  return paths + [report]


def figure_files(results: Mapping[str, Any]) -> list[str]:
  """The file names of the figures ``report.md`` shows for ``results`` (none
  with the study's ``plots`` option off), in the order it shows them."""
  if not results["options"].get("plots", True):
    return []
  return [line[line.rindex("(") + 1:-1] for line in report_lines(results)
          if md.is_image(line)]


def _write_plots(results: Mapping[str, Any], out_dir: str) -> list[str]:
  """Every figure of the report; returns their paths."""
  seeds, agg = results["seeds"], results["aggregate"]
  runs = f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}"
  paths = []
  lead = lead_curves(results)
  for metric, name in _CURVE_FILES.items():
    paths.append(_curve_plot(
        results, agg, np.asarray(seeds[0]["fractions"], np.float64), metric,
        os.path.join(out_dir, md.figure(results, name)),
        f"{results['task']}: test {_METRIC_LABELS[metric]}, {runs}",
        report_extensions.gate_points(results) if metric == "token_accuracy"
        else None, keys=lead, bands=_REFERENCES))
  paths.append(_families_plot(
      results, "token_accuracy",
      os.path.join(out_dir, md.figure(results, _FAMILIES_PNG)),
      f"{results['task']}: test token accuracy by family, {runs}"))
  paths.append(_curve_plot(
      results, agg["no_layer_emptied"],
      np.asarray(seeds[0]["no_layer_emptied"]["fractions"], np.float64),
      "token_accuracy", os.path.join(
          out_dir, md.figure(results, _NO_LAYER_EMPTIED_PNG)),
      f"{results['task']}: never emptying a layer, {runs}",
      report_extensions.gate_points(results, "no_layer_emptied")))
  paths += [_importance_plot(results, out_dir),
            _ablation_plot(results, out_dir),
            _scatter_plot(results, out_dir)]
  if results.get("speed"):
    paths.append(_speed_plot(results, out_dir))
  paths += report_extensions.write_plots(results, out_dir, _curve_plot)
  return paths


# --------------------------------------------------------------------------
# report.md, section by section.
# --------------------------------------------------------------------------


def report_lines(results: Mapping[str, Any]) -> list[str]:
  """The lines of ``report.md``."""
  lines = _intro(results)
  lines += _findings_section(results)
  lines += _curves_section(results)
  lines += _oracle_section(results)
  lines += _searches_section(results)
  lines += _tuning_section(results)
  lines += _loss_oracle_section(results)
  lines += _kv_groups_section(results)
  lines += _kv_cache_section(results)
  lines += _over_training_section(results)
  lines += _no_layer_emptied_section(results)
  lines += _spearman_section(results)
  lines += _attribution_section(results)
  lines += _importance_section(results)
  lines += _interactions_section(results)
  lines += roles_section(results)
  lines += _ablation_section(results)
  if results.get("speed"):
    lines += _speed_section(results)
  lines += report_extensions.report_lines(results)
  if "custom_pruning" in results:
    c = results["custom_pruning"]
    lines += ["## Requested pruning", "",
              f"Removed {c['removed']}: heads per layer "
              f"{c['heads_per_layer']}, {c['params']:,} parameters, test "
              f"token accuracy {c['test_token_accuracy']:.4f}, exact match "
              f"{c['test_exact_match']:.4f}.", ""]
  return lines + _timings_section(results)


def _intro(results: Mapping[str, Any]) -> list[str]:
  seeds, model, opts = results["seeds"], results["model"], results["options"]
  sizes = results["splits"]["sizes"]
  return [
      f"# Head importance and head pruning: `{results['task']}`", "",
      f"Checkpoint: `{results['workdir']}`. Model: {model['num_layers']} "
      f"layers, heads {model['num_heads']}, d_model {model['d_model']}, mlp "
      f"{model['mlp_dim']}. Seeds: "
      + ", ".join(f"{s['seed']} (step {s['step']})" for s in seeds) + ".", "",
      f"Importance, the oracle's choices and the prunable level are measured "
      f"on **validation** ({sizes['validation']} examples); every accuracy "
      f"reported is on **test** ({sizes['test']} examples). Unpruned test "
      "token accuracy / exact match per seed: "
      + ", ".join(f"{s['test']['token_accuracy']:.4f} / "
                  f"{s['test']['exact_match']:.4f}" for s in seeds) + ".", "",
      "In the findings, the pruning curves, never emptying a layer and the "
      "ranking's stability, every `value [low, high]` is a mean over seeds "
      "with its 95% interval from a paired bootstrap "
      f"({opts['num_bootstrap']} resamples) over test and validation "
      "examples"
      + (" and over seeds: the examples' bootstrap of the mean over seeds "
         "plus a seed-level Student t term with "
         f"{len(seeds) - 1} degree{'s' if len(seeds) > 2 else ''} of "
         "freedom (`interval_method` "
         f"`{results.get('interval_method', 'n/a')}` in results.json), "
         "which keeps its coverage with few seeds where a percentile "
         "bootstrap over seeds does not (measured in "
         "`scripts/interval_coverage.py`, docs/pruning.md)"
         if len(seeds) > 1 else " (one seed: the interval says nothing about "
         "another training run)") + ". The oracle's table, the importance "
      "of each head and Michel et al.'s tables are of the first seed "
      f"({seeds[0]['seed']}) only (the oracle's intervals over its test "
      "examples). All orderings share each resample, so "
      "differences between them are paired. " + _conditional_sentence(seeds)
      + " Claims about "
      "the orderings against random orders and against the oracle use "
      "simultaneous 95% intervals over each family (max-t: every gap's "
      "interval holds its truth at once with 95% probability); the tables "
      "show marginal ones.", "",
      _ablation_sentence(results.get("ablation", "zero")), "",
  ]


def _conditional_sentence(seeds: Sequence[Mapping[str, Any]]) -> str:
  """Which orderings' intervals include their own estimation, which are
  conditional on the order."""
  info = seeds[0].get("bootstrap_importance") or {}
  again = info.get("reestimated", [])
  if not again:
    return ("The intervals are conditional on each seed's orderings: the "
            "importance measures are computed once on the whole of "
            "validation, not again in each resample.")
  names = ", ".join(f"`{n}`" for n in again)
  left = ", ".join(f"`{n}`" for n in info.get("conditional", []))
  return (f"The orderings {names} are re-estimated in every resample of "
          "validation (from per-example gradients and per-example "
          "leave-one-out losses), so their intervals include the "
          "uncertainty of the order itself"
          + (f"; {left} needed too many masks and stay" if left else "")
          + "; the other orderings' intervals are conditional on the order "
          "computed once on the whole of validation.")


#: What a removed head outputs under each ``--ablation`` mode.
ABLATION_TEXT = {
    "zero": "zero (its context is masked out)",
    "mean": "its mean context over validation, at every position",
    "mean_position": "its mean context over validation at that position",
    "resample": "its context on another test (or validation) example of "
                "the same length, in the unpruned model",
}


def _ablation_sentence(mode: str) -> str:
  """Which ablation the study's subsets were evaluated under."""
  name, sinks, window = parse_ablation(mode)
  if name == ABLATION_STREAMING:
    return (f"Ablation: a removed head keeps a streaming KV cache (`--ablation "
            f"{mode}`): it attends to the first {sinks} positions and the "
            f"last {window} up to the query instead of the whole context. "
            "The oracle, every curve, the searches, leave-one-out, Shapley "
            "values and the mask-gradient measures (gradient, Fisher: a "
            "mask value mixes a head's full and windowed outputs) are "
            "computed under it; 'heads removed' means heads given the "
            "short cache.")
  text = (f"Ablation: a removed head outputs {ABLATION_TEXT[name]} "
          f"(`--ablation {mode}`). The oracle, every curve, the searches, "
          "leave-one-out and Shapley values are computed under it")
  if mode == "zero":
    return text + "."
  return (text + "; the mask-gradient measures (gradient, Fisher) are taken "
          "at zero ablation, and Kwon et al.'s mask tuning, which assumes "
          "it, is skipped.")


def _attribution_section(results: Mapping[str, Any]) -> list[str]:
  """Attribution patching's estimates against actual patching."""
  seeds = [s for s in results["seeds"] if "attribution" in s]
  if not seeds:
    return []
  rows = []
  for name, check in seeds[0]["attribution"].items():
    per_seed = [s["attribution"][name] for s in seeds]
    rho = stats.fisher_mean([c["spearman"] for c in per_seed])
    rows.append([
        f"{name} (`{check['mode']}`)",
        f"{md.fmt(rho['rho'], 2)} [" + ", ".join(
            md.fmt(c, 2) for c in rho["ci"]) + "]",
        ", ".join(md.fmt(c["spearman"]["rho"], 2) for c in per_seed),
        ", ".join(md.fmt(c["mean_abs_error"], 4) for c in per_seed)])
  return [
      "## Attribution patching against actual patching", "",
      "Attribution patching estimates the increase in validation loss from "
      "removing each head alone to first order (`-dL/dm` at the full mask, "
      "one forward and one backward pass); actual patching removes it "
      "(leave-one-out under the same baseline). Spearman correlation of "
      "the two over heads (mean over seeds through Fisher's z, 95% "
      "interval), and the mean absolute error of the estimate in loss "
      "(nats). The orderings `attribution_*` remove the least estimated "
      "increase first.", "",
  ] + md.table(["baseline", "Spearman ρ [95% CI]", "per seed",
                "mean |error| per seed"], rows) + [""]


def _simultaneous(entry: Mapping[str, Any], key: str) -> dict[str, Any]:
  """``{key, key_ci}`` with ``entry``'s simultaneous interval of ``key``
  (``<key>_simultaneous_ci``; its marginal one where there is none)."""
  ci = entry.get(f"{key}_simultaneous_ci", entry.get(f"{key}_ci"))
  return {key: entry.get(key), f"{key}_ci": ci}


def _sign(entry: Mapping[str, Any], key: str) -> int:
  """+1 / -1 when the interval of ``entry[key]`` excludes 0 above / below,
  0 when it contains 0 (or is missing)."""
  ci = entry.get(f"{key}_ci")
  if ci is None or not all(md.finite(c) for c in ci):
    return 0
  return 1 if ci[0] > 0 else (-1 if ci[1] < 0 else 0)


def _half_split_finding(oracle: Mapping[str, Any]) -> str:
  """The oracle's prunable level chosen on one validation half, checked on
  the other and reported on test."""
  key = "token_accuracy"
  if f"prunable_heads_{key}_half_split" not in oracle:
    return "- (No half-split level in these results.)"
  return (
      "- Chosen on the first half of validation instead, checked on the "
      "second (the oracle's candidates ranked on the first half alone; the "
      "orderings were fitted on all of validation): the oracle prunes "
      f"{md.ci(oracle, f'prunable_heads_{key}_half_split', 1)} heads; the "
      "level holds on the second half in "
      f"{oracle[f'half_split_holds_{key}']:.0%} of seeds (its loss there "
      f"{md.ci(oracle, f'half_split_second_half_loss_{key}', 3)}); test "
      "token accuracy there "
      f"{md.ci(oracle, f'test_{key}_at_prunable_half_split', 3)}.")


def _oracle_finding(summary: Mapping[str, Any], orderings: Sequence[str],
                    labels: Mapping[str, str], key: str) -> str:
  """The orderings whose AUC gap to the oracle has a simultaneous interval
  (over the family of gaps to the oracle) containing 0; when there is none,
  the closest one by point estimate, said so."""
  gap = f"{key}_minus_oracle"
  text = f"- The oracle's AUC is {md.ci(summary['oracle'], key)}. "
  sim = {k: _simultaneous(summary[k], gap) for k in orderings}
  close = [k for k in orderings
           if sim[k][f"{gap}_ci"] is not None and _sign(sim[k], gap) == 0]
  if close:
    return text + (
        "Orderings not distinguishable from it (the simultaneous interval "
        "of the AUC gap contains 0): " + "; ".join(
            f"{labels[k]} {md.ci(sim[k], gap, sign=True)}"
            for k in close) + ".")
  best = max(orderings, key=lambda k: summary[k][key])
  return text + (
      "Every ordering's gap to it has a simultaneous interval excluding 0; "
      f"the closest by point estimate is {labels[best]}, "
      f"{md.ci(sim[best], gap, sign=True)}.")


#: The curves that are references, not methods (left out of the findings'
#: lists of orderings).
REFERENCES = ("oracle", "oracle_by_loss")


def _nesting_finding(summary: Mapping[str, Any], orderings: Sequence[str],
                     labels: Mapping[str, str], key: str) -> str:
  """The best ordering's gap to the oracle (the price of nesting) and the
  closest ordering's gap to the best ordering (its ranking error)."""
  best = summary.get("best_ordering")
  if best is None:
    return "- (No best ordering in these results.)"
  ranked = [k for k in orderings if k != "best_ordering"
            and f"{key}_minus_best_ordering" in summary[k]]
  text = ("- The best ordering (the nested chain of best validation AUC) "
          f"has AUC {md.ci(best, key)}; its gap to the oracle, the price of "
          f"nesting: {md.ci(best, f'{key}_minus_oracle', sign=True)}")
  if not ranked:
    return text + "."
  closest = max(ranked, key=lambda k: summary[k][key])
  return text + (
      f". The closest ordering, {labels[closest]}, is "
      f"{md.ci(summary[closest], f'{key}_minus_best_ordering', sign=True)} "
      "from it (its ranking error).")


def _findings_section(results: Mapping[str, Any]) -> list[str]:
  """The claims the intervals carry, each with its interval."""
  agg, labels = results["aggregate"], _labels(results)
  summary = agg["curve_summary"]
  searches = _search_names(results)
  orderings = [k for k in labels if k in summary and k not in REFERENCES
               and k not in searches]
  key = "auc_token_accuracy"
  lines = ["## Findings (test token accuracy; 95% intervals)", ""]
  vs_random = f"{key}_minus_random"
  sim = {k: _simultaneous(summary[k], vs_random) for k in orderings}
  by_sign = {s: [k for k in orderings if k != "random" and
                 _sign(sim[k], vs_random) == s]
             for s in (1, 0, -1)}
  for s, verdict in ((1, "beat random orders"),
                     (0, "are not distinguishable from random orders"),
                     (-1, "are worse than random orders")):
    if by_sign[s]:
      lines.append(f"- These orderings {verdict} (AUC difference, "
                   "simultaneous intervals): " +
                   "; ".join(f"{labels[k]} " + md.ci(
                       sim[k], vs_random, sign=True)
                             for k in by_sign[s]) + ".")
  if "oracle" in summary:
    lines.append(_oracle_finding(summary, orderings, labels, key))
    lines.append(
        "- Heads prunable within the tolerance (chosen on validation): "
        f"oracle {md.ci(summary['oracle'], 'prunable_heads_token_accuracy', 1)}"
        "; " + "; ".join(
            f"{labels[k]} {md.ci(summary[k], 'prunable_heads_token_accuracy', 1)}"
            for k in orderings) + ".")
    lines.append(_half_split_finding(summary["oracle"]))
    lines.append(_nesting_finding(summary, orderings, labels, key))
  else:
    lines.append("- " + results["seeds"][0].get(
        "oracle_skipped", "The oracle was not computed."))
  change = agg["no_layer_emptied"]["curve_summary"]
  for s, verdict in ((1, "raises"), (-1, "lowers")):
    names = [k for k in orderings if k in change and
             _sign(change[k], f"{key}_change") == s]
    if names:
      lines.append(
          f"- Never emptying a layer {verdict} the AUC (same points) of: " +
          "; ".join(f"{labels[k]} " + md.ci(change[k], f"{key}_change",
                                          sign=True) for k in names) + ".")
  same = [labels[k] for k in orderings
          if k in change and _sign(change[k], f"{key}_change") == 0]
  if same:
    lines.append("- It makes no difference the intervals can see for: " +
                 ", ".join(same) + ".")
  return lines + [""]


def _curve_rows(summary: Mapping[str, Any], labels: Mapping[str, str],
                columns: Sequence[tuple[str, int, bool]]) -> list[list[str]]:
  """A row per curve of ``summary`` (in ``labels``' order): its label, then
  ``value [low, high]`` of each ``(key, digits, signed)`` column."""
  return [[label] + [md.ci(summary[key], column, digits, sign)
                     for column, digits, sign in columns]
          for key, label in labels.items() if key in summary]


def _cost_cell(results: Mapping[str, Any], name: str) -> str:
  """``S subsets, F fwd / B bwd, T s``: the mean over seeds of ``name``'s
  ``cost`` (empty where results have none)."""
  costs = [s["cost"][name] for s in results["seeds"]
           if name in s.get("cost", {})]
  if not costs:
    return ""
  mean = lambda key: float(np.mean([c[key] for c in costs]))
  unit = costs[0].get("unit")
  passes = (f"{mean('forward_passes'):,.0f} fwd / "
            f"{mean('backward_passes'):,.0f} bwd"
            + (f" ({unit})" if unit else ""))
  return (f"{mean('subset_evaluations'):,.0f} subsets, {passes}, "
          f"{mean('seconds'):.1f} s")


def _curves_section(results: Mapping[str, Any]) -> list[str]:
  agg, opts = results["aggregate"], results["options"]
  labels = _labels(results)
  tol = opts["tolerance"] * 100
  lines = [
      "## Pruning curves", "",
      "Heads removed globally, least important first, "
      + ("one at a time" if not opts["step_fraction"] else
         f"in steps of {opts['step_fraction']:.0%}") + f"; "
      f"{opts['num_random_orders']} random orders per seed. The oracle is, "
      "for each number of heads removed, the subset with the best validation "
      "token accuracy (its subsets need not be nested).", "",
      "The first two figures draw the oracle, the best ordering (the best "
      "nested chain of subsets, where the results hold it), the search and "
      f"the {LEAD_ORDERINGS} orderings of best AUC (test token accuracy), "
      "and random, with the 95% intervals of the oracle and random; the "
      "third draws every curve, one panel per family, each with the oracle "
      "and random.", "",
      md.image(results, "token accuracy", "curves_token_accuracy.png"), "",
      md.image(results, "exact match", "curves_exact_match.png"), "",
      md.image(results, "token accuracy by family", _FAMILIES_PNG), "",
      "AUC: area under the test curve over the fraction removed (1 = no "
      f"loss). Prunable: the most heads removed with every validation point "
      f"within {tol:g} point(s) of the unpruned validation accuracy, chosen "
      "on validation; its test accuracy beside it. Random is the mean of "
      f"{opts['num_random_orders']} random orders per seed: the intervals of "
      "the differences against it resample examples and seeds, not the "
      "random orders, so they leave out the Monte-Carlo error of that "
      "mean.", "",
  ]
  searches = set(_search_names(results))
  ordering_labels = {k: v for k, v in labels.items() if k not in searches}
  rows = _curve_rows(agg["curve_summary"], ordering_labels, [
      ("auc_token_accuracy", 3, False),
      ("auc_token_accuracy_minus_oracle", 3, True),
      ("auc_token_accuracy_minus_best_ordering", 3, True),
      ("auc_token_accuracy_minus_random", 3, True),
      ("prunable_heads_token_accuracy", 1, False),
      ("prunable_heads_token_accuracy_minus_oracle", 1, True),
      ("test_token_accuracy_at_25pct_removed", 3, False),
      ("test_token_accuracy_at_50pct_removed", 3, False),
      ("test_token_accuracy_at_prunable", 3, False),
      ("auc_exact_match", 3, False)])
  rows = [row + [_cost_cell(results, key)] for row, key in zip(
      rows, [k for k in ordering_labels if k in agg["curve_summary"]])]
  lines += [
      "Orderings (and the references read off the oracle's table). Δ vs "
      "best ordering: the ranking error, what a better ranking could "
      "recover; the best ordering's Δ vs oracle is the price of nesting, "
      "what no ordering can (the two add up to an ordering's Δ vs oracle). "
      "Prunable Δ vs oracle: heads prunable within the tolerance minus the "
      "oracle's, the gap where pruning is used. Test token accuracy at 25% "
      "and 50% of the heads removed (the curve's point with the most heads "
      "removed not beyond it). Cost per seed: subsets evaluated, passes "
      "over validation (forward / backward), measured seconds "
      "(`cost` in results.json).", ""]
  lines += md.table(["curve", "AUC token acc.", "Δ vs oracle",
                     "Δ vs best ordering", "Δ vs random",
                     "prunable heads (val.)", "prunable Δ vs oracle",
                     "test token acc. at 25%", "at 50%",
                     "at the prunable level", "AUC exact match", "cost"],
                    rows)
  share = agg.get("share_of_random_at_least_as_good", {})
  if share:
    lines += ["Share of random orders with at least the AUC of each curve, per "
              "seed (a one-sided permutation p-value): "
              + "; ".join(f"{labels.get(k, k)} "
                          + ", ".join(f"{p:.2f}" for p in v)
                          for k, v in share.items()) + ".", ""]
  return lines


def _oracle_section(results: Mapping[str, Any]) -> list[str]:
  first = results["seeds"][0]
  lines = [f"## The oracle (seed {first['seed']})", ""]
  if not first.get("oracle"):
    return lines + [first.get("oracle_skipped", "Not computed."), ""]
  curve = first.get("curves", {}).get("oracle", {})
  ci = curve.get("token_accuracy_ci")
  if ci is None or len(ci) != len(first["oracle"]):
    ci = [None] * len(first["oracle"])  # Curve points are not every k.
  rows = [[e["k"], _heads_text(e["removed"]),
           md.fmt(e["validation"]["token_accuracy"]),
           md.ci({"v": e["test"]["token_accuracy"], "v_ci": c}, "v"),
           md.fmt(e["test"]["exact_match"])]
          for e, c in zip(first["oracle"], ci)]
  lines += md.table(["heads removed", "which (layer:head)",
                   "validation token acc.", "test token acc. [95% CI]",
                   "test exact match"], rows)
  return lines + [
      "The oracle's choice is made on the full validation split. In each "
      "bootstrap replicate it is made again, on the resampled validation "
      "split, among the few best subsets of the full split for each number "
      "of heads removed, so the oracle's intervals include the variability "
      "of its choice.", ""]


#: The curves of the KV-cache table (streaming ablation), in its order:
#: the ground truth, the learned gates, the attention-pattern scores, the
#: existing measures, random.
KV_CACHE_CURVES = ("oracle", "best_ordering", "duo_gates", "retrieval_score",
                   "headkv", "echo", "induction", "attention_distance",
                   "gradient", "fisher", "leave_one_out", "shapley",
                   "random")
#: The attention-pattern heuristics DuoAttention's gates are compared with.
KV_HEURISTICS = ("retrieval_score", "headkv", "echo", "induction",
                 "attention_distance")


def _kv_text(value: float, interval: Sequence[float] | None) -> str:
  """A share of the KV cache as a percentage, with its interval."""
  pct = lambda x: f"{100 * x + 0.0:.1f}"  # + 0.0: no "-0.0"
  if interval is None:
    return f"{pct(value)}%"
  return f"{pct(value)}% [{pct(min(interval))}, {pct(max(interval))}]"


def _kv_cache_section(results: Mapping[str, Any]) -> list[str]:
  """Under ``--ablation streaming``: which heads need their whole KV cache
  (the oracle's minimal set within the tolerance), each scorer's gap to
  it in heads and in KV memory, and the three published claims tested."""
  mode, sinks, window = parse_ablation(results.get("ablation", "zero"))
  first = results["seeds"][0]
  if mode != ABLATION_STREAMING or "kv_memory" not in first:
    return []
  summary_ = results["aggregate"]["curve_summary"]
  counts = np.asarray(first["counts"])
  n = int(counts.max())
  memory = np.asarray(first["kv_memory"], np.float64)
  per_head = (memory[0] - memory[-1]) / max(n, 1)  # KV share of one head
  metric = "token_accuracy"
  key = f"prunable_heads_{metric}"
  tol = results["options"].get("tolerance", 0.01)

  def full_heads(entry):  # heads that keep a full cache at the level
    value = n - entry[key]
    ci = entry.get(f"{key}_ci")
    return value, None if ci is None else [n - ci[1], n - ci[0]]

  def kv_at(entry):
    value, ci = full_heads(entry)
    lowest = memory[-1]
    return (lowest + value * per_head,
            None if ci is None else [lowest + c * per_head for c in ci])

  rows = []
  for name in KV_CACHE_CURVES:
    entry = summary_.get(name)
    if entry is None or key not in entry:
      continue
    heads, heads_ci = full_heads(entry)
    kv, kv_ci = kv_at(entry)
    gap = entry.get(f"{key}_minus_oracle")
    gap_ci = entry.get(f"{key}_minus_oracle_ci")
    rows.append([
        results.get("curve_labels", {}).get(name, name),
        f"{heads:.1f}" + ("" if heads_ci is None else
                          f" [{heads_ci[0]:.1f}, {heads_ci[1]:.1f}]"),
        _kv_text(kv, kv_ci),
        "" if gap is None else (
            _kv_text(-gap * per_head, None if gap_ci is None else
                     [-c * per_head for c in gap_ci])),
        md.ci(entry, f"auc_{metric}"),
        "" if name == "oracle" else md.ci(entry, f"auc_{metric}_minus_oracle",
                                          sign=True)])
  lines = [
      "## KV cache: which heads need their whole context", "",
      f"Each curve gives heads, in its order, a streaming cache ({sinks} "
      f"sink positions and a window of {window}) instead of the whole "
      "context; the "
      f"KV memory kept is `(k T + (N - k)(S + W)) / (N T)` for `k` full "
      f"heads of `N = {n}`. Full heads at the level: the fewest heads that "
      f"keep test {metric.replace('_', ' ')} within {tol:g} of the full "
      "model (chosen on validation, as the pruning level); the oracle's is "
      "the minimal set over every subset. Mean accuracy over the KV range: "
      "the AUC of the curve, the same over heads removed as over KV "
      "memory (KV memory is linear in the heads removed). Means over "
      "seeds, 95% intervals.", ""]
  lines += md.table(["ordering", "full heads at the level",
                     "KV memory at the level", "KV memory above the oracle's",
                     "mean accuracy over the KV range",
                     "minus the oracle's"], rows)
  lines += _kv_questions(summary_, n, key, metric)
  return lines


def _kv_questions(summary_: Mapping[str, Any], n: int, key: str,
                  metric: str) -> list[str]:
  """The three published claims, one sentence each, from the intervals."""
  out = []
  oracle_ = summary_.get("oracle", {})
  if key not in oracle_:
    return out
  need = n - oracle_[key]
  need_ci = oracle_.get(f"{key}_ci") or [oracle_[key]] * 2
  share = (f"{100 * need / n:.0f}% of heads [{100 * (n - need_ci[1]) / n:.0f}"
           f", {100 * (n - need_ci[0]) / n:.0f}]")
  retrieval = summary_.get("retrieval_score", {})
  if key in retrieval:
    gap = retrieval.get(f"{key}_minus_oracle_ci")
    same = gap is not None and gap[0] <= 0 <= gap[1]
    under = (n - need_ci[0]) / n < 0.05
    verdict = ("are not shown to differ from it in number" if same else
               "need more full heads than it")
    out.append(
        f"- **Wu et al. (retrieval heads are few, under 5%):** the minimal "
        f"set of full-cache heads is {share} here, "
        f"{'under' if under else 'not under'} 5% by its interval; the top "
        f"retrieval-score heads {verdict} "
        f"({md.ci(retrieval, key + '_minus_oracle', digits=1, sign=True)} "
        "heads prunable against the oracle).")
  duo = summary_.get("duo_gates", {})
  compared = [(h, summary_[h]) for h in KV_HEURISTICS if h in summary_ and
              f"auc_{metric}_minus_duo_gates" in summary_[h]]
  if duo and compared:
    wins = [h for h, e in compared
            if e[f"auc_{metric}_minus_duo_gates_ci"][1] < 0]
    losses = [h for h, e in compared
              if e[f"auc_{metric}_minus_duo_gates_ci"][0] > 0]
    out.append(
        "- **DuoAttention (optimised gates beat attention-pattern "
        "heuristics):** by mean accuracy over the KV range (paired), the "
        f"gates beat {len(wins)} of the {len(compared)} heuristics"
        + (f" ({', '.join(wins)})" if wins else "")
        + f", lose to {len(losses)}"
        + (f" ({', '.join(losses)})" if losses else "")
        + ", and the rest are within their intervals.")
  razor = [summary_[h] for h in ("echo", "induction") if h in summary_]
  if razor:
    best = max(razor, key=lambda e: e.get(key, -1))
    name = "echo" if best is summary_.get("echo") else "induction"
    gap = best.get(f"{key}_minus_oracle_ci")
    out.append(
        "- **RazorAttention (echo and induction heads suffice):** ranked by "
        f"their {name} score (the better of the two), the heads kept at the "
        "level "
        + ("match the oracle's count within the interval"
           if gap is not None and gap[0] <= 0 <= gap[1] else
           "are more than the oracle's")
        + f" ({md.ci(best, key + '_minus_oracle', digits=1, sign=True)} "
        "heads prunable against the oracle).")
  return out + [""]


#: The group-level curves, in the order of the KV-groups table.
KV_GROUP_CURVES = {"oracle": "oracle (best subset of groups)",
                   "oracle_by_loss": "oracle by loss",
                   "gradient": "gradient (group mask)",
                   "fisher": "Fisher (group mask)",
                   "leave_one_out": "leave-one-group-out",
                   **{name: f"{ORDERINGS[name]}, by group"
                      for name in KV_CACHE_CURVES if name in KV_SCORES},
                   "random": "random"}


def _kv_groups_section(results: Mapping[str, Any]) -> list[str]:
  """A GQA model pruned by whole key/value groups beside the head-level
  oracle: the same statistics with groups as the units."""
  groups = results["aggregate"].get("kv_groups")
  if not groups:
    return []
  first = results["seeds"][0]["kv_groups"]
  size = max(first["heads_per_group"])
  summary = groups["curve_summary"]
  heads = results["aggregate"]["curve_summary"].get("oracle", {})
  rows = [[label, md.ci(summary[k], "auc_token_accuracy"),
           md.ci(summary[k], "auc_token_accuracy_minus_oracle", sign=True),
           md.ci(summary[k], "prunable_heads_token_accuracy", 1),
           md.ci(summary[k], "test_token_accuracy_at_prunable"),
           md.ci(summary[k], "prunable_heads_loss", 1)]
          for k, label in KV_GROUP_CURVES.items() if k in summary]
  header = ["curve", "AUC token acc.", "Δ vs oracle", "prunable groups "
            "(val.)", "test token acc. there", "prunable groups by loss"]
  if "kv_memory" in first:  # --ablation streaming: groups keep a window
    # kv_memory is linear in the groups streaming: 1 - p (1 - m_U) / U.
    memory = np.asarray(first["kv_memory"], np.float64)
    per_group = (1.0 - memory[-1]) / first["num_groups"]
    header.append("KV memory kept there")
    for row, k in zip(rows, [k for k in KV_GROUP_CURVES if k in summary]):
      value = summary[k].get("prunable_heads_token_accuracy")
      interval = summary[k].get("prunable_heads_token_accuracy_ci")
      row.append("n/a" if not md.finite(value) else _kv_text(
          1 - value * per_group,
          None if interval is None or not all(map(md.finite, interval))
          else [1 - c * per_group for c in interval]))
    what = (
        f"Under `--ablation={first['ablation']}` a removed group keeps a "
        "streaming cache: all its query heads see only the sinks and the "
        "window of their shared keys and values, so the group's cache "
        "shrinks for real (the mixed cache decodes it so). Here prunable "
        "groups are groups that can stream, and the KV memory kept there "
        "counts groups, which hold equal bytes. The head-level KV memory "
        "(the KV cache section) counts query heads: the saving of a "
        "per-head cache, not of this grouped one.")
  else:
    what = ("Removing a whole group removes its key and value projections, "
            "all its query heads and its share of the KV cache.")
  return [
      "## KV groups", "",
      f"The model's query heads share key/value heads ({first['num_groups']} "
      f"groups of {size} query heads). {what} The same statistics with "
      f"groups as the units (every subset of the {first['num_groups']} "
      "groups evaluated): prunable counts are groups. Head level, for "
      "comparison: the oracle removes "
      f"{md.ci(heads, 'prunable_heads_token_accuracy', 1)} heads within "
      "the tolerance (any heads, not whole groups).", ""
  ] + md.table(header, rows)


#: The orderings that rank heads by the loss (the gradient family and the
#: measures of a loss increase), compared with the oracle by loss.
LOSS_ORDERINGS = ("gradient", "gradient_l2", "gradient_iterative", "fisher",
                  "attribution_zero", "attribution_mean",
                  "attribution_resample", "leave_one_out")


def _loss_oracle_section(results: Mapping[str, Any]) -> list[str]:
  """The oracle chosen by validation loss beside the one chosen by token
  accuracy, and the orderings that rank by the loss against it."""
  summary = results["aggregate"]["curve_summary"]
  if "oracle_by_loss" not in summary:
    return []
  labels = _labels(results)
  names = ["oracle", "oracle_by_loss", "best_ordering",
           *[k for k in LOSS_ORDERINGS if k in summary], "random"]
  rows = [[labels.get(k, k), md.ci(summary[k], "auc_loss", 3),
           md.ci(summary[k], "auc_loss_minus_oracle_by_loss", 3, sign=True),
           md.ci(summary[k], "auc_token_accuracy"),
           md.ci(summary[k], "auc_token_accuracy_minus_oracle", sign=True),
           md.ci(summary[k], "prunable_heads_token_accuracy", 1),
           md.ci(summary[k], "prunable_heads_loss", 1),
           md.ci(summary[k], "prunable_heads_loss_minus_oracle_by_loss", 1,
                 sign=True),
           md.ci(summary[k], "test_bits_at_prunable_loss", 3)]
          for k in names if k in summary]
  bits = results["options"].get("loss_tolerance_bits", 0.05)
  return [
      "## The oracle by loss", "",
      "The oracle above chooses each subset by validation token accuracy; "
      "the gradient family (gradient, Fisher, attribution patching) and "
      "leave-one-out rank heads by the loss. The oracle by loss chooses "
      "each subset by the lowest validation loss (again in each replicate "
      "among its candidates), from the same table. AUC loss: the area "
      "under the test loss curve over the fraction removed (nats; lower is "
      "better); Δ vs oracle by loss: a curve's excess of it. Prunable by "
      f"loss: the most heads removed with every validation point within "
      f"{bits:g} bits per scored token of the unpruned loss "
      "(--loss_tolerance_bits; for a character LM, bits per character), "
      "and the test loss there in bits.", ""
  ] + md.table(["curve", "AUC test loss", "Δ vs oracle by loss",
                "AUC token acc.", "Δ vs oracle (token acc.)",
                "prunable heads (val.)", f"prunable by loss (≤ {bits:g} bits)",
                "Δ vs oracle by loss", "test bits there"], rows)


#: The curves of the over-training table, beside the oracle's level.
_OVER_TRAINING_CURVES = ("best_ordering", "gradient", "fisher",
                         "leave_one_out", "attribution_zero", "shapley",
                         "random")


def _over_training_section(results: Mapping[str, Any]) -> list[str]:
  """The oracle's prunable level and the orderings' AUC gaps to it at each
  checkpoint step every seed's run holds (mean over seeds)."""
  entries = results["aggregate"].get("checkpoints_over_training")
  if not entries:
    return []
  labels = _labels(results)
  seeds = results["seeds"]
  names = [k for k in _OVER_TRAINING_CURVES if k in entries[-1]["orderings"]]
  rows = []
  for e in entries:
    loss = [c["validation"]["loss"] for s in seeds
            for c in s.get("checkpoints_over_training", [])
            if c["step"] == e["step"]]
    acc = [c["test"]["token_accuracy"] for s in seeds
           for c in s.get("checkpoints_over_training", [])
           if c["step"] == e["step"]]
    oracle = e.get("oracle", {})
    rows.append([e["step"], md.fmt(float(np.mean(loss)), 4) if loss else "",
                 md.fmt(float(np.mean(acc))) if acc else "",
                 md.ci(oracle, "prunable_heads_token_accuracy", 1)
                 if oracle else "n/a"]
                + [md.ci(e["orderings"][k], "auc_token_accuracy_minus_oracle",
                         sign=True) for k in names])
  return [
      "## Over training", "",
      "Every checkpoint step that each seed's run holds ("
      + (f"all {len(seeds)} seeds" if len(seeds) > 1 else "one seed")
      + "), analysed as the study analyses its step (but no searches, Kwon "
      "et al., gates, nor orderings re-estimated in each resample: at the "
      "study's own step the re-estimated orderings' intervals include their "
      "own uncertainty, at the others they are conditional): the unpruned "
      "validation loss and test token accuracy, the oracle's heads "
      "prunable within the tolerance, and each ordering's AUC gap to the "
      "oracle (test token accuracy; mean over seeds, 95% intervals). The "
      "early checkpoints are not saturated: the gradient family's signal "
      "is there. Every ordering's gaps per step and seed: "
      "`checkpoints_over_training` in results.json.", ""
  ] + md.table(["step", "validation loss", "test token acc.",
                "oracle: prunable heads (val.)",
                *[f"{labels.get(k, k)}: Δ AUC vs oracle" for k in names]],
               rows)


def _search_names(results: Mapping[str, Any]) -> list[str]:
  """The searches every seed ran (``searches.<name>``), in label order."""
  names = set(results["seeds"][0].get("searches", {}))
  return [k for k in results["curve_labels"] if k in names]


def _heads_text(removed: Sequence[Sequence[int]]) -> str:
  return ", ".join(f"{l}:{h}" for l, h in removed) or "-"


def _searches_section(results: Mapping[str, Any]) -> list[str]:
  """Each search's AUC and its gap to the oracle (intervals over examples
  and seeds), its cost, and per number of heads removed (first seed) the
  subset it found against the best ordering's there."""
  names = _search_names(results)
  if not names:
    return []
  summary = results["aggregate"]["curve_summary"]
  labels, opts, seeds = _labels(results), results["options"], results["seeds"]
  key = "auc_token_accuracy"
  lines = [
      "## Searches for the best subset", "",
      "Each search chooses, on validation, one subset of heads for each "
      "number removed, evaluating subsets through the model (the oracle's "
      "value: validation token accuracy). The layer-additive surrogate "
      "evaluates every removal set of each layer alone, combines them by a "
      f"knapsack over the layers, evaluates the {opts['surrogate_top']} best "
      "combinations of each size exactly and polishes the best by "
      f"{opts['search_polish_rounds']} round(s) of swaps; beam search keeps "
      f"the {opts['beam_width']} best subsets of each size."
      + (" Kwon et al.'s retraining-free search evaluates no subset: it "
         "removes the heads of least Fisher information of the head mask "
         "(per-example gradients squared), rearranges each layer's removals "
         "to minimise the layer's block of the Fisher matrix"
         + (", and, tuned, refits the kept heads' mask values by least "
            "squares, layer by layer (section 'Mask tuning')"
            if "kwon_tuned" in names else "")
         + ". Its seconds exclude the Fisher information (the ordering "
         "'Fisher')."
         if "kwon" in names else "")
      + (" The exact-K gates evaluate no subset either: one gate vector per "
         "number of heads removed, trained on the train split, removes its "
         "heads of lowest learned gate (section 'Learned gates'); their "
         "seconds are the training's."
         if "gates_k" in names else "")
      + " Test token accuracy; 95% intervals over examples and seeds; "
      "seconds and subsets evaluated are means over seeds.", ""]
  has_oracle = "oracle" in summary
  rows = []
  for name in (["oracle"] if has_oracle else []) + names:
    entry = summary[name]
    rows.append([
        labels[name], md.ci(entry, key),
        md.ci(entry, f"{key}_minus_oracle", sign=True) if has_oracle else
        "n/a", md.ci(entry, "prunable_heads_token_accuracy", 1),
        md.ci(entry, "prunable_heads_token_accuracy_minus_oracle", 1,
              sign=True) if has_oracle else "n/a",
        md.ci(entry, "test_token_accuracy_at_25pct_removed"),
        md.ci(entry, "test_token_accuracy_at_50pct_removed"),
        _cost_cell(results, name) or (
            md.fmt(float(np.mean([s["timings"][f"{name}_s"]
                                  for s in seeds])), 1) + " s")])
  lines += md.table(["search", "AUC token acc.", "Δ vs oracle",
                     "prunable heads (val.)", "prunable Δ vs oracle",
                     "test token acc. at 25%", "at 50%",
                     "cost (subsets, passes, seconds)"], rows)
  if has_oracle:
    verdicts = []
    for name in names:
      sign = _sign(summary[name], f"{key}_minus_oracle")
      verdicts.append(f"{labels[name]}: " + (
          "its AUC gap to the oracle has an interval containing 0" if sign == 0
          else "its AUC gap to the oracle has an interval excluding 0, "
          + ("above" if sign > 0 else "below") + " it"))
    lines += ["- " + "; ".join(verdicts) + ".", ""]
  first = seeds[0]
  orderings = [k for k in labels if k in first.get("curves", {})
               and k not in names and k != "oracle"]
  # The other tunings' subsets are Kwon et al.'s or the oracle's: section
  # 'Mask tuning'.
  names = [k for k in names if k not in ("kwon_tuned_attention_output",
                                         "oracle_kwon_tuned")]
  counts = list(first["counts"])
  rows = []
  for k in counts:
    at = counts.index(k)
    best_name = max(orderings, key=lambda o: first["curves"][o][
        "token_accuracy"][at])
    best = first["curves"][best_name]["token_accuracy"][at]
    row = [k]
    for name in names:
      e = first["searches"][name][k]
      value = e["test"]["token_accuracy"]
      # Within float rounding is a tie (a mean over random orders of the
      # same subset, say).
      row += [_heads_text(e["removed"]), md.fmt(value),
              "ties" if abs(value - best) <= _TIE else (
                  "yes" if value > best else "no")]
    rows.append(row + [f"{labels[best_name]} {md.fmt(best)}"])
  header = ["heads removed"]
  for name in names:
    header += [f"{name}: removed (layer:head)", "test token acc.",
               "beats every ordering"]
  lines += [f"Seed {first['seed']}, at each number of heads removed: the "
            "subset each search found, its test token accuracy, and whether "
            "that is above every ordering's at the same number (point "
            "estimates on test, without intervals).", ""]
  return lines + md.table(header + ["best ordering there"], rows)


def _tuning_section(results: Mapping[str, Any]) -> list[str]:
  """Kwon et al.'s mask tuning: per tuned curve its AUC, the untuned one's,
  the paired difference (tuned minus untuned, same resamples) and its
  effect on the prunable level, and how often a layer's solution was
  rejected."""
  summary = results["aggregate"]["curve_summary"]
  names = [k for k in UNTUNED if k in summary and UNTUNED[k] in summary]
  if not names:
    return []
  labels, seeds = _labels(results), results["seeds"]
  key = "auc_token_accuracy"
  rows = []
  for name in names:
    entry, untuned = summary[name], summary[UNTUNED[name]]
    entries = [e for s in seeds for e in s["searches"].get(name, [])]
    stopped = [e for e in entries if e.get("rejected_layer") is not None]
    rows.append([
        labels[name], labels[UNTUNED[name]], md.ci(entry, key),
        md.ci(untuned, key), md.ci(entry, f"{key}_minus_untuned", sign=True),
        md.ci(entry, "prunable_heads_token_accuracy_minus_untuned", 1,
              sign=True),
        f"{len(stopped)} of {len(entries)}" if entries and all(
            "rejected_layer" in e for e in entries) else "n/a"])
  lines = [
      "## Mask tuning", "",
      "Kwon et al.'s third step makes the kept heads' mask values real "
      "numbers, fitted by least squares layer by layer from the bottom on "
      "validation. As their code does it (`kwon_tuned`): the target is the "
      "layer's output before LayerNorm with the residual (here the block's "
      "input plus its attention output: the residual stream after the "
      "attention sublayer), so a layer also corrects what the layers below "
      "left in the residual stream; layer 0 is not tuned; a solution with a "
      "value outside [-10, 10] is rejected, and that layer and those above "
      "keep their 0/1 values. `kwon_tuned_attention_output` fits the "
      "attention output alone, from layer 0 up, without the bound. The "
      "oracle's subset tuned as Kwon et al. do (`oracle_kwon_tuned`) is the "
      "ceiling of tuning: the best subset per number removed, tuned. Tuned "
      "masks are real-valued, the oracle's are 0/1 subsets. The difference "
      "is paired: the same resamples of examples and seeds for both curves. "
      "Test token accuracy; 95% intervals over examples and seeds.", ""]
  lines += md.table(["tuned", "untuned", "AUC tuned", "AUC untuned",
                     "Δ AUC (tuned − untuned)", "Δ prunable heads (val.)",
                     "masks stopped by the bound"], rows)
  return lines


def _no_layer_emptied_section(results: Mapping[str, Any]) -> list[str]:
  group = results["aggregate"]["no_layer_emptied"]
  labels = _labels(results)
  counts = results["seeds"][0]["no_layer_emptied"]["counts"]
  lines = [
      "## Never emptying a layer", "",
      "Each ordering again, skipping a head that is the last of its layer "
      f"(at most {int(counts[-1])} heads removed), and the oracle among the "
      "subsets keeping a head in every layer. Change: AUC of the constrained "
      "curve minus the plain curve's over the same points.", "",
      md.image(results, "no layer emptied", _NO_LAYER_EMPTIED_PNG), "",
  ]
  rows = _curve_rows(group["curve_summary"], labels, [
      ("auc_token_accuracy", 3, False), ("auc_token_accuracy_plain", 3, False),
      ("auc_token_accuracy_change", 3, True),
      ("auc_token_accuracy_minus_oracle", 3, True)])
  return lines + md.table(["curve", "AUC token acc.", "plain, same points",
                         "change", "Δ vs oracle"], rows)


def _spearman_section(results: Mapping[str, Any]) -> list[str]:
  names = {
      "gradient_vs_leave_one_out": "gradient vs leave-one-out",
      "gradient_l2_vs_leave_one_out": "gradient (L2) vs leave-one-out",
      "gradient_halves": "gradient on two disjoint halves of validation",
      "confidence_vs_leave_one_out": "confidence vs leave-one-out",
      "shapley_vs_leave_one_out": "Shapley vs leave-one-out (token acc.)",
      "shapley_vs_gradient": "Shapley vs gradient",
  }
  rows = []
  for key, v in results["aggregate"]["spearman"].items():
    ci = "[" + ", ".join(md.fmt(c, 2) for c in v["ci"]) + "]"
    rows.append([names.get(key, key), f"{md.fmt(v['rho'], 2)} {ci}",
                 md.fmt(v["p"]), ", ".join(md.fmt(x, 2) for x in v["per_seed"])])
  return [
      "## Is the ranking stable?", "",
      "Spearman correlations of per-head scores, averaged over seeds through "
      "Fisher's z, with a 95% interval and the p-value of no correlation "
      "(normal approximation, rough with this few heads).", "",
  ] + md.table(["pair", "Spearman ρ [95% CI]", "p", "per seed"], rows) + (
      ["n/a: undefined, where one side scores every head the same (a "
       "constant has no ranking) or too few heads are left to correlate.",
       ""] if any("n/a" in cell for row in rows for cell in row) else []) + [
      md.image(results, "gradient vs leave-one-out",
               "scatter_gradient_vs_leave_one_out.png"),
      ""]


def _importance_section(results: Mapping[str, Any]) -> list[str]:
  first = results["seeds"][0]
  lines = [
      f"## Importance of each head (seed {first['seed']}, validation)", "",
      md.image(results, "importance", f"importance_seed{first['seed']}.png"), "",
      "Shapley value of each head for v(S) = validation token accuracy with "
      "exactly the heads of S kept (they sum to v(all) - v(none))"
      + (":" if first.get("shapley_method") != "sampled" else
         ", sampled from antithetic pairs of random orders of the heads "
         f"({results['options'].get('shapley_pairs')} pairs; each value's "
         "95% interval, over the orders and the examples, is "
         "`importance.shapley_token_accuracy_ci` in results.json):"), "",
  ]
  shapley = md.grid(first["importance"]["shapley_token_accuracy"])
  lines += (md.heads_table(shapley) if not np.all(np.isnan(shapley)) else
            [first.get("oracle_skipped", "Not computed."), ""])
  lines += ["Leave-one-out loss increase:", ""]
  lines += md.heads_table(md.grid(first["importance"]["leave_one_out"]))
  lines += ["Gradient importance E|dL/dξ|:", ""]
  return lines + md.heads_table(md.grid(first["importance"]["gradient"]), "{:.3g}")


def _interactions_section(results: Mapping[str, Any]) -> list[str]:
  """The pairwise Shapley interactions (when every subset was evaluated):
  the strongest pairs of the first seed, and whether redundant pairs lie
  within a layer, per seed."""
  seeds = [s for s in results["seeds"] if "interactions" in s]
  if not seeds:
    return []
  first = seeds[0]
  lines = [
      "## Interactions between heads", "",
      "Pairwise Shapley interaction index of validation token accuracy "
      "(Grabisch 1997; from every subset, through the Möbius transform): "
      "negative, either head of the pair does the other's job (redundant); "
      "positive, they are worth more together. Seed "
      f"{first['seed']}, the strongest pairs:", ""]
  rows = [[f"{a[0]}:{a[1]}", f"{b[0]}:{b[1]}", md.fmt(p["value"], 4, True)]
          for p in first["interactions"]["pairs"][:6]
          for a, b in [p["heads"]]]
  lines += md.table(["head", "head", "interaction"], rows)
  rows = []
  for s in seeds:
    summary = s["interactions"]["summary"]
    rows.append([s["seed"], md.fmt(summary.get("mean_within_layer"), 4, True),
                 md.fmt(summary.get("mean_across_layers"), 4, True),
                 md.fmt(summary.get("redundant_decile_within_layer"), 2),
                 md.fmt(summary.get("all_pairs_within_layer"), 2)])
  lines += ["Do redundant heads come in pairs within a layer? Per seed: the "
            "mean interaction of pairs within a layer and across layers, and "
            "the share of the most negative tenth of pairs that lie within a "
            "layer beside the share of all pairs that do:", ""]
  return lines + md.table(["seed", "mean within a layer",
                           "mean across layers",
                           "most redundant tenth: within a layer",
                           "all pairs: within a layer"], rows)


#: Importance measures set beside the heads' roles: results key -> label.
_ROLE_MEASURES = {"leave_one_out": "leave-one-out loss increase",
                  "shapley_token_accuracy": "Shapley value"}


def _role_correlations(seeds: Sequence[Mapping[str, Any]], measure: str
                       ) -> dict[str, dict[str, Any]]:
  """Per pattern (and for the top role's score, ``top``): Spearman's rho
  across heads between the pattern's score and ``measure``, per seed, and
  its Fisher-z mean over seeds with a 95% interval and p-value;
  ``top_within_layer``: the same for the top role's score within each
  layer (one rho per seed and layer, layers of at least 4 heads)."""
  out = {}
  for name in (*head_roles.PATTERNS, "top", "top_within_layer"):
    per_seed = []
    for seed in seeds:
      roles = {p: md.grid(seed["head_roles"][p]) for p in head_roles.PATTERNS}
      score = (roles[name] if name in roles else
               np.max(np.stack(list(roles.values())), axis=0))
      importance = md.grid(seed["importance"][measure])
      if name == "top_within_layer":  # one correlation per layer
        per_seed += [stats.spearman(a, b) for a, b in zip(score, importance)]
      else:
        per_seed.append(stats.spearman(score, importance))
    out[name] = stats.fisher_mean(per_seed)
  return out


def _role_cell(v: Mapping[str, Any]) -> str:
  if not md.finite(v["rho"]):
    return "n/a"
  return (f"{md.fmt(v['rho'], 2)} [" + ", ".join(md.fmt(c, 2) for c in v["ci"])
          + f"], p{md.q_value(v['p'])}")


def roles_section(results: Mapping[str, Any]) -> list[str]:
  """``report.md``'s "Does importance follow role?": each head's top role
  (:mod:`mha.head_roles`, on validation) beside its importance (first
  seed), and per pattern the rank correlation between the pattern's score
  and importance across heads, averaged over seeds (Fisher's z), with its
  interval and p-value. Empty for results without ``head_roles``."""
  seeds = [s for s in results["seeds"] if "head_roles" in s]
  if not seeds:
    return []
  first = seeds[0]
  roles = {p: md.grid(first["head_roles"][p]) for p in head_roles.PATTERNS}
  top = head_roles.top_roles(roles)
  change = md.grid(first["single_head_ablation"]["token_accuracy_change"])
  measures = {label: md.grid(first["importance"][key])
              for key, label in _ROLE_MEASURES.items()}
  rows = [[layer, head, f"{head_roles.LABELS[role]} "
           f"({roles[role][layer, head]:.2f})",
           *[md.fmt(m[layer, head]) for m in measures.values()],
           f"{change[layer, head]:+.3f}"]
          for layer, row in enumerate(top) for head, role in enumerate(row)
          if role is not None]
  lines = [
      "## Does importance follow role?", "",
      "Each head's role scores (`mha.head_roles`, on validation): the "
      "attention mass on previous / next / same position, the anti-diagonal "
      "(query i to key n-1-i) and other positions of the same token, and "
      "diffuse (normalised entropy, 1 = uniform over the valid keys); all "
      f"in [0, 1]. Seed {first['seed']}, its top role beside its "
      "importance:", "",
  ] + md.table(["layer", "head", "top role (score)", *measures,
              "Δ test token acc. removed alone"], rows)
  correlations = {label: _role_correlations(seeds, key)
                  for key, label in _ROLE_MEASURES.items()}
  names = {**head_roles.LABELS, "top": "top role's score",
           "top_within_layer": "top role's score, within each layer"}
  lines += [
      "Spearman's ρ across heads between each role score and importance, "
      + (f"averaged over {len(seeds)} seeds through Fisher's z"
         if len(seeds) > 1 else "one seed") + ", with its 95% interval and "
      "the p-value of no correlation (normal approximation: rough with this "
      "few heads; eight correlations of the same heads, not corrected for "
      "multiplicity). Roles and importance both differ by layer, so a "
      "correlation across all heads may only say which layer a head is in; "
      "the last row compares heads of the same layer only (one ρ per seed "
      "and layer of at least 4 heads, averaged the same way):", ""]
  lines += md.table(["role score", *(f"vs {m}" for m in correlations)],
                  [[names[name], *(_role_cell(c[name])
                                   for c in correlations.values())]
                   for name in names])
  loo = correlations[_ROLE_MEASURES["leave_one_out"]]
  clear = [f"{names[n]} ({'+' if v['rho'] > 0 else '-'})"
           for n, v in loo.items()
           if md.finite(v["rho"]) and (v["ci"][0] > 0 or v["ci"][1] < 0)]
  lines += [("Leave-one-out importance rises (+) or falls (-) with: "
             + ", ".join(clear) + " (intervals excluding 0)." if clear else
             "No role score's interval against leave-one-out importance "
             "excludes 0: with these heads, importance does not follow "
             "role clearly."), ""]
  within = loo["top_within_layer"]
  if md.finite(within["rho"]):
    lines += [f"Within a layer, ρ = {_role_cell(within)} between the top "
              "role's score and leave-one-out importance: its interval "
              + ("excludes" if within["ci"][0] > 0 or within["ci"][1] < 0
                 else "includes") + " 0.", ""]
  return lines


def _ablation_section(results: Mapping[str, Any]) -> list[str]:
  first = results["seeds"][0]
  single = first["single_head_ablation"]
  change = md.grid(single["token_accuracy_change"])
  q = md.grid(single["token_accuracy_q"])
  cells = np.where(np.isnan(change), np.nan, change)
  header = ["layer"] + [f"head {h}" for h in range(change.shape[1])]
  rows = [[str(layer)] + ["" if np.isnan(c) else
                          f"{c:+.3f} (q{md.q_value(q[layer, h])})"
                          for h, c in enumerate(row)]
          for layer, row in enumerate(cells)]
  significant = results["aggregate"]["significant_single_heads"]
  lines = [
      f"## Michel et al.'s tables (seed {first['seed']}, test)", "",
      "Single-head ablation: change of test token accuracy when that head "
      "alone is removed, with the Benjamini-Hochberg q-value of a paired "
      "t-test over test examples (per-example correct tokens). Heads with "
      "q < 0.05, per seed: " + ", ".join(map(str, significant)) + ".", "",
  ] + md.table(header, rows)
  lines += ["All but one head per layer: test token accuracy when a layer "
            "keeps only that head (the other layers intact).", ""]
  lines += md.heads_table(md.grid(first["all_but_one"]["test"]["token_accuracy"]),
                        "{:.3f}")
  best = [b for b in first["all_but_one"]["best_head_per_layer"] if b]
  lines += md.table(
      ["layer", "best head (chosen on validation)", "test token acc.",
       "test exact match"],
      [[b["layer"], b["head"], f"{b['test_token_accuracy']:.3f}",
        f"{b['test_exact_match']:.3f}"] for b in best])
  return lines + [md.image(results, "ablation",
                           f"ablation_seed{first['seed']}.png"), ""]


def _speedup_cell(e: Mapping[str, Any], b: str) -> str:
  ci = (e.get("speedup_ci") or {}).get(b)
  text = f"{e['examples_per_sec'][b]:,.0f} (×{e['speedup'][b]:.2f}"
  return text + (f" [{ci[0]:.2f}, {ci[1]:.2f}])" if ci else ")")


def _cost_verdict(flops: float, other: Mapping[str, float]) -> str:
  """Which of XLA's other counts (name -> ratio) fell more than the FLOPs."""
  fell = [name for name, r in other.items() if md.finite(r) and r < flops]
  if not fell:
    return ("neither fell more than the FLOPs: XLA's counts do not explain "
            "it")
  return " and ".join(fell) + " fell more than the FLOPs"


def _speed_explanation(sp: Mapping[str, Any]) -> list[str]:
  """Where a speed-up's interval lies above ``1 / FLOP ratio`` (what the
  FLOPs alone predict): that speed-up beside the bytes-accessed and
  transcendentals ratios at the same batch size, and which of them fell
  more than the FLOPs."""
  beyond = []
  for e in sp["entries"]:
    for b, ci in (e.get("speedup_ci") or {}).items():
      flops = e.get("flop_ratio", {}).get(b)
      if ci is None or not md.finite(flops) or flops <= 0 or ci[0] <= 1 / flops:
        continue
      other = {"bytes accessed": e.get("bytes_accessed_ratio", {}).get(b),
               "transcendentals": e.get("transcendentals_ratio", {}).get(b)}
      beyond.append(
          f"{e['fraction']:.0%} removed at batch {b}: ×{e['speedup'][b]:.2f}"
          f" [{ci[0]:.2f}, {ci[1]:.2f}] against ×{1 / flops:.2f} from the "
          f"FLOP ratio {flops:.3f}; ratios of bytes accessed "
          f"{md.fmt(other['bytes accessed'])}, transcendentals "
          f"{md.fmt(other['transcendentals'])}: "
          + _cost_verdict(flops, other))
  if not beyond:
    return ["No speed-up's interval lies above 1 / FLOP ratio (the speed-up "
            "the FLOPs alone would give).", ""]
  return ["Speed-ups whose interval lies above 1 / FLOP ratio (the FLOPs "
          "alone would give less), beside the other costs XLA counts: "
          + "; ".join(beyond) + ".", ""]


def _rounds_text(results: Mapping[str, Any]) -> str:
  """How many timing rounds the speed table ran, in words."""
  sp = results["speed"]
  timing = sp.get("timing", {})
  if not timing.get("adaptive"):
    return (f"{timing.get('repeats', results['options']['speed_repeats'])} "
            "rounds")
  counts = [n for e in sp["entries"] for n in e.get("rounds", {}).values()]
  tight = [t for e in sp["entries"][1:] for t in e.get("tight", {}).values()]
  return (f"{min(counts)} to {max(counts)} rounds (adaptive: at least "
          f"{timing['repeats']}, and a cell stops once its speed-up's "
          f"interval is within {timing['target_width']:.0%} of it, or at "
          f"{timing['max_repeats']}; {sum(tight)} of {len(tight)} pruned "
          "cells met that)")


def _speed_interval_text(timing: Mapping[str, Any]) -> str:
  """"95% interval", or, where too few rounds ran for that, the coverage
  the interval has."""
  confidence, coverage = timing.get("confidence", 0.95), timing.get("coverage")
  if coverage is None or coverage >= confidence:
    return f"{confidence:.0%} interval"
  return (f"interval, over too few rounds for {confidence:.0%}: it covers the "
          f"median speed-up with probability {coverage:.0%} only")


def _speed_section(results: Mapping[str, Any]) -> list[str]:
  sp, labels = results["speed"], _labels(results)
  sizes = [str(b) for b in sp["batch_sizes"]]
  timing = sp.get("timing", {})
  lines = [
      "## Physical pruning and prediction speed", "",
      f"Heads removed by the `{labels.get(sp['order'], sp['order'])}` order "
      f"of seed {results['seeds'][0]['seed']}, sliced out of the parameters "
      "with `prune_heads`. Examples/s of the jitted prediction, the median "
      f"over {_rounds_text(results)}, on {results['jax']['backend']}; the "
      "speed-up with its " + _speed_interval_text(timing)
      + (f" ({timing['interval']})" if "interval" in timing else "") +
      ". FLOPs, bytes accessed and transcendentals from XLA's cost analysis "
      f"of the compiled program (ratios to the unpruned model at batch "
      f"{sizes[-1]}).", "",
  ]
  ratio = lambda e, key: (f"{e[key][sizes[-1]]:.3f}" if key in e else "n/a")
  header = (["removed", "heads per layer", "params", "FLOP ratio",
             "bytes ratio", "transcendentals ratio", "test token acc."] +
            [f"ex/s @ {b} (speed-up)" for b in sizes])
  rows = [[f"{e['fraction']:.0%} ({e['heads_removed']})",
           str(e["heads_per_layer"]), f"{e['params']:,}",
           ratio(e, "flop_ratio"), ratio(e, "bytes_accessed_ratio"),
           ratio(e, "transcendentals_ratio"),
           f"{e['test_token_accuracy']:.3f}"] +
          [_speedup_cell(e, b) for b in sizes] for e in sp["entries"]]
  lines += md.table(header, rows) + _speed_explanation(sp) + [
      md.image(results, "speed", "speed.png"), ""]
  diffs = [e["max_abs_logit_diff_pruned_vs_masked"] for e in sp["entries"]]
  return lines + [f"Pruned vs masked model, largest logit difference: "
                  f"{max(diffs):.2e}.", ""]


def _timings_section(results: Mapping[str, Any]) -> list[str]:
  keys = ("gradient_s", "leave_one_out_s", "confidence_s", "oracle_s",
          "best_ordering_s", "gradient_iterative_s", "validation_masks_s",
          "test_masks_s", "total_s", "over_training_s")
  rows = [[s["seed"]] + [md.fmt(s["timings"].get(k), 2) for k in keys]
          for s in results["seeds"]]
  tt = results["timings"]
  return ["## Timings (s)", ""] + md.table(
      ["seed", "gradient", "leave-one-out", "confidence", "oracle",
       "best ordering", "re-estimated", "masks (val.)", "masks (test)",
       "total", "over training (all seeds)"], rows) + [
      f"First seed with the speed table: {tt['first_seed_with_speed_s']:.1f} "
      f"s; the whole run: {tt['total_s']:.1f} s. The loop-vs-vmap comparison "
      "of leave-one-out is a benchmark: `python benchmarks/benchmark.py`.", ""]


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m mha.pruning.study.report DIR [--noplots]``: re-renders
  ``report.md`` and the plots of ``DIR/results.json`` in ``DIR``. A missing or unreadable
  ``results.json`` is one line on stderr and exit code 2."""
  parser = argparse.ArgumentParser(
      prog="python -m mha.pruning.study.report",
      description="Re-render report.md and the plots of a pruning study "
                  "from its results.json.")
  parser.add_argument("dir", help="The study's output folder.")
  parser.add_argument("--noplots", action="store_true",
                      help="Re-render report.md only; the figures already "
                      "there stay as they are.")
  args = parser.parse_args(argv)
  path = os.path.join(args.dir, "results.json")
  try:
    with open(path, encoding="utf-8") as f:
      results = json.load(f)
  except (OSError, ValueError) as e:
    print(f"report: error: cannot read {path}: "
          f"{getattr(e, 'strerror', None) or e}", file=sys.stderr)
    return 2
  missing = [key for key in STUDY_KEYS if key not in results] if isinstance(
      results, dict) else list(STUDY_KEYS)
  if missing:
    print(f"report: error: {path} is not a pruning study's results (it has "
          f"no {', '.join(missing)}); nothing written", file=sys.stderr)
    return 2
  try:
    written = write(upgrade(results), args.dir, figures=not args.noplots)
  except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
    print(f"report: error: {path} is incomplete or from another version "
          f"({type(e).__name__}: {e}); report.md left as it was",
          file=sys.stderr)
    return 2
  for written_path in written:
    print(written_path)
  return 0


if __name__ == "__main__":
  from mha.run import cli  # pylint: disable=import-outside-toplevel
  cli.end_quietly_on_broken_pipe()
  raise SystemExit(main())
