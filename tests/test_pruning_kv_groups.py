"""Tests of pruning whole key/value groups (mha.pruning.kv_groups)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import data
from mha.model import Transformer, TransformerConfig
from mha.pruning import core
from mha.pruning import kv_groups

CONFIG = TransformerConfig(vocab_size=9, num_layers=2, num_heads=4,
                           d_model=8, mlp_dim=8, max_len=6, causal=True,
                           num_kv_heads=2)


def test_group_masks_keep_or_remove_a_groups_query_heads_together():
  assert kv_groups.is_grouped(CONFIG)
  assert not kv_groups.is_grouped(TransformerConfig(vocab_size=9))
  assert not kv_groups.is_grouped(TransformerConfig(vocab_size=9,
                                                    num_kv_heads=4))
  assert kv_groups.num_groups(CONFIG) == 4
  masks = kv_groups.subset_masks(CONFIG)  # [16, L, G]
  assert masks.shape == (16, 2, 2)
  # Subset 0b0110 keeps groups 1 (layer 0, group 1) and 2 (layer 1, group 0).
  np.testing.assert_array_equal(masks[0b0110], [[0, 1], [1, 0]])
  np.testing.assert_array_equal(kv_groups.head_mask(CONFIG, masks[0b0110]),
                                [[0, 0, 1, 1], [1, 1, 0, 0]])
  assert kv_groups.removed_groups(CONFIG, 0b0110) == [(0, 0), (1, 1)]
  np.testing.assert_array_equal(kv_groups.kept_counts(CONFIG)[[0, 5, 15]],
                                [0, 2, 4])
  # A chain removes the order's groups one at a time.
  np.testing.assert_array_equal(
      kv_groups.chain_subsets(CONFIG, np.array([2, 0, 3, 1])),
      [0b1111, 0b1011, 0b1010, 0b0010, 0b0000])


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_a_groups_gradient_is_its_mask_derivative_per_example():
  model = Transformer(CONFIG)
  params = model.init(jax.random.key(0), jnp.ones((1, 6), jnp.int32))["params"]
  rng = np.random.default_rng(0)
  split = data.Split(rng.integers(1, 9, (5, 6)).astype(np.int32),
                     rng.integers(0, 9, (5, 6)).astype(np.int32))
  got = kv_groups.group_gradients(model, params, split, batch_size=2)
  assert got.shape == (5, 4)
  # The derivative of each example's loss by each group's mask, [L, G],
  # where the mask scales all the group's query heads.
  def loss(group_mask, x, y):
    heads = jnp.repeat(group_mask, 2, axis=-1)
    return core.per_example_loss(model, params, x[None], y[None], heads)[0]
  want = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(
      jnp.ones((2, 2)), split.inputs, split.targets)
  np.testing.assert_allclose(got, np.asarray(want).reshape(5, 4), rtol=1e-4,
                             atol=1e-6)
  importance = kv_groups.group_importance(got)
  np.testing.assert_allclose(importance["gradient"], np.abs(got).mean(0))
  np.testing.assert_allclose(importance["fisher"], np.square(got).mean(0))


def test_a_head_order_removes_a_group_with_its_last_query_head():
  # 2 layers x 4 query heads in 2 groups of 2: head (l, h) is flat 4 l + h,
  # group (l, h // 2) is unit 2 l + h // 2.
  order = np.array([0, 5, 4, 2, 6, 1, 3, 7])
  # Head 4 completes group (1, 0) = unit 2; head 1 group (0, 0) = unit 0;
  # head 3 group (0, 1) = unit 1; head 7 group (1, 1) = unit 3.
  np.testing.assert_array_equal(kv_groups.induced_order(CONFIG, order),
                                [2, 0, 1, 3])
  # Brute force: a group goes at the position of its latest query head.
  rng = np.random.default_rng(0)
  orders = np.stack([rng.permutation(8) for _ in range(20)])
  got = kv_groups.induced_order(CONFIG, orders)
  assert got.shape == (20, 4)
  for order, groups in zip(orders, got):
    last = [max(np.flatnonzero(np.isin(order, [4 * (u // 2) + 2 * (u % 2),
                                                4 * (u // 2) + 2 * (u % 2)
                                                + 1])))
            for u in range(4)]
    np.testing.assert_array_equal(groups, np.argsort(last))
  with pytest.raises(ValueError, match="removes 3 of the 4 groups"):
    kv_groups.induced_order(CONFIG, order[:-1])
