"""Retraining after pruning, many pruned models at once.

A model with heads removed by a 0/1 head mask computes exactly what the
physically pruned model computes (:func:`mha.pruning.prune_heads`), and a
removed head's parameters get zero gradient, so fine-tuning the masked model
is fine-tuning the pruned one (weight decay shrinks the removed heads'
kernels, which nothing reads). That lets every pruned model of a seed train
as one vmapped program over stacked parameters and masks, all on the same
batches (paired), with a fresh optimizer each. What differs between the arms
is where they start and for how many steps they train:

* *fine-tuned*: from the converged parameters, for the fine-tuning steps;
* *Scratch-E* and *Scratch-B* (Liu et al. 2019): the pruned architecture
  from a fresh initialisation *of that architecture*
  (:func:`scratch_params`: ``build.init_params`` of the model with fewer
  heads per layer, so e.g. the output projection's fan-in is the pruned
  one's), for the original run's steps (E) or for as many steps as cost the
  FLOPs of the original run plus the fine-tuning (B, :func:`scratch_b_steps`);
* *rewind* (Frankle & Carbin 2019): the kept heads' step-0 weights, i.e. the
  run's own initial parameters (:func:`step0_params`) under the mask, for
  the original run's steps.

Why a masked model stands for the physically pruned one here, exactly: a
scratch arm's parameters are the pruned architecture's initial parameters
written into the kept heads' slots of the full layout, zeros in the removed
heads' (:func:`embed_heads`; ``prune_heads`` of them gives back the pruned
model's parameters, shapes and values). Under the mask the removed heads'
parameters get zero gradient, so AdamW leaves them at zero (its weight decay
of zero is zero) and the gradient clipping sees the pruned model's global
norm: every step computes what the pruned model's step computes, up to
floating-point summation order. (With attention dropout > 0 the dropout
draws of a ``[B, H, Q, K]`` tensor differ from a pruned model's: equal in
distribution, not in value. The configs here have none.)

The optimizer is the run's (``build.make_optimizer``) for a config with
``num_train_steps = steps`` and the warmup scaled to the same share of the
run; the batches are ``data.train_batch(train, seed=config.seed, step=s)``,
so a run of the original steps sees the original run's batches.
``config.init_from`` is the same fine-tuning for one saved pruned model from
the command line (:mod:`mha.finetune`).
"""

from __future__ import annotations

import copy
import dataclasses
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
from mha.model import Transformer, TransformerConfig
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


#: ``build.init_params`` compiled once per architecture (eager
#: initialisation runs op by op and takes seconds).
_init = jax.jit(build.init_params, static_argnums=0)


def step0_params(model: Transformer,
                 config: ml_collections.ConfigDict) -> Params:
  """The parameters the run of ``config`` started from (its step 0): the
  same key as :func:`mha.train.train_and_evaluate` draws them with."""
  return _init(model, build.run_rngs(config)[0])


def pruned_model_config(config: TransformerConfig,
                        mask: np.ndarray) -> TransformerConfig:
  """The config of the model with ``mask``'s heads per layer (``[L, H]``)."""
  return dataclasses.replace(
      config, num_heads=tuple(int(c) for c in np.asarray(mask).sum(axis=1)),
      head_dim=config.resolved_head_dim)


def embed_heads(pruned: Params, full: Params, mask: np.ndarray) -> Params:
  """The inverse of :func:`mha.pruning.prune_heads`: a pruned model's
  parameters written into the layout of ``full`` (parameters or their
  shapes), its heads in the slots ``mask`` (``[L, H]``) keeps, zeros in the
  others. Everything but the attention heads is ``pruned``'s."""
  out = jax.tree.map(np.asarray, dict(pruned))
  for layer, row in enumerate(np.asarray(mask)):
    name = f"layer_{layer}"
    kept = np.flatnonzero(row[:full[name]["attention"]["out"]["kernel"].shape[
        0]])
    source = pruned[name]["attention"]
    attention = {}
    for proj, leaves in full[name]["attention"].items():
      attention[proj] = {}
      for leaf, like in leaves.items():
        axis = core.HEAD_AXES.get((proj, leaf))
        if axis is None:
          attention[proj][leaf] = np.asarray(source[proj][leaf])
          continue
        value = np.zeros(like.shape, like.dtype)
        if len(kept):
          index = [slice(None)] * value.ndim
          index[axis] = kept
          value[tuple(index)] = np.asarray(source[proj][leaf])
        attention[proj][leaf] = value
    out[name] = dict(out[name], attention=attention)
  return out


def scratch_params(model: Transformer, masks: np.ndarray,
                   seeds: np.ndarray) -> Params:
  """Stacked fresh parameters ``[R, ...]`` of the pruned architectures of
  ``masks`` (``[R, L, H]``): the model with each mask's heads per layer
  initialised with ``jax.random.key(seeds[r])`` (its own shapes, so its
  own fan-ins), in the full layout (:func:`embed_heads`)."""
  full = jax.eval_shape(lambda: build.init_params(model, jax.random.key(0)))
  one = []
  for mask, seed in zip(np.asarray(masks), np.asarray(seeds)):
    pruned = Transformer(pruned_model_config(model.config, mask))
    one.append(embed_heads(_init(pruned, jax.random.key(int(seed))), full,
                           mask))
  return jax.tree.map(lambda *xs: np.stack(xs), *one)


def forward_flops(config: TransformerConfig) -> float:
  """Matrix-multiply FLOPs (2 per multiply-add) of one forward pass of one
  sequence of ``max_len`` tokens (batches are padded to it): per layer, the
  query, key, value and output projections and the attention scores and
  weighted values of its heads, and the feed-forward block; the logits.
  LayerNorm, softmax, GELU and the embeddings (O(L d) each) are left out. A
  training step costs about 3 forward passes for every architecture, so
  ratios of this are ratios of training compute."""
  n, d, dh = config.max_len, config.d_model, config.resolved_head_dim
  flops = 2.0 * n * d * config.vocab_size
  for heads in config.heads_per_layer:
    flops += 4 * 2.0 * n * d * heads * dh  # query, key, value, out
    flops += 2 * 2.0 * n * n * heads * dh  # scores, weighted values
    flops += 2 * 2.0 * n * d * config.mlp_dim  # feed-forward
  return flops


def scratch_b_steps(config: TransformerConfig, mask: np.ndarray, *,
                    train_steps: int, finetune_steps: int) -> int:
  """Steps of the pruned architecture of ``mask`` that cost what pruning
  and fine-tuning cost: ``train_steps`` of the full model and
  ``finetune_steps`` of the pruned one, in :func:`forward_flops` (the
  importance measurement and the search are not counted). That is
  ``round(train_steps * F_full / F_pruned) + finetune_steps``: Liu et al.'s
  (2019) Scratch-B, its steps scaled by the FLOP ratio."""
  ratio = forward_flops(config) / forward_flops(
      pruned_model_config(config, mask))
  return int(round(train_steps * ratio)) + int(finetune_steps)


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


__all__ = ["retrain_config", "finetune_masked", "fresh_params", "step0_params",
           "pruned_model_config", "embed_heads", "scratch_params",
           "forward_flops", "scratch_b_steps", "stack", "example_sums"]
