"""The speed table (mha.pruning.speed): its protocol and its numbers' shape.

No assertion here depends on how fast anything runs: the timing windows are
replaced by a deterministic fake where the protocol is checked, and the real
table is checked for structure only. Both time the same three models (the
speed table's: none, layer 0's heads, every head removed) at the same shapes,
each compiled once for the module (``compiled_once``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import init_params
from mha import data
from mha.model import Transformer, TransformerConfig
from mha import head_masks
from mha.pruning import core
from mha.pruning import speed

CONFIG = TransformerConfig(vocab_size=12, num_layers=2, num_heads=4,
                           d_model=16, mlp_dim=32, max_len=6)


#: The speed table's order: flat head indices, layer 0's heads first.
ORDER = core.order_from_importance(np.arange(8, dtype=np.float64).reshape(2, 4))
FRACTIONS = [0.5, 1.0]
BATCH_SIZES = [1, 4]


@pytest.fixture(scope="module", autouse=True)
def compiled_once():
  """``speed.compile_prediction`` memoized on (model config, input shape and
  dtype), which fix the parameters' shapes too: the tests compile each of
  their models once, not once per test (XLA compilation is their cost)."""
  compiled: dict = {}
  original = speed.compile_prediction

  def compile_once(model, params, inputs):
    key = (model.config, tuple(inputs.shape), str(inputs.dtype))
    if key not in compiled:
      compiled[key] = original(model, params, inputs)
    return compiled[key]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(speed, "compile_prediction", compile_once)
    yield


@pytest.fixture(scope="module")
def models():
  """The speed table's three models, ``[(model, params)]``: none, layer 0's
  heads and every head removed (the first through ``core.prune_heads`` too,
  as the table builds it, so that its config is the table's)."""
  model = Transformer(CONFIG)
  params = init_params(model, jax.random.key(0))
  out = []
  for fraction in [0.0, *FRACTIONS]:
    removed = head_masks.flat_to_pairs(CONFIG, ORDER[:int(fraction * 8)])
    pruned_params, pruned_config = core.prune_heads(params, CONFIG, removed)
    out.append((Transformer(pruned_config), pruned_params))
  return out


def _split(n: int = max(BATCH_SIZES)) -> data.Split:
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, CONFIG.vocab_size, (n, CONFIG.max_len))
  inputs[:, -2:] = 0  # some padding
  return data.Split(inputs.astype(np.int32), inputs[:, ::-1].astype(np.int32))


def test_median_interval_ranks_and_coverage():
  # 10 samples: x_(2) and x_(9), coverage 1 - 2 P(Bin(10, 1/2) <= 1).
  median, low, high, coverage = speed.median_interval(np.arange(10.0)[::-1])
  assert (median, low, high) == (4.5, 1.0, 8.0)
  assert coverage == pytest.approx(1 - 2 * 11 / 1024)
  # 5 samples are too few for 95%: the range, with its own coverage.
  assert speed.median_interval([3.0, 1, 2, 5, 4]) == (3.0, 1.0, 5.0,
                                                      1 - 2 / 32)
  assert speed.median_interval([7.0])[:3] == (7.0, 7.0, 7.0)


def test_median_interval_covers_the_true_median_as_stated():
  # Exponential(1) has median log 2. 4,000 simulated sets of 10: the share
  # covering it is 0.9785 up to a binomial standard error of 0.0023; 0.012
  # is 5 standard errors.
  rng = np.random.default_rng(0)
  hits = 0
  for _ in range(4000):
    _, low, high, coverage = speed.median_interval(rng.exponential(size=10))
    hits += low <= math.log(2) <= high
  assert hits / 4000 == pytest.approx(coverage, abs=0.012)


def test_rotation_puts_every_model_in_every_slot():
  schedule = speed.rotation(3, 6)
  assert schedule[:3] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
  assert schedule[3:] == schedule[:3]
  for slot in range(3):
    counts = np.bincount([order[slot] for order in schedule], minlength=3)
    assert list(counts) == [2, 2, 2]


def test_compiled_costs_reads_xla_cost_analysis():
  x = np.ones((8, 8), np.float32)  # host: jnp.ones compiles a program
  compiled = jax.jit(lambda a: jnp.exp(a) @ a).lower(x).compile()
  costs = speed.compiled_costs(compiled)
  assert set(costs) == {"flops", "bytes_accessed", "transcendentals"}
  if speed.gpu_products_uncounted():  # XLA would count the exp alone
    assert math.isnan(costs["flops"])
  else:
    assert costs["flops"] == 2 * 8 ** 3  # the matmul's multiply-adds
  assert costs["transcendentals"] == 64  # one exp per element
  assert costs["bytes_accessed"] >= 3 * 8 * 8 * 4  # x in, x again, out


@pytest.mark.slow  # Over 5 s on 2 cores: outside the fast loop.
def test_time_models_rotates_every_round_and_pairs_the_ratios(monkeypatch,
                                                              models):
  row_of = {id(p): row for row, (_, p) in enumerate(models)}
  ran: list[int] = []

  def fake_window(fn, p, inputs, calls):
    del fn, inputs
    ran.append(row_of[id(p)])
    # Model r takes (r + 1) ms per call, and round k is (k + 1) times slower
    # for everyone (a drifting machine): the paired ratio cancels the drift.
    round_index = (len(ran) - 1) // len(models)
    return calls * 1e-3 * (row_of[id(p)] + 1) * (round_index % 4 + 1)

  monkeypatch.setattr(speed, "_window", fake_window)
  monkeypatch.setattr(speed, "_calls_for", lambda *args: 5)
  batches = {bs: _split().inputs[:bs] for bs in BATCH_SIZES}
  timings = speed.time_models(models, batches, repeats=4, min_seconds=0.0)

  schedule = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
  assert timings.schedule == schedule
  per_batch = [row for order in schedule for row in order]
  assert ran == per_batch * len(batches)  # the order actually run
  assert timings.rounds.shape == (3, 2, 4)
  assert timings.examples_per_sec.shape == timings.speedup.shape == (3, 2)
  assert timings.examples_per_sec_ci.shape == timings.speedup_ci.shape == (
      3, 2, 2)
  assert timings.calls_per_window.tolist() == [[5, 5]] * 3
  # Round k of model r at batch b: b / ((r + 1) ms * (k + 1)).
  np.testing.assert_allclose(timings.rounds[0, 0], 1 / (1e-3 * np.arange(1, 5)))
  np.testing.assert_allclose(timings.rounds[2, 1],
                             4 / (3e-3 * np.arange(1, 5)))
  np.testing.assert_allclose(timings.speedup[:, 0], [1.0, 1 / 2, 1 / 3])
  np.testing.assert_allclose(timings.speedup_ci[1, 1], [0.5, 0.5])
  assert np.all(timings.examples_per_sec_ci[..., 0] <= timings.examples_per_sec)
  assert np.all(timings.examples_per_sec <= timings.examples_per_sec_ci[..., 1])
  # XLA's static counts: fewer heads, less of each.
  for name in ("flops", "bytes_accessed", "transcendentals"):
    assert timings.costs[name].shape == (3, 2)
    assert np.all(timings.costs[name][1] < timings.costs[name][0]), name
    assert np.all(timings.costs[name][2] < timings.costs[name][1]), name


@pytest.mark.slow
def test_speed_table_structure(models):
  model, params = models[0]
  logged: list[str] = []
  table = speed.speed_table(model, params, ORDER, _split(),
                            fractions=FRACTIONS, batch_sizes=BATCH_SIZES,
                            repeats=3, min_seconds=0.0, log=logged.append)
  assert table["batch_sizes"] == [1, 4]
  timing = table["timing"]
  assert timing["repeats"] == 3 and timing["min_seconds"] == 0.0
  assert timing["schedule"] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
  # 3 rounds are too few for 95%: the interval is their range, which misses
  # the median only when all three fall on one side of it.
  assert timing["coverage"] == 1 - 2 * 0.5 ** 3
  entries = table["entries"]
  assert [e["fraction"] for e in entries] == [0.0, 0.5, 1.0]
  assert [e["heads_removed"] for e in entries] == [0, 4, 8]
  assert entries[2]["heads_per_layer"] == [0, 0]
  for entry in entries:
    assert entry["max_abs_logit_diff_pruned_vs_masked"] < 1e-5
    for key in ("examples_per_sec", "examples_per_sec_ci",
                "examples_per_sec_rounds", "speedup", "speedup_ci",
                "calls_per_window", "flops", "flop_ratio", "bytes_accessed",
                "bytes_accessed_ratio", "transcendentals",
                "transcendentals_ratio"):
      assert list(entry[key]) == ["1", "4"], key
    for bs in ("1", "4"):
      low, high = entry["examples_per_sec_ci"][bs]
      assert low <= entry["examples_per_sec"][bs] <= high
      assert len(entry["examples_per_sec_rounds"][bs]) == 3
      assert entry["calls_per_window"][bs] == 1  # min_seconds=0
  assert entries[0]["speedup"] == {"1": 1.0, "4": 1.0}
  assert entries[0]["flop_ratio"] == {"1": 1.0, "4": 1.0}
  assert entries[2]["transcendentals_ratio"]["4"] < 1.0  # no softmax left
  assert any("rotated" in line for line in logged)


def test_adaptive_rounds_stop_each_cell_once_its_interval_is_tight():
  rng = np.random.default_rng(0)
  ran: list[int] = []

  def window(row):
    ran.append(row)
    # Model 1 is exactly twice as fast as model 0 in every round; model 2's
    # ratio is noisy, so its interval never gets within 1% of it.
    return {0: 100.0, 1: 200.0,
            2: 150.0 * math.exp(0.5 * rng.standard_normal())}[row]

  rates, orders = speed.run_rounds(window, 3, repeats=10, max_repeats=25,
                                   target_width=0.01)
  assert [len(r) for r in rates] == [25, 10, 25]
  assert orders[:3] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]  # the rotation
  assert all(sorted(o) == [0, 2] for o in orders[10:])  # model 1 stopped
  assert orders[10:12] == [[0, 2], [2, 0]]  # still rotated
  assert ran == [row for order in orders for row in order]
  # Without a target, exactly `repeats` rounds: the fixed protocol.
  rates, orders = speed.run_rounds(window, 3, repeats=10, max_repeats=25,
                                   target_width=None)
  assert [len(r) for r in rates] == [10, 10, 10] and len(orders) == 10
  # Every model tight: all stop at the floor.
  rates, _ = speed.run_rounds(lambda row: 100.0 * (row + 1), 3, repeats=10,
                              max_repeats=25, target_width=0.01)
  assert [len(r) for r in rates] == [10, 10, 10]


def test_adaptive_stopping_keeps_the_intervals_coverage():
  # Skewed, heavy-tailed windows (10% slowed 1.2-3x), 400 simulated tables:
  # the stopping rule looks at the interval's width only, and the speed-up's
  # interval still covers the true median (nominal >= 95% at a fixed n).
  result = speed.stopping_coverage(400, noise=0.08, spikes=0.1, seed=1)
  assert result["coverage"] >= 0.93, result
  assert 10 <= result["mean_rounds"] <= speed.MAX_REPEATS
  assert 0.0 < result["tight"] < 1.0  # both ways of stopping happened


@pytest.mark.slow
def test_adaptive_speed_table_records_rounds_and_tightness(models):
  model, params = models[0]
  table = speed.speed_table(model, params, ORDER, _split(),
                            fractions=FRACTIONS, batch_sizes=BATCH_SIZES,
                            repeats=6, min_seconds=0.0, target_width=1e-9,
                            max_repeats=8, log=lambda _: None)
  timing = table["timing"]
  assert timing["adaptive"] and timing["max_repeats"] == 8
  assert timing["target_width"] == 1e-9
  for entry in table["entries"]:
    for bs in ("1", "4"):
      n = entry["rounds"][bs]
      assert 6 <= n <= 8 and len(entry["examples_per_sec_rounds"][bs]) == n
      low, high = entry["speedup_ci"][bs]
      assert low <= entry["speedup"][bs] <= high
  # The reference runs as long as the longest of the others.
  first = table["entries"][0]["rounds"]
  assert all(first[bs] == max(e["rounds"][bs] for e in table["entries"])
             for bs in ("1", "4"))


def test_compiled_costs_read_a_negative_count_as_unknown():
  class Compiled:  # what XLA's GPU cost analysis gave for cuBLAS products
    def cost_analysis(self):
      return {"flops": -1.0, "bytes accessed": 511.0}
  costs = speed.compiled_costs(Compiled())
  assert math.isnan(costs["flops"]) and math.isnan(costs["transcendentals"])
  assert costs["bytes_accessed"] == 511.0


def test_a_cell_is_tight_only_with_its_full_coverage():
  # One round is the "interval" [x, x]: width 0, coverage 0. The adaptive
  # rule stopped there (the report then called it a 95% interval).
  assert not speed.is_tight([1.15], target_width=0.1)
  assert not speed.is_tight([1.15] * 5, target_width=0.1)  # 93.8% < 95%
  assert speed.is_tight([1.15] * 6, target_width=0.1)
  from mha.pruning.study import report  # pylint: disable=import-outside-toplevel
  assert report._speed_interval_text({"confidence": 0.95, "coverage": 0.0}) == (  # pylint: disable=protected-access
      "interval, over too few rounds for 95%: it covers the median speed-up "
      "with probability 0% only")
  assert report._speed_interval_text(  # pylint: disable=protected-access
      {"confidence": 0.95, "coverage": 0.979}) == "95% interval"

