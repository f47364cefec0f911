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

    totals = subset_totals(model, params, splits["validation"])  # streamed
    values = subset_values(mha.evaluate.summarize(totals))   # [2**N]
    removed = best_removals(values, model.config)

Every oracle helper lives here: which models it applies to
(:func:`oracle_applies`), the value of a subset (:func:`subset_values`),
the candidates per number of heads removed (:data:`ORACLE_CANDIDATES`,
:func:`ranked_removals`, :func:`removals_by_variant`), the oracle of a model
(:func:`oracle_removals`, :func:`evaluate_oracle`) and exact Shapley values.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import math
import os
from typing import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha.aliases import Array, Log, Params
from mha.attention import MultiHeadAttention
from mha.model import EncoderBlock, Transformer, TransformerConfig
from mha.model import attention_mask as model_mask
from mha.run.progress import Tenths, quiet, timed
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.run import arguments
from mha.run import sharding as sharding_lib


#: Seconds after which :func:`subset_totals` reports its progress.
PROGRESS_AFTER_S = 10.0
#: Rows (subsets x examples) of one call of :func:`subset_totals`: enough to
#: amortise a call, few enough that its activations stay near the cache
#: (4096 measured fastest of 2048-16384 on 2 CPU cores, 12 and 16 heads).
ROWS_PER_CALL = 1 << 12
#: Examples x positions x positions of one call of :func:`subset_totals`,
#: at most (:func:`call_shape`): one head's attention weights a call, 512
#: KiB of float32, so that long windows come a few at a time. Measured
#: 2026-11-30 on 2 CPU cores (AMD EPYC), the streaming oracle (``4,16``):
#: the passkey decoder (8 heads, 256 tokens, 128 windows) 11.1 s at 128
#: windows a call (2.4 GiB), 5.0 s at 16, 4.1 s at 4, 3.0 s at 2 (0.6
#: GiB), 3.6 s at 1; the character LM (12 heads, 128 tokens, 32 windows)
#: 48.7 s at 16, 47.4 s at 8, 45.0 s at 4; a 2 x 8-head ``mqar`` model (32
#: windows of 128) 26.5 s at 16, 18.5 s at 8, 18.0 s at 4. Sequences of up
#: to 16 tokens keep the shapes :data:`ROWS_PER_CALL` gives them.
CALL_ATTENTION_ENTRIES = 1 << 17
#: Calls of :func:`subset_totals` dispatched ahead of the one whose sums
#: the host adds up.
IN_FLIGHT = 2
#: Threads that run :func:`subset_totals`'s calls, each waiting for its own
#: call's sums: two calls then run at once, filling the gaps one call leaves
#: in XLA's intra-op threads (on 2 CPU cores, 12 heads: the 1,008 calls in
#: 8.0-9.0 s instead of 9.3-11.1 s, 4 alternating pairs, bitwise the same
#: sums; docs/performance.md).
DISPATCH_THREADS = 2
#: Rows of one call of the per-example table (:func:`evaluate_subsets` with
#: ``per_example``), the shapes it has always had.
TABLE_ROWS_PER_CALL = 1 << 13
#: Positions (rows x sequence length) of one such call: a call's attention
#: grows with the square of the length, so long sequences get fewer
#: examples a call. Sequences of up to 16 tokens keep the shapes above; the
#: passkey decoder (256 subsets, 256 tokens) took 7.6 GiB at 32 examples a
#: call, about 1 GiB at 2 (2026-11-29).
TABLE_POSITIONS_PER_CALL = TABLE_ROWS_PER_CALL * 16
#: Masks of the last layer evaluated together within a call of
#: :func:`subset_totals` (:func:`_last_layer_sums`), at most: the call goes
#: through its prefixes one at a time and their masks in groups, so that
#: what a group computes (its MLP's ``[masks x positions, mlp_dim]``
#: activations) stays in the cache instead of streaming through memory
#: (2026-11-27, 2 CPU cores, alternating rounds in one process: 12 heads
#: 7.7 s against 10.5 s for every prefix and mask at once; 16 heads on 160
#: examples 27.3 s against 36.7 s; groups of 8 as fast as 16; of 32 or 64,
#: slower than no groups at all).
MASKS_PER_STEP = 16
#: Bytes of a group's MLP activations (float32), at most, down to one mask
#: a group (:func:`mask_group`): a mask of the character LM's last layer
#: (16 windows of 128 tokens, ``mlp_dim`` 512) holds 4 MiB of them, and one
#: mask at a time ran its oracle in 47-51 s against 81 s for its 16 masks at
#: once, the passkey decoder's (256 windows of 256 tokens) in 12.7 s
#: against 20.6 s, while ``deep64`` (16 masks of 0.07 MiB) kept its groups
#: of 16 (2026-11-30, AMD EPYC, 2 CPU cores, one run each; 32 of 96
#: validation windows, 128 of 1,000 and all 1,000).
MASK_GROUP_BYTES = 1 << 20


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
  """The subset index ``s`` of each dense mask ``[..., L, H]``. NumPy on the
  host: not for ``jit``."""
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


def embed_tokens(model: Transformer, params: Params, tokens: Array) -> Array:
  """The model's input to its first block (no dropout)."""
  return model.apply({"params": params}, tokens, method="embed")


def run_block(model: Transformer, params: Params, layer: int, x: Array,
              attention_mask: Array, layer_mask: Array,
              shift: Array | None = None,
              added: Array | None = None) -> Array:
  """Block ``layer`` of the model under its ``[H_l]`` head mask; with
  ``shift`` ``[H, D]`` (mean ablation), each removed head's row is added to
  the output bias; with ``added`` ``[H, B | 1, T | 1, D]`` (any
  :mod:`mha.pruning.ablation` mode), each removed head's shift is added to
  the attention's output."""
  block = EncoderBlock(model.config, model.config.heads_per_layer[layer])
  with _ablated(layer_mask, added):
    y, _ = block.apply({"params": _block_params(model, params, layer,
                                                layer_mask, shift)},
                       x, attention_mask, layer_mask, deterministic=True,
                       return_weights=False)
  return y


def _ablated(layer_mask: Array, added: Array | None):
  """A context in which a block applied alone is ablated by ``added``
  (:func:`mha.pruning.ablation.block_interceptor`), or does nothing."""
  if added is None:
    return contextlib.nullcontext()
  return nn.intercept_methods(
      ablation_lib.block_interceptor(layer_mask, added))


def _block_params(model: Transformer, params: Params, layer: int,
                  layer_mask: Array, shift: Array | None) -> Params:
  """Block ``layer``'s parameters; with ``shift`` (mean ablation), each
  removed head's row of ``shift`` added to the out-projection's bias."""
  count = model.config.heads_per_layer[layer]
  block_params = params[f"layer_{layer}"]
  if shift is not None and count:
    out = block_params["attention"]["out"]
    out = dict(out, bias=out["bias"] + (1.0 - layer_mask) @ shift[:count])
    block_params = dict(block_params, attention=dict(
        block_params["attention"], out=out))
  return block_params


def attention_outputs(model: Transformer, params: Params, layer: int,
                      x: Array, attention_mask: Array, masks: Array,
                      shift: Array | None,
                      added: Array | None = None) -> Array:
  """``[M, B, T, D]``: the attention sublayer's output of block ``layer``
  (what is added to the residual stream) under each of ``masks`` (``shift``
  and ``added``: as :func:`run_block`)."""
  block = EncoderBlock(model.config, model.config.heads_per_layer[layer])

  def one(m):
    with _ablated(m, added):
      _, captured = block.apply(
          {"params": _block_params(model, params, layer, m, shift)}, x,
          attention_mask, m, deterministic=True, return_weights=False,
          capture_intermediates=lambda mdl, _: isinstance(
              mdl, MultiHeadAttention),
          mutable=["intermediates"])
    return captured["intermediates"]["attention"]["__call__"][0][0]
  return jax.vmap(one)(masks)


def _is_attention_out(context: nn.module.InterceptorContext) -> bool:
  """Whether an interceptor's ``context`` is the call of a
  :class:`MultiHeadAttention`'s out-projection (its argument: the heads'
  contexts ``[..., T, H, Dh]``)."""
  return (isinstance(context.module, nn.DenseGeneral)
          and context.module.name == "out" and context.method_name == "__call__"
          and isinstance(context.module.parent, MultiHeadAttention))


def _attention_replaced_by(output: Array):
  """An interceptor under which a block applied to rows ``[1, P, D]`` takes
  ``output`` ``[P, D]`` as its attention sublayer's output (no weights)."""
  def intercept(next_fun, args, kwargs, context):
    if (isinstance(context.module, MultiHeadAttention)
        and context.method_name == "__call__"):
      return output[None].astype(args[0].dtype), None
    return next_fun(*args, **kwargs)
  return intercept


class _Captured(Exception):
  """Raised by an interceptor that has captured what it was after, to stop
  the rest of a block from being traced; caught right around the apply."""


def _head_outputs(model: Transformer, params: Params, layer: int, x: Array,
                  attention_mask: Array, positions: Array
                  ) -> tuple[Array, Array]:
  """``(base, heads)``: the attention sublayer's output of block ``layer``
  under the empty mask (the out-projection's bias) ``[P, D]``, and each
  head's change to it ``[H, P, D]``, at the flat ``positions`` of the batch
  (zero ablation). The same numbers as the empty and single-head masks of
  :func:`attention_outputs`: each head's context is taken before the
  out-projection (``nn.intercept_methods``), cut to ``positions`` and
  projected by its own rows of the kernel."""
  count = model.config.heads_per_layer[layer]
  block = EncoderBlock(model.config, count)
  contexts = []

  def intercept(next_fun, args, kwargs, context):
    if _is_attention_out(context):
      contexts.append(args[0])
      raise _Captured  # The rest of the block is not needed (nor traced).
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(intercept), contextlib.suppress(_Captured):
    block.apply({"params": params[f"layer_{layer}"]}, x, attention_mask,
                jnp.ones((count,), x.dtype), deterministic=True,
                return_weights=False)
  (ctx,) = contexts  # [B, T, H, Dh]
  ctx = ctx.reshape((-1,) + ctx.shape[-2:])[positions]  # [P, H, Dh]
  out = params[f"layer_{layer}"]["attention"]["out"]
  dtype = model.config.compute_dtype  # As the out-projection computes.
  bias = out["bias"].astype(dtype)
  heads = jnp.einsum("phd,hde->hpe", ctx.astype(dtype),
                     out["kernel"].astype(dtype)) + bias[None, None]
  base = jnp.broadcast_to(bias[None], heads.shape[1:])
  return base, heads - bias[None, None]


def _inverse_positions(positions: Array, weights: Array, size: int) -> Array:
  """``[size]``: for each flat position of the batch, its index in
  ``positions`` (a valid one), or ``len(positions)`` (padding)."""
  count = positions.shape[0]
  index = jnp.where(weights > 0, positions, size)
  return jnp.full((size,), count, jnp.int32).at[index].set(
      jnp.arange(count, dtype=jnp.int32), mode="drop")


def _run_block_at(model: Transformer, params: Params, layer: int, x: Array,
                  attention_mask: Array, layer_mask: Array,
                  shift: Array | None, positions: Array,
                  inverse: Array) -> Array:
  """:func:`run_block` (zero ablation), with all that follows the
  attention's context (the out-projection, the residuals, the MLP) run on
  the flat ``positions`` only: the same numbers there, zeros at every other
  position (padding, which the next block's attention masks)."""
  count = model.config.heads_per_layer[layer]
  block = EncoderBlock(model.config, count)
  block_params = {"params": _block_params(model, params, layer, layer_mask,
                                          shift)}
  outs = []

  def capture(next_fun, args, kwargs, context):
    if _is_attention_out(context):
      ctx = args[0]  # [B, T, H, Dh], gated
      out = next_fun(ctx.reshape((-1,) + ctx.shape[-2:])[positions],
                     *args[1:], **kwargs)  # [P, D]
      outs.append(out)
      raise _Captured  # The rest of the block is not needed (nor traced).
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(capture), contextlib.suppress(_Captured):
    block.apply(block_params, x, attention_mask, layer_mask,
                deterministic=True, return_weights=False)
  (out,) = outs

  residual = x.reshape(-1, x.shape[-1])[positions][None]  # [1, P, D]
  with nn.intercept_methods(_attention_replaced_by(out)):
    y, _ = block.apply(block_params, residual, None, layer_mask,
                       deterministic=True, return_weights=False)
  y = jnp.concatenate([y[0], jnp.zeros((1, y.shape[-1]), y.dtype)])
  return y[inverse].reshape(x.shape)


def _last_layer_sums(model: Transformer, params: Params, xs: Array,
                     attention_mask: Array, codes: Array, positions: Array,
                     weights: Array, targets: Array,
                     shift: Array | None, added: Array | None = None,
                     streaming_mask: Array | None = None,
                     parents: Array | None = None
                     ) -> tuple[Array, Array]:
  """Per-example sums ``[prefixes, M, B]`` (loss, correct) over
  ``positions`` of the last block under each of its masks ``codes``
  ``[M, H]`` and the read-out; with ``parents`` ``[M]``, ``[M, B]``: mask
  ``i`` under prefix ``parents[i]`` only (a list of masks).

  Exact reformulation of running the block once per mask: the attention
  sublayer's output is affine in the head mask (the mask gates each head's
  context before the out-projection; mean ablation's bias shift is affine
  too), so it is computed for the empty mask and each single head, once per
  prefix, and combined per mask. Under zero ablation each head's part is
  its own context through its own rows of the out-projection, on the valid
  positions only (:func:`_head_outputs`); otherwise the block's attention
  runs under the empty and each single-head mask
  (:func:`attention_outputs`). What follows it (residual, MLP, norms,
  read-out) acts on each position alone and runs only on ``positions``
  (``[P]`` into the flattened batch, padded with ``weights`` 0; the
  scored ones are enough: the keys and values are computed everywhere):
  the block's own code, with its attention replaced by
  the combined output (``nn.intercept_methods``). The prefixes run one at
  a time and the masks in groups of :func:`mask_group`
  (``jax.lax.map``), so that a group's activations stay small: one program
  on every backend. With ``streaming_mask`` (streaming ablation), each
  head's part under that mask is computed too, and a removed head
  contributes it instead of nothing.
  """
  cfg = model.config
  layer = cfg.num_layers - 1
  count = cfg.heads_per_layer[layer]
  block = EncoderBlock(cfg, count)
  batch = targets.shape[0]
  basis = jnp.concatenate([jnp.zeros((1, count)), jnp.eye(count)])
  flat_targets = targets.reshape(-1)[positions]
  counted = weights * (flat_targets >= 0)  # a target < 0 is not scored
  onehot = (jax.nn.one_hot(positions // targets.shape[1], batch) *
            counted[:, None])  # [P, B]: each scored position's example
  flat_targets = jnp.maximum(flat_targets, 0)

  def for_prefix(x):
    streamed = None
    if shift is None and added is None:
      base, heads = _head_outputs(model, params, layer, x, attention_mask,
                                  positions)  # [P, D], [H, P, D]
      if streaming_mask is not None:
        _, streamed = _head_outputs(model, params, layer, x, streaming_mask,
                                    positions)  # [H, P, D]
    else:
      outs = attention_outputs(model, params, layer, x, attention_mask,
                               basis, shift, added)  # [1 + H, B, T, D]
      outs = outs.reshape(outs.shape[:1] + (-1, outs.shape[-1]))[:,
                                                                 positions]
      base, heads = outs[0], outs[1:] - outs[:1]  # [P, D], [H, P, D]
    residual = x.reshape(-1, x.shape[-1])[positions][None]  # [1, P, D]
    return base, heads, streamed, residual

  def per_mask(parts, m):
    base, heads, streamed, residual = parts
    # m @ heads, written out: the masks are 0 or 1, so this is the
    # matmul's sum in its order (bitwise the same), fused into the
    # residual's addition instead of a matmul and a transposition.
    def part(h):  # A removed streaming head keeps its windowed part.
      return (m[h] * heads[h] if streamed is None else
              m[h] * heads[h] + (1.0 - m[h]) * streamed[h])
    combined = part(0)
    for h in range(1, count):
      combined = combined + part(h)
    output = base + combined  # [P, D] (shift: already in `base`)
    with nn.intercept_methods(_attention_replaced_by(output)):
      y, _ = block.apply({"params": params[f"layer_{layer}"]}, residual,
                         None, m, deterministic=True, return_weights=False)
    logits = _readout(model, params, y)[0].astype(jnp.float32)  # [P, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         flat_targets)
    right = (jnp.argmax(logits, -1) == flat_targets).astype(jnp.float32)
    return ce @ onehot, right @ onehot

  group = mask_group(positions.shape[0], cfg.mlp_dim)
  if parents is not None:  # mask i under prefix parents[i]
    parts = jax.lax.map(for_prefix, xs)
    return _in_groups(lambda pm: per_mask(
        jax.tree.map(lambda a: a[pm[0]], parts), pm[1]), (parents, codes),
                      group)
  # A prefix at a time, its masks in groups.
  return jax.lax.map(lambda x: _in_groups(
      functools.partial(per_mask, for_prefix(x)), codes, group), xs)


def _exact(correct: Array, tokens: Array) -> Array:
  """Whether each example (last axis) got every one of its ``tokens``
  scored positions right: ``correct`` ``[..., B]`` against ``tokens``
  ``[B]``, as :func:`mha.evaluate.example_metric_sums` counts exact
  matches."""
  tokens = tokens.reshape((1,) * (correct.ndim - 1) + tokens.shape)
  return ((correct == tokens) & (tokens > 0)).astype(jnp.int32)


def mask_group(positions: int, mlp_dim: int) -> int:
  """Masks of the last layer evaluated together (:func:`_last_layer_sums`)
  for ``positions`` valid positions a call: the most, up to
  :data:`MASKS_PER_STEP`, whose MLP activations fit in
  :data:`MASK_GROUP_BYTES`, and at least one."""
  fit = MASK_GROUP_BYTES // max(1, 4 * positions * mlp_dim)
  return int(max(1, min(MASKS_PER_STEP, fit)))


def _in_groups(fn: Callable, xs, group: int):
  """``jax.vmap(fn)(xs)``, ``group`` rows at a time (``jax.lax.map``)
  where ``xs`` (an array or a tuple of them) has more rows than that."""
  if jax.tree.leaves(xs)[0].shape[0] > group:
    return jax.lax.map(fn, xs, batch_size=group)
  return jax.vmap(fn)(xs)


def _streaming_block(model: Transformer, params: Params, layer: int, x: Array,
                     attention_mask: Array, layer_mask: Array,
                     ablation: ablation_lib.Ablation) -> Array:
  """:func:`run_block` with each removed head keeping its streaming
  window (``ablation``: ``streaming``)."""
  with nn.intercept_methods(ablation_lib.streaming_interceptor(
      ablation.sinks, ablation.window)):
    return run_block(model, params, layer, x, attention_mask, layer_mask)


def _readout(model: Transformer, params: Params, x: Array) -> Array:
  """Final LayerNorm (pre-norm models) and the logits."""
  return model.apply({"params": params}, x, method="readout")


def _example_sums(model: Transformer, params: Params, x: Array, inputs: Array,
                  targets: Array) -> tuple[Array, Array, Array]:
  """``(loss_sum, correct, exact)`` ``[B]`` of the last block's output
  ``x``: the read-out and :func:`eval_lib.example_metric_sums`."""
  sums = eval_lib.example_metric_sums(_readout(model, params, x), targets,
                                      inputs)
  return sums["loss_sum"], sums["correct"], sums["exact"]


def subset_metric_sums(model: Transformer, params: Params, inputs: Array,
                       targets: Array,
                       bias_shifts: Array | None = None,
                       first_codes: Array | None = None,
                       positions: Array | None = None,
                       position_weights: Array | None = None,
                       ablation: ablation_lib.Ablation | None = None,
                       last_positions: tuple[Array, Array] | None = None,
                       shared_positions: tuple[Array, Array] | None = None
                       ) -> dict[str, Array]:
  """Per-example :func:`eval_lib.example_metric_sums` under every subset.

  Pure (``jit``, ``vmap`` over stacked parameters). Layer ``l`` runs once
  per distinct mask of the layers below it (see the module docstring).
  ``bias_shifts`` ``[L, H, D]``: mean ablation
  (:func:`mha.pruning.mean_ablation.bias_shifts`) instead of zero ablation.
  ``first_codes`` ``[C, H_0]``: only these masks of layer 0 (a chunk of the
  rows of ``_bits(H_0)``, see :func:`subset_totals`); all ``2**H_0`` when
  None. ``positions`` ``[P]`` (flat indices of the batch's valid positions,
  padded, with ``position_weights`` 1 for a valid one and 0 for padding):
  the last layer runs the fast way (:func:`_last_layer_sums`, the same
  sums to float32 rounding), and every other layer with heads, unless
  ``ablation`` intercepts it, runs what follows its attention on the valid
  positions only (:func:`_run_block_at`; the same to float32 rounding: XLA's
  LayerNorm rounds by the number of rows); else as every other layer.
  ``ablation``
  (aligned with ``inputs``): each removed head replaced as
  :mod:`mha.pruning.ablation` says; under ``streaming`` every layer but the
  fast last one runs under :func:`mha.pruning.ablation.streaming_interceptor`
  (a removed head's windowed output depends on the layer's input, so it is
  computed once per prefix, like the attention weights).
  ``last_positions`` ``([Q], [Q])``: the positions the fast last layer
  runs on, with their weights, where they are fewer than ``positions``:
  the scored ones (the last layer's other outputs are never read).
  ``shared_positions`` (``streaming`` only) ``([S], [S])``: scored
  positions whose output no subset changes, taken out of
  ``last_positions``: a query before ``sinks + window`` sees its whole
  causal context through the window too, at every layer. Their sums are
  computed once, under every head kept, and added to each subset's.

  Returns:
    ``loss_sum``, ``correct``, ``exact``: ``[2**N, B]`` (with
    ``first_codes``: ``[2**(N - H_0) * C, B]``, subset ``first + 2**H_0 *
    rest`` at row ``rest * C + j`` for the ``j``-th of the chunk);
    ``tokens``, ``sequences``: ``[B]``.
  """
  cfg = model.config
  attention_mask = model_mask(cfg, inputs)
  xs = embed_tokens(model, params, inputs)[None]  # [prefixes, B, T, D]
  counted = data.scored(inputs, targets)  # the positions the sums count
  fast = positions is not None and cfg.heads_per_layer[-1] > 0
  added = (ablation.layer_shifts(model, params) if ablation is not None
           else [None] * cfg.num_layers)
  streaming = ablation is not None and ablation.streaming
  streaming_mask = (ablation_lib.windowed(
      attention_mask, inputs.shape[-1], ablation.sinks, ablation.window)
                    if streaming else None)
  if shared_positions is not None and not streaming:
    raise ValueError("shared_positions: only under the streaming ablation")
  if fast:
    inverse = _inverse_positions(positions, position_weights, inputs.size)
    last_positions = last_positions or (positions, position_weights)
  sizes = []
  for layer, count in enumerate(cfg.heads_per_layer):
    codes = (jnp.asarray(first_codes) if layer == 0 and first_codes is not None
             else jnp.asarray(_bits(count)))
    sizes.append(codes.shape[0])
    shift = None if bias_shifts is None else bias_shifts[layer]
    if fast and layer == cfg.num_layers - 1:
      last = functools.partial(_last_layer_sums, model, params,
                               attention_mask=attention_mask, targets=targets,
                               shift=shift, added=added[layer],
                               streaming_mask=streaming_mask)
      loss, correct = last(xs, codes=codes, positions=last_positions[0],
                           weights=last_positions[1])
      if shared_positions is not None:  # the same in every subset
        shared = last(xs[:1], codes=jnp.ones((1, count)),
                      positions=shared_positions[0],
                      weights=shared_positions[1])
        loss, correct = loss + shared[0], correct + shared[1]
      exact = _exact(correct, jnp.sum(counted, axis=-1))
      per_subset = tuple(v.reshape((-1,) + v.shape[2:])
                         for v in (loss, correct, exact))
      break
    if streaming:
      run = functools.partial(
          _streaming_block, model, params, layer,
          attention_mask=attention_mask, ablation=ablation)
    elif fast and added[layer] is None and count:
      run = functools.partial(
          _run_block_at, model, params, layer, attention_mask=attention_mask,
          shift=shift, positions=positions, inverse=inverse)
    else:
      run = functools.partial(
          run_block, model, params, layer, attention_mask=attention_mask,
          shift=shift, added=added[layer])
    per_prefix = lambda x, run=run, codes=codes: jax.vmap(
        lambda m: run(x=x, layer_mask=m))(codes)
    xs = jax.vmap(per_prefix)(xs).reshape((-1,) + xs.shape[1:])
  else:
    per_subset = jax.vmap(lambda x: _example_sums(model, params, x, inputs,
                                                  targets))(xs)
  # xs is ordered C-style over (m_0, ..., m_{L-1}); subset s has layer 0 in
  # its lowest bits: reverse the layer axes.
  axes = tuple(reversed(range(len(sizes)))) + (len(sizes),)
  loss, correct, exact = (
      jnp.transpose(v.reshape(sizes + [v.shape[-1]]), axes).reshape(
          (-1, v.shape[-1])) for v in per_subset)
  return {"loss_sum": loss, "correct": correct, "exact": exact,
          "tokens": jnp.sum(counted, axis=-1),
          "sequences": jnp.any(counted, axis=-1).astype(jnp.int32)}


def _sums(model, params, inputs, targets, per_example, bias_shifts=None,
          first_codes=None, positions=None, position_weights=None,
          ablation=None, last_positions=None, shared_positions=None):
  sums = subset_metric_sums(model, params, inputs, targets, bias_shifts,
                            first_codes, positions, position_weights,
                            ablation, last_positions, shared_positions)
  if per_example:
    return sums
  return {k: jnp.sum(v.astype(jnp.float32), axis=-1) for k, v in sums.items()}


_subset_sums = jax.jit(_sums, static_argnames=("model", "per_example"))


def prefix_plan(config: TransformerConfig, masks: np.ndarray
                ) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
  """How :func:`mask_metric_sums` shares the layers below: per layer ``l``,
  ``(parents, codes)``: the distinct masks of layers ``0..l`` among
  ``masks`` ``[M, L, H]``, each as the index of its own layers ``0..l-1``
  among the previous layer's (``parents`` ``[U_l]``, zeros at layer 0) and
  its layer-``l`` mask (``codes`` ``[U_l, H_l]``). The last layer's rows are
  the masks themselves, in their order (``U_{L-1} = M``). NumPy on the
  host."""
  masks = np.asarray(masks, np.float32)
  count = len(masks)
  plan = []
  below = np.zeros(count, np.int64)  # each mask's prefix id so far
  for layer, heads in enumerate(config.heads_per_layer):
    code = masks[:, layer, :heads]
    if layer == config.num_layers - 1:
      plan.append((below, code))
      break
    # A prefix: the id of the layers below and this layer's mask.
    keys = np.concatenate([below[:, None].astype(np.float32), code], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True,
                                  return_inverse=True)
    plan.append((below[first], code[first]))
    below = inverse.reshape(-1)
  return tuple(plan)


def mask_metric_sums(model: Transformer, params: Params, inputs: Array,
                     targets: Array, plan: tuple[tuple[Array, Array], ...],
                     ablation: ablation_lib.Ablation | None = None,
                     positions: tuple[Array, Array] | None = None
                     ) -> dict[str, Array]:
  """Per-example :func:`eval_lib.example_metric_sums` under each mask of
  :func:`prefix_plan`: layer ``l`` runs once per distinct mask of the
  layers ``0..l`` (as the per-example table of every subset runs them,
  :func:`subset_metric_sums` without positions), so masks that agree below
  share that work; the last layer and the read-out run a group of masks at
  a time (:func:`mask_group`, ``jax.lax.map``). Pure (``jit``). With
  ``positions`` (the batch's scored positions, flat, and their weights,
  padded with weight 0), the last layer runs as the oracle's
  (:func:`_last_layer_sums`: each distinct prefix's head outputs once,
  combined per mask, what follows the attention on the scored positions
  only; the same sums to float32 rounding).

  Returns:
    ``loss_sum``, ``correct``, ``exact``: ``[M, B]``; ``tokens``,
    ``sequences``: ``[B]``.
  """
  cfg = model.config
  attention_mask = model_mask(cfg, inputs)
  xs = embed_tokens(model, params, inputs)[None]  # [prefixes, B, T, D]
  counted = data.scored(inputs, targets)
  added = (ablation.layer_shifts(model, params) if ablation is not None
           else [None] * cfg.num_layers)

  def block(layer):
    if ablation is not None and ablation.streaming:
      return functools.partial(_streaming_block, model, params, layer,
                               attention_mask=attention_mask,
                               ablation=ablation)
    return functools.partial(run_block, model, params, layer,
                             attention_mask=attention_mask,
                             added=added[layer])

  *lower, (parents, codes) = plan
  for layer, (below, layer_codes) in enumerate(lower):
    xs = jax.vmap(lambda p, m, run=block(layer), xs=xs: run(
        x=xs[p], layer_mask=m))(below, layer_codes)

  tokens = jnp.sum(counted, axis=-1)
  if positions is None or not cfg.heads_per_layer[-1]:
    def last(p, m):  # The last block and the read-out of one mask.
      x = block(len(lower))(x=xs[p], layer_mask=m)
      return _example_sums(model, params, x, inputs, targets)[:2]
    # Its masks in groups, as the oracle's (mask_group): their activations
    # near the cache.
    loss, correct = _in_groups(lambda pm: last(*pm), (parents, codes),
                               mask_group(inputs.size, cfg.mlp_dim))
  else:  # The oracle's last layer (_last_layer_sums), mask by mask.
    streaming_mask = (ablation_lib.windowed(
        attention_mask, inputs.shape[-1], ablation.sinks, ablation.window)
                      if ablation is not None and ablation.streaming
                      else None)
    loss, correct = _last_layer_sums(
        model, params, xs, attention_mask, codes, *positions, targets, None,
        added[-1], streaming_mask, parents)
  exact = _exact(correct, tokens)
  return {"loss_sum": loss, "correct": correct, "exact": exact,
          "tokens": tokens,
          "sequences": jnp.any(counted, axis=-1).astype(jnp.int32)}


_mask_sums = jax.jit(mask_metric_sums, static_argnames="model")



# --------------------------------------------------------------------------
# Drivers.
# --------------------------------------------------------------------------


def evaluate_subsets(model: Transformer, params: Params, split: data.Split, *,
                     batch_size: int = 1000,
                     per_example: bool = False,
                     bias_shifts: Array | None = None,
                     ablation: ablation_lib.Ablation | None = None
                     ) -> dict[str, np.ndarray]:
  """Metrics of every subset of heads on ``split`` (mean-ablated with
  ``bias_shifts``, or as ``ablation``, built for ``split``, says: see
  :func:`subset_metric_sums`).

  Args:
    model, params: the model.
    split: the examples (select on validation, report on test).
    batch_size: at most this many examples per jitted call (fewer when
      ``2**N`` subsets x examples would exceed :data:`ROWS_PER_CALL`, or
      :data:`TABLE_ROWS_PER_CALL` and :data:`TABLE_POSITIONS_PER_CALL`
      with ``per_example``).
    per_example: return per-example sums instead of metrics.
    bias_shifts: ``[L, H, D]``, mean ablation
      (:func:`mha.pruning.mean_ablation.bias_shifts`) instead of zero
      ablation; None for none.
    ablation: what a removed head outputs (:mod:`mha.pruning.ablation`,
      built for ``split``); zero when None.

  Returns:
    ``loss``, ``token_accuracy``, ``exact_match``: ``[2**N]`` (streamed,
    :func:`subset_totals`). With ``per_example`` (every layer run as the
    model runs it; ``[2**N, n]`` per metric: small ``N`` only): the
    :func:`mha.evaluate.example_metric_sums` of every example,
    ``loss_sum``, ``correct``, ``exact``, ``tokens``, ``sequences``, each
    ``[2**N, n]``; :func:`mha.evaluate.summarize` of their sums over the
    examples (any resample of them) gives the metrics.
  """
  arguments.check_count("batch_size", batch_size)
  if not per_example:
    return eval_lib.summarize(subset_totals(
        model, params, split, batch_size=batch_size, bias_shifts=bias_shifts,
        ablation=ablation))
  subsets = 2 ** num_heads(model.config)
  length = max(int(np.shape(split.inputs)[-1]), 1)
  examples = max(1, min(batch_size, TABLE_ROWS_PER_CALL // subsets,
                        TABLE_POSITIONS_PER_CALL // (subsets * length)))
  return _table_calls(split, examples, ablation, subsets, lambda inputs,
                      targets, abl, _: _subset_sums(
                          model, params, inputs, targets, per_example,
                          bias_shifts, ablation=abl))


def _table_calls(split: data.Split, examples: int,
                 ablation: ablation_lib.Ablation | None, rows: int,
                 call: Callable[..., dict[str, Array]]
                 ) -> dict[str, np.ndarray]:
  """The per-example sums ``[rows, n]`` of ``call(inputs, targets,
  ablation, b)`` over ``split``'s batches ``b`` of ``examples``, joined in order
  (``tokens`` and ``sequences`` repeated for every row)."""
  parts: dict[str, list[np.ndarray]] = {}
  for b, (inputs, targets, abl) in enumerate(ablation_lib.batched(
      split, examples, ablation)):
    for key, value in jax.device_get(call(inputs, targets, abl, b)).items():
      parts.setdefault(key, []).append(np.asarray(value))
  n = len(split)
  out = {k: np.concatenate(v, axis=-1)[..., :n] for k, v in parts.items()}
  for key in ("tokens", "sequences"):
    out[key] = np.broadcast_to(out[key], (rows, n))
  return out


def evaluate_mask_list(model: Transformer, params: Params,
                       split: data.Split, masks: np.ndarray, *,
                       batch_size: int = 1000,
                       ablation: ablation_lib.Ablation | None = None
                       ) -> dict[str, np.ndarray]:
  """The per-example sums ``[M, n]`` of each of ``masks`` ``[M, L, H]`` on
  ``split`` (removed heads replaced as ``ablation``, built for ``split``,
  says), the layers below shared between masks that agree there
  (:func:`prefix_plan`, :func:`mask_metric_sums`): the numbers of the
  per-example table of every subset (:func:`evaluate_subsets`), for only
  the masks asked for. A call holds at most :data:`TABLE_ROWS_PER_CALL`
  rows (prefixes x examples) and :data:`TABLE_POSITIONS_PER_CALL`
  positions, as that table's calls do.

  Returns:
    ``loss_sum``, ``correct``, ``exact``, ``tokens``, ``sequences``:
    ``[M, n]`` each; :func:`mha.evaluate.summarize` of their sums over the
    examples gives the metrics.
  """
  arguments.check_count("batch_size", batch_size)
  config = model.config
  masks = np.asarray(masks, np.float32)
  count, n = len(masks), len(split)
  if count == 0:
    return {key: np.zeros((0, n), np.float32) for key in eval_lib.SUM_KEYS}
  plan = prefix_plan(config, masks)
  widest = max(len(parents) for parents, _ in plan)
  length = max(int(np.shape(split.inputs)[-1]), 1)
  examples = max(1, min(batch_size, TABLE_ROWS_PER_CALL // widest,
                        TABLE_POSITIONS_PER_CALL // (widest * length)))
  plan = tuple((jnp.asarray(p, jnp.int32), jnp.asarray(c)) for p, c in plan)
  scored, _ = _last_layer_positions(split, examples, None)
  return _table_calls(split, examples, ablation, count, lambda inputs,
                      targets, abl, b: _mask_sums(model, params, inputs,
                                                  targets, plan, abl,
                                                  scored[b]))


def call_shape(config: TransformerConfig, batch_size: int,
               rows: int = ROWS_PER_CALL) -> tuple[int, int]:
  """``(examples, first)`` of one call of :func:`subset_totals`: examples
  per call and layer-0 masks per call, about ``rows`` subsets x examples.

  Examples first (up to ``batch_size``, and to
  :data:`CALL_ATTENTION_ENTRIES` over the square of the model's positions):
  the more examples a call has, the less its valid positions are padded
  (:func:`subset_totals`); then as many of layer 0's masks (a power of two)
  as still fit. A call's memory is that of about ``rows`` rows whatever
  ``N``.
  """
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("rows", rows)
  first = 2 ** config.heads_per_layer[0]
  rest = 2 ** (num_heads(config) - config.heads_per_layer[0])
  examples = max(1, min(batch_size, rows // rest,
                        CALL_ATTENTION_ENTRIES // max(1, config.max_len) ** 2))
  chunk = max(1, rows // (examples * rest))
  return examples, min(first, 1 << (chunk.bit_length() - 1))


def subset_totals(model: Transformer, params: Params, split: data.Split, *,
                  batch_size: int = 1000, bias_shifts: Array | None = None,
                  rows: int = ROWS_PER_CALL,
                  log: Log = quiet,
                  ablation: ablation_lib.Ablation | None = None,
                  per_example: bool = False
                  ) -> dict[str, np.ndarray]:
  """The metric sums of every subset of heads over ``split``, streamed.

  The exhaustive oracle without its per-example table: each call evaluates
  a block of subsets on a batch of examples (:func:`call_shape`) and only
  the sums over the examples are kept, ``[2**N]`` float64 per metric. The
  memory is ``O(2**N)`` numbers plus one call's activations, so 16 heads
  (65,536 subsets) fit where a per-example table (``[2**N, n]`` per metric)
  would not. The last layer runs in an exact reformulation
  (:func:`_last_layer_sums`), so the sums equal those of
  :func:`evaluate_subsets` to float32 rounding: the loss in its last bits,
  and a token whose two best logits lie within rounding of each other can be
  counted the other way.

  With ``per_example`` the same calls keep each example's sums instead of
  adding them up: the per-example table of :func:`evaluate_subsets`
  (``[2**N, n]`` per key, float64, in ``split``'s order) from the fast
  path, to float32 rounding as above; for small ``N`` and ``n`` only
  (:func:`table_bytes`).

  Returns:
    ``loss_sum``, ``correct``, ``exact``, ``tokens``, ``sequences``:
    ``[2**N]`` sums over the examples (``[2**N, n]`` with ``per_example``);
    :func:`mha.evaluate.summarize` of the sums gives the metrics.
  """
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("rows", rows)
  config = model.config
  n = num_heads(config)
  examples, chunk = call_shape(config, batch_size, rows)
  first = 2 ** config.heads_per_layer[0]
  rest = 2 ** n // first
  codes = _bits(config.heads_per_layer[0])
  keys = ("loss_sum", "correct", "exact")
  totals = {k: np.zeros((rest, first)) for k in keys}
  kept: dict[str, dict[int, np.ndarray]] = {k: {} for k in keys}
  valid = data.scored(np.asarray(split.inputs), np.asarray(split.targets))
  balanced = _balanced(split, examples)
  if ablation is not None and ablation.donors is not None:
    # Donors have their example's length: they are dealt to the same slots.
    donors = np.asarray(ablation.donors)
    ablation = ablation.replace(
        donors=_balanced(data.Split(donors, donors), examples).inputs)
  num_batches = -(-len(balanced) // examples)
  # The batches' valid positions, from the host copy (core.batches cuts the
  # same consecutive rows): one width, the most of any batch.
  valid_positions = _batch_positions(np.asarray(balanced.inputs) != 0,
                                     examples)
  # The last layer's positions: the scored ones, and under streaming those
  # no subset changes apart (subset_metric_sums).
  last, shared = _last_layer_positions(balanced, examples, ablation)
  progress = Tenths(log, "subsets", num_batches, PROGRESS_AFTER_S)

  def add(start: int, batch: int, out: dict[str, np.ndarray]) -> None:
    """Adds one call's sums over its examples to the totals (float64), or
    with ``per_example`` keeps them in the batch's columns."""
    for key, total in totals.items():
      value = np.asarray(out[key], np.float64).reshape(rest, chunk, -1)
      if per_example:
        columns = kept[key].setdefault(
            batch, np.zeros((rest, first, value.shape[-1])))
        columns[:, start:start + chunk] = value
      else:
        total[:, start:start + chunk] += np.sum(value, axis=-1)

  program = _subset_sums
  run = lambda args: jax.device_get(program(*args))
  # The first call compiles alone; then DISPATCH_THREADS threads run that
  # very executable (_pinned), IN_FLIGHT each ahead of the oldest call, whose
  # sums the host adds in call order (the totals do not depend on the
  # threads).
  pending: collections.deque = collections.deque()
  with concurrent.futures.ThreadPoolExecutor(DISPATCH_THREADS) as pool:
    for b, (inputs, targets, abl) in enumerate(
        ablation_lib.batched(balanced, examples, ablation)):
      positions, weights = valid_positions[b]
      for start in range(0, first, chunk):
        args = (model, params, inputs, targets, True, bias_shifts,
                None if chunk == first else codes[start:start + chunk],
                positions, weights, abl, last[b],
                None if shared is None else shared[b])
        if b == 0 and start == 0:
          add(start, b, run(args))
          run = _pinned(program, args)
          continue
        pending.append((start, b, pool.submit(run, args)))
        while len(pending) > DISPATCH_THREADS * IN_FLIGHT:
          done_start, done_b, future = pending.popleft()
          add(done_start, done_b, future.result())
      progress(b + 1, f"batches of {examples} examples")
    while pending:
      done_start, done_b, future = pending.popleft()
      add(done_start, done_b, future.result())
  if per_example:  # the batches' columns, back in split's order
    slots = _balanced_slots(split, examples)
    out = {k: np.concatenate([v[b] for b in sorted(v)], axis=-1).reshape(
        2 ** n, -1)[:, slots] for k, v in kept.items()}
    counts = {"tokens": valid.sum(axis=-1),
              "sequences": valid.any(axis=-1)}
    return {**out, **{k: np.broadcast_to(np.asarray(v, np.float64),
                                         (2 ** n, len(split)))
                      for k, v in counts.items()}}
  out = {k: v.reshape(-1) for k, v in totals.items()}
  counts = {"tokens": float(valid.sum()),
            "sequences": float(valid.any(axis=-1).sum())}
  return {**out, **{k: np.full(2 ** n, v) for k, v in counts.items()}}


def _pinned(program, args: tuple) -> Callable[[tuple], dict[str, np.ndarray]]:
  """A function of a call's ``args`` (shaped as ``args``) that runs the
  executable ``program`` compiled for ``args`` on this thread (jit's caches
  hold it: nothing is compiled again) and fetches its sums. The threads of
  :func:`subset_totals` call it, so they run exactly that program whatever
  their own thread-local JAX settings (``jax.enable_x64``,
  ``jax.default_device`` and the like do not reach other threads)."""
  compiled = program.lower(*args).compile()
  # An executable takes the arguments but the static ones (_sums' model and
  # per_example, at positions 0 and 4).
  return lambda a: jax.device_get(compiled(*a[1:4], *a[5:]))


def _balanced_slots(split: data.Split, examples: int) -> np.ndarray:
  """``[n]``: the row of :func:`_balanced` that holds each example of
  ``split``."""
  n = len(split)
  count = -(-n // examples)
  if count <= 1:
    return np.arange(n)
  lengths = np.sum(np.asarray(split.inputs) != 0, axis=1)
  order = np.argsort(-lengths, kind="stable")
  rank = np.arange(n)
  lap, seat = rank // count, rank % count
  batch = np.where(lap % 2 == 0, seat, count - 1 - seat)
  slots = np.empty(n, np.int64)
  slots[order] = batch * examples + lap  # each batch's examples side by side
  return slots


def _balanced(split: data.Split, examples: int) -> data.Split:
  """``split`` reordered (and padded with empty examples, which count
  nothing) so that consecutive batches of ``examples`` hold about the same
  number of valid positions: examples dealt by length in snake order
  (:func:`_balanced_slots`). Sums over the examples do not depend on the
  batches."""
  n = len(split)
  count = -(-n // examples)
  if count <= 1:
    return split
  slots = _balanced_slots(split, examples)
  inputs = np.zeros((count * examples,) + split.inputs.shape[1:],
                    split.inputs.dtype)
  targets = np.zeros((count * examples,) + split.targets.shape[1:],
                     split.targets.dtype)
  inputs[slots] = split.inputs
  targets[slots] = split.targets
  return data.Split(inputs, targets)


def _last_layer_positions(split: data.Split, examples: int,
                          ablation: ablation_lib.Ablation | None
                          ) -> tuple[list, list | None]:
  """Per batch of ``examples`` of ``split`` (host arrays), the positions
  and weights of :func:`subset_metric_sums`'s ``last_positions`` (the
  scored ones) and, under ``streaming``, its ``shared_positions`` (those
  before ``sinks + window``, taken out of the first)
  (:func:`_batch_positions`)."""
  scored = data.scored(np.asarray(split.inputs), np.asarray(split.targets))
  shared = np.zeros_like(scored)
  if ablation is not None and ablation.streaming:
    shared[..., :ablation.sinks + ablation.window] = True
    shared &= scored
  return (_batch_positions(scored & ~shared, examples),
          _batch_positions(shared, examples) if shared.any() else None)


def _batch_positions(where: np.ndarray, examples: int
                     ) -> list[tuple[Array, Array]]:
  """Per batch of ``where`` (host bool, one row an example) as
  :func:`mha.pruning.ablation.batches` cuts batches of ``examples`` (their
  rows rounded up to a multiple of the devices), the flat indices of its
  True entries and their weights (1), padded with index 0 and weight 0 to
  the widest batch's count, so that one program serves every batch."""
  rows = sharding_lib.eval_batch_rows(examples, len(where),
                                      sharding_lib.make_mesh())
  batches = [where[b:b + rows] for b in range(0, len(where), rows)]
  width = max(1, max(int(batch.sum()) for batch in batches))
  out = []
  for batch in batches:
    flat = np.flatnonzero(batch.reshape(-1))
    positions = np.zeros(width, np.int32)
    positions[:len(flat)] = flat
    weights = np.zeros(width, np.float32)
    weights[:len(flat)] = 1.0
    out.append((jnp.asarray(positions), jnp.asarray(weights)))
  return out


#: Seconds per subset of heads of the streamed oracle of one model on 2 CPU
#: cores (fitted with the grid's cell times of 2026-11-27: about 14 s at 12
#: heads; 155-250 s at 16 heads alone), a rough guess elsewhere.
SECONDS_PER_SUBSET = 3.5e-3
#: The validation positions (non-padding tokens) those seconds were fitted
#: on: 1,000 examples of 1 to 16 tokens, 8.5 on average.
REFERENCE_POSITIONS = 8_500
#: Where the split is known (:func:`expected_seconds`), the guess is, per
#: subset, :data:`SUBSET_OVERHEAD_S` plus the scored positions times the
#: multiply-adds of the last block's MLP and read-out a position
#: (:func:`_position_cost`) at :data:`MULTIPLY_ADDS_PER_S`; plus, once for
#: each subset of the layers below, every position's multiply-adds there
#: (:func:`_lower_cost`) at :data:`LOWER_MULTIPLY_ADDS_PER_S`. Fitted on 2
#: CPU cores (AMD EPYC, 2026-12-07; least squares of the log ratio) to five
#: oracles (``benchmarks/oracle_benchmark.py``), measured (guessed):
#: ``deep64`` 13.5 s (18.5), and under ``streaming:4,16`` ``passkey`` at
#: 128 windows 4.1 s (3.3), 12-head ``mqar`` at 256 windows 39.7 s (45.2),
#: ``pylm`` at 96 windows 161.5 s (154.9), 16-head ``mqar`` 224 s (187).
SUBSET_OVERHEAD_S = 1.43e-3
MULTIPLY_ADDS_PER_S = 7.9e10
LOWER_MULTIPLY_ADDS_PER_S = 2.41e10
#: Above this many seconds of oracle (all seeds), the study refuses to start
#: unless the estimate is accepted (``--accept_estimate``).
ACCEPT_ABOVE_S = 30 * 60


def expected_seconds(config: TransformerConfig,
                     positions: int | None = None,
                     examples: int | None = None) -> float:
  """A rough guess of the oracle's seconds for one model of ``config`` on 2
  CPU cores, ``2**N`` subsets: :data:`SECONDS_PER_SUBSET` each (the grid's
  guess, fitted to its cells) or, given the validation split's scored
  ``positions``, :data:`SUBSET_OVERHEAD_S` plus their multiply-adds
  (:func:`_position_cost`) at :data:`MULTIPLY_ADDS_PER_S` each; given its
  ``examples`` too, plus the layers below the last on every position
  (:func:`_lower_cost`) at :data:`LOWER_MULTIPLY_ADDS_PER_S`."""
  if positions is None:
    return SECONDS_PER_SUBSET * 2.0 ** num_heads(config)
  seconds = 2.0 ** num_heads(config) * (
      SUBSET_OVERHEAD_S
      + positions * _position_cost(config) / MULTIPLY_ADDS_PER_S)
  if examples is not None:
    seconds += (examples * max(config.max_len, 1) * _lower_cost(config)
                / LOWER_MULTIPLY_ADDS_PER_S)
  return seconds


def tokens(split: data.Split) -> int:
  """The scored positions of ``split`` (non-padding, target >= 0), those
  the last layer runs on for each subset: the ``positions`` of
  :func:`expected_seconds`."""
  return int(np.sum(data.scored(np.asarray(split.inputs),
                                np.asarray(split.targets))))


def _position_cost(config: TransformerConfig) -> int:
  """Multiply-adds per subset and position of what the oracle runs once per
  subset: the last block's MLP and the read-out."""
  return (2 * config.d_model * config.mlp_dim
          + config.d_model * config.vocab_size)


def _lower_cost(config: TransformerConfig) -> float:
  """Multiply-adds a position of what the oracle runs once per subset of
  the layers below the last: each such block (its projections, its
  attention over ``max_len`` keys, its MLP) once per subset of its layer
  and those below, and the last block's attention once per subset of the
  layers below it."""
  d, length = config.d_model, max(config.max_len, 1)
  attention = 4 * d * d + 2 * length * d
  heads = config.heads_per_layer
  cost = 2.0 ** sum(heads[:-1]) * attention
  for layer in range(len(heads) - 1):
    cost += 2.0 ** sum(heads[:layer + 1]) * (attention
                                              + 2 * d * config.mlp_dim)
  return cost


def describe_seconds(seconds: float) -> str:
  """An estimate's seconds in words: ``1.2 h``, ``14 min``, ``35 s`` or
  ``0.4 s``."""
  return (f"{seconds / 3600:.1f} h" if seconds >= 3600 else
          f"{seconds / 60:.0f} min" if seconds >= 60 else
          f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s")


def describe_cost(config: TransformerConfig, models: int = 1,
                  positions: int | None = None,
                  examples: int | None = None) -> str:
  """``every subset of N heads (2**N) for M models: about T, G GiB``: the
  oracle's estimate (on ``positions`` scored validation tokens of
  ``examples`` windows where given: :func:`expected_seconds`), time (on 2
  CPU cores) and memory, in words."""
  n = num_heads(config)
  time_ = describe_seconds(expected_seconds(config, positions, examples)
                           * models)
  return (f"every subset of {n} heads (2**{n} = {2**n:,}) for {models} "
          f"model{'s' * (models != 1)}: about {time_} (estimate, 2 CPU "
          f"cores) and {oracle_bytes(config) / 2**30:.2f} GiB")


def oracle_bytes(config: TransformerConfig,
                 rows: int = ROWS_PER_CALL) -> int:
  """About the bytes :func:`subset_totals` and the oracle's selection need
  beyond the model and its data: five float64 sums and a few bookkeeping
  arrays per subset (``O(2**N)``), the bits of every subset, and one call's
  hidden states (:func:`call_shape` at the study's batch size: its subsets x
  examples, each ``max_len x d_model`` float32), three times over.

  Under ``streaming:4,16`` (2 CPU cores, 2026-12-07; the process's peak
  after the oracle less its peak before, the model and data loaded) the
  oracle took 0.12 GiB at 8 heads of context 256 (this guess: 0.09), 0.33 at
  12 heads of width 16 and 0.43 of width 32 at context 128 (0.38 and 0.75),
  0.34 at 16 heads of width 8 (0.38). The guess before, ``rows x max_len x
  16 x max(d_model, mlp_dim, vocab_size)`` bytes, said 2 to 4 GiB for them.
  """
  arguments.check_count("rows", rows)
  n = num_heads(config)
  per_subset = 8 * (5 + 3 + 3) + 4 * n
  examples, first = call_shape(config, 1000, rows)
  call_rows = examples * first * 2 ** (n - config.heads_per_layer[0])
  act = 3 * 4 * call_rows * max(config.max_len, 1) * config.d_model
  return 2 ** n * per_subset + act


def ranked_removals(values: np.ndarray, config: TransformerConfig, *,
                    no_layer_emptied: bool = False,
                    top: int = 1) -> list[list[np.ndarray]]:
  """For each number ``k`` of heads removed, the removed heads of the
  ``top`` best subsets, best first (see :func:`best_removals`)."""
  arguments.check_count("top", top)
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
  the heads of ``S`` kept). The values sum to ``v(all) - v(none)``. NumPy
  on the host, in float64: not for ``jit``.

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
#: Largest per-example table of every subset (:func:`table_bytes`) kept in
#: memory where one is handy (mean ablation's curves look their masks up in
#: it); larger ones are streamed (:func:`subset_totals`).
PER_EXAMPLE_BYTES = 1 << 26
#: The two oracles: among all subsets, and among those keeping at least one
#: head in every layer that has heads.
VARIANTS = ("all", "no_layer_emptied")


def table_bytes(config: TransformerConfig, num_examples: int) -> int:
  """About the bytes the study's per-example table of every subset takes:
  five sums ``[2**N, n]``, held as float64 while they are summarised."""
  arguments.check_count("num_examples", num_examples, 0)
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
  arguments.check_count("max_heads", max_heads)
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
  arguments.check_count("top", top)
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

  ``table``: the sums of every subset on ``validation`` (per example,
  ``[2**N, n]``, from ``evaluate_subsets(..., per_example=True)``, or
  totals ``[2**N]`` from :func:`subset_totals`) when already evaluated;
  otherwise they are streamed here (:func:`subset_totals`).
  """
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("top", top)
  if table is None:
    table = subset_totals(model, params, validation, batch_size=batch_size)
  per_example = np.ndim(table["correct"]) == 2
  values = subset_values(core.summarize_examples(table) if per_example
                         else eval_lib.summarize(table))
  return ranked_removals(values, model.config,
                         no_layer_emptied=no_layer_emptied, top=top)


def _part(split: data.Split, ablation: ablation_lib.Ablation | None,
          start: int, stop: int
          ) -> tuple[data.Split, ablation_lib.Ablation | None]:
  """Examples ``start:stop`` of ``split`` and the ``ablation`` built for it
  (resample's donors are per example: cut alike)."""
  part = data.Split(split.inputs[start:stop], split.targets[start:stop])
  if ablation is not None and ablation.donors is not None:
    ablation = ablation.replace(donors=ablation.donors[start:stop])
  return part, ablation


def evaluate_oracle(model: Transformer, params: Params,
                    validation: data.Split, *, batch_size: int,
                    max_heads: int, log: Log = quiet,
                    timings: dict[str, float] | None = None,
                    ablation: ablation_lib.Ablation | None = None,
                    first_half: dict[str, np.ndarray] | None = None,
                    table: dict[str, np.ndarray] | None = None
                    ) -> tuple[dict[str, np.ndarray] | None, np.ndarray,
                               dict[str, list[list[np.ndarray]]]]:
  """Every subset on validation (removed heads replaced as ``ablation``,
  built for ``validation``, says), streamed (:func:`subset_totals`): the
  metrics of every subset (``loss``, ``token_accuracy``, ``exact_match``,
  ``[2**N]`` each), exact Shapley values ``[L, H]`` of token accuracy, and
  the oracle's candidates per variant (:func:`removals_by_variant`);
  ``(None, NaN, {})`` above ``max_heads``. ``timings["oracle_s"]``
  receives the seconds it took.

  ``first_half``: when given (a dict), validation is streamed as its two
  halves (the first ``len // 2`` examples, then the rest, as
  :func:`mha.pruning.orderings.halves` cuts it), their sums added for the
  whole, and ``first_half`` receives the first half's metrics: what
  chooses the candidates of a level chosen on that half alone (about the
  same work as one pass).

  ``table``: when given (a dict) and the per-example table of every subset
  fits in :data:`PER_EXAMPLE_BYTES` (:func:`table_bytes`), it receives that
  table (:func:`subset_totals` with ``per_example``: the same calls, each
  example's sums kept), so that masks on validation are looked up instead
  of evaluated again; else it stays empty."""
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("max_heads", max_heads)
  config = model.config
  n = num_heads(config)
  if not oracle_applies(config, max_heads):
    log(f"  oracle and Shapley values skipped: {n} heads > "
        f"--oracle_max_heads={max_heads}")
    return None, np.full(head_masks.existing_heads(config).shape, np.nan), {}
  timings = {} if timings is None else timings
  keep = table is not None and (
      table_bytes(config, len(validation)) <= PER_EXAMPLE_BYTES)

  def stream(split, abl):
    """``(totals, table)``: the sums over ``split``'s examples, and the
    per-example table they add up (None unless kept)."""
    sums = subset_totals(model, params, split, batch_size=batch_size,
                         log=log, ablation=abl, per_example=keep)
    if not keep:
      return sums, None
    return {k: np.sum(v, axis=-1) for k, v in sums.items()}, sums

  def whole():
    totals, sums = stream(validation, ablation)
    if keep:
      table.update(sums)
    return totals

  if first_half is None or len(validation) < 2:
    totals, timings["oracle_s"] = timed(
        log, f"oracle: all {2 ** n} subsets of heads on validation, layer "
        "by layer, streamed", whole)
  else:
    middle = len(validation) // 2

    def by_halves():
      a, a_sums = stream(*_part(validation, ablation, 0, middle))
      b, b_sums = stream(*_part(validation, ablation, middle,
                                len(validation)))
      first_half.update(eval_lib.summarize(a))
      if keep:
        table.update({k: np.concatenate([a_sums[k], b_sums[k]], axis=-1)
                      for k in a_sums})
      return {k: a[k] + b[k] for k in a}
    totals, timings["oracle_s"] = timed(
        log, f"oracle: all {2 ** n} subsets of heads on validation, layer "
        "by layer, streamed, half by half", by_halves)
  metrics = eval_lib.summarize(totals)
  removals = removals_by_variant(subset_values(metrics), config)
  shapley = shapley_values(metrics["token_accuracy"], config)
  return metrics, shapley, removals


__all__ = ["subset_masks", "subset_index", "kept_counts", "num_heads",
           "subset_metric_sums", "evaluate_subsets", "call_shape",
           "prefix_plan", "mask_metric_sums", "evaluate_mask_list",
           "subset_totals", "oracle_bytes", "best_removals",
           "ranked_removals", "shapley_values", "ORACLE_CANDIDATES",
           "PER_EXAMPLE_BYTES", "TABLE_ROWS_PER_CALL",
           "TABLE_POSITIONS_PER_CALL", "VARIANTS", "table_bytes", "machine_memory_bytes",
           "oracle_applies", "subset_values", "tokens",
           "removals_by_variant", "oracle_removals", "evaluate_oracle",
           "embed_tokens", "run_block", "attention_outputs",
           "describe_seconds"]
