"""mha: multi-head attention that returns its weights, an encoder-only
Transformer built on it, training on toy sequence tasks, and head pruning.

The public names are imported on first use (PEP 562), so that ``import
mha.cli`` and an entry point refusing a mistyped flag do not import JAX,
Flax or orbax first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # For type checkers and IDEs; at run time, on first use.
  from mha.attention import MultiHeadAttention, dot_product_attention
  from mha.checkpoint import load_checkpoint
  from mha.model import Transformer, TransformerConfig

# Public name -> the module that defines it.
_PUBLIC = {
    "MultiHeadAttention": "mha.attention",
    "dot_product_attention": "mha.attention",
    "Transformer": "mha.model",
    "TransformerConfig": "mha.model",
    "load_checkpoint": "mha.checkpoint",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
  if name in _PUBLIC:
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # Later look-ups skip this function.
    return value
  raise AttributeError(f"module 'mha' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_PUBLIC))
