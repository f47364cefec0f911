"""Retraining after pruning (mha.pruning.retrain): the arms' starting points
and budgets."""

import jax
import numpy as np
import optax
import pytest

from configs import default
from mha import build
from mha import checkpoint as ckpt_lib
from mha import data
from mha import head_masks
from mha.model import Transformer, TransformerConfig
from mha.pruning import core
from mha.pruning import retrain

from conftest import (assert_same_bits, init_params, random_model_and_split,
                      tiny_config)

CONFIG = TransformerConfig(vocab_size=8, num_layers=2, num_heads=3,
                           d_model=12, mlp_dim=8, max_len=6)
#: Removed flat heads (layer * 3 + head) of each mask: one head of layer 0;
#: layer 1 emptied and one head of layer 0.
REMOVED = ([1], [0, 3, 4, 5])


def _masks():
  return np.stack([head_masks.mask_without(CONFIG, r) for r in REMOVED])


def _pairs(removed):
  return [(h // CONFIG.max_heads, h % CONFIG.max_heads) for h in removed]


@pytest.mark.slow  # compiles an initialisation per architecture
def test_scratch_arms_have_the_pruned_shapes_from_step_0():
  model = Transformer(CONFIG)
  seeds = np.asarray([7, 8])
  stacked = retrain.scratch_params(model, _masks(), seeds)
  for r, removed in enumerate(REMOVED):
    params = jax.tree.map(lambda x, r=r: x[r], stacked)
    pruned, pruned_config = core.prune_heads(params, CONFIG, _pairs(removed))
    assert pruned_config == retrain.pruned_model_config(CONFIG, _masks()[r])
    # The pruned architecture's own initialisation: its shapes, its values
    # (so the output projection's fan-in is the kept heads').
    expected = init_params(Transformer(pruned_config),
                           jax.random.key(int(seeds[r])))
    assert (jax.tree.map(np.shape, pruned)
            == jax.tree.map(np.shape, expected))
    jax.tree.map(np.testing.assert_array_equal, pruned, expected)
    # The removed heads' slots hold zeros.
    for layer, head in _pairs(removed):
      attention = params[f"layer_{layer}"]["attention"]
      assert not np.any(attention["query"]["kernel"][:, head])
      assert not np.any(attention["out"]["kernel"][head])
  assert (retrain.pruned_model_config(CONFIG, _masks()[1]).heads_per_layer
          == (2, 0))


@pytest.mark.slow
def test_a_masked_scratch_model_trains_as_the_pruned_model():
  model, _, split = random_model_and_split(CONFIG, n=64)
  run = default.get_config("tiny,batch_size=16")
  mask = _masks()[1]
  stacked = retrain.scratch_params(model, mask[None], np.asarray([3]))
  trained, _ = retrain.finetune_masked(model, stacked, mask[None], split, run,
                                       steps=4)
  pruned_config = retrain.pruned_model_config(CONFIG, mask)
  pruned_model = Transformer(pruned_config)
  start = init_params(pruned_model, jax.random.key(3))
  ones = np.ones((1, CONFIG.num_layers, pruned_config.max_heads))
  expected, _ = retrain.finetune_masked(
      pruned_model, retrain.stack(start, 1), ones, split, run, steps=4)
  got, _ = core.prune_heads(jax.tree.map(lambda x: x[0], trained), CONFIG,
                            _pairs(REMOVED[1]))
  expected = jax.tree.map(lambda x: x[0], expected)
  # The key bias adds the same logit to every key of a query, so its true
  # gradient is 0 and Adam turns its rounding noise into steps of either
  # sign: it differs, and nothing it does can be seen. Every other parameter
  # takes the same updates, float32 sums in another order.
  for layer in ("layer_0", "layer_1"):
    for tree in (got, expected):
      tree[layer]["attention"].get("key", {}).pop("bias", None)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
               got, expected)
  # And the removed heads stayed at zero.
  attention = jax.tree.map(lambda x: x[0], trained)["layer_1"]["attention"]
  assert not np.any(np.asarray(attention["value"]["kernel"]))


@pytest.mark.slow  # compiles the stacked step and a single-model step
def test_each_stacked_model_trains_as_it_would_alone():
  model, params, split = random_model_and_split(CONFIG, n=64)
  run = default.get_config("tiny,batch_size=16")
  masks, steps = _masks()[[0, 1, 0]], np.asarray([5, 3, 5])
  trained, info = retrain.finetune_masked(model, retrain.stack(params, 3),
                                          masks, split, run, steps=steps)
  for r in (0, 1):
    # The run's optimizer for this many steps, its schedule compiled in, one
    # model alone: the stacked program takes the same steps.
    optimizer = build.make_optimizer(retrain.retrain_config(run,
                                                            int(steps[r])))

    def plain(p, state, mask, inputs, targets, rng, optimizer=optimizer):
      loss, grads = jax.value_and_grad(retrain._loss)(  # pylint: disable=protected-access
          p, model, inputs, targets, mask, rng)
      updates, state = optimizer.update(grads, state, p)
      return optax.apply_updates(p, updates), state, loss

    step = jax.jit(plain)
    p, state = params, optimizer.init(params)
    for s in range(steps[r]):
      batch = data.train_batch(split, seed=run.seed, step=s,
                               batch_size=run.batch_size)
      p, state, loss = step(p, state, masks[r], batch["inputs"],
                            batch["targets"],
                            jax.random.fold_in(jax.random.key(run.seed), s))
    # Equal to float32 rounding: the two programs are compiled apart, and
    # XLA:CPU may fuse the products differently inside the stacked program's
    # loop. The key bias aside: its
    # true gradient is 0 and Adam turns rounding noise into steps of either
    # sign (see above).
    got = jax.tree.map(lambda a, r=r: np.asarray(a[r]), trained)
    alone = jax.tree.map(np.asarray, p)
    for tree in (got, alone):
      for layer in ("layer_0", "layer_1"):
        tree[layer]["attention"].get("key", {}).pop("bias", None)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6), got, alone)
    assert info["final_loss"][r] == pytest.approx(float(loss), rel=1e-5)
  # The same job twice trains to the same bits (the models of a stack do not
  # interact): the study trains such duplicates once. Last: skipped off CPU
  # but on a GPU under XLA's deterministic ops (conftest.assert_same_bits).
  assert_same_bits(jax.tree.map(lambda x: x[0], trained),
                   jax.tree.map(lambda x: x[2], trained))


def test_scratch_b_steps_follow_the_flop_rule():
  config = TransformerConfig(vocab_size=12, num_layers=2, num_heads=4,
                             d_model=32, mlp_dim=64, max_len=16)
  # Per head: q, k, v, out 8 * 16 * 32 * 8 = 32768 and scores and values
  # 4 * 16^2 * 8 = 8192, so 40960; per layer the feed-forward
  # 4 * 16 * 32 * 64 = 131072; the logits 2 * 16 * 32 * 12 = 12288.
  full = 2 * (4 * 40960 + 131072) + 12288
  assert retrain.forward_flops(config) == full
  half = head_masks.mask_without(config, [0, 1, 4, 5])
  assert retrain.forward_flops(
      retrain.pruned_model_config(config, half)) == full - 4 * 40960
  # round(500 * 602112 / 438272) + 100 = round(686.9) + 100.
  assert retrain.scratch_b_steps(config, half, train_steps=500,
                                 finetune_steps=100) == 787
  nothing = np.ones((2, 4))
  assert retrain.scratch_b_steps(config, nothing, train_steps=500,
                                 finetune_steps=100) == 600


@pytest.mark.slow
def test_rewind_starts_from_the_runs_step_0_weights(data_dir, tmp_path):
  from mha import train  # pylint: disable=import-outside-toplevel
  # The schedule's first learning rate is 0 (warmup from 0): a one-step run
  # saves its step-0 parameters.
  config = tiny_config(data_dir, "num_train_steps=1", "warmup_steps=1",
                       "seed=3")
  state = train.train_and_evaluate(config, str(tmp_path))
  saved = ckpt_lib.load_checkpoint(str(tmp_path))
  assert int(state.step) == 1
  model = build.make_model(config)
  step0 = retrain.step0_params(model, config)
  jax.tree.map(np.testing.assert_array_equal, saved.params, step0)
  # Another seed's initialisation differs.
  other = retrain.step0_params(model, tiny_config(data_dir, "seed=4"))
  assert not np.array_equal(other["logits"]["kernel"],
                            step0["logits"]["kernel"])
