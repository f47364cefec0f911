"""Each seed's finished analysis kept in the output folder and reused.

A study stopped by a signal (or a crash) keeps the analysis of every seed
it finished, ``<out>/seeds/seed_<s>/analysis.npz``, and a rerun reuses it
instead of computing it again, so that a rerun redoes at most the seed that
was under way. What a seed's analysis keeps: its result, its bootstrap
statistics and the extensions' per-seed results, and the state of the
study's shared random generator after it (so that the seeds after it draw
the same numbers as in an uninterrupted study).

A kept analysis is reused only when its key matches (:func:`key`): the
study's options, the seed's checkpoint step and a hash of its parameters,
the splits and the bootstrap resamples, the random generator's state before
the seed, the package versions and backend
(:func:`mha.run.provenance.environment`) and a hash of the ``mha`` package's
source; anything different, and the analysis is computed again (and kept
again). One file, written to a temporary name and renamed into place: it is
there whole or not at all.

The file is an ``.npz`` without pickles: the arrays, plus one JSON text
(``tree``) holding the nested structure with the arrays replaced by
references (:func:`encode`, :func:`decode`). Python floats, ints, strings,
booleans and None, tuples, dicts with any keys and arrays (NumPy scalars as
0-d arrays) come back equal and of the same type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import zipfile
from typing import Any, Mapping

import jax
import numpy as np

from mha import data
from mha.aliases import Log, Params
from mha.run import provenance
from mha.pruning.study.options import StudyOptions

FILE = "analysis.npz"
#: Bumped when what the file holds changes meaning.
FORMAT = 1
_ARRAY, _SCALAR, _TUPLE, _ITEMS = "__array__", "__scalar__", "__tuple__", "__items__"


def encode(value: Any, arrays: list[np.ndarray]) -> Any:
  """``value`` as JSON can hold it exactly, its arrays appended to
  ``arrays`` and replaced by ``{"__array__": i}``.

  Raises:
    TypeError: a value of another type (or an array of objects).
  """
  if isinstance(value, (np.ndarray, jax.Array, np.generic)):
    array = np.asarray(value)
    if array.dtype.hasobject:
      raise TypeError(f"an array of objects cannot be kept: {array.dtype}")
    arrays.append(array)
    tag = _SCALAR if isinstance(value, np.generic) else _ARRAY
    return {tag: len(arrays) - 1}
  if value is None or isinstance(value, (bool, int, float, str)):
    if type(value) not in (type(None), bool, int, float, str):
      raise TypeError(f"cannot keep a {type(value).__name__}")
    return value
  if isinstance(value, tuple):
    return {_TUPLE: [encode(v, arrays) for v in value]}
  if isinstance(value, list):
    return [encode(v, arrays) for v in value]
  if isinstance(value, dict):
    if all(isinstance(k, str) for k in value) and not (
        len(value) == 1 and next(iter(value)).startswith("__")):
      return {k: encode(v, arrays) for k, v in value.items()}
    return {_ITEMS: [[encode(k, arrays), encode(v, arrays)]
                     for k, v in value.items()]}
  raise TypeError(f"cannot keep a {type(value).__name__}")


def decode(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
  """The value :func:`encode` encoded, its arrays from ``arrays``
  (``a<i>``)."""
  if isinstance(value, list):
    return [decode(v, arrays) for v in value]
  if not isinstance(value, dict):
    return value
  if len(value) == 1:
    (tag, inner), = value.items()
    if tag == _ARRAY:
      return arrays[f"a{inner}"]
    if tag == _SCALAR:
      return arrays[f"a{inner}"][()]
    if tag == _TUPLE:
      return tuple(decode(v, arrays) for v in inner)
    if tag == _ITEMS:
      return {_hashable(decode(k, arrays)): decode(v, arrays)
              for k, v in inner}
  return {k: decode(v, arrays) for k, v in value.items()}


def _hashable(key: Any) -> Any:
  return key.item() if isinstance(key, np.ndarray) else key


def _digest(*parts: Any) -> str:
  """A SHA-256 of ``parts``: arrays by dtype, shape and bytes, the rest by
  their JSON text."""
  h = hashlib.sha256()
  for part in parts:
    if isinstance(part, np.ndarray):
      h.update(f"{part.dtype}{part.shape}".encode())
      h.update(np.ascontiguousarray(part).tobytes())
    else:
      h.update(json.dumps(part, sort_keys=True, default=str).encode())
  return h.hexdigest()


def params_digest(params: Params) -> str:
  """A hash of a model's parameters: every leaf's path, dtype, shape and
  bytes."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return _digest(*[x for path, leaf in leaves
                   for x in (jax.tree_util.keystr(path), np.asarray(leaf))])


@functools.cache
def code_digest() -> str:
  """A hash of the ``mha`` package's Python source, read once a process (at
  the first call: the source it runs, not a file edited since)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  h = hashlib.sha256()
  for folder, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
          h.update(f.read())
  return h.hexdigest()


def key(options: StudyOptions, step: int, params: Params,
        splits: Mapping[str, data.Split], resamples: Any,
        rng: np.random.Generator) -> str:
  """What determines a seed's analysis, hashed: the options, the
  checkpoint's step and parameters, the splits, the bootstrap resamples
  (``analysis.Resamples``), the random generator's state before the seed,
  the environment (package versions, backend, numeric settings) and the
  code."""
  split_arrays = [a for name in sorted(splits)
                  for a in (splits[name].inputs, splits[name].targets)]
  return _digest(
      FORMAT, dataclasses.asdict(options), int(step), params_digest(params),
      *split_arrays, resamples.validation, resamples.test, resamples.seeds,
      rng.bit_generator.state, provenance.environment(), code_digest())


def save(path: str, digest: str, kept: Mapping[str, Any],
         rng: np.random.Generator) -> None:
  """Writes ``kept`` (a seed's result, statistics and extras) under
  ``digest`` with the random generator's state after the seed, whole or
  not at all.

  Raises:
    TypeError: ``kept`` holds a value :func:`encode` cannot keep.
  """
  arrays: list[np.ndarray] = []
  tree = encode({"key": digest, "rng": rng.bit_generator.state,
                 "kept": dict(kept)}, arrays)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp.npz"  # np.savez appends .npz to any other name.
  np.savez(tmp, tree=np.asarray(json.dumps(tree)),
           **{f"a{i}": a for i, a in enumerate(arrays)})
  os.replace(tmp, path)


def load(path: str, digest: str, rng: np.random.Generator,
         log: Log) -> dict[str, Any] | None:
  """The analysis kept at ``path`` under ``digest`` (and ``rng`` set to the
  state after it), or None: no file, another key, or a file that does not
  read (said in one line)."""
  if not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as f:
      arrays = {name: f[name] for name in f.files}
    tree = decode(json.loads(str(arrays.pop("tree"))), arrays)
  except (OSError, EOFError, ValueError, KeyError, TypeError,
          zipfile.BadZipFile) as e:
    log(f"  the kept analysis {path} does not read ({type(e).__name__}: "
        f"{e}); computing it again")
    return None
  if tree.get("key") != digest:
    log(f"  the kept analysis {path} is of other options, checkpoint, data "
        "or code; computing it again")
    return None
  rng.bit_generator.state = tree["rng"]
  return tree["kept"]


__all__ = ["FILE", "encode", "decode", "params_digest", "code_digest", "key",
           "save", "load"]
