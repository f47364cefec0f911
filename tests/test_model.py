"""Tests of mha.model: shapes, padding, head masks, pruned configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha.model import Transformer, TransformerConfig

TOL = dict(atol=1e-5, rtol=1e-5)
CFG = TransformerConfig(vocab_size=11, num_layers=2, num_heads=4, d_model=32,
                        mlp_dim=64, max_len=8)
# Put from the host: jnp.array would compile a conversion program.
TOKENS = jax.device_put(np.array([[3, 1, 4, 1, 5, 0, 0, 0],
                                  [9, 2, 6, 5, 3, 5, 8, 9]], np.int32))


def _init(cfg=CFG, tokens=TOKENS):
  return Transformer(cfg).init(jax.random.key(0), tokens)


@pytest.mark.slow
def test_shapes_and_attention_per_layer():
  params = _init()
  logits, attention = Transformer(CFG).apply(params, TOKENS)
  assert logits.shape == (2, 8, 11)
  assert len(attention) == 2
  assert all(a.shape == (2, 4, 8, 8) for a in attention)
  # Padding keys get zero weight, padding queries attend to nothing.
  a = np.asarray(attention[0])[0]
  assert np.all(a[:, :, 5:] == 0) and np.all(a[:, 5:, :] == 0)
  np.testing.assert_allclose(a[:, :5].sum(-1), 1.0, **TOL)


@pytest.mark.slow  # seconds of compiling or training: the full suite only
def test_unbatched_and_vmapped_calls_equal_batched():
  params = _init()
  model = Transformer(CFG)
  batched, _ = model.apply(params, TOKENS)
  single, _ = model.apply(params, TOKENS[1])
  np.testing.assert_allclose(single, np.asarray(batched)[1], **TOL)
  # Jitted: one program, not each vmapped op compiled on its own.
  mapped, _ = jax.jit(jax.vmap(lambda t: model.apply(params, t)))(TOKENS)
  np.testing.assert_allclose(mapped, batched, **TOL)


@pytest.mark.slow
def test_padding_invariance():
  params = _init()
  model = Transformer(CFG)
  other = np.array(TOKENS)  # on the host: no eager programs
  other[1] = [1, 1, 1, 0, 0, 0, 0, 0]
  # The three calls in one program: eagerly each operation compiles alone.
  logits, short, changed = jax.device_get(jax.jit(lambda p: [
      model.apply(p, tokens)[0] for tokens in (TOKENS, TOKENS[:1, :6],
                                               other)])(params))
  # Shorter padding (a shorter array) gives the same valid logits.
  np.testing.assert_allclose(short[0, :5], logits[0, :5], **TOL)
  # Another batch row's content never leaks into this one.
  np.testing.assert_allclose(changed[0, :5], logits[0, :5], **TOL)


@pytest.mark.slow  # over 2 s on 2 cores: the full suite only
def test_finite_gradients_for_params_and_head_mask():
  params = _init()
  model = Transformer(CFG)

  def loss(p, hm):
    logits, attention = model.apply(p, TOKENS, head_mask=hm)
    return jnp.mean(logits ** 2) + sum(jnp.sum(a) for a in attention)

  g_params, g_mask = jax.device_get(jax.jit(jax.grad(loss, argnums=(0, 1)))(
      params, np.ones((2, 4), np.float32)))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(g_params))
  assert g_mask.shape == (2, 4) and np.all(np.isfinite(g_mask))
  assert np.any(g_mask != 0)


@pytest.mark.slow
def test_head_mask_array_and_sequence_agree_and_vmap():
  params = _init()
  model = Transformer(CFG)
  hm = jnp.array([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.5]])
  a, _ = model.apply(params, TOKENS, head_mask=hm)
  b, _ = model.apply(params, TOKENS, head_mask=[hm[0], hm[1]])
  np.testing.assert_allclose(a, b, **TOL)
  masks = np.stack([hm, np.ones(hm.shape, np.float32)])  # on the host
  mapped, _ = jax.jit(jax.vmap(  # one program, not op by op
      lambda m: model.apply(params, TOKENS, head_mask=m)))(masks)
  np.testing.assert_allclose(np.asarray(mapped)[0], a, **TOL)


@pytest.mark.slow  # 3.2 s on 2 cores: the fused path run eagerly, op by op
def test_return_weights_false_gives_same_logits():
  params = _init()
  model = Transformer(CFG)
  a, _ = model.apply(params, TOKENS)
  b, attention = model.apply(params, TOKENS, return_weights=False)
  np.testing.assert_allclose(a, b, **TOL)
  assert attention == (None, None)


def test_dropout_only_when_not_deterministic():
  cfg = TransformerConfig(**{**CFG.__dict__, "dropout_rate": 0.3,
                             "attention_dropout_rate": 0.3})
  params = _init(cfg)
  model = Transformer(cfg)
  det, _ = model.apply(params, TOKENS)
  det_ref, _ = Transformer(CFG).apply(params, TOKENS)
  np.testing.assert_allclose(det, det_ref, **TOL)
  noisy, _ = model.apply(params, TOKENS, deterministic=False,
                         rngs={"dropout": jax.random.key(3)})
  assert not np.allclose(noisy, det, atol=1e-3)


@pytest.mark.slow
def test_per_layer_heads_with_an_empty_layer():
  cfg = TransformerConfig(vocab_size=11, num_layers=3, num_heads=(2, 0, 3),
                          head_dim=8, d_model=32, mlp_dim=64, max_len=8)
  params = _init(cfg)
  attn = params["params"]["layer_1"]["attention"]
  assert set(attn) == {"out"} and set(attn["out"]) == {"bias"}
  logits, attention = Transformer(cfg).apply(
      params, TOKENS, head_mask=[jnp.ones(2), jnp.ones(0), jnp.ones(3)])
  assert logits.shape == (2, 8, 11)
  assert [a.shape[1] for a in attention] == [2, 0, 3]
  assert params["params"]["layer_2"]["attention"]["query"]["kernel"].shape == (
      32, 3, 8)


@pytest.mark.parametrize("positional, pre_norm", [("sinusoidal", True),
                                                  ("learned", False)])
def test_variants_run(positional, pre_norm):
  cfg = TransformerConfig(**{**CFG.__dict__, "positional": positional,
                             "pre_norm": pre_norm})
  params = _init(cfg)
  logits, _ = Transformer(cfg).apply(params, TOKENS)
  assert np.all(np.isfinite(logits))


def test_causal_positions_never_see_later_tokens():
  cfg = TransformerConfig(**{**CFG.__dict__, "causal": True})
  params = _init(cfg)
  model = Transformer(cfg)
  logits, attention = model.apply(params, TOKENS)
  assert all(np.all(np.triu(np.asarray(a), 1) == 0) for a in attention)
  tokens = np.array(TOKENS)  # changed on the host: no eager programs
  tokens[1, 5] = 1
  changed, _ = model.apply(params, jax.device_put(tokens))
  changed, logits = jax.device_get((changed, logits))  # sliced on the host
  np.testing.assert_array_equal(changed[1, :5], logits[1, :5])
  assert not np.allclose(changed[1, 5:], logits[1, 5:])
  # Same parameters as the encoder's: only the mask differs.
  assert (jax.tree.map(jnp.shape, params)
          == jax.tree.map(jnp.shape, _init()))


def test_grouped_kv_heads_and_the_default_unchanged():
  gqa = TransformerConfig(**{**CFG.__dict__, "num_kv_heads": 2})
  params = _init(gqa)["params"]["layer_0"]["attention"]
  assert params["key"]["kernel"].shape == (32, 2, 8)
  assert params["value"]["bias"].shape == (2, 8)
  assert params["query"]["kernel"].shape == (32, 4, 8)
  logits, attention = Transformer(gqa).apply(_init(gqa), TOKENS)
  assert attention[0].shape == (2, 4, 8, 8) and np.all(np.isfinite(logits))
  # num_kv_heads = num_heads is the model without the field, bitwise.
  same = TransformerConfig(**{**CFG.__dict__, "num_kv_heads": 4})
  expected, _ = Transformer(CFG).apply(_init(), TOKENS)
  got, _ = Transformer(same).apply(_init(same), TOKENS)
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_heads=3), r"num_kv_heads \(3\) must be >= 1 and divide"),
    (dict(num_kv_heads=0), r"num_kv_heads \(0\) must be >= 1"),
    (dict(decode=True), r"decode=True needs a causal model"),
    (dict(num_heads=3), r"d_model \(32\) must be divisible by num_heads \(3\)"),
    (dict(num_heads=(2, 2, 2)), r"num_heads has 3 entries"),
    (dict(num_heads=(2, 2)), r"head_dim is required"),
    (dict(positional="rope"), r"positional must be one of"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    TransformerConfig(**{**CFG.__dict__, **kwargs})


def test_bad_inputs():
  params = _init()
  model = Transformer(CFG)
  with pytest.raises(ValueError, match=r"`tokens` has shape \(1, 9\)"):
    model.apply(params, jax.device_put(np.ones((1, 9), np.int32)))
  with pytest.raises(ValueError, match=r"`head_mask` has shape \(2, 3\)"):
    model.apply(params, TOKENS,
                head_mask=jax.device_put(np.ones((2, 3), np.float32)))
  with pytest.raises(ValueError, match=r"3 per-layer entries"):
    model.apply(params, TOKENS, head_mask=[jnp.ones(4)] * 3)


@pytest.mark.slow  # seconds of compiling or training: the full suite only
def test_bfloat16_compute_dtype():
  cfg = TransformerConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
  params = _init()  # the float32 model's parameters: the same tree
  # Its initialisation's shapes and dtypes, traced (not compiled, op by op).
  shapes = jax.eval_shape(lambda: _init(cfg))
  assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, params)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(shapes))
  logits, attention = jax.jit(Transformer(cfg).apply)(params, TOKENS)
  expected, expected_attention = jax.jit(Transformer(CFG).apply)(params,
                                                                 TOKENS)
  assert logits.dtype == attention[0].dtype == jnp.bfloat16
  # The softmax runs in float32 either way; bfloat16 activations keep ~3
  # significant digits through two blocks: weights in [0, 1] within 0.02.
  np.testing.assert_allclose(np.asarray(attention[1], np.float32),
                             expected_attention[1], atol=2e-2)
  assert np.all(np.isfinite(np.asarray(logits, np.float32)))
  logits, expected = jax.device_get((logits, expected))  # NumPy's argmax
  assert np.mean(np.argmax(logits, -1) == np.argmax(expected, -1)) > 0.9
  assert TransformerConfig(**{**CFG.__dict__, "dtype": jnp.bfloat16}
                           ).dtype == "bfloat16"
  with pytest.raises(ValueError, match="dtype must be one of"):
    TransformerConfig(**{**CFG.__dict__, "dtype": "float16"})
