"""Ablation modes: what a removed head outputs instead of its context.

A head mask ``m`` gates each head's context ``c_h`` before the attention's
output projection. Removing head ``h`` replaces its context by a baseline
``r_h``; the projection is linear, so the layer's output becomes

    out = sum_h (m_h c_h + (1 - m_h) r_h) W_o[h] + b
        = [the zero-ablated output] + sum_h (1 - m_h) s_h,    s_h = r_h W_o[h],

and every mode is zero ablation plus a *shift* ``s`` added for each removed
head. The modes (:data:`MODES`):

* ``zero``: ``r = 0`` (the head mask as it is; no shift);
* ``mean``: ``r_h`` is the head's mean context over every non-padding
  position of a reference split (validation) of the unpruned model;
* ``mean_position``: the mean at each position separately (over the
  reference examples long enough to have it): on ``reverse`` a head's
  output depends on where it is;
* ``resample``: the head's context on *another example of the same length*
  of the same split, in the unpruned model (resample ablation): shifts
  ``[B, T, D]`` per example, computed inside the jitted call from the donor
  examples' tokens (one more forward pass);
* ``streaming:SINKS,WINDOW`` (causal models): the head keeps a streaming KV
  cache instead of vanishing (StreamingLLM's sinks and recent window): it
  attends to the first ``SINKS`` positions and the last ``WINDOW``
  positions up to and including the query (:func:`window_mask`). Its shift
  ``r_h W_o[h]`` is then the head's own output under the window mask, a
  function of the layer's input; :func:`streaming_interceptor` applies it.
  A mask value between 0 and 1 mixes the two outputs (DuoAttention's gate).

An :class:`Ablation` holds a mode and its data for one split (for resample,
one donor per example of that split, aligned with it); the functions of
:mod:`mha.pruning.core` and :mod:`mha.pruning.oracle` take it as
``ablation=`` and batch its donors with the examples (:func:`batched`).
Everything is pure: ``jit``, ``grad`` and ``vmap`` over masks pass through.

    abl = build(model, params, "mean_position", splits["validation"],
                splits["test"])
    core.evaluate_masks(model, params, splits["test"], masks, ablation=abl)

:func:`attribution` is attribution patching: the first-order estimate of
each head's removal under a baseline, ``-dL/dm_h`` at the full mask.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha.run import sharding as sharding_lib
from mha.aliases import Array, Params
from mha.attention import MultiHeadAttention
from mha.model import Transformer, TransformerConfig
from mha.pruning.constants import (ABLATION_MODES, ABLATION_STREAMING,
                                   parse_ablation)
from mha.run import arguments

#: The ablation modes whose replacement is a fixed shift (``--ablation``'s
#: choices besides ``streaming:SINKS,WINDOW``).
MODES = ABLATION_MODES
#: The mode in which a removed head keeps sinks and a recent window.
STREAMING = ABLATION_STREAMING
#: ``(mode, sinks, window)`` of an ``--ablation`` value (ValueError if
#: malformed): :func:`mha.pruning.constants.parse_ablation`.
parse = parse_ablation


@struct.dataclass
class Ablation:
  """An ablation mode and its data for one split.

  Attributes:
    mode: one of :data:`MODES`.
    shifts: ``[L, H, 1, T | 1, D]`` (``mean``: ``T`` axis 1;
      ``mean_position``: one row per position): what each removed head adds
      to its layer's output, ``r_h W_o[h]`` (zeros where no head).
    donors: ``[n, T]`` int32 (``resample``): each example's donor tokens,
      aligned with the split (or with a batch of it inside a call). Once
      :meth:`resolved`, resample carries its donors' shifts ``[L, H, B, T,
      D]`` in ``shifts`` instead.
    sinks, window: ``streaming`` only: the positions a removed head keeps.
  """

  mode: str = struct.field(pytree_node=False)
  shifts: Array | None = None
  donors: Array | None = None
  sinks: int = struct.field(pytree_node=False, default=0)
  window: int = struct.field(pytree_node=False, default=0)

  @property
  def streaming(self) -> bool:
    """Whether a removed head keeps a streaming cache (its shift depends on
    the layer's input, so :meth:`layer_shifts` has none)."""
    return self.mode == STREAMING

  @property
  def spec(self) -> str:
    """The ``--ablation`` value this ablation is (``streaming:4,16``)."""
    return (f"{STREAMING}:{self.sinks},{self.window}" if self.streaming
            else self.mode)

  def layer_shifts(self, model: Transformer,
                   params: Params) -> list[Array | None]:
    """Per layer ``[H_l, B | 1, T | 1, D]`` (None under zero ablation):
    the shift each head adds when removed, for the examples this ablation
    is aligned with (resample: the donors' head outputs, computed here)."""
    config = model.config
    if self.mode == "zero" or self.streaming:
      return [None] * config.num_layers
    if self.shifts is None:  # resample, not yet resolved
      outs = head_outputs(model, params, jnp.asarray(self.donors))
      return [None if o is None else jax.lax.stop_gradient(o) for o in outs]
    return [self.shifts[l, :c] if c else None
            for l, c in enumerate(config.heads_per_layer)]

  def resolved(self, model: Transformer, params: Params) -> "Ablation":
    """This ablation with its shifts computed: resample's donors run once
    here (``shifts`` ``[L, H, B, T, D]``, zeros where no head), not once per
    mask where many masks share a batch. Other modes are returned as they
    are."""
    if self.mode != "resample" or self.shifts is not None:
      return self
    config = model.config
    shape = ((config.max_heads,) + tuple(self.donors.shape)
             + (config.d_model,))
    rows = [jnp.zeros(shape, jnp.float32) if shift is None else
            jnp.zeros(shape, jnp.float32).at[:shift.shape[0]].set(shift)
            for shift in self.layer_shifts(model, params)]
    return self.replace(shifts=jnp.stack(rows), donors=None)


def check_mode(mode: str) -> str:
  """``mode`` if it is one of :data:`MODES` or a well-formed
  ``streaming:SINKS,WINDOW`` (:func:`parse`), else ``ValueError``."""
  parse(mode)
  return mode


def check_streaming(spec: str, config: TransformerConfig,
                    context: int) -> None:
  """``ValueError`` unless ``streaming:SINKS,WINDOW`` applies to a model of
  ``config`` at sequences of ``context`` tokens: the model is causal (a
  streaming cache is a decoder's) and ``SINKS + WINDOW < context`` (else a
  streaming head keeps every position: nothing to save). Other modes
  pass."""
  mode, sinks, window = parse(spec)
  if mode != STREAMING:
    return
  if not config.causal:
    raise ValueError(f"ablation {spec!r} needs a causal decoder; this "
                     "model is an encoder (model.causal=False)")
  if sinks + window >= context:
    raise ValueError(
        f"ablation {spec!r}: SINKS + WINDOW = {sinks + window} keeps every "
        f"position of a context of {context} tokens; nothing to save "
        f"(use SINKS + WINDOW < {context})")


def window_mask(length: int, sinks: int, window: int) -> Array:
  """``[length, length]`` bool: query ``t`` may attend to key ``s`` iff
  ``s <= t`` and ``s < sinks`` or ``t - s < window`` (the first ``sinks``
  positions and the last ``window`` up to and including the query)."""
  t = jnp.arange(length)[:, None]
  s = jnp.arange(length)[None, :]
  return (s <= t) & ((s < sinks) | (t - s < window))


def windowed(mask: Array | None, length: int, sinks: int,
             window: int) -> Array:
  """``mask`` (``[..., T, T]`` bool, or None) restricted to
  :func:`window_mask`."""
  kept = window_mask(length, sinks, window)
  if mask is None:
    return kept
  return jnp.logical_and(mask, kept.reshape((1,) * (mask.ndim - 2)
                                            + kept.shape))


def kv_memory(kept: Any, num_heads: int, context: int, sinks: int,
              window: int) -> np.ndarray:
  """The share of a full KV cache kept when ``kept`` of ``num_heads``
  heads keep all ``context`` positions and the others ``sinks + window``:
  ``(k T + (N - k) min(S + W, T)) / (N T)``."""
  kept = np.asarray(kept, np.float64)
  held = min(sinks + window, context)
  return (kept * context + (num_heads - kept) * held) / (num_heads * context)


# --------------------------------------------------------------------------
# The pure core.
# --------------------------------------------------------------------------


def _is_out_projection(context: Any) -> bool:
  """Whether ``context`` is the call of an attention output projection
  (``.../attention/out``)."""
  path = context.module.path
  return bool(context.method_name == "__call__" and len(path) >= 2
              and path[-2:] == ("attention", "out")
              and isinstance(context.module, nn.DenseGeneral))


def layer_of(context: Any) -> int | None:
  """The layer index when ``context`` is the call of a layer's attention
  output projection (``layer_<l>/attention/out``), else None."""
  path = context.module.path
  if _is_out_projection(context) and len(path) >= 3:
    return int(path[-3].split("_")[-1])
  return None


def head_outputs(model: Transformer, params: Params,
                 inputs: Array) -> list[Array | None]:
  """Per layer ``[H_l, B, T, D]``: what each head adds to the layer's
  output in the unpruned model, its context times its rows of the output
  projection (None for a layer without heads)."""
  found: dict[int, Array] = {}

  def capture(next_fun, args, kwargs, context):
    layer = layer_of(context)
    if layer is not None:
      kernel = params[f"layer_{layer}"]["attention"]["out"]["kernel"]
      found[layer] = jnp.einsum("bthd,hdo->hbto", args[0], kernel)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(capture):
    model.apply({"params": params}, inputs, return_weights=False)
  return [found.get(layer) for layer in range(model.config.num_layers)]


def _shifted(out: Array, layer_mask: Array, shift: Array) -> Array:
  """``out`` plus ``sum_h (1 - m_h) shift_h``: each removed head's shift."""
  return out + jnp.tensordot(1.0 - layer_mask, shift, axes=1).astype(
      out.dtype)


def block_interceptor(layer_mask: Array, shift: Array) -> Callable[..., Any]:
  """An ``nn.intercept_methods`` interceptor for one block applied alone:
  adds ``sum_h (1 - m_h) shift_h`` (``shift`` ``[H, B | 1, T | 1, D]``) to
  its attention's output projection, so the block is ablated."""

  def intercept(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return (_shifted(out, layer_mask, shift) if _is_out_projection(context)
            else out)
  return intercept


def streaming_interceptor(sinks: int, window: int) -> Callable[..., Any]:
  """An ``nn.intercept_methods`` interceptor under which every attention
  layer called with a ``head_mask`` ``m`` gives

      out = sum_h (m_h c_h + (1 - m_h) c^s_h) W_o[h] + b,

  ``c^s_h`` the head's context under its mask and :func:`window_mask`: a
  removed head keeps a streaming cache. The layer runs once on its inputs
  stacked twice, under ``m`` and its mask, and under ``1 - m`` and the
  window; the two outputs are added and the bias counted twice taken off
  (the same as the per-head masks up to float32 rounding)."""

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    head_mask = kwargs.get("head_mask")
    if (not isinstance(module, MultiHeadAttention)
        or context.method_name != "__call__" or head_mask is None
        or module.num_heads == 0):
      return next_fun(*args, **kwargs)
    if len(args) > 1 or any(kwargs.get(k) is not None for k in (
        "inputs_k", "inputs_v", "inputs_kv", "valid_lens")):
      raise ValueError("the streaming ablation intercepts self-attention "
                       "called as layer(x, mask=..., head_mask=...)")
    x = args[0]
    length = x.shape[-2]
    mask = kwargs.get("mask")
    full = jnp.ones((length, length), bool) if mask is None else mask
    full = full.reshape((1,) * (x.ndim + 1 - full.ndim) + full.shape)
    both = jnp.stack([full, windowed(full, length, sinks, window)])
    gates = jnp.stack([head_mask, 1.0 - head_mask])
    gates = gates.reshape(gates.shape[:1] + (1,) * (x.ndim - 1 - (
        gates.ndim - 1)) + gates.shape[1:])
    out, weights = next_fun(jnp.stack([x, x]), **dict(
        kwargs, mask=both, head_mask=gates))
    bias = module.variables["params"]["out"].get("bias")
    out = out[0] + out[1]
    if bias is not None:
      out = out - bias.astype(out.dtype).reshape(
          (1,) * (out.ndim - 1) + bias.shape)
    return out, None if weights is None else weights[0]
  return intercept


def ablated_logits(model: Transformer, params: Params, inputs: Array,
                   head_mask: Array, ablation: Ablation | None) -> Array:
  """Logits ``[B, T, V]`` under a dense ``[L, H]`` head mask, each removed
  head replaced as ``ablation`` (aligned with ``inputs``) says."""
  if ablation is None or ablation.mode == "zero":
    return head_masks.masked_logits(model, params, inputs, head_mask)
  if ablation.streaming:
    with nn.intercept_methods(streaming_interceptor(ablation.sinks,
                                                    ablation.window)):
      return head_masks.masked_logits(model, params, inputs, head_mask)
  shifts = ablation.layer_shifts(model, params)
  mask = jnp.asarray(head_mask, jnp.float32)

  def intercept(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    layer = layer_of(context)
    if layer is None or shifts[layer] is None:
      return out
    return _shifted(out, mask[layer, :shifts[layer].shape[0]], shifts[layer])

  with nn.intercept_methods(intercept):
    return head_masks.masked_logits(model, params, inputs, head_mask)


# --------------------------------------------------------------------------
# Building an ablation.
# --------------------------------------------------------------------------


def batches(split: data.Split, batch_size: int
            ) -> Iterator[tuple[Array, Array]]:
  """``(inputs, targets)`` batches of ``split`` in order, split across every
  device (rounded up to a multiple of them; the padding rows at the end
  count nothing), like :mod:`mha.evaluate`: the batches of every mask
  evaluation (:func:`mha.pruning.core.batches`)."""
  mesh = sharding_lib.make_mesh()
  for batch in sharding_lib.eval_batches(
      split, min(batch_size, max(len(split), 1)), mesh):
    yield batch["inputs"], batch["targets"]


@functools.partial(jax.jit, static_argnames="model")
def _output_sums(model, params, inputs):
  """Per layer the sums ``[H, T, D]`` of each head's output over the
  batch's examples, at their valid positions, and the counts ``[T]``."""
  valid = (inputs != 0).astype(jnp.float32)
  outs = head_outputs(model, params, inputs)
  return ([None if o is None else jnp.einsum("hbto,bt->hto", o, valid)
           for o in outs], jnp.sum(valid, axis=0))


def position_means(model: Transformer, params: Params, split: data.Split, *,
                   batch_size: int = 1000) -> tuple[np.ndarray, np.ndarray]:
  """``([L, H, T, D], [L, H, D])``: each head's mean output (context times
  its output-projection rows) at each position over the examples of
  ``split`` long enough to have it, and over every valid position."""
  arguments.check_count("batch_size", batch_size)
  config = model.config
  length = split.inputs.shape[1]
  total = np.zeros((config.num_layers, config.max_heads, length,
                    config.d_model), np.float64)
  counts = np.zeros(length, np.float64)
  for inputs, _ in batches(split, batch_size):
    sums, count = jax.device_get(_output_sums(model, params, inputs))
    counts += np.asarray(count, np.float64)
    for layer, value in enumerate(sums):
      if value is not None:
        total[layer, :value.shape[0]] += np.asarray(value, np.float64)
  per_position = total / np.maximum(counts, 1)[:, None]
  overall = total.sum(axis=2) / max(counts.sum(), 1)
  return per_position.astype(np.float32), overall.astype(np.float32)


def resample_donors(split: data.Split, rng: np.random.Generator
                    ) -> np.ndarray:
  """``[n]`` int: for each example, another example of the same length (a
  random cyclic shift within a shuffled length group, so no example is its
  own donor unless its length is unique in the split)."""
  lengths = split.lengths
  donors = np.arange(len(split))
  for length in np.unique(lengths):
    group = rng.permutation(np.flatnonzero(lengths == length))
    donors[group] = np.roll(group, 1)
  return donors


def build(model: Transformer, params: Params, mode: str,
          reference: data.Split, split: data.Split, *,
          rng: np.random.Generator | None = None,
          batch_size: int = 1000,
          means: tuple[np.ndarray, np.ndarray] | None = None) -> Ablation:
  """The ablation ``mode`` for ``split``.

  Args:
    model, params: the unpruned model.
    mode: one of :data:`MODES` or ``streaming:SINKS,WINDOW``.
    reference: the split the means are measured on (validation).
    split: the split the ablation will be evaluated on (resample's donors
      come from it).
    rng: draws resample's donors (default: seed 0).
    batch_size: examples per call when measuring means.
    means: :func:`position_means` of ``reference``, when already measured.
  """
  mode, sinks, window = parse(mode)
  if mode == STREAMING:
    return Ablation(mode, sinks=sinks, window=window)
  if mode == "zero":
    return Ablation(mode)
  if mode == "resample":
    rng = np.random.default_rng(0) if rng is None else rng
    donors = resample_donors(split, rng)
    return Ablation(mode, donors=np.asarray(split.inputs)[donors])
  per_position, overall = (position_means(model, params, reference,
                                          batch_size=batch_size)
                           if means is None else means)
  shifts = (per_position[:, :, None] if mode == "mean_position"
            else overall[:, :, None, None])
  return Ablation(mode, shifts=jnp.asarray(shifts))


def batched(split: data.Split, batch_size: int,
            ablation: Ablation | None
            ) -> Iterator[tuple[Array, Array, Ablation | None]]:
  """``(inputs, targets, ablation)`` batches of ``split`` as
  :func:`batches` cuts them, resample's donors cut the
  same way (padding rows: donors of no tokens)."""
  arguments.check_count("batch_size", batch_size)
  if ablation is None or ablation.donors is None:
    for inputs, targets in batches(split, batch_size):
      yield inputs, targets, ablation
    return
  donors = np.asarray(ablation.donors)
  pairs = zip(batches(split, batch_size),
              batches(data.Split(donors, donors), batch_size))
  for (inputs, targets), (donor, _) in pairs:
    yield inputs, targets, ablation.replace(donors=donor)


# --------------------------------------------------------------------------
# Attribution patching.
# --------------------------------------------------------------------------


def _loss_sum(model, params, inputs, targets, head_mask, ablation):
  logits = ablated_logits(model, params, inputs, head_mask, ablation)
  return eval_lib.metric_sums(logits, targets, inputs)["loss_sum"]


@functools.partial(jax.jit, static_argnames="model")
def _mask_gradient(model, params, inputs, targets, head_mask, ablation):
  return jax.grad(_loss_sum, argnums=4)(model, params, inputs, targets,
                                        head_mask, ablation)


def attribution(model: Transformer, params: Params, split: data.Split,
                ablation: Ablation | None, *,
                batch_size: int = 1000) -> np.ndarray:
  """Attribution patching: the first-order estimate of the increase in
  ``split``'s loss (token-weighted mean cross-entropy) when each head alone
  is replaced by ``ablation``'s baseline, ``-dL/dm_h`` at the full mask.

  ``dL/dm_h = (c_h - r_h) W_o[h] . dL/d out``: one forward pass of the
  examples, one of the donors (resample only) and one backward pass.
  Signed: negative where removing the head is estimated to help. Compare
  :func:`mha.pruning.core.leave_one_out` with the same ``ablation`` (the
  actual patching).

  Returns:
    ``[L, H]``, NaN where no head.
  """
  arguments.check_count("batch_size", batch_size)
  config = model.config
  mask = jnp.asarray(head_masks.full_head_mask(config))
  total = np.zeros(mask.shape, np.float64)
  for inputs, targets, abl in batched(split, batch_size, ablation):
    total += np.asarray(_mask_gradient(model, params, inputs, targets, mask,
                                       abl), np.float64)
  tokens = max(int(np.sum(split.inputs != 0)), 1)
  return np.where(head_masks.existing_heads(config), -total / tokens,
                  np.nan)


__all__ = ["MODES", "STREAMING", "Ablation", "check_mode", "parse",
           "check_streaming", "window_mask", "windowed", "kv_memory",
           "streaming_interceptor", "layer_of", "head_outputs",
           "ablated_logits", "position_means", "resample_donors", "build",
           "batched", "attribution", "block_interceptor"]
