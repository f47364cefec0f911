"""Activation capture and patching (mha/patching.py) and docs/patching.md.

A randomly initialised 2-layer, 2-head model (width 16, length 8) for the
identities, which hold for any parameters; the session's trained ``tiny``
run for the docs' example. Tolerances: one patch is bitwise the model's own
computation; a vmapped call batches XLA's matrix products, which rounds
differently in float32 (measured up to 6e-7 on logits of order 1), so it is
compared to 1e-5.
"""

from __future__ import annotations

import os
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from mha import patching
from mha.model import Transformer, TransformerConfig

VMAP_ATOL = 1e-5  # vmapped matmuls round differently (see module doc)
CONFIG = TransformerConfig(vocab_size=11, num_layers=2, num_heads=2,
                           d_model=16, mlp_dim=32, max_len=8)
# Same padding in both; they differ at (0, 4) and (1, 2).
CLEAN = np.array([[3, 1, 4, 1, 5, 9, 0, 0], [2, 7, 1, 8, 0, 0, 0, 0]])
CORRUPT = np.array([[3, 1, 4, 1, 6, 9, 0, 0], [2, 7, 2, 8, 0, 0, 0, 0]])
# Four patches, the last every head: every many-patch call of heads has this
# shape (one compilation).
PATCHES = [(0, 1), [(0, 0), (1, 1)], (1, 0), [(0, 0), (0, 1), (1, 0), (1, 1)]]


def _random_params(model: Transformer, scale: float = 0.5):
  """Normal parameters of the model's shapes (no compiled ``init``)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             jnp.asarray(CLEAN))["params"])
  rng = np.random.default_rng(0)
  # Cast in NumPy (jnp.asarray compiles a conversion for each shape).
  return jax.tree.map(lambda s: jax.device_put(np.asarray(
      scale * rng.standard_normal(s.shape), s.dtype)), shapes)


@pytest.fixture(scope="module")
def model_and_params():
  model = Transformer(CONFIG)
  return model, _random_params(model)


def _logits(model, params, tokens):
  logits, _ = model.apply({"params": params}, tokens, return_weights=False)
  return logits


def test_cache_holds_the_contexts_and_the_residual_stream(model_and_params):
  model, params = model_and_params
  logits, acts = patching.run_with_cache(model, params, CLEAN)
  np.testing.assert_array_equal(logits, _logits(model, params, CLEAN))
  assert [c.shape for c in acts.contexts] == [(2, 8, 2, 8)] * 2
  assert acts.residual.shape == (3, 2, 8, 16)
  residual = np.asarray(acts.residual)  # indexed on the host
  np.testing.assert_array_equal(residual[0], model.apply(
      {"params": params}, CLEAN, method="embed"))
  np.testing.assert_array_equal(logits, model.apply(
      {"params": params}, jax.device_put(residual[2]), method="readout"))
  # Layer 1's contexts: its attention weights times its values.
  _, weights = model.apply({"params": params}, CLEAN)
  block = params["layer_1"]
  y = nn.LayerNorm().apply({"params": block["ln_attention"]},
                          acts.residual[1])
  value = block["attention"]["value"]
  v = (jnp.einsum("bld,dhk->blhk", y, value["kernel"])
       + value["bias"][None, None])
  np.testing.assert_allclose(
      acts.contexts[1], jnp.einsum("bhqk,bkhd->bqhd", weights[1], v),
      atol=1e-5)


def test_own_activations_change_nothing(model_and_params):
  model, params = model_and_params
  expected = _logits(model, params, CLEAN)
  _, own = patching.run_with_cache(model, params, CLEAN)
  everything = patching.run_patched(
      model, params, CLEAN, own, heads=jax.device_put(np.ones((2, 2), bool)),
      positions=jax.device_put(np.ones((3, 8), bool)))
  np.testing.assert_array_equal(everything, expected)  # bitwise
  heads = patching.patch_heads(model, params, CLEAN, CLEAN, PATCHES)
  assert heads.shape == (4, 2, 8, 11)
  np.testing.assert_allclose(
      heads, np.broadcast_to(np.asarray(expected), heads.shape),
      atol=VMAP_ATOL)


def test_the_residual_everywhere_before_a_block_is_the_corrupt_run(
    model_and_params):
  model, params = model_and_params
  expected = _logits(model, params, CORRUPT)
  _, source = patching.run_with_cache(model, params, CORRUPT)
  before_block_0 = np.zeros((3, 8), bool)
  before_block_0[0] = True
  np.testing.assert_array_equal(patching.run_patched(
      model, params, CLEAN, source,
      positions=jax.device_put(before_block_0)),
      expected)  # bitwise
  layers = [[(layer, p) for p in range(8)] for layer in range(3)]
  patched = patching.patch_residual(model, params, CLEAN, CORRUPT, layers)
  np.testing.assert_allclose(
      patched, np.broadcast_to(np.asarray(expected), patched.shape),
      atol=VMAP_ATOL)


def test_every_head_carries_the_corrupt_run_where_tokens_agree(
    model_and_params):
  """Heads are the only path between positions: with every head's context
  from the corrupt run, a position whose token is the same in both inputs
  computes what it computes in the corrupt run; a changed one does not."""
  model, params = model_and_params
  expected = np.asarray(_logits(model, params, CORRUPT))  # host indexing
  assert PATCHES[-1] == patching.every_head(CONFIG)
  patched = np.asarray(
      patching.patch_heads(model, params, CLEAN, CORRUPT, PATCHES))[-1]
  same = CLEAN == CORRUPT
  np.testing.assert_allclose(patched[same], expected[same], atol=VMAP_ATOL)
  assert np.all(np.abs(patched[~same] - expected[~same]).max(-1) > 1e-2)


def test_the_vmapped_call_equals_a_loop(model_and_params):
  model, params = model_and_params
  batched = patching.patch_heads(model, params, CLEAN, CORRUPT, PATCHES)
  _, source = patching.run_with_cache(model, params, CORRUPT)
  masks = patching.head_patch_masks(CONFIG, PATCHES)
  assert masks.sum() == 8 and masks[1, 0, 0] and masks[1, 1, 1]
  for mask, logits in zip(masks, np.asarray(batched)):
    np.testing.assert_allclose(logits, patching.run_patched(
        model, params, CLEAN, source, heads=jax.device_put(mask)),
        atol=VMAP_ATOL)


@pytest.mark.slow
def test_jit_vmap_and_grad_pass_through(model_and_params):
  model, params = model_and_params
  eager = patching.patch_heads(model, params, CLEAN, CORRUPT, PATCHES)
  # jit of a vmap over examples: [B, P, L, V], the batched call's
  # [P, B, L, V].
  mapped = jax.jit(jax.vmap(lambda c, k: patching.patch_heads(
      model, params, c, k, PATCHES)))(CLEAN, CORRUPT)
  np.testing.assert_allclose(mapped, np.asarray(eager).transpose(1, 0, 2, 3),
                             atol=VMAP_ATOL)
  # Attribution patching: the gradient of a logit with respect to the
  # source's contexts is nonzero only for the patched head.
  _, source = patching.run_with_cache(model, params, CORRUPT)
  heads = np.zeros((2, 2), bool)
  heads[1, 0] = True
  heads = jax.device_put(heads)
  grads = jax.jit(jax.grad(lambda s: patching.run_patched(
      model, params, CLEAN, s, heads=heads)[0, 0, 3]))(source)
  grads = jax.tree.map(np.asarray, grads)  # read on the host
  assert np.abs(grads.contexts[1][..., 0, :]).max() > 0
  assert not np.any(grads.contexts[1][..., 1, :])
  assert not np.any(grads.contexts[0]) and not np.any(grads.residual)


def test_a_layer_without_heads():
  config = TransformerConfig(vocab_size=11, num_layers=2, num_heads=(2, 0),
                             head_dim=8, d_model=16, mlp_dim=32, max_len=8)
  model = Transformer(config)
  params = _random_params(model)
  logits, acts = patching.run_with_cache(model, params, CLEAN)
  assert [c.shape for c in acts.contexts] == [(2, 8, 2, 8), (2, 8, 0, 8)]
  np.testing.assert_array_equal(logits, _logits(model, params, CLEAN))
  assert patching.every_head(config) == [(0, 0), (0, 1)]
  with pytest.raises(ValueError, match=re.escape(
      "patch 1 names head (1, 0), but layer 1 has 0 heads")):
    patching.head_patch_masks(config, [(0, 0), (1, 0)])


@pytest.mark.parametrize("kind,patches,message", [
    ("heads", [(0, 0), (2, 0)],
     "patch 1 names head (2, 0), but the model has no layer 2 (layers 0..1)"),
    ("heads", [[(0, 0), (1, 2)]],
     "patch 0 names head (1, 2), but layer 1 has 2 heads"),
    ("heads", [(-1, 0)], "patch 0 names head (-1, 0), but the model has no "
     "layer -1"),
    ("heads", [(0, 0, 1)], "patch 0 is (0, 0, 1): expected a (layer, index) "
     "pair"),
    ("heads", [], "patches must be a non-empty list of patches, got []"),
    ("residual", [(3, 0)], "patch 0 names position (3, 0), but the residual "
     "stream has layers 0..2"),
    ("residual", [(0, 7), (1, 8)], "patch 1 names position (1, 8), but the "
     "inputs have 8 positions"),
])
def test_bad_patches_are_named(model_and_params, kind, patches, message):
  model, params = model_and_params
  run = patching.patch_heads if kind == "heads" else patching.patch_residual
  with pytest.raises(ValueError, match=re.escape(message)):
    run(model, params, CLEAN, CORRUPT, patches)


def test_inputs_of_different_shapes(model_and_params):
  model, params = model_and_params
  with pytest.raises(ValueError, match=re.escape(
      "clean has shape (2, 8) but corrupt has shape (2, 7)")):
    patching.patch_heads(model, params, CLEAN, CORRUPT[:, :7], [(0, 0)])


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_the_docs_example_runs(tiny_run, tmp_path, monkeypatch):
  """docs/patching.md's block, on the tiny reverse run as runs/reverse."""
  with open(os.path.join(ROOT, "docs", "patching.md"), encoding="utf-8") as f:
    [block] = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert len(block.strip().splitlines()) <= 10
  assert tiny_run.config.task == "reverse"
  shutil.copytree(tiny_run.workdir, tmp_path / "runs" / "reverse")
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  exec(compile(block, "docs/patching.md", "exec"), namespace)
  effect, heads = namespace["effect"], namespace["heads"]
  assert heads == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert effect.shape == (4,) and np.all(np.isfinite(effect))
