"""The exhaustive oracle: every subset of heads, evaluated.

With ``N`` heads there are ``2**N`` subsets. For each number ``k`` of heads
removed, the best subset (chosen on validation, reported on test) is the
ground truth every importance ordering is measured against; the same table
gives exact Shapley values.

Subset ``s`` keeps existing head ``i`` (the ``i``-th of
``np.flatnonzero(head_masks.existing_heads(config))``, layer by layer) iff bit ``i``
of ``s`` is set, so ``s = 2**N - 1`` keeps every head and ``s = 0`` none.

Work is shared: a head of layer ``l`` changes only layer ``l`` and the layers
above it, so the model runs layer by layer and layer ``l`` is computed once
for each distinct mask of the layers below it, vmapped over its own
``2**H_l`` masks. Inside one layer vmap shares more: the head mask gates each
head's context just before the out-projection, so the query/key/value
projections and the attention weights do not depend on the layer's own mask
and XLA computes them once per prefix. The cost is about one MLP and one
read-out per subset, not ``L`` full layers.

    values = evaluate_subsets(model, params, splits["validation"])
    removed = best_removals(values["token_accuracy"], model.config)

Every oracle helper lives here: which models it applies to
(:func:`oracle_applies`), the value of a subset (:func:`subset_values`),
the candidates per number of heads removed (:data:`ORACLE_CANDIDATES`,
:func:`ranked_removals`, :func:`removals_by_variant`), the oracle of a model
(:func:`oracle_removals`, :func:`evaluate_oracle`) and exact Shapley values.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha.aliases import Array, Log, Params
from mha.attention import padding_mask_from_tokens
from mha.model import EncoderBlock, Transformer, TransformerConfig
from mha.progress import quiet, timed
from mha.pruning import core


#: Rows (subsets x examples) of one jitted call: enough to amortise a call,
#: few enough that the activations of one layer stay near the cache.
ROWS_PER_CALL = 1 << 13


# --------------------------------------------------------------------------
# Subsets.
# --------------------------------------------------------------------------


def num_heads(config: TransformerConfig) -> int:
  """Number of existing heads ``N``."""
  return int(head_masks.existing_heads(config).sum())


def _bits(count: int) -> np.ndarray:
  """``[2**count, count]`` float32: row ``s`` holds the bits of ``s``."""
  codes = np.arange(2 ** count, dtype=np.int64)
  return ((codes[:, None] >> np.arange(count)[None, :]) & 1).astype(np.float32)


def subset_masks(config: TransformerConfig) -> np.ndarray:
  """``[2**N, L, H]`` float32 head masks: mask ``s`` keeps existing head
  ``i`` iff bit ``i`` of ``s`` is set."""
  exists = head_masks.existing_heads(config)
  flat = np.flatnonzero(exists)
  masks = np.zeros((2 ** len(flat), exists.size), np.float32)
  masks[:, flat] = _bits(len(flat))
  return masks.reshape((-1,) + exists.shape)


def subset_index(config: TransformerConfig, masks: np.ndarray) -> np.ndarray:
  """The subset index ``s`` of each dense mask ``[..., L, H]``."""
  flat = np.flatnonzero(head_masks.existing_heads(config))
  masks = np.asarray(masks).reshape(np.shape(masks)[:-2] + (-1,))
  kept = masks[..., flat] > 0.5
  return np.sum(kept.astype(np.int64) << np.arange(len(flat)), axis=-1)


def kept_counts(config: TransformerConfig) -> np.ndarray:
  """``[2**N]``: how many heads subset ``s`` keeps."""
  return _bits(num_heads(config)).sum(axis=1).astype(np.int64)


def _layer_offsets(config: TransformerConfig) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(config.heads_per_layer)])


# --------------------------------------------------------------------------
# The pure core: the model layer by layer, every subset at once.
# --------------------------------------------------------------------------


def _embed(model: Transformer, params: Params, tokens: Array) -> Array:
  """The model's input to its first block (no dropout)."""
  return model.apply({"params": params}, tokens, method="embed")


def _block(model: Transformer, params: Params, layer: int, x: Array,
           attention_mask: Array, layer_mask: Array,
           shift: Array | None = None) -> Array:
  """Block ``layer`` of the model under its ``[H_l]`` head mask; with
  ``shift`` ``[H, D]`` (mean ablation), each removed head's row is added to
  the output bias."""
  cfg = model.config
  count = cfg.heads_per_layer[layer]
  block = EncoderBlock(cfg, count)
  block_params = params[f"layer_{layer}"]
  if shift is not None and count:
    out = block_params["attention"]["out"]
    out = dict(out, bias=out["bias"] + (1.0 - layer_mask) @ shift[:count])
    block_params = dict(block_params, attention=dict(
        block_params["attention"], out=out))
  y, _ = block.apply({"params": block_params}, x, attention_mask,
                     layer_mask, deterministic=True, return_weights=False)
  return y


def _readout(model: Transformer, params: Params, x: Array) -> Array:
  """Final LayerNorm (pre-norm models) and the logits."""
  return model.apply({"params": params}, x, method="readout")


def subset_metric_sums(model: Transformer, params: Params, inputs: Array,
                       targets: Array,
                       bias_shifts: Array | None = None) -> dict[str, Array]:
  """Per-example :func:`eval_lib.example_metric_sums` under every subset.

  Pure (``jit``, ``vmap`` over stacked parameters). Layer ``l`` runs once
  per distinct mask of the layers below it (see the module docstring).
  ``bias_shifts`` ``[L, H, D]``: mean ablation
  (:func:`mha.pruning.mean_ablation.bias_shifts`) instead of zero ablation.

  Returns:
    ``loss_sum``, ``correct``, ``exact``: ``[2**N, B]``; ``tokens``,
    ``sequences``: ``[B]``.
  """
  cfg = model.config
  attention_mask = padding_mask_from_tokens(inputs)
  xs = _embed(model, params, inputs)[None]  # [prefixes, B, T, D]
  for layer, count in enumerate(cfg.heads_per_layer):
    codes = jnp.asarray(_bits(count))
    run = functools.partial(
        _block, model, params, layer, attention_mask=attention_mask,
        shift=None if bias_shifts is None else bias_shifts[layer])
    per_prefix = lambda x, run=run, codes=codes: jax.vmap(
        lambda m: run(x=x, layer_mask=m))(codes)
    xs = jax.vmap(per_prefix)(xs).reshape((-1,) + xs.shape[1:])

  def metrics(x):
    sums = eval_lib.example_metric_sums(_readout(model, params, x), targets,
                                    inputs)
    return sums["loss_sum"], sums["correct"], sums["exact"]

  per_subset = jax.vmap(metrics)(xs)
  # xs is ordered C-style over (m_0, ..., m_{L-1}); subset s has layer 0 in
  # its lowest bits: reverse the layer axes.
  sizes = [2 ** c for c in cfg.heads_per_layer]
  axes = tuple(reversed(range(len(sizes)))) + (len(sizes),)
  loss, correct, exact = (
      jnp.transpose(v.reshape(sizes + [v.shape[-1]]), axes).reshape(
          (-1, v.shape[-1])) for v in per_subset)
  valid = inputs != 0
  return {"loss_sum": loss, "correct": correct, "exact": exact,
          "tokens": jnp.sum(valid, axis=-1),
          "sequences": jnp.any(valid, axis=-1).astype(jnp.int32)}


@functools.partial(jax.jit, static_argnames=("model", "per_example"))
def _subset_sums(model, params, inputs, targets, per_example,
                 bias_shifts=None):
  sums = subset_metric_sums(model, params, inputs, targets, bias_shifts)
  if per_example:
    return sums
  return {k: jnp.sum(v.astype(jnp.float32), axis=-1) for k, v in sums.items()}


# --------------------------------------------------------------------------
# Drivers.
# --------------------------------------------------------------------------


def evaluate_subsets(model: Transformer, params: Params, split: data.Split, *,
                     batch_size: int = 1000,
                     per_example: bool = False,
                     bias_shifts: Array | None = None
                     ) -> dict[str, np.ndarray]:
  """Metrics of every subset of heads on ``split`` (mean-ablated with
  ``bias_shifts``, see :func:`subset_metric_sums`).

  Args:
    model, params: the model.
    split: the examples (select on validation, report on test).
    batch_size: at most this many examples per jitted call (fewer when
      ``2**N`` subsets x examples would exceed :data:`ROWS_PER_CALL`).
    per_example: return per-example sums instead of metrics.

  Returns:
    ``loss``, ``token_accuracy``, ``exact_match``: ``[2**N]``. With
    ``per_example``: the :func:`eval_lib.example_metric_sums` of every example,
    ``loss_sum``, ``correct``, ``exact``, ``tokens``, ``sequences``, each
    ``[2**N, n]``; :func:`mha.evaluate.summarize` of their sums over the
    examples (any resample of them) gives the metrics.
  """
  subsets = 2 ** num_heads(model.config)
  examples = max(1, min(batch_size, ROWS_PER_CALL // subsets))
  parts: dict[str, list[np.ndarray]] = {}
  for inputs, targets in core.batches(split, examples):
    out = jax.device_get(_subset_sums(model, params, inputs, targets,
                                      per_example, bias_shifts))
    for key, value in out.items():
      parts.setdefault(key, []).append(np.asarray(value))
  if not per_example:
    totals = {k: np.sum(np.stack(v), axis=0, dtype=np.float64)
              for k, v in parts.items()}
    return eval_lib.summarize(totals)
  n = len(split)
  out = {k: np.concatenate(v, axis=-1)[..., :n] for k, v in parts.items()}
  for key in ("tokens", "sequences"):
    out[key] = np.broadcast_to(out[key], (subsets, n))
  return out


def ranked_removals(values: np.ndarray, config: TransformerConfig, *,
                    no_layer_emptied: bool = False,
                    top: int = 1) -> list[list[np.ndarray]]:
  """For each number ``k`` of heads removed, the removed heads of the
  ``top`` best subsets, best first (see :func:`best_removals`)."""
  values = np.asarray(values, np.float64)
  flat = np.flatnonzero(head_masks.existing_heads(config))
  n = len(flat)
  if values.shape != (2 ** n,):
    raise ValueError(f"values must be [2**N] = [{2 ** n}], got "
                     f"{values.shape}.")
  bits = _bits(n) > 0.5
  kept = bits.sum(axis=1)
  allowed = np.ones(2 ** n, bool)
  if no_layer_emptied:
    offsets = _layer_offsets(config)
    for start, stop in zip(offsets[:-1], offsets[1:]):
      if stop > start:
        allowed &= bits[:, start:stop].any(axis=1)
  out = []
  for k in range(n + 1):
    candidates = np.flatnonzero(allowed & (kept == n - k))
    if len(candidates) == 0:
      break
    # Best first; ties keep the lower subset index first.
    ranked = candidates[np.argsort(-values[candidates], kind="stable")]
    out.append([flat[~bits[s]] for s in ranked[:top]])
  return out


def best_removals(values: np.ndarray, config: TransformerConfig, *,
                  no_layer_emptied: bool = False) -> list[np.ndarray]:
  """For each number ``k`` of heads removed, the best subset's removed heads.

  Args:
    values: ``[2**N]`` one number per subset, higher is better (pass
      ``-loss`` for the loss).
    config: the model's config.
    no_layer_emptied: only subsets keeping at least one head in every layer
      that has heads; then ``k`` goes up to ``N - (layers with heads)``.

  Returns:
    for ``k = 0, 1, ...`` the flat head indices (``layer * H + head``, as in
    the orders of :mod:`mha.pruning.core`) of the best subset with ``k``
    heads removed (ties: the lowest subset index).
  """
  return [r[0] for r in ranked_removals(values, config,
                                        no_layer_emptied=no_layer_emptied)]


def shapley_values(values: np.ndarray, config: TransformerConfig) -> np.ndarray:
  """Exact Shapley value of every head for the value function ``values``.

  ``phi_h = sum over S without h of |S|! (N - |S| - 1)! / N! *
  (v(S + h) - v(S))``, where ``v(S) = values[S]`` (the metric with exactly
  the heads of ``S`` kept). The values sum to ``v(all) - v(none)``.

  Returns:
    ``[L, H]``, NaN where a head does not exist.
  """
  values = np.asarray(values, np.float64)
  n = num_heads(config)
  kept = kept_counts(config)
  weight = np.asarray([math.factorial(s) * math.factorial(n - s - 1) /
                       math.factorial(n) for s in range(n)])
  subsets = np.arange(2 ** n, dtype=np.int64)
  phi = np.empty(n)
  for i in range(n):
    without = subsets[(subsets >> i) & 1 == 0]
    gain = values[without | (1 << i)] - values[without]
    phi[i] = np.sum(weight[kept[without]] * gain)
  return core.heads_to_array(config, phi)


# --------------------------------------------------------------------------
# The oracle of a model: what the study, export and the extensions use.
# --------------------------------------------------------------------------

#: Subsets per number of heads removed among which each bootstrap replicate
#: chooses the oracle again (the best ones on the full validation split), so
#: that the oracle's intervals include the variability of its choice.
ORACLE_CANDIDATES = 5
#: The cost of one subset in :func:`evaluate_subsets` relative to one mask
#: of ``core.evaluate_masks`` (0.85 measured on 2 CPU cores when the study
#: was written; ``scripts/benchmark.py`` measures it again:
#: ``pruning_masks``, ``subsets.speedup`` is its inverse). Every subset is
#: evaluated instead of ``M`` masks when ``M >= SUBSET_COST * 2**N``.
SUBSET_COST = 0.85
#: The two oracles: among all subsets, and among those keeping at least one
#: head in every layer that has heads.
VARIANTS = ("all", "no_layer_emptied")


def table_bytes(config: TransformerConfig, num_examples: int) -> int:
  """About the bytes the study's per-example table of every subset takes:
  five sums ``[2**N, n]``, held as float64 while they are summarised."""
  return 2 ** num_heads(config) * num_examples * 5 * 8


def machine_memory_bytes() -> int | None:
  """This machine's physical memory, or None where it cannot be read."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, OSError, ValueError):
    return None


def oracle_applies(config: TransformerConfig, max_heads: int) -> bool:
  """Whether every subset of the model's heads is evaluated: at most
  ``max_heads`` heads (``--oracle_max_heads``)."""
  return num_heads(config) <= max_heads


def subset_values(metrics: Mapping[str, np.ndarray]) -> np.ndarray:
  """The oracle's and Shapley's value of each subset: token accuracy, ties
  broken by the loss (differences in token accuracy are multiples of one
  token in the split, far above 1e-9 x loss)."""
  return metrics["token_accuracy"] - 1e-9 * metrics["loss"]


def removals_by_variant(values: np.ndarray, config: TransformerConfig, *,
                        top: int = ORACLE_CANDIDATES
                        ) -> dict[str, list[list[np.ndarray]]]:
  """:func:`ranked_removals` of both :data:`VARIANTS`: variant -> for each
  ``k`` the removals of the ``top`` best subsets, the best first."""
  return {variant: ranked_removals(
      values, config, no_layer_emptied=variant == "no_layer_emptied",
      top=top) for variant in VARIANTS}


def oracle_removals(model: Transformer, params: Params,
                    validation: data.Split, *, batch_size: int,
                    no_layer_emptied: bool = False, top: int = 1,
                    table: Mapping[str, np.ndarray] | None = None
                    ) -> list[list[np.ndarray]]:
  """The oracle, chosen on ``validation``: for each number ``k`` of heads
  removed (0..N), the removed heads (flat indices, ``layer * H + head``) of
  the ``top`` best subsets by :func:`subset_values`, the best first;
  ``[k][0]`` is the oracle's choice.

  ``table``: the per-example sums of every subset on ``validation``
  (``evaluate_subsets(..., per_example=True)``) when already evaluated;
  otherwise they are evaluated here.
  """
  if table is None:
    table = evaluate_subsets(model, params, validation,
                             batch_size=batch_size, per_example=True)
  values = subset_values(core.summarize_examples(table))
  return ranked_removals(values, model.config,
                         no_layer_emptied=no_layer_emptied, top=top)


def evaluate_oracle(model: Transformer, params: Params,
                    validation: data.Split, *, batch_size: int,
                    max_heads: int, log: Log = quiet,
                    timings: dict[str, float] | None = None
                    ) -> tuple[dict[str, np.ndarray] | None, np.ndarray,
                               dict[str, list[list[np.ndarray]]]]:
  """Every subset on validation (per example), exact Shapley values
  ``[L, H]`` of token accuracy, and the oracle's candidates per variant
  (:func:`removals_by_variant`); ``(None, NaN, {})`` above ``max_heads``.
  ``timings["oracle_s"]`` receives the seconds it took."""
  config = model.config
  n = num_heads(config)
  if not oracle_applies(config, max_heads):
    log(f"  oracle and Shapley values skipped: {n} heads > "
        f"--oracle_max_heads={max_heads}")
    return None, np.full(head_masks.existing_heads(config).shape, np.nan), {}
  timings = {} if timings is None else timings
  table, timings["oracle_s"] = timed(
      log, f"oracle: all {2 ** n} subsets of heads on validation, layer by "
      "layer", lambda: evaluate_subsets(
          model, params, validation, per_example=True,
          batch_size=batch_size))
  summary = core.summarize_examples(table)
  removals = removals_by_variant(subset_values(summary), config)
  shapley = shapley_values(summary["token_accuracy"], config)
  return table, shapley, removals


__all__ = ["subset_masks", "subset_index", "kept_counts", "num_heads",
           "subset_metric_sums", "evaluate_subsets", "best_removals",
           "ranked_removals", "shapley_values", "ORACLE_CANDIDATES",
           "SUBSET_COST", "VARIANTS", "table_bytes", "machine_memory_bytes",
           "oracle_applies", "subset_values",
           "removals_by_variant", "oracle_removals", "evaluate_oracle"]
