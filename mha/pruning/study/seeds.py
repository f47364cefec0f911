"""The study's models: the workdir's checkpoint and the other seeds.

The only module of the study that trains. For ``num_seeds > 1`` the study
trains the workdir's config with the next seeds under ``out/seeds/seed_<s>/``;
a seed already trained there is reused when its recorded config matches the
workdir's (seed and ``config_validation.RESUMABLE_KEYS`` but
``num_train_steps`` aside); otherwise the run is refused, or the seed
retrained with ``retrain_seeds``. Every seed is analysed at the step of the
workdir's checkpoint.
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

from mha import checkpoint as ckpt_lib
from mha.run import config_validation
from mha.run import interrupt
from mha import train
from mha.aliases import Log


def kept_steps(config: Any) -> list[int]:
  """The checkpoint steps a finished run of ``config`` keeps."""
  every, total = config.checkpoint_every_steps, config.num_train_steps
  steps = sorted({*range(every, total + 1, every), total})
  keep = config.max_checkpoints_to_keep
  return steps[-keep:] if keep and keep > 0 else steps


def check_step(first: ckpt_lib.LoadedCheckpoint, num_seeds: int) -> None:
  """Raises ValueError when the other seeds cannot be analysed at the step of
  the workdir's checkpoint ``first`` (a step their runs do not keep)."""
  steps = kept_steps(first.config)
  if num_seeds > 1 and first.step not in steps:
    raise ValueError(
        f"step {first.step}: the seeds this script trains keep steps "
        f"{', '.join(map(str, steps))}; pick one of them with --step or "
        "--num_seeds=1")


def _seed_config(first: ckpt_lib.LoadedCheckpoint, offset: int) -> Any:
  config = copy.deepcopy(first.config)
  config.seed = first.config.seed + offset
  return config


def seed_dir(out_dir: str, seed: int) -> str:
  """Where the study trains the model of ``seed``."""
  return os.path.join(out_dir, "seeds", f"seed_{seed}")


def seed_conflicts(first: ckpt_lib.LoadedCheckpoint, out_dir: str,
                   num_seeds: int) -> dict[str, list[str]]:
  """Seed directories under ``out_dir`` whose recorded config differs from
  the workdir's (seed aside, and the keys a resumed run may change,
  ``config_validation.RESUMABLE_KEYS``, but for ``num_train_steps``: a seed
  trained longer is another model at its end): directory -> differing
  keys."""
  out = {}
  for i in range(1, num_seeds):
    config = _seed_config(first, i)
    directory = seed_dir(out_dir, config.seed)
    saved = ckpt_lib.saved_config(directory) if os.path.isdir(
        directory) else None
    if saved is not None:
      keys = [c.split(" ", 1)[0] for c in
              config_validation.resume_conflicts(saved, config)]
      if saved.get("num_train_steps") != config.num_train_steps:
        keys.append("num_train_steps")
      if keys:
        out[directory] = keys
  return out


def _saved_steps(directory: str) -> list[int]:
  """The checkpoint steps in ``directory`` (none when it has none)."""
  if not os.path.isdir(ckpt_lib.checkpoint_dir(directory)):
    return []
  manager = ckpt_lib.make_manager(directory, read_only=True)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def check_seeds(first: ckpt_lib.LoadedCheckpoint, out_dir: str,
                num_seeds: int, retrain: bool) -> dict[str, list[str]]:
  """Checks that every seed can be analysed at ``first.step``; returns the
  seed directories to retrain (:func:`seed_conflicts`, with ``retrain``).

  Raises:
    ValueError: a step the seeds' runs do not keep; a seed directory
      trained with another config (without ``retrain``); a finished seed
      directory without a checkpoint of ``first.step``.
  """
  check_step(first, num_seeds)
  conflicts = seed_conflicts(first, out_dir, num_seeds)
  if conflicts and not retrain:
    directory, keys = next(iter(conflicts.items()))
    raise ValueError(
        f"{directory} was trained with another config (differs in "
        f"{', '.join(keys)}); delete it or pass --retrain_seeds")
  for i in range(1, num_seeds):
    directory = seed_dir(out_dir, first.config.seed + i)
    steps = [] if directory in conflicts else _saved_steps(directory)
    if (steps and steps[-1] >= first.config.num_train_steps
        and first.step not in steps):
      raise ValueError(
          f"{directory} has no checkpoint of step {first.step} (steps "
          f"saved: {', '.join(map(str, steps))}); delete it or pass another "
          "--step")
  return conflicts


def train_seed(config: Any, directory: str, what: str) -> None:
  """``train.train_and_evaluate(config, directory)``; a SIGINT or SIGTERM
  during it (the checkpoint of the steps done saved) becomes
  :class:`mha.run.interrupt.Interrupted`, which names ``what`` was
  training and where its checkpoint is."""
  try:
    train.train_and_evaluate(config, directory)
  except train.TrainingInterrupted as e:
    raise interrupt.Interrupted(
        e.signum, f"{what} stopped training at step {e.step}, its "
        f"checkpoint kept in {directory}") from None


def seed_models(first: ckpt_lib.LoadedCheckpoint, out_dir: str,
                num_seeds: int, log: Log = print, *,
                retrain: bool = False) -> list[ckpt_lib.LoadedCheckpoint]:
  """The workdir's checkpoint ``first``, then ``num_seeds - 1`` models of
  the same config trained with the next seeds under ``out_dir/seeds/``,
  each at ``first.step``. A seed directory is reused when its recorded
  config matches; one trained with another config is an error
  (ValueError, :func:`check_seeds`), or retrained from scratch with
  ``retrain``."""
  stale = check_seeds(first, out_dir, num_seeds, retrain)
  loaded = [first]
  for i in range(1, num_seeds):
    config = _seed_config(first, i)
    directory = seed_dir(out_dir, config.seed)
    if directory in stale:
      log(f"Retraining seed {config.seed}: {directory} was trained with "
          f"another config ({', '.join(stale[directory])})")
      shutil.rmtree(directory)
    steps = _saved_steps(directory)
    if steps and steps[-1] >= config.num_train_steps:
      log(f"Reusing seed {config.seed} from {directory}")
    else:
      log(f"Training seed {config.seed} in {directory} ...")
      train_seed(config, directory, f"seed {config.seed}")
    loaded.append(ckpt_lib.load_checkpoint(directory, first.step))
  return loaded


__all__ = ["kept_steps", "train_seed", "check_step", "seed_dir", "seed_conflicts",
           "check_seeds", "seed_models"]
