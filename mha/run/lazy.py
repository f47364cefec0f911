"""Names of a package imported on first use (PEP 562), for light imports.

``import mha`` or the study's command line then imports no JAX, Flax or
orbax until a name that needs them is used::

    __getattr__, __dir__, __all__ = lazy.attach(__name__, {
        "load_checkpoint": "mha.checkpoint"})
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable, Mapping


def attach(package: str, public: Mapping[str, str]
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]],
                      list[str]]:
  """The module ``__getattr__``, ``__dir__`` and ``__all__`` of ``package``
  (its ``__name__``) whose public names (``public``: name -> the module
  defining it) are imported on first use, then kept in its namespace. A
  submodule not imported yet (``package.name``) is imported when asked for,
  as a package that imported it eagerly would have it."""
  namespace = sys.modules[package].__dict__

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name not in public:
      if submodule(package, name):
        return importlib.import_module(f"{package}.{name}")
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(public[name]), name)
    namespace[name] = value  # Later look-ups skip this function.
    return value

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(namespace) | set(public))

  return __getattr__, __dir__, sorted(public)


def submodule(package: str, name: str) -> bool:
  """Whether ``package.name`` is a module (found without importing it)."""
  return (name.isidentifier() and not name.startswith("__")
          and importlib.util.find_spec(f"{package}.{name}") is not None)
