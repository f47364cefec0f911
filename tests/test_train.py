"""End-to-end tests of training, checkpoints, resume and eval.py."""

import functools
import glob
import json
import os
import shutil
import struct
import sys
import time
import types

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import default

from conftest import assert_same_bits, copy_workdir, run, start, tiny_config
import mha
from mha import build
from mha.run import config_validation
from mha import data
from mha import evaluate
from mha import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(ROOT, "configs", "default.py")


def _get_config(arg=""):
  return default.get_config(arg)


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
  config, workdir, state = tiny_run.config, tiny_run.workdir, tiny_run.state
  assert int(state.step) == config.num_train_steps
  rows = _read_jsonl(workdir)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [5, 10, 15, 20]
  for key in ("time", "loss", "token_accuracy", "exact_match",
              "learning_rate", "grad_norm", "steps_per_sec"):
    assert all(key in r for r in train_rows), key
  assert all(abs(r["time"] - time.time()) < 3600 for r in rows)
  # The logged learning rate is the schedule's at the window's last step
  # (the step counter before that update). Near the end of the cosine it is
  # 1 + cos(x) with cos(x) close to -1: that cancellation turns the float32
  # rounding of cos (XLA's inside the step, eager here) into up to ~1e-5.
  schedule = build.learning_rate_schedule(config)
  for r in train_rows:
    assert r["learning_rate"] == pytest.approx(float(schedule(r["step"] - 1)),
                                               rel=1e-4)
  val_steps = [r["step"] for r in rows if "validation/exact_match" in r]
  assert val_steps == [10, 20]
  test_rows = [r for r in rows if "test/exact_match" in r]
  assert len(test_rows) == 1 and test_rows[0]["step"] == 20
  # The test metrics are those of the final parameters on the test split
  # (the same program on the same data: equal to the last bit).
  splits = data.load_splits(build.data_spec(config), config.data.data_dir)
  expected = evaluate.evaluate(build.make_model(config), state.params,
                               splits["test"], config.eval_batch_size)
  assert {k: test_rows[0][f"test/{k}"] for k in expected} == expected
  # An eval_batch_size far past the split pads no batch beyond the split's
  # 64 rows (it asked for 732 GB): the same program, the same numbers. So
  # does the program a run compiles for it.
  assert evaluate.evaluate(build.make_model(config), state.params,
                           splits["test"], 10**8) == expected
  with pytest.raises(ValueError, match="the split holds no examples"):
    evaluate.evaluate(build.make_model(config), state.params,
                      data.Split(splits["test"].inputs[:0],
                                 splits["test"].targets[:0]), 64)
  # The loss goes down on this tiny problem.
  assert train_rows[-1]["loss"] < train_rows[0]["loss"]

  assert {"loss", "validation/exact_match", "test/token_accuracy"} <= (
      _event_tags(workdir))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "10", "20"]
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f) == config.to_dict()


def test_load_checkpoint_restores_params_and_config(tiny_run):
  config, workdir, state = tiny_run.config, tiny_run.workdir, tiny_run.state
  ckpt = mha.load_checkpoint(workdir)
  assert ckpt.step == 20
  assert ckpt.config.to_dict() == config.to_dict()
  assert (jax.tree.structure(ckpt.params) ==
          jax.tree.structure(state.params))
  for a, b in zip(jax.tree.leaves(ckpt.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  tokens = np.array([[1, 2, 3, 0, 0, 0, 0, 0]])
  # Jitted: eagerly each of the model's operations compiles on its own.
  logits, attention = jax.jit(ckpt.model.apply)({"params": ckpt.params},
                                                tokens)
  assert logits.shape == (1, 8, ckpt.model_config.vocab_size)
  assert len(attention) == config.model.num_layers
  assert mha.load_checkpoint(workdir, step=10).step == 10
  with pytest.raises(FileNotFoundError, match="steps saved: 10, 20"):
    mha.load_checkpoint(workdir, step=7)
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    mha.load_checkpoint(os.path.join(workdir, "nothing-here"))


def _forget_new_keys(workdir):
  """Makes ``workdir`` look saved before ``model.head_dim``,
  ``data.max_digits`` and ``model.dtype`` existed: its configs
  (``config.json`` and each checkpoint's JSON item) lack them."""
  paths = [os.path.join(workdir, "config.json")] + glob.glob(
      os.path.join(workdir, "checkpoints", "*", "config", "metadata"))
  assert len(paths) == 3
  for path in paths:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    del saved["model"]["head_dim"], saved["data"]["max_digits"]
    del saved["model"]["dtype"]
    with open(path, "w", encoding="utf-8") as f:
      json.dump(saved, f)


def test_second_call_resumes_and_continues(tiny_run, tmp_path, data_dir,
                                           capsys):
  # A copy of the finished run, as saved before model.head_dim and
  # data.max_digits existed, is loaded and continued for 10 more steps with
  # today's config.
  resumed_dir = copy_workdir(tiny_run.workdir, tmp_path / "resumed")
  _forget_new_keys(resumed_dir)
  ckpt = mha.load_checkpoint(resumed_dir)
  # The loaded config is today's: the missing keys at their defaults (what
  # the old run did), so it passes the checks a new run's config passes
  # (the pruning study trains more seeds from it).
  assert ckpt.config.model.head_dim is None
  assert ckpt.config.model.dtype == "float32"
  assert ckpt.config.data.max_digits == default.get_config().data.max_digits
  assert ckpt.config.to_dict() == tiny_run.config.to_dict()
  config_validation.validate_config(ckpt.config)
  assert ckpt.model_config == build.model_config(tiny_run.config)
  for a, b in zip(jax.tree.leaves(ckpt.params),
                  jax.tree.leaves(tiny_run.state.params)):
    np.testing.assert_array_equal(a, b)
  longer = tiny_config(data_dir, "num_train_steps=30")
  new_state = train.train_and_evaluate(longer, resumed_dir)
  assert int(new_state.step) == 30
  steps = [r["step"] for r in _read_jsonl(resumed_dir) if "loss" in r]
  assert steps == [5, 10, 15, 20, 25, 30]  # 5..20 from the first call
  assert "30" in os.listdir(os.path.join(resumed_dir, "checkpoints"))
  # The finished run again: nothing to train, no second row of the same
  # test metrics (a killed run's missing test row would be written).
  rows = _read_jsonl(resumed_dir)
  listing = {name: os.stat(os.path.join(resumed_dir, name)).st_mtime_ns
             for name in os.listdir(resumed_dir) if name != "run.lock"}
  again = train.train_and_evaluate(longer, resumed_dir)
  assert int(again.step) == 30
  assert _read_jsonl(resumed_dir) == rows
  # Nothing else written either: no empty event file, config.json as it was.
  assert {name: os.stat(os.path.join(resumed_dir, name)).st_mtime_ns
          for name in os.listdir(resumed_dir) if name != "run.lock"} == listing
  assert capsys.readouterr().out.splitlines()[-2].startswith(
      "Nothing to train: the run is at step 30 (num_train_steps=30)")


def test_resume_with_dropout_equals_an_uninterrupted_run(tiny_run, tmp_path,
                                                         data_dir):
  # Dropout draws its masks from fold_in(rng, step): a run resumed from step
  # 10 must draw those of steps 11..20 again, and end bitwise the same.
  # (tiny's two layers, unlike tests/test_reliability.py's one-layer runs:
  # the comparison with tiny_run below needs the same model.)
  config = tiny_config(data_dir, "model.dropout_rate=0.1",
                       "model.attention_dropout_rate=0.1")
  whole = train.train_and_evaluate(config, str(tmp_path / "whole"))
  resumed_dir = copy_workdir(tmp_path / "whole", tmp_path / "resumed")
  shutil.rmtree(os.path.join(resumed_dir, "checkpoints", "20"))
  resumed = train.train_and_evaluate(config, resumed_dir)
  assert int(resumed.step) == 20
  # Dropout was on: the same run without it (tiny_run) ends elsewhere.
  assert not np.array_equal(whole.params["logits"]["kernel"],
                            tiny_run.state.params["logits"]["kernel"])
  assert_same_bits(resumed, whole)


def _parse_flags(argv):
  fv = flags.FlagValues()
  # config_flags registers the --config.* overrides from the argv it is given.
  config_flags.DEFINE_config_file("config", CONFIG_FILE, flag_values=fv,
                                  lock_config=True, sys_argv=argv)
  fv(argv)
  return fv.config


def _initial_state(config, model):
  """A run's initial train state, jitted as the run does (eagerly, each
  operation of the initialisation is a program of its own)."""
  return jax.jit(lambda: build.create_train_state(
      config, model, build.run_rngs(config)[0]))()


def test_train_step_says_whether_the_new_state_is_finite():
  config = _get_config("tiny,model.num_layers=1")  # one layer: seconds less
  model = build.make_model(config)
  state = _initial_state(config, model)
  step = jax.jit(functools.partial(
      train.train_step, model=model,
      schedule=build.learning_rate_schedule(config)))
  tokens = np.ones((config.batch_size, config.data.max_len), np.int32)
  batch = {"inputs": tokens, "targets": tokens}
  rng = jax.random.key(0)
  assert bool(step(state, batch, rng)[1]["state_finite"])
  # A non-finite moment of the optimizer (not a parameter) is seen too.
  broken = state.replace(opt_state=jax.tree.map(
      lambda x: np.full(x.shape, np.inf, x.dtype) if x.ndim == 2 else x,
      state.opt_state))
  assert not bool(step(broken, batch, rng)[1]["state_finite"])


def test_a_causal_model_learns_next_tokens_on_the_weighted_positions():
  # No next-token task is registered yet: the model is built directly (the
  # config checks would refuse model.causal with reverse). Rows count up
  # from a random start (mod 9, tokens 1..9): the next token follows from
  # the current one; the first two targets of each row are not scored.
  config = _get_config("tiny,model.causal=True,model.num_kv_heads=1,"
                       "learning_rate=0.03")
  model = build.make_model(config)
  assert model.config.causal and model.config.num_kv_heads == 1
  state = _initial_state(config, model)
  step = jax.jit(functools.partial(
      train.train_step, model=model,
      schedule=build.learning_rate_schedule(config)))
  start = np.random.default_rng(0).integers(0, 9, (64, 1))
  tokens = (start + np.arange(config.data.max_len + 1)) % 9 + 1
  arrays = data.next_token_arrays(tokens, scored_from=3)
  split = data.Split(**arrays)
  batch = data.train_batch(split, seed=0, step=0, batch_size=32)
  first = None
  for _ in range(config.num_train_steps):
    state, metrics = step(state, batch, jax.random.key(0))
    first = first or float(metrics["loss_sum"] / metrics["tokens"])
  assert float(metrics["tokens"]) == 32 * (config.data.max_len - 2)
  metrics = evaluate.evaluate(model, state.params, split, 64)
  assert metrics["loss"] < 0.5 * first and metrics["token_accuracy"] > 0.9


# ml_collections' config_flags loads a config file with the deprecated
# loader.load_module() (config_flags.py, version 1.x); nothing of ours does.
@pytest.mark.filterwarnings(
    "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
def test_config_overrides_from_the_command_line():
  config = _parse_flags([
      "train.py", f"--config={CONFIG_FILE}:sort,tiny",
      "--config.model.num_heads=4", "--config.learning_rate=0.01",
      "--config.data.max_len=6"
  ])
  assert config.task == "sort" and config.model.num_heads == 4
  assert config.learning_rate == 0.01 and config.data.max_len == 6
  assert config.model.d_model == 16  # from the tiny variant
  assert config.model.head_dim is None  # a placeholder: d_model // num_heads
  config = _parse_flags(["train.py", f"--config={CONFIG_FILE}:tiny",
                         "--config.model.num_heads=8",
                         "--config.model.head_dim=8"])
  assert config.model.num_heads == 8 and config.model.head_dim == 8
  assert build.model_config(config).resolved_head_dim == 8
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
  with pytest.raises(KeyError, match="unknown config key 'foo.bar'"):
    _get_config("tiny,foo.bar=1")
  with pytest.raises(ValueError, match="'model' is a group of keys"):
    _get_config("tiny,model=1")


def test_per_layer_heads_from_the_config_argument():
  # A list keeps its commas (one variant); it trains as a pruned model's
  # config would (tests/test_pruned_models.py trains those).
  config = _get_config("tiny,model.num_heads=[2,1],model.head_dim=8,seed=3")
  assert config.model.num_heads == [2, 1] and config.seed == 3
  assert config_validation.config_problems(config) == []
  assert build.model_config(config).heads_per_layer == (2, 1)
  assert config_validation.config_problems(
      _get_config("tiny,model.num_heads=[2,1]")) == [
          "model.num_heads=[2, 1] is per layer: it needs model.head_dim"]
  with pytest.raises(ValueError, match="must be of type int"):
    _get_config("tiny,model.num_heads=[2,x],model.head_dim=8")


def test_eval_script_prints_json_and_writes_heatmaps(tiny_run, tmp_path,
                                                     subprocess_env):
  workdir = copy_workdir(tiny_run.workdir, tmp_path / "run")  # eval/ goes in
  result = run(
      [sys.executable, os.path.join(ROOT, "eval.py"), f"--workdir={workdir}",
       "--split=validation", "--num_examples=2", "--html", "--examples=3"],
      check=True, env=subprocess_env)
  last = json.loads(result.stdout.strip().splitlines()[-1])
  assert last["step"] == 20 and last["split"] == "validation"
  # The validation metrics training logged at step 20, with the same
  # parameters, data and program: equal to the last bit.
  logged = [r for r in _read_jsonl(workdir)
            if r["step"] == 20 and "validation/loss" in r]
  for key in ("loss", "token_accuracy", "exact_match"):
    assert last[key] == logged[-1][f"validation/{key}"], key
  with open(os.path.join(workdir, "eval", "metrics_validation_step20.json"),
            encoding="utf-8") as f:
    assert json.load(f) == last
  # Head roles beside the metrics, [layers][heads] per pattern (tiny: 2 x 2).
  assert [len(r) for r in last["head_roles"]["anti_diagonal"]] == [2, 2]
  with open(os.path.join(workdir, "eval", "attention.html"),
            encoding="utf-8") as f:  # tests/test_explorer.py opens pages
    assert f.read().count('"index":') == 3  # --examples
  pngs = glob.glob(os.path.join(workdir, "eval", "*.png"))
  assert len(pngs) == 2
  for path in pngs:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_eval_script_bad_input(tiny_run, tmp_path, subprocess_env):
  workdir = tiny_run.workdir
  # eval/ cannot be made (a file in the way): refused before any work.
  blocked = copy_workdir(workdir, tmp_path / "blocked")
  with open(os.path.join(blocked, "eval"), "w", encoding="utf-8") as f:
    f.write("kept")
  # Its data to prepare in a data_dir that cannot hold it (behind a file):
  # the run's config, saved in each checkpoint, names that folder.
  no_data = copy_workdir(workdir, tmp_path / "no_data")
  (tmp_path / "a_file").write_text("kept")
  for saved in glob.glob(os.path.join(no_data, "checkpoints", "*", "config",
                                      "metadata")):
    with open(saved, encoding="utf-8") as f:
      config = json.load(f)
    config["data"]["data_dir"] = str(tmp_path / "a_file" / "tfds")
    with open(saved, "w", encoding="utf-8") as f:
      json.dump(config, f)
  cases = (
      ([f"--workdir={tmp_path / 'missing'}"], "does not exist"),
      ([f"--workdir={tmp_path}"], "no checkpoints"),
      (["--workdir="], "--workdir is empty"),  # not the current folder
      ([f"--workdir={workdir}", "--step=3"], "steps saved: 10, 20"),
      ([f"--workdir={workdir}", "--plot_format=gif"],
       "--plot_format=gif: value should be one of <png|svg|pdf>"),
      ([f"--workdir={workdir}", "--num_examples=-3"],
       "--num_examples must be at least 1, got -3"),
      ([f"--workdir={workdir}", "--num_examples=0"],  # wrote 0 heatmaps
       "--num_examples must be at least 1, got 0"),
      ([f"--workdir={blocked}"],
       f"cannot write to {blocked}/eval: {blocked}/eval is a file, not a "
       "folder"),
      ([f"--workdir={no_data}"],
       f"data_dir {tmp_path}/a_file/tfds cannot be used"),
  )
  procs = [start([sys.executable, os.path.join(ROOT, "eval.py")] + args,
                 env=subprocess_env) for args, _ in cases]
  for proc, (_, message) in zip(procs, cases):
    result = proc.wait()
    stderr = result.stderr
    assert result.returncode == 2, stderr
    assert stderr.strip().splitlines() == [
        f"eval.py: error: {stderr.strip()[len('eval.py: error: '):]}"]
    assert message in stderr
  assert not os.path.exists(os.path.join(workdir, "eval"))
  with open(os.path.join(blocked, "eval"), encoding="utf-8") as f:
    assert f.read() == "kept"
  assert (tmp_path / "a_file").read_text() == "kept"


def test_a_logging_window_is_timed_from_fetch_to_fetch(monkeypatch):
  # steps/s of a window: its steps over the time between the fetch that
  # ended the window before and its own last fetch, however long the host
  # then spends on logging (time.time() is read once a fetch). A window
  # every 5 steps.
  clock = iter([100.0, 100.5, 101.0, 101.5, 102.0, 102.5,  # start, 1-5
                103.0, 103.5, 104.0, 104.5, 107.5])  # steps 6-10
  monkeypatch.setattr(train.time, "time", lambda: next(clock))
  written = []
  run = types.SimpleNamespace(
      config=default.get_config("tiny,log_every_steps=5,num_train_steps=10"),
      start_time=100.0, log=lambda line: None,
      writer=types.SimpleNamespace(
          write_scalars=lambda step, scalars: written.append(
              (step, scalars["steps_per_sec"]))))
  progress = train._Progress(run, 0)  # pylint: disable=protected-access
  metrics = {key: np.float32(1) for key in (
      *evaluate.SUM_KEYS, "grad_norm", "learning_rate", "state_finite")}
  for step in range(1, 11):
    progress.record(step, metrics)
  assert written == [(5, 5 / 2.5), (10, 5 / 5.0)]
