"""``config.init_from``: a run that starts from another run's checkpoint."""

import json
import os

import jax
import numpy as np
import pytest

import mha
from conftest import tiny_config
from mha.run import config_validation
from mha import finetune
from mha import train
from mha.pruning import export


@pytest.fixture(scope="module")
def pruned(tiny_run, tmp_path_factory):
  """The tiny run with head 0:1 removed, saved as a workdir."""
  out = str(tmp_path_factory.mktemp("pruned") / "model")
  export.save_pruned(mha.load_checkpoint(tiny_run.workdir), [(0, 1)], out,
                     source=tiny_run.workdir)
  return out


def test_starts_from_the_pruned_models_exact_parameters(pruned, data_dir,
                                                        tmp_path):
  source = mha.load_checkpoint(pruned)
  workdir = str(tmp_path / "ft")
  # One step: the warmup's learning rate at step 0 is exactly 0, so the
  # parameters after it are the starting ones, bit for bit.
  config = tiny_config(data_dir, f"init_from={pruned}", "num_train_steps=1")
  state = train.train_and_evaluate(config, workdir)
  assert int(state.step) == 1  # step 0 was the start, not the source's 20
  ft = mha.load_checkpoint(workdir)
  assert ft.config.model.num_heads == [1, 2]  # the model config is W's
  jax.tree.map(np.testing.assert_array_equal, ft.params, source.params)
  tokens = source.config.data.max_len
  inputs = np.arange(2 * tokens, dtype=np.int32).reshape(2, tokens) % 11
  # Jitted: the pruned model's shapes are this test's alone, and eagerly
  # each of its ops would compile on its own.
  np.testing.assert_array_equal(
      jax.jit(ft.model.apply)({"params": ft.params}, inputs)[0],
      jax.jit(source.model.apply)({"params": source.params}, inputs)[0])
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    # The train row (the first step also has a row of start-up times).
    first = next(row for row in map(json.loads, f) if "learning_rate" in row)
  assert first["step"] == 1 and first["learning_rate"] == 0.0
  # The optimizer is fresh: Adam's count is this run's one step.
  restored = train.ckpt_lib.make_manager(workdir, read_only=True)
  try:
    full = train.ckpt_lib.read_state(
        restored, 1, train.ckpt_lib.abstract_train_state(ft.config))
  finally:
    restored.close()
  counts = [int(x) for x in jax.tree.leaves(full.opt_state)
            if np.ndim(x) == 0]
  assert counts and set(counts) == {1}
  # Resuming it is as usual: the same command, more steps.
  more = tiny_config(data_dir, f"init_from={pruned}", "num_train_steps=3")
  assert int(train.train_and_evaluate(more, workdir).step) == 3


def test_mismatched_model_keys_are_refused_writing_nothing(pruned, data_dir,
                                                           tmp_path):
  workdir = tmp_path / "ft"
  config = tiny_config(data_dir, f"init_from={pruned}", "model.mlp_dim=64")
  with pytest.raises(config_validation.ConfigError,
                     match=r"model.mlp_dim \(here 64, there 32\)"):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()
  wide = tiny_config(data_dir, f"init_from={pruned}", "model.num_heads=1")
  with pytest.raises(config_validation.ConfigError, match="model.num_heads"):
    finetune.resolve_config(wide)
  with pytest.raises(config_validation.ConfigError, match="no checkpoints"):
    finetune.resolve_config(tiny_config(data_dir,
                                        f"init_from={tmp_path / 'none'}"))


def test_the_model_config_comes_from_the_source(pruned, data_dir):
  # The unpruned tiny model's config names the model W was pruned from.
  resolved = finetune.resolve_config(
      tiny_config(data_dir, f"init_from={pruned}"))
  assert resolved.model.num_heads == [1, 2] and resolved.model.head_dim == 8
  given = {"num_layers": 2, "num_heads": 2, "d_model": 16, "head_dim": None}
  source = dict(given, num_heads=[1, 2], head_dim=8)
  assert finetune.model_conflicts(given, source) == []
  assert finetune.model_conflicts(dict(given, num_heads=1), source)
  assert finetune.model_conflicts(given, dict(source, head_dim=4))
