"""Learned head gates: hard-concrete gates with an expected-L0 penalty.

Voita et al. (2019), after Louizos et al. (2018): each head gets a gate
``z_h`` in [0, 1] with a parameter ``log_alpha_h``. In training a gate is a
stretched, clipped binary-concrete sample,

    u ~ U(0, 1),  s = sigmoid((log u - log(1 - u) + log_alpha) / beta),
    z = min(1, max(0, s (zeta - gamma) + gamma)),

with ``beta = 2/3``, ``gamma = -0.1``, ``zeta = 1.1`` (exact zeros and ones
have positive probability), and the loss is the task's cross-entropy under
the gates plus ``lambda * sum_h P(z_h != 0)``, the expected number of heads
kept, ``P(z_h != 0) = sigmoid(log_alpha_h - beta log(-gamma / zeta))``. At
test time ``z = min(1, max(0, sigmoid(log_alpha) (zeta - gamma) + gamma))``
and the heads with ``z = 0`` are removed.

Here the gates are trained on the *train* split from the converged model
with its parameters frozen, so a strength's kept heads are a choice of
heads like any other, evaluated as a 0/1 head mask on the same model as the
orderings and the oracle (Voita et al. fine-tuned the whole model with the
gates; retraining after pruning is :mod:`mha.pruning.retrain`). A sweep of
strengths trains as one vmapped program, one gate vector per ``lambda``.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha import sharding as sharding_lib
from mha.aliases import Array, Params
from mha.model import Transformer, TransformerConfig


BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1
#: Initial ``log_alpha``: every gate partly open (test-time gate 0.65,
#: P(z != 0) 0.89). Chosen on validation in a pilot on 3 seeds of the
#: default model (strengths 1-6, 200 steps): the mean validation token
#: accuracy gap to the oracle at the same count was -0.016 from 0.5, -0.027
#: from 0 (Louizos et al.'s drop rate 0.5) and -0.085 from 3 (gates fully
#: open, which settle in worse subsets).
INIT_LOG_ALPHA = 0.5


def sample(log_alpha: Array, rng: Array) -> Array:
  """A hard-concrete sample of every gate (training)."""
  u = jax.random.uniform(rng, jnp.shape(log_alpha), minval=1e-6,
                         maxval=1.0 - 1e-6)
  s = jax.nn.sigmoid((jnp.log(u) - jnp.log1p(-u) + log_alpha) / BETA)
  return jnp.clip(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def probability_open(log_alpha: Array) -> Array:
  """``P(z != 0)`` of every gate: the expected-L0 penalty's terms."""
  return jax.nn.sigmoid(log_alpha - BETA * math.log(-GAMMA / ZETA))


def deterministic(log_alpha: Array) -> Array:
  """The test-time gate values; 0 removes the head."""
  return jnp.clip(jax.nn.sigmoid(log_alpha) * (ZETA - GAMMA) + GAMMA, 0.0,
                  1.0)


def gate_loss(log_alpha: Array, model: Transformer, params: Params,
              inputs: Array, targets: Array, rng: Array,
              strength: Array) -> tuple[Array, Array]:
  """Mean token cross-entropy under sampled gates ``[L, H]`` plus
  ``strength`` times the expected number of heads kept; and that number."""
  exists = jnp.asarray(head_masks.existing_heads(model.config), jnp.float32)
  z = sample(log_alpha, rng) * exists
  sums = eval_lib.metric_sums(head_masks.masked_logits(model, params, inputs, z),
                              targets, inputs)
  expected = jnp.sum(probability_open(log_alpha) * exists)
  return (sums["loss_sum"] / jnp.maximum(sums["tokens"], 1)
          + strength * expected), expected


@functools.partial(jax.jit, static_argnames=("model", "optimizer"))
def _step(model, optimizer, params, log_alpha, opt_state, inputs, targets,
          rng, strengths):
  keys = jax.random.split(rng, strengths.shape[0])
  grad = jax.grad(gate_loss, has_aux=True)
  grads, expected = jax.vmap(
      lambda la, key, lam: grad(la, model, params, inputs, targets, key, lam)
  )(log_alpha, keys, strengths)
  updates, opt_state = optimizer.update(grads, opt_state, log_alpha)
  return optax.apply_updates(log_alpha, updates), opt_state, expected


def train_gates(model: Transformer, params: Params, train: data.Split,
                strengths: Sequence[float], *, steps: int, batch_size: int,
                learning_rate: float = 0.05, seed: int = 0,
                log: Callable[[str], None] = lambda _: None
                ) -> dict[str, Any]:
  """Trains one gate vector per strength (``lambda``), all at once.

  Batches are ``data.train_batch(train, seed=seed, step=s)``; Adam on
  ``log_alpha`` only (the model's parameters are frozen).

  Returns:
    ``log_alpha`` ``[S, L, H]`` (NaN where no head), ``expected_heads``
    ``[S]`` at the end (the expected-L0 term), ``seconds`` and ``steps``.
  """
  config = model.config
  strengths = jnp.asarray(strengths, jnp.float32)
  log_alpha = jnp.full((len(strengths),) + head_masks.existing_heads(config).shape,
                       INIT_LOG_ALPHA, jnp.float32)
  optimizer = optax.adam(learning_rate)
  # Laid out as the step's outputs will be (replicated), so that the second
  # step does not compile again for committed inputs.
  log_alpha = jax.device_put(
      log_alpha, sharding_lib.replicated(sharding_lib.make_mesh()))
  opt_state = jax.device_put(optimizer.init(log_alpha), log_alpha.sharding)
  rng = jax.random.key(seed)
  start = time.perf_counter()
  expected = jnp.zeros(len(strengths))
  for step in range(steps):
    batch = data.train_batch(train, seed=seed, step=step,
                             batch_size=batch_size)
    log_alpha, opt_state, expected = _step(
        model, optimizer, params, log_alpha, opt_state, batch["inputs"],
        batch["targets"], jax.random.fold_in(rng, step), strengths)
    if (step + 1) % max(steps // 4, 1) == 0:
      log(f"    gates step {step + 1}/{steps}: expected heads kept "
          + ", ".join(f"{float(e):.1f}" for e in expected))
  log_alpha = np.asarray(jax.device_get(log_alpha), np.float64)
  log_alpha[:, ~head_masks.existing_heads(config)] = np.nan
  return {"log_alpha": log_alpha,
          "expected_heads": np.asarray(expected, np.float64),
          "seconds": time.perf_counter() - start, "steps": steps}


def kept_mask(log_alpha: np.ndarray, config: TransformerConfig, *,
              no_layer_emptied: bool = False) -> np.ndarray:
  """The 0/1 head mask ``[L, H]`` of one strength's gates: the heads whose
  test-time gate is above 0; with ``no_layer_emptied``, a layer left with
  none keeps its head of largest ``log_alpha``."""
  exists = head_masks.existing_heads(config)
  values = np.where(exists, np.nan_to_num(log_alpha, nan=-np.inf), -np.inf)
  mask = (np.asarray(deterministic(jnp.asarray(np.where(
      exists, values, 0.0)))) > 0) & exists
  if no_layer_emptied:
    for layer, count in enumerate(config.heads_per_layer):
      if count and not mask[layer].any():
        mask[layer, int(np.argmax(values[layer]))] = True
  return mask.astype(np.float32)


def removal_of_size(log_alpha: np.ndarray, config: TransformerConfig,
                    count: int) -> np.ndarray:
  """The ``count`` heads (flat indices) of lowest ``log_alpha``: the gates'
  choice of exactly ``count`` heads to remove."""
  flat = np.where(head_masks.existing_heads(config), log_alpha, np.inf).reshape(-1)
  order = np.argsort(flat, kind="stable")
  return order[:count]


__all__ = ["BETA", "GAMMA", "ZETA", "INIT_LOG_ALPHA", "sample",
           "probability_open", "deterministic", "gate_loss", "train_gates",
           "kept_mask", "removal_of_size"]
