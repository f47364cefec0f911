"""From a run config to objects: the dataset spec, the model, the optimizer.

The one low module every entry point builds with (nanodo's ``model_factory``):
``mha.train``, ``mha.checkpoint``, ``eval.py`` and the scripts import it, and it
imports none of them, so no import cycle can form.

    config = default.get_config()
    model = build.make_model(config)
    state = build.create_train_state(config, model, jax.random.key(0))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.training import train_state as train_state_lib

from mha import data
from mha.aliases import Array
from mha.model import Transformer, TransformerConfig

TrainState = train_state_lib.TrainState


def data_spec(config: ml_collections.ConfigDict) -> data.DataSpec:
  """The dataset a config trains on: ``config.data``'s fields that the
  ``DataSpec`` has (all but ``data_dir``). A config saved before a field
  existed (e.g. ``max_digits``) lacks it and gets the dataclass default."""
  fields = {field.name for field in dataclasses.fields(data.DataSpec)}
  return data.DataSpec(task=config.task, **{
      key: value for key, value in config.data.items() if key in fields})


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
  """The ``TransformerConfig`` of a run config (the model/data boundary).

  ``config.model`` is passed wholesale (nanodo's ``DoConfig(**c.model, ...)``):
  a new model hyperparameter is one field of ``TransformerConfig`` and one line
  in ``configs/default.py``. The data decides the vocabulary and the positions.
  A config saved before a field existed (e.g. ``head_dim``) lacks it and gets
  the dataclass default.
  """
  return TransformerConfig(
      **config.model,
      vocab_size=data.vocab_size(config.task, config.data.num_symbols,
                                 config.data.max_len),
      max_len=data.example_length(config.task, config.data.max_len,
                                  config.data.context_length),
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
  """True for the parameters weight decay applies to: the kernels of the
  Dense and DenseGeneral layers (leaf name ``kernel``), whatever their rank.

  Not the biases (the attention's ``[H, Dh]`` biases have rank 2, so a mask
  by rank would decay them), the LayerNorm scales and biases, the token
  embedding or the learned position embedding.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def make_optimizer(
    config: ml_collections.ConfigDict,
    schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """AdamW (decay per :func:`weight_decay_mask`) after global-norm clipping;
  its learning rate ``schedule`` (default :func:`learning_rate_schedule`)."""
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip_norm),
      optax.adamw(schedule or learning_rate_schedule(config), b2=config.adam_b2,
                  weight_decay=config.weight_decay, mask=weight_decay_mask),
  )


def run_rngs(config: ml_collections.ConfigDict) -> Array:
  """A run's two keys ``[2]``, both from ``config.seed``: parameter init
  (``[0]``) and dropout (``[1]``). A run's step-0 parameters are
  ``init_params(model, run_rngs(config)[0])``."""
  return jax.random.split(jax.random.key(config.seed))


def init_params(model: Transformer, rng: Array) -> Any:
  """Fresh parameters of ``model``."""
  tokens = jnp.ones((1, model.config.max_len), jnp.int32)
  return model.init(rng, tokens)["params"]


def create_train_state(config: ml_collections.ConfigDict, model: Transformer,
                       rng: Array,
                       tx: optax.GradientTransformation | None = None
                       ) -> TrainState:
  """Fresh parameters and optimizer state at step 0; ``tx`` defaults to
  :func:`make_optimizer` (pass one to get states whose trees compare equal:
  each optimizer made is a new object)."""
  state = TrainState.create(apply_fn=model.apply,
                            params=init_params(model, rng),
                            tx=tx or make_optimizer(config))
  # Its step an int32 as a restored state's (``create`` gives a weakly typed
  # 0), so that a run resumed in the same process reuses the train program.
  return state.replace(step=jnp.zeros((), jnp.int32))
