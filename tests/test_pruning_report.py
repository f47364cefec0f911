"""Tests of report.md's claims (mha.pruning.report): a claim only where its
interval carries it."""

from mha.pruning import report


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
  # The closest ordering's gap contains 0: no claim that it differs.
  closest = next(l for l in lines.splitlines() if "closest" in l)
  assert "good" in closest and "not distinguishable from the oracle" in closest
  assert "raises the AUC (same points) of: good" in lines
  assert "lowers the AUC (same points) of: bad" in lines
