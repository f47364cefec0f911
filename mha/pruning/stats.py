"""Intervals and tests of the pruning study.

* A paired bootstrap over test examples: every statistic of one replicate
  is computed from the *same* resample, so differences between orderings are
  paired. Replicates are multinomial count weights, so a ratio metric (token
  accuracy = correct / tokens) is recomputed from weighted per-example sums.
* Over several seeds (they share their test set: a crossed design), the
  mean over seeds has a small-sample interval (:func:`seed_t_replicates`): the
  example bootstrap of the mean over seeds plus a seed-level Student-t term
  with ``S - 1`` degrees of freedom. The percentile bootstrap that resamples
  the seeds as well (:func:`seed_weights`, :func:`two_level`) is kept for
  comparison: over 2-5 seeds it covers far less than its nominal level
  (``scripts/interval_coverage.py``).
* Simultaneous (max-t) intervals for a family of statistics from the same
  replicates (:func:`simultaneous_intervals`).
* Single-head ablations: a paired t-test per head over examples, with the
  Benjamini-Hochberg correction (``scipy.stats.false_discovery_control``).
* Spearman correlations averaged over seeds through Fisher's z.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Sequence

import numpy as np

from mha import evaluate as eval_lib
from mha.run import arguments

#: Central coverage of every interval.
LEVEL = 0.95

#: ``results.json``'s ``interval_method`` with one seed and with several.
ONE_SEED_METHOD = "example_bootstrap_percentile"
SEEDS_METHOD = "seed_t_plus_example_bootstrap"


def _scipy_stats():
  """``scipy.stats``, imported on first use: importing it takes 0.7 s, a
  third of the start-up of every entry point of the pruning study (measured
  on 2 cores), and a run that fails on its command line never needs it."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  return stats


def example_weights(num_examples: int, num_bootstrap: int,
                    rng: np.random.Generator) -> np.ndarray:
  """``[R, n]`` float32 counts: how often each example is drawn in each of
  ``R`` resamples with replacement."""
  arguments.check_count("num_examples", num_examples)
  arguments.check_count("num_bootstrap", num_bootstrap)
  draws = rng.integers(0, num_examples, (num_bootstrap, num_examples))
  # One bincount over (resample, example) cells: the counts np.add.at makes,
  # 6-7x faster (the bootstrap draws thousands of these).
  cells = (np.arange(num_bootstrap)[:, None] * num_examples + draws).ravel()
  return np.bincount(cells, minlength=num_bootstrap * num_examples).reshape(
      num_bootstrap, num_examples).astype(np.float32)


def seed_weights(num_seeds: int, num_bootstrap: int,
                 rng: np.random.Generator) -> np.ndarray:
  """``[R, S]`` float64 seed weights of a replicate (draw counts / S); one
  seed gives weight 1 in every replicate."""
  arguments.check_count("num_seeds", num_seeds)
  arguments.check_count("num_bootstrap", num_bootstrap)
  return example_weights(num_seeds, num_bootstrap, rng).astype(
      np.float64) / num_seeds


def resampled_metrics(sums: Mapping[str, np.ndarray],
                      weights: np.ndarray) -> dict[str, np.ndarray]:
  """Metrics of per-example sums ``[..., n]`` under each resample.

  Args:
    sums: :func:`mha.evaluate.example_metric_sums` arrays ``[..., n]``.
    weights: ``[R, n]`` example counts (:func:`example_weights`); a row of
      ones is the full sample.

  Returns:
    ``loss``, ``token_accuracy``, ``exact_match``: ``[R, ...]``.
  """
  w = np.asarray(weights, np.float64)
  totals = {k: np.einsum("rn,...n->r...", w, np.asarray(v, np.float64))
            for k, v in sums.items()}
  return eval_lib.summarize(totals)


def interval(replicates: np.ndarray, axis: int = 0) -> np.ndarray:
  """Percentile interval ``[..., 2]`` (low, high) of the replicates."""
  tail = 100 * (1 - LEVEL) / 2
  low, high = np.percentile(replicates, [tail, 100 - tail], axis=axis)
  return np.stack([low, high], axis=-1)


def two_level(per_seed: np.ndarray, seed_w: np.ndarray) -> np.ndarray:
  """Combines per-seed replicates ``[S, R, ...]`` into replicates of the
  mean over seeds ``[R, ...]`` with seed weights ``[R, S]``."""
  per_seed = np.asarray(per_seed, np.float64)
  return np.einsum("rs,sr...->r...", seed_w, per_seed)


def seed_t_weights(num_seeds: int, num_bootstrap: int,
                   rng: np.random.Generator) -> np.ndarray:
  """``[R, S]`` float64 coefficients ``z / sqrt(S * c)`` of the seed-level
  term of :func:`seed_t_replicates`: ``z`` standard normal per replicate and
  seed, ``c`` chi-square with ``S - 1`` degrees of freedom per replicate.
  One seed: zeros (no seed term)."""
  arguments.check_count("num_seeds", num_seeds)
  arguments.check_count("num_bootstrap", num_bootstrap)
  if num_seeds < 2:
    return np.zeros((num_bootstrap, num_seeds))
  z = rng.standard_normal((num_bootstrap, num_seeds))
  chi2 = rng.chisquare(num_seeds - 1, num_bootstrap)
  return z / np.sqrt(num_seeds * chi2)[:, None]


def seed_t_replicates(per_seed: np.ndarray,
                      seed_t: np.ndarray) -> np.ndarray:
  """Replicates ``[R, ...]`` of the mean over seeds of a statistic, with the
  small-sample correction for few seeds.

  A replicate is the example bootstrap of the mean over seeds (every seed
  under the same resample of the shared examples, equal seed weights) plus a
  seed-level term ``sum_s seed_t[r, s] * (x_s - mean(x))`` over the seeds'
  full-sample values ``x_s``. With the coefficients of
  :func:`seed_t_weights` that term is exactly ``s / sqrt(S)`` times a
  Student t with ``S - 1`` degrees of freedom (``s``: the standard deviation
  of ``x_s`` over seeds), independent of the example resample; the 2.5 and
  97.5 percentiles of the sum (:func:`interval`) are the interval. So:

  * when the seeds differ much more than the examples do, it is the
    seed-level t-interval ``mean +- t(S - 1) s / sqrt(S)``, exact for normal
    seed effects, where a percentile bootstrap over seeds resamples ``S``
    values (``S ** S`` equally likely draws, 3 distinct means for 2 seeds),
    has the spread ``s sqrt((S - 1) / S) / sqrt(S)`` and a normal tail: it
    covers about 60% (2 seeds), 75% (3), 85% (5) at a nominal 95%;
  * when the examples dominate, the example bootstrap's percentiles (its
    skew and its discreteness included) carry the interval, as with one
    seed;
  * in between, the convolution weighs the two by their spreads (as a
    Satterthwaite t-interval would, without its normal approximation of the
    example part).

  A studentised bootstrap over seeds was not chosen: with 2 or 3 seeds most
  seed resamples have no spread at all (a zero denominator), and with 5 its
  ``t`` table has too few distinct values to set a 97.5% point.

  The seeds' spread ``s`` also holds the seed-by-example interaction
  (each seed's own errors on the shared examples), which the example
  bootstrap of the mean counts as well: counted twice, it makes the interval
  conservative when that interaction dominates. Coverage measured in
  ``scripts/interval_coverage.py`` (``docs/pruning.md``).

  Args:
    per_seed: ``[S, 1 + R, ...]``: each seed's statistic under the full
      sample (row 0) and the ``R`` example resamples, shared by the seeds.
    seed_t: ``[R, S]`` from :func:`seed_t_weights` (zeros for one seed: the
      interval is then the example bootstrap's percentile interval).

  Returns:
    ``[R, ...]`` replicates of the mean over seeds.
  """
  per_seed = np.asarray(per_seed, np.float64)
  full = per_seed[:, 0]
  spread = full - full.mean(axis=0)
  return per_seed[:, 1:].mean(axis=0) + np.einsum(
      "rs,s...->r...", np.asarray(seed_t, np.float64), spread)


def seed_interval(per_seed: np.ndarray, seed_t: np.ndarray) -> np.ndarray:
  """The interval ``[..., 2]`` of the mean over seeds of per-seed statistics
  ``[S, 1 + R, ...]`` (:func:`seed_t_replicates`)."""
  return interval(seed_t_replicates(per_seed, seed_t))


def interval_method(num_seeds: int) -> str:
  """``results.json``'s ``interval_method`` for ``num_seeds`` seeds."""
  arguments.check_count("num_seeds", num_seeds)
  return ONE_SEED_METHOD if num_seeds < 2 else SEEDS_METHOD


def simultaneous_intervals(estimates: np.ndarray, replicates: np.ndarray
                           ) -> tuple[np.ndarray, float]:
  """Max-t simultaneous intervals for a family of statistics.

  Each member ``k`` is standardised by half the width ``h_k`` of its
  marginal interval (:func:`interval` of its replicates); the ``LEVEL``
  quantile ``c`` of ``max_k |replicate_k - estimate_k| / h_k`` over the
  replicates is the family's critical value, and member ``k``'s interval is
  ``estimate_k +- c h_k``, widened where needed to hold its marginal
  interval. With probability ``LEVEL`` (as far as the replicates carry it)
  every member's interval holds its truth at once.

  Args:
    estimates: ``[K]`` full-sample values of the family's members.
    replicates: ``[R, K]`` their replicates (the same resamples).

  Returns:
    ``([K, 2] intervals, c)``; a member with NaN replicates gets NaN and is
    left out of ``c``.
  """
  estimates = np.asarray(estimates, np.float64)
  replicates = np.asarray(replicates, np.float64)
  ok = np.all(np.isfinite(replicates), axis=0) & np.isfinite(estimates)
  out = np.full((len(estimates), 2), np.nan)
  if not ok.any():
    return out, float("nan")
  marginal = interval(replicates[:, ok])
  half = (marginal[:, 1] - marginal[:, 0]) / 2
  dev = np.abs(replicates[:, ok] - estimates[ok])
  with np.errstate(divide="ignore", invalid="ignore"):
    t = np.where(dev == 0, 0.0, dev / half)
  c = float(np.quantile(t.max(axis=1), LEVEL))
  out[ok, 0] = np.minimum(marginal[:, 0], estimates[ok] - c * half)
  out[ok, 1] = np.maximum(marginal[:, 1], estimates[ok] + c * half)
  return out, c


def paired_ttest_pvalues(base: np.ndarray, removed: np.ndarray) -> np.ndarray:
  """Two-sided paired t-test p-values, one per row of ``removed`` ``[M, n]``
  against ``base`` ``[n]`` (1 where the two never differ).

  Where the differences are (nearly) the same non-zero value on every
  example (a head whose removal shifts every example alike), scipy warns
  "Precision loss occurred in moment calculation": their variance is
  (nearly) zero, t is huge and the p-value 0 or near it, which is right.
  That warning is silenced here, and only here."""
  base = np.asarray(base, np.float64)
  out = np.ones(len(removed))
  for i, row in enumerate(np.asarray(removed, np.float64)):
    diff = row - base
    if np.any(diff != 0):
      with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Precision loss occurred in moment",
            category=RuntimeWarning)
        out[i] = _scipy_stats().ttest_rel(row, base).pvalue
  return out


def benjamini_hochberg(pvalues: np.ndarray) -> np.ndarray:
  """Benjamini-Hochberg adjusted p-values (``q``), NaN entries kept NaN."""
  p = np.asarray(pvalues, np.float64)
  out = np.full(p.shape, np.nan)
  keep = np.isfinite(p)
  if keep.any():
    out[keep] = _scipy_stats().false_discovery_control(p[keep], method="bh")
  return out


def spearman(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
  """Spearman's rho and its p-value over the entries finite in both (NaN
  when fewer than 3 or a constant side)."""
  a, b = np.ravel(a), np.ravel(b)
  keep = ~(np.isnan(a) | np.isnan(b))
  if keep.sum() < 3 or np.ptp(a[keep]) == 0 or np.ptp(b[keep]) == 0:
    return {"rho": float("nan"), "p": float("nan"), "n": int(keep.sum())}
  result = _scipy_stats().spearmanr(a[keep], b[keep])
  return {"rho": float(result.statistic), "p": float(result.pvalue),
          "n": int(keep.sum())}


def fisher_mean(results: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """Mean of per-seed Spearman rhos through Fisher's z, with a two-sided
  p-value of "no correlation" from the pooled z (standard error
  ``sqrt(1.06 / (n - 3))`` per seed, the Fieller et al. approximation for
  Spearman's rho; rough for few heads) and a 95% interval. A per-seed rho
  of +-1 counts as half an adjacent swap short of it."""
  # NaN rhos and p-values (a constant side) come back from results.json as
  # None; NumPy reads those as NaN.
  rhos = np.asarray([r["rho"] for r in results], np.float64)
  ns = np.asarray([r["n"] for r in results], np.float64)
  keep = np.isfinite(rhos) & (ns > 3)
  out = {"rho": float("nan"), "p": float("nan"), "ci": [float("nan")] * 2,
         "per_seed": [float(r) for r in rhos],
         "per_seed_p": [float(p) for p in np.asarray(
             [r["p"] for r in results], np.float64)]}
  if not keep.any():
    return out
  # A perfect rank agreement has an infinite z, which would decide the mean
  # alone (and a cap like 0.9999 would pick its value). Count it as half an
  # adjacent swap short of perfect: 1 - 6 / (n (n^2 - 1)), halfway between 1
  # and the largest rho below 1 that n items without ties can have. Only
  # +-1 is moved: with ties a rho below 1 may lie above that bound.
  n = ns[keep]
  bound = 1.0 - 6.0 / (n * (n * n - 1.0))
  rho = rhos[keep]
  z = np.arctanh(np.where(np.abs(rho) >= 1.0, np.sign(rho) * bound, rho))
  se = np.sqrt(1.0 / np.sum((ns[keep] - 3) / 1.06))
  mean = float(np.mean(z))
  half = _scipy_stats().norm.ppf(0.5 + LEVEL / 2) * se
  out["rho"] = float(np.tanh(mean))
  out["p"] = float(2 * _scipy_stats().norm.sf(abs(mean) / se))
  out["ci"] = [float(np.tanh(mean - half)), float(np.tanh(mean + half))]
  return out


__all__ = ["LEVEL", "ONE_SEED_METHOD", "SEEDS_METHOD", "example_weights",
           "seed_weights", "resampled_metrics", "interval", "two_level",
           "seed_t_weights", "seed_t_replicates", "seed_interval",
           "interval_method", "simultaneous_intervals",
           "paired_ttest_pvalues",
           "benjamini_hochberg", "spearman", "fisher_mean"]
