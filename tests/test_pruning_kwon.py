"""Tests of retraining-free pruning after Kwon et al. (mha.pruning.kwon)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_model_and_split

from mha import data
from mha import head_masks
from mha.model import TransformerConfig
from mha.pruning import core
from mha.pruning import kwon

CONFIG = TransformerConfig(vocab_size=7, num_layers=2, num_heads=3,
                           d_model=12, mlp_dim=16, max_len=5)


def _model_and_split(config=CONFIG, seed=0, n=24):
  return random_model_and_split(config, seed=seed, n=n)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_fisher_equals_a_loop_of_per_example_gradients():
  model, params, split = _model_and_split(n=12)
  blocks = kwon.fisher_blocks(model, params, split, batch_size=5)
  full = jnp.asarray(head_masks.full_head_mask(CONFIG))
  # One example at a time (one compiled gradient, called per example).
  grad = jax.jit(jax.grad(lambda m, x, y: core.per_example_loss(
      model, params, x[None], y[None], m)[0]))
  want = np.zeros_like(blocks)
  for x, y in zip(split.inputs, split.targets):
    g = np.asarray(grad(full, x, y), np.float64)
    want += np.einsum("lh,lg->lhg", g, g)
  np.testing.assert_allclose(blocks, want / len(split), rtol=1e-4,
                             atol=1e-10)
  importance = kwon.fisher_importance(blocks, CONFIG)
  np.testing.assert_allclose(importance,
                             np.diagonal(want, axis1=1, axis2=2) / len(split),
                             rtol=1e-4, atol=1e-10)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_fisher_is_nan_and_zero_where_no_head():
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=(3, 1),
                             d_model=12, head_dim=4, mlp_dim=16, max_len=5)
  model, params, split = _model_and_split(config)
  blocks = kwon.fisher_blocks(model, params, split)
  assert blocks.shape == (2, 3, 3)
  assert np.all(blocks[1, 1:] == 0) and np.all(blocks[1, :, 1:] == 0)
  importance = kwon.fisher_importance(blocks, config)
  assert np.isnan(importance[1, 1:]).all()
  assert np.isfinite(importance[0]).all() and importance[1, 0] > 0


def test_search_removes_least_fisher_then_rearranges_within_layers():
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=3,
                             d_model=12, mlp_dim=16, max_len=5)
  blocks = np.zeros((2, 3, 3))
  blocks[0] = np.diag([1.0, 2.0, 3.0])
  blocks[1] = np.diag([0.5, 0.6, 5.0])
  # Heads 0 and 1 of layer 1 interact: removing both costs more than their
  # diagonals say.
  blocks[1, 0, 1] = blocks[1, 1, 0] = 10.0
  # Fisher alone: the two smallest diagonals, (1, 0) and (1, 1).
  assert kwon.search(blocks, config, 2, rearrange=False) == [3, 4]
  # Rearranged: layer 1 still loses two heads, but 0 and 2 (0.5 + 5 = 5.5)
  # beat 0 and 1 (0.5 + 0.6 + 2 * 10 = 21.1).
  assert kwon.search(blocks, config, 2) == [3, 5]
  # One head: nothing to rearrange against in its layer's block.
  assert kwon.search(blocks, config, 1) == [3]
  assert kwon.search(blocks, config, 0) == []
  assert kwon.search(blocks, config, 6) == list(range(6))
  with pytest.raises(ValueError, match="k=7"):
    kwon.search(blocks, config, 7)


def test_rearrangement_never_raises_the_block_estimate():
  rng = np.random.default_rng(1)
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=4,
                             d_model=16, mlp_dim=16, max_len=5)
  for _ in range(20):
    g = rng.normal(size=(2, 4, 6))
    blocks = np.einsum("lhx,lgx->lhg", g, g)  # positive semi-definite
    for k in range(9):
      def estimate(removed):
        r = np.zeros(8)
        r[removed] = 1
        r = r.reshape(2, 4)
        return sum(r[l] @ blocks[l] @ r[l] for l in range(2))
      plain = kwon.search(blocks, config, k, rearrange=False)
      rearranged = kwon.search(blocks, config, k)
      assert len(rearranged) == k
      assert estimate(rearranged) <= estimate(plain) + 1e-12
      # The same number of heads per layer.
      assert (np.bincount(np.asarray(plain, int) // 4, minlength=2) ==
              np.bincount(np.asarray(rearranged, int) // 4,
                          minlength=2)).all()


# Jitted, as is _scaled_copy: one program, not an update op by op.
@functools.partial(jax.jit, static_argnames=("layer", "source", "copy"))
def _duplicate_head(params, layer, source, copy):
  """Head ``copy`` of ``layer`` made identical to head ``source``."""
  attention = dict(params[f"layer_{layer}"]["attention"])
  for name in ("query", "key", "value"):
    kernel = attention[name]["kernel"].at[:, copy].set(
        attention[name]["kernel"][:, source])
    bias = attention[name]["bias"].at[copy].set(attention[name]["bias"][source])
    attention[name] = {"kernel": kernel, "bias": bias}
  out = attention["out"]["kernel"].at[copy].set(
      attention["out"]["kernel"][source])
  attention["out"] = {"kernel": out, "bias": attention["out"]["bias"]}
  layer_params = dict(params[f"layer_{layer}"], attention=attention)
  return dict(params, **{f"layer_{layer}": layer_params})


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_tuning_recovers_a_removed_duplicate_where_zero_ablation_fails():
  """A planted model: head 1 of layer 0 a copy of head 0, the targets the
  full model's own predictions. Removing the copy and doubling head 0 is
  the same model, which the fit finds; zero ablation loses tokens."""
  model, params, split = _model_and_split(n=32)
  params = _duplicate_head(params, layer=0, source=0, copy=1)
  full_mask = head_masks.full_head_mask(CONFIG)
  # Jitted: the targets come from one program, not op by op.
  logits = jax.jit(core.masked_logits, static_argnums=0)(
      model, params, split.inputs, full_mask)
  targets = np.where(split.inputs != 0, np.argmax(np.asarray(logits), -1), 0)
  split = data.Split(split.inputs, targets.astype(np.int32))
  mask = head_masks.mask_without(CONFIG, [1])  # drop the copy
  tuned = kwon.tune_mask_attention_output(model, params, split, mask)
  # Head 0 doubled stands in for both; the rest unchanged (to the fit's
  # float32 inputs).
  np.testing.assert_allclose(tuned[0], [2.0, 0.0, 1.0], atol=1e-3)
  np.testing.assert_allclose(tuned[1], [1.0, 1.0, 1.0], atol=1e-3)
  assert tuned[0, 1] == 0.0
  metrics = core.evaluate_masks(model, params, split,
                                np.stack([full_mask, mask, tuned]))
  full, zero, fitted = metrics["loss"]
  assert fitted == pytest.approx(full, rel=1e-3)
  assert fitted < zero
  assert metrics["token_accuracy"][0] == metrics["token_accuracy"][2] == 1.0
  assert metrics["token_accuracy"][1] < 1.0


@pytest.mark.slow
def test_tuning_keeps_removed_heads_and_empty_layers_at_zero():
  model, params, split = _model_and_split()
  mask = head_masks.mask_without(CONFIG, [0, 1, 2, 4])  # layer 0 emptied
  tuned = kwon.tune_mask_attention_output(model, params, split, mask)
  np.testing.assert_array_equal(tuned[0], [0, 0, 0])
  assert tuned[1, 1] == 0 and np.all(tuned[1, [0, 2]] != 0)
  assert np.all(np.isfinite(tuned))


def test_fit_scales_recovers_planted_scales_and_intercept():
  """Kwon et al.'s least squares: a target made of the heads at known scales
  plus a constant gives the scales back (the constant is fitted and
  dropped); without the intercept column the constant biases them."""
  rng = np.random.default_rng(0)
  heads = rng.normal(size=(3, 400)) + 0.5  # not centred: the constant matters
  planted = np.array([1.5, -0.5, 2.0])
  target = planted @ heads + 0.3
  # Exact data: only the ridge (1e-6 of the mean diagonal) moves the fit.
  np.testing.assert_allclose(
      kwon.fit_scales(heads, target, intercept=True, prior=1.0), planted,
      atol=1e-4)
  assert not np.allclose(kwon.fit_scales(heads, target), planted, atol=1e-2)
  # A strong ridge pulls towards its prior: Kwon et al.'s towards 1.
  np.testing.assert_allclose(
      kwon.fit_scales(heads, target, intercept=True, prior=1.0, ridge=1e6),
      1.0, atol=1e-3)


@functools.partial(jax.jit, static_argnames=("layer", "source", "copy"))
def _scaled_copy(params, layer, source, copy, factor):
  """Head ``copy`` of ``layer`` made head ``source`` with its output
  multiplied by ``factor`` (its output-projection rows scaled)."""
  params = _duplicate_head(params, layer=layer, source=source, copy=copy)
  attention = dict(params[f"layer_{layer}"]["attention"])
  kernel = attention["out"]["kernel"]
  attention["out"] = dict(attention["out"],
                          kernel=kernel.at[copy].multiply(factor))
  layer_params = dict(params[f"layer_{layer}"], attention=attention)
  return dict(params, **{f"layer_{layer}": layer_params})


@pytest.mark.slow  # seconds of compiling three layers: the full suite only
def test_tuning_as_kwon_et_al_wrote_it():
  """Kwon et al.'s target (layer output with the residual), on a planted
  model: head 0 of layer 1 is head 1 at a known fraction, so with head 1
  removed the exact fit scales head 0 by 1 + 1 / fraction. Layer 0 is never
  tuned; a scale outside [-10, 10] is rejected and tuning stops there."""
  config = TransformerConfig(vocab_size=7, num_layers=3, num_heads=3,
                             d_model=12, mlp_dim=16, max_len=5)
  model, params, split = _model_and_split(config, n=16)
  planted = _scaled_copy(params, layer=1, source=1, copy=0, factor=0.5)
  # Flat indices: layer l, head h is 3 l + h.
  masks = [head_masks.mask_without(config, [4]),      # head 1 of layer 1
           head_masks.mask_without(config, [2, 4])]   # and head 2 of layer 0
  tuned = kwon.tune_masks(model, planted, split, masks)
  assert tuned.rejected_layers == [None, None]
  # Layers 0 and 1 hold nothing else, layer 2's input is the unpruned one:
  # the exact fit (1e-3: float32 activations, the ridge).
  np.testing.assert_allclose(tuned.masks[0], [[1, 1, 1], [3, 0, 1],
                                              [1, 1, 1]], atol=1e-3)
  # Layer 0 untouched though a head is gone; layer 1 corrects what that
  # left in the residual stream, so its values move off the exact fit.
  np.testing.assert_array_equal(tuned.masks[1][0], [1, 1, 0])
  assert tuned.masks[1][1, 1] == 0
  assert np.abs(tuned.masks[1][1] - [3, 0, 1]).max() > 1e-2
  # Head 0 at 1/20 of head 1 needs a scale of 21: rejected at layer 1, and
  # layer 2 (head 0 removed) is left untuned above it.
  far = _scaled_copy(params, layer=1, source=1, copy=0, factor=0.05)
  mask = head_masks.mask_without(config, [4, 6])
  rejected = kwon.tune_masks(model, far, split, [mask])
  assert rejected.rejected_layers == [1]
  np.testing.assert_array_equal(rejected.masks[0], mask)
  # Without the bound (and the ridge, which pulls a head this small towards
  # 1 by 0.1%) the same fit finds the planted 21.
  free = kwon.tune_mask(model, far, split, mask, limit=np.inf, ridge=0.0)
  assert free[1, 0] == pytest.approx(21.0, rel=1e-3)
  assert np.all(free[2, 1:] != 1) and free[2, 0] == 0
