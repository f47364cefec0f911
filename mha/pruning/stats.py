"""Intervals and tests of the pruning study.

* A paired bootstrap over test examples, and over seeds when there are
  several (a two-level bootstrap): every statistic of one replicate is
  computed from the *same* resample, so differences between orderings are
  paired. The seeds share their test set, so a replicate resamples the seeds
  and, once, the examples (the pigeonhole bootstrap of a crossed design).
  Replicates are multinomial count weights, so a ratio metric (token
  accuracy = correct / tokens) is recomputed from weighted per-example sums.
* Single-head ablations: a paired t-test per head over examples, with the
  Benjamini-Hochberg correction (``scipy.stats.false_discovery_control``).
* Spearman correlations averaged over seeds through Fisher's z.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from mha import evaluate as eval_lib

#: Central coverage of every interval.
LEVEL = 0.95


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
  draws = rng.integers(0, num_examples, (num_bootstrap, num_examples))
  counts = np.zeros((num_bootstrap, num_examples), np.float32)
  np.add.at(counts, (np.arange(num_bootstrap)[:, None], draws), 1.0)
  return counts


def seed_weights(num_seeds: int, num_bootstrap: int,
                 rng: np.random.Generator) -> np.ndarray:
  """``[R, S]`` float64 seed weights of a replicate (draw counts / S); one
  seed gives weight 1 in every replicate."""
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


def paired_ttest_pvalues(base: np.ndarray, removed: np.ndarray) -> np.ndarray:
  """Two-sided paired t-test p-values, one per row of ``removed`` ``[M, n]``
  against ``base`` ``[n]`` (1 where the two never differ)."""
  base = np.asarray(base, np.float64)
  out = np.ones(len(removed))
  for i, row in enumerate(np.asarray(removed, np.float64)):
    diff = row - base
    if np.any(diff != 0):
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
  rhos = np.asarray([r["rho"] for r in results], np.float64)
  ns = np.asarray([r["n"] for r in results], np.float64)
  keep = np.isfinite(rhos) & (ns > 3)
  out = {"rho": float("nan"), "p": float("nan"), "ci": [float("nan")] * 2,
         "per_seed": [float(r) for r in rhos],
         "per_seed_p": [float(r["p"]) for r in results]}
  if not keep.any():
    return out
  # A perfect rank agreement has an infinite z, which would decide the mean
  # alone (and a cap like 0.9999 would pick its value). Count it as half an
  # adjacent swap short of perfect: 1 - 6 / (n (n^2 - 1)), halfway between 1
  # and the largest rho below 1 that n items can have.
  n = ns[keep]
  bound = 1.0 - 6.0 / (n * (n * n - 1.0))
  z = np.arctanh(np.clip(rhos[keep], -bound, bound))
  se = np.sqrt(1.0 / np.sum((ns[keep] - 3) / 1.06))
  mean = float(np.mean(z))
  half = _scipy_stats().norm.ppf(0.5 + LEVEL / 2) * se
  out["rho"] = float(np.tanh(mean))
  out["p"] = float(2 * _scipy_stats().norm.sf(abs(mean) / se))
  out["ci"] = [float(np.tanh(mean - half)), float(np.tanh(mean + half))]
  return out


__all__ = ["LEVEL", "example_weights", "seed_weights", "resampled_metrics",
           "interval", "two_level", "paired_ttest_pvalues",
           "benjamini_hochberg", "spearman", "fisher_mean"]
