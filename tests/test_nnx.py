"""mha.nnx: the NNX layer as a drop-in for flax.nnx.MultiHeadAttention, and
the bridge that runs a trained Linen checkpoint from NNX.

One test per behaviour Flax 0.12.8's own NNX attention tests check (written
here, not copied): the constructor and call, sown weights, decoding from an
initialised cache (x64 included), keep_rngs, is_causal with padding and
cross-attention, consistency of parameters, in_kv_features, grouped-query
attention and bad head counts; plus dropout. Each compares with Flax's layer
built from the same ``nnx.Rngs``, hence on the same parameters.
"""

import inspect
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import attention as att
from mha import nnx as mha_nnx

# float32 reductions over a few dozen terms: 1e-5 is ~100 ulps.
TOL = dict(atol=1e-5, rtol=1e-5)


def _x(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _both(**kwargs):
  """Ours and Flax's layer from the same seed: the same parameters."""
  kwargs.setdefault("rngs", None)
  make = lambda cls: cls(**{**kwargs, "rngs": nnx.Rngs(0)})
  return make(mha_nnx.MultiHeadAttention), make(nnx.MultiHeadAttention)


def _params(layer):
  return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


def _assert_equal(a, b):
  """Two states (PRNG keys included) are equal, leaf by leaf."""
  def data(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.key_data(x)
    return x
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(data(x), data(y)),
               a, b)


# ------------------------------------------------- constructor, call, state


_NEWER_FLAX_ARGUMENTS = ("input_positions",)


def test_every_flax_argument_with_its_default_and_every_attribute():
  for method, extra in (("__init__", []),
                        ("__call__", ["valid_lens", "head_mask",
                                      "return_weights"])):
    theirs = inspect.signature(getattr(nnx.MultiHeadAttention, method))
    ours = inspect.signature(getattr(mha_nnx.MultiHeadAttention, method))
    # Arguments of newer Flax releases than the one installed (flax 0.12.12
    # added input_positions) are ours already.
    newer = [n for n in _NEWER_FLAX_ARGUMENTS if n not in theirs.parameters]
    assert ([n for n in ours.parameters if n not in newer]
            == list(theirs.parameters) + extra)
    for name, p in theirs.parameters.items():
      q = ours.parameters[name]
      assert q.kind == p.kind, name
      if name != "attention_fn":  # ours: mha.attention's, with the weights
        assert q.default is p.default or q.default == p.default, name
  ours, theirs = _both(num_heads=2, in_features=4, dropout_rate=0.1)
  assert set(vars(ours)) == set(vars(theirs))


@pytest.mark.parametrize("kwargs", [
    dict(num_heads=4, in_features=8, qkv_features=8, num_kv_heads=2,
         in_kv_features=6, normalize_qk=True, dropout_rate=0.5),
    dict(num_heads=2, in_features=8, out_features=4, use_bias=False),
])
def test_same_parameters_and_state_moves_between_the_two(kwargs):
  ours, theirs = _both(**kwargs)
  for layer in (ours, theirs):
    layer.init_cache((2, 3, 8))
  _assert_equal(nnx.state(ours), nnx.state(theirs))
  fresh = mha_nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(1))
  fresh.init_cache((2, 3, 8))
  nnx.update(fresh, nnx.state(theirs))  # Flax's state into ours ...
  nnx.update(theirs, nnx.state(ours))   # ... and ours into Flax's
  _assert_equal(nnx.state(fresh), nnx.state(ours))


def test_keep_rngs():
  for keep in (True, False):
    layer = mha_nnx.MultiHeadAttention(
        num_heads=2, in_features=4, dropout_rate=0.5, keep_rngs=keep,
        rngs=nnx.Rngs(42))
    if keep:
      _, _, rest = nnx.split(layer, nnx.Param, ...)
      assert isinstance(rest["rngs"]["count"], nnx.RngCount)
      assert isinstance(rest["rngs"]["key"], nnx.RngKey)
    else:
      assert layer.rngs is None


# ----------------------------------------------------------------- outputs


def test_same_outputs_as_flax_gqa_cross_attention_causal_and_padding():
  ours, theirs = _both(num_heads=4, in_features=8, qkv_features=8,
                       num_kv_heads=2, in_kv_features=6, normalize_qk=True)
  assert ours.key.kernel.shape == theirs.key.kernel.shape == (6, 2, 2)
  q, kv = _x(2, 3, 8), _x(2, 5, 6, seed=1)
  padding = att.padding_mask_from_lengths(jnp.array([5, 2]), 5)
  calls = (dict(), dict(mask=padding), dict(is_causal=True),
           dict(mask=padding, is_causal=True))

  @nnx.jit
  def run(ours, theirs):
    return ([ours(q, kv, decode=False, **kw) for kw in calls],
            [theirs(q, kv, decode=False, **kw) for kw in calls],
            # Our valid_lens is Flax's mask of the same keys; fused path.
            ours(q, kv, decode=False, valid_lens=jnp.array([5, 2]),
                 is_causal=True, return_weights=False))

  results, expected, (fused, none) = run(ours, theirs)
  for (out, weights), want in zip(results, expected):
    np.testing.assert_allclose(out, want, **TOL)
    assert weights.shape == (2, 4, 3, 5)
  np.testing.assert_allclose(fused, expected[-1], **TOL)
  assert none is None


def test_input_positions_reach_an_attention_fn_that_takes_them():
  seen = {}

  def attention_fn(query, key, value, *, input_positions=None, **kwargs):
    seen["positions"] = input_positions
    return nnx.dot_product_attention(query, key, value, **kwargs)

  ours, theirs = _both(num_heads=2, in_features=8, attention_fn=attention_fn)
  x, positions = _x(2, 3, 8), jnp.array([[4., 5., 6.], [0., 1., 2.]])
  out, weights = ours(x, decode=False, input_positions=positions)
  np.testing.assert_array_equal(seen.pop("positions"), positions)
  if _NEWER_FLAX_ARGUMENTS[0] in inspect.signature(
      nnx.MultiHeadAttention.__call__).parameters:
    np.testing.assert_allclose(
        out, theirs(x, decode=False, input_positions=positions), **TOL)
  assert weights is None  # the attention_fn returned no weights
  ours(x, decode=False)
  assert seen["positions"] is None  # not passed when not given
  default, _ = _both(num_heads=2, in_features=8)
  with pytest.raises(ValueError, match="input_positions"):
    default(x, decode=False, input_positions=positions)


def test_head_mask_and_the_linen_layer_on_the_same_parameters():
  layer = mha_nnx.MultiHeadAttention(num_heads=4, in_features=8,
                                     qkv_features=8, num_kv_heads=2,
                                     decode=False, rngs=nnx.Rngs(0))
  linen = att.MultiHeadAttention(num_heads=4, qkv_features=8, num_kv_heads=2)
  params = {"params": _params(layer)}  # the Linen layer's tree exactly
  x, head_mask = _x(2, 5, 8), jnp.array([1.0, 0.0, 0.5, 1.0])
  kwargs = dict(valid_lens=jnp.array([5, 3]), head_mask=head_mask)
  masks = 1.0 - jnp.eye(4)  # leave-one-out

  @nnx.jit
  def run(layer):
    return (layer(x, **kwargs), linen.apply(params, x, **kwargs),
            # vmap over head masks, through the NNX module.
            nnx.vmap(lambda m, hm: m(x, head_mask=hm)[0],
                     in_axes=(None, 0))(layer, masks),
            layer(x, head_mask=masks[1])[0])

  ours, theirs, mapped, one = run(layer)
  for got, want in zip(ours, theirs):
    np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(mapped[1], one, **TOL)


def test_sow_weights_like_flax():
  ours, theirs = _both(num_heads=2, in_features=8, decode=False)
  x = _x(2, 4, 8)

  @nnx.jit
  def run(ours, theirs):
    sow = lambda m: m(x, sow_weights=True)
    return (nnx.capture(sow, nnx.Intermediate)(ours),
            nnx.capture(sow, nnx.Intermediate)(theirs),
            nnx.capture(lambda m: m(x), nnx.Intermediate)(ours)[1])

  ((_, weights), sown), (_, flax_sown), not_sown = run(ours, theirs)
  sown, flax_sown = nnx.to_pure_dict(sown), nnx.to_pure_dict(flax_sown)
  assert jax.tree.structure(sown) == jax.tree.structure(flax_sown)
  np.testing.assert_allclose(sown["attention_weights"][0], weights, **TOL)
  np.testing.assert_allclose(weights, flax_sown["attention_weights"][0],
                             **TOL)
  assert not nnx.to_pure_dict(not_sown)  # sown only when asked


def test_decoding_from_the_cache_like_flax():
  kwargs = dict(num_heads=4, in_features=8, qkv_features=8, num_kv_heads=2,
                decode=True, precision=jax.lax.Precision.HIGHEST)
  ours, theirs = _both(**kwargs)
  x = _x(2, 3, 8)
  x_host = np.asarray(x)  # sliced on the host: no eager programs
  with pytest.raises(ValueError, match="call ``init_cache`` first"):
    # Traced, not run: the check is Python's, raised the same way eagerly.
    nnx.jit(lambda m: m(x_host[:, :1]))(ours)
  for layer in (ours, theirs):
    layer.init_cache(x.shape)
  assert ours.cached_key.shape == (2, 3, 2, 2)
  expected, _ = nnx.jit(lambda m: m(x, decode=False, is_causal=True))(ours)
  step = nnx.jit(lambda m, f, x_t: (m(x_t), f(x_t)))
  expected = np.asarray(expected)
  for t in range(3):
    (out, _), flax_out = jax.device_get(step(ours, theirs, x_host[:, t:t + 1]))
    np.testing.assert_allclose(out[:, 0], expected[:, t], **TOL)
    np.testing.assert_allclose(out, flax_out, **TOL)
  assert int(ours.cache_index[...]) == 3
  with pytest.raises(ValueError, match="Autoregressive cache shape error"):
    nnx.jit(lambda m: m(x_host[:, :2]))(ours)  # traced, not run
  view = nnx.view(mha_nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0)),
                  decode=True, batch_size=2, max_length=3)
  assert view.cached_key.shape == (2, 3, 2, 2)


def test_decoding_under_x64():
  with jax.enable_x64(True):
    layer = mha_nnx.MultiHeadAttention(num_heads=2, in_features=4,
                                       decode=True, rngs=nnx.Rngs(0))
    layer.init_cache((1, 4, 4), dtype=jnp.float64)
    out, _ = nnx.jit(lambda m: m(jnp.ones((1, 1, 4))))(layer)
    assert out.shape == (1, 1, 4)
    assert layer.cache_index[...].dtype == jnp.int32
    assert int(layer.cache_index[...]) == 1


def test_dropout_like_flax():
  ours, theirs = _both(num_heads=2, in_features=8, dropout_rate=0.5,
                       decode=False)
  x, key = _x(2, 4, 8), jax.random.key(7)

  @nnx.jit
  def run(layer):
    return [layer(x, deterministic=False),
            layer(x, deterministic=False),  # the stream advances
            layer(x, deterministic=False, rngs=nnx.Rngs(dropout=key)),
            layer(x, deterministic=True)]

  ours_out = [out for out, _ in run(ours)]
  for got, want in zip(ours_out, run(theirs)):
    np.testing.assert_allclose(got, want, **TOL)
  assert not np.allclose(ours_out[0], ours_out[1])
  with pytest.raises(ValueError, match="deterministic"):
    ours(x)
  bare = mha_nnx.MultiHeadAttention(num_heads=2, in_features=8,
                                    dropout_rate=0.5, keep_rngs=False,
                                    decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="'rngs' must be provided"):
    bare(x, deterministic=False)


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=6, num_kv_heads=4),
     r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (dict(num_heads=5), r"qkv_features \(12\) must be divisible by "
     r"num_heads \(5\)"),
])
def test_bad_head_counts_raise_value_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mha_nnx.MultiHeadAttention(in_features=12, **kwargs, rngs=nnx.Rngs(0))


# ------------------------------------------------- a Linen checkpoint in NNX


@pytest.mark.slow  # trains the tiny run: the full suite only
def test_transformer_from_checkpoint_equals_the_linen_model(tiny_run):
  from mha.checkpoint import load_checkpoint, transformer_from_checkpoint
  loaded = load_checkpoint(tiny_run.workdir)
  model = transformer_from_checkpoint(tiny_run.workdir)
  jax.tree.map(np.testing.assert_array_equal,
               nnx.to_pure_dict(nnx.state(model, nnx.Param)), loaded.params)
  # Host arrays: no eager programs.
  tokens = np.array([[3, 4, 5, 0], [5, 6, 0, 0]], np.int32)
  head_mask = np.ones((loaded.model_config.num_layers,
                       loaded.model_config.max_heads), np.float32)
  head_mask[0, 0] = 0.0
  (logits, attention), (want_logits, want_attention) = nnx.jit(
      lambda m: (m(tokens, head_mask=head_mask), loaded.model.apply(
          {"params": loaded.params}, tokens, head_mask=head_mask)))(model)
  np.testing.assert_allclose(logits, want_logits, **TOL)
  np.testing.assert_allclose(attention[-1], want_attention[-1], **TOL)


@pytest.mark.slow
def test_the_docs_snippet_runs():
  from conftest import ROOT
  with open(os.path.join(ROOT, "docs", "attention.md"),
            encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("## The NNX layer"):]
  start = section.index("```python\n") + len("```python\n")
  snippet = section[start:section.index("```", start)]
  namespace = {}
  exec(snippet, namespace)  # the snippet as the reader runs it
  assert namespace["out"].shape == (2, 10, 64)
  assert namespace["weights"].shape == (2, 8, 10, 10)
