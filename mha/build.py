"""From a run config to objects: the dataset spec, the model, the optimizer.

The one low module every entry point builds with (nanodo's ``model_factory``):
``mha.train``, ``mha.checkpoint``, ``eval.py`` and the scripts import it, and it
imports none of them, so no import cycle can form.

    config = default.get_config()
    model = build.make_model(config)
    state = build.create_train_state(config, model, jax.random.key(0))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.training import train_state as train_state_lib

from mha import data
from mha.model import Transformer, TransformerConfig

Array = jax.Array
TrainState = train_state_lib.TrainState


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


def weight_decay_mask(params: Any) -> Any:
  """True for the parameters weight decay applies to."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(
    config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW (decay per :func:`weight_decay_mask`) after global-norm clipping."""
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip_norm),
      optax.adamw(learning_rate_schedule(config), b2=config.adam_b2,
                  weight_decay=config.weight_decay, mask=weight_decay_mask),
  )


def create_train_state(config: ml_collections.ConfigDict, model: Transformer,
                       rng: Array) -> TrainState:
  """Fresh parameters and optimizer state at step 0."""
  tokens = jnp.ones((1, model.config.max_len), jnp.int32)
  params = model.init(rng, tokens)["params"]
  return TrainState.create(apply_fn=model.apply, params=params,
                           tx=make_optimizer(config))
