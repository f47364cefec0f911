"""MultiHeadAttention as a drop-in for flax.linen.MultiHeadDotProductAttention.

One test per behaviour Flax's own linen attention tests check (written here,
not copied): the constructor and call, initialisers, dropout (broadcast,
explicit keys, the deterministic merge), sowing, the decode cache, causal
receptive fields, keys/values arguments, mixed precision, einsum factories,
the class alias. Most compare with Flax's layer on the same parameters.
Also the dtype errors (issue 13) and the fused kernels' selection and
weights from the log-sum-exp (issue 16).
"""

import dataclasses
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import attention as att
from mha import attention_kernels as kernels
from mha.attention import MultiHeadAttention, dot_product_attention

# float32 reductions over a few dozen terms: 1e-5 is ~100 ulps.
TOL = dict(atol=1e-5, rtol=1e-5)


def _x(*shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _both(**kwargs):
  return MultiHeadAttention(**kwargs), nn.MultiHeadDotProductAttention(
      **kwargs)


# ------------------------------------------------------ constructor, call


def test_every_flax_field_and_call_argument_with_its_default():
  theirs = [(f.name, f.default) for f in dataclasses.fields(
      nn.MultiHeadDotProductAttention) if f.name not in ("parent", "name")]
  ours = {f.name: f.default for f in dataclasses.fields(MultiHeadAttention)}
  names = [name for name, _ in theirs]
  assert list(ours)[:len(names)] == names  # Flax's order: positional too
  for name, default in theirs:
    if name == "attention_fn":  # ours: this module's, returning weights
      assert ours[name] is dot_product_attention
    else:
      assert ours[name] is default or ours[name] == default, name
  ours_call = inspect.signature(MultiHeadAttention.__call__).parameters
  for name, p in inspect.signature(
      nn.MultiHeadDotProductAttention.__call__).parameters.items():
    assert name in ours_call, name
    assert (ours_call[name].kind, ours_call[name].default) == (
        p.kind, p.default), name


@pytest.mark.parametrize("kwargs", [
    dict(num_heads=2),
    dict(num_heads=2, qkv_features=8, out_features=6, normalize_qk=True,
         bias_init=nn.initializers.uniform()),
])
def test_same_parameters_and_outputs_as_flax(kwargs):
  q, kv = _x(2, 3, 8), _x(2, 5, 8, seed=1)
  ours, theirs = _both(**kwargs)
  mask = att.padding_mask_from_lengths(jnp.array([5, 2]), 5)
  # Eager, both: the same operations give the same bits on any backend.
  ours_params = ours.init(jax.random.key(3), q, kv)
  their_params = theirs.init(jax.random.key(3), q, kv)
  jax.tree.map(np.testing.assert_array_equal, ours_params, their_params)
  out, weights = jax.jit(ours.apply)(ours_params, q, kv, mask=mask)
  np.testing.assert_allclose(
      out, jax.jit(theirs.apply)(ours_params, q, kv, mask=mask), **TOL)
  assert weights.shape == (2, 2, 3, 5)


def test_out_initializers_apply_to_the_out_layer_only():
  layer = MultiHeadAttention(num_heads=2, kernel_init=nn.initializers.ones,
                             out_kernel_init=nn.initializers.zeros,
                             bias_init=nn.initializers.zeros,
                             out_bias_init=nn.initializers.ones)
  x = _x(2, 3, 4)
  # Jitted: eagerly each operation compiles alone.
  params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
  for name in ("query", "key", "value"):
    np.testing.assert_array_equal(params[name]["kernel"], 1.0)
    np.testing.assert_array_equal(params[name]["bias"], 0.0)
  np.testing.assert_array_equal(params["out"]["kernel"], 0.0)
  np.testing.assert_array_equal(params["out"]["bias"], 1.0)
  out, _ = jax.jit(layer.apply)({"params": params}, x)
  np.testing.assert_array_equal(out, 1.0)  # zero kernel, bias of ones


def test_flax_alias_swaps_for_ours_in_a_parent_module():
  # Flax's nn.MultiHeadAttention alias is auto-named MultiHeadAttention_0,
  # as ours is: a parent written for it gets the same parameter paths.
  class Parent(nn.Module):
    layer: type

    @nn.compact
    def __call__(self, x):
      out = self.layer(num_heads=2)(x)
      return out[0] if isinstance(out, tuple) else out

  x = _x(2, 3, 4)
  flax_params = Parent(nn.MultiHeadAttention).init(jax.random.key(0), x)
  ours_params = Parent(MultiHeadAttention).init(jax.random.key(0), x)
  jax.tree.map(np.testing.assert_array_equal, ours_params, flax_params)
  np.testing.assert_allclose(
      Parent(MultiHeadAttention).apply(flax_params, x),
      Parent(nn.MultiHeadAttention).apply(flax_params, x), **TOL)


def test_keys_and_values_arguments_resolve_as_in_flax():
  q, kv = _x(3, 4), _x(5, 4, seed=1)
  layer = MultiHeadAttention(num_heads=2)
  params = layer.init(jax.random.key(0), q, kv)
  both = layer.apply(params, q, inputs_k=kv, inputs_v=kv)[0]
  np.testing.assert_array_equal(layer.apply(params, q, kv)[0], both)
  with pytest.warns(DeprecationWarning, match="inputs_kv arg will be"):
    np.testing.assert_array_equal(
        layer.apply(params, q, inputs_kv=kv)[0], both)
  with pytest.raises(ValueError, match="`inputs_k` cannot be None"):
    layer.apply(params, q, inputs_v=kv)
  with pytest.raises(ValueError, match="`inputs_kv` must be None"):
    layer.apply(params, q, kv, inputs_kv=kv)
  # A mask passed where inputs_v goes: Flax's warning, then a shape error.
  square = np.ones((1, 5, 5), bool)  # a host array: no eager program
  with pytest.warns(DeprecationWarning, match="intended to pass it to the"):
    with pytest.raises(ValueError, match="inputs_v"):
      layer.apply(params, q[None], kv[None], square)


# ----------------------------------------------------------------- dropout


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_equals_flax_with_the_same_key(broadcast):
  x = _x(3, 4, 8)
  ours, theirs = _both(num_heads=2, dropout_rate=0.5,
                       broadcast_dropout=broadcast, deterministic=False)
  params = ours.init(jax.random.key(0), x)
  rngs = {"dropout": jax.random.key(7)}
  out, weights = ours.apply(params, x, rngs=rngs)
  np.testing.assert_allclose(out, theirs.apply(params, x, rngs=rngs), **TOL)
  # The returned weights are those before dropout.
  np.testing.assert_allclose(
      weights, MultiHeadAttention(num_heads=2).apply(params, x)[1], **TOL)


def test_broadcast_dropout_shares_one_mask_over_batch_and_heads():
  # Host arrays: no eager programs.
  value = np.broadcast_to(np.eye(5, dtype=np.float32)[None, :, None, :],
                          (3, 5, 2, 5))
  q = np.zeros((3, 4, 2, 5), np.float32)  # uniform weights, value = identity
  for broadcast in (True, False):
    context, _ = jax.jit(dot_product_attention, static_argnames=(
        "broadcast_dropout", "dropout_rate", "deterministic"))(
        q, q[:, :1].repeat(5, 1), value, broadcast_dropout=broadcast,
        dropout_rng=jax.random.key(1), dropout_rate=0.5, deterministic=False)
    dropped = np.asarray(context) == 0  # [B, Lq, H, Lk]: key k dropped
    same = (dropped == dropped[:1, :, :1]).all()
    assert same == broadcast


def test_explicit_dropout_rng_wins_over_the_dropout_stream():
  class Two(nn.Module):

    @nn.compact
    def __call__(self, x, dropout_rng=None):
      # Equal parameters in both layers: only dropout tells them apart.
      layer = lambda: MultiHeadAttention(
          num_heads=2, dropout_rate=0.5, deterministic=False,
          kernel_init=nn.initializers.constant(0.3))
      return (layer()(x, dropout_rng=dropout_rng)[0],
              layer()(x, dropout_rng=dropout_rng)[0])

  x = _x(2, 3, 4)
  params = Two().init({"params": jax.random.key(0),
                       "dropout": jax.random.key(1)}, x)
  a, b = Two().apply(params, x, rngs={"dropout": jax.random.key(2)})
  assert not np.array_equal(a, b)  # two layers, two streams
  c, d = Two().apply(params, x, rngs={"dropout": jax.random.key(3)},
                     dropout_rng=jax.random.key(4))
  e, f = Two().apply(params, x, dropout_rng=jax.random.key(4))
  np.testing.assert_array_equal(c, d)  # one key given: one mask
  np.testing.assert_array_equal(c, e)  # the streams did not matter
  np.testing.assert_array_equal(e, f)


def test_deterministic_field_merges_with_the_call_argument():
  x = _x(2, 3, 4)
  field = MultiHeadAttention(num_heads=2, dropout_rate=0.5,
                             deterministic=True)
  params = field.init(jax.random.key(0), x)  # no dropout key needed
  plain = MultiHeadAttention(num_heads=2).apply(params, x)[0]
  np.testing.assert_array_equal(field.apply(params, x)[0], plain)
  call = MultiHeadAttention(num_heads=2, dropout_rate=0.5)
  np.testing.assert_array_equal(
      call.apply(params, x, deterministic=True)[0], plain)
  with pytest.raises(ValueError, match="must be passed to the constructor"):
    call.apply(params, x)
  with pytest.raises(ValueError, match="passed to the constructor and at"):
    field.apply(params, x, deterministic=False)
  # Without dropout it is needed nowhere, and no key is drawn.
  np.testing.assert_array_equal(
      MultiHeadAttention(num_heads=2, deterministic=False).apply(params, x)[0],
      plain)


# ------------------------------------------------------------------ sowing


def test_sow_weights_where_flax_sows_them():
  class Stack(nn.Module):
    layer: type

    @nn.compact
    def __call__(self, x, sow):
      for i in range(2):
        out = self.layer(num_heads=2)(x, sow_weights=sow and i == 0)
        x = out[0] if isinstance(out, tuple) else out
      return x

  x = _x(2, 3, 4)
  params = Stack(nn.MultiHeadDotProductAttention).init(jax.random.key(0), x,
                                                       False)
  ours = Stack(MultiHeadAttention)
  renamed = {"params": {k.replace("MultiHeadDotProductAttention",
                                  "MultiHeadAttention"): v
                        for k, v in params["params"].items()}}
  _, state = ours.apply(renamed, x, True, mutable=["intermediates"])
  _, flax_state = Stack(nn.MultiHeadDotProductAttention).apply(
      params, x, True, mutable=["intermediates"])
  (sown,) = state["intermediates"]["MultiHeadAttention_0"]["attention_weights"]
  (flax_sown,) = flax_state["intermediates"]["MultiHeadDotProductAttention_0"][
      "attention_weights"]
  np.testing.assert_allclose(sown, flax_sown, **TOL)
  assert list(state["intermediates"]) == ["MultiHeadAttention_0"]
  _, state = ours.apply(renamed, x, False, mutable=["intermediates"])
  assert "intermediates" not in state
  # Sowing without returning: the weights are computed for the sow alone.
  layer = MultiHeadAttention(num_heads=2)
  p = {"params": renamed["params"]["MultiHeadAttention_0"]}
  (out, none), state = layer.apply(p, x, sow_weights=True,
                                   return_weights=False,
                                   mutable=["intermediates"])
  assert none is None
  np.testing.assert_allclose(state["intermediates"]["attention_weights"][0],
                             layer.apply(p, x)[1], **TOL)


# ------------------------------------------------------------ decode cache


def test_decoding_one_position_at_a_time_equals_causal_attention():
  length, heads = 4, 2
  x = _x(2, 3, length, 6)  # two batch axes
  layer = MultiHeadAttention(num_heads=heads, qkv_features=8,
                             precision=jax.lax.Precision.HIGHEST)
  decoder = layer.clone(decode=True)
  # Jitted (eagerly each operation compiles alone); Flax's cache only traced:
  # its shapes and dtypes are compared.
  variables = jax.jit(decoder.init)(jax.random.key(0), x)
  cache = variables["cache"]
  flax_decoder = nn.MultiHeadDotProductAttention(num_heads=heads,
                                                qkv_features=8, decode=True)
  flax_cache = jax.eval_shape(flax_decoder.init, jax.random.key(0),
                              x)["cache"]
  assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == jax.tree.map(
      lambda a: (a.shape, a.dtype), flax_cache)
  params = {"params": variables["params"]}
  expected, expected_w = jax.jit(
      lambda p: layer.apply(p, x, mask=att.causal_mask(length)))(params)

  @jax.jit
  def step(cache, x_t):
    (out, weights), state = decoder.apply(params | {"cache": cache}, x_t,
                                          mutable=["cache"])
    return state["cache"], out, weights

  # Slices on the host: eagerly each slice compiles alone.
  x_host, expected, expected_w = jax.device_get((x, expected, expected_w))
  for t in range(length):
    cache, out, weights = step(cache, x_host[..., t:t + 1, :])
    out, weights = jax.device_get((out, weights))
    np.testing.assert_allclose(out[..., 0, :], expected[..., t, :], **TOL)
    np.testing.assert_allclose(weights[..., 0, :], expected_w[..., t, :],
                               **TOL)
  assert int(cache["cache_index"]) == length
  with pytest.raises(ValueError, match="Autoregressive cache shape error"):
    # Traced, not run: the check is on shapes, the same eagerly.
    jax.eval_shape(lambda c, x: decoder.apply(params | {"cache": c}, x,
                                              mutable=["cache"]),
                   cache, x[..., :2, :])


def test_decoding_under_x64():
  with jax.enable_x64(True):
    x = np.ones((1, 3, 4))  # float64, on the host: no eager programs
    decoder = MultiHeadAttention(num_heads=2, decode=True)
    # Jitted: eagerly each operation compiles alone.
    variables = jax.jit(decoder.init)(jax.random.key(0), x)
    step = jax.jit(lambda v, x_t: decoder.apply(v, x_t, mutable=["cache"]))
    for t in range(2):
      (out, _), state = step(variables, x[:, t:t + 1])
      variables = {"params": variables["params"], **state}
      assert out.shape == (1, 1, 4)
    assert variables["cache"]["cache_index"].dtype == jnp.int32


def test_causal_receptive_field():
  length = 6
  x = _x(1, length, 2)
  layer = MultiHeadAttention(num_heads=1, kernel_init=nn.initializers.ones)
  # Jitted, as the jacobian is: eagerly each operation compiles alone.
  params = jax.jit(layer.init)(jax.random.key(0), x)
  mask = jax.jit(nn.make_causal_mask)(
      np.ones((1, length), np.float32))  # Flax's: f32

  # d out[i] / d x[j] for every i, j at once: nonzero exactly for j <= i.
  jacobian = jax.jit(jax.jacrev(
      lambda x: layer.apply(params, x, mask=mask)[0]))(x)
  reached = np.any(np.abs(np.asarray(jacobian)[0]) > 0,
                   axis=(1, 2, 4))  # [i, j]
  np.testing.assert_array_equal(reached, np.tril(np.ones((length, length))))


# --------------------------------------------- precision, einsums, attention_fn


@pytest.mark.parametrize("force_fp32", [True, False])
def test_mixed_precision_weights_dtype_as_flax(force_fp32):
  x = _x(2, 3, 4)
  ours, theirs = _both(num_heads=2, dtype=jnp.bfloat16,
                       force_fp32_for_softmax=force_fp32)
  params = ours.init(jax.random.key(0), x)
  (out, weights), state = ours.apply(params, x, sow_weights=True,
                                     mutable=["intermediates"])
  flax_out, flax_state = theirs.apply(params, x, sow_weights=True,
                                      mutable=["intermediates"])
  expected = jnp.float32 if force_fp32 else jnp.bfloat16
  assert weights.dtype == expected
  assert state["intermediates"]["attention_weights"][0].dtype == expected
  assert flax_state["intermediates"]["attention_weights"][0].dtype == expected
  assert out.dtype == flax_out.dtype == jnp.bfloat16
  # bfloat16 keeps ~3 significant digits; ours runs the softmax in float32
  # where Flax (without force_fp32) does not: outputs of size ~1 agree to a
  # few bfloat16 ulps.
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(flax_out, np.float32), atol=3e-2)
  # Without the weights, the same output: with force_fp32 the float32
  # weights still multiply the values (the fused kernels' weights would be
  # bfloat16, one ulp off); without it, on CPU the fused path is the same
  # math (a GPU's cuDNN kernel is not).
  fused_out, none = ours.apply(params, x, return_weights=False)
  assert none is None
  if force_fp32 or jax.default_backend() == "cpu":
    np.testing.assert_array_equal(np.asarray(fused_out, np.float32),
                                  np.asarray(out, np.float32))


def test_einsum_and_dot_general_factories_are_used():
  calls = []

  def counting(name):
    def einsum(*args, **kwargs):
      calls.append(name)
      return jnp.einsum(*args, **kwargs)
    return lambda: einsum

  def dot_general(*args, **kwargs):
    calls.append("dot_general")
    return jax.lax.dot_general(*args, **kwargs)

  x = _x(2, 3, 4)
  plain = MultiHeadAttention(num_heads=2)
  params = plain.init(jax.random.key(0), x)
  custom = MultiHeadAttention(
      num_heads=2, qk_attn_weights_einsum_cls=counting("qk"),
      attn_weights_value_einsum_cls=counting("av"),
      qkv_dot_general=dot_general, out_dot_general=dot_general)
  for return_weights in (True, False):
    calls.clear()
    np.testing.assert_allclose(
        custom.apply(params, x, return_weights=return_weights)[0],
        plain.apply(params, x)[0], **TOL)
    assert calls.count("qk") == calls.count("av") == 1
    assert calls.count("dot_general") == 4
  with pytest.raises(ValueError, match="must be specified together"):
    MultiHeadAttention(num_heads=2, qk_attn_weights_einsum_cls=counting(
        "qk")).apply(params, x)
  with pytest.raises(ValueError, match="mutually exclusive"):
    dot_product_attention(x[..., None], x[..., None], x[..., None],
                          precision=jax.lax.Precision.HIGHEST,
                          qk_attn_weights_einsum=jnp.einsum,
                          attn_weights_value_einsum=jnp.einsum)


def test_another_attention_fn_is_called_as_flax_calls_it():
  x = _x(2, 3, 4)
  ours = MultiHeadAttention(num_heads=2,
                            attention_fn=nn.dot_product_attention)
  theirs = nn.MultiHeadDotProductAttention(num_heads=2)
  params = ours.init(jax.random.key(0), x)
  (out, weights), state = ours.apply(params, x, sow_weights=True,
                                     mutable=["intermediates"])
  assert weights is None  # Flax's function returns the context alone
  flax_out, flax_state = theirs.apply(params, x, sow_weights=True,
                                      mutable=["intermediates"])
  np.testing.assert_allclose(out, flax_out, **TOL)
  np.testing.assert_allclose(state["intermediates"]["attention_weights"][0],
                             flax_state["intermediates"][
                                 "attention_weights"][0], **TOL)
  # A function returning (context, weights) gives its weights back.
  pair = MultiHeadAttention(
      num_heads=2, attention_fn=lambda q, k, v, mask=None: (
          dot_product_attention(q, k, v, mask=mask)))
  out, weights = pair.apply(params, x)
  np.testing.assert_allclose(weights, ours.clone(
      attention_fn=dot_product_attention).apply(params, x)[1], **TOL)


# ------------------------------------------------------------- dtypes (#13)


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int32])
@pytest.mark.parametrize("argument", ["inputs_q", "inputs_k", "inputs_v"])
def test_complex_or_integer_layer_inputs_raise(dtype, argument):
  x = _x(2, 3, 4)
  inputs = dict(inputs_q=x, inputs_k=x, inputs_v=x)
  inputs[argument] = inputs[argument].astype(dtype)
  layer = MultiHeadAttention(num_heads=2)
  with pytest.raises(ValueError,
                     match=f"`{argument}` has dtype {jnp.dtype(dtype)}"):
    layer.init(jax.random.key(0), **inputs)


@pytest.mark.parametrize("fn", [dot_product_attention,
                                att.fused_dot_product_attention])
def test_complex_or_integer_query_key_value_raise(fn):
  q = _x(3, 2, 4)
  for argument in ("query", "key", "value"):
    for dtype in (jnp.complex64, jnp.int8):
      arrays = dict(query=q, key=q, value=q)
      arrays[argument] = q.astype(dtype)
      with pytest.raises(ValueError,
                         match=f"`{argument}` has dtype {jnp.dtype(dtype)}"):
        fn(arrays["query"], arrays["key"], arrays["value"])


# ----------------------------------------- fused kernels (selection, weights)

H100 = kernels.DeviceFacts("cuda", "9.0", 91000)
A100 = kernels.DeviceFacts("cuda", "8.0", 90100)


@pytest.mark.parametrize("facts, kwargs, expected", [
    (H100, {}, "cudnn"),
    (A100, {}, "cudnn"),
    (H100, dict(dtype=jnp.float16), "cudnn"),
    (kernels.DeviceFacts("cpu"), {}, "xla"),
    (kernels.DeviceFacts("tpu"), {}, "xla"),
    (kernels.DeviceFacts("rocm", None, None), {}, "xla"),
    (kernels.DeviceFacts("cuda", "9.0", None), {}, "xla"),  # no cuDNN
    (kernels.DeviceFacts("cuda", "7.5", 91000), {}, "xla"),  # pre-Ampere
    (kernels.DeviceFacts("cuda", "10.3", 91000), {}, "xla"),
    (kernels.DeviceFacts("cuda", "10.3", 91100), {}, "cudnn"),
    (H100, dict(dtype=jnp.float32), "xla"),
    (H100, dict(head_dim=60, value_head_dim=60), "xla"),  # not 8k
    (H100, dict(head_dim=256, value_head_dim=256), "cudnn"),
    (A100, dict(head_dim=256, value_head_dim=256), "xla"),  # > 128 pre-Hopper
    (H100, dict(value_head_dim=32), "xla"),
    (H100, dict(mask_form="lengths"), "cudnn"),
    (H100, dict(mask_form="array"), "cudnn"),
    (H100, dict(mask_form="array", q_len=63), "xla"),  # bias: even lengths
    (H100, dict(mask_form="none", q_len=63), "cudnn"),
    (H100, dict(size=0), "xla"),
])
def test_select_implementation(facts, kwargs, expected):
  args = dict(dtype=jnp.bfloat16, head_dim=64, value_head_dim=64, q_len=128,
              kv_len=128, mask_form="none") | kwargs
  assert kernels.select_implementation(facts, **args) == expected


def test_select_implementation_refuses_an_unknown_mask_form():
  with pytest.raises(ValueError, match="mask_form"):
    kernels.select_implementation(H100, dtype=jnp.bfloat16, head_dim=64,
                                  value_head_dim=64, q_len=8, kv_len=8,
                                  mask_form="causal")


def _qkv_mask(dtype=jnp.float32):
  q, k, v = (_x(2, 6, 2, 8, seed=s, dtype=dtype) for s in range(3))
  mask = np.ones((2, 2, 6, 6), bool)  # host arrays: no eager programs
  mask[:, :, 3, :] = False  # no key
  mask[1, :, :, 4:] = False
  return q, k, v, mask


@pytest.mark.slow
def test_weights_rebuilt_from_the_log_sum_exp_equal_the_unfused_ones():
  q, k, v, mask = _qkv_mask()
  rebuild = lambda q, k, v, mask, lengths=None: kernels.library_attention(
      q, k, v, mask=mask, kv_lengths=lengths, implementation="xla",
      return_weights=True)
  one_head = mask[:, :1]  # [B, 1, Lq, Lk]: one mask for every head

  @jax.jit  # the reference in one program: eagerly each op compiles alone
  def reference(m, lengths):
    full = m if lengths is None else att.padding_mask_from_lengths(lengths, 6)
    full = jnp.broadcast_to(full, (2, 2, 6, 6))
    return dot_product_attention(q, k, v, mask=full)

  for m, lengths in ((mask, None), (one_head, None),
                     (None, np.array([6, 0], np.int32))):
    context, weights = jax.jit(rebuild)(q, k, v, m, lengths)
    expected_context, expected = reference(m, lengths)
    assert weights.dtype == jnp.float32
    np.testing.assert_allclose(weights, expected, **TOL)
    np.testing.assert_allclose(context, expected_context, **TOL)
  np.testing.assert_array_equal(np.asarray(weights)[1], 0.0)  # zero rows

  # Gradients through the rebuilt weights equal the unfused ones.
  def loss(attention, q, k):
    context, weights = attention(q, k)
    return jnp.sum(jnp.sin(weights)) + jnp.sum(context ** 2)

  fused = lambda q, k: rebuild(q, k, v, mask)
  unfused = lambda q, k: dot_product_attention(q, k, v, mask=mask)
  grad = jax.jit(jax.grad(loss, (1, 2)), static_argnums=0)
  for a, b in zip(grad(fused, q, k), grad(unfused, q, k)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)  # two orders


def test_bfloat16_residual_is_renormalised():
  q, k, v, mask = _qkv_mask(jnp.bfloat16)
  _, weights = jax.jit(lambda q, k, v, m: kernels.library_attention(
      q, k, v, mask=m, kv_lengths=None, implementation="xla",
      return_weights=True))(q, k, v, mask)
  # The casts in the reference's program: eagerly each compiles alone.
  _, expected = jax.jit(lambda q, k, v, m: dot_product_attention(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      mask=m))(q, k, v, mask)
  # The logits come from the same bfloat16 inputs, in float32: the weights
  # agree to float32 rounding once the bfloat16 log-sum-exp is renormalised
  # (without, rows would sum to 1 +- ~1%).
  np.testing.assert_allclose(weights, expected, atol=1e-5, rtol=1e-4)
  np.testing.assert_allclose(jnp.sum(weights, -1)[:, :, :3], 1.0, rtol=1e-6)


@pytest.mark.skipif(kernels.device_facts().platform == "cuda",
                    reason="on a GPU cuDNN does not refuse (the call itself: "
                    "test_cudnn_path_on_a_gpu_equals_xla)")
def test_a_refused_cudnn_choice_falls_back_to_xla():
  # On a CPU, facts claiming an H100 make the rule pick cuDNN; its call
  # refuses at trace time (no cuDNN) and XLA runs instead.
  q, k, v, mask = _qkv_mask(jnp.bfloat16)
  assert kernels.select_implementation(
      H100, dtype=q.dtype, head_dim=8, value_head_dim=8, q_len=6, kv_len=6,
      mask_form="array") == "cudnn"
  got, weights = jax.jit(lambda q, k, v, m: kernels.fused_attention(
      q, k, v, mask=m, kv_lengths=None, return_weights=True, facts=H100))(
          q, k, v, mask)
  expected, _ = jax.jit(lambda q, k, v, m: kernels.library_attention(
      q, k, v, mask=m, kv_lengths=None, implementation="xla"))(q, k, v, mask)
  np.testing.assert_array_equal(got, expected)
  assert weights.shape == (2, 2, 6, 6)


@pytest.mark.skipif(kernels.device_facts().platform == "cuda",
                    reason="the default device's facts are a GPU's here")
def test_the_platform_branch_is_traced_only_where_cudnn_can_run(monkeypatch):
  # Without cuDNN (this CPU), the fused path is one plain program: no
  # platform branch to trace. Where the rule picks cuDNN (facts claiming an
  # H100, 16-bit floats), the kernel is chosen when lowering: the CPU variant
  # is the plain math, and the program lowers for CUDA too. (A new function
  # each time: JAX keeps a function's trace.)
  q, k, v, mask = _qkv_mask(jnp.bfloat16)
  fused = lambda: lambda q, k, v, m: att.fused_dot_product_attention(
      q, k, v, mask=m)
  plain = fused()
  assert "platform_index" not in str(jax.make_jaxpr(plain)(q, k, v, mask))
  monkeypatch.setattr(kernels, "device_facts", lambda: H100)
  assert "platform_index" in str(jax.make_jaxpr(fused())(q, k, v, mask))
  exported = jax.export.export(jax.jit(fused()), platforms=("cpu", "cuda"))(
      q, k, v, mask)
  np.testing.assert_array_equal(exported.call(q, k, v, mask),
                                jax.jit(plain)(q, k, v, mask))


def test_weights_from_lse_layer_option_on_cpu_is_the_unfused_path():
  x = _x(2, 5, 8)
  layer = MultiHeadAttention(num_heads=2, weights_from_lse=True)
  params = layer.init(jax.random.key(0), x)
  lengths = jnp.array([5, 2])
  out, weights = jax.jit(lambda p, x: layer.apply(p, x, valid_lens=lengths))(
      params, x)
  expected, expected_w = MultiHeadAttention(num_heads=2).apply(
      params, x, valid_lens=lengths)
  np.testing.assert_allclose(out, expected, **TOL)
  np.testing.assert_allclose(weights, expected_w, **TOL)
  assert weights.dtype == jnp.float32


def test_no_warning_on_a_plain_call():
  x = _x(2, 3, 4)
  layer = MultiHeadAttention(num_heads=2)
  params = layer.init(jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    layer.apply(params, x, x, x[..., :3, :])  # inputs_v not square


@pytest.mark.skipif(kernels.device_facts().platform != "cuda",
                    reason="needs an NVIDIA GPU (cuDNN)")
def test_cudnn_path_on_a_gpu_equals_xla():
  # On a GPU the rule picks cuDNN for bfloat16 with a supported head width;
  # its context and rebuilt weights equal XLA's (bfloat16 outputs: ~1e-2).
  q, k, v = (_x(2, 64, 2, 64, seed=s, dtype=jnp.bfloat16) for s in range(3))
  facts = kernels.device_facts()
  mask_cases = ((None, jnp.array([64, 17], jnp.int32)),
                (att.causal_mask(64)[None] & jnp.ones((2, 2, 64, 64), bool),
                 None))
  for mask, lengths in mask_cases:
    form = "array" if mask is not None else "lengths"
    assert kernels.select_implementation(
        facts, dtype=q.dtype, head_dim=64, value_head_dim=64, q_len=64,
        kv_len=64, mask_form=form) == "cudnn", facts
    run = lambda impl: jax.jit(lambda q, k, v: kernels.library_attention(
        q, k, v, mask=mask, kv_lengths=lengths, implementation=impl,
        return_weights=True))(q, k, v)
    (context, weights), (xla_context, xla_weights) = run("cudnn"), run("xla")
    np.testing.assert_allclose(np.asarray(context, np.float32),
                               np.asarray(xla_context, np.float32), atol=2e-2)
    np.testing.assert_allclose(weights, xla_weights, atol=2e-3)
