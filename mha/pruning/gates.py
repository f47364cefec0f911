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

**Exact-K gates** (:func:`train_exact_k`). A strength gives *some* number
of heads, not a chosen one, so the ``lambda`` grid covers the counts
coarsely. Exact-K gates take the number of heads to remove, ``k``, instead:
one gate vector per ``k``, all ``k`` one vmapped program like the
strengths, the model frozen, on the train split. Two ways to train them:

* ``top_k`` (the default; Li, Cotterell and Sachan 2021, differentiable
  subset pruning): every forward pass keeps exactly the ``N - k`` heads of
  largest ``log_alpha + Gumbel noise`` (gates exactly 1 or 0), and the
  gradient flows through Plotz and Roth's successive-softmax relaxation of
  that top-k (straight-through; temperature 0.5).
* ``lagrangian`` (Wang et al. 2020; CoFi, Xia et al. 2022): the
  hard-concrete gates above under
  ``CE + lambda1 (E[L0] - t) + lambda2 (E[L0] - t)^2``, ``t = N - k``,
  minimised in ``log_alpha`` and maximised (gradient ascent) in the
  multipliers.

Either way the subset is read off the learned ranking: the ``k`` heads of
lowest ``log_alpha`` are removed (:func:`removal_of_size`), so a target
keeps exactly ``N - k`` heads *by construction*, whatever the training did.
Why top-k is the default: it trains in the condition it is evaluated in
(exactly ``N - k`` heads, hard 0/1 gates), where the Lagrangian's sampled
gates keep about ``N - k`` heads, some of them half open. In a pilot on
the default model (seed 0, every ``k`` from 1 to 7, 200 steps, learning
rate 0.1), the mean validation token accuracy gap to the oracle at the same
``k`` was -0.069 for the Lagrangian (its best of three learning-rate
settings), -0.019 for top-k at temperature 1 and -0.010 at temperature 0.5.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha import data
from mha import evaluate as eval_lib
from mha import head_masks
from mha.run import sharding as sharding_lib
from mha.aliases import Array, Params
from mha.model import Transformer, TransformerConfig
from mha.pruning.constants import EXACT_K_METHODS
from mha.run import arguments


BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1
#: Initial ``log_alpha``: every gate partly open (test-time gate 0.65,
#: P(z != 0) 0.89). Chosen on validation in a pilot on 3 seeds of the
#: default model (strengths 1-6, 200 steps): the mean validation token
#: accuracy gap to the oracle at the same count was -0.016 from 0.5, -0.027
#: from 0 (Louizos et al.'s drop rate 0.5) and -0.085 from 3 (gates fully
#: open, which settle in worse subsets).
INIT_LOG_ALPHA = 0.5
#: The score of a head that does not exist in the top-k relaxation.
_ABSENT = -1e9


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


def _sampled_loss(log_alpha: Array, model: Transformer, params: Params,
                  inputs: Array, targets: Array, rng: Array
                  ) -> tuple[Array, Array]:
  """Mean token cross-entropy under sampled gates ``[L, H]``, and the
  expected number of heads kept."""
  exists = jnp.asarray(head_masks.existing_heads(model.config), jnp.float32)
  z = sample(log_alpha, rng) * exists
  sums = eval_lib.metric_sums(head_masks.masked_logits(model, params, inputs, z),
                              targets, inputs)
  expected = jnp.sum(probability_open(log_alpha) * exists)
  return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1), expected


def gate_loss(log_alpha: Array, model: Transformer, params: Params,
              inputs: Array, targets: Array, rng: Array,
              strength: Array) -> tuple[Array, Array]:
  """Mean token cross-entropy under sampled gates ``[L, H]`` plus
  ``strength`` times the expected number of heads kept; and that number."""
  loss, expected = _sampled_loss(log_alpha, model, params, inputs, targets,
                                 rng)
  return loss + strength * expected, expected


def lagrangian_loss(variables: Mapping[str, Array], model: Transformer,
                    params: Params, inputs: Array, targets: Array, rng: Array,
                    target_kept: Array) -> tuple[Array, Array]:
  """The exact-K gates' Lagrangian: mean token cross-entropy under sampled
  gates plus ``lambda1 d + lambda2 d^2``, ``d`` the expected number of heads
  kept minus ``target_kept``; and that expected number. ``variables``:
  ``log_alpha`` ``[L, H]``, ``lambda1`` and ``lambda2`` (scalars; the
  caller ascends their gradients)."""
  loss, expected = _sampled_loss(variables["log_alpha"], model, params,
                                 inputs, targets, rng)
  gap = expected - target_kept
  return (loss + variables["lambda1"] * gap
          + variables["lambda2"] * jnp.square(gap)), expected


# The optimizers are static arguments of the jitted steps below, and an
# optax transformation compares by the identity of its functions: a new
# ``optax.adam(rate)`` in every call would compile the step again for every
# seed of a study (measured: the exact-K and strength gates' steps compiled
# anew for the second seed, 3.4 and 2.4 s of its 7 s of compiling at XLA's
# default level). One object per rate, so later calls hit the jit's cache.
@functools.lru_cache(maxsize=None)
def _adam(learning_rate: float) -> optax.GradientTransformation:
  return optax.adam(learning_rate)


@functools.lru_cache(maxsize=None)
def _lagrangian_optimizer(learning_rate: float, multiplier_learning_rate: float
                          ) -> optax.GradientTransformation:
  return optax.multi_transform(
      {"gates": optax.adam(learning_rate),
       "multipliers": optax.adam(multiplier_learning_rate)},
      {"log_alpha": "gates", "lambda1": "multipliers",
       "lambda2": "multipliers"})


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


def replicated_start(variables: Any, optimizer: optax.GradientTransformation
                     ) -> tuple[Any, Any]:
  """``variables`` and ``optimizer.init(variables)``, laid out as a jitted
  step's outputs will be (replicated over the devices' mesh), so that the
  second step does not compile again for committed inputs."""
  replicated = sharding_lib.replicated(sharding_lib.make_mesh())
  variables = jax.device_put(variables, replicated)
  return variables, jax.device_put(optimizer.init(variables), replicated)


def _train(step_fn: Callable, model: Transformer, params: Params,
           variables: Any, optimizer: optax.GradientTransformation,
           per_vector: Array, train: data.Split, *, steps: int,
           batch_size: int, seed: int, log: Callable[[str], None],
           name: str, describe: Callable[[Any], str]
           ) -> tuple[Any, np.ndarray]:
  """The gates' training loop, shared by the strengths and the exact-K
  targets: ``steps`` of ``step_fn(model, optimizer, params, variables,
  opt_state, inputs, targets, rng, per_vector)`` on
  ``data.train_batch(train, seed=seed, step=s)``, logged four times
  (``name``, the step and ``describe(aux)``). Returns the trained variables
  (on the host) and the last step's auxiliary output ``[V]``."""
  variables, opt_state = replicated_start(variables, optimizer)
  rng = jax.random.key(seed)
  aux = jnp.zeros(len(per_vector))
  for step in range(steps):
    batch = data.train_batch(train, seed=seed, step=step,
                             batch_size=batch_size)
    variables, opt_state, aux = step_fn(
        model, optimizer, params, variables, opt_state, batch["inputs"],
        batch["targets"], jax.random.fold_in(rng, step), per_vector)
    if (step + 1) % max(steps // 4, 1) == 0:
      log(f"    {name} step {step + 1}/{steps}: {describe(aux)}")
  return jax.device_get(variables), np.asarray(aux, np.float64)


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
  arguments.check_count("steps", steps)
  arguments.check_count("batch_size", batch_size)
  config = model.config
  strengths = jnp.asarray(strengths, jnp.float32)
  log_alpha = jnp.full((len(strengths),) + head_masks.existing_heads(config).shape,
                       INIT_LOG_ALPHA, jnp.float32)
  start = time.perf_counter()
  log_alpha, expected = _train(
      _step, model, params, log_alpha, _adam(float(learning_rate)), strengths,
      train, steps=steps, batch_size=batch_size, seed=seed, log=log,
      name="gates", describe=lambda expected: "expected heads kept "
      + ", ".join(f"{float(e):.1f}" for e in expected))
  log_alpha = np.asarray(log_alpha, np.float64)
  log_alpha[:, ~head_masks.existing_heads(config)] = np.nan
  return {"log_alpha": log_alpha,
          "expected_heads": np.asarray(expected, np.float64),
          "seconds": time.perf_counter() - start, "steps": steps}


def kept_mask(log_alpha: np.ndarray, config: TransformerConfig, *,
              no_layer_emptied: bool = False) -> np.ndarray:
  """The 0/1 head mask ``[L, H]`` of one strength's gates: the heads whose
  test-time gate is above 0; with ``no_layer_emptied``, a layer left with
  none keeps its head of largest ``log_alpha``. NumPy on the host: not for
  ``jit``."""
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
  arguments.check_count("count", count, 0)
  flat = np.where(head_masks.existing_heads(config), log_alpha, np.inf).reshape(-1)
  order = np.argsort(flat, kind="stable")
  return order[:count]


def relaxed_top_k(scores: Array, count: Array, exists: Array,
                  temperature: float) -> Array:
  """Plotz and Roth's (2018) successive-softmax relaxation of the top
  ``count`` of ``scores`` ``[L, H]`` (as Li et al. 2021 use it): ``count``
  softmaxes, each over what the previous ones left; their sum, clipped
  to ``[0, 1]`` per head (so at most ``count`` in all). ``count`` may be traced
  (vmapped targets): the loop runs over every head and adds only the
  first ``count`` rounds."""
  flat = jnp.where(exists, scores, _ABSENT).reshape(-1)

  def body(i, carry):
    flat, onehot, khot = carry
    on = i < count
    flat = jnp.where(on, flat + jnp.log(jnp.maximum(1.0 - onehot, 1e-20)),
                     flat)
    onehot = jnp.where(on, jax.nn.softmax(flat / temperature), onehot)
    return flat, onehot, jnp.where(on, khot + onehot, khot)
  zeros = jnp.zeros_like(flat)
  _, _, khot = jax.lax.fori_loop(0, flat.shape[0], body, (flat, zeros, zeros))
  return jnp.clip(khot, 0.0, 1.0).reshape(scores.shape)


def top_k_sample(log_alpha: Array, rng: Array, count: Array, exists: Array,
                 temperature: float) -> Array:
  """Gumbel top-k gates (Li et al. 2021): the ``count`` heads of largest
  ``log_alpha`` plus Gumbel noise kept (exactly 1, the rest exactly 0) in
  the forward pass; gradients through :func:`relaxed_top_k` of the same
  perturbed scores (straight-through)."""
  scores = log_alpha + jax.random.gumbel(rng, jnp.shape(log_alpha))
  soft = relaxed_top_k(scores, count, exists, temperature)
  flat = jnp.where(exists, scores, _ABSENT).reshape(-1)
  rank = jnp.argsort(jnp.argsort(-flat))  # 0: the largest
  hard = (rank < count).astype(scores.dtype).reshape(scores.shape)
  # soft - soft is exactly 0: the forward value is exactly the hard gates.
  return hard + (soft - jax.lax.stop_gradient(soft))


def top_k_loss(log_alpha: Array, model: Transformer, params: Params,
               inputs: Array, targets: Array, rng: Array, kept: Array,
               temperature: float) -> tuple[Array, Array]:
  """Mean token cross-entropy with exactly ``kept`` heads kept, drawn by
  :func:`top_k_sample`; and ``kept``."""
  exists = jnp.asarray(head_masks.existing_heads(model.config))
  z = top_k_sample(log_alpha, rng, kept, exists, temperature) * exists
  sums = eval_lib.metric_sums(head_masks.masked_logits(model, params, inputs, z),
                              targets, inputs)
  return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1), jnp.sum(z)


@functools.partial(jax.jit, static_argnames=("model", "optimizer",
                                             "temperature"))
def _top_k_step(model, optimizer, params, log_alpha, opt_state, inputs,
                targets, rng, kept, temperature):
  keys = jax.random.split(rng, kept.shape[0])
  grad = jax.grad(top_k_loss, has_aux=True)
  grads, count = jax.vmap(
      lambda la, key, k: grad(la, model, params, inputs, targets, key, k,
                              temperature))(log_alpha, keys, kept)
  updates, opt_state = optimizer.update(grads, opt_state, log_alpha)
  return optax.apply_updates(log_alpha, updates), opt_state, count


@functools.partial(jax.jit, static_argnames=("model", "optimizer"))
def _exact_step(model, optimizer, params, variables, opt_state, inputs,
                targets, rng, target_kept):
  keys = jax.random.split(rng, target_kept.shape[0])
  grad = jax.grad(lagrangian_loss, has_aux=True)
  grads, expected = jax.vmap(
      lambda v, key, t: grad(v, model, params, inputs, targets, key, t)
  )(variables, keys, target_kept)
  # A saddle point: descend in log_alpha, ascend in the multipliers.
  grads = dict(grads, lambda1=-grads["lambda1"], lambda2=-grads["lambda2"])
  updates, opt_state = optimizer.update(grads, opt_state, variables)
  return optax.apply_updates(variables, updates), opt_state, expected


def check_targets(config: TransformerConfig, targets: Sequence[int]) -> None:
  """Raises ValueError unless every target (heads removed) is an integer in
  ``1 .. N - 1`` (``N`` the model's heads): 0 and ``N`` need no gates."""
  n = int(np.sum(head_masks.existing_heads(config)))
  bad = [t for t in targets if int(t) != t or not 1 <= t <= n - 1]
  if bad or not len(targets):
    raise ValueError(
        f"exact-K gate targets (heads removed) must be integers from 1 to "
        f"{n - 1} for this model's {n} heads, got {list(targets)}")


# EXACT_K_METHODS (mha.pruning.constants): train_exact_k's methods.


def train_exact_k(model: Transformer, params: Params, train: data.Split,
                  targets: Sequence[int], *, steps: int, batch_size: int,
                  method: str = "top_k", learning_rate: float = 0.1,
                  temperature: float = 0.5,
                  multiplier_learning_rate: float | None = None,
                  seed: int = 0, log: Callable[[str], None] = lambda _: None
                  ) -> dict[str, Any]:
  """Trains one exact-K gate vector per target (heads removed), all at once
  (module docstring): ``method`` ``top_k``, Gumbel top-k keeping exactly
  ``N - target`` heads in every forward pass (:func:`top_k_loss`,
  ``temperature`` its relaxation's), or ``lagrangian``, hard-concrete gates
  under :func:`lagrangian_loss`.

  Batches are ``data.train_batch(train, seed=seed, step=s)``; Adam on
  ``log_alpha`` (``learning_rate``) and, for the Lagrangian, on the
  multipliers (``multiplier_learning_rate``, default ``learning_rate``);
  the model's parameters are frozen.

  Returns:
    ``targets`` (heads removed), ``removed`` (per target the flat indices
    of exactly that many heads: those of lowest ``log_alpha``),
    ``log_alpha`` ``[T, L, H]`` (NaN where no head), ``expected_heads``
    ``[T]`` (heads kept in the last step: exactly ``N - target`` for
    ``top_k``, the expected L0 for ``lagrangian``), ``method``, ``seconds``
    and ``steps``; for ``lagrangian`` the multipliers ``lambda1`` and
    ``lambda2`` ``[T]``.

  Raises:
    ValueError: a target outside ``1 .. N - 1`` (:func:`check_targets`) or
      an unknown ``method``.
  """
  arguments.check_count("steps", steps)
  arguments.check_count("batch_size", batch_size)
  if method not in EXACT_K_METHODS:
    raise ValueError(f"method {method!r} is not one of: "
                     f"{', '.join(EXACT_K_METHODS)}")
  config = model.config
  check_targets(config, targets)
  n = int(np.sum(head_masks.existing_heads(config)))
  count = len(targets)
  kept = jnp.asarray([n - int(t) for t in targets],
                     jnp.int32 if method == "top_k" else jnp.float32)
  log_alpha = jnp.full((count,) + head_masks.existing_heads(config).shape,
                       INIT_LOG_ALPHA, jnp.float32)
  if method == "top_k":
    variables, optimizer = log_alpha, _adam(float(learning_rate))
    step_fn = functools.partial(_top_k_step, temperature=temperature)
  else:
    variables = {"log_alpha": log_alpha,
                 "lambda1": jnp.zeros(count, jnp.float32),
                 "lambda2": jnp.zeros(count, jnp.float32)}
    rate = (learning_rate if multiplier_learning_rate is None
            else multiplier_learning_rate)
    optimizer = _lagrangian_optimizer(float(learning_rate), float(rate))
    step_fn = _exact_step
  start = time.perf_counter()
  variables, heads = _train(
      step_fn, model, params, variables, optimizer, kept, train, steps=steps,
      batch_size=batch_size, seed=seed, log=log,
      name="exact-K gates", describe=lambda heads: "heads kept " + ", ".join(
          f"{float(e):.1f}/{int(t)}" for e, t in zip(heads, kept)))
  out: dict[str, Any] = {}
  if method == "lagrangian":
    out = {name: np.asarray(variables[name], np.float64)
           for name in ("lambda1", "lambda2")}
    variables = variables["log_alpha"]
  log_alpha = np.asarray(variables, np.float64)
  log_alpha[:, ~head_masks.existing_heads(config)] = np.nan
  return out | {
      "targets": [int(t) for t in targets], "method": method,
      "removed": [removal_of_size(la, config, int(t))
                  for la, t in zip(log_alpha, targets)],
      "log_alpha": log_alpha, "expected_heads": np.asarray(heads, np.float64),
      "seconds": time.perf_counter() - start, "steps": steps}


__all__ = ["BETA", "GAMMA", "ZETA", "INIT_LOG_ALPHA", "sample",
           "probability_open", "deterministic", "gate_loss",
           "lagrangian_loss", "relaxed_top_k", "top_k_sample", "top_k_loss",
           "train_gates", "EXACT_K_METHODS", "check_targets", "train_exact_k",
           "kept_mask", "removal_of_size", "replicated_start"]
