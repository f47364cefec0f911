"""Pruned models saved as regular workdirs.

A model whose heads were physically removed (:func:`mha.pruning.prune_heads`)
is an ordinary :class:`mha.model.Transformer` with per-layer head counts. This
module writes it as a training run would: an orbax checkpoint in
``out/checkpoints/<step>/`` (the ``state`` and ``config`` items of
:mod:`mha.checkpoint`) and ``out/config.json``, so that
``mha.load_checkpoint(out)`` and ``python eval.py --workdir out`` work on it.

* The config is the source run's, with ``model.num_heads`` a list of per-layer
  head counts (0 for a layer that lost every head) and ``model.head_dim`` set.
* The state is the source step's, heads sliced out of the parameters *and* out
  of the optimizer's moments (they have the parameters' structure), so the
  step, the learning-rate schedule and Adam's statistics carry on.
* ``out/pruned_from.json`` records where it came from: the source workdir and
  step, the removed ``[layer, head]`` pairs and how they were chosen. It is
  also what makes ``out`` safe to overwrite: a non-empty ``out`` is replaced
  only when this file names the same source workdir. ``out`` is replaced
  whole, so it is never the current directory, the source or a folder
  holding either, nor inside a run's ``checkpoints/`` (a resume of that run
  would delete it); a new ``out`` gets the permissions ``os.makedirs``
  gives a folder (:func:`check_output_dir`).
* What ``scripts/prune_heads.py --save_pruned`` decides is decided here, so
  that it is tested without a process: :func:`check_request` (the flags, and
  whether ``out`` may be written), :func:`check_order` (an order that needs
  every subset of heads, refused before any data is loaded) and
  :func:`heads_of_order` (the heads ``--prune_fraction`` of ``--order``
  removes, measured on validation as the study does).

    ckpt = mha.load_checkpoint("runs/reverse")
    save_pruned(ckpt, [(0, 1), (1, 3)], "runs/reverse_pruned",
                source="runs/reverse")
    pruned = mha.load_checkpoint("runs/reverse_pruned")
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from typing import Any, Mapping, Sequence

import jax
import ml_collections
import numpy as np

from mha import build
from mha import checkpoint as ckpt_lib
from mha.run import cli
from mha.run import config_validation
from mha import data
from mha import head_masks
from mha.run import workdir_lock
from mha.run import write_failures
from mha.aliases import HeadSpec
from mha.model import Transformer, TransformerConfig
from mha.pruning import core
from mha.pruning import orderings
from mha.pruning import oracle
from mha.run import arguments

PROVENANCE_FILE = "pruned_from.json"
#: What ``--order`` takes: every ordering of the study but ``random``, and
#: ``oracle`` (the best subset on validation).
ORDERS = tuple(k for k in orderings.ORDERINGS
               if k != "random" and k not in orderings.KV_SCORES) + ("oracle",)
#: The orders that evaluate every subset of heads (at most
#: ``--oracle_max_heads`` heads).
SUBSET_ORDERS = ("shapley", "oracle")


# --------------------------------------------------------------------------
# Where a pruned model may be written.
# --------------------------------------------------------------------------


def _real(path: str | os.PathLike) -> str:
  return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _within(path: str, folder: str) -> bool:
  """Whether the real path ``path`` is ``folder`` or lies inside it."""
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _current_dir() -> str | None:
  try:
    return os.path.realpath(os.getcwd())
  except OSError:  # The current directory was deleted.
    return None


def _is_run_config(path: str) -> bool:
  """Whether ``path`` is a run's ``config.json`` (a JSON object with the
  ``model`` and ``data`` sections every run config has)."""
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(config, dict) and {"model", "data"} <= set(config)


def run_checkpoints_of(path: str | os.PathLike) -> str | None:
  """The checkpoints folder of a run that ``path`` is or lies inside (a
  folder named ``checkpoints`` beside a run's ``config.json``), or None. A
  resume of that run deletes what it does not know there."""
  probe = _real(path)
  while True:
    parent = os.path.dirname(probe)
    if (os.path.basename(probe) == ckpt_lib.CHECKPOINT_DIR
        and _is_run_config(os.path.join(parent, "config.json"))):
      return probe
    if parent == probe:
      return None
    probe = parent


def check_writable_target(path: str | os.PathLike | None, flag: str, *,
                          replaced: bool = False) -> str:
  """Checks a folder the user named with ``flag`` to write into; writes
  nothing. Returns its real path.

  Args:
    path: the folder (it need not exist).
    flag: the flag that named it, for the messages.
    replaced: the folder is written beside it and moved into its place
      (its parent must take writes), not written into.

  Raises:
    config_validation.ConfigError: an empty value; a folder inside a run's
      checkpoints (:func:`run_checkpoints_of`); a file.
    workdir_lock.WorkdirUnusableError: a file in the way of the path; the
      folder (or, when missing, the nearest folder above it) cannot be
      written (no permission, a read-only file system).
  """
  if path is None or not os.fspath(path).strip():
    raise config_validation.ConfigError(f"{flag} is empty; name a folder")
  real = _real(path)
  checkpoints = run_checkpoints_of(real)
  if checkpoints is not None:
    where = ("is the checkpoints folder" if real == checkpoints
             else "is inside the checkpoints")
    raise config_validation.ConfigError(
        f"{flag} {real} {where} of the run in {os.path.dirname(checkpoints)}"
        f", which a resume of that run would delete; choose a folder outside "
        f"{checkpoints}")
  if os.path.lexists(real) and not os.path.isdir(real):
    raise config_validation.ConfigError(
        f"{flag} {real} exists and is not a directory")
  probe = write_failures.nearest_existing(
      os.path.dirname(real) if replaced else real)
  if not os.path.isdir(probe):
    raise workdir_lock.WorkdirUnusableError(
        f"cannot use {flag} {real}: {probe} is a file, not a folder")
  if not os.access(probe, os.W_OK | os.X_OK):
    readonly = False
    try:
      readonly = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
      pass
    code = errno.EROFS if readonly else errno.EACCES
    raise workdir_lock.WorkdirUnusableError(
        f"cannot use {flag} {real}: " + workdir_lock.unusable_reason(
            OSError(code, os.strerror(code), probe)))
  return real


def read_provenance(out: str | os.PathLike) -> dict[str, Any] | None:
  """The ``pruned_from.json`` of ``out``, or None when it has none (or it is
  not readable JSON)."""
  path = os.path.join(out, PROVENANCE_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def check_request(out: str | os.PathLike | None, source: str | os.PathLike,
                  *, remove_heads: str, prune_fraction: float | None,
                  order: str | None
                  ) -> tuple[list[tuple[int, int]], str | None]:
  """Checks the export flags of ``scripts/prune_heads.py``; writes nothing.

  Args:
    out: ``--save_pruned`` (None when not given).
    source: ``--workdir``.
    remove_heads: ``--remove_heads`` (``""`` when not given).
    prune_fraction: ``--prune_fraction`` (None when not given).
    order: ``--order`` (None when not given).

  Returns:
    The heads of ``--remove_heads`` and None, or no heads and the order
    (one of :data:`ORDERS`) to take ``--prune_fraction`` of.

  Raises:
    cli.UsageError: an inconsistent combination of the flags, a fraction
      outside [0, 1], an unknown order, unreadable ``--remove_heads``.
    config_validation.ConfigError: a pruned model of ``source`` may not go
      to ``out`` (:func:`check_output_dir`).
  """
  if out is None:
    raise cli.UsageError("--prune_fraction and --order need --save_pruned")
  if bool(remove_heads) == (prune_fraction is not None):
    raise cli.UsageError("--save_pruned needs exactly one of --remove_heads "
                         "and --prune_fraction")
  heads: list[tuple[int, int]] = []
  if remove_heads:
    if order is not None:
      raise cli.UsageError("--order goes with --prune_fraction, not "
                           "--remove_heads")
    try:
      heads = head_masks.parse_heads(remove_heads)
    except ValueError as e:
      raise cli.UsageError(f"--remove_heads: {e}") from None
  else:
    if not 0.0 <= prune_fraction <= 1.0:
      raise cli.UsageError(
          f"--prune_fraction must be in [0, 1], got {prune_fraction}")
    if order is None:
      raise cli.UsageError("--prune_fraction needs --order, one of: "
                           + ", ".join(ORDERS))
    if order not in ORDERS:
      raise cli.UsageError(f"--order {order!r} is not one of: "
                           + ", ".join(ORDERS))
  check_output_dir(out, source)
  return heads, order


def check_output_dir(out: str | os.PathLike,
                     source: str | os.PathLike) -> None:
  """Raises ``config_validation.ConfigError`` (a ValueError) unless a
  pruned model of ``source`` may go to ``out``.

  Allowed: ``out`` does not exist (and its nearest existing folder takes
  writes), is an empty directory, or is a pruned model of the same source
  workdir (its ``pruned_from.json`` names it; that model is replaced).
  Refused: an empty value, a file (or a file in the way of the path), a
  folder that cannot be written, a folder inside a run's checkpoints, the
  source workdir or a folder holding it, the current directory or a folder
  holding it (``out`` is replaced whole), a pruned model trained in place
  since it was saved (a run's lock or metrics, later checkpoints), anything
  else that is not empty.
  Writes nothing.
  """
  flag = "--save_pruned"
  if out is None or not os.fspath(out).strip():
    raise config_validation.ConfigError(
        f"{flag} is empty; name a new folder for the pruned model")
  out, source = _real(out), _real(source)
  if out == source:
    raise config_validation.ConfigError(
        f"{flag} {out} is the source workdir itself")
  if _within(source, out):
    raise config_validation.ConfigError(
        f"{flag} {out} holds the source workdir {source}; it would be "
        "replaced")
  cwd = _current_dir()
  if cwd is not None and _within(cwd, out):
    raise config_validation.ConfigError(
        f"{flag} {out} " + ("is the current directory" if cwd == out else
                            f"holds the current directory {cwd}")
        + "; it would be replaced whole: name a folder elsewhere")
  check_writable_target(out, flag, replaced=True)
  if not os.path.exists(out) or not os.listdir(out):
    return
  provenance = read_provenance(out)
  if provenance is None:
    raise config_validation.ConfigError(
        f"{flag} {out} is not empty and is not a pruned model (no "
        f"{PROVENANCE_FILE}); refusing to overwrite it")
  if _real(provenance.get("source_workdir", "")) != source:
    raise config_validation.ConfigError(
        f"{flag} {out} holds a pruned model of another workdir "
        f"({provenance.get('source_workdir')}); refusing to overwrite it")
  # Replaced only as it was saved (eval.py's eval/ aside, which it makes
  # again): a model trained in place since (its lock, metrics, later
  # checkpoints) is someone's work, and a run may be writing there now.
  extra = sorted(set(os.listdir(out)) - set(_REPLACEABLE))
  checkpoints = os.path.join(out, "checkpoints")
  later = sorted((name for name in os.listdir(checkpoints)
                  if name != str(provenance.get("source_step"))),
                 key=lambda name: (len(name), name)) if os.path.isdir(
                     checkpoints) else []
  if later:
    extra.append(f"checkpoints/{', '.join(later)}")
  if extra:
    raise config_validation.ConfigError(
        f"{flag} {out} holds a pruned model trained or changed since it was "
        f"saved ({', '.join(extra)}); refusing to replace it: name another "
        "folder, or delete it first")


# What may be in a pruned model's folder that save_pruned replaces: what it
# writes, and eval.py's outputs.
_REPLACEABLE = ("checkpoints", "config.json", PROVENANCE_FILE, "eval")


# --------------------------------------------------------------------------
# The pruned config and state.
# --------------------------------------------------------------------------


def pruned_run_config(config: ml_collections.ConfigDict,
                      model_config: TransformerConfig
                      ) -> ml_collections.ConfigDict:
  """The run config of a pruned model: ``config`` with ``model.num_heads``
  the per-layer counts of ``model_config`` and ``model.head_dim`` set."""
  values = config.to_dict()
  values["model"]["num_heads"] = [int(h) for h in model_config.heads_per_layer]
  values["model"]["head_dim"] = int(model_config.resolved_head_dim)
  new = ml_collections.ConfigDict(values)
  new.lock()
  return new


def _prune_optimizer_state(opt_state: Any, params: Any,
                           config: TransformerConfig,
                           heads: HeadSpec) -> Any:
  """Slices ``heads`` out of every subtree of ``opt_state`` shaped like the
  parameters (Adam's moments); counts and empty states pass unchanged."""
  structure = jax.tree.structure(params)

  def is_params_like(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node) == set(params) and (
        jax.tree.structure(node) == structure)

  def prune(node: Any) -> Any:
    if is_params_like(node):
      return core.prune_heads(node, config, heads)[0]
    return node

  return jax.tree.map(prune, opt_state, is_leaf=is_params_like)


def prune_train_state(state: build.TrainState, config: TransformerConfig,
                      heads: HeadSpec
                      ) -> tuple[build.TrainState, TransformerConfig]:
  """The train state with ``heads`` removed from the parameters and the
  optimizer's moments (same step); and the pruned model's config."""
  params, pruned_config = core.prune_heads(state.params, config, heads)
  opt_state = _prune_optimizer_state(state.opt_state, state.params, config,
                                     heads)
  return state.replace(params=params, opt_state=opt_state), pruned_config


def read_train_state(workdir: str | os.PathLike,
                     ckpt: ckpt_lib.LoadedCheckpoint) -> build.TrainState:
  """The whole train state (optimizer included) of the step ``ckpt`` was
  loaded from, read again from ``workdir``."""
  manager = ckpt_lib.make_manager(workdir, read_only=True)
  try:
    return ckpt_lib.read_state(manager, ckpt.step,
                              ckpt_lib.abstract_train_state(ckpt.config))
  finally:
    manager.close()


def _matched_to(state: build.TrainState,
                config: ml_collections.ConfigDict) -> build.TrainState:
  """``state`` with the pruned model's ``apply_fn`` and ``tx``; ValueError
  unless its arrays have exactly the structure and shapes that a load of
  ``config`` restores into (else the saved model would not load)."""
  expected = ckpt_lib.abstract_train_state(config)
  state = state.replace(apply_fn=expected.apply_fn, tx=expected.tx)
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  if (jax.tree.structure(expected) != jax.tree.structure(state)
      or shapes(expected) != shapes(state)):
    raise ValueError("the pruned train state does not match the structure of "
                     "the pruned config's model (a bug in mha.pruning.export)")
  return state


# --------------------------------------------------------------------------
# Saving.
# --------------------------------------------------------------------------


def _count(config: TransformerConfig, fraction: float) -> int:
  """``round(fraction * N)``, ``N`` the existing heads; ValueError unless
  ``fraction`` is in [0, 1]."""
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"--prune_fraction must be in [0, 1], got {fraction}")
  return int(round(fraction * int(head_masks.existing_heads(config).sum())))


def heads_for_fraction(config: TransformerConfig, order: Sequence[int],
                       fraction: float) -> list[tuple[int, int]]:
  """The first ``round(fraction * N)`` heads of ``order`` (flat indices, least
  important first) as ``(layer, head)`` pairs, ``N`` the existing heads."""
  count = _count(config, fraction)
  return head_masks.flat_to_pairs(config, np.asarray(order, np.int64)[:count])


def check_order(config: TransformerConfig, order: str, *,
                oracle_max_heads: int) -> None:
  """Raises ``cli.UsageError`` when ``order`` evaluates every subset of
  heads (:data:`SUBSET_ORDERS`) and the model has more than
  ``oracle_max_heads`` heads. Cheap: call it before any data is
  loaded."""
  if order in SUBSET_ORDERS and not oracle.oracle_applies(config,
                                                          oracle_max_heads):
    raise cli.UsageError(
        f"--order {order} evaluates all 2^{oracle.num_heads(config)} subsets "
        f"of heads: more than --oracle_max_heads={oracle_max_heads} "
        "heads")


def heads_of_order(model: Transformer, params: Any, validation: data.Split,
                   order: str, fraction: float, *, batch_size: int,
                   oracle_max_heads: int) -> list[tuple[int, int]]:
  """The heads that ``--prune_fraction fraction --order order`` removes.

  For an ordering of the study: its ``round(fraction * N)`` least important
  heads, measured on ``validation`` as the study measures them (only that
  ordering is computed). For ``oracle``: the best subset with that many
  heads removed on ``validation`` (every subset evaluated).

  Raises:
    cli.UsageError: see :func:`check_order`.
    ValueError: ``fraction`` outside [0, 1].
  """
  arguments.check_count("batch_size", batch_size)
  arguments.check_count("oracle_max_heads", oracle_max_heads)
  config = model.config
  check_order(config, order, oracle_max_heads=oracle_max_heads)
  count = _count(config, fraction)
  if order == "oracle":
    flat = oracle.oracle_removals(model, params, validation,
                                  batch_size=batch_size)[count][0]
    return head_masks.flat_to_pairs(config, flat)
  orders = orderings.compute_orders(
      model, params, validation, batch_size=batch_size,
      oracle_max_heads=oracle_max_heads,
      reestimate=order == "gradient_iterative", names=[order])
  return heads_for_fraction(config, orders[order], fraction)


def _write(out: str, step: int, state: Any,
           config: ml_collections.ConfigDict,
           provenance: Mapping[str, Any]) -> None:
  manager = ckpt_lib.make_manager(out)
  try:
    ckpt_lib.save(manager, step, state, config)
    manager.wait_until_finished()
  finally:
    manager.close()
  with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
    f.write(ckpt_lib.config_to_json(config) + "\n")
  with open(os.path.join(out, PROVENANCE_FILE), "w", encoding="utf-8") as f:
    json.dump(provenance, f, indent=2)
    f.write("\n")


def _sorted_pairs(heads: HeadSpec) -> list[list[int]]:
  if isinstance(heads, Mapping):
    heads = [(layer, h) for layer, hs in heads.items() for h in hs]
  return [list(pair) for pair in sorted({(int(l), int(h)) for l, h in heads})]


def _make_staging(out: str) -> str:
  """A new, empty folder beside ``out`` to write the model into, made as
  ``os.makedirs`` makes folders (mode ``0o777`` less the umask), unlike
  ``tempfile.mkdtemp``'s ``0o700``: it becomes ``out``."""
  parent, name = os.path.dirname(out), os.path.basename(out)
  for _ in range(100):
    staging = os.path.join(parent, f".{name}.{secrets.token_hex(4)}")
    try:
      os.mkdir(staging, 0o777)
      return staging
    except FileExistsError:
      continue
  raise FileExistsError(errno.EEXIST, "no free staging name", out)


def save_pruned(ckpt: ckpt_lib.LoadedCheckpoint, heads: HeadSpec,
                out: str | os.PathLike, *, source: str | os.PathLike,
                details: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes the model of ``ckpt`` with ``heads`` removed as a workdir.

  The model is written to a temporary folder beside ``out`` and moved into
  place once complete, so ``out`` never holds half a model; a previous
  pruned model of the same source in ``out`` is replaced. A new ``out`` gets
  the mode ``os.makedirs`` would give it; an existing one keeps its own.

  Args:
    ckpt: the loaded source checkpoint (``mha.load_checkpoint(source)``).
    heads: ``(layer, head)`` pairs (or ``{layer: heads}``) to remove.
    out: the new workdir.
    source: the workdir ``ckpt`` was loaded from (its optimizer state is
      read again from there; named in the provenance).
    details: extra provenance (e.g. the order and fraction that chose the
      heads), stored in ``pruned_from.json``.

  Returns:
    The provenance written to ``out/pruned_from.json``.

  Raises:
    ValueError: a head that does not exist.
    config_validation.ConfigError: ``out`` may not be written
      (:func:`check_output_dir`; ``workdir_lock.WorkdirUnusableError``
      when its folder cannot be made), checked before anything is written.
  """
  check_output_dir(out, source)
  source, out = _real(source), _real(out)
  pairs = _sorted_pairs(heads)
  state, model_config = prune_train_state(
      read_train_state(source, ckpt), ckpt.model_config, pairs)
  config = pruned_run_config(ckpt.config, model_config)
  state = _matched_to(state, config)
  provenance = {
      "source_workdir": source,
      "source_step": int(ckpt.step),
      "removed": pairs,
      "heads_per_layer": list(model_config.heads_per_layer),
      **dict(details or {}),
  }
  parent = os.path.dirname(out)
  try:
    os.makedirs(parent, exist_ok=True)
    staging = _make_staging(out)
  except OSError as e:
    raise workdir_lock.WorkdirUnusableError(
        f"cannot write {out}: {workdir_lock.unusable_reason(e)}") from None
  try:
    _write(staging, int(ckpt.step), state, config, provenance)
    if os.path.isdir(out):  # Keep the folder's own permissions.
      os.chmod(staging, stat.S_IMODE(os.stat(out).st_mode))
      shutil.rmtree(out)
    os.rename(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return provenance


__all__ = [
    "PROVENANCE_FILE",
    "ORDERS",
    "SUBSET_ORDERS",
    "read_provenance",
    "check_request",
    "check_output_dir",
    "check_writable_target",
    "run_checkpoints_of",
    "check_order",
    "heads_of_order",
    "pruned_run_config",
    "prune_train_state",
    "read_train_state",
    "heads_for_fraction",
    "save_pruned",
]
