"""mha: multi-head attention that returns its weights, a Transformer built on
it (an encoder, or a causal decoder that generates through a cache of keys
and values), training on toy sequence tasks, and head pruning.

The public names are imported on first use (PEP 562), so that ``import
mha.run.cli`` and an entry point refusing a mistyped flag do not import JAX,
Flax or orbax first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mha.run import lazy

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

__getattr__, __dir__, __all__ = lazy.attach(__name__, _PUBLIC)
