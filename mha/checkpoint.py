"""Orbax checkpoints of a training run, and loading them from a notebook.

A checkpoint of step ``s`` (``s`` optimizer updates done) lives in
``workdir/checkpoints/<s>/`` and holds two items:

* ``state``: the train state pytree (``step``, ``params``, ``opt_state``);
* ``config``: the run's ml_collections config, as JSON.

The batch order is a pure function of ``(seed, step)`` (see
:func:`mha.data.train_batch`), so the step is the whole data position.

    ckpt = mha.load_checkpoint("runs/reverse")
    logits, attention = ckpt.model.apply({"params": ckpt.params}, tokens)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from mha.model import Transformer, TransformerConfig

CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(workdir: str | os.PathLike) -> str:
  """The folder holding a workdir's step folders."""
  return os.path.join(os.path.abspath(os.path.expanduser(workdir)),
                      CHECKPOINT_DIR)


def make_manager(workdir: str | os.PathLike, *, max_to_keep: int | None = None,
                 read_only: bool = False) -> ocp.CheckpointManager:
  """An orbax CheckpointManager for ``workdir/checkpoints``.

  Saves are asynchronous; call ``wait_until_finished()`` before exiting.
  """
  # Loading only: no directory creation and no clean-up of others' files
  # (orbax's own read_only flag warns on every load).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=not read_only,
      cleanup_tmp_directories=not read_only,
  )
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                               item_names=("state", "config"))


def save(manager: ocp.CheckpointManager, step: int, state: Any,
         config: ml_collections.ConfigDict) -> None:
  """Saves the train state and the config at ``step`` (asynchronously)."""
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      config=ocp.args.JsonSave(config.to_dict()),
  ))


def restore_state(manager: ocp.CheckpointManager, step: int,
                  abstract_state: Any) -> Any:
  """Restores the train state of ``step`` into the structure, shapes and
  shardings of ``abstract_state`` (e.g. from ``jax.eval_shape``)."""
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state)))
  return restored["state"]


def restore_config(manager: ocp.CheckpointManager,
                   step: int) -> ml_collections.ConfigDict:
  """The config saved with ``step``, locked."""
  restored = manager.restore(step, args=ocp.args.Composite(
      config=ocp.args.JsonRestore()))
  config = ml_collections.ConfigDict(restored["config"])
  config.lock()
  return config


def config_to_json(config: ml_collections.ConfigDict) -> str:
  """The config as indented JSON (what ``workdir/config.json`` holds)."""
  return json.dumps(config.to_dict(), indent=2, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
  """A trained model, ready to apply.

  Attributes:
    config: the run's config (ml_collections, locked).
    model: the ``Transformer`` module.
    params: its parameters (``model.apply({"params": params}, tokens)``).
    step: the training step of the checkpoint.
  """

  config: ml_collections.ConfigDict
  model: Transformer
  params: Any
  step: int

  @property
  def model_config(self) -> TransformerConfig:
    """The model's static hyperparameters."""
    return self.model.config


def load_checkpoint(workdir: str | os.PathLike,
                    step: int | None = None) -> LoadedCheckpoint:
  """Loads a run's config and parameters; the latest step unless ``step``.

  Nothing but the workdir is needed: the config saved in the checkpoint
  rebuilds the model.

  Raises:
    FileNotFoundError: the workdir has no checkpoint, or not ``step``.
  """
  from mha import train  # Deferred: train imports this module.

  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints in {workdir} ({directory} does "
                            "not exist)")
  manager = make_manager(workdir, read_only=True)
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f"no checkpoints in {directory}")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise FileNotFoundError(
        f"no checkpoint of step {step} in {directory}; steps saved: "
        f"{', '.join(map(str, steps))}")
  config = restore_config(manager, step)
  model = train.make_model(config)
  abstract = jax.eval_shape(
      lambda: train.create_train_state(config, model, jax.random.key(0)))
  state = restore_state(manager, step, abstract)
  manager.close()
  return LoadedCheckpoint(config=config, model=model, params=state.params,
                          step=int(step))
