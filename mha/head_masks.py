"""Head masks: which attention heads a forward pass keeps.

A *head mask* is a float array ``[L, H]`` (``L`` layers, ``H`` the largest
head count of any layer): 1 keeps a head, 0 removes it (its context is zeroed
before the out-projection, exactly what slicing it out does). For a model
with fewer heads in some layers (a pruned one) the entries past a layer's
count are ignored; :func:`existing_heads` tells which exist. A *flat* head
index is ``layer * H + head``; an *order* is a 1-D array of them, the head to
remove first at index 0.

These primitives are shared by the pruning techniques (:mod:`mha.pruning`,
which re-exports them), the attention explorer and the head-role scores:

    mask = mask_without(config, [0, 5])       # remove heads (0, 0) and (1, 1)
    logits = masked_logits(model, params, tokens, mask)
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from mha.aliases import Array, Params
from mha.model import Transformer, TransformerConfig


def existing_heads(config: TransformerConfig) -> np.ndarray:
  """Boolean ``[L, H]``: which entries of a dense head mask are real heads."""
  heads = np.arange(config.max_heads)[None, :]
  return heads < np.asarray(config.heads_per_layer)[:, None]


def full_head_mask(config: TransformerConfig) -> np.ndarray:
  """The float32 ``[L, H]`` mask keeping every existing head."""
  return existing_heads(config).astype(np.float32)


def _layer_masks(config: TransformerConfig, head_mask: Array) -> list[Array]:
  """Splits a dense ``[..., L, H]`` mask into one ``[..., H_l]`` per layer."""
  return [head_mask[..., layer, :count]
          for layer, count in enumerate(config.heads_per_layer)]


def mask_without(config: TransformerConfig, heads: Sequence[int],
                 base: np.ndarray | None = None) -> np.ndarray:
  """``base`` (default: all heads) with the flat head indices ``heads`` set
  to 0."""
  mask = full_head_mask(config) if base is None else np.array(base, np.float32)
  mask.reshape(-1)[np.asarray(heads, np.int64)] = 0.0
  return mask


def leave_one_out_masks(config: TransformerConfig) -> np.ndarray:
  """``[N, L, H]``: mask ``i`` removes the ``i``-th existing head alone."""
  flat = np.flatnonzero(existing_heads(config))
  return np.stack([mask_without(config, [i]) for i in flat])


def all_but_one_masks(config: TransformerConfig) -> np.ndarray:
  """``[N, L, H]``: mask ``i`` keeps, in the layer of the ``i``-th existing
  head, that head alone (Michel et al.'s "all but one head per layer");
  the other layers keep every head."""
  exists = existing_heads(config)
  masks = []
  for flat in np.flatnonzero(exists):
    layer, head = divmod(int(flat), config.max_heads)
    mask = exists.astype(np.float32)
    mask[layer] = 0.0
    mask[layer, head] = 1.0
    masks.append(mask)
  return np.stack(masks)


def masks_from_order(config: TransformerConfig, order: Sequence[int],
                     counts: Sequence[int]) -> np.ndarray:
  """``[len(counts), L, H]``: mask ``p`` removes the first ``counts[p]``
  heads of ``order``."""
  order = np.asarray(order, np.int64)
  return np.stack([mask_without(config, order[:k]) for k in counts])




def masked_logits(model: Transformer, params: Params, inputs: Array,
                  head_mask: Array) -> Array:
  """Logits ``[B, T, V]`` of the model under a dense ``[L, H]`` head mask
  (fused attention path, no weights)."""
  logits, _ = model.apply({"params": params}, inputs,
                          head_mask=_layer_masks(model.config, head_mask),
                          return_weights=False)
  return logits



def parse_heads(text: str) -> list[tuple[int, int]]:
  """Parses ``"0:1,1:3"`` into ``[(0, 1), (1, 3)]`` (ValueError if
  malformed)."""
  pairs = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    layer, sep, head = part.partition(":")
    if not sep or not layer.strip().isdigit() or not head.strip().isdigit():
      raise ValueError(
          f"bad head {part!r}: expected LAYER:HEAD, e.g. 0:1,1:3")
    pairs.append((int(layer), int(head)))
  return pairs


def flat_to_pairs(config: TransformerConfig,
                  flat: Iterable[int]) -> list[tuple[int, int]]:
  """Flat head indices to ``(layer, head)`` pairs."""
  return [divmod(int(i), config.max_heads) for i in flat]


def pairs_to_flat(config: TransformerConfig,
                  pairs: Iterable[Sequence[int]]) -> list[int]:
  """``(layer, head)`` pairs to flat head indices (:func:`flat_to_pairs`'s
  inverse)."""
  return [int(layer) * config.max_heads + int(head) for layer, head in pairs]


__all__ = ["existing_heads", "full_head_mask", "mask_without",
           "leave_one_out_masks", "all_but_one_masks", "masks_from_order",
           "masked_logits", "flat_to_pairs", "pairs_to_flat", "parse_heads"]
