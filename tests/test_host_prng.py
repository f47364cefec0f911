"""mha.host_prng: JAX's threefry2x32 with its hashes on the host must give
bitwise JAX's keys and random bits, under jit and vmap, in either setting of
``jax_threefry_partitionable``."""

import jax
from jax.extend import random as jex_random
import jax.numpy as jnp
import numpy as np
import pytest

from mha import host_prng


def _bits(x):
  """The raw words of a key array, or the array."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _assert_same(a, b):
  a, b = _bits(a), _bits(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  assert a.tobytes() == b.tobytes()


def test_numpy_hash_is_jax_threefry2x32():
  rng = np.random.default_rng(0)
  words = [rng.integers(0, 2**32, 1001, dtype=np.uint32) for _ in range(4)]
  words[0][:3] = [0, 2**32 - 1, 0x1BD11BDA]
  hashed = jax.jit(lambda *w: jex_random.threefry2x32_p.bind(*w))(*words)
  for ours, theirs in zip(host_prng.threefry2x32(*words), hashed, strict=True):
    _assert_same(ours, theirs)
  # A key broadcast over the counts, as JAX's random_bits calls it.
  counts = np.arange(7, dtype=np.uint32).reshape(7, 1)
  key = np.uint32(12345), np.uint32(678)
  ours = host_prng.threefry2x32(*key, counts, counts + 7)
  assert ours[0].shape == (7, 1)
  for o, t in zip(ours, jax.jit(lambda *w: jex_random.threefry2x32_p.bind(
      *(jnp.broadcast_to(x, (7, 1)) for x in w)))(*key, counts, counts + 7)):
    _assert_same(o, t)


def _draws(key):
  """Everything a run's initialisation and training ask of a key."""
  first, second = jax.random.split(key)
  folded = jax.random.fold_in(second, 3)
  return [
      jax.random.split(key, 5), jax.random.split(key, (2, 3)), folded,
      jax.random.bits(first, ()), jax.random.bits(first, (7, 5)),
      jax.random.bits(first, (3,), jnp.uint8),
      jax.random.bits(first, (5,), jnp.uint16),
      jax.random.normal(folded, (33, 9)),
      jax.random.uniform(first, (4, 8, 32), minval=-2.0, maxval=3.0),
      jax.random.truncated_normal(folded, -2.0, 2.0, (32, 4, 8)),
      jax.random.bernoulli(first, 0.3, (16,)),
  ]


@pytest.mark.parametrize("partitionable", [True, False])
def test_keys_and_draws_are_bitwise_jax_threefry(partitionable):
  before = jax.config.jax_threefry_partitionable
  jax.config.update("jax_threefry_partitionable", partitionable)
  try:
    for seed in (0, 7, 2**31 + 5):
      theirs = jax.random.key(seed)
      ours = jax.random.key(seed, impl=host_prng.impl())
      assert str(jax.random.key_impl(theirs)) == "threefry2x32"
      assert str(jax.random.key_impl(ours)) != "threefry2x32"
      _assert_same(ours, theirs)
      # Eagerly and jitted.
      for fn in (_draws, jax.jit(_draws)):
        for a, b in zip(fn(ours), fn(theirs), strict=True):
          _assert_same(a, b)
      # vmapped over a batch of keys.
      sample = jax.jit(jax.vmap(lambda k: (
          jax.random.normal(k, (3, 2)), jax.random.fold_in(k, 9))))
      for a, b in zip(sample(jax.random.split(ours, 6)),
                      sample(jax.random.split(theirs, 6)), strict=True):
        _assert_same(a, b)
      converted = host_prng.as_threefry(jax.random.split(ours))
      assert str(jax.random.key_impl(converted)) == "threefry2x32"
      _assert_same(converted, jax.random.split(theirs))
  finally:
    jax.config.update("jax_threefry_partitionable", before)


def test_hashes_leave_the_program():
  # The point of it: the program has no loop of threefry rounds left.
  key = jax.random.key(0, impl=host_prng.impl())
  hlo = jax.jit(lambda: jax.random.normal(key, (16, 32))).lower().as_text()
  assert "while" not in hlo and "callback" in hlo
  hlo = jax.jit(lambda: jax.random.normal(jax.random.key(0), (16, 32))
                ).lower().as_text()
  assert "callback" not in hlo


def test_a_run_uses_it_only_as_the_twin_of_jax_default():
  # mha.train hashes on the host only where JAX's default implementation is
  # threefry2x32 (on one CPU device); with another default, a run's keys are
  # that default's, as before.
  from configs import default
  from mha import build, train
  config = default.get_config("tiny")
  model = build.make_model(config)
  if jax.default_backend() == "cpu" and jax.device_count() == 1:
    assert train._rng_impl() is host_prng.impl()
    # A run's initial state then has no threefry loop left (the point of
    # it: should JAX's PRNG functions change so that no hash is replaced,
    # the state would stay right but the cold start slow).
    initial, _ = train._fresh_state(config, model)
    text = jax.jit(initial).lower().as_text()
    assert "while" not in text and "callback" in text
  before = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")
  try:
    assert train._rng_impl() is None
    initial, abstract_state = train._fresh_state(config, model)
    leaves, dropout_rng = jax.jit(initial)()
    assert str(jax.random.key_impl(dropout_rng)) == "rbg"
    _assert_same(dropout_rng, build.run_rngs(config)[1])
    assert len(leaves) == len(jax.tree.leaves(abstract_state))
  finally:
    jax.config.update("jax_default_prng_impl", before)
