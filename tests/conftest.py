"""Test-wide JAX settings."""

import jax

# Catch silent broadcasting between arrays of different rank.
jax.config.update("jax_numpy_rank_promotion", "raise")
