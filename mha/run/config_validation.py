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

import functools
import math
import os
from typing import Any, Mapping

import ml_collections

from configs import default
from mha.run import write_failures

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
    "compilation_cache_dir",
})

_AT_LEAST_ONE = (
    "batch_size", "eval_batch_size", "num_train_steps", "log_every_steps",
    "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "model.num_layers", "model.d_model", "model.mlp_dim", "data.num_symbols",
    "data.min_len", "data.num_train_examples", "data.num_eval_examples",
    "data.max_digits", "data.context_length", "data.num_pairs")
# ``seed`` draws the train batches' order with numpy, which takes no
# negative seed (and the initialisation with it too).
_AT_LEAST_ZERO = ("seed", "warmup_steps", "data.seed")


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


def declared_types(
    config: ml_collections.ConfigDict | None = None,
    prefix: str = "") -> dict[str, type]:
  """Every key of a run config and its type, read off ``default.get_config()``
  (the one place the fields are declared; a placeholder's declared type too).
  """
  config = default.get_config() if config is None else config
  types = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      types.update(declared_types(value, f"{prefix}{key}."))
    else:
      types[f"{prefix}{key}"] = config.get_type(key)
  return types


@functools.cache
def _optional_keys() -> frozenset[str]:
  """Keys whose default is a placeholder (None): a config saved before the
  key existed lacks it and means the default."""
  return frozenset(key for key, value in flatten(
      default.get_config().to_dict()).items() if value is None)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(key: str, value: Any, kind: type) -> str | None:
  if value is None and key in _optional_keys():
    return None
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  elif kind is int:
    # ``model.num_heads`` may also be one count per layer (a pruned model).
    ok = _is_int(value) or (key == "model.num_heads" and isinstance(
        value, (list, tuple)) and all(map(_is_int, value)))
  else:
    ok = isinstance(value, kind)
  return None if ok else (f"{key}={value!r} must be of type {kind.__name__}, "
                          f"not {type(value).__name__}")


def _head_problems(values: Mapping[str, Any]) -> list[str]:
  """What is wrong with ``model.num_heads`` and ``model.head_dim``."""
  heads, head_dim = values["model.num_heads"], values.get("model.head_dim")
  layers, width = values["model.num_layers"], values["model.d_model"]
  problems = []
  if head_dim is not None and head_dim < 1:
    problems.append(f"model.head_dim={head_dim} must be >= 1")
  if isinstance(heads, (list, tuple)):
    if len(heads) != layers:
      problems.append(f"model.num_heads={list(heads)} has {len(heads)} "
                      f"entries, not one per layer (model.num_layers={layers})")
    if any(h < 0 for h in heads):
      problems.append(f"model.num_heads={list(heads)} must be >= 0 each")
    if head_dim is None:
      problems.append(f"model.num_heads={list(heads)} is per layer: it needs "
                      "model.head_dim")
  elif heads < 1:
    problems.append(f"model.num_heads={heads} must be >= 1")
  elif head_dim is None and width % heads:
    problems.append(f"model.d_model={width} is not divisible by "
                    f"model.num_heads={heads}")
  kv_heads = values.get("model.num_kv_heads")
  if kv_heads is not None and kv_heads < 1:
    problems.append(f"model.num_kv_heads={kv_heads} must be >= 1")
  elif kv_heads is not None and any(
      h % kv_heads for h in (heads if isinstance(heads, (list, tuple))
                             else [heads])):
    problems.append(f"model.num_kv_heads={kv_heads} does not divide "
                    f"model.num_heads={heads}: each key/value head serves a "
                    "group of query heads")
  return problems


def config_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Everything wrong with a run config, one phrase each (empty: it is fine).

  The keys and their types are those of ``default.get_config()``; a key whose
  default is a placeholder may be absent (a config saved before it existed).
  """
  fields = declared_types()
  values = flatten(config.to_dict())
  problems = [f"unknown config key {key!r}" for key in values
              if key not in fields]
  problems += [f"missing config key {key!r}" for key in fields
               if key not in values and key not in _optional_keys()]
  problems += filter(None, (_type_problem(key, values[key], kind)
                            for key, kind in fields.items() if key in values))
  if problems:  # The range checks below need every field, of its type.
    return problems
  return _range_problems(values)


def _range_problems(values: Mapping[str, Any]) -> list[str]:
  """The values out of range of a config whose every field has its type."""
  # Imported here: this module is imported by command lines before JAX
  # (mha.data imports TFDS, mha.model Flax).
  from mha.data import CAUSAL_TASKS, MAX_WORD_LEN, TASKS, causal_problems  # pylint: disable=import-outside-toplevel
  from mha.model import DTYPES, POSITIONAL_KINDS  # pylint: disable=import-outside-toplevel

  def value(key):
    return values[key]

  problems = []
  if value("task") not in TASKS + CAUSAL_TASKS:
    problems.append(f"task={value('task')!r} is not a task; the tasks are "
                    f"{', '.join(TASKS + CAUSAL_TASKS)}")
  problems += [f"{key}={value(key)} must be >= 1" for key in _AT_LEAST_ONE
               if value(key) < 1]
  problems += [f"{key}={value(key)} must be >= 0" for key in _AT_LEAST_ZERO
               if value(key) < 0]
  # jax.random.key takes 32 bits here: 2**32 would be seed 0 again (and
  # 2**63 an OverflowError).
  if value("seed") >= 2 ** 32:
    problems.append(f"seed={value('seed')} must be < 2**32 = {2 ** 32}")
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
  problems += _head_problems(values)
  if value("model.causal") and value("task") not in CAUSAL_TASKS:
    problems.append(
        f"model.causal=True cannot learn task={value('task')!r}: it needs "
        "bidirectional attention (a causal model takes a next-token task: "
        f"{', '.join(sorted(CAUSAL_TASKS)) or 'none yet'})")
  elif not value("model.causal") and value("task") in CAUSAL_TASKS:
    problems.append(
        f"task={value('task')!r} is a next-token task: it needs "
        "model.causal=True (an encoder would read the token it predicts)")
  if value("model.positional") not in POSITIONAL_KINDS:
    problems.append(f"model.positional={value('model.positional')!r} is not "
                    f"one of {', '.join(POSITIONAL_KINDS)}")
  if value("model.dtype") not in DTYPES:
    problems.append(f"model.dtype={value('model.dtype')!r} is not one of "
                    f"{', '.join(DTYPES)}")
  if value("data.min_len") > value("data.max_len"):
    problems.append(f"data.min_len={value('data.min_len')} is larger than "
                    f"data.max_len={value('data.max_len')}")
  if value("task") == "spell" and value("data.max_len") < (
      MAX_WORD_LEN * value("data.max_digits")):
    problems.append(
        f"data.max_len={value('data.max_len')} cannot hold the longest "
        f"spelling of data.max_digits={value('data.max_digits')} digits "
        f"({MAX_WORD_LEN * value('data.max_digits')} letters)")
  if not problems:  # A causal task's fields, each >= 1 by now.
    problems += causal_problems(
        value("task"), context_length=value("data.context_length"),
        num_pairs=value("data.num_pairs"),
        num_symbols=value("data.num_symbols"))
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


# What a run writes in its workdir, each a file (True) or a folder (False):
# one of the wrong kind there would fail the run only once it has trained.
WORKDIR_ENTRIES: dict[str, bool] = {
    "config.json": True,
    "metrics.jsonl": True,
    "checkpoints": False,
    "damaged_checkpoints": False,
    "run.lock": True,  # mha.run.workdir_lock's
}


def check_workdir(workdir: str | os.PathLike) -> None:
  """Raises ``ConfigError`` if ``workdir`` cannot be a run's directory: an
  empty path (it would be the current directory), an existing file, a path
  through a file (``a_file/run``), or a workdir whose ``config.json`` or
  ``metrics.jsonl`` is a folder, or whose ``checkpoints`` is a file
  (:data:`WORKDIR_ENTRIES`). Reads only; what cannot be known without
  writing (a read-only file system) is found when the workdir is locked
  (``mha.run.workdir_lock``), still before anything is written."""
  if not os.fspath(workdir):
    raise ConfigError('the workdir path is empty ("" would be the current '
                      'folder); name a folder, "." for the current one')
  workdir = os.path.abspath(os.path.expanduser(os.fspath(workdir)))
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"workdir {workdir} is an existing file, not a directory")
  parent = write_failures.nearest_existing(os.path.dirname(workdir))
  if not os.path.isdir(parent):
    raise ConfigError(f"cannot use {workdir}: {parent} is a file, not a "
                      "folder")
  for name, is_file in WORKDIR_ENTRIES.items():
    path = os.path.join(workdir, name)
    if not os.path.lexists(path) or (
        os.path.isfile(path) if is_file else os.path.isdir(path)):
      continue
    kind = ("a broken link" if not os.path.exists(path)
            else "a folder" if os.path.isdir(path)
            else "a file" if os.path.isfile(path) else "a special file")
    raise ConfigError(f"{path} is {kind}, not the "
                      f"{'file' if is_file else 'folder'} a run writes there; "
                      "move it away or use another workdir")


def resume_conflicts(saved: Mapping[str, Any],
                     config: ml_collections.ConfigDict) -> list[str]:
  """The keys, with both values, in which ``config`` may not differ from the
  ``saved`` config (as a dict) of the run it would resume.

  A key absent from one side (a config saved before the key existed) counts
  as its ``default.get_config()`` value.
  """
  old, new = flatten(saved), flatten(config.to_dict())
  defaults = flatten(default.get_config().to_dict())
  missing = object()
  conflicts = []
  for key in sorted(old.keys() | new.keys()):
    a = old.get(key, defaults.get(key, missing))
    b = new.get(key, defaults.get(key, missing))
    if key == "init_from" and isinstance(a, str) and isinstance(b, str):
      # The same folder however it is written (relative, ~, a link).
      a, b = _real_path(a), _real_path(b)
    if key not in RESUMABLE_KEYS and _comparable(a) != _comparable(b):
      show = lambda v: "<absent>" if v is missing else repr(v)
      conflicts.append(f"{key} (saved {show(a)}, now {show(b)})")
  return conflicts


def _real_path(path: str) -> str:
  return os.path.realpath(os.path.expanduser(path))


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
