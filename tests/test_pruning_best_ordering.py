"""Tests of the best possible ordering (mha.pruning.best_ordering): the
dynamic program against brute force over every order, on planted tables."""

import itertools

import numpy as np
import pytest

from mha.model import TransformerConfig
from mha.pruning import best_ordering
from mha.pruning import core


def _brute_force(values, weights):
  n = int(np.log2(len(values)))
  return max((best_ordering.chain_value(values, order, weights), order)
             for order in itertools.permutations(range(n)))


@pytest.mark.parametrize("seed", range(3))
def test_the_program_equals_brute_force_over_every_order(seed):
  rng = np.random.default_rng(seed)
  n = 6  # 720 orders
  values = rng.random(2 ** n)
  for weights in (None, best_ordering.auc_weights(np.arange(n + 1), n),
                  best_ordering.auc_weights(core.pruning_counts(n, 0.34), n)):
    order, total = best_ordering.best_chain(values, weights)
    want, _ = _brute_force(values, weights)
    # float64 sums of 7 terms in another order: equal to rounding.
    assert total == pytest.approx(want, abs=1e-12)
    assert best_ordering.chain_value(values, order, weights) == (
        pytest.approx(total, abs=1e-12))
    assert sorted(order) == list(range(n))


def test_a_planted_chain_is_recovered_and_beats_the_greedy_one():
  n = 5
  planted = [3, 0, 4, 1, 2]
  values = np.zeros(2 ** n)
  subset = 2 ** n - 1
  values[subset] = 1.0
  for k, bit in enumerate(planted, start=1):
    subset &= ~(1 << bit)
    values[subset] = 1.0 - 0.1 * k
  # A greedy trap: removing head 1 first is best at k = 1, and then every
  # later subset is worth nothing.
  values[(2 ** n - 1) & ~(1 << 1)] = 0.95
  order, total = best_ordering.best_chain(values)
  assert list(order) == planted
  assert total == pytest.approx(sum(1.0 - 0.1 * k for k in range(n + 1)))


def test_auc_weights_give_the_study_s_trapezoid():
  n = 8
  rng = np.random.default_rng(0)
  curve = rng.random(n + 1)
  for counts in (np.arange(n + 1), core.pruning_counts(n, 0.25)):
    fractions = counts / n
    want = np.trapezoid(curve[counts], fractions) / (fractions[-1]
                                                     - fractions[0])
    weights = best_ordering.auc_weights(counts, n)
    assert weights @ curve == pytest.approx(want, abs=1e-12)
    assert weights[np.setdiff1d(np.arange(n + 1), counts)].sum() == 0


def test_best_order_gives_flat_head_indices():
  # Layer 0 has 2 heads of 3 slots: existing heads are flat 0, 1, 3, 4, 5.
  config = TransformerConfig(vocab_size=8, num_layers=2, num_heads=(2, 3),
                             d_model=12, head_dim=4, mlp_dim=8, max_len=4)
  values = np.random.default_rng(1).random(2 ** 5)
  order = best_ordering.best_order(values, config)
  bits, _ = best_ordering.best_chain(values)
  assert list(order) == list(np.array([0, 1, 3, 4, 5])[bits])
  with pytest.raises(ValueError, match=r"\[2\*\*N\] = \[32\]"):
    best_ordering.best_order(values[:16], config)
