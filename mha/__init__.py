"""mha: multi-head attention that returns its weights, an encoder-only
Transformer built on it, training on toy sequence tasks, and head pruning."""

from mha.attention import MultiHeadAttention, dot_product_attention
from mha.model import Transformer, TransformerConfig

__all__ = [
    "MultiHeadAttention",
    "Transformer",
    "TransformerConfig",
    "dot_product_attention",
    "load_checkpoint",
]


def __getattr__(name):
  # Checkpoint loading pulls in orbax; import it only when asked for.
  if name == "load_checkpoint":
    from mha.checkpoint import load_checkpoint
    return load_checkpoint
  raise AttributeError(f"module 'mha' has no attribute {name!r}")
