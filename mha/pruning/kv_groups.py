"""Whole key/value groups of a grouped-query attention model, pruned.

Under grouped-query attention (``TransformerConfig.num_kv_heads``) the query
heads of a layer share ``num_kv_heads`` key/value heads: query head ``h`` of a
layer with ``H`` heads reads group ``h // (H / num_kv_heads)`` (the layer's
own convention, :func:`mha.attention._qk_logits`). Removing a whole group
removes its key and value projections and all its query heads; removing only
some of its query heads saves no key/value cache. So a GQA model is pruned at
two granularities: heads and groups. A group mask ``[L, G]`` is the head mask
that keeps or removes all of a group's query heads together
(:func:`head_mask`), so every technique on head masks (the metrics under a
mask, the per-example head-mask gradients) serves groups too:

* the group's gradient is the sum of its heads' (the chain rule: the group
  mask multiplies each of its heads' masks), taken per example before the
  absolute value, as Michel et al. do for heads (:func:`group_gradients`);
* the oracle over groups is every subset of the ``U`` groups
  (:func:`subset_masks`, ``2**U`` masks, few: 16 for 2 layers of 2 groups),
  in the oracle's bit convention (subset ``s`` keeps group ``u`` iff bit
  ``u`` of ``s`` is set; groups flat, layer by layer).

    masks = kv_groups.subset_masks(config)             # [2**U, L, G]
    heads = kv_groups.head_mask(config, masks)          # [2**U, L, H]
    sums = core.evaluate_masks(model, params, split, heads, per_example=True)

NumPy on the host for the masks and orders; the gradients are
:func:`mha.pruning.core.head_mask_gradients` (pure JAX) summed.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import head_masks
from mha.aliases import Params
from mha.model import Transformer, TransformerConfig
from mha.pruning import core
from mha.pruning import ablation as ablation_lib


def is_grouped(config: TransformerConfig) -> bool:
  """Whether some layer's query heads share key/value heads (GQA or MQA)."""
  kv = config.num_kv_heads
  return kv is not None and any(h not in (0, kv)
                                for h in config.heads_per_layer)


def groups_per_layer(config: TransformerConfig) -> tuple[int, ...]:
  """The key/value groups of every layer (0 for a layer without heads)."""
  kv = config.num_kv_heads or 0
  return tuple(kv if h else 0 for h in config.heads_per_layer)


def num_groups(config: TransformerConfig) -> int:
  """``U``: the key/value groups of the whole model."""
  return sum(groups_per_layer(config))


def _flat_groups(config: TransformerConfig) -> list[tuple[int, int]]:
  """``(layer, group)`` of every group, layer by layer: unit ``u``."""
  return [(layer, g) for layer, count in enumerate(groups_per_layer(config))
          for g in range(count)]


def query_groups(config: TransformerConfig) -> np.ndarray:
  """``[L, H]`` int: the key/value group, within its layer, that each query
  head reads (``h // (heads / num_kv_heads)``; a head's own index without
  groups; 0 where no head)."""
  out = np.zeros((config.num_layers, config.max_heads), np.int32)
  for layer, heads in enumerate(config.heads_per_layer):
    if heads:
      size = heads // config.num_kv_heads if config.num_kv_heads else 1
      out[layer, :heads] = np.arange(heads) // size
  return out


def head_mask(config: TransformerConfig, group_mask: np.ndarray) -> np.ndarray:
  """Head masks ``[..., L, H]`` (``H`` = ``config.max_heads``) of group
  masks ``[..., L, G]``: each query head takes its group's value; absent
  heads 0."""
  group_mask = np.asarray(group_mask, np.float32)
  layers = np.arange(config.num_layers)[:, None]
  return (group_mask[..., layers, query_groups(config)]
          * head_masks.existing_heads(config))


def subset_masks(config: TransformerConfig) -> np.ndarray:
  """``[2**U, L, G]`` float32 group masks: mask ``s`` keeps group ``u``
  iff bit ``u`` of ``s`` is set (``s = 2**U - 1`` keeps every group)."""
  units = _flat_groups(config)
  masks = np.zeros((2 ** len(units), config.num_layers,
                    config.num_kv_heads or 1), np.float32)
  codes = np.arange(2 ** len(units))
  for u, (layer, g) in enumerate(units):
    masks[:, layer, g] = (codes >> u) & 1
  return masks


def kept_counts(config: TransformerConfig) -> np.ndarray:
  """``[2**U]``: how many groups subset ``s`` keeps."""
  codes = np.arange(2 ** num_groups(config))
  return np.array([bin(int(c)).count("1") for c in codes], np.int64)


def removed_groups(config: TransformerConfig, subset: int
                   ) -> list[tuple[int, int]]:
  """The ``(layer, group)`` pairs subset ``subset`` removes."""
  return [unit for u, unit in enumerate(_flat_groups(config))
          if not (subset >> u) & 1]


def chain_subsets(config: TransformerConfig, order: np.ndarray) -> np.ndarray:
  """``[U + 1]`` subset indices of a nested chain: point ``k`` removes the
  first ``k`` units of ``order`` (flat group indices, least important
  first)."""
  full = 2 ** num_groups(config) - 1
  out, subset = [full], full
  for u in np.asarray(order, np.int64):
    subset &= ~(1 << int(u))
    out.append(subset)
  return np.asarray(out, np.int64)


def order_from_importance(importance: np.ndarray) -> np.ndarray:
  """Flat group indices, least important first (ties: the lower index
  first), of an importance ``[U]``."""
  return np.argsort(np.asarray(importance, np.float64), kind="stable")


def induced_order(config: TransformerConfig,
                  head_order: np.ndarray) -> np.ndarray:
  """The group order a head order induces: walking ``head_order`` (flat head
  indices ``layer * max_heads + head``, least important first), a group
  is removed when the last of its query heads is, since a group's cache can
  go only once none of its query heads reads it (a group's score is its
  most important head's). ``[..., N]`` orders give ``[..., U]``."""
  head_order = np.asarray(head_order, np.int64)
  if head_order.ndim > 1:
    return np.stack([induced_order(config, o) for o in head_order])
  unit = {group: u for u, group in enumerate(_flat_groups(config))}
  groups = query_groups(config)
  # The query heads each group has left to stream: the heads that read it.
  left = collections.Counter(
      (layer, int(groups[layer, head]))
      for layer, head in zip(*np.nonzero(head_masks.existing_heads(config))))
  out = []
  for flat in head_order:
    layer, head = divmod(int(flat), config.max_heads)
    group = (layer, int(groups[layer, head]))
    left[group] -= 1
    if left[group] == 0:
      out.append(unit[group])
  if len(out) != len(unit):
    raise ValueError(f"a head order of {len(head_order)} heads removes "
                     f"{len(out)} of the {len(unit)} groups: every query "
                     "head must appear once")
  return np.asarray(out, np.int64)


_head_mask_gradients = jax.jit(core.head_mask_gradients,
                               static_argnames="model")


def group_gradients(model: Transformer, params: Params, split: data.Split, *,
                    batch_size: int = 256,
                    ablation: ablation_lib.Ablation | None = None
                    ) -> np.ndarray:
  """``[n, U]`` per-example gradients of the loss with respect to each
  group's mask at the full model: the sum of its query heads' head-mask
  gradients (:func:`mha.pruning.core.head_mask_gradients`)."""
  config = model.config
  full = jnp.asarray(head_mask(config, np.ones(
      (config.num_layers, config.num_kv_heads or 1))))
  pieces = []
  for inputs, targets, abl in ablation_lib.batched(split, batch_size,
                                                   ablation):
    grads = np.asarray(_head_mask_gradients(
        model, params, inputs, targets, full, abl), np.float64)
    pieces.append(grads)
  grads = np.concatenate(pieces)[:len(split)]  # [n, L, H]
  out = np.zeros((len(grads), num_groups(config)))
  for u, (layer, g) in enumerate(_flat_groups(config)):
    size = config.heads_per_layer[layer] // config.num_kv_heads
    out[:, u] = grads[:, layer, g * size:(g + 1) * size].sum(axis=-1)
  return out


def group_importance(gradients: np.ndarray) -> dict[str, np.ndarray]:
  """Importance ``[U]`` of each group from per-example gradients ``[n,
  U]``: ``gradient``, the mean absolute value (Michel et al.), and
  ``fisher``, the mean square (Kwon et al.)."""
  g = np.asarray(gradients, np.float64)
  return {"gradient": np.abs(g).mean(axis=0),
          "fisher": np.square(g).mean(axis=0)}


__all__ = ["is_grouped", "groups_per_layer", "num_groups", "query_groups",
           "head_mask",
           "subset_masks", "kept_counts", "removed_groups", "chain_subsets",
           "order_from_importance", "induced_order", "group_gradients",
           "group_importance"]
