"""Tests of mha.pruning.shapley: sampled Shapley values and interactions."""

import itertools
import math

import numpy as np
import pytest

from mha.model import TransformerConfig
from mha.pruning import oracle
from mha.pruning import shapley

N = 6


def _exact(values: np.ndarray) -> np.ndarray:
  """Shapley values of a subset table, by the definition."""
  n = int(math.log2(len(values)))
  phi = np.zeros(n)
  for i in range(n):
    for s in range(2 ** n):
      if s >> i & 1:
        continue
      k = bin(s).count("1")
      weight = math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n)
      phi[i] += weight * (values[s | 1 << i] - values[s])
  return phi


def _table(rng, n=N, examples=5):
  """A planted per-example subset table ``[2**n, examples]``: additive head
  values, one redundant pair (heads 0 and 1 do the same job) and noise."""
  bits = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1
  additive = bits @ rng.uniform(0.0, 0.2, n)
  either = np.maximum(bits[:, 0], bits[:, 1]) * 0.3
  table = (additive + either)[:, None] + rng.normal(0, 0.02, (2 ** n,
                                                              examples))
  return table


def _value_fn(table):
  def value_fn(kept):
    index = np.sum(kept.astype(np.int64) << np.arange(kept.shape[1]), axis=1)
    return table[index]
  return value_fn


def test_sampled_shapley_converges_to_the_exact_values():
  rng = np.random.default_rng(0)
  table = _table(rng)
  exact = _exact(table.mean(axis=1))
  phi, ci = shapley.sampled_shapley(_value_fn(table), N, num_pairs=2000,
                                    rng=np.random.default_rng(1))
  np.testing.assert_allclose(phi, exact, atol=5e-3)
  assert np.all(ci[:, 0] <= phi) and np.all(phi <= ci[:, 1])
  # The values sum to v(all) - v(none) in every sample (efficiency).
  assert phi.sum() == pytest.approx(table[-1].mean() - table[0].mean())


def test_sampled_intervals_cover_the_exact_values():
  rng = np.random.default_rng(2)
  table = _table(rng)
  exact = _exact(table.mean(axis=1))
  covered = []
  for r in range(100):
    _, ci = shapley.sampled_shapley(_value_fn(table), N, num_pairs=8,
                                    rng=np.random.default_rng(100 + r))
    covered.append((ci[:, 0] <= exact) & (exact <= ci[:, 1]))
  # Nominal 95%; the data part of the interval makes it conservative here.
  assert np.mean(covered) >= 0.9


def test_exact_shapley_of_the_oracle_matches_the_definition():
  rng = np.random.default_rng(3)
  values = rng.normal(size=2 ** 4)
  config = TransformerConfig(vocab_size=5, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=4)
  np.testing.assert_allclose(
      oracle.shapley_values(values, config).reshape(-1), _exact(values))


def test_interaction_indices_match_their_definition():
  rng = np.random.default_rng(4)
  n = 5
  values = rng.normal(size=2 ** n)
  brute = np.zeros((n, n))
  for i, j in itertools.combinations(range(n), 2):
    for s in range(2 ** n):
      if s >> i & 1 or s >> j & 1:
        continue
      k = bin(s).count("1")
      weight = (math.factorial(k) * math.factorial(n - k - 2)
                / math.factorial(n - 1))
      brute[i, j] += weight * (values[s | 1 << i | 1 << j] - values[s | 1 << i]
                               - values[s | 1 << j] + values[s])
    brute[j, i] = brute[i, j]
  np.testing.assert_allclose(shapley.interaction_indices(values), brute,
                             atol=1e-12)


def test_a_redundant_pair_has_the_most_negative_interaction():
  table = _table(np.random.default_rng(5))
  config = TransformerConfig(vocab_size=5, num_layers=2, num_heads=3,
                             d_model=6, mlp_dim=8, max_len=4)
  pairs = shapley.interaction_pairs(table.mean(axis=1), config)
  assert len(pairs) == N * (N - 1) // 2
  assert pairs[0]["heads"] == [[0, 0], [0, 1]] and pairs[0]["value"] < -0.2
  values = [abs(p["value"]) for p in pairs]
  assert values == sorted(values, reverse=True)
  summary = shapley.layer_summary(pairs)
  assert summary["mean_within_layer"] < summary["mean_across_layers"]


def test_mobius_inverts_to_the_table():
  values = np.random.default_rng(6).normal(size=2 ** 4)
  m = shapley.mobius(values)
  back = [sum(m[t] for t in range(16) if t & s == t) for s in range(16)]
  np.testing.assert_allclose(back, values, atol=1e-12)


@pytest.mark.slow  # a per-example table of the tiny model: seconds
def test_coverage_script_counts_intervals_holding_the_exact_values(tiny_run):
  from scripts import shapley_coverage  # pylint: disable=import-outside-toplevel
  result = shapley_coverage.coverage(tiny_run.workdir, repeats=20, pairs=4,
                                     examples=None)
  assert result["heads"] == 4 and result["repeats"] == 20
  low, high = result["coverage_ci_repeats"]
  assert 0.0 <= low <= result["coverage"] <= high <= 1.0
  assert result["coverage_min_head"] <= result["coverage"]
  # 20 seeded repeats on the tiny model (deterministic): most intervals
  # hold the exact value.
  assert result["coverage"] >= 0.8
