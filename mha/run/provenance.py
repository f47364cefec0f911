"""What produced a number: package versions, the backend and the settings
that can change results.

Recorded in the first row ``train.py`` writes to ``metrics.jsonl`` each time
a run starts or resumes, and in the pruning study's ``results.json``, so that
a figure can be traced to the code and settings behind it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

import jax

_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
# JAX options that change a program's numbers, recorded with their values.
_NUMERIC_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision",
                    "jax_disable_most_optimizations", "jax_default_prng_impl",
                    "jax_threefry_partitionable", "jax_softmax_custom_jvp")


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def environment() -> dict[str, Any]:
  """The versions, devices and numeric settings of this process.

  ``compile_settings`` holds JAX's options that change numbers (as they are
  set, defaults included) and ``XLA_FLAGS`` when it is set: the code
  itself passes no compiler option to any program.
  """
  devices = jax.devices()
  settings: dict[str, Any] = {}
  for name in _NUMERIC_OPTIONS:
    try:  # Options come and go between releases.
      settings[name] = jax.config.read(name)
    except (AttributeError, KeyError, ValueError):
      if hasattr(jax.config, name):
        settings[name] = getattr(jax.config, name)
  if os.environ.get("XLA_FLAGS"):
    settings["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
  return {
      "python": platform.python_version(),
      **{package: _version(package) for package in _PACKAGES},
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "process_count": jax.process_count(),
      "compile_settings": settings,
  }
