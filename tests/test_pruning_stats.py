"""Tests of the study's statistics (mha.pruning.stats, mha.pruning.study.summary)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from mha.pruning import stats
from mha.pruning.study import summary
from scripts import interval_coverage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sums(correct, tokens):
  n = len(tokens)
  return {"correct": correct, "tokens": tokens, "loss_sum": np.zeros(n),
          "exact": np.zeros(n), "sequences": np.ones(n)}


def _coverage(num_seeds, trials, *, n=100, resamples=400, seed_sd=0.03):
  """How often the two-level interval of token accuracy covers the truth.

  Each example has 1-16 tokens, each right with probability 0.5 +- 0.2 (the
  sign drawn per example, so the population's token accuracy is 0.5) plus a
  seed effect N(0, seed_sd) shared by the seed's examples; the seeds share
  their examples, as the study's seeds share the test set.
  """
  rng = np.random.default_rng(num_seeds)
  hits = 0
  for _ in range(trials):
    tokens = rng.integers(1, 17, n)
    delta = rng.choice([-0.2, 0.2], n)
    effects = seed_sd * rng.standard_normal(num_seeds)
    if num_seeds == 1:
      effects[:] = 0.0
    example_w = stats.example_weights(n, resamples, rng)
    per_seed = [stats.resampled_metrics(
        _sums(rng.binomial(tokens, np.clip(0.5 + delta + e, 0, 1)), tokens),
        example_w)["token_accuracy"] for e in effects]
    low, high = stats.interval(stats.two_level(
        np.stack(per_seed), stats.seed_weights(num_seeds, resamples, rng)))
    hits += low <= 0.5 <= high
  return hits / trials


@pytest.mark.parametrize("num_seeds", [1, 5])
def test_bootstrap_intervals_cover_the_truth_at_the_nominal_rate(num_seeds):
  # 300 trials: the coverage's standard error at 95% is 1.3 points; the
  # bounds are ~3.5 of them (a fixed seed, so deterministic). With 5 seeds
  # the seed effect here is small next to the example noise; when seeds
  # dominate, 5 seeds undercover (about 0.89 measured at seed_sd=0.1), as
  # any percentile bootstrap over 5 units does.
  assert 0.90 <= _coverage(num_seeds, 300) <= 0.995


def test_one_level_matches_scipy_percentile_bootstrap():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 17, 300)
  correct = rng.binomial(tokens, 0.7)
  ours = stats.interval(stats.resampled_metrics(
      _sums(correct, tokens), stats.example_weights(300, 4000, rng))[
          "token_accuracy"])
  ratio = lambda c, t, axis=-1: np.sum(c, axis) / np.sum(t, axis)
  theirs = scipy_stats.bootstrap(
      (correct, tokens), ratio, paired=True, vectorized=True,
      n_resamples=4000, method="percentile", random_state=1
  ).confidence_interval
  # Two Monte Carlo estimates of the same percentiles: within 0.004 (about
  # a tenth of the interval's width).
  np.testing.assert_allclose(ours, [theirs.low, theirs.high], atol=0.004)


def test_resampled_metrics_reweight_examples():
  tokens = np.array([2, 4])
  correct = np.array([[2, 0], [1, 4]])  # two masks
  weights = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
  acc = stats.resampled_metrics(
      {"correct": correct, "tokens": np.broadcast_to(tokens, (2, 2)),
       "loss_sum": np.zeros((2, 2)), "exact": np.zeros((2, 2)),
       "sequences": np.ones((2, 2))}, weights)["token_accuracy"]
  np.testing.assert_allclose(acc, [[2 / 6, 5 / 6], [1.0, 0.5], [0.0, 1.0]])


def test_benjamini_hochberg_by_hand():
  p = np.array([0.01, 0.04, 0.03, 0.20, np.nan])
  # Sorted 0.01, 0.03, 0.04, 0.20 (m = 4): p * m / rank = 0.04, 0.06, 0.0533,
  # 0.20, then the running minimum from the top.
  np.testing.assert_allclose(stats.benjamini_hochberg(p),
                             [0.04, 0.0533333, 0.0533333, 0.2, np.nan],
                             rtol=1e-5)
  assert stats.paired_ttest_pvalues(np.ones(5), np.ones((1, 5)))[0] == 1.0


def test_fisher_mean_of_spearman():
  same = [{"rho": 0.5, "p": 0.2, "n": 8}] * 3
  out = stats.fisher_mean(same)
  # Worked by hand: z = atanh(0.5) = 0.54931; se = sqrt(1.06 / (3 x 5)) =
  # 0.26583; 95%: tanh(z -+ 1.95996 se) = 0.02828, 0.78958; p = 2 x
  # sf(z / se = 2.0664) = 0.0388. Tolerance: the 4-5 digits written here.
  assert out["rho"] == pytest.approx(0.5)
  assert out["ci"] == pytest.approx([0.02828, 0.78958], abs=5e-5)
  assert out["p"] == pytest.approx(0.0388, abs=5e-5)
  # Pooling three seeds gives more evidence than one.
  assert out["p"] < stats.fisher_mean(same[:1])["p"]
  nan = stats.fisher_mean([{"rho": float("nan"), "p": float("nan"), "n": 8}])
  assert np.isnan(nan["rho"])
  # NaN comes back from results.json as None (a 2-head model's seeds: a
  # constant side); the report re-rendered from it crashed on float(None).
  from_json = stats.fisher_mean([{"rho": None, "p": None, "n": 2}, same[0]])
  assert np.isnan(from_json["per_seed"][0])
  assert np.isnan(from_json["per_seed_p"][0])
  assert from_json["rho"] == pytest.approx(0.5)


def test_fisher_mean_with_a_perfect_seed():
  # rho = 1 has an infinite z: it counts as 1 - 6 / (n (n^2 - 1)), half an
  # adjacent swap short of perfect (8 heads: 1 - 6/504), not as whatever a
  # numerical cap would make it.
  perfect = {"rho": 1.0, "p": 0.0, "n": 8}
  assert stats.fisher_mean([perfect])["rho"] == pytest.approx(1 - 6 / 504)
  z = (np.arctanh(1 - 6 / 504) + 2 * np.arctanh(0.5)) / 3
  mixed = stats.fisher_mean([perfect] + [{"rho": 0.5, "p": 0.2, "n": 8}] * 2)
  assert mixed["rho"] == pytest.approx(np.tanh(z))
  assert stats.fisher_mean([dict(perfect, rho=-1.0)])["rho"] == pytest.approx(
      -(1 - 6 / 504))
  # With ties a rho below 1 can lie above that bound (4 heads: 0.9); it is
  # kept as it is (it was cut to 0.9).
  assert stats.fisher_mean([{"rho": 0.95, "p": 0.05, "n": 4}])["rho"] == (
      pytest.approx(0.95))


def test_seed_statistics_of_a_known_curve():
  # One mask per point: accuracies 1, 0.5, 0 on both splits (2 examples of
  # one token each), so the AUC over fractions 0, 0.5, 1 is 0.5.
  correct = np.array([[1, 1], [1, 0], [0, 0]])
  sums = {"correct": correct, "tokens": np.ones((3, 2)),
          "loss_sum": np.zeros((3, 2)), "exact": correct,
          "sequences": np.ones((3, 2))}
  ids = {"all": {"a": np.array([[0, 1, 2]]), "oracle": np.array([[0, 0, 2]])}}
  counts = {"all": np.array([0, 1, 2])}
  weights = np.ones((4, 2))
  out = summary.seed_statistics(ids, counts, 2, sums, sums, weights, weights,
                                tolerance=0.01)
  assert out[("all", "a", "auc_token_accuracy")][0] == pytest.approx(0.5)
  assert out[("all", "oracle", "auc_token_accuracy")][0] == pytest.approx(
      0.75)
  assert out[("all", "a", "auc_token_accuracy_minus_oracle")][0] == (
      pytest.approx(-0.25))
  # Prunable on validation: a drops at once (0 heads), the oracle keeps its
  # accuracy for one head; its test accuracy there is 1.
  assert out[("all", "a", "prunable_heads_token_accuracy")][0] == 0
  assert out[("all", "oracle", "prunable_heads_token_accuracy")][0] == 1
  assert out[("all", "oracle", "test_token_accuracy_at_prunable")][0] == 1
  nested = summary.seed_summary(out)["all"]
  assert nested["curve_summary"]["a"]["auc_token_accuracy_ci"].shape == (2,)


def test_the_level_prunable_by_loss_counts_bits():
  # Losses (nats per token) of masks 0..3: the unpruned one, +0.04 bits,
  # +0.06 bits, +0.01 bits. Within 0.05 bits, curve a (0, 1, 2, 3) keeps 1
  # head removed (the third point is out, so the fourth does not count).
  bits = np.array([0.0, 0.04, 0.06, 0.01])
  loss = np.log(2.0) * (1.0 + bits)
  sums = {"correct": np.ones((4, 2)), "tokens": np.ones((4, 2)),
          "loss_sum": np.repeat(loss[:, None], 2, axis=1),
          "exact": np.ones((4, 2)), "sequences": np.ones((4, 2))}
  ids = {"all": {"a": np.array([[0, 1, 2, 3]]),
                 "oracle_by_loss": np.array([[0, 3, 1, 2]])}}
  weights = np.ones((3, 2))
  out = summary.seed_statistics(
      ids, {"all": np.array([0, 1, 2, 3])}, 3, sums, sums, weights, weights,
      tolerance=0.01, select={"oracle_by_loss": "loss"},
      loss_tolerance_bits=0.05)
  assert out[("all", "a", "prunable_heads_loss")][0] == 1
  assert out[("all", "a", "test_bits_at_prunable_loss")][0] == (
      pytest.approx(1.04))
  assert out[("all", "oracle_by_loss", "prunable_heads_loss")][0] == 2
  assert out[("all", "a", "prunable_heads_loss_minus_oracle_by_loss")][0] == -1
  stricter = summary.seed_statistics(
      ids, {"all": np.array([0, 1, 2, 3])}, 3, sums, sums, weights, weights,
      tolerance=0.01, loss_tolerance_bits=0.02)
  assert stricter[("all", "a", "prunable_heads_loss")][0] == 0


def test_tuned_minus_untuned_is_paired_in_every_replicate():
  # Kwon et al.'s subsets untuned (masks 0, 1, 2) and tuned (0, 3, 2): the
  # tuned mask 3 is right on example 0 only, mask 1 on neither. Replicate 1
  # draws example 0 twice, replicate 2 example 1 twice.
  correct = np.array([[1, 1], [0, 0], [0, 0], [1, 0]])
  sums = {"correct": correct, "tokens": np.ones((4, 2)),
          "loss_sum": np.zeros((4, 2)), "exact": correct,
          "sequences": np.ones((4, 2))}
  curves = {"all": {"kwon": np.array([[0, 1, 2]]),
                    "kwon_tuned": np.array([[0, 3, 2]])}}
  weights = np.array([[2.0, 0.0], [0.0, 2.0]])
  out = summary.seed_statistics(curves, {"all": np.array([0, 1, 2])}, 2,
                                sums, sums, weights, weights, tolerance=0.01)
  diff = out[("all", "kwon_tuned", "curve_token_accuracy_minus_untuned")]
  np.testing.assert_array_equal(diff[:, 1], [0.5, 1.0, 0.0])
  # The AUC over fractions 0, 0.5, 1: the middle point weighs a half.
  np.testing.assert_allclose(
      out[("all", "kwon_tuned", "auc_token_accuracy_minus_untuned")],
      [0.25, 0.5, 0.0])
  assert ("all", "kwon", "auc_token_accuracy_minus_untuned") not in out


def test_half_split_level_is_chosen_on_one_half_and_checked_on_the_other():
  # Four validation examples: the first half (0, 1) and the second (2, 3).
  # Mask 1 (one head removed) is right on the whole first half and wrong on
  # example 2; mask 2 (two removed) is wrong everywhere. Test: mask 1 right
  # on 3 of 4 examples.
  val = {"correct": np.array([[1, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0]]),
         "tokens": np.ones((3, 4)), "loss_sum": np.zeros((3, 4)),
         "exact": np.zeros((3, 4)), "sequences": np.ones((3, 4))}
  test = dict(val, correct=np.array([[1, 1, 1, 1], [1, 1, 1, 0],
                                     [0, 0, 0, 0]]))
  curves = {"all": {"a": np.array([[0, 1, 2]])}}
  weights = np.ones((3, 4))
  out = summary.seed_statistics(curves, {"all": np.array([0, 1, 2])}, 2, val,
                                test, weights, weights, tolerance=0.01)
  get = lambda stat: out[("all", "a", stat)][0]
  # On the whole of validation, one head removed loses 0.25: not prunable.
  assert get("prunable_heads_token_accuracy") == 0
  # On the first half it loses nothing: one head chosen there; the second
  # half loses 0.5 there, so the level does not hold; test reads 0.75.
  assert get("prunable_heads_token_accuracy_half_split") == 1
  assert get("half_split_holds_token_accuracy") == 0
  assert get("half_split_second_half_loss_token_accuracy") == (
      pytest.approx(0.5))
  assert get("test_token_accuracy_at_prunable_half_split") == (
      pytest.approx(0.75))


def test_oracle_is_chosen_again_in_each_replicate():
  # Mask 0 keeps everything; candidates A (mask 1) and B (mask 2) for one
  # head removed. A is right on validation example 0, B on example 1; on
  # test A is right on both, B on neither.
  val = {"correct": np.array([[1, 1], [1, 0], [0, 1]]),
         "tokens": np.ones((3, 2)), "loss_sum": np.zeros((3, 2)),
         "exact": np.zeros((3, 2)), "sequences": np.ones((3, 2))}
  test = dict(val, correct=np.array([[1, 1], [1, 1], [0, 0]]))
  curves = {"all": {"oracle": np.array([[0, 1], [0, 2]])}}
  weights = np.array([[2.0, 0.0], [0.0, 2.0]])  # example 0 twice; 1 twice
  out = summary.seed_statistics(curves, {"all": np.array([0, 1])}, 2, val,
                                test, weights, weights, tolerance=0.01)
  # Full sample: a tie on validation, the first candidate (A) kept; then A
  # where example 0 is drawn, B where example 1 is.
  np.testing.assert_array_equal(
      out[("all", "oracle", "curve_token_accuracy")][:, 1], [1.0, 1.0, 0.0])


def test_a_reestimated_ordering_uses_each_replicates_own_masks():
  # Masks 0 (full), 1 and 2 (one head removed each): on test, mask 1 is
  # right on both examples, mask 2 on neither. The ordering's point 1 is
  # mask 1 in the full sample and replicate 1, mask 2 in replicate 2.
  val = {"correct": np.array([[1, 1], [1, 1], [0, 0]]),
         "tokens": np.ones((3, 2)), "loss_sum": np.zeros((3, 2)),
         "exact": np.zeros((3, 2)), "sequences": np.ones((3, 2))}
  ids = np.array([[0, 1], [0, 1], [0, 2]])[:, None]  # [1 + R, 1, P]
  out = summary.seed_statistics({"all": {"a": ids}}, {"all": np.array([0, 1])},
                                2, val, val, np.ones((2, 2)), np.ones((2, 2)),
                                tolerance=0.01)
  np.testing.assert_array_equal(
      out[("all", "a", "curve_token_accuracy")][:, 1], [1.0, 1.0, 0.0])


def test_seed_t_interval_covers_where_the_seed_percentile_one_does_not():
  # Seeds dominate (seed variance 100 x the examples'), 3 seeds: the
  # percentile bootstrap over seeds covers about 0.77 (normal theory and
  # scripts/interval_coverage.py), the seed-t interval about 0.95. 200
  # simulated studies of 60 examples and 200 resamples each (fixed seed, so
  # deterministic): the coverage's standard error is about 1.5 points at
  # 0.95 and 3 at 0.77; the bounds leave 3 of them.
  rng = np.random.default_rng(0)
  sd = interval_coverage.example_sd(60, 200, rng)
  found = interval_coverage.coverage(3, 100.0, 200, examples=60,
                                     resamples=200, sd_examples=sd, rng=rng)
  old, new = found["percentile"]["coverage"], found["seed_t"]["coverage"]
  assert new >= 0.90 and new - old >= 0.10, (old, new)
  low, high = found["seed_t"]["coverage_ci"]
  assert low < new < high


def test_seed_t_term_is_a_student_t():
  # No example variation (every replicate equals the full sample): the
  # interval is mean +- t(S - 1) s / sqrt(S). 3 seeds, t(2)'s 97.5% point
  # 4.303; 40000 replicates put the percentile within 2% of it.
  values = np.array([0.1, 0.4, 0.3])
  per_seed = np.repeat(values[:, None], 40001, axis=1)
  seed_t = stats.seed_t_weights(3, 40000, np.random.default_rng(0))
  low, high = stats.seed_interval(per_seed, seed_t)
  half = scipy_stats.t.ppf(0.975, 2) * values.std(ddof=1) / np.sqrt(3)
  assert (high - low) / 2 == pytest.approx(half, rel=0.02)
  assert (low + high) / 2 == pytest.approx(values.mean(), abs=0.02 * half)


def test_one_seed_interval_is_the_example_percentile_interval():
  rng = np.random.default_rng(0)
  key = ("all", "a", "auc_token_accuracy")
  one = {key: rng.normal(size=501)}
  nested = summary.aggregate_statistics(
      [one], stats.seed_t_weights(1, 500, rng))
  np.testing.assert_array_equal(
      nested["all"]["curve_summary"]["a"]["auc_token_accuracy_ci"],
      summary.seed_summary(one)["all"]["curve_summary"]["a"][
          "auc_token_accuracy_ci"])
  assert stats.interval_method(1) == "example_bootstrap_percentile"
  assert stats.interval_method(2) == "seed_t_plus_example_bootstrap"


def test_simultaneous_intervals_of_independent_members():
  # 10 independent standard normal members: the max-t critical value is the
  # 0.95 quantile of the largest of 10 |z|, Sidak's z(1 - 0.05 / 20) =
  # 2.80, i.e. 2.80 / 1.96 = 1.43 marginal half-widths; 20000 replicates
  # give it within 3%. One member: c is about 1.
  rng = np.random.default_rng(0)
  reps = rng.standard_normal((20000, 10))
  intervals, c = stats.simultaneous_intervals(np.zeros(10), reps)
  sidak = scipy_stats.norm.ppf(1 - 0.05 / 20) / scipy_stats.norm.ppf(0.975)
  assert c == pytest.approx(sidak, rel=0.03)
  marginal = stats.interval(reps)
  assert np.all(intervals[:, 0] <= marginal[:, 0])
  assert np.all(intervals[:, 1] >= marginal[:, 1])
  _, c1 = stats.simultaneous_intervals(np.zeros(1), reps[:, :1])
  assert c1 == pytest.approx(1.0, abs=0.03)
  nan = np.where(np.arange(10) == 3, np.nan, 0.0)
  intervals, _ = stats.simultaneous_intervals(nan, reps)
  assert np.isnan(intervals[3]).all() and np.isfinite(intervals[4]).all()


def test_aggregate_adds_simultaneous_intervals_beside_the_marginal_ones():
  rng = np.random.default_rng(0)
  names = ("a", "b", "c")
  per_seed = []
  for _ in range(3):
    seed = {}
    for name in names:
      seed[("all", name, "auc_token_accuracy_minus_oracle")] = (
          rng.normal(size=301))
    per_seed.append(seed)
  nested = summary.aggregate_statistics(
      per_seed, stats.seed_t_weights(3, 300, rng))["all"]
  family = nested["simultaneous_critical_values"][
      "auc_token_accuracy_minus_oracle"]
  assert family["members"] == 3 and family["c"] > 1.0
  for name in names:
    entry = nested["curve_summary"][name]
    low, high = entry["auc_token_accuracy_minus_oracle_ci"]
    s_low, s_high = entry["auc_token_accuracy_minus_oracle_simultaneous_ci"]
    assert s_low <= low and high <= s_high


def test_interval_coverage_script_refuses_bad_flags_in_one_line(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "interval_coverage.py"),
       "--seeds=1"], cwd=tmp_path, capture_output=True, text=True,
      timeout=60, check=False)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr
  assert lines[0].startswith("interval_coverage.py: error: ")
  assert "seeds" in lines[0]
  assert os.listdir(tmp_path) == []


def test_intervals_stay_where_the_statistic_can_be():
  # Two seeds, one prunable head in one and none in the other: the seed-level
  # t term (1 degree of freedom) reaches below 0 heads and above an accuracy
  # of 1; the intervals are cut to the statistic's range, the values kept.
  rng = np.random.default_rng(0)
  weights = stats.seed_t_weights(2, 200, rng)
  per_seed = [{("all", "oracle", "prunable_heads_token_accuracy"):
               np.full(201, float(k)),
               ("all", "oracle", "auc_token_accuracy"): np.full(201, 0.99 - k),
               ("all", "oracle", "auc_token_accuracy_minus_random"):
               np.full(201, 0.5 - k)} for k in (0, 1)]
  entry = summary.aggregate_statistics(per_seed, weights)["all"][
      "curve_summary"]["oracle"]
  low, high = entry["prunable_heads_token_accuracy_ci"]
  assert low == 0.0 and high > 1.0
  assert entry["prunable_heads_token_accuracy"] == 0.5
  low, high = entry["auc_token_accuracy_ci"]
  assert low == 0.0 and high == 1.0  # -0.01 and 0.99 spread over t(1)
  low, high = entry["auc_token_accuracy_minus_random_ci"]
  assert low < -1.0  # a difference may be negative: not cut


def test_loss_oracle_accuracy_at_fractions_and_the_gap_s_two_parts():
  # Masks: 0 full; 1 and 2 one head removed; 3 two removed; 4 (four
  # removed: every head). Mask 1 has the best accuracy and mask 2 the
  # lowest loss; one example of one token each on both splits.
  correct = np.array([[1, 1], [1, 1], [1, 0], [0, 1], [0, 0]])
  loss = np.array([[0.1, 0.1], [0.9, 0.9], [0.2, 0.2], [1.0, 1.0],
                   [2.0, 2.0]])
  sums = {"correct": correct, "tokens": np.ones((5, 2)), "loss_sum": loss,
          "exact": correct, "sequences": np.ones((5, 2))}
  counts = {"all": np.array([0, 1, 2, 4])}  # points at 0, 25, 50, 100%
  curves = {"all": {
      "oracle": np.array([[0, 1, 3, 4], [0, 2, 3, 4]]),
      "oracle_by_loss": np.array([[0, 2, 3, 4], [0, 1, 3, 4]]),
      "best_ordering": np.array([[0, 2, 3, 4]]),
      "a": np.array([[0, 2, 4, 4]])}}
  weights = np.ones((3, 2))
  out = summary.seed_statistics(
      curves, counts, 4, sums, sums, weights, weights, tolerance=0.01,
      select={"oracle": "token_accuracy", "oracle_by_loss": "loss"})
  get = lambda name, stat: out[("all", name, stat)][0]
  # The loss oracle keeps its lowest-loss candidate (mask 2) at 25%.
  assert get("oracle_by_loss", "test_token_accuracy_at_25pct_removed") == 0.5
  assert get("oracle", "test_token_accuracy_at_25pct_removed") == 1.0
  assert get("oracle", "test_token_accuracy_at_50pct_removed") == 0.5
  assert get("a", "test_token_accuracy_at_50pct_removed") == 0.0
  # Loss AUC: trapezoid over 0, .25, .5, 1 of 0.1, 0.2, 1.0, 2.0.
  want = np.trapezoid([0.1, 0.2, 1.0, 2.0], [0, .25, .5, 1])
  assert get("oracle_by_loss", "auc_loss") == pytest.approx(want)
  assert get("a", "auc_loss_minus_oracle_by_loss") == pytest.approx(
      np.trapezoid([0.1, 0.2, 2.0, 2.0], [0, .25, .5, 1]) - want)
  # The gap to the oracle is the ranking error plus the price of nesting.
  assert get("a", "auc_token_accuracy_minus_oracle") == pytest.approx(
      get("a", "auc_token_accuracy_minus_best_ordering")
      + get("best_ordering", "auc_token_accuracy_minus_oracle"))
  # The loss oracle is a reference: not a member of the families.
  per_seed = [out, out]
  nested = summary.aggregate_statistics(per_seed, np.zeros((3, 2)))["all"]
  members = nested["simultaneous_critical_values"][
      "auc_token_accuracy_minus_oracle"]["members"]
  assert members == 2  # best_ordering and a


def test_the_half_split_oracle_chooses_among_its_own_candidates():
  # Masks 0 (full), 1 and 2 (one head removed). The study's candidates
  # (ranked on all of validation) hold mask 1 only; those ranked on the
  # first half, mask 2 only: the half-split statistics use the latter.
  correct = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]])
  sums = {"correct": correct, "tokens": np.ones((3, 4)),
          "loss_sum": np.zeros((3, 4)), "exact": correct,
          "sequences": np.ones((3, 4))}
  curves = {"all": {"oracle": np.array([[0, 1]])}}
  weights = np.ones((2, 4))
  plain = summary.seed_statistics(curves, {"all": np.array([0, 1])}, 2, sums,
                                  sums, weights, weights, tolerance=0.01)
  halves = summary.seed_statistics(
      curves, {"all": np.array([0, 1])}, 2, sums, sums, weights, weights,
      tolerance=0.01, half_split={"all": {"oracle": np.array([[0, 2]])}})
  key = ("all", "oracle", "test_token_accuracy_at_prunable_half_split")
  assert plain[key][0] == 1.0
  # Mask 2 loses example 1 (of the first half): the level is 0 heads.
  assert halves[("all", "oracle", "prunable_heads_token_accuracy_half_split")
                ][0] == 0.0
  # Everything else is the study's own candidates'.
  key = ("all", "oracle", "auc_token_accuracy")
  assert halves[key][0] == plain[key][0]
