"""Tests of the ablation modes and attribution patching
(mha.pruning.ablation), through the mask evaluation and the oracle."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import random_model_and_split

from mha import head_masks
from mha.model import TransformerConfig
from mha.pruning import ablation
from mha.pruning import core
from mha.pruning import mean_ablation
from mha.pruning import oracle

CONFIG = TransformerConfig(vocab_size=7, num_layers=2, num_heads=2,
                           d_model=8, mlp_dim=12, max_len=5)


def _model_and_split(seed=0, n=20):
  return random_model_and_split(CONFIG, seed=seed, n=n, min_length=2)


@pytest.fixture(scope="module")
def setup():
  model, params, split = _model_and_split()
  means = ablation.position_means(model, params, split)
  modes = {mode: ablation.build(model, params, mode, split, split,
                                means=means)
           for mode in ablation.MODES}
  return model, params, split, modes


def _contexts(model, params, inputs):
  """Per layer each head's context [B, T, H, Dh] in the unpruned model."""
  found = {}

  def capture(next_fun, args, kwargs, context):
    path = context.module.path
    if path[-2:] == ("attention", "out") and context.method_name == "__call__":
      found[int(path[-3].split("_")[-1])] = args[0]
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(capture):
    model.apply({"params": params}, inputs, return_weights=False)
  return found


@pytest.mark.slow  # compiles several programs: the full suite only
def test_resample_replaces_each_removed_heads_context_by_the_donors(setup):
  model, params, split, modes = setup
  abl = modes["resample"]
  donors = np.asarray(abl.donors)
  np.testing.assert_array_equal(donors != 0, split.inputs != 0)
  assert np.mean(np.all(donors == split.inputs, axis=1)) < 0.5
  mask = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
  # Jitted, as is the long way below: each runs as one program, not op by op.
  got = jax.jit(ablation.ablated_logits, static_argnums=0)(
      model, params, split.inputs, mask, abl)
  # The long way: the context itself swapped before the out-projection.
  donor_contexts = jax.jit(_contexts, static_argnums=0)(model, params, donors)

  def swap(next_fun, args, kwargs, context):
    path = context.module.path
    if path[-2:] == ("attention", "out") and context.method_name == "__call__":
      layer = int(path[-3].split("_")[-1])
      m = mask[layer][None, None, :, None]
      args = (args[0] * m + (1 - m) * donor_contexts[layer],) + args[1:]
    return next_fun(*args, **kwargs)

  @jax.jit
  def long_way(params, inputs):
    with nn.intercept_methods(swap):
      return model.apply({"params": params}, inputs, head_mask=list(mask),
                         return_weights=False)[0]
  want = long_way(params, split.inputs)
  valid = split.inputs != 0
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid],
                             atol=2e-5)


@pytest.mark.slow  # compiles several programs: the full suite only
def test_mean_equals_the_folded_mean_ablation(setup):
  model, params, split, modes = setup
  masks = head_masks.leave_one_out_masks(CONFIG)
  got = core.evaluate_masks(model, params, split, masks, per_example=True,
                            ablation=modes["mean"])
  shifts = mean_ablation.bias_shifts(
      params, CONFIG, mean_ablation.head_means(model, params, split))
  want = mean_ablation.evaluate_masks(model, params, shifts, split, masks)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # compiles several programs: the full suite only
def test_oracle_and_batches_agree_with_mask_evaluation(setup):
  model, params, split, modes = setup
  abl = modes["resample"]
  masks = oracle.subset_masks(CONFIG)
  want = core.evaluate_masks(model, params, split, masks, per_example=True,
                             ablation=abl)
  # Other batch cuts: resample's donors must follow their examples.
  again = core.evaluate_masks(model, params, split, masks, per_example=True,
                              ablation=abl, batch_size=24)
  table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                  batch_size=7, ablation=abl)
  streamed = oracle.subset_totals(model, params, split, batch_size=7,
                                  rows=64, ablation=abl)
  for key in ("loss_sum", "correct", "exact"):
    np.testing.assert_allclose(again[key], want[key], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(table[key], want[key], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(streamed[key], want[key].sum(-1), rtol=1e-5,
                               atol=1e-3)
  # An ablation changes what a removed head outputs.
  zero = core.evaluate_masks(model, params, split, masks, per_example=True)
  assert not np.allclose(zero["loss_sum"][:-1], want["loss_sum"][:-1])


@pytest.mark.slow  # compiles several programs: the full suite only
@pytest.mark.parametrize("mode", ["zero", "resample"])
def test_attribution_is_minus_the_mask_derivative(setup, mode):
  model, params, split, modes = setup
  abl = modes[mode]
  got = ablation.attribution(model, params, split, abl, batch_size=8)
  eps = 1e-2

  def loss(mask):
    return core.evaluate_masks(model, params, split, mask[None],
                               ablation=abl)["loss"][0]
  full = head_masks.full_head_mask(CONFIG)
  base = loss(full)
  for layer in range(CONFIG.num_layers):
    for head in range(CONFIG.num_heads):
      mask = full.copy()
      mask[layer, head] -= eps
      # Central difference around m = 1 is not available (m <= 1 is a
      # mask); a one-sided one is exact to O(eps) for this smooth loss.
      fd = (loss(mask) - base) / eps
      np.testing.assert_allclose(got[layer, head], fd, rtol=0.05, atol=2e-3)


@pytest.mark.slow
def test_resample_donors_share_the_length_and_are_others():
  split = _model_and_split(n=30)[2]
  donors = ablation.resample_donors(split, np.random.default_rng(1))
  lengths = split.lengths
  np.testing.assert_array_equal(lengths[donors], lengths)
  counts = np.bincount(lengths)
  alone = counts[lengths] == 1
  np.testing.assert_array_equal(donors == np.arange(30), alone)


def test_an_unknown_mode_is_refused():
  with pytest.raises(ValueError, match="'half'.*zero, mean, mean_position"):
    ablation.check_mode("half")
