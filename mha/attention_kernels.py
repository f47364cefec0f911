"""The fused attention kernels off CPU: which one runs, and weights from its
log-sum-exp.

``jax.nn.dot_product_attention`` has two implementations in JAX 0.10.2:
``"xla"`` (the default, any platform) and ``"cudnn"`` (cuDNN flash attention,
NVIDIA GPUs only, with constraints on dtype, head width, mask and device; it
raises when they do not hold). :func:`select_implementation` is the pure rule
that picks ``"cudnn"`` only where those constraints hold, read off JAX 0.10.2's
``jax/_src/cudnn/fused_attention_stablehlo.py``:

* platform ``cuda`` with cuDNN detected and compute capability >= 8.0 (flash
  attention needs Ampere or later; 10.3 needs cuDNN >= 9.11);
* 16-bit floats (``bfloat16`` or ``float16``);
* query/key and value heads of the same width, a multiple of 8, at most 128
  (256 on compute capability >= 9.0);
* no mask, or key lengths (cuDNN's padding mask), or a boolean mask array
  (cuDNN takes it as an additive bias) with even query and key lengths (its
  training kernels with a bias need them even);
* no empty array.

:func:`fused_attention` runs the selected implementation and, should the
cuDNN call still refuse at trace time (for example under ``vmap`` over a
non-leading axis, which its batching rule does not support), falls back to
XLA: the choice never makes a call fail.

With ``return_weights=True`` it asks the kernel for its residual, the
log-sum-exp ``lse`` of each query row, and rebuilds the weights in float32 as
``exp(logits - lse)`` (:func:`weights_from_lse`): one ``QK^T`` and one ``exp``
instead of the unfused softmax's max, exp, sum and divide and its product with
the values.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from typing import Any

import jax
import jax.numpy as jnp
from mha.aliases import Array

IMPLEMENTATIONS = ("cudnn", "xla")
MASK_FORMS = ("none", "lengths", "array")
_SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What the kernel choice depends on besides the arrays.

  Attributes:
    platform: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``, ...
    compute_capability: the GPU's, e.g. ``"9.0"`` (None off NVIDIA).
    cudnn_version: e.g. ``91000`` for 9.10.0 (None when not detected).
  """

  platform: str
  compute_capability: str | None = None
  cudnn_version: int | None = None


def device_facts() -> DeviceFacts:
  """The :class:`DeviceFacts` of JAX's default device."""
  device = jax.devices()[0]
  platform = device.platform
  if platform == "gpu":
    version = str(getattr(device.client, "platform_version", "")).lower()
    platform = "rocm" if "rocm" in version else "cuda"
  cudnn = _cudnn_version() if platform == "cuda" else None
  return DeviceFacts(platform, getattr(device, "compute_capability", None),
                     cudnn)


def _cudnn_version() -> int | None:
  """The cuDNN of JAX's CUDA wheels (the ``nvidia-cudnn-cu*`` package that
  ``jax[cuda12]`` or ``jax[cuda13]`` installs), e.g. ``91000`` for 9.10.0;
  None for a cuDNN installed otherwise (JAX has no public API for it)."""
  for package in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
    try:
      major, minor, patch = (
          importlib.metadata.version(package).split(".") + ["0", "0"])[:3]
      return int(major) * 10000 + int(minor) * 100 + int(patch)
    except (importlib.metadata.PackageNotFoundError, ValueError):
      continue
  return None


def _capability(facts: DeviceFacts) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in str(facts.compute_capability).split("."))
  except ValueError:
    return ()


def select_implementation(facts: DeviceFacts, *, dtype: Any, head_dim: int,
                          value_head_dim: int, q_len: int, kv_len: int,
                          mask_form: str, size: int = 1) -> str:
  """``"cudnn"`` where cuDNN flash attention's constraints hold, else
  ``"xla"`` (see the module docstring for the constraints).

  Args:
    facts: the device (:func:`device_facts`).
    dtype: the dtype of query, key and value.
    head_dim: per-head width of queries and keys.
    value_head_dim: per-head width of values.
    q_len: query length.
    kv_len: key/value length.
    mask_form: ``"none"``, ``"lengths"`` (per-sequence key lengths) or
      ``"array"`` (a boolean mask array).
    size: number of elements of the query (0: an empty call).
  """
  if mask_form not in MASK_FORMS:
    raise ValueError(f"mask_form must be one of {MASK_FORMS}, got "
                     f"{mask_form!r}.")
  capability = _capability(facts)
  if (facts.platform != "cuda" or facts.cudnn_version is None
      or capability < (8, 0)):
    return "xla"
  if capability == (10, 3) and facts.cudnn_version < 91100:
    return "xla"
  if jnp.dtype(dtype) not in _SIXTEEN_BIT:
    return "xla"
  max_head_dim = 256 if capability >= (9, 0) else 128
  if (head_dim != value_head_dim or head_dim % 8 or head_dim > max_head_dim
      or head_dim == 0):
    return "xla"
  if mask_form == "array" and (q_len % 2 or kv_len % 2):
    return "xla"
  if size == 0 or q_len == 0 or kv_len == 0:
    return "xla"
  return "cudnn"


@jax.custom_jvp
def weights_from_lse(logits: Array, lse: Array) -> Array:
  """``exp(logits - lse[..., None])``: the softmax of ``logits`` over the last
  axis given its log-sum-exp ``lse``, with the softmax's derivative (``lse``
  is treated as the function of ``logits`` it is, so gradients are exact)."""
  return jnp.exp(logits - lse[..., None])


@weights_from_lse.defjvp
def _weights_from_lse_jvp(primals, tangents):
  (logits, lse), (logits_dot, _) = primals, tangents
  y = weights_from_lse(logits, lse)
  return y, y * (logits_dot - jnp.sum(y * logits_dot, -1, keepdims=True))


def _flat(x: Array | None, tail: int) -> Array | None:
  """``x`` with its batch axes (all but the last ``tail``) merged into one."""
  return None if x is None else jnp.reshape(x, (-1,) + x.shape[x.ndim - tail:])


def library_attention(query: Array, key: Array, value: Array, *,
                      mask: Array | None, kv_lengths: Array | None,
                      implementation: str, return_weights: bool = False
                      ) -> tuple[Array, Array | None]:
  """``jax.nn.dot_product_attention`` on ``[..., L, H, Dh]`` arrays.

  Args:
    query, key, value: ``[..., Lq, H, Dh]``, ``[..., Lk, H_kv, Dh]``,
      ``[..., Lk, H_kv, Dv]`` (``H_kv`` divides ``H``: grouped-query
      attention, which ``jax.nn.dot_product_attention`` takes as it is).
    mask: None or boolean ``[..., H, Lq, Lk]`` or ``[..., 1, Lq, Lk]`` (full
      batch axes).
    kv_lengths: None or integer ``[...]``: keys at positions ``>= length``
      are masked (only without ``mask``).
    implementation: ``"xla"`` or ``"cudnn"``.
    return_weights: also return the weights ``[..., H, Lq, Lk]`` (float32),
      rebuilt from the kernel's log-sum-exp.

  Returns:
    ``(context [..., Lq, H, Dv], weights or None)``; query rows with no valid
    key get a zero context and zero weights.
  """
  batch_shape, lq, lk = query.shape[:-3], query.shape[-3], key.shape[-3]
  lengths = None
  if kv_lengths is not None:
    lengths = jnp.reshape(
        jnp.broadcast_to(kv_lengths, batch_shape), (-1,)).astype(jnp.int32)
  result = jax.nn.dot_product_attention(
      _flat(query, 3), _flat(key, 3), _flat(value, 3), mask=_flat(mask, 3),
      key_value_seq_lengths=lengths, implementation=implementation,
      return_residual=return_weights)
  context, lse = result if return_weights else (result, None)
  context = jnp.reshape(context, batch_shape + context.shape[-3:])
  if mask is None and kv_lengths is None:
    return context, (None if lse is None else _rebuild(query, key, lse, None))
  if mask is not None:
    row_ok = jnp.swapaxes(jnp.any(mask, axis=-1), -1, -2)  # [..., Lq, H|1]
  else:  # A sequence of length 0 has no key for any query.
    row_ok = jnp.reshape(jnp.asarray(kv_lengths) > 0, batch_shape + (1, 1))
  context = jnp.where(row_ok[..., None], context, jnp.zeros((), context.dtype))
  if lse is None:
    return context, None
  if mask is None:
    key_lengths = jnp.reshape(jnp.asarray(kv_lengths), batch_shape + (1, 1, 1))
    positions = jnp.reshape(jnp.arange(lk), (1,) * (len(batch_shape) + 2)
                            + (lk,))
    mask = jnp.broadcast_to(positions < key_lengths, batch_shape + (1, lq, lk))
  return context, _rebuild(query, key, lse, mask)


def _rebuild(query: Array, key: Array, lse: Array,
             mask: Array | None) -> Array:
  """Float32 weights ``[..., H, Lq, Lk]`` from the flat ``lse`` ``[B, Lq, H]``
  that ``jax.nn.dot_product_attention(..., return_residual=True)`` returns."""
  batch_shape = query.shape[:-3]
  rounded = lse.dtype != jnp.float32
  lse = jnp.reshape(lse, batch_shape + lse.shape[-2:])
  lse = jnp.swapaxes(lse, -1, -2).astype(jnp.float32)  # [..., H, Lq]
  scale = 1.0 / math.sqrt(query.shape[-1])
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_kv_heads and num_kv_heads != num_heads:  # grouped-query attention
    query = jnp.reshape(query, query.shape[:-2] + (
        num_kv_heads, num_heads // num_kv_heads, query.shape[-1]))
    logits = jnp.einsum("...qhgd,...khd->...hgqk", query, key,
                        preferred_element_type=jnp.float32)
    logits = jnp.reshape(logits, batch_shape + (num_heads,)
                         + logits.shape[-2:]) * scale
  else:
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key,
                        preferred_element_type=jnp.float32) * scale
  if mask is not None:
    row_ok = jnp.any(mask, axis=-1)
    lse = jnp.where(row_ok, lse, 0.0)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = weights_from_lse(logits, lse)
  if mask is not None:
    weights = jnp.where(mask, weights, 0.0)
  if rounded:
    # The public API rounds the residual to the input dtype (bfloat16: about
    # 3 significant digits, so exp(logits - lse) would be off by up to ~1.5%
    # at lse ~ 8); one division by the row sum restores float32 accuracy.
    total = jnp.sum(weights, -1, keepdims=True)
    weights = weights / jnp.where(total > 0, total, 1.0)
  return weights


def choose_implementation(query: Array, key: Array, value: Array, *,
                          mask: Array | None, kv_lengths: Array | None,
                          facts: DeviceFacts | None = None) -> str:
  """:func:`select_implementation` for these arrays on ``facts`` (JAX's
  default device when None): ``"cudnn"`` or ``"xla"``."""
  facts = device_facts() if facts is None else facts
  mask_form = ("array" if mask is not None else
               "lengths" if kv_lengths is not None else "none")
  return select_implementation(
      facts, dtype=jnp.result_type(query, key, value),
      head_dim=query.shape[-1], value_head_dim=value.shape[-1],
      q_len=query.shape[-3], kv_len=key.shape[-3], mask_form=mask_form,
      size=query.size)


def fused_attention(query: Array, key: Array, value: Array, *,
                    mask: Array | None, kv_lengths: Array | None,
                    return_weights: bool = False,
                    facts: DeviceFacts | None = None
                    ) -> tuple[Array, Array | None]:
  """:func:`library_attention` with the implementation of
  :func:`select_implementation`; a cuDNN call that still refuses at trace
  time falls back to XLA."""
  dtype = jnp.result_type(query, key, value)  # both kernels want one dtype
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  choice = choose_implementation(query, key, value, mask=mask,
                                 kv_lengths=kv_lengths, facts=facts)
  if choice == "cudnn":
    try:
      return library_attention(query, key, value, mask=mask,
                               kv_lengths=kv_lengths, implementation="cudnn",
                               return_weights=return_weights)
    except (NotImplementedError, ValueError, RuntimeError, TypeError):
      pass  # Falls back to XLA below: the choice never fails a call.
  return library_attention(query, key, value, mask=mask, kv_lengths=kv_lengths,
                           implementation="xla", return_weights=return_weights)
