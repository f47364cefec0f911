"""Type aliases shared by every module of :mod:`mha`, defined once.

    from mha.aliases import Array, Params
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import jax

#: A JAX array (device or traced).
Array = jax.Array
#: A Flax parameter tree (nested dicts of arrays).
Params = Any
#: A progress callback: takes one line of text (``print`` by default).
Log = Callable[[str], None]
#: Heads to remove: ``(layer, head)`` pairs, or ``{layer: [heads]}``.
HeadSpec = Iterable[tuple[int, int]] | Mapping[int, Iterable[int]]

__all__ = ["Array", "Params", "Log", "HeadSpec"]
