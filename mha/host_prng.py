"""JAX's threefry2x32 random numbers, with the hash computed on the host.

A fresh run's initial state is one program of random-number generation: a
threefry2x32 hash for every parameter array and for every key Flax derives
on the way. On XLA:CPU each hash is a loop of its own (31 in the default
model), and compiling them was most of the initial state's compile time,
which a cold start spends beside the train step's compilation on the same
cores (docs/performance.md, "The initial state's random numbers on the
host").

:func:`impl` is a PRNG implementation (``jax.random.key(seed, impl=impl())``)
that is JAX's own threefry2x32, function for function, with each of its
threefry2x32 hashes replaced by :func:`threefry2x32`, a NumPy copy of the
hash called through ``jax.pure_callback``. The hash is integer arithmetic
(additions, rotations and exclusive ors of uint32 words), which NumPy and
XLA compute the same way, so every key and every random bit it gives is
bitwise JAX's threefry2x32's (``tests/test_host_prng.py``); the float
arithmetic that turns bits into normal or uniform draws is left to XLA as
before. :func:`as_threefry` turns one of its keys into the same key of
JAX's default implementation.

Where it is used: ``mha.train`` makes a fresh run's initial state with it
on a single CPU device, where JAX's default implementation is threefry2x32.
A program that calls back into Python cannot be kept whole, nor in JAX's
compilation cache (``mha.executables`` keeps its outputs instead), and it
suits no other use: each hash is a round trip to the host, so use the
default implementation everywhere else.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, Sequence

import jax
from jax.extend import core as jex_core
from jax.extend import random as jex_random
import jax.numpy as jnp
import numpy as np

from mha.aliases import Array

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)  # Threefry's key-schedule constant


def threefry2x32(key1: np.ndarray, key2: np.ndarray, x1: np.ndarray,
                 x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The Threefry-2x32 hash (20 rounds, Salmon et al. 2011) of the counts
  ``(x1, x2)`` under the key ``(key1, key2)``, as JAX computes it: uint32
  arrays, broadcast together; returns the two hashed words. NumPy, on the
  host: not for ``jit``."""
  k1, k2, a, b = np.broadcast_arrays(
      *(np.asarray(x, np.uint32) for x in (key1, key2, x1, x2)))
  schedule = (k1, k2, k1 ^ k2 ^ _PARITY)
  with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as XLA's
    a = a + schedule[0]
    b = b + schedule[1]
    for i in range(5):
      for r in _ROTATIONS[i % 2]:
        a = a + b
        b = (b << np.uint32(r)) | (b >> np.uint32(32 - r))
        b = a ^ b
      a = a + schedule[(i + 1) % 3]
      b = b + schedule[(i + 2) % 3] + np.uint32(i + 1)
  return np.asarray(a, np.uint32), np.asarray(b, np.uint32)


def _hash_on_host(key1: Array, key2: Array, x1: Array, x2: Array
                  ) -> tuple[Array, Array]:
  """:func:`threefry2x32` inside a traced program (``jax.pure_callback``)."""
  # Broadcast here, so that a vmapped call's batch axis lines up.
  shape = jnp.broadcast_shapes(key1.shape, key2.shape, x1.shape, x2.shape)
  words = [jnp.broadcast_to(x, shape) for x in (key1, key2, x1, x2)]
  out = jax.ShapeDtypeStruct(shape, jnp.uint32)
  return jax.pure_callback(threefry2x32, (out, out), *words,
                           vmap_method="broadcast_all")


_CALLS = ("pjit", "jit", "closed_call", "core_call")


def _evaluate(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` (traced or not), each threefry2x32 hash
  computed by :func:`_hash_on_host`, the calls it makes inlined; every other
  equation is bound as it is."""
  env = {}

  def read(var):
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    if eqn.primitive is jex_random.threefry2x32_p:
      outs = _hash_on_host(*values)
    elif eqn.primitive.name in _CALLS and "jaxpr" in eqn.params:
      called = eqn.params["jaxpr"]
      outs = _evaluate(called.jaxpr, called.consts, *values)
    else:
      outs = eqn.primitive.bind(*values, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _hashing_on_host(fn: Callable[..., Array]) -> Callable[..., Array]:
  """``fn`` (of arrays only) with its threefry2x32 hashes on the host."""

  def wrapped(*args: Array) -> Array:
    closed = jax.make_jaxpr(fn)(*args)
    (out,) = _evaluate(closed.jaxpr, closed.consts, *args)
    return out

  return wrapped


_THREEFRY = jex_random.threefry_prng_impl


def _split(key: Array, shape: tuple[int, ...]) -> Array:
  return _hashing_on_host(lambda k: _THREEFRY.split(k, shape))(key)


def _random_bits(key: Array, bit_width: int, shape: tuple[int, ...]) -> Array:
  return _hashing_on_host(
      lambda k: _THREEFRY.random_bits(k, bit_width, shape))(key)


def _fold_in(key: Array, data: Array) -> Array:
  return _hashing_on_host(_THREEFRY.fold_in)(key, data)


@functools.cache
def impl() -> Hashable:
  """The PRNG implementation: ``jax.random.key(seed, impl=impl())`` makes a
  key whose splits, fold-ins and random bits are bitwise those of
  ``jax.random.key(seed)`` (JAX's threefry2x32, either setting of
  ``jax_threefry_partitionable``), each hash computed on the host."""
  return jex_random.define_prng_impl(
      key_shape=_THREEFRY.key_shape, seed=_THREEFRY.seed, split=_split,
      random_bits=_random_bits, fold_in=_fold_in,
      name="threefry2x32_host", tag="fryh")


def as_threefry(keys: Array) -> Array:
  """The same keys (their data) in JAX's threefry2x32 implementation."""
  return jax.random.wrap_key_data(jax.random.key_data(keys),
                                  impl="threefry2x32")
