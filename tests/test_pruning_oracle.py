"""Tests of the exhaustive oracle and exact Shapley values
(mha.pruning.oracle)."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import init_params
from mha import data
from mha import evaluate as eval_lib
from mha.model import Transformer, TransformerConfig
from mha import head_masks
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.pruning import orderings
from mha.pruning import oracle


def _tokens(rng, n, config):
  tokens = rng.integers(1, config.vocab_size, (n, config.max_len))
  lengths = rng.integers(1, config.max_len + 1, n)
  tokens[np.arange(config.max_len)[None, :] >= lengths[:, None]] = 0
  return tokens.astype(np.int32)


def _random_model(config, seed=0, n=24):
  model = Transformer(config)
  params = model.init(jax.random.key(seed),
                      jnp.ones((1, config.max_len), jnp.int32))["params"]
  rng = np.random.default_rng(seed)
  inputs = _tokens(rng, n, config)
  targets = np.where(inputs != 0, (inputs * 3 + 1) % config.vocab_size, 0)
  return model, params, data.Split(inputs, targets.astype(np.int32))


def test_subset_masks_follow_the_bit_convention():
  config = TransformerConfig(vocab_size=8, num_layers=2, num_heads=(2, 1),
                             d_model=8, head_dim=4, mlp_dim=8, max_len=4)
  masks = oracle.subset_masks(config)
  assert masks.shape == (8, 2, 2)
  # Existing heads in flat order: (0, 0), (0, 1), (1, 0); (1, 1) is absent.
  np.testing.assert_array_equal(masks[0b101], [[1, 0], [1, 0]])
  np.testing.assert_array_equal(masks[0b010], [[0, 1], [0, 0]])
  assert np.all(masks[:, 1, 1] == 0)
  np.testing.assert_array_equal(oracle.subset_index(config, masks),
                                np.arange(8))
  np.testing.assert_array_equal(oracle.kept_counts(config),
                                [0, 1, 1, 2, 1, 2, 2, 3])


@pytest.mark.parametrize("kwargs", [
    dict(num_layers=2, num_heads=3),
    dict(num_layers=3, num_heads=(2, 0, 1), head_dim=4),  # an empty layer
    dict(num_layers=2, num_heads=2, pre_norm=False, positional="sinusoidal"),
])
@pytest.mark.slow  # seconds of compiling or training: the full suite only
def test_subsets_equal_masked_models(kwargs):
  """Layer by layer with shared prefixes == the full model under each mask
  (float32 sums over a few hundred tokens: 1e-5 relative)."""
  config = TransformerConfig(vocab_size=7, d_model=12, mlp_dim=16, max_len=5,
                             **kwargs)
  model, params, split = _random_model(config)
  masks = oracle.subset_masks(config)
  reference = core.evaluate_masks(model, params, split, masks, batch_size=8)
  got = oracle.evaluate_subsets(model, params, split, batch_size=5)
  for key in reference:
    np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=1e-6)
  examples = oracle.evaluate_subsets(model, params, split, per_example=True)
  assert examples["correct"].shape == (len(masks), len(split))
  summed = core.summarize_examples(examples)
  for key in reference:
    np.testing.assert_allclose(summed[key], reference[key], rtol=1e-5,
                               atol=1e-6)
  # Pure: jit passes through and stacked parameters vmap.
  # (Stacked and summed in NumPy: op by op, each shape compiles a program.)
  stacked = jax.tree.map(lambda a: np.stack([a, a]), params)
  sums = jax.jit(jax.vmap(lambda p: oracle.subset_metric_sums(
      model, p, split.inputs, split.targets)))(stacked)
  np.testing.assert_array_equal(np.asarray(sums["correct"])[0].sum(-1),
                                examples["correct"].sum(-1))


def test_mask_groups_hold_their_activations_within_the_budget():
  budget = oracle.MASK_GROUP_BYTES
  # deep64's calls (16 examples of up to 16 tokens, mlp_dim 64): 16 masks.
  assert oracle.mask_group(256, 64) == oracle.MASKS_PER_STEP == 16
  # The character LM's (16 windows of 128 tokens, mlp_dim 512): one.
  assert oracle.mask_group(2048, 512) == 1
  for positions, mlp_dim in ((100, 64), (300, 64), (1000, 32), (7, 3)):
    group = oracle.mask_group(positions, mlp_dim)
    assert 1 <= group <= oracle.MASKS_PER_STEP
    assert group * positions * mlp_dim * 4 <= budget
    assert (group == oracle.MASKS_PER_STEP
            or (group + 1) * positions * mlp_dim * 4 > budget)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_long_sequences_split_the_table_into_more_calls(monkeypatch):
  """The per-example table bounds a call's positions (subsets x examples x
  length), not only its rows: at 64 tokens a cap of 40 examples' worth
  splits 100 examples into 3 calls (the last padded), and the table still
  equals each subset's mask evaluated through the whole model."""
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=2,
                             d_model=12, mlp_dim=16, max_len=64)
  model, params, split = _random_model(config, seed=2, n=100)
  subsets = 2 ** oracle.num_heads(config)
  monkeypatch.setattr(oracle, "TABLE_POSITIONS_PER_CALL",
                      40 * subsets * config.max_len)
  calls = []
  sums = oracle._subset_sums  # pylint: disable=protected-access
  monkeypatch.setattr(oracle, "_subset_sums", lambda model, params, inputs,
                      *a, **k: (calls.append(len(inputs)),
                                sums(model, params, inputs, *a, **k))[1])
  table = oracle.evaluate_subsets(model, params, split, per_example=True)
  assert calls == [40, 40, 40]
  want = core.evaluate_masks(model, params, split,
                             oracle.subset_masks(config), per_example=True)
  for key in want:
    np.testing.assert_allclose(table[key], want[key], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # seconds of compiling: the full suite only
@pytest.mark.parametrize("mode", ["zero", "resample"])
def test_a_list_of_masks_shares_its_lower_layers_and_equals_the_table(mode):
  """``evaluate_mask_list``: masks that agree on the layers below share
  them (the plan has one row per distinct prefix), and each mask's
  per-example sums are the table's row of its subset (the loss to float32
  rounding); a real-valued mask is evaluated as it is."""
  config = TransformerConfig(vocab_size=7, num_layers=3, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=6)
  model, params, split = _random_model(config, n=21)
  abl = (None if mode == "zero" else ablation_lib.build(
      model, params, mode, split, split, rng=np.random.default_rng(0)))
  ids = np.random.default_rng(1).choice(64, 20, replace=False)
  masks = oracle.subset_masks(config)[ids]
  plan = oracle.prefix_plan(config, masks)
  assert [len(p) for p, _ in plan] == [
      len(np.unique(masks[:, :l + 1].reshape(20, -1), axis=0))
      for l in range(3)]
  table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                  batch_size=16, ablation=abl)
  got = oracle.evaluate_mask_list(model, params, split, masks, batch_size=8,
                                  ablation=abl)
  for key in ("correct", "exact", "tokens", "sequences"):
    np.testing.assert_array_equal(got[key], np.asarray(table[key])[ids])
  np.testing.assert_allclose(got["loss_sum"], np.asarray(table["loss_sum"])[
      ids], rtol=1e-5, atol=1e-6)
  real = masks[:2] * np.float32(0.5)
  want = core.evaluate_masks(model, params, split, real, batch_size=8,
                             per_example=True, ablation=abl)
  got = oracle.evaluate_mask_list(model, params, split, real, batch_size=8,
                                  ablation=abl)
  np.testing.assert_array_equal(got["correct"], want["correct"])
  np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-5,
                             atol=1e-6)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_a_decoders_subsets_score_the_positions_its_weights_choose():
  """On a causal decoder whose task scores some positions (a recall task's
  answers), the oracle on the split with its weights folded into its targets
  (``data.scored_targets``) equals the weighted metrics of the model under
  each mask (``evaluate.metric_sums`` with ``weights``), and the streamed
  program the per-example one."""
  config = TransformerConfig(vocab_size=9, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=10, causal=True,
                             num_kv_heads=1)
  model = Transformer(config)
  params = init_params(model, jax.random.key(1))
  rng = np.random.default_rng(1)
  inputs = rng.integers(1, 9, (12, 10)).astype(np.int32)
  targets = rng.integers(1, 9, (12, 10)).astype(np.int32)
  weights = np.zeros((12, 10), np.float32)
  weights[:, -3:] = 1  # the answers
  weights[0] = 0  # an example with nothing scored
  split = data.Split(inputs, targets, weights=weights)
  scored = data.scored_targets(split)
  assert scored.weights is None and np.all(scored.targets[:, :-3] < 0)
  masks = oracle.subset_masks(config)
  reference = {k: [] for k in ("loss", "token_accuracy", "exact_match")}

  @jax.jit  # one program for the 16 masks (op by op, 1-2 s of CPU more)
  def masked_sums(mask):
    logits, _ = model.apply({"params": params}, inputs, head_mask=mask)
    return eval_lib.metric_sums(logits, targets, inputs, weights)
  for mask in masks:
    got = eval_lib.summarize(jax.device_get(masked_sums(mask)))
    for key in reference:
      reference[key].append(got[key])
  for per_example in (False, True):
    got = oracle.evaluate_subsets(model, params, scored, batch_size=5,
                                  per_example=per_example)
    if per_example:
      got = core.summarize_examples(got)
    for key, want in reference.items():
      np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_streamed_oracle_equals_the_per_example_table():
  """The streamed oracle (sums over the examples only, O(2**N) memory, the
  last layer reformulated: see ``oracle._last_layer_sums``) is the oracle of
  the per-example table, on an 8-head model: the loss sums to float32
  rounding (other programs add the same terms in another order); on this
  model no token is near enough a tie for rounding to flip it, so the
  integer sums, token accuracy, exact match, the oracle's candidates and
  Shapley values are equal exactly. Also when calls split layer 0's masks
  (how 16 heads fit in memory), when the last layer's masks go one at a time, and
  under mean ablation's bias shifts."""
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=4,
                             d_model=16, mlp_dim=16, max_len=6)
  model, params, split = _random_model(config, n=40)
  table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                  batch_size=16)
  old = core.summarize_examples(table)
  # All subsets a call; chunks; the last layer's 16 masks one at a time
  # (as a long context's are: oracle.mask_group), in a call of another
  # shape (jit traces it anew).
  for rows, group_bytes in ((oracle.ROWS_PER_CALL, oracle.MASK_GROUP_BYTES),
                            (64, oracle.MASK_GROUP_BYTES), (128, 1)):
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(oracle, "MASK_GROUP_BYTES", group_bytes)
      totals = oracle.subset_totals(model, params, split, batch_size=16,
                                    rows=rows)
    for key in ("correct", "exact", "tokens", "sequences"):
      np.testing.assert_array_equal(
          totals[key], np.sum(np.asarray(table[key], np.float64), axis=-1))
    np.testing.assert_allclose(
        totals["loss_sum"],
        np.sum(np.asarray(table["loss_sum"], np.float64), axis=-1),
        rtol=1e-6)
    new = eval_lib.summarize(totals)
    np.testing.assert_array_equal(new["token_accuracy"], old["token_accuracy"])
    np.testing.assert_array_equal(new["exact_match"], old["exact_match"])
    for variant, ranked in oracle.removals_by_variant(
        oracle.subset_values(new), config).items():
      want = oracle.removals_by_variant(oracle.subset_values(old),
                                        config)[variant]
      assert [[r.tolist() for r in k] for k in ranked] == [
          [r.tolist() for r in k] for k in want], variant
    np.testing.assert_array_equal(
        oracle.shapley_values(new["token_accuracy"], config),
        oracle.shapley_values(old["token_accuracy"], config))
  # Mean ablation: the bias shifts are affine in the mask too.
  shifts = jax.device_put(np.random.default_rng(3).normal(
      size=(2, 4, 16)).astype(np.float32))
  shifted = oracle.evaluate_subsets(model, params, split, per_example=True,
                                    batch_size=16, bias_shifts=shifts)
  totals = oracle.subset_totals(model, params, split, batch_size=16,
                                bias_shifts=shifts)
  np.testing.assert_array_equal(totals["correct"],
                                np.sum(shifted["correct"], axis=-1))
  np.testing.assert_allclose(totals["loss_sum"],
                             np.sum(shifted["loss_sum"], axis=-1), rtol=1e-6)
  # The study's entry point streams: its metrics are the table's.
  metrics, _, removals = oracle.evaluate_oracle(
      model, params, split, batch_size=16, max_heads=8)
  np.testing.assert_array_equal(metrics["token_accuracy"],
                                old["token_accuracy"])
  assert removals["all"][3][0].tolist() == oracle.ranked_removals(
      oracle.subset_values(old), config)[3][0].tolist()


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_the_oracle_half_by_half_adds_up_to_the_whole():
  """Streamed half by half (the half-split level's candidates are ranked on
  the first half): the halves' sums add up to the whole's, and the first
  half's metrics are its per-example table's; resample's donors are cut
  with the examples."""
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=6)
  model, params, split = _random_model(config, n=21)
  abl = ablation_lib.build(model, params, "resample", split, split,
                           rng=np.random.default_rng(0))
  table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                  batch_size=16, ablation=abl)
  whole, _, _ = oracle.evaluate_oracle(model, params, split, batch_size=16,
                                       max_heads=8, ablation=abl)
  first_half = {}
  halved, _, _ = oracle.evaluate_oracle(
      model, params, split, batch_size=16, max_heads=8, ablation=abl,
      first_half=first_half)
  np.testing.assert_array_equal(halved["token_accuracy"],
                                whole["token_accuracy"])
  np.testing.assert_allclose(halved["loss"], whole["loss"], rtol=1e-6)
  half = core.summarize_examples({k: np.asarray(v)[:, :10]
                                  for k, v in table.items()})
  np.testing.assert_array_equal(first_half["token_accuracy"],
                                half["token_accuracy"])
  # Asked for, the oracle keeps its per-example table (both halves, the
  # split's order): the model-path table's, the loss to float32 rounding.
  kept = {}
  again, _, _ = oracle.evaluate_oracle(
      model, params, split, batch_size=8, max_heads=8, ablation=abl,
      first_half={}, table=kept)
  assert set(kept) == set(table)
  for key in ("correct", "exact", "tokens", "sequences"):
    np.testing.assert_array_equal(kept[key], table[key], err_msg=key)
  np.testing.assert_allclose(kept["loss_sum"], table["loss_sum"], rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(again["token_accuracy"],
                                whole["token_accuracy"])


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_dispatch_threads_leave_the_sums_bitwise_and_raise_a_calls_error(
    monkeypatch):
  """``subset_totals`` runs its calls on ``DISPATCH_THREADS`` threads and
  adds their sums in call order: the totals are bitwise those of one
  thread, also under a thread-local setting of the caller (x64); a call's
  error reaches the caller (no hang, no partial sums)."""
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=5)
  model, params, split = _random_model(config, n=30)
  # 4 examples and one mask of layer 0 a call: 8 batches x 4 chunks.
  kwargs = dict(batch_size=4, rows=16)
  assert oracle.call_shape(config, 4, 16) == (4, 1)
  totals = {}
  for threads in (1, 2, 3):
    monkeypatch.setattr(oracle, "DISPATCH_THREADS", threads)
    totals[threads] = oracle.subset_totals(model, params, split, **kwargs)
  for threads in (2, 3):
    for key, value in totals[1].items():
      np.testing.assert_array_equal(totals[threads][key], value)
  # Under a thread-local setting of the caller's the threads run the
  # executable the caller's thread compiled (oracle._pinned). (On this model
  # x64 does not change the sums, so this checks that path runs and agrees,
  # not that an unpinned thread would differ.)
  with jax.enable_x64(True):
    for threads in (1, 2):
      monkeypatch.setattr(oracle, "DISPATCH_THREADS", threads)
      totals[f"x64-{threads}"] = oracle.subset_totals(model, params, split,
                                                      **kwargs)
  for key, value in totals["x64-1"].items():
    np.testing.assert_array_equal(totals["x64-2"][key], value)
  pinned = oracle._pinned
  calls = []

  def failing_pinned(program, args):
    run = pinned(program, args)

    def failing(a):
      calls.append(None)
      if len(calls) == 5:
        raise FloatingPointError("the fifth call")
      return run(a)
    return failing
  monkeypatch.setattr(oracle, "_pinned", failing_pinned)
  with pytest.raises(FloatingPointError, match="the fifth call"):
    oracle.subset_totals(model, params, split, **kwargs)


@pytest.mark.parametrize("heads, batch_size, rows, want, max_len", [
    ((4, 4), 1000, 8192, (512, 1), 6),  # examples first: one mask of layer 0
    ((4, 4), 8, 8192, (8, 16), 6),      # a small batch: all 16 masks a call
    ((4, 4), 100, 4096, (100, 2), 6),   # then a power of two of them
    ((4, 4, 4), 1000, 4096, (16, 1), 6),
    ((8, 8), 1000, 4096, (16, 1), 6),   # 65,536 subsets, 16 examples a call
    ((8, 8, 8), 1000, 4096, (1, 1), 6),  # 2**24: rows exceeded, one by one
    ((2, 2), 3, 8192, (3, 4), 6),       # a small split: all of it
    ((4, 4), 1000, 4096, (2, 16), 256),  # long windows: 2 a call
    ((4, 4, 4), 1000, 4096, (8, 2), 128),  # the character LM's shape
])
def test_call_shape_bounds_the_rows_of_a_call(heads, batch_size, rows, want,
                                              max_len):
  config = TransformerConfig(vocab_size=7, num_layers=len(heads),
                             num_heads=heads, d_model=16, head_dim=2,
                             mlp_dim=16, max_len=max_len)
  examples, chunk = oracle.call_shape(config, batch_size, rows)
  assert (examples, chunk) == want
  assert examples * max_len ** 2 <= oracle.CALL_ATTENTION_ENTRIES
  rest = 2 ** (sum(heads) - heads[0])
  assert examples * chunk * rest <= max(rows, rest)


def test_the_memory_guess_follows_the_calls_shape():
  # One call's hidden states, as call_shape cuts it: a context of 256 holds
  # 2 windows a call, so its guess stays small (passkey's shape: 0.12 GiB
  # measured, docs in oracle_bytes), and it grows with the width and the
  # subsets.
  def config(heads=4, max_len=256, d_model=64):  # 2 layers of `heads`
    return TransformerConfig(vocab_size=23, num_layers=2, num_heads=heads,
                             d_model=d_model, mlp_dim=256, max_len=max_len,
                             causal=True)
  passkey = oracle.oracle_bytes(config())
  assert passkey < 0.25 * 2**30
  examples, chunk = oracle.call_shape(config(), 1000)
  assert passkey >= 4 * examples * chunk * 16 * 256 * 64  # the call's states
  assert oracle.oracle_bytes(config(d_model=128)) > passkey
  assert oracle.oracle_bytes(config(heads=8)) > passkey


def test_best_removals_by_hand():
  config = TransformerConfig(vocab_size=8, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=4)
  # Heads (flat index): bit 0 -> 0, bit 1 -> 1, bit 2 -> 2, bit 3 -> 3.
  values = np.zeros(16)
  values[0b1111] = 1.0
  values[0b0111] = 0.9   # without head 3
  values[0b1011] = 0.95  # without head 2: the best single removal
  values[0b0011] = 0.8   # layer 1 emptied: the best pair
  values[0b0101] = 0.7   # the best pair keeping a head per layer
  removals = oracle.best_removals(values, config)
  assert [list(r) for r in removals[:3]] == [[], [2], [2, 3]]
  assert len(removals) == 5 and list(removals[4]) == [0, 1, 2, 3]
  kept = oracle.best_removals(values, config, no_layer_emptied=True)
  assert len(kept) == 3  # at most 4 - 2 heads go
  assert [list(r) for r in kept] == [[], [2], [1, 3]]
  with pytest.raises(ValueError, match=r"\[2\*\*N\]"):
    oracle.best_removals(np.zeros(8), config)


def test_shapley_efficiency_symmetry_and_null_player():
  config = TransformerConfig(vocab_size=8, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=4)
  rng = np.random.default_rng(0)
  values = rng.uniform(size=16)
  phi = oracle.shapley_values(values, config).reshape(-1)
  # Efficiency: exact up to float64 rounding of 16 terms.
  assert phi.sum() == pytest.approx(values[-1] - values[0], abs=1e-12)
  # Head 2 a null player, heads 0 and 1 interchangeable:
  # v(S) = f(|S & {0, 1}|) + g(3 in S).
  s = np.arange(16)
  pair = ((s & 1) + ((s >> 1) & 1)).astype(float)
  values = np.array([0.0, 0.3, 0.5])[pair.astype(int)] + 0.2 * ((s >> 3) & 1)
  phi = oracle.shapley_values(values, config).reshape(-1)
  np.testing.assert_allclose(phi, [0.25, 0.25, 0.0, 0.2], atol=1e-12)
  # Against the permutation definition on a random game of 3 heads.
  small = TransformerConfig(vocab_size=8, num_layers=1, num_heads=3,
                            d_model=6, mlp_dim=8, max_len=4)
  values = rng.uniform(size=8)
  expected = np.zeros(3)
  perms = list(itertools.permutations(range(3)))
  for perm in perms:
    subset = 0
    for head in perm:
      expected[head] += values[subset | (1 << head)] - values[subset]
      subset |= 1 << head
  np.testing.assert_allclose(oracle.shapley_values(values, small)[0],
                             expected / len(perms), atol=1e-12)


# --------------------------------------------------------------------------
# A planted model: the best pair to remove is not the two least important.
# --------------------------------------------------------------------------

# One layer, heads A, B, C, D. Every example repeats one token (type 1, 2 or
# 3); attention is uniform, so a head's context is its value of that token.
# The margin of the target class over a rival class, per type:
#   type 1 (50% of tokens): 4 * (1.5 * (A + B) - 1): right iff A or B kept;
#   type 2 (20%):           4 * (C - 0.5):           right iff C kept;
#   type 3 (30%):           4 * (D - 0.5):           right iff D kept.
# Removing A or B alone costs nothing, so both rank least important, but
# removing both loses 50% of the tokens; the best pair, {A or B, C}, loses
# 20%. Shapley values split type 1's credit (A = B = 0.25 > C = 0.2).
_TYPES = {1: (10, (1.5, 1.5, 0.0, 0.0), 1.0),  # examples, per-head d, bar
          2: (4, (0.0, 0.0, 1.0, 0.0), 0.5),
          3: (6, (0.0, 0.0, 0.0, 1.0), 0.5)}
_TARGET, _RIVAL, _SCALE, _BIG = 4, 5, 4.0, 1000.0


def _planted():
  config = TransformerConfig(vocab_size=6, num_layers=1, num_heads=4,
                             d_model=8, mlp_dim=4, max_len=4)
  model = Transformer(config)
  # Every parameter zero but those set below: init's shapes, not its values.
  params = jax.tree.map(lambda a: np.zeros(a.shape, np.float32),
                        jax.eval_shape(model.init, jax.random.key(0),
                                       np.ones((1, 4), np.int32))["params"])
  embed = np.zeros((6, 8), np.float32)
  for t in _TYPES:
    embed[t, t - 1] = 1.0  # coordinates 0-2: the type
  embed[:, 6], embed[:, 7] = _BIG, -_BIG  # LayerNorms ~ a fixed scale
  params["embed"]["embedding"] = embed
  block = params["layer_0"]
  for norm in ("ln_attention", "ln_mlp"):
    block[norm]["scale"] = np.ones(8, np.float32)
  params["ln_final"]["scale"] = np.ones(8, np.float32)
  # Values: head h's first value unit is d_h(type) (LN(embedding) -> d).
  normed = np.asarray(jax.jit(nn.LayerNorm().apply)(  # one program, not 13
      {"params": {"scale": np.ones(8), "bias": np.zeros(8)}}, embed[1:4]))
  wanted = np.asarray([_TYPES[t][1] for t in (1, 2, 3)])  # [3 types, 4 heads]
  kernel, *_ = np.linalg.lstsq(normed, wanted, rcond=None)
  block["attention"]["value"]["kernel"][:, :, 0] = kernel
  block["attention"]["out"]["kernel"][:, 0, 3] = 1.0  # into coordinate 3
  # Logits from the final LayerNorm (scale sigma ~ BIG / 2): target reads
  # coordinate 3, the rival the type's bar; other classes never win.
  sigma = _BIG / 2
  logits = np.zeros((8, 6), np.float32)
  logits[3, _TARGET], logits[4, _TARGET] = _SCALE * sigma, -_SCALE * sigma
  for t, (_, _, bar) in _TYPES.items():
    logits[t - 1, _RIVAL] = _SCALE * sigma * bar
    logits[4, _RIVAL] -= _SCALE * sigma * bar
  params["logits"]["kernel"] = logits
  params["logits"]["bias"] = np.asarray([-20, -20, -20, -20, 0, 0],
                                        np.float32)
  inputs = np.concatenate([np.full((n, 4), t, np.int32)
                           for t, (n, _, _) in _TYPES.items()])
  targets = np.full(inputs.shape, _TARGET, np.int32)
  return model, params, data.Split(inputs, targets)


@pytest.fixture(scope="module", name="planted")
def planted_fixture():
  """The planted model, its split, the metrics of every subset and every
  ordering of :func:`orderings.compute_orders` (built once per module)."""
  model, params, split = _planted()
  # The batch size of compute_orders below: one compiled program for both.
  metrics = oracle.evaluate_subsets(model, params, split, batch_size=32)
  orders = orderings.compute_orders(model, params, split, batch_size=32,
                                    oracle_max_heads=12, reestimate=True)
  return model, params, split, metrics, orders


@pytest.mark.slow  # the planted fixture: seconds of compiling
def test_planted_model_has_the_designed_accuracies(planted):
  _, _, _, metrics, _ = planted
  acc = metrics["token_accuracy"]
  full, a, b, c, d = 0b1111, 0b0001, 0b0010, 0b0100, 0b1000
  assert acc[full] == 1.0
  assert acc[full & ~a] == acc[full & ~b] == 1.0
  assert acc[full & ~(a | b)] == pytest.approx(0.5)
  assert acc[full & ~c] == pytest.approx(0.8)
  assert acc[full & ~(a | c)] == pytest.approx(0.8)
  assert acc[0] == 0.0


@pytest.mark.slow  # the planted fixture: seconds of compiling
def test_oracle_finds_the_pair_the_greedy_orders_miss(planted):
  model, params, split, metrics, orders = planted
  a, b, c = 0, 1, 2  # flat head indices
  removals = oracle.best_removals(oracle.subset_values(metrics),
                                  model.config)
  assert sorted(removals[2]) in ([a, c], [b, c])
  # The study's entry point chooses the same subsets.
  ranked = oracle.oracle_removals(model, params, split, batch_size=32)
  for k, best in enumerate(removals):
    np.testing.assert_array_equal(ranked[k][0], best)
  for name in ("gradient", "gradient_l2", "leave_one_out"):
    assert sorted(orders[name][:2]) == [a, b], (name, orders[name])
  pair = lambda order: head_masks.mask_without(model.config, order[:2])
  accuracy = lambda mask: core.evaluate_masks(
      model, params, split, mask[None])["token_accuracy"][0]
  assert accuracy(pair(orders["gradient"])) == pytest.approx(0.5)
  assert accuracy(pair(removals[2])) == pytest.approx(0.8)
  # Measures that account for interactions get it right here: Shapley
  # values split type 1's credit between A and B, and re-estimating the
  # gradient after A is gone sees that B is now needed.
  for name in ("shapley", "gradient_iterative"):
    assert sorted(orders[name][:2]) in ([a, c], [b, c]), (name, orders[name])
  shapley = oracle.shapley_values(metrics["token_accuracy"], model.config)
  np.testing.assert_allclose(shapley[0], [0.25, 0.25, 0.2, 0.3], atol=1e-6)


@pytest.mark.slow  # the planted fixture: seconds of compiling
def test_compute_orders_computes_only_what_is_asked(planted):
  model, params, split, _, full = planted
  orders = orderings.compute_orders(model, params, split, batch_size=32,
                                    oracle_max_heads=12, reestimate=True,
                                    names=["gradient"])
  assert "shapley" not in orders and "gradient_iterative" not in orders
  np.testing.assert_array_equal(orders["gradient"], full["gradient"])
  assert {"shapley", "gradient_iterative"} <= set(full)
