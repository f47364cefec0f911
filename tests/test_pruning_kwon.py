"""Tests of retraining-free pruning after Kwon et al. (mha.pruning.kwon)."""

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
  params = _duplicate_head(params, 0, source=0, copy=1)
  full_mask = head_masks.full_head_mask(CONFIG)
  logits = core.masked_logits(model, params, split.inputs, full_mask)
  targets = np.where(split.inputs != 0, np.argmax(logits, -1), 0)
  split = data.Split(split.inputs, targets.astype(np.int32))
  mask = head_masks.mask_without(CONFIG, [1])  # drop the copy
  tuned = kwon.tune_mask(model, params, split, mask)
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


def test_tuning_keeps_removed_heads_and_empty_layers_at_zero():
  model, params, split = _model_and_split()
  mask = head_masks.mask_without(CONFIG, [0, 1, 2, 4])  # layer 0 emptied
  tuned = kwon.tune_mask(model, params, split, mask)
  np.testing.assert_array_equal(tuned[0], [0, 0, 0])
  assert tuned[1, 1] == 0 and np.all(tuned[1, [0, 2]] != 0)
  assert np.all(np.isfinite(tuned))
