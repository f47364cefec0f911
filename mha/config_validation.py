"""Checks of what a user types: the run config, the workdir, resuming.

``train_and_evaluate`` calls these before it compiles anything or writes to the
workdir, so a mistake costs one clear line instead of a traceback minutes
later; the entry points turn a ``ConfigError`` into that line and exit code 2:

    train.py: error: model.d_model=30 is not divisible by model.num_heads=4

The model's positions are ``data.max_len`` (there is no separate model length),
so "a sequence longer than the model's positions" cannot be configured; a run
resumed with another ``data.max_len`` is refused by :func:`check_resume`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import ml_collections

from mha.data import TASKS
from mha.model import POSITIONAL_KINDS

# Every key of a run config and its type (a float field also takes an int).
FIELDS: dict[str, type] = {
    "task": str,
    "seed": int,
    "batch_size": int,
    "eval_batch_size": int,
    "num_train_steps": int,
    "learning_rate": float,
    "warmup_steps": int,
    "weight_decay": float,
    "adam_b2": float,
    "grad_clip_norm": float,
    "log_every_steps": int,
    "eval_every_steps": int,
    "checkpoint_every_steps": int,
    "max_checkpoints_to_keep": int,
    "model.num_layers": int,
    "model.num_heads": int,
    "model.d_model": int,
    "model.mlp_dim": int,
    "model.dropout_rate": float,
    "model.attention_dropout_rate": float,
    "model.pre_norm": bool,
    "model.positional": str,
    "mesh.data": int,
    "mesh.shard_params": bool,
    "data.num_symbols": int,
    "data.min_len": int,
    "data.max_len": int,
    "data.num_train_examples": int,
    "data.num_eval_examples": int,
    "data.seed": int,
    "data.data_dir": str,
}

# The keys a resumed run may change: none of them changes the model, the data
# or the optimizer state. (``num_train_steps`` stretches or shortens the cosine
# decay from the resumed step on; that is what continuing a run means. The
# mesh only lays the same arrays out on other devices: a checkpoint restores
# on any device count.)
RESUMABLE_KEYS: frozenset[str] = frozenset({
    "num_train_steps",
    "mesh.data",
    "mesh.shard_params",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "max_checkpoints_to_keep",
    "eval_batch_size",
    "data.data_dir",
})

_AT_LEAST_ONE = (
    "batch_size", "eval_batch_size", "num_train_steps", "log_every_steps",
    "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "model.num_layers", "model.num_heads", "model.d_model", "model.mlp_dim",
    "data.num_symbols", "data.min_len", "data.num_train_examples",
    "data.num_eval_examples")
_AT_LEAST_ZERO = ("warmup_steps", "data.seed")


class ConfigError(ValueError):
  """A config, workdir or command line that cannot run; the message says why."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"model": {"d_model": 32}}`` -> ``{"model.d_model": 32}``."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def _type_problem(key: str, value: Any, kind: type) -> str | None:
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  elif kind is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
  else:
    ok = isinstance(value, kind)
  return None if ok else (f"{key}={value!r} must be of type {kind.__name__}, "
                          f"not {type(value).__name__}")


def config_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Everything wrong with a run config, one phrase each (empty: it is fine)."""
  values = flatten(config.to_dict())
  problems = [f"unknown config key {key!r}" for key in values
              if key not in FIELDS]
  problems += [f"missing config key {key!r}" for key in FIELDS
               if key not in values]
  problems += filter(None, (_type_problem(key, values[key], kind)
                            for key, kind in FIELDS.items() if key in values))
  if problems:  # The range checks below need every field, of its type.
    return problems

  def value(key):
    return values[key]

  if value("task") not in TASKS:
    problems.append(f"task={value('task')!r} is not a task; the tasks are "
                    f"{', '.join(TASKS)}")
  problems += [f"{key}={value(key)} must be >= 1" for key in _AT_LEAST_ONE
               if value(key) < 1]
  problems += [f"{key}={value(key)} must be >= 0" for key in _AT_LEAST_ZERO
               if value(key) < 0]
  for key in ("learning_rate", "grad_clip_norm"):
    if not (math.isfinite(value(key)) and value(key) > 0):
      problems.append(f"{key}={value(key)} must be a positive number")
  if not (math.isfinite(value("weight_decay")) and value("weight_decay") >= 0):
    problems.append(f"weight_decay={value('weight_decay')} must be >= 0")
  if not 0 <= value("adam_b2") < 1:
    problems.append(f"adam_b2={value('adam_b2')} must be in [0, 1)")
  for key in ("model.dropout_rate", "model.attention_dropout_rate"):
    if not 0 <= value(key) < 1:
      problems.append(f"{key}={value(key)} must be in [0, 1)")
  heads, width = value("model.num_heads"), value("model.d_model")
  if heads >= 1 and width % heads:
    problems.append(f"model.d_model={width} is not divisible by "
                    f"model.num_heads={heads}")
  if value("model.positional") not in POSITIONAL_KINDS:
    problems.append(f"model.positional={value('model.positional')!r} is not "
                    f"one of {', '.join(POSITIONAL_KINDS)}")
  if value("data.min_len") > value("data.max_len"):
    problems.append(f"data.min_len={value('data.min_len')} is larger than "
                    f"data.max_len={value('data.max_len')}")
  if not value("data.data_dir"):
    problems.append("data.data_dir is empty")
  if value("mesh.data") != -1 and value("mesh.data") < 1:
    problems.append(f"mesh.data={value('mesh.data')} must be -1 (all devices) "
                    "or >= 1")
  return problems


def device_problems(config: ml_collections.ConfigDict,
                    num_devices: int) -> list[str]:
  """What keeps a valid ``config`` from running on ``num_devices`` devices
  (``jax.device_count()``, every process's), one phrase each."""
  problems = []
  data_size = config.mesh.data
  if data_size not in (-1, num_devices):
    problems.append(f"mesh.data={data_size} does not match the {num_devices} "
                    f"device{'s' * (num_devices != 1)} of this run; use -1 for "
                    "all of them")
  elif config.batch_size % num_devices:
    problems.append(f"batch_size={config.batch_size} is not divisible by the "
                    f"{num_devices} devices of the data axis; use a multiple "
                    f"of {num_devices}")
  return problems


def validate_devices(config: ml_collections.ConfigDict,
                     num_devices: int) -> None:
  """Raises ``ConfigError`` if ``config`` cannot run on ``num_devices``."""
  problems = device_problems(config, num_devices)
  if problems:
    raise ConfigError("; ".join(problems))


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` listing every problem of ``config``, if any."""
  problems = config_problems(config)
  if problems:
    raise ConfigError("; ".join(problems))


def check_workdir(workdir: str) -> None:
  """Raises ``ConfigError`` if ``workdir`` cannot be a run's directory."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"workdir {workdir} is an existing file, not a directory")


def resume_conflicts(saved: Mapping[str, Any],
                     config: ml_collections.ConfigDict) -> list[str]:
  """The keys, with both values, in which ``config`` may not differ from the
  ``saved`` config (as a dict) of the run it would resume."""
  old, new = flatten(saved), flatten(config.to_dict())
  missing = object()
  conflicts = []
  for key in sorted(old.keys() | new.keys()):
    a, b = old.get(key, missing), new.get(key, missing)
    if key not in RESUMABLE_KEYS and _comparable(a) != _comparable(b):
      show = lambda v: "<absent>" if v is missing else repr(v)
      conflicts.append(f"{key} (saved {show(a)}, now {show(b)})")
  return conflicts


def _comparable(value: Any) -> Any:
  # JSON turns tuples into lists.
  return list(value) if isinstance(value, tuple) else value


def check_resume(saved: Mapping[str, Any], config: ml_collections.ConfigDict,
                 workdir: str) -> None:
  """Raises ``ConfigError`` if resuming ``workdir`` with ``config`` would mix
  two runs: only ``RESUMABLE_KEYS`` may differ from the ``saved`` config."""
  conflicts = resume_conflicts(saved, config)
  if conflicts:
    raise ConfigError(
        f"workdir {workdir} holds a run with another config: "
        f"{'; '.join(conflicts)}. Only {', '.join(sorted(RESUMABLE_KEYS))} may "
        "change when a run resumes; start the new run in a new workdir")
