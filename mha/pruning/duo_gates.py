"""DuoAttention's gates: which heads need a full KV cache, learned.

Xiao et al. (2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads") give each key/value head a gate ``alpha``
in [0, 1] that mixes the full attention of its query heads with streaming
attention (a few sink positions and a recent window),

    out_h = alpha_g(h) full_h + (1 - alpha_g(h)) streaming_h,

and train the gates alone, the model frozen, to keep the last hidden states
of the mixed model close to the full model's while an L1 penalty pushes the
gates to 0. As their code (``duo_attn/train.py``, ``duo_attn/loss.py``)
writes it:

    L = mean over scored positions of mean over features (h_full - h_mixed)^2
        + lambda mean over gates |alpha|,

with Adam (their AdamW without weight decay) at a learning rate warmed up
over the first fifth of the steps and cooled down over the last fifth
(between 0.1 and 1 of it), ``alpha`` clipped to [0, 1] before each step;
the heads of largest ``alpha`` keep a full cache. Under grouped keys and
values a gate serves all the query heads of its group (a group's cache is
kept or windowed whole); on a model without groups a gate is a head's.

The mix is exactly the streaming ablation's head mask
(:func:`mha.pruning.ablation.streaming_interceptor`: a mask value between 0
and 1 mixes the two outputs), so the gates are a head mask here, like
:mod:`mha.pruning.gates`'s. Adapted: the positions distilled are the task's
scored ones (a passkey's answer, as DuoAttention distils on the passkey's
tokens; every character of the language model) of its train split, ``h`` is
the last block's output before the read-out (the final LayerNorm of a
pre-norm model is not applied), and the steps and batch are ours (a toy
model: 200 steps of 32 examples, where they take 2,000 of one long one).

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
from mha.model import Transformer, TransformerConfig
from mha.pruning import gates as gates_lib
from mha.pruning import kv_groups
from mha.pruning.ablation import Ablation, ablated_logits
from mha.pruning.constants import DUO_GATES_STEPS
from mha.run import arguments

#: DuoAttention's defaults where they carry over: the L1 strength and the
#: learning rate (their Adam, 0.02); steps and batch are ours (a toy model).
STRENGTH = 0.05
LEARNING_RATE = 0.02
STEPS = DUO_GATES_STEPS
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


def gate_heads(config: TransformerConfig) -> int:
  """The gates of a layer: its key/value heads (one gate per group of query
  heads under grouped keys and values), else its heads."""
  return config.num_kv_heads or config.max_heads


def head_gates(config: TransformerConfig, alpha: Array) -> Array:
  """``[L, H]`` head masks of gates ``[L, G]`` (:func:`gate_heads`): each
  query head takes its group's gate, absent heads 0."""
  exists = jnp.asarray(head_masks.existing_heads(config), jnp.float32)
  gate = jnp.asarray(kv_groups.query_groups(config))  # each head's gate
  return jnp.take_along_axis(alpha, gate, axis=-1) * exists


def existing_gates(config: TransformerConfig) -> np.ndarray:
  """``[L, G]`` bool: the gates of layers that have heads."""
  has_heads = np.asarray(config.heads_per_layer) > 0
  return np.repeat(has_heads[:, None], gate_heads(config), axis=1)


def distillation_loss(alpha: Array, model: Transformer, params: Params,
                      inputs: Array, targets: Array, ablation: Ablation,
                      strength: float | Array) -> tuple[Array, Array]:
  """DuoAttention's loss at gates ``alpha`` ``[L, G]`` (:func:`gate_heads`):
  the mean over scored positions of the mean over features of the squared
  difference between the full model's and the mixed model's last hidden
  states, plus ``strength`` times the mean of ``|alpha|`` over existing
  gates; and the distance alone."""
  config = model.config
  exists = jnp.asarray(head_masks.existing_heads(config), jnp.float32)
  full = jax.lax.stop_gradient(hidden_states(
      model, params, inputs, exists, ablation))
  mixed = hidden_states(model, params, inputs, head_gates(config, alpha),
                        ablation)
  scored = data.scored(inputs, targets).astype(jnp.float32)
  distance = jnp.mean(jnp.square(mixed - full), axis=-1)
  distill = jnp.sum(distance * scored) / jnp.maximum(jnp.sum(scored), 1.0)
  gates = jnp.asarray(existing_gates(config), jnp.float32)
  l1 = jnp.sum(jnp.abs(alpha) * gates) / jnp.sum(gates)
  return distill + strength * l1, distill


def learning_rate_schedule(learning_rate: float,
                           steps: int) -> optax.Schedule:
  """DuoAttention's schedule: the rate times ``min(1, max((s + 1) / (S /
  5), 0.1), max((S - s) / (S / 5), 0.1))`` at step ``s`` of ``S``."""
  fifth = max(steps // 5, 1)

  def schedule(step: Array) -> Array:
    up = jnp.maximum((step + 1) / fifth, 0.1)
    down = jnp.maximum((steps - step) / fifth, 0.1)
    return learning_rate * jnp.minimum(1.0, jnp.minimum(up, down))
  return schedule


@functools.partial(jax.jit, static_argnames=("model", "optimizer"))
def _step(model, optimizer, params, alpha, opt_state, inputs, targets,
          ablation, strength):
  alpha = jnp.clip(alpha, 0.0, 1.0)  # as theirs: clamped before each step
  grads, distill = jax.grad(distillation_loss, has_aux=True)(
      alpha, model, params, inputs, targets, ablation, strength)
  updates, opt_state = optimizer.update(grads, opt_state, alpha)
  return optax.apply_updates(alpha, updates), opt_state, distill


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate: float, steps: int
               ) -> optax.GradientTransformation:
  """Adam on :func:`learning_rate_schedule`; one object per setting, so the
  jitted step (its static argument) compiles once for each."""
  return optax.adam(learning_rate_schedule(learning_rate, steps))


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
    more; under grouped keys and values each query head has its group's
    gate), ``distillation`` (the last step's distance), ``steps``,
    ``strength`` and ``seconds``.
  """
  arguments.check_count("steps", steps)
  arguments.check_count("batch_size", batch_size)
  if not ablation.streaming:
    raise ValueError(f"DuoAttention's gates mix a head with its streaming "
                     f"window; got ablation {ablation.spec!r}")
  config = model.config
  exists = head_masks.existing_heads(config)
  gates = existing_gates(config)
  optimizer = _optimizer(float(learning_rate), int(steps))
  alpha, opt_state = gates_lib.replicated_start(
      jnp.asarray(gates, jnp.float32), optimizer)
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
          f"{int(np.sum(np.clip(np.asarray(alpha), 0, 1)[gates] > 0.5))} of "
          f"{int(gates.sum())}")
  alpha = np.asarray(head_gates(config, jnp.clip(alpha, 0.0, 1.0)))
  out = np.where(exists, alpha.astype(np.float64), np.nan)
  return {"alpha": out, "distillation": float(distill), "steps": steps,
          "strength": float(strength), "seconds": time.perf_counter() - start}


__all__ = ["STRENGTH", "LEARNING_RATE", "STEPS", "BATCH_SIZE", "gate_heads",
           "head_gates", "existing_gates", "hidden_states", "distillation_loss",
           "learning_rate_schedule", "train"]
