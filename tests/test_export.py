"""Accelerators without one: the train program, the eval step and the layer
(weights and fused paths) lower for CUDA and TPU through ``jax.export`` on
a CPU-only machine. No GPU or TPU has run them (docs/attention.md).

Each program is exported once for ``cpu``, ``cuda`` and ``tpu`` together;
the CPU variant of the exported module is then run here and must equal the
jitted function, so the test checks the same module that would go to an
accelerator, not only that lowering raised nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from conftest import init_params
from configs import default
from mha import build
from mha import evaluate
from mha import train
from mha.attention import MultiHeadAttention

PLATFORMS = ("cpu", "cuda", "tpu")


def _exported(fn, *args):
  """``fn`` exported for every platform (serialising it would need the
  optional ``flatbuffers`` package)."""
  exported = export.export(fn, platforms=PLATFORMS)(*args)
  assert exported.platforms == PLATFORMS
  return exported


@pytest.fixture(scope="module")
def tiny():
  config = default.get_config("tiny")
  model = build.make_model(config)
  state = jax.jit(functools.partial(build.create_train_state, config,
                                    model))(jax.random.key(0))
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 10, (4, config.data.max_len)).astype(np.int32)
  inputs[:, -2:] = 0  # padding
  # Host arrays: on the host, flipping them below compiles nothing.
  batch = {"inputs": inputs,
           "targets": np.where(inputs > 0, 11 - inputs, 0).astype(np.int32)}
  return config, model, state, batch


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_train_step_lowers_for_cuda_and_tpu(tiny):
  # The run's train step, exported for CPU, CUDA and TPU, and the CPU export
  # called: two steps as train_step jitted gives them.
  config, model, state, batch = tiny
  schedule = build.learning_rate_schedule(config)
  step = jax.jit(functools.partial(train.train_step, model=model,
                                   schedule=schedule))
  rng = jax.random.key(1)
  exported = _exported(step, state, batch, rng)
  got_state, got = exported.call(state, batch, rng)
  want_state, want = step(state, batch, rng)
  np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-6)
  flipped = jax.tree.map(lambda x: x[::-1], batch)
  got_state, got = exported.call(got_state, flipped, rng)
  want_state, want = step(want_state, flipped, rng)
  np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-6)
  # Equal to float32 rounding, the attention's key bias aside: its true
  # gradient is 0 (softmax does not change when a constant is added to a
  # row of logits) and Adam turns rounding noise into steps of either sign.
  got_params, want_params = (jax.tree.map(np.asarray, s.params)
                             for s in (got_state, want_state))
  for params in (got_params, want_params):
    for layer in params.values():
      if isinstance(layer, dict) and "attention" in layer:
        layer["attention"]["key"].pop("bias")
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-7), got_params, want_params)


@pytest.mark.slow
def test_eval_step_lowers_for_cuda_and_tpu(tiny):
  _, model, state, batch = tiny
  step = jax.jit(functools.partial(evaluate.eval_step, model))
  exported = _exported(step, state.params, batch)
  got, want = exported.call(state.params, batch), step(state.params, batch)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6)


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights path", "fused path"])
def test_layer_lowers_for_cuda_and_tpu(return_weights):
  layer = MultiHeadAttention(num_heads=4, qkv_features=32, out_features=32)
  x = jax.random.normal(jax.random.key(0), (2, 8, 32))
  # Jitted: eagerly each op of the initialisation compiles alone.
  params = jax.jit(layer.init)(jax.random.key(1), x)
  head_mask = jnp.asarray([1.0, 0.0, 1.0, 1.0])
  fn = jax.jit(lambda p, x, m: layer.apply(
      p, x, head_mask=m, return_weights=return_weights))
  exported = _exported(fn, params, x, head_mask)
  got, want = exported.call(params, x, head_mask), fn(params, x, head_mask)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  if return_weights:
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)
  else:
    assert got[1] is None and want[1] is None


@pytest.mark.slow  # Over 5 s on 2 cores: outside the fast loop.
def test_streamed_oracle_lowers_for_cuda_and_tpu():
  # One program for every platform: the last layer goes a prefix at a time,
  # its masks in groups (oracle.MASKS_PER_STEP), with no backend branch.
  # pylint: disable=import-outside-toplevel
  from mha import data
  from mha.model import Transformer, TransformerConfig
  from mha.pruning import oracle
  # pylint: enable=import-outside-toplevel
  config = TransformerConfig(vocab_size=7, num_layers=2, num_heads=(2, 5),
                             d_model=8, head_dim=4, mlp_dim=8, max_len=5)
  model = Transformer(config)
  params = init_params(model, jax.random.key(0))
  inputs = np.random.default_rng(0).integers(1, 7, (3, 5)).astype(np.int32)
  inputs[1, 3:] = 0
  split = data.Split(inputs, (inputs * 2) % 7)
  (positions, weights), = oracle._batch_positions(  # pylint: disable=protected-access
      inputs != 0, len(inputs))
  fn = jax.jit(lambda p, i, t, w: oracle._sums(  # pylint: disable=protected-access
      model, p, i, t, True, positions=positions, position_weights=w))
  args = (params, split.inputs, split.targets, weights)
  exported = _exported(fn, *args)
  for platform in ("cpu", "cuda", "tpu"):
    one = export.export(fn, platforms=[platform])(*args)
    assert one.mlir_module().count("stablehlo.while") == 2, platform
  got, want = exported.call(*args), fn(*args)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])
  # The same sums as the per-example table's, every subset.
  table = oracle.evaluate_subsets(model, params, split, per_example=True)
  np.testing.assert_array_equal(
      np.asarray(got["correct"]).sum(-1), table["correct"].sum(-1))
