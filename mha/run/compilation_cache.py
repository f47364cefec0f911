"""JAX's persistent compilation cache, on by default, and a compile counter.

A researcher reruns ``train.py`` many times a day with small changes; most
runs compile programs an earlier run already compiled. With the cache on, XLA's
executables are written to ``config.compilation_cache_dir`` (default
``~/.cache/mha/jax``) and a later run of the same program loads it instead of
compiling it again. The entry points (``train.py``, ``eval.py``,
``scripts/prune_heads.py``) call :func:`configure` before they compile
anything; a library caller may too:

    from mha.run import compilation_cache
    compilation_cache.configure("~/.cache/mha/jax")

A run uses ``config.compilation_cache_dir`` (``""`` turns the cache off),
whose default is ``$JAX_COMPILATION_CACHE_DIR`` when that is set (JAX's own
variable, so a cache set up for every JAX program keeps working) and
``~/.cache/mha/jax`` otherwise (``configs/default.py``).

The cache never fails a run: a directory that cannot be created or written is
one warning line on stderr, and the run compiles without it. Nor does it
change a result: a loaded executable is the one XLA compiled for the same
program, options and devices (JAX's cache key covers all three). The cache
grows by a few hundred kB per distinct program and is never pruned; delete the
directory at any time.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache as jax_cache

# JAX's events: one per program compiled or loaded from the cache, and one
# per program loaded from the cache.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def resolve_dir(value: str) -> str:
  """The absolute cache directory for the config value ``value`` (``""``:
  no cache)."""
  return os.path.abspath(os.path.expanduser(value)) if value else ""


def _unusable(directory: str) -> str | None:
  """Why ``directory`` cannot hold the cache, or None: it is created if
  missing, and a file is written to it and removed."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".mha-probe-"):
      pass
  except OSError as e:
    return e.strerror or type(e).__name__
  return None


def configure(value: str, prog: str = "mha") -> str:
  """Turns the persistent compilation cache on in the directory that
  ``value`` (a ``config.compilation_cache_dir``) resolves to, or off.

  Every program is cached, however small or quick to compile (JAX's default
  thresholds skip programs compiled in under a second). Call it before the
  first compilation; calling it again switches directories.

  Args:
    value: the config value: a path (``~`` allowed), or ``""`` for none.
    prog: the program named in the warning line.

  Returns:
    The directory in use, or ``""`` when the cache is off (turned off, or
    the directory unusable: then one warning line goes to stderr).
  """
  directory = resolve_dir(value)
  problem = _unusable(directory) if directory else None
  if problem:
    print(f"{prog}: warning: compilation cache {directory} is not usable "
          f"({problem}); compiling without it", file=sys.stderr, flush=True)
    directory = ""
  if directory:
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_enable_compilation_cache", bool(directory))
  jax_cache.reset_cache()  # A cache JAX opened already is reopened.
  return directory


# --------------------------------------------------------------------------
# Counting compilations.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileCounts:
  """Programs compiled in this process so far (``programs``, loaded from the
  persistent cache included), of which ``cache_hits`` came from the cache."""

  programs: int = 0
  cache_hits: int = 0

  def __sub__(self, other: "CompileCounts") -> "CompileCounts":
    return CompileCounts(self.programs - other.programs,
                         self.cache_hits - other.cache_hits)

  def __str__(self) -> str:
    """``3 programs, 2 of them loaded from the compilation cache``."""
    text = f"{self.programs} program{'s' if self.programs != 1 else ''}"
    if self.cache_hits:
      hits = "all" if self.cache_hits == self.programs else self.cache_hits
      text += f", {hits} of them loaded from the compilation cache"
    return text


_counts = {"programs": 0, "cache_hits": 0}


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event == _CACHE_HIT_EVENT:
    _counts["cache_hits"] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  if event == _COMPILE_EVENT:
    _counts["programs"] += 1


monitoring.register_event_listener(_on_event)
monitoring.register_event_duration_secs_listener(_on_duration)


def counts() -> CompileCounts:
  """Compilations in this process since this module was imported; subtract
  two readings for those in between."""
  return CompileCounts(**_counts)
