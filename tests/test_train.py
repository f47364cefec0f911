"""End-to-end tests of training, checkpoints, resume and eval.py."""

import glob
import json
import os
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import default
import mha
from mha import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(ROOT, "configs", "default.py")


def _get_config(arg=""):
  return default.get_config(arg)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir):
  """A tiny config trained for 20 steps: (config, workdir, final state)."""
  config = _get_config(f"tiny,data.data_dir={data_dir}")
  workdir = str(tmp_path_factory.mktemp("tiny_run"))
  state = train.train_and_evaluate(config, workdir)
  return config, workdir, state


def _read_jsonl(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _event_tags(workdir):
  """Scalar tags in the workdir's TensorBoard event files (parsed for real)."""
  from tensorboardX.proto import event_pb2
  tags = set()
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      blob = f.read()
    pos = 0
    while pos < len(blob):  # TFRecord: len, crc, payload, crc
      (length,) = struct.unpack("<Q", blob[pos:pos + 8])
      event = event_pb2.Event.FromString(blob[pos + 12:pos + 12 + length])
      tags.update(v.tag for v in event.summary.value)
      pos += 12 + length + 4
  return tags


def test_train_writes_metrics_checkpoints_and_events(tiny_run):
  config, workdir, state = tiny_run
  assert int(state.step) == config.num_train_steps
  rows = _read_jsonl(workdir)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [5, 10, 15, 20]
  for key in ("time", "loss", "token_accuracy", "exact_match",
              "learning_rate", "grad_norm", "steps_per_sec"):
    assert all(key in r for r in train_rows), key
  assert all(abs(r["time"] - time.time()) < 3600 for r in rows)
  val_steps = [r["step"] for r in rows if "validation/exact_match" in r]
  assert val_steps == [10, 20]
  test_rows = [r for r in rows if "test/exact_match" in r]
  assert len(test_rows) == 1 and 0 <= test_rows[0]["test/exact_match"] <= 1
  # The loss goes down on this tiny problem.
  assert train_rows[-1]["loss"] < train_rows[0]["loss"]

  assert {"loss", "validation/exact_match", "test/token_accuracy"} <= (
      _event_tags(workdir))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "10", "20"]
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["model"]["d_model"] == config.model.d_model


def test_load_checkpoint_restores_params_and_config(tiny_run):
  config, workdir, state = tiny_run
  ckpt = mha.load_checkpoint(workdir)
  assert ckpt.step == 20
  assert ckpt.config.to_dict() == config.to_dict()
  for a, b in zip(jax.tree.leaves(ckpt.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  tokens = np.array([[1, 2, 3, 0, 0, 0, 0, 0]])
  logits, attention = ckpt.model.apply({"params": ckpt.params}, tokens)
  assert logits.shape == (1, 8, ckpt.model_config.vocab_size)
  assert len(attention) == config.model.num_layers
  assert mha.load_checkpoint(workdir, step=10).step == 10
  with pytest.raises(FileNotFoundError, match="steps saved: 10, 20"):
    mha.load_checkpoint(workdir, step=7)
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    mha.load_checkpoint(os.path.join(workdir, "nothing-here"))


def test_second_call_resumes_and_continues(tiny_run, tmp_path, data_dir):
  config, workdir, state = tiny_run
  # A copy of the finished run, continued for 10 more steps.
  import shutil
  resumed_dir = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed_dir)
  longer = _get_config(f"tiny,data.data_dir={data_dir},num_train_steps=30")
  new_state = train.train_and_evaluate(longer, resumed_dir)
  assert int(new_state.step) == 30
  steps = [r["step"] for r in _read_jsonl(resumed_dir) if "loss" in r]
  assert steps == [5, 10, 15, 20, 25, 30]  # 5..20 from the first call
  assert "30" in os.listdir(os.path.join(resumed_dir, "checkpoints"))


def _parse_flags(argv):
  fv = flags.FlagValues()
  # config_flags registers the --config.* overrides from the argv it is given.
  config_flags.DEFINE_config_file("config", CONFIG_FILE, flag_values=fv,
                                  lock_config=True, sys_argv=argv)
  fv(argv)
  return fv.config


def test_config_overrides_from_the_command_line():
  config = _parse_flags([
      "train.py", f"--config={CONFIG_FILE}:sort,tiny",
      "--config.model.num_heads=4", "--config.learning_rate=0.01",
      "--config.data.max_len=6"
  ])
  assert config.task == "sort" and config.model.num_heads == 4
  assert config.learning_rate == 0.01 and config.data.max_len == 6
  assert config.model.d_model == 16  # from the tiny variant
  with pytest.raises(flags.IllegalFlagValueError):
    _parse_flags(["train.py", f"--config={CONFIG_FILE}",
                  "--config.model.num_heads=x"])


def test_config_variants():
  assert _get_config("histogram").task == "histogram"
  config = _get_config("tiny,model.mlp_dim=48,data.min_len=2")
  assert config.model.mlp_dim == 48 and config.data.min_len == 2
  with pytest.raises(KeyError, match="no_such_key"):
    _get_config("no_such_key=3")
  with pytest.raises(ValueError, match="unknown config variant"):
    _get_config("huge")
  with pytest.raises(AttributeError):  # locked: no new fields
    _get_config().new_field = 1


def test_eval_script_prints_json_and_writes_heatmaps(tiny_run):
  _, workdir, _ = tiny_run
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "eval.py"), f"--workdir={workdir}",
       "--split=validation", "--num_examples=2"],
      capture_output=True, text=True, check=True)
  last = json.loads(result.stdout.strip().splitlines()[-1])
  assert last["step"] == 20 and last["split"] == "validation"
  for key in ("loss", "token_accuracy", "exact_match"):
    assert 0 <= last[key] < 100
  pngs = glob.glob(os.path.join(workdir, "eval", "*.png"))
  assert len(pngs) == 2
  for path in pngs:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_eval_script_bad_input(tiny_run, tmp_path):
  _, workdir, _ = tiny_run
  for args, message in (
      ([f"--workdir={tmp_path / 'missing'}"], "does not exist"),
      ([f"--workdir={tmp_path}"], "no checkpoints"),
      ([f"--workdir={workdir}", "--step=3"], "steps saved: 10, 20"),
  ):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "eval.py")] + args,
        capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
