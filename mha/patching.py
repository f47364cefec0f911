"""Activation capture and activation patching on :class:`mha.model.Transformer`.

Two kinds of activation, as TransformerLens's ``run_with_cache`` names them:

* **per-head contexts**: the attention output of each head before the output
  projection, one ``[..., L, H_l, Dh]`` array per layer (after the model's
  ``head_mask`` gate, so a gated head's context is zero);
* **the residual stream**: ``[num_layers + 1, ..., L, d_model]``, index ``l``
  the input of block ``l`` and index ``num_layers`` the last block's output
  (before the final LayerNorm and the read-out).

:func:`run_with_cache` returns both beside the logits. **Patching** runs the
model on one input (``clean``) with chosen activations taken from a run on
another (``corrupt``): a head's context at every position
(:func:`patch_heads`), or the residual stream at one position before one
block (:func:`patch_residual`). Many patches run in one vmapped call, and
the corrupt run is computed once for all of them:

    heads = patching.every_head(ckpt.model_config)       # [(layer, head)]
    logits = patching.patch_heads(ckpt.model, ckpt.params, clean, corrupt,
                                  heads)                 # [P, ..., L, V]

A patch is a ``(layer, head)`` (or ``(layer, position)``) pair, or a sequence
of such pairs patched together (``[(1, 0), (1, 1)]``: both heads of layer
1). Any name of a head or position the model does not have raises
``ValueError`` naming it.

Design: the model is not changed, nor its parameters. Capture and patching
wrap the model's own code with ``flax.linen.intercept_methods`` (as
:mod:`mha.pruning.oracle` does): the output projection ``attention/out`` of
each block sees the per-head context as its input, each block
``layer_{l}`` its residual input, and ``Transformer.readout`` the last
block's output; the interceptor records them, or swaps in the source's values
where a boolean patch mask says so (``jnp.where``, so an unpatched value is
bitwise the model's own). Outside these functions nothing is intercepted and
the model's default path is untouched. Everything is pure: ``jit``, ``vmap``
and ``grad`` pass through. One patch is :func:`run_patched` with a boolean
mask (``heads [num_layers, max_heads]``, ``positions [num_layers + 1, L]``);
the many-patch calls vmap it over a stack of masks made from the pairs
(:func:`head_patch_masks`, :func:`position_patch_masks`).

The attention's padding mask is always the clean input's: a residual patch
reproduces the corrupt run exactly only where both inputs pad alike.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mha.aliases import Array, Params
from mha.model import EncoderBlock, Transformer, TransformerConfig
from mha.run import arguments

#: A patch: one ``(layer, index)`` pair, or a sequence of pairs patched
#: together (index = a head for :func:`patch_heads`, a position for
#: :func:`patch_residual`).
Patch = tuple[int, int] | Sequence[tuple[int, int]]


class Activations(NamedTuple):
  """What :func:`run_with_cache` records (a pytree: ``jit``/``vmap`` pass).

  Attributes:
    contexts: one ``[..., L, H_l, Dh]`` array per layer, each head's
      attention output before the output projection (zero heads: ``H_l`` 0).
    residual: ``[num_layers + 1, ..., L, d_model]``; ``residual[l]`` is the
      input of block ``l``, ``residual[num_layers]`` the last block's output.
  """

  contexts: tuple[Array, ...]
  residual: Array


def _block_index(module: nn.Module) -> int | None:
  """``l`` for the block ``layer_{l}`` of a Transformer, else None."""
  if isinstance(module, EncoderBlock) and module.name and \
      module.name.startswith("layer_"):
    return int(module.name[len("layer_"):])
  return None


def _out_projection_layer(module: nn.Module) -> int | None:
  """``l`` for the output projection ``layer_{l}/attention/out``."""
  path = module.path
  if (isinstance(module, nn.DenseGeneral) and len(path) >= 3
      and path[-2:] == ("attention", "out")
      and path[-3].startswith("layer_")):
    return int(path[-3][len("layer_"):])
  return None


def _select(mask: Array, source: Array, own: Array, axis_from_end: int
            ) -> Array:
  """``source`` where ``mask`` (``[N]``, over the axis ``axis_from_end``
  from the end of ``own``) is True, else ``own``; no rank promotion."""
  shape = [1] * own.ndim
  shape[own.ndim - axis_from_end] = mask.shape[0]
  return jnp.where(mask.reshape(shape), source.astype(own.dtype), own)


def _intercepting_apply(model: Transformer, params: Params, tokens: Array, *,
                        head_mask: Array | None = None,
                        source: Activations | None = None,
                        heads: Array | None = None,
                        positions: Array | None = None
                        ) -> tuple[Array, dict[str, dict[int, Array]]]:
  """The model's logits, with its activations recorded and, where ``heads``
  / ``positions`` are True, taken from ``source``."""
  cfg = model.config
  seen: dict[str, dict[int, Array]] = {"contexts": {}, "residual": {}}

  def intercept(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if isinstance(module, Transformer) and method == "readout":
      layer = cfg.num_layers
    elif method == "__call__" and _block_index(module) is not None:
      layer = _block_index(module)
    elif method == "__call__" and _out_projection_layer(module) is not None:
      layer = _out_projection_layer(module)
      value = args[0]  # [..., L, H_l, Dh]
      if heads is not None:
        value = _select(heads[layer, :value.shape[-2]],
                        source.contexts[layer], value, 2)
      seen["contexts"][layer] = value
      return next_fun(value, *args[1:], **kwargs)
    else:
      return next_fun(*args, **kwargs)
    value = args[0]  # the residual stream [..., L, d_model]
    if positions is not None:
      value = _select(positions[layer], source.residual[layer], value, 2)
    seen["residual"][layer] = value
    return next_fun(value, *args[1:], **kwargs)

  with nn.intercept_methods(intercept):
    logits, _ = model.apply({"params": params}, tokens, head_mask=head_mask,
                            return_weights=False)
  return logits, seen


def run_with_cache(model: Transformer, params: Params, tokens: Array, *,
                   head_mask: Array | Sequence[Array] | None = None
                   ) -> tuple[Array, Activations]:
  """The logits of ``tokens`` and the activations of the run.

  Pure (``jit``, ``vmap``, ``grad``). The logits are the model's own
  (``model.apply(..., return_weights=False)``), bitwise.

  Args:
    model: the Transformer.
    params: its parameters.
    tokens: int ``[..., L]``, 0 = padding.
    head_mask: passed to the model (gated heads' contexts are zero).

  Returns:
    ``(logits [..., L, V], activations)``: see :class:`Activations`.
  """
  cfg = model.config
  logits, seen = _intercepting_apply(model, params, tokens,
                                     head_mask=head_mask)
  residual = jnp.stack([seen["residual"][l]
                        for l in range(cfg.num_layers + 1)])
  contexts = []
  for layer, count in enumerate(cfg.heads_per_layer):
    if count:
      contexts.append(seen["contexts"][layer])
    else:  # A layer without heads has no context: an empty one.
      contexts.append(jnp.zeros(
          residual.shape[1:-1] + (0, cfg.resolved_head_dim),
          cfg.compute_dtype))
  return logits, Activations(tuple(contexts), residual)


def run_patched(model: Transformer, params: Params, tokens: Array,
                source: Activations, *, heads: Array | None = None,
                positions: Array | None = None) -> Array:
  """The logits of ``tokens`` with one patch of activations from ``source``.

  Pure: ``vmap`` over ``heads``/``positions`` runs many patches (what
  :func:`patch_heads` and :func:`patch_residual` do), ``jit`` passes.
  Patched values replace the run's own at the point they are read, so a
  patch of an early layer changes what the later layers compute, except
  where those are patched too.

  Args:
    model: the Transformer.
    params: its parameters.
    tokens: int ``[..., L]`` (its padding mask is used throughout).
    source: activations of a run on an input of the same shape
      (:func:`run_with_cache`).
    heads: bool ``[num_layers, max_heads]``: True takes that head's context,
      at every position, from ``source`` (:func:`head_patch_masks`).
    positions: bool ``[num_layers + 1, L]``: True takes the residual stream
      at that position, before that block (``num_layers``: before the
      read-out), from ``source`` (:func:`position_patch_masks`).

  Returns:
    logits ``[..., L, V]``.
  """
  cfg = model.config
  if heads is not None and heads.shape != (cfg.num_layers, cfg.max_heads):
    raise ValueError(f"heads has shape {heads.shape}, expected [num_layers, "
                     f"max_heads] = [{cfg.num_layers}, {cfg.max_heads}]")
  length = tokens.shape[-1]
  if positions is not None and positions.shape != (cfg.num_layers + 1,
                                                   length):
    raise ValueError(
        f"positions has shape {positions.shape}, expected [num_layers + 1, "
        f"L] = [{cfg.num_layers + 1}, {length}]")
  if source.residual.shape[1:-1] != tokens.shape:
    raise ValueError(
        f"the source activations are of tokens of shape "
        f"{source.residual.shape[1:-1]}, but tokens has shape {tokens.shape}")
  logits, _ = _intercepting_apply(model, params, tokens, source=source,
                                  heads=heads, positions=positions)
  return logits


def _as_pairs(patch: Any, index: int) -> list[tuple[int, int]]:
  """The ``(layer, index)`` pairs of one patch (a pair or a sequence)."""
  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(
      v, (bool, np.bool_))
  if isinstance(patch, (tuple, list)) and len(patch) == 2 and all(
      is_int(v) for v in patch):
    return [(int(patch[0]), int(patch[1]))]
  if isinstance(patch, (tuple, list)) and patch and all(
      isinstance(p, (tuple, list)) and len(p) == 2 and all(
          is_int(v) for v in p) for p in patch):
    return [(int(a), int(b)) for a, b in patch]
  raise ValueError(
      f"patch {index} is {patch!r}: expected a (layer, index) pair of ints "
      "or a non-empty sequence of such pairs")


def _check_patches(patches: Sequence[Patch]) -> None:
  if isinstance(patches, (str, bytes)) or not isinstance(
      patches, (tuple, list)) or not patches:
    raise ValueError(f"patches must be a non-empty list of patches, got "
                     f"{patches!r}")


def head_patch_masks(config: TransformerConfig,
                     patches: Sequence[Patch]) -> np.ndarray:
  """The patches as bool masks ``[P, num_layers, max_heads]`` (the
  ``heads`` of :func:`run_patched`).

  Raises:
    ValueError: a patch names a head ``(layer, head)`` the model does not
      have (the message names it), or is not a pair or a list of pairs.
  """
  _check_patches(patches)
  heads = config.heads_per_layer
  masks = np.zeros((len(patches), config.num_layers, config.max_heads), bool)
  for i, patch in enumerate(patches):
    for layer, head in _as_pairs(patch, i):
      if not 0 <= layer < config.num_layers:
        raise ValueError(
            f"patch {i} names head ({layer}, {head}), but the model has no "
            f"layer {layer} (layers 0..{config.num_layers - 1})")
      if not 0 <= head < heads[layer]:
        raise ValueError(
            f"patch {i} names head ({layer}, {head}), but layer {layer} has "
            f"{heads[layer]} heads")
      masks[i, layer, head] = True
  return masks


def position_patch_masks(config: TransformerConfig, length: int,
                         patches: Sequence[Patch]) -> np.ndarray:
  """The patches as bool masks ``[P, num_layers + 1, length]`` (the
  ``positions`` of :func:`run_patched`); a pair is ``(layer, position)``,
  layer ``num_layers`` the input of the read-out.

  Raises:
    ValueError: a patch names a position ``(layer, position)`` that does not
      exist (the message names it), or is not a pair or a list of pairs.
  """
  arguments.check_count("length", length)
  _check_patches(patches)
  masks = np.zeros((len(patches), config.num_layers + 1, length), bool)
  for i, patch in enumerate(patches):
    for layer, position in _as_pairs(patch, i):
      if not 0 <= layer <= config.num_layers:
        raise ValueError(
            f"patch {i} names position ({layer}, {position}), but the "
            f"residual stream has layers 0..{config.num_layers} (block "
            f"inputs, then the last block's output)")
      if not 0 <= position < length:
        raise ValueError(
            f"patch {i} names position ({layer}, {position}), but the "
            f"inputs have {length} positions")
      masks[i, layer, position] = True
  return masks


def every_head(config: TransformerConfig) -> list[tuple[int, int]]:
  """Every ``(layer, head)`` of the model, layer by layer."""
  return [(layer, head) for layer, count in enumerate(config.heads_per_layer)
          for head in range(count)]


def every_position(config: TransformerConfig,
                   length: int) -> list[tuple[int, int]]:
  """Every ``(layer, position)`` of the residual stream, layer by layer
  (layers ``0..num_layers``)."""
  arguments.check_count("length", length)
  return [(layer, position) for layer in range(config.num_layers + 1)
          for position in range(length)]


@functools.partial(jax.jit, static_argnames="model")
def _patched_runs(model: Transformer, params: Params, clean: Array,
                  corrupt: Array, heads: Array | None,
                  positions: Array | None) -> Array:
  """``[P, ..., L, V]``: ``clean`` under each patch from ``corrupt``."""
  _, source = run_with_cache(model, params, corrupt)
  one = lambda h, p: run_patched(model, params, clean, source, heads=h,
                                 positions=p)
  return jax.vmap(one)(heads, positions)


def _check_inputs(clean: Array, corrupt: Array) -> None:
  if jnp.shape(clean) != jnp.shape(corrupt):
    raise ValueError(f"clean has shape {jnp.shape(clean)} but corrupt has "
                     f"shape {jnp.shape(corrupt)}; they must be equal")


def patch_heads(model: Transformer, params: Params, clean: Array,
                corrupt: Array, patches: Sequence[Patch]) -> Array:
  """Runs ``clean`` once per patch, the patch's heads' contexts (at every
  position) taken from the run on ``corrupt``; all patches in one vmapped
  call. Pure (``jit``, ``vmap``; ``patches`` is static).

  Args:
    model: the Transformer.
    params: its parameters.
    clean: int ``[..., L]``, the input the model runs on.
    corrupt: int ``[..., L]``, the input the patched contexts come from.
    patches: ``P`` patches, each a ``(layer, head)`` pair or a sequence of
      pairs (:func:`every_head` lists them all).

  Returns:
    logits ``[P, ..., L, V]``.

  Raises:
    ValueError: a patch names a head that does not exist (the message names
      it), or the inputs' shapes differ.
  """
  _check_inputs(clean, corrupt)
  masks = head_patch_masks(model.config, patches)
  return _patched_runs(model, params, clean, corrupt, jnp.asarray(masks),
                       None)


def patch_residual(model: Transformer, params: Params, clean: Array,
                   corrupt: Array, patches: Sequence[Patch]) -> Array:
  """Runs ``clean`` once per patch, the residual stream at the patch's
  ``(layer, position)`` pairs taken from the run on ``corrupt``; all
  patches in one vmapped call. Pure (``jit``, ``vmap``; ``patches`` is
  static).

  Args:
    model: the Transformer.
    params: its parameters.
    clean: int ``[..., L]``, the input the model runs on.
    corrupt: int ``[..., L]``, the input the patched residuals come from.
    patches: ``P`` patches, each a ``(layer, position)`` pair or a sequence
      of pairs: layer ``l < num_layers`` is the input of block ``l``, layer
      ``num_layers`` the last block's output (:func:`every_position`).

  Returns:
    logits ``[P, ..., L, V]``.

  Raises:
    ValueError: a patch names a position that does not exist (the message
      names it), or the inputs' shapes differ.
  """
  _check_inputs(clean, corrupt)
  masks = position_patch_masks(model.config, jnp.shape(clean)[-1], patches)
  return _patched_runs(model, params, clean, corrupt, None,
                       jnp.asarray(masks))


__all__ = ["Activations", "Patch", "run_with_cache", "run_patched",
           "head_patch_masks", "position_patch_masks", "every_head",
           "every_position", "patch_heads", "patch_residual"]
