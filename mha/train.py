"""Training and evaluation: ``train_and_evaluate(config, workdir)``.

One jitted, buffer-donating train step; batches a pure function of
``(seed, step)``; orbax checkpoints of the whole train state, so a run
resumed from its workdir ends with bitwise the parameters of an
uninterrupted one (on CPU). Metrics go to the console (a progress line with
steps/s and ETA), TensorBoard event files and ``workdir/metrics.jsonl``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.training import train_state as train_state_lib

from mha import checkpoint as ckpt_lib
from mha import data
from mha import evaluate as eval_lib
from mha.metric_writers import MetricWriter, format_duration
from mha.model import Transformer, TransformerConfig

Array = jax.Array
TrainState = train_state_lib.TrainState


# --------------------------------------------------------------------------
# From config to model, data and optimizer.
# --------------------------------------------------------------------------


def data_spec(config: ml_collections.ConfigDict) -> data.DataSpec:
  """The dataset a config trains on."""
  return data.DataSpec(
      task=config.task,
      num_symbols=config.data.num_symbols,
      min_len=config.data.min_len,
      max_len=config.data.max_len,
      num_train_examples=config.data.num_train_examples,
      num_eval_examples=config.data.num_eval_examples,
      seed=config.data.seed,
  )


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
  """The ``TransformerConfig`` of a run config (the model/data boundary)."""
  m = config.model
  return TransformerConfig(
      vocab_size=data.vocab_size(config.task, config.data.num_symbols,
                                 config.data.max_len),
      num_layers=m.num_layers,
      num_heads=(tuple(m.num_heads) if isinstance(m.num_heads, (list, tuple))
                 else m.num_heads),
      d_model=m.d_model,
      mlp_dim=m.mlp_dim,
      max_len=config.data.max_len,
      dropout_rate=m.dropout_rate,
      attention_dropout_rate=m.attention_dropout_rate,
      pre_norm=m.pre_norm,
      positional=m.positional,
  )


def make_model(config: ml_collections.ConfigDict) -> Transformer:
  """The ``Transformer`` a run config describes."""
  return Transformer(model_config(config))


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to ``learning_rate``, then cosine decay to 0."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=config.warmup_steps,
      decay_steps=max(config.num_train_steps, config.warmup_steps + 1),
      end_value=0.0,
  )


def make_optimizer(
    config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW (decay on matrices only) after global-norm clipping."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip_norm),
      optax.adamw(learning_rate_schedule(config), b2=config.adam_b2,
                  weight_decay=config.weight_decay, mask=decay_mask),
  )


def create_train_state(config: ml_collections.ConfigDict, model: Transformer,
                       rng: Array) -> TrainState:
  """Fresh parameters and optimizer state at step 0."""
  tokens = jnp.ones((1, model.config.max_len), jnp.int32)
  params = model.init(rng, tokens)["params"]
  return TrainState.create(apply_fn=model.apply, params=params,
                           tx=make_optimizer(config))


# --------------------------------------------------------------------------
# Steps.
# --------------------------------------------------------------------------


def train_step(state: TrainState, batch: Mapping[str, Array], rng: Array, *,
               model: Transformer,
               schedule: optax.Schedule) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer update; returns the new state and metric sums.

  The dropout rng is ``fold_in(rng, step)``, so a resumed run draws the same
  dropout masks as an uninterrupted one.
  """
  dropout_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    logits, _ = model.apply({"params": params}, batch["inputs"],
                            deterministic=False, return_weights=False,
                            rngs={"dropout": dropout_rng})
    sums = eval_lib.metric_sums(logits, batch["targets"], batch["inputs"])
    return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  metrics = dict(sums, grad_norm=optax.tree.norm(grads),
                 learning_rate=schedule(state.step))
  return state.apply_gradients(grads=grads), metrics


class _TrainMetrics:
  """Host-side accumulator of train metric sums over a logging window."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.sums: dict[str, float] = {}
    self.steps = 0
    self.last: dict[str, float] = {}

  def add(self, metrics: Mapping[str, np.ndarray]):
    for key in ("loss_sum", "correct", "tokens", "exact", "sequences"):
      self.sums[key] = self.sums.get(key, 0.0) + float(metrics[key])
    self.last = {k: float(metrics[k]) for k in ("grad_norm", "learning_rate")}
    self.steps += 1

  def summary(self) -> dict[str, float]:
    return {**eval_lib.summarize(self.sums), **self.last}


def _check_finite(step: int, metrics: Mapping[str, np.ndarray]) -> None:
  loss = float(metrics["loss_sum"])
  grad_norm = float(metrics["grad_norm"])
  if not (np.isfinite(loss) and np.isfinite(grad_norm)):
    raise FloatingPointError(
        f"non-finite training metrics at step {step}: loss sum {loss}, "
        f"gradient norm {grad_norm}")


# --------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------


def _log_line(step: int, total: int, metrics: Mapping[str, float],
              steps_per_sec: float, elapsed: float) -> str:
  eta = (total - step) / steps_per_sec if steps_per_sec > 0 else 0.0
  return (f"step {step:>{len(str(total))}}/{total} | "
          f"loss {metrics['loss']:.4f} | tok_acc {metrics['token_accuracy']:.4f}"
          f" | exact {metrics['exact_match']:.4f} | "
          f"{steps_per_sec:.1f} steps/s | {format_duration(elapsed)} elapsed, "
          f"ETA {format_duration(eta)}")


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike) -> TrainState:
  """Trains ``config`` in ``workdir``, resuming from its latest checkpoint.

  Evaluates on validation every ``eval_every_steps`` and on test at the end;
  saves checkpoints every ``checkpoint_every_steps`` and at the end.

  Returns:
    The final train state.
  """
  start_time = time.time()
  workdir = os.path.abspath(os.path.expanduser(os.fspath(workdir)))
  os.makedirs(workdir, exist_ok=True)

  splits = data.load_splits(data_spec(config), config.data.data_dir)
  model = make_model(config)
  rng = jax.random.key(config.seed)
  init_rng, dropout_rng = jax.random.split(rng)

  manager = ckpt_lib.make_manager(
      workdir, max_to_keep=config.max_checkpoints_to_keep)
  # Jitted: eager initialisation runs op by op and takes seconds.
  state = jax.jit(functools.partial(create_train_state, config, model))(
      init_rng)
  latest = manager.latest_step()
  if latest is not None:
    state = ckpt_lib.restore_state(manager, latest, state)
    print(f"Resumed from checkpoint at step {latest} in {workdir}",
          flush=True)
  start_step = int(state.step)
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    f.write(ckpt_lib.config_to_json(config) + "\n")

  writer = MetricWriter(workdir)
  if start_step == 0:
    writer.write_text(0, "config", f"```\n{config}\n```")
    num_params = sum(p.size for p in jax.tree.leaves(state.params))
    print(f"Training {config.task}: {num_params:,} parameters, "
          f"{config.num_train_steps} steps of batch {config.batch_size}; "
          f"workdir {workdir}", flush=True)

  step_fn = jax.jit(
      functools.partial(train_step, model=model,
                        schedule=learning_rate_schedule(config)),
      donate_argnums=0)
  total = config.num_train_steps
  window = _TrainMetrics()
  window_start, window_step = time.time(), start_step
  pending = None  # (step, metrics on device): fetched one step late.

  def process(step: int, metrics) -> None:
    nonlocal window_start, window_step
    metrics = jax.device_get(metrics)
    _check_finite(step, metrics)
    window.add(metrics)
    if step % config.log_every_steps == 0 or step == total:
      now = time.time()
      rate = (step - window_step) / max(now - window_start, 1e-9)
      summary = window.summary()
      writer.write_scalars(step, {**summary, "steps_per_sec": rate})
      print(_log_line(step, total, summary, rate, now - start_time),
            flush=True)
      window.reset()
      window_start, window_step = now, step

  for step in range(start_step + 1, total + 1):
    batch = data.train_batch(splits["train"], seed=config.seed, step=step - 1,
                             batch_size=config.batch_size)
    state, metrics = step_fn(state, batch, dropout_rng)
    if pending is not None:
      process(*pending)
    pending = (step, metrics)

    is_last = step == total
    do_eval = step % config.eval_every_steps == 0 or is_last
    do_save = step % config.checkpoint_every_steps == 0 or is_last
    if do_eval or do_save:
      # Never evaluate or checkpoint before the finiteness check of this step.
      process(*pending)
      pending = None
    if do_eval:
      _evaluate_and_write(writer, model, state.params, splits["validation"],
                          "validation", step, config.eval_batch_size,
                          start_time)
    if do_save:
      ckpt_lib.save(manager, step, state, config)
    if do_eval or do_save:  # steps/s measures training: restart its clock
      window_start, window_step = time.time(), step

  if pending is not None:
    process(*pending)
  final_step = int(state.step)
  _evaluate_and_write(writer, model, state.params, splits["test"], "test",
                      final_step, config.eval_batch_size, start_time)
  manager.wait_until_finished()
  manager.close()
  writer.close()
  return state


def _evaluate_and_write(writer: MetricWriter, model: Transformer, params: Any,
                        split: data.Split, name: str, step: int,
                        batch_size: int, start_time: float) -> dict[str, float]:
  metrics = eval_lib.evaluate(model, params, split, batch_size)
  writer.write_scalars(step, {f"{name}/{k}": v for k, v in metrics.items()})
  print(f"{name} @ step {step}: loss {metrics['loss']:.4f} | "
        f"tok_acc {metrics['token_accuracy']:.4f} | "
        f"exact {metrics['exact_match']:.4f} "
        f"({format_duration(time.time() - start_time)} since start)",
        flush=True)
  return metrics
