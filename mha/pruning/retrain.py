"""Retraining after pruning, many pruned models at once.

A model with heads removed by a 0/1 head mask computes exactly what the
physically pruned model computes (:func:`mha.pruning.prune_heads`), and a
removed head's parameters get zero gradient, so fine-tuning the masked model
is fine-tuning the pruned one (weight decay shrinks the removed heads'
kernels, which nothing reads). That lets every pruned model of a seed train
in one compiled program over stacked parameters and masks, all on the same
batches (paired), with a fresh optimizer each (:func:`finetune_masked`:
one model after another within each step, the same computation whatever
the other models of the stack are, so identical jobs can be trained once). What differs
between the arms is where they start and for how many steps they train:

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
run (its learning rates computed per step count and read from a table, so
models of different step counts share one program); the batches are ``data.train_batch(train, seed=config.seed, step=s)``,
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
from mha.run import sharding as sharding_lib
from mha.aliases import Params
from mha.model import Transformer, TransformerConfig
from mha.pruning import core
from mha.run import arguments


def retrain_config(config: ml_collections.ConfigDict,
                   steps: int) -> ml_collections.ConfigDict:
  """``config`` for ``steps`` steps, its warmup the same share of them."""
  arguments.check_count("steps", steps)
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


def learning_rates(config: ml_collections.ConfigDict,
                   steps: int) -> np.ndarray:
  """The learning rate of each step ``[steps]`` (float32) of a run of
  ``steps`` steps: :func:`mha.build.learning_rate_schedule` of
  :func:`retrain_config`, compiled with its step counts as constants as
  when it was part of a run's optimizer, so :func:`_step`, which reads them
  from this table (one compiled program for every ``steps``), takes the
  same steps as that optimizer (``tests/test_retrain.py``)."""
  schedule = build.learning_rate_schedule(retrain_config(config, steps))
  return np.asarray(jax.jit(jax.vmap(schedule))(
      jnp.arange(steps, dtype=jnp.int32)), np.float32)


#: The optimizer's settings :func:`_step` reads (static; the learning rates
#: are an input).
_HYPER = ("grad_clip_norm", "adam_b2", "weight_decay")


@functools.partial(jax.jit, static_argnames=("model", "hyper"),
                   donate_argnums=(2, 3, 4))
def _step(model, hyper, params, opt_state, last_loss, masks, rates, active,
          step, inputs, targets, rng):
  """One training step of the first ``active`` of the stacked models (the
  others are left as they are), one model after another: each an unbatched
  step (faster than a vmapped one on CPU, and the same computation whatever
  the other models are), its learning rates ``rates[r]`` (by step)."""
  config = ml_collections.ConfigDict(dict(hyper))
  rng = jax.random.fold_in(rng, step)

  def body(r, carry):
    params, opt_state, last_loss = carry
    take = lambda x: jax.lax.dynamic_index_in_dim(x, r, keepdims=False)
    p, state = jax.tree.map(take, params), jax.tree.map(take, opt_state)
    loss, grads = jax.value_and_grad(_loss)(p, model, inputs, targets,
                                            masks[r], rng)
    optimizer = build.make_optimizer(config, lambda count: rates[r, count])
    updates, state = optimizer.update(grads, state, p)
    p = optax.apply_updates(p, updates)
    put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, r, 0)
    return (jax.tree.map(put, params, p), jax.tree.map(put, opt_state, state),
            last_loss.at[r].set(loss))

  return jax.lax.fori_loop(0, active, body, (params, opt_state, last_loss))


@functools.partial(jax.jit, static_argnames="hyper")
def _fresh_opt_state(params, hyper):
  """A fresh optimizer state for each of the stacked ``params``, as one
  program (vmapped eagerly instead, each leaf's shape compiled programs of
  its own)."""
  config = ml_collections.ConfigDict(dict(hyper))
  return jax.vmap(build.make_optimizer(config, lambda count: 0.0).init)(params)


#: Stacks are padded to a multiple of this many models and the learning
#: rate tables to a multiple of this many steps, so that every arm and seed
#: runs the same compiled program (padding costs no compute).
PAD_MODELS, PAD_STEPS = 32, 1024


def finetune_masked(model: Transformer, params: Params, masks: np.ndarray,
                    train: data.Split, config: ml_collections.ConfigDict, *,
                    steps: int | np.ndarray,
                    log: Callable[[str], None] = lambda _: None
                    ) -> tuple[Params, dict[str, Any]]:
  """Trains ``R`` models at once with a fresh optimizer each: stacked
  ``params`` (leading axis ``R``) under their fixed head ``masks``
  ``[R, L, H]``, for ``steps`` steps (one count, or one per model ``[R]``,
  each with its own schedule, :func:`retrain_config`). All see the same
  batch at each step; a model with fewer steps stops while the others go
  on. A model's result does not depend on the others in the stack (the
  same job twice trains to the same bits); it equals training it alone to
  float32 rounding.

  Returns:
    The stacked trained parameters, and ``{"seconds", "final_loss" [R]}``.
  """
  count = int(np.asarray(masks).shape[0])
  steps = np.broadcast_to(np.asarray(steps, np.int64), (count,))
  # Longest first: the models still training at a step are a prefix.
  order = np.argsort(-steps, kind="stable")
  size = -(-max(count, 1) // PAD_MODELS) * PAD_MODELS

  def padded(x, fill=None):
    x = np.asarray(x)[order]
    rest = (np.broadcast_to(x[:1], (size - count,) + x.shape[1:])
            if fill is None else np.full((size - count,) + x.shape[1:], fill,
                                         x.dtype))
    return np.concatenate([x, rest])

  total = int(steps.max()) if count else 0
  rates = np.zeros((count, -(-max(total, 1) // PAD_STEPS) * PAD_STEPS),
                   np.float32)
  for value in set(steps.tolist()):
    rates[steps == value, :value] = learning_rates(config, value)
  # Laid out as the step's outputs will be (replicated): one compilation.
  replicated = sharding_lib.replicated(sharding_lib.make_mesh())
  put = lambda x: jax.device_put(x, replicated)
  hyper = tuple((k, config[k]) for k in _HYPER)
  params = put(jax.tree.map(padded, params))
  opt_state = put(_fresh_opt_state(params, hyper))
  last_loss = put(np.full(size, np.nan, np.float32))
  masks = put(padded(np.asarray(masks, np.float32)))
  rates = put(padded(rates, 0))
  rng = jax.random.key(config.seed)
  start = time.perf_counter()
  for step in range(total):
    batch = data.train_batch(train, seed=config.seed, step=step,
                             batch_size=config.batch_size)
    active = int(np.sum(steps > step))
    params, opt_state, last_loss = _step(
        model, hyper, params, opt_state, last_loss, masks, rates, active,
        step, batch["inputs"], batch["targets"], rng)
    if (step + 1) % max(total // 4, 1) == 0:
      log(f"    retraining {count} models, step {step + 1}/{total}: "
          f"mean loss {float(np.mean(np.asarray(last_loss)[:count])):.4f}")
  back = np.argsort(order)
  # On the host: as device ops, each leaf's shape would compile two programs.
  params = jax.tree.map(lambda x: np.asarray(x)[:count][back], params)
  return params, {"seconds": time.perf_counter() - start,
                  "final_loss": np.asarray(last_loss, np.float64)[:count][
                      back]}


def fresh_params(model: Transformer, seeds: np.ndarray) -> Params:
  """Stacked fresh parameters, one set per seed (``[R, ...]``)."""
  keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
  return _fresh(model, keys)


@functools.partial(jax.jit, static_argnums=0)
def _fresh(model: Transformer, keys: jax.Array) -> Params:
  """:func:`build.init_params` for each of ``keys``, compiled once per
  architecture and count."""
  return jax.vmap(lambda k: build.init_params(model, k))(keys)


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
  arguments.check_count("train_steps", train_steps)
  arguments.check_count("finetune_steps", finetune_steps, 0)
  ratio = forward_flops(config) / forward_flops(
      pruned_model_config(config, mask))
  return int(round(train_steps * ratio)) + int(finetune_steps)


def stack(params: Params, count: int) -> Params:
  """``count`` copies of ``params`` along a new leading axis (host arrays,
  read-only views: nothing is compiled)."""
  arguments.check_count("count", count)
  return jax.tree.map(
      lambda x: np.broadcast_to(np.asarray(x), (count,) + np.shape(x)), params)


@functools.partial(jax.jit, static_argnames="model")
def _example_sums(model, params, masks, inputs, targets):
  return jax.vmap(lambda p, m: core.masked_example_sums(
      model, p, inputs, targets, m))(params, masks)


def example_sums(model: Transformer, params: Params, masks: np.ndarray,
                 split: data.Split, *,
                 batch_size: int = 1000) -> dict[str, np.ndarray]:
  """Per-example sums ``[R, n]`` of each of the stacked ``params`` under
  its mask ``[R, L, H]`` on ``split``."""
  arguments.check_count("batch_size", batch_size)
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
