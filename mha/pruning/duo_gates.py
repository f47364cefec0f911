"""DuoAttention's gates: which heads need a full KV cache, learned.

Xiao et al. (2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads") give each head a gate ``alpha_h`` in
[0, 1] that mixes its full attention with streaming attention (a few sink
positions and a recent window),

    out_h = alpha_h full_h + (1 - alpha_h) streaming_h,

and train the gates alone, the model frozen, to keep the last hidden states
of the mixed model close to the full model's while an L1 penalty pushes the
gates to 0:

    L = mean over scored positions of ||h_full - h_mixed||^2
        + lambda sum_h |alpha_h|,

clipping ``alpha`` to [0, 1] after each step; the heads of largest
``alpha`` keep a full cache. The mix is exactly the streaming ablation's
head mask (:func:`mha.pruning.ablation.streaming_interceptor`: a mask value
between 0 and 1 mixes the two outputs), so the gates are a head mask here,
like :mod:`mha.pruning.gates`'s. Adapted: the positions distilled are the
task's scored ones (a passkey's answer, as DuoAttention distils on the
passkey's tokens; every character of the language model) of its train
split, and ``h`` is the last block's output before the read-out (the final
LayerNorm of a pre-norm model is not applied).

    abl = ablation.build(model, params, "streaming:4,16", val, val)
    out = duo_gates.train(model, params, splits["train"], abl, steps=200)
    out["alpha"]  # [L, H], NaN where no head: the importance
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha import data
from mha import head_masks
from mha.aliases import Array, Params
from mha.model import Transformer
from mha.pruning import gates as gates_lib
from mha.pruning.ablation import Ablation, ablated_logits
from mha.run import arguments

#: DuoAttention's defaults where they carry over: the L1 strength and the
#: learning rate (their Adam, 0.02); steps and batch are ours (a toy model).
STRENGTH = 0.05
LEARNING_RATE = 0.02
STEPS = 200
BATCH_SIZE = 32


def hidden_states(model: Transformer, params: Params, inputs: Array,
                  head_mask: Array, ablation: Ablation | None) -> Array:
  """``[B, T, D]``: the last block's output (the read-out's input) under
  ``head_mask``, removed heads replaced as ``ablation`` says."""
  found = []

  def capture(next_fun, args, kwargs, context):
    if context.method_name == "readout" and isinstance(context.module,
                                                       Transformer):
      found.append(args[0])
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(capture):
    ablated_logits(model, params, inputs, head_mask, ablation)
  return found[0]


def distillation_loss(alpha: Array, model: Transformer, params: Params,
                      inputs: Array, targets: Array, ablation: Ablation,
                      strength: float | Array) -> tuple[Array, Array]:
  """DuoAttention's loss at gates ``alpha`` ``[L, H]``: the mean over
  scored positions of the squared distance between the full model's and the
  mixed model's last hidden states, plus ``strength`` times the sum of
  ``|alpha|`` over existing heads; and the distance alone."""
  exists = jnp.asarray(head_masks.existing_heads(model.config), jnp.float32)
  full = jax.lax.stop_gradient(hidden_states(
      model, params, inputs, exists, ablation))
  mixed = hidden_states(model, params, inputs, alpha * exists, ablation)
  scored = data.scored(inputs, targets).astype(jnp.float32)
  distance = jnp.sum(jnp.square(mixed - full), axis=-1)
  distill = jnp.sum(distance * scored) / jnp.maximum(jnp.sum(scored), 1.0)
  return distill + strength * jnp.sum(jnp.abs(alpha) * exists), distill


@functools.partial(jax.jit, static_argnames=("model", "optimizer"))
def _step(model, optimizer, params, alpha, opt_state, inputs, targets,
          ablation, strength):
  grads, distill = jax.grad(distillation_loss, has_aux=True)(
      alpha, model, params, inputs, targets, ablation, strength)
  updates, opt_state = optimizer.update(grads, opt_state, alpha)
  alpha = jnp.clip(optax.apply_updates(alpha, updates), 0.0, 1.0)
  return alpha, opt_state, distill


def train(model: Transformer, params: Params, train_split: data.Split,
          ablation: Ablation, *, steps: int = STEPS,
          batch_size: int = BATCH_SIZE, strength: float = STRENGTH,
          learning_rate: float = LEARNING_RATE, seed: int = 0,
          log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
  """Trains DuoAttention's gates on ``train_split`` (batches
  ``data.train_batch(train_split, seed=seed, step=s)``), the model frozen,
  from every gate at 1 (the full model).

  Args:
    model, params: the trained causal decoder.
    train_split: the examples distilled on (their scored positions).
    ablation: a ``streaming`` ablation: the window a gate mixes in.
    steps, batch_size, strength, learning_rate: the training.
    seed: the batches' seed.
    log: progress, four times.

  Returns:
    ``alpha`` ``[L, H]`` (NaN where no head; higher: needs a full cache
    more), ``distillation`` (the last step's distance), ``steps``,
    ``strength`` and ``seconds``.
  """
  arguments.check_count("steps", steps)
  arguments.check_count("batch_size", batch_size)
  if not ablation.streaming:
    raise ValueError(f"DuoAttention's gates mix a head with its streaming "
                     f"window; got ablation {ablation.spec!r}")
  config = model.config
  exists = head_masks.existing_heads(config)
  # One optimizer object per rate, shared with the head gates: a static
  # argument of the jitted step, so later calls hit its compile cache.
  optimizer = gates_lib._adam(float(learning_rate))  # pylint: disable=protected-access
  alpha, opt_state = gates_lib.replicated_start(
      jnp.asarray(exists, jnp.float32), optimizer)
  start = time.perf_counter()
  distill = jnp.zeros(())
  for step in range(steps):
    batch = data.train_batch(train_split, seed=seed, step=step,
                             batch_size=batch_size)
    targets = batch["targets"]
    if "weights" in batch:  # A task that scores some positions only.
      targets = jnp.where(batch["weights"] > 0, targets, data.UNSCORED)
    alpha, opt_state, distill = _step(
        model, optimizer, params, alpha, opt_state, batch["inputs"],
        targets, ablation, jnp.float32(strength))
    if (step + 1) % max(steps // 4, 1) == 0:
      log(f"    DuoAttention gates step {step + 1}/{steps}: distillation "
          f"{float(distill):.4g}, gates above 0.5: "
          f"{int(np.sum(np.asarray(alpha)[exists] > 0.5))} of "
          f"{int(exists.sum())}")
  out = np.where(exists, np.asarray(alpha, np.float64), np.nan)
  return {"alpha": out, "distillation": float(distill), "steps": steps,
          "strength": float(strength), "seconds": time.perf_counter() - start}


__all__ = ["STRENGTH", "LEARNING_RATE", "STEPS", "BATCH_SIZE",
           "hidden_states", "distillation_loss", "train"]
