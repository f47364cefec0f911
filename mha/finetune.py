"""Starting a run from another run's checkpoint: ``config.init_from``.

    python train.py --workdir runs/ft --config.init_from=runs/reverse_half

The new run starts from the parameters of the newest intact checkpoint of
``init_from`` (a pruned model written by ``scripts/prune_heads.py
--save_pruned`` included: its per-layer head counts), with a fresh optimizer
at step 0 and the learning-rate schedule of its own config. The model config
is the source's: the given ``config.model`` must equal it key by key, except
that the given ``model.num_heads`` (an int) may be the model the source was
pruned from (every per-layer count at most it, the same per-head width).
Any other difference, or a task and data whose vocabulary or positions give
the parameters other shapes, is a ``ConfigError`` (one line, exit 2 from
``train.py``), raised before anything is compiled or written.

Resuming the new run is as usual (the same command): once its workdir holds
a run started from ``init_from``, its own saved model config is the source
and ``init_from`` is not read again.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import ml_collections

from mha import build
from mha import checkpoint as ckpt_lib
from mha.run import config_validation
from mha.run import sharding as sharding_lib

ConfigError = config_validation.ConfigError


def _absolute(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path))


def _source_config(init_from: str) -> ml_collections.ConfigDict:
  """The config of the newest readable checkpoint of ``init_from``."""
  if not os.path.isdir(ckpt_lib.checkpoint_dir(init_from)):
    raise ConfigError(f"config.init_from={init_from}: no checkpoints there")
  saved = ckpt_lib.saved_config(init_from)
  if saved is None:
    raise ConfigError(f"config.init_from={init_from}: no readable checkpoint")
  return ckpt_lib.complete_config(saved)


def _pruned_from(given: Mapping[str, Any], source: Mapping[str, Any]) -> bool:
  """Whether the source's per-layer ``num_heads`` is a pruning of the given
  int ``num_heads`` (same layers, counts at most it, same head width)."""
  heads, counts = given["num_heads"], source["num_heads"]
  if not isinstance(heads, int) or not isinstance(counts, (list, tuple)):
    return False
  width = given["head_dim"] or given["d_model"] // max(heads, 1)
  return (len(counts) == given["num_layers"] and all(c <= heads for c in counts)
          and source["head_dim"] == width)


def model_conflicts(given: Mapping[str, Any],
                    source: Mapping[str, Any]) -> list[str]:
  """The ``model.*`` keys in which the ``given`` model config (a dict) may
  not differ from the ``source``'s, with both values; empty when it is the
  source's model, or the model the source was pruned from."""
  pruned = _pruned_from(given, source)
  conflicts = []
  for key in sorted(given.keys() | source.keys()):
    a, b = given.get(key), source.get(key)
    if isinstance(a, tuple):
      a = list(a)
    if isinstance(b, tuple):
      b = list(b)
    if a != b and not (pruned and key in ("num_heads", "head_dim")):
      conflicts.append(f"model.{key} (here {a!r}, there {b!r})")
  return conflicts


def _resumed_source(config: ml_collections.ConfigDict,
                    workdir: str | None) -> ml_collections.ConfigDict | None:
  """The saved config of the run in ``workdir`` when it was started from
  the same ``init_from`` (a resume), else None."""
  if workdir is None:
    return None
  saved = ckpt_lib.saved_config(workdir)
  if saved is None or saved.get("init_from") is None or _absolute(
      saved["init_from"]) != _absolute(config.init_from):
    return None
  return ckpt_lib.complete_config(saved)


def resolve_config(config: ml_collections.ConfigDict,
                   workdir: str | os.PathLike | None = None
                   ) -> ml_collections.ConfigDict:
  """``config`` with the model config of ``config.init_from`` (a copy,
  locked); ``config`` itself when ``init_from`` is unset.

  ``workdir``: the new run's; when it already holds a run started from the
  same ``init_from``, that run's saved model is the source (a resume needs
  nothing from ``init_from``).

  Raises:
    ConfigError: an invalid config; ``init_from`` is the workdir itself or
      holds no readable checkpoint; a model key that differs
      (:func:`model_conflicts`); a task or data giving the source's
      parameters other shapes.
  """
  config_validation.validate_config(config)
  if config.init_from is None:
    return config
  init_from = config.init_from
  if workdir is not None and _absolute(init_from) == _absolute(
      os.fspath(workdir)):
    raise ConfigError(f"config.init_from={init_from} is the workdir itself")
  source = _resumed_source(config, None if workdir is None else
                           os.fspath(workdir)) or _source_config(init_from)
  conflicts = model_conflicts(config.model.to_dict(), source.model.to_dict())
  if conflicts:
    raise ConfigError(f"config.init_from={init_from}: the model differs from "
                      f"the one there in {'; '.join(conflicts)}")
  values = config.to_dict()
  values["model"] = source.model.to_dict()
  resolved = ml_collections.ConfigDict(values)
  resolved.lock()
  mine, theirs = build.model_config(resolved), build.model_config(source)
  shapes = [f"{name} {getattr(mine, name)} (there {getattr(theirs, name)})"
            for name in ("vocab_size", "max_len")
            if getattr(mine, name) != getattr(theirs, name)]
  if shapes:
    raise ConfigError(f"config.init_from={init_from}: this task and data "
                      f"give the model {', '.join(shapes)}")
  return resolved


def initial_state(config: ml_collections.ConfigDict,
                  state: build.TrainState,
                  state_shardings: Any) -> build.TrainState:
  """The train state at step 0 with the parameters of the newest intact
  checkpoint of ``config.init_from`` and a fresh optimizer state: ``state``
  (a freshly created one, ``build.create_train_state``, so the same
  optimizer) with its parameters replaced, laid out in ``state_shardings``."""
  loaded = ckpt_lib.load_checkpoint(config.init_from)
  if sharding_lib.is_main_process():
    print(f"Starting from the parameters of {_absolute(config.init_from)} "
          f"(step {loaded.step}); fresh optimizer at step 0", flush=True)
  params = jax.device_put(loaded.params, state_shardings.params)
  opt_state = jax.jit(state.tx.init,
                      out_shardings=state_shardings.opt_state)(params)
  return state.replace(params=params, opt_state=opt_state)


__all__ = ["model_conflicts", "resolve_config", "initial_state"]
