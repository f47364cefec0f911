"""Tests of report.md's claims (mha.pruning.study.report): a claim only where its
interval carries it."""

from mha.pruning.study import report


def _entry(auc, diff_random, diff_oracle, change=(0.0, -0.01, 0.01)):
  value, low, high = diff_random
  return {
      "auc_token_accuracy": auc, "auc_token_accuracy_ci": [auc - .01,
                                                           auc + .01],
      "auc_token_accuracy_minus_random": value,
      "auc_token_accuracy_minus_random_ci": [low, high],
      "auc_token_accuracy_minus_oracle": diff_oracle[0],
      "auc_token_accuracy_minus_oracle_ci": list(diff_oracle[1:]),
      "prunable_heads_token_accuracy": 1.0,
      "prunable_heads_token_accuracy_ci": [0.0, 2.0],
      "auc_token_accuracy_change": change[0],
      "auc_token_accuracy_change_ci": list(change[1:]),
  }


def test_findings_claim_only_what_the_intervals_carry():
  summary = {
      "good": _entry(0.6, (0.1, 0.05, 0.15), (-0.02, -0.05, 0.01),
                     change=(0.05, 0.01, 0.09)),
      "unclear": _entry(0.5, (0.01, -0.02, 0.04), (-0.1, -0.2, -0.05)),
      "bad": _entry(0.3, (-0.2, -0.25, -0.15), (-0.3, -0.35, -0.25),
                    change=(-0.05, -0.09, -0.01)),
      "random": _entry(0.4, (0.0, 0.0, 0.0), (-0.2, -0.25, -0.15)),
      "oracle": _entry(0.62, (0.2, 0.15, 0.25), (0.0, 0.0, 0.0)),
  }
  results = {
      "curve_labels": {k: k for k in summary},
      "aggregate": {"curve_summary": summary,
                    "no_layer_emptied": {"curve_summary": summary}},
      "seeds": [{}],
  }
  lines = "\n".join(report._findings_section(results))
  beat = next(l for l in lines.splitlines() if "beat random" in l)
  assert "good" in beat and "unclear" not in beat and "bad" not in beat
  assert "unclear +0.010 [-0.020, +0.040]" in next(
      l for l in lines.splitlines() if "not distinguishable" in l)
  assert "bad" in next(l for l in lines.splitlines() if "worse than" in l)
  # Every ordering whose gap to the oracle contains 0 is named, no other.
  close = next(l for l in lines.splitlines() if "oracle's AUC" in l)
  assert "not distinguishable from it" in close and "good -0.020" in close
  assert "unclear" not in close and "bad" not in close
  # When every gap excludes 0, the closest is named by point estimate.
  summary["good"] = _entry(0.6, (0.1, 0.05, 0.15), (-0.02, -0.03, -0.01))
  close = next(l for l in report._findings_section(results)
               if "oracle's AUC" in l)
  assert "closest by point estimate is good, -0.020" in close
  summary["good"] = _entry(0.6, (0.1, 0.05, 0.15), (-0.02, -0.05, 0.01),
                           change=(0.05, 0.01, 0.09))
  assert "raises the AUC (same points) of: good" in lines
  assert "lowers the AUC (same points) of: bad" in lines


def test_speed_beyond_the_flop_ratio_is_shown_with_the_other_costs():
  entry = {"fraction": 0.5, "flop_ratio": {"4": 0.8},
           "bytes_accessed_ratio": {"4": 0.6},
           "transcendentals_ratio": {"4": 0.5}, "speedup": {"4": 1.6},
           "speedup_ci": {"4": [1.4, 1.8]}}
  line = report._speed_explanation({"entries": [entry]})[0]
  # 1 / 0.8 = 1.25 < 1.4: beyond what the FLOPs give.
  assert "batch 4: ×1.60 [1.40, 1.80] against ×1.25" in line
  assert "ratios of bytes accessed 0.600, transcendentals 0.500" in line
  assert "bytes accessed and transcendentals fell more than the FLOPs" in line
  entry["bytes_accessed_ratio"] = {"4": 0.9}
  entry["transcendentals_ratio"] = {"4": 0.85}
  assert "XLA's counts do not explain it" in report._speed_explanation(
      {"entries": [entry]})[0]
  entry["speedup_ci"] = {"4": [1.1, 1.8]}  # contains 1.25: no claim
  assert report._speed_explanation(
      {"entries": [entry]})[0].startswith("No speed-up's interval")


def test_family_claims_use_the_simultaneous_intervals():
  # "good"'s marginal intervals exclude 0 against random and the oracle;
  # its simultaneous ones (over each family) contain 0: no claim of either.
  summary = {
      "good": _entry(0.6, (0.1, 0.05, 0.15), (-0.02, -0.03, -0.01)),
      "random": _entry(0.4, (0.0, 0.0, 0.0), (-0.2, -0.25, -0.15)),
      "oracle": _entry(0.62, (0.2, 0.15, 0.25), (0.0, 0.0, 0.0)),
  }
  summary["good"]["auc_token_accuracy_minus_random_simultaneous_ci"] = [
      -0.01, 0.21]
  summary["good"]["auc_token_accuracy_minus_oracle_simultaneous_ci"] = [
      -0.04, 0.005]
  results = {"curve_labels": {k: k for k in summary},
             "aggregate": {"curve_summary": summary,
                           "no_layer_emptied": {"curve_summary": summary}},
             "seeds": [{}]}
  lines = report._findings_section(results)
  line = next(l for l in lines if "not distinguishable from random" in l)
  assert "good +0.100 [-0.010, +0.210]" in line and "simultaneous" in line
  close = next(l for l in lines if "oracle's AUC" in l)
  assert "good -0.020 [-0.040, +0.005]" in close
  assert "simultaneous interval of the AUC gap contains 0" in close


def test_an_undefined_spearman_correlation_is_explained():
  def results(rho):
    return {"options": {"plots": False}, "aggregate": {"spearman": {
        "gradient_vs_leave_one_out": {"rho": rho, "ci": [rho, rho], "p": 0.5,
                                      "per_seed": [rho]}}}}
  note = "n/a: undefined, where one side scores every head the same"
  lines = "\n".join(report._spearman_section(results(None)))
  assert "| n/a [n/a, n/a] |" in lines and note in lines
  assert note not in "\n".join(report._spearman_section(results(0.5)))


def _lead_results(names, searches=()):
  summary = {k: {"auc_token_accuracy": auc} for k, auc in names.items()}
  return {"curve_labels": {k: k for k in names},
          "aggregate": {"curve_summary": summary,
                        "curves": {k: {} for k in names}},
          "seeds": [{"searches": {k: [] for k in searches}}]}


def test_the_lead_figure_draws_at_most_seven_curves():
  names = {"oracle": 0.9, "best_ordering": 0.88, "beam": 0.89,
           "surrogate": 0.895, "oracle_kwon_tuned": 0.95, "kwon": 0.6,
           "gradient": 0.7, "shapley": 0.8, "entropy": 0.3, "fisher": 0.75,
           "reverse_gradient": 0.2, "random": 0.4}
  results = _lead_results(names, ("beam", "surrogate", "kwon",
                                  "oracle_kwon_tuned"))
  # The best search (the tuned oracle is a ceiling, not a search), the
  # three best orderings by AUC, the references.
  assert report.lead_curves(results) == [
      "oracle", "best_ordering", "surrogate", "shapley", "fisher",
      "gradient", "random"]
  del names["best_ordering"]  # Results without it: skipped.
  assert report.lead_curves(_lead_results(names, ("beam", "surrogate")))[
      :3] == [
      "oracle", "surrogate", "shapley"]


def test_tuning_table_gives_the_paired_difference_and_the_rejections():
  entry = lambda auc: {"auc_token_accuracy": auc,
                       "auc_token_accuracy_ci": [auc - .01, auc + .01]}
  tuned = dict(entry(0.66), auc_token_accuracy_minus_untuned=0.014,
               auc_token_accuracy_minus_untuned_ci=[0.004, 0.024])
  results = {"curve_labels": {"kwon": "Kwon", "kwon_tuned": "Kwon tuned"},
             "aggregate": {"curve_summary": {"kwon": entry(0.649),
                                             "kwon_tuned": tuned}},
             "seeds": [{"searches": {"kwon_tuned": [
                 {"rejected_layer": None}, {"rejected_layer": 2}]}}]}
  row = next(l for l in report._tuning_section(results)
             if l.startswith("| Kwon tuned"))
  assert "+0.014 [+0.004, +0.024]" in row and "1 of 2" in row


def test_an_older_results_json_reads_under_todays_names():
  old = {"curve_labels": {"kwon": "K", "kwon_tuned": "Kwon et al., mask tuned"},
         "seeds": [{"searches": {"kwon": [], "kwon_tuned": []},
                    "timings": {"kwon_tuned_s": 1.0}}],
         "aggregate": {"curve_summary": {"kwon_tuned": {"auc": 0.6}}}}
  new = report.upgrade(old)
  assert new["curve_labels"] == {
      "kwon": "K",
      "kwon_tuned_attention_output":
          "Kwon et al., mask tuned (attention output)"}
  assert new["seeds"][0]["timings"] == {"kwon_tuned_attention_output_s": 1.0}
  assert "kwon_tuned_attention_output" in new["aggregate"]["curve_summary"]
  # Today's results (both names) come back as they are.
  assert report.upgrade(new) is new
  today = dict(old, seeds=[{"searches": {"kwon_tuned": [],
                                         "kwon_tuned_attention_output": []}}])
  assert report.upgrade(today) is today
