"""The report's sections and plots of learned gates, retraining after
pruning and mean ablation (:mod:`mha.pruning.study.extensions`), for
``report.md``.

:mod:`mha.pruning.study.report` calls :func:`write_plots`, :func:`gate_points`
and :func:`report_lines`; each returns nothing for a part that did not run.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from mha.pruning.study import markdown as md
from mha.pruning.study import plots as pruning_plots

MEAN_ABLATION_PNG = "curves_mean_ablation.png"
RETRAINING_PNG = "retraining.png"
#: How close to the oracle the gates should come (the issue's goal).
GOAL = 0.01
_RETRAIN_LABELS = {"gradient": "gradient", "oracle": "oracle",
                   "gates": "learned gates", "random": "random"}


# --------------------------------------------------------------------------
# Plots.
# --------------------------------------------------------------------------


def gate_points(results: Mapping[str, Any],
                variant: str = "all") -> dict[str, tuple] | None:
  """The gates' subsets (``variant``: ``all`` or ``no_layer_emptied``) as
  points of the token-accuracy curves: per strength, the mean fraction
  removed and test token accuracy over seeds with its interval."""
  rows = results.get("gates", {}).get(variant)
  if not rows:
    return None
  x = [r["fraction_removed"] for r in rows]
  y = [r["test_token_accuracy"] for r in rows]
  ci = np.asarray([r["test_token_accuracy_ci"] for r in rows], np.float64)
  return {"learned gates (one per λ)": (x, y, ci[:, 0], ci[:, 1])}


def write_plots(results: Mapping[str, Any], out_dir: str,
                curve_plot: Any) -> list[str]:
  """``curves_mean_ablation.png`` and ``retraining.png`` when they ran;
  ``curve_plot`` is the report's curve plotter (same styles and bands)."""
  paths = []
  runs = len(results["seeds"])
  if "mean_ablation" in results:
    group = results["mean_ablation"]
    paths.append(curve_plot(
        results, group, np.asarray(group["fractions"], np.float64),
        "token_accuracy", os.path.join(
            out_dir, md.figure(results, MEAN_ABLATION_PNG)),
        f"{results['task']}: test token accuracy, mean ablation, {runs} "
        f"seed{'s' * (runs > 1)}"))
  retraining = results.get("retraining")
  if retraining:
    fractions = retraining["fractions"]
    rows = {}
    for name, label in _RETRAIN_LABELS.items():
      by_fraction = retraining["orderings"].get(name)
      if not by_fraction:
        continue
      entries = [by_fraction[f"{f:g}"] for f in fractions]
      rows[label] = {
          stage: ([e[key] for e in entries], [e[f"{key}_ci"] for e in entries])
          for stage, key in (("before", "before"), ("after", "after"),
                             ("scratch", "from_scratch"),
                             ("scratch_e", "scratch_e"),
                             ("scratch_b", "scratch_b"), ("rewind", "rewind"))
          if all(key in e for e in entries)}
    paths.append(pruning_plots.plot_retraining(
        fractions, rows,
        os.path.join(out_dir, md.figure(results, RETRAINING_PNG)),
        steps=retraining["steps"],
        title=f"{results['task']}: retraining pruned models, {runs} "
        f"seed{'s' * (runs > 1)}"))
  return paths


# --------------------------------------------------------------------------
# report.md.
# --------------------------------------------------------------------------


def report_lines(results: Mapping[str, Any]) -> list[str]:
  """The sections of the parts that ran (none: no lines)."""
  lines = []
  if "gates" in results:
    lines += _gates_section(results)
  if "retraining" in results:
    lines += _retraining_section(results)
  if "mean_ablation" in results:
    lines += _mean_ablation_section(results)
  return lines


def _gate_verdict(rows: Sequence[Mapping[str, Any]]) -> str:
  """Whether every strength lands within :data:`GOAL` of the oracle."""
  gaps = [(r["lambda"], r["minus_oracle_token_accuracy"]) for r in rows
          if r.get("minus_oracle_token_accuracy") is not None
          and np.isfinite(r["minus_oracle_token_accuracy"])]
  if not gaps:
    return ("The oracle did not run (too many heads), so the gates are not "
            "compared with it.")
  misses = [(lam, gap) for lam, gap in gaps if gap < -GOAL]
  if not misses:
    return (f"At every strength the gates' subsets are within {GOAL:.0%} "
            "(1 point) of the oracle's test token accuracy with as many "
            f"heads removed (largest shortfall {min(g for _, g in gaps):+.3f}"
            ").")
  return ("The gates miss the oracle by more than 1 point at "
          + "; ".join(f"λ={lam:g} ({gap:+.3f})" for lam, gap in misses)
          + ". Why: the gates minimise the cross-entropy (under random "
          "gates, on the train split), the oracle maximises validation "
          "token accuracy. The last two columns split the gap: the subset "
          "of lowest validation loss with as many heads removed (what the "
          "gates' objective prefers) against the oracle's, and how often "
          "the gates found that subset (the rest of the gap is the gates "
          "stopping at a worse local optimum).")


_EXACT_K_METHODS = {
    "top_k": "Gumbel top-k (Li et al. 2021): every training step keeps "
             "exactly N - k heads, the gradient through a successive-softmax "
             "relaxation of the top-k (straight-through)",
    "lagrangian": "hard-concrete gates under an L0 Lagrangian on the "
                  "expected count kept (Wang et al. 2020), its multipliers "
                  "trained by gradient ascent"}


def _exact_k_lines(results: Mapping[str, Any]) -> list[str]:
  """The exact-K gates (``gates.exact_k``): the gates' main result."""
  g = results["gates"]
  rows = g.get("exact_k")
  if not rows:
    return []
  seconds = g["exact_k_train_seconds_per_seed"]
  method = g["exact_k_method"]
  summary = results["aggregate"]["curve_summary"].get(g["exact_k_curve"], {})
  lines = [
      "### Exact-K gates (the gates' main result)", "",
      f"One gate vector per number of heads removed k, trained for "
      f"{g['exact_k_steps']} steps on the train split with the model frozen "
      f"(all k in one vmapped program; {np.mean(seconds):.1f} s per seed, "
      f"compilation included): {_EXACT_K_METHODS.get(method, method)}. "
      "k's subset removes the k heads of lowest learned log α, so it "
      "removes exactly k heads by construction; it is the curve "
      f"'{results['curve_labels'][g['exact_k_curve']]}' of the pruning "
      "curves and the searches' table.", ""]
  targets = [r["target_k"] for r in rows]
  n = int(results["seeds"][0]["counts"][-1])
  if targets != list(range(1, n)):
    lines[-2] += (f" Trained for k = {', '.join(map(str, targets))} only "
                  "(`--gate_targets`): the curve's other points remove the "
                  "k heads of lowest log α of the nearest target.")
  if "auc_token_accuracy_minus_oracle" in summary:
    lines += [
        "- AUC of test token accuracy "
        + md.ci(summary, "auc_token_accuracy") + "; gap to the oracle "
        + md.ci(summary, "auc_token_accuracy_minus_oracle", sign=True)
        + " (95% interval over examples and seeds).", ""]
  table = [[r["target_k"], _heads(r["per_seed"][0]["removed"]),
            md.ci(r, "test_token_accuracy"),
            md.ci(r, "minus_oracle_token_accuracy", sign=True)]
           for r in rows]
  return lines + md.table(
      ["k (heads removed)", f"removed, seed {rows[0]['per_seed'][0]['seed']}",
       "test token acc.", "minus oracle (same k)"], table)


def _heads(removed: Sequence[Sequence[int]]) -> str:
  return ", ".join(f"{l}:{h}" for l, h in removed) or "-"


def _gates_section(results: Mapping[str, Any]) -> list[str]:
  g = results["gates"]
  seconds = g["train_seconds_per_seed"]
  lines = [
      "## Learned gates (hard-concrete, expected-L0 penalty)", "",
      *_exact_k_lines(results),
      *(["### A grid of penalty strengths (secondary)", ""]
        if "exact_k" in g else []),
      f"One gate per head (Voita et al. 2019), trained for {g['steps']} "
      f"steps on the {g['trained_on']}, for each penalty strength λ "
      f"({', '.join(f'{x:g}' for x in g['strengths'])}; all strengths in one "
      f"vmapped program). Cost: {np.mean(seconds):.1f} s per seed (mean "
      f"over {len(seconds)}; compilation included). A strength's subset is "
      "the heads whose test-time gate is above 0, evaluated as a head mask "
      "on test like every other subset; \"minus oracle\" is its test token "
      "accuracy minus that of the oracle's subset with as many heads "
      "removed (paired, mean over seeds). The stars on the token-accuracy "
      "curves are these subsets.", "",
      "- " + _gate_verdict(g["all"]), ""]
  for variant, title in (("all", "plain"),
                         ("no_layer_emptied", "never emptying a layer")):
    rows = [[f"{r['lambda']:g}", f"{r['heads_removed']:.1f}",
             ", ".join(str(s["heads_removed"]) for s in r["per_seed"]),
             md.ci(r, "test_token_accuracy"),
             md.ci(r, "minus_oracle_token_accuracy", sign=True),
             md.ci(r, "lowest_loss_minus_oracle_token_accuracy", sign=True),
             md.fmt(r.get("share_lowest_loss_subset"), 2)]
            for r in g[variant]]
    lines += [f"Gates, {title}:", ""] + md.table(
        ["λ", "heads removed (mean)", "per seed", "test token acc.",
         "minus oracle (same count)", "lowest-loss subset minus oracle",
         "share of seeds where the gates found the lowest-loss subset"],
        rows)
  return lines


def _matters(entries: Mapping[str, Mapping[str, Any]], key: str) -> str:
  """Which orderings' difference against random subsets (``key``) has an
  interval excluding 0."""
  out = []
  for name, e in entries.items():
    ci = e.get(f"{key}_ci")
    if ci is None or not all(c is not None and np.isfinite(c) for c in ci):
      continue
    # An interval inside (-0.0005, 0.0005) prints as +0.000 [+0.000, +0.000]:
    # the same accuracy to the 3 decimals shown, not "above" or "below".
    verdict = ("equal to 3 decimals to" if max(map(abs, ci)) < 5e-4 else
               "above" if ci[0] > 0 else "below" if ci[1] < 0 else
               "not distinguishable from")
    out.append(f"{_RETRAIN_LABELS.get(name, name)} {verdict} random "
               f"({md.ci(e, key, sign=True)})")
  return "; ".join(out) or "n/a"


def _versus(entries: Mapping[str, Mapping[str, Any]], key: str) -> str:
  """Each ordering's paired difference ``key`` with its interval."""
  return "; ".join(f"{_RETRAIN_LABELS.get(n, n)} {md.ci(e, key, sign=True)}"
                   for n, e in entries.items() if key in e) or "n/a"


def _arms_lines(r: Mapping[str, Any]) -> list[str]:
  """What each arm is (a ``results.json`` written before the fair controls
  has only the old one)."""
  arms = r.get("arms")
  if not arms:
    return [f"The control is {r['from_scratch']}.", ""]
  labels = {"fine_tuned": "Fine-tuned", "scratch_e": "Scratch-E",
            "scratch_b": "Scratch-B", "rewind": "Rewind"}
  return [f"The arms ({r['run_steps']} steps in the original run):", ""] + [
      f"- **{labels.get(k, k)}** (`{k}`): {v}." for k, v in arms.items()] + [
      f"- **From scratch, old control** (`from_scratch`): "
      f"{r['from_scratch']}.", ""]


def _retraining_section(results: Mapping[str, Any]) -> list[str]:
  r = results["retraining"]
  lines = [
      "## Retraining after pruning", "",
      f"At each fraction of heads removed, the subsets of the gradient "
      f"order, the oracle, the learned gates (the strength whose count is "
      f"nearest, its lowest gates) and {r['random_subsets']} random orders "
      f"are fine-tuned for {r['steps']} steps ({r['schedule']}). Test token "
      "accuracy, means over seeds with 95% intervals (random: the mean of "
      "its subsets). Cost: "
      f"{np.mean(r['train_seconds_per_seed']):.1f} s of training per seed "
      "(the models of one step count in one vmapped program)."
      + ("" if results.get("ablation", "zero") == "zero" else
         " The models are pruned (their heads removed, as zero ablation), "
         f"so \"before\" is not the study's {results['ablation']} "
         "ablation; the subsets are the study's."), ""]
  lines += _arms_lines(r)
  lines += [md.image(results, "retraining", RETRAINING_PNG), ""]
  fair = "arms" in r
  for fraction in r["fractions"]:
    entries = {name: by[f"{fraction:g}"] for name, by in
               r["orderings"].items() if f"{fraction:g}" in by}
    text = (
        f"- **{fraction:.0%} removed.** Does the choice of heads still "
        "matter after fine-tuning? " + _matters(entries, "after_minus_random")
        + ". Before fine-tuning: " + _matters(entries, "before_minus_random")
        + ". Accuracy that comes back: " + _versus(entries, "recovered"))
    if fair:
      text += (
          ". Do the kept weights beat training the architecture afresh? "
          "Fine-tuned − Scratch-E: " + _versus(
              entries, "fine_tuned_minus_scratch_e")
          + "; fine-tuned − Scratch-B (the same FLOPs): " + _versus(
              entries, "fine_tuned_minus_scratch_b")
          + ". Does the kept heads' initialisation matter? Rewind − "
          "Scratch-E: " + _versus(entries, "rewind_minus_scratch_e"))
    lines.append(text + ". Subsets that empty a layer: " + "; ".join(
        f"{_RETRAIN_LABELS.get(n, n)} "
        f"{md.fmt(e.get('share_emptying_a_layer'), 2)}"
        for n, e in entries.items()) + ".")
  lines.append("")
  cells = [(f, name, by[f]) for f in [f"{x:g}" for x in r["fractions"]]
           for name, by in r["orderings"].items() if f in by]
  if fair:
    lines += md.table(
        ["removed", "subset", "before", "fine-tuned", "Scratch-E",
         "Scratch-B (steps)", "rewind", "fine-tuned − Scratch-E",
         "fine-tuned − Scratch-B", "rewind − Scratch-E"],
        [[f"{float(f):.0%}", _RETRAIN_LABELS.get(name, name),
          md.ci(e, "before"), md.ci(e, "fine_tuned"), md.ci(e, "scratch_e"),
          f"{md.ci(e, 'scratch_b')} ({e.get('scratch_b_steps', 'n/a')})",
          md.ci(e, "rewind"),
          md.ci(e, "fine_tuned_minus_scratch_e", sign=True),
          md.ci(e, "fine_tuned_minus_scratch_b", sign=True),
          md.ci(e, "rewind_minus_scratch_e", sign=True)]
         for f, name, e in cells])
    lines += ["", "The old control and the comparison with random subsets:",
              ""]
  return lines + md.table(
      ["removed", "subset", "before", "after fine-tuning",
       "from scratch (old control)", "recovered", "after − scratch (old)",
       "after − random", "share of subsets emptying a layer"],
      [[f"{float(f):.0%}", _RETRAIN_LABELS.get(name, name),
        md.ci(e, "before"), md.ci(e, "after"), md.ci(e, "from_scratch"),
        md.ci(e, "recovered", sign=True),
        md.ci(e, "after_minus_from_scratch", sign=True),
        md.ci(e, "after_minus_random", sign=True),
        md.fmt(e.get("share_emptying_a_layer"), 2)]
       for f, name, e in cells])


def _mean_ablation_section(results: Mapping[str, Any]) -> list[str]:
  m = results["mean_ablation"]
  labels = dict(results.get("curve_labels") or results["orderings"])
  rows = [[label, md.ci(m["curve_summary"][k], "auc_token_accuracy"),
           md.ci(results["aggregate"]["curve_summary"][k],
               "auc_token_accuracy"),
           md.ci(m["curve_summary"][k], "auc_token_accuracy_mean_minus_zero",
               sign=True),
           md.ci(m["curve_summary"][k], "prunable_heads_token_accuracy", 1)]
          for k, label in labels.items()
          if k in m["curve_summary"] and k in
          results["aggregate"]["curve_summary"]]
  # The study's own ablation is the baseline (zero unless --ablation said
  # otherwise); results.json keeps its "mean_minus_zero" keys for it.
  base = results.get("ablation", "zero")
  return [
      "## Mean ablation", "",
      f"The same curves with mean ablation instead of the study's {base} "
      f"ablation: {m['ablation']}; the oracle is chosen again on validation "
      "under mean ablation. A "
      "mean-ablated model is still an ordinary smaller model "
      "(`mean_ablation.prune_mean_ablated`).", "",
      md.image(results, "mean ablation", MEAN_ABLATION_PNG), ""] + md.table(
      ["curve", "AUC, mean ablation", f"AUC, {base} ablation",
       f"mean − {base} (paired)", "prunable heads (val.), mean ablation"],
      rows)


__all__ = ["MEAN_ABLATION_PNG", "RETRAINING_PNG", "gate_points",
           "write_plots", "report_lines"]
