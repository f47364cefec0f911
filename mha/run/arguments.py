"""Checks of a public function's count and size arguments, made first.

    arguments.check_count("batch_size", batch_size)
    # ValueError: batch_size must be an int >= 1; got 0

Every public entry of :mod:`mha.patching`, :mod:`mha.pruning` and
:mod:`mha.nnx` that takes a count or a size (``num_examples``,
``batch_size``, ``k``, ``num_heads``, ``beam_width``, ...) checks it with
these before it loads or computes anything: one ``ValueError`` naming the
argument and the values it takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
  """Whether ``value`` is an int (a NumPy integer too; not a bool)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_count(name: str, value: Any, minimum: int = 1, *,
                none: str = "", note: str = "") -> None:
  """Raises ValueError unless ``value`` is an int ``>= minimum`` (or None,
  when ``none`` says what None means).

  The message: ``<name> must be [None (<none>) or ]an int >= <minimum>
  [(<note>)]; got <value!r>``.
  """
  if value is None and none:
    return
  if not is_int(value) or value < minimum:
    raise ValueError(
        f"{name} must be {f'None ({none}) or ' if none else ''}an int >= "
        f"{minimum}{f' ({note})' if note else ''}; got {value!r}")


def check_counts(name: str, values: Any, minimum: int = 1) -> None:
  """Raises ValueError unless ``values`` is a non-empty sequence of ints
  ``>= minimum``."""
  if (isinstance(values, (str, bytes)) or not hasattr(values, "__len__")
      or not len(values) or not all(is_int(v) and v >= minimum
                                    for v in values)):
    raise ValueError(f"{name} must be a non-empty sequence of ints >= "
                     f"{minimum}; got {values!r}")


__all__ = ["is_int", "check_count", "check_counts"]
