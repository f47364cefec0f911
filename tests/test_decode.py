"""Tests of mha.decode: cached decoding is the full causal pass, token by
token; generation is greedy or sampled; the checkpoint of a causal model with
grouped key/value heads rebuilds it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import decode
from mha.model import Transformer, TransformerConfig

# Float32 sums in another order (one position at a time against the whole
# sequence): agreement within 1e-5 on logits of order 1.
TOL = dict(atol=1e-5, rtol=1e-5)
CFG = TransformerConfig(vocab_size=11, num_layers=2, num_heads=2, d_model=16,
                        mlp_dim=32, max_len=8, causal=True)
# Jitted: one program, not one per operation.
TOKENS = jax.jit(lambda: jax.random.randint(jax.random.key(1), (2, 8), 1,
                                            11))()


def _params(cfg):
  return Transformer(cfg).init(jax.random.key(0), TOKENS)["params"]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    {"num_kv_heads": 1},
    # Seconds of compiling each: the full suite only.
    pytest.param({}, marks=pytest.mark.slow),
    pytest.param({"positional": "sinusoidal", "pre_norm": False},
                 marks=pytest.mark.slow)])
def test_cached_decoding_equals_the_full_causal_pass(kwargs):
  cfg = dataclasses.replace(CFG, **kwargs)
  params = _params(cfg)
  full, _ = Transformer(cfg).apply({"params": params}, TOKENS)
  np.testing.assert_allclose(decode.cached_logits(cfg, params, TOKENS), full,
                             **TOL)


def test_the_cache_holds_the_key_value_heads():
  cache = decode.init_cache(dataclasses.replace(CFG, num_kv_heads=1), 3, 5)
  assert cache["layer_0"]["attention"]["cached_key"].shape == (3, 5, 1, 8)
  assert int(cache["cache_index"]) == 0


@pytest.mark.slow  # compiles the generation loop: the full suite only
def test_greedy_generation_is_the_argmax_of_the_full_pass():
  cfg = dataclasses.replace(CFG, num_kv_heads=1)
  params = _params(cfg)
  prompt = TOKENS[:, :3]
  out = decode.generate(cfg, params, prompt, 5, rng=jax.random.key(0))
  assert out.shape == (2, 8)
  out = np.asarray(out)
  np.testing.assert_array_equal(out[:, :3], prompt)
  full, _ = Transformer(cfg).apply({"params": params}, out)
  # On the host: the argmax of each position's logits, never padding.
  best = np.argmax(np.asarray(full)[:, :, 1:], -1) + 1
  np.testing.assert_array_equal(out[:, 3:], best[:, 2:-1])


def test_sampling_draws_from_the_tempered_distribution():
  logits = jnp.log(jnp.array([[0.5, 0.1, 0.3, 0.6]] * 4000))
  next_token = jax.jit(decode.next_token)  # one program for the three
  greedy = np.asarray(next_token(logits, jax.random.key(0), 0.0))
  assert np.all(greedy == 3)
  drawn = np.asarray(next_token(logits, jax.random.key(0), 1.0))
  # Token 0 is never drawn; 1..3 in proportion 0.1 : 0.3 : 0.6, each within
  # 0.03 (a binomial standard deviation at n = 4000 is under 0.008).
  assert not np.any(drawn == 0)
  np.testing.assert_allclose(np.bincount(drawn, minlength=4)[1:] / 4000,
                             [0.1, 0.3, 0.6], atol=0.03)
  sharp = np.asarray(next_token(logits, jax.random.key(0), 0.05))
  assert np.mean(sharp == 3) > 0.99


@pytest.mark.parametrize("call, match", [
    (lambda p: decode.generate(dataclasses.replace(CFG, causal=False), p,
                               TOKENS[:, :2], 2, rng=jax.random.key(0)),
     "only a causal model"),
    (lambda p: decode.generate(CFG, p, TOKENS[:, :4], 5,
                               rng=jax.random.key(0)),
     "a prompt of 4 tokens and 5 more exceed the model's 8 positions"),
    (lambda p: decode.generate(CFG, p, TOKENS[:, :0], 2,
                               rng=jax.random.key(0)), "the prompt is empty"),
    (lambda p: decode.generate(CFG, p, TOKENS[:, :2], 2, rng=jax.random.key(0),
                               temperature=-1.0), "temperature must be >= 0"),
])
def test_bad_generation_requests(call, match):
  with pytest.raises(ValueError, match=match):
    call(_params(CFG))


@pytest.fixture(scope="module")
def causal_workdir(tmp_path_factory):
  """A workdir holding step 1 of an untrained causal model with one key/value
  head for two query heads (saved directly: no next-token task exists for
  train.py to train one on)."""
  from configs import default  # pylint: disable=import-outside-toplevel
  from mha import build  # pylint: disable=import-outside-toplevel
  from mha import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  config = default.get_config("tiny,model.causal=True,model.num_kv_heads=1")
  # Jitted: eager initialisation compiles each op on its own.
  state = jax.jit(lambda: build.create_train_state(
      config, build.make_model(config), jax.random.key(0)))()
  workdir = str(tmp_path_factory.mktemp("causal"))
  checkpoints = ckpt_lib.TrainCheckpoints(
      workdir, keep=1, abstract_state=jax.eval_shape(lambda: state))
  checkpoints.save(1, state, config)
  checkpoints.close()
  return workdir


@pytest.mark.slow  # an orbax save and two restores: the full suite only
def test_a_causal_grouped_checkpoint_rebuilds_in_linen_and_nnx(
    causal_workdir):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from mha.checkpoint import load_checkpoint, transformer_from_checkpoint  # pylint: disable=import-outside-toplevel
  loaded = load_checkpoint(causal_workdir)
  cfg = loaded.model_config
  assert cfg.causal and cfg.num_kv_heads == 1 and not cfg.decode
  assert loaded.params["layer_0"]["attention"]["key"]["kernel"].shape == (
      16, 1, 8)
  tokens = TOKENS[:, :6]
  want, _ = jax.jit(loaded.model.apply)({"params": loaded.params}, tokens)
  model = transformer_from_checkpoint(causal_workdir)
  got, _ = nnx.jit(lambda m: m(tokens))(model)
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(
      decode.cached_logits(cfg, loaded.params, tokens), want, **TOL)


@pytest.mark.slow  # runs sample.py: the full suite only
def test_sample_script_and_its_bad_input(causal_workdir, tmp_path,
                                         subprocess_env):
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from conftest import ROOT, run  # pylint: disable=import-outside-toplevel
  sample = lambda *args: run(
      [sys.executable, os.path.join(ROOT, "sample.py"),
       f"--workdir={causal_workdir}", *args], env=subprocess_env)
  result = sample("--prompt_ids=3,1,4", "--num_tokens=4", "--num_samples=2",
                  "--temperature=0.7")
  assert result.returncode == 0, result.stderr
  rows = [json.loads(line)["tokens"] for line in result.stdout.splitlines()]
  assert len(rows) == 2 and all(len(r) == 7 and r[:3] == [3, 1, 4]
                                for r in rows)
  for args, message in [
      (["--prompt_ids=3,1,4", "--num_tokens=6"],
       "a prompt of 3 tokens and 6 more exceed the model's 8 positions"),
      (["--prompt_ids=3,x"], "--prompt_ids must be integers, got 3,x"),
      (["--prompt_ids=3,11"], "prompt token 11 is not a token of the model"),
      (["--prompt=abc"], "this task's tokens are not characters"),
      ([], "give the prompt as --prompt (text) or --prompt_ids"),
      (["--prompt_ids=1", "--temperature=-1"], "--temperature must be >= 0"),
  ]:
    result = sample(*args)
    assert result.returncode == 2, (args, result.stderr)
    assert result.stderr.strip().splitlines() == [
        f"sample.py: error: {result.stderr.split('error: ', 1)[1].strip()}"]
    assert message in result.stderr, (args, result.stderr)
  assert os.listdir(causal_workdir) == ["checkpoints"]  # nothing written
