"""Tests of the streaming ablation (``--ablation streaming:SINKS,WINDOW``):
a removed head keeps sinks and a recent window instead of vanishing."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import data
from mha import evaluate as eval_lib
from mha.attention import MultiHeadAttention
from mha.model import Transformer, TransformerConfig
from mha.model import attention_mask as model_mask
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.pruning import duo_gates
from mha.pruning import mixed_cache
from mha.pruning import oracle


def _decoder(num_layers=2, num_heads=4, length=12, n=10, seed=0,
             **kwargs):
  config = TransformerConfig(vocab_size=9, num_layers=num_layers,
                             num_heads=num_heads, d_model=16, mlp_dim=16,
                             max_len=length, causal=True, **kwargs)
  model = Transformer(config)
  params = model.init(jax.random.key(seed),
                      jnp.ones((1, length), jnp.int32))["params"]
  rng = np.random.default_rng(seed)
  inputs = rng.integers(1, 9, (n, length)).astype(np.int32)
  inputs[0, -3:] = 0  # padding at the end of one example
  targets = np.where(inputs != 0, rng.integers(1, 9, (n, length)),
                     data.UNSCORED).astype(np.int32)
  targets[:, :2] = data.UNSCORED  # positions the task does not score
  return model, params, data.Split(inputs, targets)


def _direct_logits(model, params, inputs, head_mask, sinks, window):
  """The held-out reference: each layer's attention under a per-head mask,
  the model's own mask for a kept head and that mask restricted to the
  window for a removed one, every head's context kept (no head mask)."""
  config = model.config
  inputs = jnp.asarray(inputs)
  full = model_mask(config, inputs)  # [B, 1, T, T]
  windowed = ablation_lib.windowed(full, inputs.shape[-1], sinks, window)

  def intercept(next_fun, args, kwargs, context):
    if (isinstance(context.module, MultiHeadAttention)
        and context.method_name == "__call__"):
      layer = int(context.module.path[-2].split("_")[-1])
      keep = jnp.asarray(head_mask)[layer, :config.heads_per_layer[layer]]
      mask = jnp.where(keep[None, :, None, None] > 0.5, full, windowed)
      return next_fun(*args, **dict(kwargs, mask=mask, head_mask=None))
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(intercept):
    logits, _ = model.apply({"params": params}, inputs, return_weights=False)
  return logits


def test_parse_and_checks():
  assert ablation_lib.parse("zero") == ("zero", 0, 0)
  assert ablation_lib.parse("streaming:4,16") == ("streaming", 4, 16)
  assert ablation_lib.parse("streaming:0,1") == ("streaming", 0, 1)
  for bad, says in (("streaming", "SINKS,WINDOW"), ("streaming:4", "two"),
                    ("streaming:a,4", "two"), ("streaming:-1,4", "two"),
                    ("streaming:0,0", "at least 1"), ("window:1,2", "one of")):
    with pytest.raises(ValueError, match=says):
      ablation_lib.parse(bad)
  decoder = TransformerConfig(vocab_size=9, num_layers=1, num_heads=2,
                              d_model=8, mlp_dim=8, max_len=32, causal=True)
  ablation_lib.check_streaming("streaming:4,16", decoder, 32)
  encoder = dataclasses.replace(decoder, causal=False)
  ablation_lib.check_streaming("mean", encoder, 32)
  with pytest.raises(ValueError, match="nothing to save"):
    ablation_lib.check_streaming("streaming:4,28", decoder, 32)
  with pytest.raises(ValueError, match="encoder"):
    ablation_lib.check_streaming("streaming:1,2", encoder, 32)


def test_window_mask_and_kv_memory_by_hand():
  got = np.asarray(ablation_lib.window_mask(5, 1, 2)).astype(int)
  want = np.array([[1, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0],
                   [1, 1, 1, 0, 0],
                   [1, 0, 1, 1, 0],
                   [1, 0, 0, 1, 1]])
  np.testing.assert_array_equal(got, want)
  # 12 heads at context 128, 4 + 16 kept by a streaming head.
  np.testing.assert_allclose(
      ablation_lib.kv_memory([12, 6, 0], 12, 128, 4, 16),
      [1.0, (6 * 128 + 6 * 20) / (12 * 128), 20 / 128])


@pytest.mark.slow  # seconds of compiling: the full suite only
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_streaming_logits_equal_the_direct_window_masks(kv_heads):
  """Under ``ablated_logits`` a removed head's output is its output under
  the window mask (the layer's output under ``m`` plus its output under the
  window and ``1 - m``): the direct per-head masks give the same logits,
  also on a GQA model. Keeping every head is the unpruned model, and a
  window as long as the context removes nothing."""
  model, params, split = _decoder(num_kv_heads=kv_heads)
  abl = ablation_lib.build(model, params, "streaming:2,3", split, split)
  assert abl.spec == "streaming:2,3" and abl.streaming
  # Jitted, each one program for the three masks (op by op, each call
  # compiles dozens of programs).
  ablated = lambda ablation: jax.jit(lambda mask: ablation_lib.ablated_logits(
      model, params, split.inputs, mask, ablation))
  streamed = ablated(abl)
  direct = jax.jit(
      lambda mask: _direct_logits(model, params, split.inputs, mask, 2, 3))
  rng = np.random.default_rng(0)
  for mask in (rng.integers(0, 2, (2, 4)).astype(np.float32),
               np.zeros((2, 4), np.float32), np.ones((2, 4), np.float32)):
    got = streamed(mask)
    want = direct(mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  plain, _ = jax.jit(model.apply)({"params": params}, split.inputs)
  everything = ablation_lib.Ablation("streaming", sinks=0, window=12)
  np.testing.assert_allclose(
      ablated(everything)(np.zeros((2, 4), np.float32)),
      plain, rtol=1e-5, atol=1e-5)


def _direct_metrics(model, params, split, masks, sinks, window):
  """Each mask's metrics through the whole model (``_direct_logits``),
  vmapped over the masks 256 at a time (one call a mask took 4096
  dispatches, 4-8 s of CPU, on 12 heads)."""
  run = jax.jit(jax.vmap(lambda m: eval_lib.metric_sums(
      _direct_logits(model, params, split.inputs, m, sinks, window),
      jnp.maximum(split.targets, 0), split.inputs,
      data.scored(split.inputs, split.targets).astype(jnp.float32))))
  masks = np.asarray(masks, np.float32)
  parts = [jax.device_get(run(masks[start:start + 256]))
           for start in range(0, len(masks), 256)]
  got = eval_lib.summarize({k: np.concatenate([p[k] for p in parts])
                            for k in parts[0]})
  return {k: got[k] for k in ("loss", "token_accuracy", "exact_match")}


def _check_oracle(num_layers, num_heads, n):
  model, params, split = _decoder(num_layers, num_heads, n=n)
  abl = ablation_lib.build(model, params, "streaming:1,3", split, split)
  masks = oracle.subset_masks(model.config)
  want = _direct_metrics(model, params, split, masks, 1, 3)
  streamed = eval_lib.summarize(oracle.subset_totals(
      model, params, split, batch_size=8, ablation=abl))
  table = core.summarize_examples(oracle.evaluate_subsets(
      model, params, split, per_example=True, batch_size=8, ablation=abl))
  for got in (streamed, table):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-5)
    for key in ("token_accuracy", "exact_match"):
      np.testing.assert_array_equal(got[key], want[key])
  # Some of the subsets, their lower layers shared (the study's curves).
  picked = np.random.default_rng(0).choice(len(masks), 40, replace=False)
  listed = core.summarize_examples(oracle.evaluate_mask_list(
      model, params, split, masks[picked], batch_size=8, ablation=abl))
  np.testing.assert_allclose(listed["loss"], want["loss"][picked], rtol=2e-5)
  for key in ("token_accuracy", "exact_match"):
    np.testing.assert_array_equal(listed[key], want[key][picked])
  # The ablation matters: removing heads differs from zero ablation.
  zero = eval_lib.summarize(oracle.subset_totals(model, params, split,
                                                 batch_size=8))
  assert np.abs(zero["loss"][0] - streamed["loss"][0]) > 1e-3


def test_the_oracles_last_layer_runs_on_scored_positions_shared_ones_once():
  """The streamed oracle's last layer runs each subset on the scored
  positions only (the rest of a recall task's window is never read), and
  under ``streaming`` those before ``sinks + window`` (where the window
  holds the whole causal context, so no subset changes them) once:
  together exactly the scored positions, each once, in every batch."""
  _, _, split = _decoder(n=10)
  scored = data.scored(split.inputs, split.targets)
  for spec, cut in ((None, 0), ("streaming:1,3", 4)):
    abl = (None if spec is None else
           ablation_lib.Ablation("streaming", sinks=1, window=3))
    last, shared = oracle._last_layer_positions(split, 4, abl)  # pylint: disable=protected-access
    assert (shared is None) == (cut == 0) and len(last) == 3
    for b, (positions, weights) in enumerate(last):
      rows = scored[4 * b:4 * b + 4]
      got = np.zeros(rows.size, np.int32)
      np.add.at(got, np.asarray(positions), np.asarray(weights, np.int32))
      if shared is not None:
        here, kept = shared[b]
        np.add.at(got, np.asarray(here), np.asarray(kept, np.int32))
        column = np.asarray(here)[np.asarray(kept) > 0] % rows.shape[1]
        assert column.size and np.all(column < cut)
      np.testing.assert_array_equal(got, rows.reshape(-1))


@pytest.mark.slow  # 256 direct evaluations: seconds of compiling
def test_streamed_oracle_equals_the_direct_evaluation_8_heads():
  """The oracle under ``streaming`` (every subset, layer prefixes shared,
  the last layer from each head's full and windowed parts) equals running
  each of the 256 subsets through the whole model with per-head window
  masks: loss to float32 rounding, token accuracy and exact match
  exactly."""
  _check_oracle(2, 4, n=10)


@pytest.mark.slow  # 4096 direct evaluations
def test_streamed_oracle_equals_the_direct_evaluation_12_heads():
  _check_oracle(3, 4, n=6)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_streaming_gradient_and_leave_one_out_run_through_core():
  """The existing measures run under the streaming ablation: leave-one-out
  is the direct evaluation with one head windowed, and the mask gradient
  is the derivative of the mix of full and windowed outputs."""
  model, params, split = _decoder(1, 2, n=6)
  abl = ablation_lib.build(model, params, "streaming:0,2", split, split)
  loo = core.leave_one_out(model, params, split, ablation=abl)
  want = _direct_metrics(model, params, split,
                         [np.array([[0, 1]], np.float32),
                          np.array([[1, 0]], np.float32),
                          np.ones((1, 2), np.float32)], 0, 2)
  np.testing.assert_allclose(
      np.asarray(loo["loss_increase"])[0],
      want["loss"][:2] - want["loss"][2], rtol=1e-4, atol=1e-6)
  grads = ablation_lib.attribution(model, params, split, abl)
  assert np.all(np.isfinite(grads))


@pytest.mark.slow  # 60 training steps
def test_duo_gates_close_a_head_whose_window_changes_nothing():
  """DuoAttention's gates on a planted decoder: head 0 writes nothing (its
  value projection is zero), so its full and windowed outputs agree and
  the L1 penalty alone moves its gate, to 0; head 1's window changes the
  hidden states, and its gate stays open. At every gate 1 the mixed model
  is the full model (distance 0)."""
  model, params, split = _decoder(1, 2, length=12, n=32, seed=3)
  value = params["layer_0"]["attention"]["value"]
  params = jax.tree_util.tree_map(lambda x: x, params)
  # Zeroed in NumPy (op by op, each update compiles programs).
  kernel, bias = np.array(value["kernel"]), np.array(value["bias"])
  kernel[:, 0], bias[0] = 0.0, 0.0
  params["layer_0"]["attention"]["value"] = dict(
      value, kernel=jax.device_put(kernel), bias=jax.device_put(bias))
  abl = ablation_lib.build(model, params, "streaming:1,2", split, split)
  ones = jax.device_put(np.ones((1, 2), np.float32))
  _, distance = duo_gates.distillation_loss(
      ones, model, params, split.inputs, split.targets, abl, 0.05)
  assert float(distance) == 0.0
  out = duo_gates.train(model, params, split, abl, steps=60, batch_size=16,
                        strength=0.01, learning_rate=0.05)
  alpha = out["alpha"][0]
  assert alpha[0] == 0.0 and alpha[1] > 0.5, alpha
  with pytest.raises(ValueError, match="streaming"):
    duo_gates.train(model, params, split, ablation_lib.Ablation("zero"),
                    steps=1)


@pytest.mark.slow  # seconds of tracing: the full suite only
def test_duo_gates_loss_and_schedule_as_their_code_writes_them():
  """DuoAttention's objective as duo_attn/train.py and loss.py write it:
  the squared difference of the hidden states averaged over features and
  scored positions, the L1 penalty averaged over gates; their learning
  rate warmed up and cooled down over a fifth of the steps each."""
  model, params, split = _decoder(2, 4, length=12, n=6, seed=5)
  abl = ablation_lib.build(model, params, "streaming:1,2", split, split)
  alpha = jnp.asarray([[1.0, 0.25, 0.0, 0.5], [0.75, 1.0, 1.0, 0.0]])
  # Jitted, as training runs them (op by op, each compiles dozens of
  # programs); compared to a tolerance.
  loss, distill = jax.jit(lambda a: duo_gates.distillation_loss(
      a, model, params, split.inputs, split.targets, abl, 0.05))(alpha)
  exists = np.ones((2, 4), np.float32)
  hidden = jax.jit(lambda a: duo_gates.hidden_states(
      model, params, split.inputs, a, abl))
  full = hidden(exists)
  mixed = hidden(alpha)
  scored = np.asarray(data.scored(split.inputs, split.targets))
  want = np.square(np.asarray(mixed) - np.asarray(full)).mean(-1)[scored]
  np.testing.assert_allclose(distill, want.mean(), rtol=1e-5)
  np.testing.assert_allclose(loss - distill, 0.05 * 4.5 / 8, rtol=1e-5)
  schedule = jax.jit(duo_gates.learning_rate_schedule(0.02, 200))
  np.testing.assert_allclose(
      [schedule(s) for s in (0, 19, 39, 100, 160, 180, 199)],
      [0.002, 0.01, 0.02, 0.02, 0.02, 0.01, 0.002], rtol=1e-6)


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_duo_gates_under_grouped_keys_are_one_per_group():
  """Under grouped keys and values a gate serves its group's query heads
  (their cache is kept or windowed whole): 2 gates a layer for 4 heads,
  each query head reporting its group's."""
  model, params, split = _decoder(2, 4, length=12, n=16, seed=3,
                                  num_kv_heads=2)
  config = model.config
  assert duo_gates.gate_heads(config) == 2
  np.testing.assert_array_equal(
      duo_gates.head_gates(config, jnp.asarray([[0.1, 0.9], [0.3, 0.7]])),
      np.asarray([[0.1, 0.1, 0.9, 0.9], [0.3, 0.3, 0.7, 0.7]], np.float32))
  abl = ablation_lib.build(model, params, "streaming:1,2", split, split)
  alpha = duo_gates.train(model, params, split, abl, steps=4,
                          batch_size=8)["alpha"]
  assert alpha.shape == (2, 4)
  np.testing.assert_array_equal(alpha[:, 0], alpha[:, 1])
  np.testing.assert_array_equal(alpha[:, 2], alpha[:, 3])
  assert np.all((0 <= alpha) & (alpha <= 1))


def _assert_decodes_as_the_ablation(model, params, tokens, full, sinks,
                                    window):
  """The mixed cache's logits equal the streaming ablation's forward pass
  with the heads not in ``full`` removed."""
  abl = ablation_lib.Ablation("streaming", sinks=sinks, window=window)
  # The reference jitted: op by op, it compiles dozens of programs.
  want = jax.jit(lambda mask: ablation_lib.ablated_logits(
      model, params, tokens, mask, abl))(full.astype(np.float32))
  got = mixed_cache.cached_logits(model, params, tokens, full, sinks=sinks,
                                  window=window)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _byte_share(config, full, sinks, window):
  """The mixed cache's bytes over the full cache's (3 sequences of 12)."""
  sizes = [mixed_cache.cache_bytes(mixed_cache.init_cache(
      config, f, batch_size=3, length=12, sinks=sinks, window=window))
           for f in (full, np.ones_like(full))]
  return sizes[0] / sizes[1]


@pytest.mark.slow  # three scans compiled
def test_mixed_cache_decodes_as_the_streaming_ablation():
  """Decoding through the mixed cache (full heads keep every position, the
  others a ring of sinks and the recent window) gives, position by
  position, the logits of the streaming ablation's forward pass with the
  same heads removed; with every head full, the model's own; and its keys
  and values take the formula's share of the full cache's bytes."""
  model, params, split = _decoder(2, 4, length=12, n=3, seed=5)
  tokens = np.where(split.inputs == 0, 1, split.inputs)  # no padding
  full = np.array([[1, 0, 0, 1], [0, 1, 0, 0]], bool)
  _assert_decodes_as_the_ablation(model, params, tokens, full, 2, 3)
  plain, _ = jax.jit(model.apply)({"params": params}, tokens)
  every = mixed_cache.cached_logits(model, params, tokens,
                                    np.ones((2, 4), bool), sinks=2, window=3)
  np.testing.assert_allclose(every, plain, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_byte_share(model.config, full, 2, 3),
                             ablation_lib.kv_memory(3, 8, 12, 2, 3))


@pytest.mark.slow  # two scans compiled
def test_mixed_cache_under_grouped_keys_keeps_a_group_for_any_full_head():
  """Under GQA (4 query heads on 2 key/value groups) a group keeps every
  position when any of its query heads is full; its streaming query heads
  read that cache through the window. Decoding equals the streaming
  ablation of the same query heads, and the memory is that of the groups:
  layer 0 keeps group 0 (head 1 full, head 0 streaming in it), layer 1
  keeps no group, so 1 of 4 groups is full."""
  model, params, split = _decoder(2, 4, length=12, n=3, seed=7,
                                  num_kv_heads=2)
  tokens = np.where(split.inputs == 0, 1, split.inputs)
  full = np.array([[0, 1, 0, 0], [0, 0, 0, 0]], bool)
  _assert_decodes_as_the_ablation(model, params, tokens, full, 1, 3)
  cache = mixed_cache.init_cache(model.config, full, batch_size=3, length=12,
                                 sinks=1, window=3)
  assert cache.full_groups == ((0,), ())
  assert cache.layers[0].full_key.shape == (3, 12, 1, 4)
  assert cache.layers[1].ring_key.shape == (3, 4, 2, 4)
  np.testing.assert_allclose(_byte_share(model.config, full, 1, 3),
                             ablation_lib.kv_memory(1, 4, 12, 1, 3))
