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
