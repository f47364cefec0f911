"""Retraining after pruning, many pruned models at once.

A model with heads removed by a 0/1 head mask computes exactly what the
physically pruned model computes (:func:`mha.pruning.prune_heads`), and a
removed head's parameters get zero gradient, so fine-tuning the masked model
is fine-tuning the pruned one (weight decay shrinks the removed heads'
kernels, which nothing reads). That lets every pruned model of a seed train
as one vmapped program over stacked parameters and masks, all on the same
batches (paired), with a fresh optimizer each:

* *fine-tuned*: from the converged parameters;
* *from scratch* (the control): fresh parameters of the same architecture
  (the same mask), the same steps and schedule.

The optimizer is the run's (``build.make_optimizer``) for a config with
``num_train_steps = steps`` and the warmup scaled to the same share of the
run; the batches are ``data.train_batch(train, seed=config.seed, step=s)``.
``config.init_from`` is the same fine-tuning for one saved pruned model from
the command line (:mod:`mha.finetune`).
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from mha import build
from mha import data
from mha import evaluate as eval_lib
from mha import sharding as sharding_lib
from mha.aliases import Params
from mha.model import Transformer
from mha.pruning import core



def retrain_config(config: ml_collections.ConfigDict,
                   steps: int) -> ml_collections.ConfigDict:
  """``config`` for ``steps`` steps, its warmup the same share of them."""
  new = copy.deepcopy(config)
  share = config.warmup_steps / max(config.num_train_steps, 1)
  new.num_train_steps = steps
  new.warmup_steps = int(round(share * steps))
  return new


def _loss(params, model, inputs, targets, mask, rng):
  logits, _ = model.apply(
      {"params": params}, inputs,
      head_mask=[mask[l, :c] for l, c in
                 enumerate(model.config.heads_per_layer)],
      deterministic=False, return_weights=False, rngs={"dropout": rng})
  sums = eval_lib.metric_sums(logits, targets, inputs)
  return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1)


@functools.partial(jax.jit, static_argnames=("model", "optimizer"),
                   donate_argnums=(2, 3))
def _step(model, optimizer, params, opt_state, masks, inputs, targets, rng):
  def one(p, state, mask):
    loss, grads = jax.value_and_grad(_loss)(p, model, inputs, targets, mask,
                                            rng)
    updates, state = optimizer.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  return jax.vmap(one)(params, opt_state, masks)


def finetune_masked(model: Transformer, params: Params, masks: np.ndarray,
                    train: data.Split, config: ml_collections.ConfigDict, *,
                    steps: int, log: Callable[[str], None] = lambda _: None
                    ) -> tuple[Params, dict[str, Any]]:
  """Trains ``R`` models at once for ``steps`` steps with a fresh optimizer
  each: stacked ``params`` (leading axis ``R``) under their fixed head
  ``masks`` ``[R, L, H]``.

  Returns:
    The stacked trained parameters, and ``{"seconds", "final_loss" [R]}``.
  """
  run_config = retrain_config(config, steps)
  optimizer = build.make_optimizer(run_config)
  # Laid out as the step's outputs will be (replicated): one compilation.
  replicated = sharding_lib.replicated(sharding_lib.make_mesh())
  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(jax.vmap(optimizer.init)(params), replicated)
  masks = jax.device_put(jnp.asarray(masks, jnp.float32), replicated)
  rng = jax.random.key(config.seed)
  start = time.perf_counter()
  loss = None
  for step in range(steps):
    batch = data.train_batch(train, seed=config.seed, step=step,
                             batch_size=config.batch_size)
    params, opt_state, loss = _step(
        model, optimizer, params, opt_state, masks, batch["inputs"],
        batch["targets"], jax.random.fold_in(rng, step))
    if (step + 1) % max(steps // 4, 1) == 0:
      log(f"    retraining {masks.shape[0]} models, step {step + 1}/{steps}: "
          f"mean loss {float(jnp.mean(loss)):.4f}")
  return params, {"seconds": time.perf_counter() - start,
                  "final_loss": np.asarray(loss, np.float64)}


def fresh_params(model: Transformer, seeds: np.ndarray) -> Params:
  """Stacked fresh parameters, one set per seed (``[R, ...]``)."""
  keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
  return jax.jit(jax.vmap(lambda k: build.init_params(model, k)))(keys)


def stack(params: Params, count: int) -> Params:
  """``count`` copies of ``params`` along a new leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + x.shape),
                      params)


@functools.partial(jax.jit, static_argnames="model")
def _example_sums(model, params, masks, inputs, targets):
  return jax.vmap(lambda p, m: core.masked_example_sums(
      model, p, inputs, targets, m))(params, masks)


def example_sums(model: Transformer, params: Params, masks: np.ndarray,
                 split: data.Split, *,
                 batch_size: int = 1000) -> dict[str, np.ndarray]:
  """Per-example sums ``[R, n]`` of each of the stacked ``params`` under
  its mask ``[R, L, H]`` on ``split``."""
  masks = jnp.asarray(masks, jnp.float32)
  pieces: dict[str, list[np.ndarray]] = {}
  for inputs, targets in core.batches(split, batch_size):
    out = jax.device_get(_example_sums(model, params, masks, inputs, targets))
    for key, value in out.items():
      pieces.setdefault(key, []).append(np.asarray(value))
  return {k: np.concatenate(v, axis=-1)[:, :len(split)]
          for k, v in pieces.items()}


__all__ = ["retrain_config", "finetune_masked", "fresh_params", "stack",
           "example_sums"]
