"""Compiled programs kept whole on disk, so that a warm start traces nothing.

JAX's persistent compilation cache (:mod:`mha.compilation_cache`) saves a
warm run XLA's compiling, but not the work before it: to find a program in
that cache, JAX traces the Python function and lowers it to StableHLO, whose
hash is the cache key. For the default train step that is about 0.5 s of
Python holding the GIL, the largest part of a warm start after the imports
(docs/performance.md, "The warm start").

This module keeps the executables themselves
(``jax.experimental.serialize_executable``), next to JAX's cache, in
``<compilation cache>/executables/``, under a key of everything that
determines the program: its name, the source of the ``mha`` package, the
caller's description (``parts``: the config, the compiler options), the
versions of Python, JAX, jaxlib, Flax, optax and NumPy, JAX's config flags,
``XLA_FLAGS``, the devices and the CPU's features, and the arguments' shapes,
types and shardings. A later call with the same key loads the executable and
runs it: no tracing, no lowering, no cache key to hash. Of a program that
takes no arguments and runs once (a run's initial state), it keeps the
outputs instead of the program (:func:`run_or_load`): a warm start loads
them, and such a program need not be serializable (the initial state's is
not: it calls back into Python, :mod:`mha.host_prng`).

Rules that keep it safe:

* Only an executable compiled in this very call is kept. One XLA:CPU loaded
  from JAX's cache serializes incomplete (its object code is missing and the
  loaded copy fails at its first call), so a program that came from JAX's
  cache (or from JAX's in-memory cache) is not written here; it is written
  the next time it is compiled.
* Nothing here fails a run: an entry that cannot be read or loaded, or a
  write that fails, falls back to compiling (and a damaged entry is
  replaced).
* A loaded executable checks its arguments' types and shardings at every
  call, as a compiled one does.
* As with JAX's cache, anyone who can write to the folder can make your runs
  execute code: keep it private. Delete it at any time.

``train.py`` turns the store on (:func:`enable`); it is used where the
compilation cache is on, so ``""`` as the cache folder
(``--config.compilation_cache_dir=""``) turns both off. A library caller of
``mha.train.train_and_evaluate`` traces as before unless it turns the store
on itself: the key covers the source on disk, not a method patched at run
time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import platform
import sys
import tempfile
import zlib
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from mha import compilation_cache

SUBDIRECTORY = "executables"
_SUFFIX = ".pkl.zlib"  # A pickle, compressed (1.2-1.6 MB -> 0.25 MB).
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_enabled = {"on": False}


def enable(on: bool = True) -> None:
  """Turns the store on (``train.py`` does) or off (the default).

  Off by default because its key covers the package's source on disk, not
  what a caller may have changed at run time: a notebook that patches a
  model method and then calls ``mha.train.train_and_evaluate`` must trace
  it. A fresh ``train.py`` process runs the source on disk.
  """
  _enabled["on"] = on


def directory() -> str:
  """The store's folder: ``executables/`` in JAX's persistent compilation
  cache folder; ``""`` (no store) when the store is off (:func:`enable`), the
  compilation cache is off, or the run spans several processes."""
  if (not _enabled["on"] or not jax.config.jax_enable_compilation_cache
      or jax.process_count() > 1):
    return ""
  cache = jax.config.jax_compilation_cache_dir
  return os.path.join(cache, SUBDIRECTORY) if cache else ""


@functools.cache
def source_digest() -> str:
  """SHA-256 of every ``.py`` file of the ``mha`` package (paths and
  contents): an edit anywhere in the package is a new key."""
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(_PACKAGE_DIR):
    dirs.sort()
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(root, name)
        digest.update(os.path.relpath(path, _PACKAGE_DIR).encode())
        with open(path, "rb") as f:
          digest.update(hashlib.sha256(f.read()).digest())
  return digest.hexdigest()


@functools.cache
def _machine() -> str:
  """Versions and the CPU: what the same source can compile differently."""
  versions = [f"python={sys.version}"]
  for package in _PACKAGES:
    try:
      versions.append(f"{package}={importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
      versions.append(f"{package}=?")
  cpu = platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu += "".join(sorted({line for line in f
                             if line.startswith(("flags", "model name"))}))
  except OSError:
    cpu += platform.processor()
  return "\n".join(versions + [cpu])


def key(name: str, args: Sequence[Any], parts: Mapping[str, Any],
        compiler_options: Mapping[str, Any] | None = None) -> str:
  """The store's key of program ``name`` called on ``args`` (arrays or
  ``jax.ShapeDtypeStruct``s, their shardings included; other leaves, static
  arguments, by their ``repr``), described by
  ``parts`` (``repr``-able values: the config, ...) and compiled with
  ``compiler_options``."""
  devices = [(d.id, d.process_index, d.platform, d.device_kind)
             for d in jax.devices()]
  leaves = [(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
             repr(getattr(x, "sharding", None))) if hasattr(x, "shape")
            else repr(x)  # a static argument: a model, say
            for x in jax.tree.leaves(args)]
  fields = [
      name, source_digest(), _machine(), repr(sorted(parts.items())),
      repr(sorted((compiler_options or {}).items())),
      repr(sorted(jax.config.values.items())),
      os.environ.get("XLA_FLAGS", ""), repr(devices),
      jax.devices()[0].client.platform_version,
      repr(jax.tree.structure(args)), repr(leaves)]
  digest = hashlib.sha256()
  for field in fields:
    digest.update(hashlib.sha256(field.encode()).digest())
  return digest.hexdigest()


def load(folder: str, entry: str) -> jax.stages.Compiled | None:
  """The executable stored under ``entry``, loaded; None if there is none or
  it cannot be read or loaded."""
  from jax.experimental import serialize_executable
  try:
    with open(os.path.join(folder, entry + _SUFFIX), "rb") as f:
      serialized, in_tree, out_tree, device_ids = pickle.loads(
          zlib.decompress(f.read()))
    devices = {d.id: d for d in jax.devices()}
    compiled = serialize_executable.deserialize_and_load(
        serialized, in_tree, out_tree,
        execution_devices=[devices[i] for i in device_ids])
  except Exception:  # pylint: disable=broad-except
    return None  # None there, or damaged: compiled (and replaced).
  compilation_cache.note_executable_loaded()
  return compiled


def store(folder: str, entry: str, compiled: jax.stages.Compiled) -> bool:
  """Writes ``compiled`` under ``entry`` (atomically: a reader sees the old
  file or the new one); False if it could not be serialized or written.

  Only for an executable compiled in this process, not loaded from JAX's
  cache (see the module's doc): :func:`compile_or_load` checks that.
  """
  from jax.experimental import serialize_executable
  try:
    # The devices it runs on, in order (a program of a mesh over some of
    # the devices must be loaded onto those).
    device_ids = [d.id for d in
                  compiled._executable.xla_executable.local_devices()]  # pylint: disable=protected-access
    payload = pickle.dumps(
        (*serialize_executable.serialize(compiled), device_ids),
        protocol=pickle.HIGHEST_PROTOCOL)
  except Exception:  # pylint: disable=broad-except
    return False  # e.g. a program that calls back into Python
  return _write(folder, entry, payload)


def run_or_load(name: str, jitted: Any, *, parts: Mapping[str, Any],
                out_shardings: Any,
                compiler_options: Mapping[str, Any] | None = None,
                folder: str | None = None) -> Any:
  """The outputs of ``jitted()``, a program of no arguments (so the same
  outputs at every run), or those outputs as an earlier call with the same
  :func:`key` stored them (``folder``, default :func:`directory`).

  For a program that runs once, as a run's initial state does: where its
  outputs are stored, a warm start neither loads nor runs the program, and
  a program that cannot be kept whole (one that calls back into Python)
  still costs a warm start nothing. ``out_shardings``: the outputs' tree,
  a sharding for each array (the loaded ones are put there). PRNG key
  arrays are kept as their data and implementation, a scalar of a weak type
  as a weak scalar; outputs with a weak-typed array, or with a key of an
  implementation that cannot be named again (a custom one), are not kept,
  nor are outputs where ``out_shardings`` has no sharding for each (give a
  sharding for every output, not ``None`` or a prefix). Where nothing is
  stored, the program is compiled (loaded from JAX's compilation cache
  where that keeps it: not a program that calls back into Python) and run;
  the program itself is not kept.
  """
  folder = directory() if folder is None else folder
  entry = (key(name, (), parts, compiler_options) + _RESULT
           if folder else "")
  if entry:
    outputs = _load_outputs(folder, entry, out_shardings)
    if outputs is not None:
      compilation_cache.note_executable_loaded()
      return outputs
  # Compiled, not loaded or kept whole: its outputs are what is kept.
  outputs = compile_or_load(name, jitted, (), parts=parts,
                            compiler_options=compiler_options, folder="")()
  if entry:
    _store_outputs(folder, entry, outputs, out_shardings)
  return outputs


_RESULT = ".outputs"  # An entry of outputs, not of an executable.
_WEAK = "weak"  # An output of a weak type: a scalar, kept as a NumPy one.


def _load_outputs(folder: str, entry: str, out_shardings: Any) -> Any:
  """The outputs :func:`_store_outputs` kept under ``entry``, put on
  ``out_shardings``; None where there are none, or they cannot be read or do
  not fit ``out_shardings``' tree."""
  try:
    with open(os.path.join(folder, entry + _SUFFIX), "rb") as f:
      leaves = pickle.loads(zlib.decompress(f.read()))
    shardings, tree = jax.tree.flatten(out_shardings)
    if len(leaves) != len(shardings):
      return None
    arrays = []
    for (kind, value), sharding in zip(leaves, shardings):
      if kind == _WEAK:  # a Python scalar is put as a weak one
        array = jax.device_put(value.item(), sharding)
        if array.dtype != value.dtype:  # another jax_enable_x64
          return None
      else:
        array = jax.device_put(value, sharding)
        if kind is not None:
          array = jax.random.wrap_key_data(array, impl=kind)
      arrays.append(array)
    return jax.tree.unflatten(tree, arrays)
  except Exception:  # pylint: disable=broad-except
    return None  # None there, or damaged: computed (and replaced).


def _store_outputs(folder: str, entry: str, outputs: Any,
                   out_shardings: Any) -> bool:
  """Writes ``outputs`` (arrays and PRNG key arrays) under ``entry``,
  atomically; False where :func:`_load_outputs` could not give them back
  (an array of a weak type, not a scalar; a key of an implementation it
  cannot name; not a sharding for each output) or the write fails."""
  outputs = jax.tree.leaves(outputs)
  if len(outputs) != len(jax.tree.leaves(out_shardings)):
    return False
  leaves = []
  for leaf in outputs:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      name = jax.random.key_impl(leaf)
      if not isinstance(name, str):  # A custom one: no name to find it by.
        return False
      leaves.append((name, np.asarray(jax.random.key_data(leaf))))
    elif getattr(leaf, "weak_type", False):
      if leaf.shape:
        return False  # only a scalar can be made weak again
      leaves.append((_WEAK, np.asarray(leaf)))
    else:
      leaves.append((None, np.asarray(leaf)))
  return _write(folder, entry, pickle.dumps(
      leaves, protocol=pickle.HIGHEST_PROTOCOL))


def _write(folder: str, entry: str, payload: bytes) -> bool:
  """Writes ``payload``, compressed, as ``entry`` in ``folder`` (made
  private if new), atomically; False if that fails."""
  try:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp",
                                     delete=False) as f:
      f.write(zlib.compress(payload, 1))
    os.replace(f.name, os.path.join(folder, entry + _SUFFIX))
  except Exception:  # pylint: disable=broad-except
    try:
      os.unlink(f.name)  # pytype: disable=name-error
    except Exception:  # pylint: disable=broad-except
      pass
    return False
  return True


def unknown_compiler_option(error: Exception) -> bool:
  """Whether ``error`` is XLA refusing a compiler option this jaxlib does not
  know, by name or by value (XLA's debug options come and go); the caller
  then compiles without it."""
  return (isinstance(error, jax.errors.JaxRuntimeError)
          and ("While setting option" in str(error)
               or "compile option" in str(error)))


def compile_or_load(name: str, jitted: Any, args: Sequence[Any], *,
                    parts: Mapping[str, Any],
                    compiler_options: Mapping[str, Any] | None = None,
                    folder: str | None = None) -> jax.stages.Compiled:
  """``jitted.lower(*args).compile(compiler_options)``, or the same program
  loaded whole from the store (``folder``, default :func:`directory`) when an
  earlier call compiled it under the same :func:`key`; a program compiled
  here is stored for the next call.

  ``parts`` must describe whatever the traced function closes over that the
  source and the arguments do not (e.g. the run's config). Where XLA refuses
  one of ``compiler_options`` (:func:`unknown_compiler_option`), the program
  is compiled, or loaded, without them.
  """
  try:
    return _compile_or_load(name, jitted, args, parts, compiler_options,
                            folder)
  except Exception as e:  # pylint: disable=broad-except
    if not compiler_options or not unknown_compiler_option(e):
      raise
  return _compile_or_load(name, jitted, args, parts, None, folder)


def _compile_or_load(name: str, jitted: Any, args: Sequence[Any],
                     parts: Mapping[str, Any],
                     compiler_options: Mapping[str, Any] | None,
                     folder: str | None) -> jax.stages.Compiled:
  """:func:`compile_or_load` with ``compiler_options`` as they are."""
  folder = directory() if folder is None else folder
  if not folder:
    return jitted.lower(*args).compile(compiler_options)
  entry = key(name, args, parts, compiler_options)
  compiled = load(folder, entry)
  if compiled is not None:
    return compiled
  with compilation_cache.this_thread() as seen:
    compiled = jitted.lower(*args).compile(compiler_options)
  if seen.programs == 1 and not seen.cache_hits:  # compiled here, complete
    store(folder, entry, compiled)
  return compiled
