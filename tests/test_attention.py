"""Tests of mha.attention: semantics, parity with Flax, transformations."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import attention as att
from mha import attention_kernels as kernels
from mha.attention import MultiHeadAttention, dot_product_attention

# float32 reductions over a few hundred terms: 1e-5 absolute is ~100 ulps.
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _init(layer, *args, **kwargs):
  return layer.init(jax.random.key(42), *args, **kwargs)


def _jit_init(layer, *args):
  """``_init`` as one program: eagerly, each operation compiles alone."""
  return jax.jit(layer.init)(jax.random.key(42), *args)


def _lengths_mask(valid_lens, length):
  """[B] lengths -> Flax-style key mask [B, 1, 1, L]."""
  return (np.arange(length)[None, :] < np.asarray(valid_lens)[:, None])[
      :, None, None, :]


# ----------------------------------------------------------------- shapes


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_shapes_any_number_of_batch_dims(batch):
  x = _inputs(*batch, 5, 16)
  layer = MultiHeadAttention(num_heads=4, out_features=12)
  params = _init(layer, x)
  out, weights = layer.apply(params, x)
  assert out.shape == batch + (5, 12)
  assert weights.shape == batch + (4, 5, 5)


def test_cross_attention_shapes():
  q, kv = _inputs(2, 3, 8), _inputs(2, 7, 6, seed=1)
  layer = MultiHeadAttention(num_heads=2, qkv_features=10)
  params = _jit_init(layer, q, kv)
  out, weights = jax.jit(layer.apply)(params, q, kv)
  assert out.shape == (2, 3, 8)
  assert weights.shape == (2, 2, 3, 7)


def test_parameter_tree_matches_flax():
  x = _inputs(2, 5, 16)
  # Shapes only: traced, not run (eagerly each operation compiles alone).
  ours = jax.eval_shape(lambda: _init(
      MultiHeadAttention(num_heads=4, qkv_features=8), x))
  theirs = jax.eval_shape(lambda: _init(
      nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=8), x))
  assert (jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, theirs))


# ---------------------------------------------------------- masks, weights


def test_masked_keys_get_exact_zero_and_rows_sum_to_one():
  x = _inputs(3, 6, 16)
  layer = MultiHeadAttention(num_heads=4)
  params = _jit_init(layer, x)
  valid_lens = jnp.array([2, 6, 4])
  _, weights = jax.jit(layer.apply)(params, x, valid_lens=valid_lens)
  key_ok = _lengths_mask(valid_lens, 6)
  masked = np.broadcast_to(~key_ok, weights.shape)
  assert np.all(np.asarray(weights)[masked] == 0.0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, **TOL)


def test_valid_lens_per_query_form():
  x = _inputs(2, 4, 8)
  layer = MultiHeadAttention(num_heads=2)
  params = _jit_init(layer, x)
  per_query = jnp.array([[1, 2, 3, 4], [4, 4, 1, 1]])
  _, weights = jax.jit(layer.apply)(params, x, valid_lens=per_query)
  key_ok = np.arange(4)[None, None, :] < np.asarray(per_query)[..., None]
  assert np.all(np.asarray(weights)[np.broadcast_to(
      ~key_ok[:, None], weights.shape)] == 0.0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, **TOL)


@pytest.mark.slow
def test_fully_masked_rows_are_zero_not_nan_nor_uniform():
  x = _inputs(2, 4, 8)
  layer = MultiHeadAttention(num_heads=2)
  params = _jit_init(layer, x)
  mask = np.ones((2, 1, 4, 4), bool)  # host arrays: no eager programs
  mask[0, :, 1, :] = False
  # The three calls in one program: eagerly each operation compiles alone.
  paths, (_, no_keys_weights) = jax.device_get(jax.jit(lambda p: (
      [layer.apply(p, x, mask=mask, return_weights=return_weights)
       for return_weights in (True, False)],
      layer.apply(p, x, valid_lens=jnp.array([0, 4]))))(params))
  for return_weights, (out, weights) in zip((True, False), paths):
    assert np.all(np.isfinite(out))
    # The row's context is zero, so its output is the out-projection bias.
    np.testing.assert_allclose(out[0, 1], params["params"]["out"]["bias"],
                               **TOL)
    if return_weights:
      assert np.all(weights[0, :, 1] == 0.0)
  # valid_lens of 0 masks every key of that sequence.
  assert np.all(no_keys_weights[0] == 0.0)

  # Gradients through a fully masked row stay finite.
  def loss(p):
    out, w = layer.apply(p, x, mask=mask)
    return jnp.sum(out ** 2) + jnp.sum(w)
  grads = jax.jit(jax.grad(loss))(params)  # one program, not op by op
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_mask_helpers():
  # The helpers in one program: eagerly each operation compiles alone.
  @jax.jit
  def masks(tokens, lengths):
    m = att.padding_mask_from_tokens(tokens)
    return (att.causal_mask(3), m, att.padding_mask_from_lengths(lengths, 3),
            att.combine_masks(att.causal_mask(3), m, None))

  causal, m, from_lengths, combined = jax.device_get(masks(
      np.array([[5, 3, 0]], np.int32), np.array([2], np.int32)))
  np.testing.assert_array_equal(
      causal[0],
      [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  assert m.shape == (1, 1, 3, 3)
  np.testing.assert_array_equal(m[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
  np.testing.assert_array_equal(from_lengths[0, 0, 0], [1, 1, 0])
  np.testing.assert_array_equal(combined[0, 0],
                                [[1, 0, 0], [1, 1, 0], [0, 0, 0]])
  assert att.combine_masks(None, None) is None


# ---------------------------------------------------------- parity with Flax


@pytest.mark.parametrize("use_mask", [False, True])
def test_parity_with_flax_self_attention(use_mask):
  x = _inputs(3, 6, 16)
  flax_layer = nn.MultiHeadDotProductAttention(num_heads=4)
  params = _jit_init(flax_layer, x)  # a Flax checkpoint loads into ours
  mask = _lengths_mask([6, 3, 1], 6) if use_mask else None

  @jax.jit  # one program, not op by op
  def run(params):
    theirs, inter = flax_layer.apply(params, x, mask=mask, sow_weights=True,
                                     mutable=["intermediates"])
    return ((theirs, inter["intermediates"]["attention_weights"][0]),
            MultiHeadAttention(num_heads=4).apply(params, x, mask=mask))

  (theirs, their_weights), (ours, weights) = run(params)
  np.testing.assert_allclose(ours, theirs, **TOL)
  np.testing.assert_allclose(weights, their_weights, **TOL)


@pytest.mark.slow
def test_parity_with_flax_cross_attention_and_options():
  q, k, v = _inputs(2, 3, 8), _inputs(2, 7, 6, seed=1), _inputs(2, 7, 5,
                                                                 seed=2)
  kwargs = dict(num_heads=2, qkv_features=12, out_features=4)
  flax_layer = nn.MultiHeadDotProductAttention(**kwargs)
  params = _jit_init(flax_layer, q, k, v)
  mask = jnp.asarray(_lengths_mask([7, 4], 7))

  @jax.jit  # one program, not op by op
  def run(params):
    theirs = flax_layer.apply(params, q, k, v, mask=mask)
    return theirs, MultiHeadAttention(**kwargs).apply(
        params, q, k, v, valid_lens=jnp.array([7, 4]))

  theirs, (ours, weights) = run(params)
  np.testing.assert_allclose(ours, theirs, **TOL)
  assert weights.shape == (2, 2, 3, 7)


def test_parity_with_flax_without_bias():
  x = _inputs(2, 5, 8)
  kwargs = dict(num_heads=2, use_bias=False)
  params = _jit_init(MultiHeadAttention(**kwargs), x)
  # Both layers in one program: eagerly each operation compiles alone.
  theirs, (ours, _) = jax.jit(lambda p: (
      nn.MultiHeadDotProductAttention(**kwargs).apply(p, x),
      MultiHeadAttention(**kwargs).apply(p, x)))(params)
  np.testing.assert_allclose(ours, theirs, **TOL)


# ------------------------------------------------------------- head mask


def _slice_heads(params, keep):
  """The parameters of a layer that has only the heads in ``keep``."""
  p = params["params"]
  out = {name: {"kernel": p[name]["kernel"][:, keep],
                "bias": p[name]["bias"][keep]}
         for name in ("query", "key", "value")}
  out["out"] = {"kernel": p["out"]["kernel"][keep], "bias": p["out"]["bias"]}
  return {"params": out}


def test_head_mask_zero_equals_slicing_the_head_out():
  x = _inputs(2, 5, 16)
  layer = MultiHeadAttention(num_heads=4)
  params = _jit_init(layer, x)
  valid_lens = jnp.array([5, 3])
  head_mask = jnp.array([1.0, 0.0, 1.0, 0.0])
  keep = np.array([0, 2])
  sliced_layer = MultiHeadAttention(num_heads=2, qkv_features=8,
                                    out_features=16)
  # Both layers in one program: eagerly each operation compiles alone.
  (masked, weights), (sliced, sliced_weights) = jax.device_get(jax.jit(
      lambda p: (
          layer.apply(p, x, valid_lens=valid_lens, head_mask=head_mask),
          sliced_layer.apply(_slice_heads(p, keep), x,
                             valid_lens=valid_lens)))(params))
  np.testing.assert_allclose(masked, sliced, **TOL)
  np.testing.assert_allclose(weights[:, keep], sliced_weights, **TOL)


def test_zero_heads_layer_is_the_masked_layer():
  x = _inputs(2, 5, 16)
  layer = MultiHeadAttention(num_heads=4)
  params = _jit_init(layer, x)
  empty = MultiHeadAttention(num_heads=0, qkv_features=0, out_features=16)
  empty_params = {"params": {"out": {"bias": params["params"]["out"]["bias"]}}}
  # Shapes only: traced, not run (eagerly each operation compiles alone).
  assert (jax.tree.map(jnp.shape, jax.eval_shape(lambda: _init(empty, x))) ==
          jax.tree.map(jnp.shape, empty_params))
  # Both layers in one program.
  (masked, _), (out, weights) = jax.jit(lambda p, e: (
      layer.apply(p, x, head_mask=jnp.zeros(4)), empty.apply(e, x)))(
          params, empty_params)
  np.testing.assert_allclose(out, masked, **TOL)
  assert weights.shape == (2, 0, 5, 5)


def test_head_mask_gradient_is_finite_and_matches_finite_difference():
  x = _inputs(2, 5, 16)
  layer = MultiHeadAttention(num_heads=4)
  params = _jit_init(layer, x)

  def loss(head_mask):
    out, _ = layer.apply(params, x, head_mask=head_mask)
    return jnp.sum(out ** 2)

  ones = np.ones(4, np.float32)  # host arrays: no eager programs
  grad = np.asarray(jax.jit(jax.grad(loss))(ones))
  assert np.all(np.isfinite(grad)) and np.any(grad != 0)
  loss = jax.jit(loss)  # one program for the 8 evaluations, not op by op
  eps = 1e-2  # loss is quadratic in the gate: central differences are exact
  # ones.at[h].add(+-eps), on the host: the same float32 gates.
  nudges = np.eye(4, dtype=np.float32) * np.float32(eps)
  fd = [(np.asarray(loss(ones + nudge)) - np.asarray(loss(ones - nudge)))
        / (2 * eps) for nudge in nudges]
  np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=1e-3)


# --------------------------------------------------- grouped-query attention


def _grouped_qkv():
  """Queries of 4 heads, keys and values of 2, a mask with a few holes."""
  q = _inputs(2, 5, 4, 8)
  k, v = _inputs(2, 6, 2, 8, seed=1), _inputs(2, 6, 2, 8, seed=2)
  mask = np.array(jax.random.bernoulli(jax.random.key(3), 0.7, (2, 4, 5, 6)))
  mask[..., 0] = True  # no fully masked row (on the host: no eager program)
  return q, k, v, mask


def test_grouped_query_attention_equals_jax_nn():
  q, k, v, mask = _grouped_qkv()
  head_mask = jnp.array([1.0, 0.0, 0.5, 1.0])  # over the 4 query heads

  @jax.jit
  def run(q, k, v, mask, head_mask):
    expected = jax.nn.dot_product_attention(q, k, v, mask=mask)
    # Query head n reads key/value head n // 2.
    _, repeated = dot_product_attention(q, jnp.repeat(k, 2, axis=-2),
                                        jnp.repeat(v, 2, axis=-2), mask=mask)
    return dict(
        expected=(expected, repeated,
                  expected * head_mask[None, None, :, None]),
        ours=dot_product_attention(q, k, v, mask=mask) + (
            dot_product_attention(q, k, v, mask=mask,
                                  head_mask=head_mask)[0],),
        fused=(att.fused_dot_product_attention(q, k, v, mask=mask),
               att.fused_dot_product_attention(q, k, v, mask=mask,
                                               head_mask=head_mask)),
        # The GPU's kernel call, through XLA: weights from the lse.
        library=kernels.library_attention(
            q, k, v, mask=mask, kv_lengths=None, implementation="xla",
            return_weights=True))

  r = run(q, k, v, mask, head_mask)
  (expected, weights, gated), ours = r["expected"], r["ours"]
  for got, want in zip(ours + r["fused"] + r["library"],
                       (expected, weights, gated, expected, gated, expected,
                        weights)):
    np.testing.assert_allclose(got, want, **TOL)


def test_grouped_layer_equals_its_projections_through_jax_nn():
  x = _inputs(2, 5, 16)
  layer = MultiHeadAttention(num_heads=4, num_kv_heads=2, qkv_features=8)
  valid_lens = jnp.array([5, 3])
  head_mask = jnp.array([1.0, 0.0, 1.0, 0.5])
  kwargs = dict(valid_lens=valid_lens, head_mask=head_mask)

  @jax.jit
  def run(params):
    p = params["params"]
    project = lambda name: (jnp.einsum("bld,dhk->blhk", x, p[name]["kernel"])
                            + p[name]["bias"][None, None])
    context = jax.nn.dot_product_attention(
        project("query"), project("key"), project("value"),
        mask=_lengths_mask(valid_lens, 5)) * head_mask[None, None, :, None]
    expected = (jnp.einsum("blhk,hkd->bld", context, p["out"]["kernel"])
                + p["out"]["bias"][None, None])
    return (expected, layer.apply(params, x, **kwargs),
            layer.apply(params, x, return_weights=False, **kwargs))

  params = jax.jit(layer.init)(jax.random.key(42), x)
  p = params["params"]
  assert p["key"]["kernel"].shape == p["value"]["kernel"].shape == (16, 2, 2)
  assert p["query"]["kernel"].shape == (16, 4, 2)
  expected, (out, weights), (fused, none) = run(params)
  np.testing.assert_allclose(out, expected, **TOL)
  assert weights.shape == (2, 4, 5, 5)  # one per query head
  np.testing.assert_allclose(fused, expected, **TOL)
  assert none is None


def test_num_kv_heads_none_keeps_the_layer_bitwise():
  x = _inputs(2, 5, 8)
  plain, grouped = (MultiHeadAttention(num_heads=2, num_kv_heads=n)
                    for n in (None, 2))
  params = _init(plain, x)
  jax.tree.map(np.testing.assert_array_equal, params, _init(grouped, x))
  jax.tree.map(np.testing.assert_array_equal, plain.apply(params, x),
               grouped.apply(params, x))


def test_grouped_decoding_caches_key_value_heads_only():
  x = _inputs(2, 3, 8)
  layer = MultiHeadAttention(num_heads=4, num_kv_heads=2, qkv_features=8)
  decoder = layer.clone(decode=True)
  variables = jax.jit(decoder.init)(jax.random.key(0), x)
  assert variables["cache"]["cached_key"].shape == (2, 3, 2, 2)
  params = {"params": variables["params"]}
  expected, _ = jax.jit(lambda p: layer.apply(p, x, mask=att.causal_mask(3)))(
      params)
  step = jax.jit(lambda cache, x_t: decoder.apply(
      params | {"cache": cache}, x_t, mutable=["cache"]))
  cache = variables["cache"]
  for t in range(3):
    (out, _), state = step(cache, x[:, t:t + 1])
    cache = state["cache"]
    np.testing.assert_allclose(out[:, 0], expected[:, t], **TOL)


# -------------------------------------------------------- transformations


def test_vmap_over_batch_equals_batched_call():
  x = _inputs(3, 5, 8)
  layer = MultiHeadAttention(num_heads=2)
  params = _init(layer, x)
  valid_lens = jnp.array([5, 2, 3])
  batched = layer.apply(params, x, valid_lens=valid_lens)
  mapped = jax.vmap(lambda xi, vl: layer.apply(params, xi, valid_lens=vl))(
      x, valid_lens)
  for a, b in zip(batched, mapped):
    np.testing.assert_allclose(a, b, **TOL)


def test_vmap_over_head_masks_equals_loop():
  x = _inputs(2, 5, 8)
  layer = MultiHeadAttention(num_heads=4, qkv_features=8)
  params = _jit_init(layer, x)
  masks = 1.0 - jnp.eye(4)  # leave-one-out
  run = lambda hm: layer.apply(params, x, head_mask=hm)[0]
  mapped = jax.jit(jax.vmap(run))(masks)
  loop = jax.jit(run)  # one program for the loop, not op by op
  for i in range(4):
    np.testing.assert_allclose(mapped[i], loop(masks[i]), **TOL)


def test_vmap_over_stacked_parameters_equals_loop():
  x = _inputs(2, 5, 8)
  layer = MultiHeadAttention(num_heads=2)
  stacked = jax.vmap(lambda k: layer.init(k, x))(
      jax.random.split(jax.random.key(0), 3))
  mapped_out, mapped_w = jax.vmap(lambda p: layer.apply(p, x))(stacked)
  for i in range(3):
    p = jax.tree.map(lambda a: a[i], stacked)
    out, w = layer.apply(p, x)
    np.testing.assert_allclose(mapped_out[i], out, **TOL)
    np.testing.assert_allclose(mapped_w[i], w, **TOL)


def test_jit_equals_no_jit():
  x = _inputs(2, 5, 8)
  layer = MultiHeadAttention(num_heads=2)
  params = _init(layer, x)
  kwargs = dict(valid_lens=jnp.array([3, 5]), head_mask=jnp.array([1.0, .5]))
  eager = layer.apply(params, x, **kwargs)
  jitted = jax.jit(lambda p, x: layer.apply(p, x, **kwargs))(params, x)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, **TOL)


def test_grad_through_everything_is_finite():
  x = _inputs(2, 5, 8)
  layer = MultiHeadAttention(num_heads=2)
  params = _init(layer, x)

  def loss(p, x, hm):
    out, w = layer.apply(p, x, valid_lens=jnp.array([2, 5]), head_mask=hm)
    return jnp.sum(out ** 2) + jnp.sum(w ** 2)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, jnp.ones(2))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


# ------------------------------------------------------- dropout, fused path


def test_dropout_only_when_not_deterministic():
  x = _inputs(2, 6, 16)
  # Per-element dropout (the model's); Flax's broadcast default is tested
  # with the drop-in tests.
  layer = MultiHeadAttention(num_heads=4, dropout_rate=0.5,
                             broadcast_dropout=False)
  params = _init(layer, x, deterministic=True)
  reference, ref_w = MultiHeadAttention(num_heads=4).apply(params, x)
  det, det_w = layer.apply(params, x, deterministic=True)
  np.testing.assert_allclose(det, reference, **TOL)
  rngs = {"dropout": jax.random.key(1)}
  noisy, noisy_w = layer.apply(params, x, deterministic=False, rngs=rngs)
  assert not np.allclose(noisy, reference, atol=1e-3)
  # The returned weights are the softmax before dropout.
  np.testing.assert_allclose(noisy_w, ref_w, **TOL)
  again, _ = layer.apply(params, x, deterministic=False, rngs=rngs)
  np.testing.assert_array_equal(noisy, again)
  # Dropout also works on the no-weights path (it falls back to the
  # explicit computation) and never returns weights there.
  out, w = layer.apply(params, x, deterministic=False, rngs=rngs,
                       return_weights=False)
  assert w is None
  np.testing.assert_array_equal(out, noisy)


def test_dot_product_attention_dropout_needs_rng():
  q = _inputs(4, 2, 3)
  with pytest.raises(ValueError, match="dropout_rng"):
    # Traced, not run: the check is Python's, the same eagerly.
    jax.eval_shape(lambda q: dot_product_attention(
        q, q, q, dropout_rate=0.1, deterministic=False), q)


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_fused_path_equals_weights_path(batch):
  x = _inputs(*batch, 6, 16)
  layer = MultiHeadAttention(num_heads=4)
  params = _jit_init(layer, x)
  valid_lens = np.full(batch, 4, np.int32)  # host arrays: no eager programs
  mask = np.ones(batch + (1, 6, 6), bool)
  mask[..., 2, :] = False
  kwargs = dict(valid_lens=valid_lens, mask=mask,
                head_mask=jnp.array([1.0, 0.0, 0.5, 1.0]))
  # Both paths in one program: eagerly each operation compiles alone.
  (with_weights, _), (fused, none) = jax.jit(lambda p: (
      layer.apply(p, x, **kwargs),
      layer.apply(p, x, return_weights=False, **kwargs)))(params)
  assert none is None
  np.testing.assert_allclose(fused, with_weights, **TOL)


@pytest.mark.slow  # over 2 s on 2 cores: the full suite only
def test_library_path_equals_explicit_math():
  # On CPU the fused path runs the explicit math; the branch other platforms
  # take (jax.nn.dot_product_attention) must agree, fully masked rows too.
  q, k, v = (_inputs(2, 6, 4, 8, seed=s) for s in range(3))  # [B, L, H, Dh]
  mask = np.ones((2, 4, 6, 6), bool)  # host arrays: no eager programs
  mask[:, :, 3, :] = False
  mask[1, :, :, 4:] = False
  lengths = np.array([0, 4], np.int32)  # cuDNN's padding form, a 0 too
  library = functools.partial(kernels.library_attention, implementation="xla")

  @jax.jit  # one program: eagerly each operation compiles alone
  def run(q, k, v, m, lengths):
    return dict(
        masked=(library(q, k, v, mask=m, kv_lengths=None),
                dot_product_attention(q, k, v, mask=m)[0]),
        unmasked=(library(q, k, v, mask=None, kv_lengths=None)[0],
                  dot_product_attention(q, k, v)[0]),
        lengths=(library(q, k, v, mask=None, kv_lengths=lengths)[0],
                 dot_product_attention(q, k, v, mask=(
                     att.padding_mask_from_lengths(lengths, 6)))[0]))

  r = jax.device_get(run(q, k, v, mask, lengths))
  (got, none), expected = r["masked"]
  assert none is None
  np.testing.assert_allclose(got, expected, **TOL)
  np.testing.assert_array_equal(got[:, 3], 0.0)  # no key: zero context
  np.testing.assert_allclose(*r["unmasked"], **TOL)
  # Key lengths (cuDNN's padding form), a length of 0 included.
  np.testing.assert_allclose(*r["lengths"], **TOL)


# ------------------------------------------------- masked rows under autodiff


@pytest.mark.slow
def test_gradients_through_masked_keys_and_fully_masked_rows_are_zero():
  """jax.nn.softmax differentiated as JAX does it: masked keys get exactly
  zero weight and gradient, and a query with no key to attend to an all-zero
  row and a zero gradient, never NaN."""
  q, k, v = (_inputs(2, 4, 2, 8, seed=s) for s in range(3))  # [B, L, H, Dh]
  mask = np.ones((2, 2, 4, 4), bool)  # host arrays: no eager programs
  mask[0, :, :, 3:] = False
  mask[1, :, 2, :] = False  # a query with no key

  def loss(q, k, v):
    context, weights = dot_product_attention(q, k, v, mask=mask)
    return jnp.sum(context ** 2) + jnp.sum(jnp.sin(weights))

  # One program, not op by op.
  weights, grads = jax.device_get(jax.jit(lambda q, k, v: (
      dot_product_attention(q, k, v, mask=mask)[1],
      jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v))
  assert np.all(weights[~mask] == 0.0)
  np.testing.assert_array_equal(weights[1, :, 2], 0.0)
  for grad in grads:
    assert np.all(np.isfinite(grad))
  np.testing.assert_array_equal(grads[0][1, 2], 0.0)  # the query's gradient
  np.testing.assert_array_equal(grads[1][0, 3:], 0.0)  # masked keys'


# ------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, match", [
    (lambda L, x: L(num_heads=3).init(jax.random.key(0), x),
     r"qkv_features \(16\) must be divisible by num_heads \(3\)"),
    (lambda L, x: L(num_heads=4).init(jax.random.key(0), x,
                                      _inputs(3, 5, 16)),
     r"inputs_q.*\(2, 5, 16\).*inputs_k.*\(3, 5, 16\)"),
    (lambda L, x: L(num_heads=4).init(jax.random.key(0), x,
                                      valid_lens=jnp.ones((3,), int)),
     r"`valid_lens` has shape \(3,\)"),
    (lambda L, x: L(num_heads=4).init(jax.random.key(0), x,
                                      head_mask=jnp.ones(3)),
     r"`head_mask` has shape \(3,\).*\[4\]"),
    (lambda L, x: L(num_heads=4).init(jax.random.key(0), x,
                                      mask=jnp.ones((2, 1, 5, 4), bool)),
     r"`mask` has shape \(2, 1, 5, 4\)"),
    (lambda L, x: L(num_heads=4, num_kv_heads=3).init(jax.random.key(0), x),
     r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (lambda L, x: dot_product_attention(_inputs(2, 5, 3, 4),
                                        *[_inputs(2, 5, 2, 4)] * 2),
     r"query heads \(3\) must be a multiple of key heads \(2\)"),
])
def test_bad_shapes_raise_value_error_naming_the_argument(call, match):
  x = _inputs(2, 5, 16)
  with pytest.raises(ValueError, match=match):
    call(MultiHeadAttention, x)


def test_bad_shapes_raise_at_trace_time_under_jit():
  x = _inputs(2, 5, 16)
  layer = MultiHeadAttention(num_heads=4)
  params = _jit_init(layer, x)
  with pytest.raises(ValueError, match="head_mask"):
    jax.jit(lambda p: layer.apply(p, x, head_mask=jnp.ones(5)))(params)
