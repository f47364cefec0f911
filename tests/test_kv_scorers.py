"""KV-cache head scorers (mha.pruning.kv_scorers): planted attention weights
get their hand-computed scores, through the pure sums and through a causal
model whose attention is planted."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import data
from mha.attention import MultiHeadAttention
from mha.model import Transformer, TransformerConfig
from mha.pruning import kv_scorers

U = data.UNSCORED


def _scores(weights, inputs, targets):
  """``name -> [H]`` means of the pure sums of one layer."""
  sums, counts = jax.jit(kv_scorers.pattern_sums)(
      jnp.asarray(weights), jnp.asarray(inputs), jnp.asarray(targets))
  return {n: np.asarray(sums[n], np.float64) / float(counts[n])
          for n in sums}, {n: int(c) for n, c in counts.items()}


def _one_hot_rows(keys, length):
  """``[T, T]`` with row ``t`` one-hot on ``keys[t]`` (zero rows: None)."""
  rows = np.zeros((length, length), np.float32)
  for t, key in enumerate(keys):
    if key is not None:
      rows[t, key] = 1.0
  return rows


def test_planted_echo_induction_and_uniform_heads():
  # Tokens 3 1 3 1 3, then padding. Earlier occurrences of the query's
  # token: t=2 -> {0}, t=3 -> {1}, t=4 -> {0, 2}; the keys after them:
  # {1}, {2}, {1, 3}.
  inputs = np.array([[3, 1, 3, 1, 3, 0]], np.int32)
  targets = np.array([[1, 3, 1, 3, U, 0]], np.int32)
  length = inputs.shape[1]
  echo_head = _one_hot_rows([0, 1, 0, 1, 2, None], length)  # else itself
  induction_head = _one_hot_rows([0, 1, 1, 2, 3, None], length)
  uniform = np.tril(np.ones((length, length), np.float32))[:, :5]
  uniform = np.pad(uniform / uniform.sum(1, keepdims=True), ((0, 0), (0, 1)))
  uniform[5] = 1.0 / 6  # A padding row: counts nothing.
  weights = np.stack([echo_head, induction_head, uniform])[None]
  got, counts = _scores(weights, inputs, targets)
  assert counts == {"echo": 3, "induction": 3, "retrieval_score": 3,
                    "headkv": 3, "attention_distance": 5}
  # Exact by construction up to float32 rounding of 1/3, 1/4, 2/5.
  tol = dict(abs=1e-6)
  assert got["echo"] == pytest.approx([1.0, 0.0, 59 / 180], **tol)
  assert got["induction"] == pytest.approx([0.0, 1.0, 59 / 180], **tol)
  # Distances 0 0 2 2 2, 0 0 1 1 1 and t / 2 over the five real queries.
  assert got["attention_distance"] == pytest.approx([1.2, 0.6, 1.0], **tol)
  # Targets 1 3 1 3 (t=4 unscored): R_1 = {0}, R_2 = {1}, R_3 = {0, 2}.
  # Top-1 keys: echo 1 0 1 (no hit), induction 1 1 2 (hits at t=2, 3),
  # uniform 0 0 0 (first of the ties: hits at t=1, 3).
  assert got["retrieval_score"] == pytest.approx([0.0, 2 / 3, 2 / 3], **tol)
  # HeadKV: the mass of R_t within the |R_t| largest weights; for the
  # uniform head the earliest keys: 1/2, 0 (key 0 chosen), 1/4 + 0.
  assert got["headkv"] == pytest.approx(
      [0.0, 2 / 3, (1 / 2 + 0 + 1 / 4) / 3], **tol)


def test_retrieval_counts_the_top_key_and_headkv_the_top_k_mass():
  # Query 1 (target 5): R = {0}, k = 1. Query 3 (target 5): R = {0, 2},
  # k = 2. Query 2 is unscored, the padding query 4's target is ignored, and
  # a real query with target 0 has no eligible key (padding keys never are).
  inputs = np.array([[5, 2, 5, 7, 0]], np.int32)
  targets = np.array([[0, 5, U, 5, 5]], np.int32)
  w = np.zeros((1, 2, 5, 5), np.float32)
  w[0, :, 0, 0] = 1.0
  w[0, 0, 1, :2] = [0.6, 0.4]  # top-1 key 0: a hit; top-1 mass 0.6
  w[0, 1, 1, :2] = [0.3, 0.7]  # top-1 key 1: no hit, mass 0
  w[0, :, 2, :3] = [0.0, 0.0, 1.0]
  # Head 0: top-2 keys {1, 2}: a miss for top-1, top-2 mass 0.35 of 0.6.
  w[0, 0, 3, :4] = [0.25, 0.4, 0.35, 0.0]
  # Head 1: top-2 keys {0, 3}: a hit, top-2 mass 0.5.
  w[0, 1, 3, :4] = [0.5, 0.1, 0.0, 0.4]
  w[0, :, 4] = 0.2  # padding row
  got, counts = _scores(w, inputs, targets)
  assert counts["retrieval_score"] == counts["headkv"] == 2
  assert got["retrieval_score"] == pytest.approx([0.5, 0.5], abs=1e-6)
  assert got["headkv"] == pytest.approx([(0.6 + 0.35) / 2, 0.5 / 2],
                                        abs=1e-6)
  # The unscored query's row does not matter.
  w[0, :, 2, :3] = [1.0, 0.0, 0.0]
  again = _scores(w, inputs, targets)[0]
  for name in ("retrieval_score", "headkv"):
    np.testing.assert_array_equal(again[name], got[name])


def test_sums_pass_through_vmap_and_add_up_over_batches():
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 4, size=(2, 6, 7)).astype(np.int32)
  inputs[:, :, 5:] = 0
  targets = np.where(inputs != 0, rng.integers(-1, 4, inputs.shape), 0)
  targets = targets.astype(np.int32)
  logits = rng.normal(size=(2, 6, 3, 7, 7))
  logits = np.where(np.tril(np.ones((7, 7), bool)), logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
  sums, counts = jax.jit(jax.vmap(kv_scorers.pattern_sums))(
      weights, inputs, targets)
  whole_sums, whole_counts = jax.jit(kv_scorers.pattern_sums)(
      weights.reshape(12, 3, 7, 7), inputs.reshape(12, 7),
      targets.reshape(12, 7))
  for name in kv_scorers.SCORERS:
    # Float32 sums of a few dozen terms in another order: a few ulps.
    np.testing.assert_allclose(np.sum(sums[name], 0), whole_sums[name],
                               rtol=1e-5, err_msg=name)
    assert int(np.sum(counts[name])) == int(whole_counts[name]) > 0, name
  for name in ("retrieval_score", "echo", "induction", "headkv"):
    assert np.all(whole_sums[name] <= whole_counts[name] + 1e-4)


def _decoder(num_heads, vocab_size, length=8, n=10, seed=0):
  config = TransformerConfig(vocab_size=vocab_size, num_layers=2,
                             num_heads=num_heads, head_dim=4, d_model=16,
                             mlp_dim=16, max_len=length, causal=True)
  model = Transformer(config)
  # Random parameters of the init's shapes, without running the init (its
  # op-by-op dispatch costs seconds the first time in a process).
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(seed),
                          jnp.ones((1, length), jnp.int32))["params"]
  params = jax.tree.map(
      lambda x: rng.normal(0.0, 0.5, x.shape).astype(x.dtype), shapes)
  inputs = rng.integers(1, 4, (n, length)).astype(np.int32)  # repeats
  inputs[0, -3:] = 0
  inputs[1, -5:] = 0
  targets = np.where(inputs != 0, rng.integers(1, 4, (n, length)), U)
  targets[:, :2] = U
  return model, params, data.Split(inputs, targets.astype(np.int32))


def _planted(tokens):
  """``[B, 2, T, T]``: head 0 one-hot on the latest earlier occurrence of
  the query's token (else on itself), head 1 uniform over its keys."""
  length = tokens.shape[-1]
  q = jnp.arange(length)[:, None]
  k = jnp.arange(length)[None, :]
  valid = tokens != 0
  same = (tokens[:, :, None] == tokens[:, None, :]) & (k < q)[None]
  latest = jnp.max(jnp.where(same, k[None], -1), axis=-1)
  latest = jnp.where(latest < 0, q[None, :, 0], latest)
  echo_head = (k[None] == latest[:, :, None]).astype(jnp.float32)
  allowed = valid[:, None, :] & (k <= q)[None]
  uniform = allowed / jnp.maximum(jnp.sum(allowed, -1, keepdims=True), 1)
  heads = jnp.stack([echo_head, uniform], axis=1)
  return jnp.where(valid[:, None, :, None], heads, 0.0)


def test_measure_reads_the_planted_heads_of_a_causal_model():
  # A config no other test uses: the interceptor acts when `measure`'s jit
  # traces, and a cached trace of the same model and shapes would skip it.
  model, params, split = _decoder((2, 3), vocab_size=13)
  tokens = {}

  def plant(next_fun, args, kwargs, context):
    if isinstance(context.module, Transformer) and (
        context.method_name == "__call__"):
      tokens["now"] = args[0]
    if (isinstance(context.module, MultiHeadAttention)
        and context.method_name == "__call__"
        and context.module.path[-2] == "layer_0"):
      out, _ = next_fun(*args, **kwargs)
      return out, _planted(tokens["now"])
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(plant):
    got = kv_scorers.measure(model, params, split, batch_size=4)
  assert set(got) == set(kv_scorers.SCORERS)
  for name, value in got.items():  # Layer 0 has two heads, layer 1 three.
    assert value.shape == (2, 3) and value.dtype == np.float64, name
    assert np.isnan(value[0, 2]) and np.all(np.isfinite(value[1])), name
  assert got["echo"][0, 0] == pytest.approx(1.0, abs=1e-6)
  # The uniform head: distance t / 2 at every real query.
  positions = np.nonzero(split.inputs)[1]
  assert got["attention_distance"][0, 1] == pytest.approx(
      np.mean(positions / 2), rel=1e-6)
  assert got["attention_distance"][0, 0] > 0
  for name in ("retrieval_score", "echo", "induction", "headkv"):
    assert np.all((got[name][1] >= 0) & (got[name][1] <= 1 + 1e-6)), name


def test_scores_do_not_depend_on_the_batch_size(monkeypatch):
  model, params, split = _decoder(2, vocab_size=5)
  names = ("retrieval_score", "headkv", "attention_distance")
  one = kv_scorers.measure(model, params, split, batch_size=3, names=names)
  other = kv_scorers.measure(model, params, split, batch_size=10,
                             names=names)
  # Long windows a few a call: two examples' attention a call at most.
  # pylint: disable-next=protected-access
  calls, batch_sums = [], kv_scorers._batch_sums
  monkeypatch.setattr(kv_scorers, "CALL_ATTENTION_ENTRIES",
                      2 * model.config.max_len ** 2)
  monkeypatch.setattr(kv_scorers, "_batch_sums", lambda model, params, inputs,
                      *rest: calls.append(len(inputs)) or batch_sums(
                          model, params, inputs, *rest))
  bounded = kv_scorers.measure(model, params, split, batch_size=10,
                               names=names)
  assert max(calls) <= 2 and sum(calls) >= len(split)
  assert set(one) == set(names)
  for name in names:
    # Float32 sums per batch, float64 across them: a few ulps of float32.
    np.testing.assert_allclose(one[name], other[name], rtol=1e-5,
                               err_msg=name)
    np.testing.assert_allclose(bounded[name], other[name], rtol=1e-5,
                               err_msg=name)


def test_bad_arguments_are_refused():
  model, params, split = _decoder(2, vocab_size=5)
  with pytest.raises(ValueError, match="unknown scorers"):
    kv_scorers.measure(model, params, split, names=["retrieval"])
  with pytest.raises(ValueError, match="batch_size"):
    kv_scorers.measure(model, params, split, batch_size=0)
  encoder = Transformer(TransformerConfig(vocab_size=5, causal=False))
  with pytest.raises(ValueError, match="causal"):
    kv_scorers.measure(encoder, params, split)
