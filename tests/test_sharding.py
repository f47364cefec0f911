"""Scaling out: 8 devices train like 1, checkpoints move between device
counts, two processes train as one, and bad meshes are refused up front.

The 8 devices are CPU devices of one subprocess
(``--xla_force_host_platform_device_count=8`` must be set before JAX starts);
this process has one device. Everything of 8 devices runs in that one
subprocess, to start and compile once. A checkpoint moves by a run continued
from its step 6 on the other device count (every run has the same 10 steps,
so the same programs).
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from conftest import copy_workdir, run, start
import mha
from mha.run import config_validation
from mha import data
from mha.run import sharding
from mha import train
from mha.run import workdir_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(ROOT, "configs", "default.py")

# Tiny runs of 10 steps, checkpoints at 6 and 10; the loss logged every 2
# steps (so that calls of the train program run 1 and 2 steps; a run
# continued from step 6 logs the windows of an uninterrupted one). One layer:
# the devices, the shardings and the checkpoints are under test, not the
# model, and each run (in three processes, on three device layouts) traces
# and compiles its programs afresh (measured 2026-12-07: the 8-device
# subprocess 19.7 -> 14.0 s of CPU).
OVERRIDES = ("tiny", "num_train_steps=10", "log_every_steps=2",
             "eval_every_steps=10", "checkpoint_every_steps=6",
             "model.num_layers=1")
# 8 devices add up the same sums in another order: float32 rounding, grown
# over 10 Adam steps at lr 1e-2, stays far below 1e-4 (measured on one layer:
# losses within 5e-7, relatively 2e-7).
RTOL, ATOL = 1e-4, 1e-5

EIGHT_DEVICES = r"""
import json, os, sys
import jax
from mha import checkpoint, train
from mha.run import config_validation
from configs import default as configs
args = json.loads(sys.argv[2])
get = lambda *o: configs.get_config(",".join(args["overrides"] + list(o)))
out = {"devices": jax.device_count()}
try:
  train.train_and_evaluate(get("batch_size=12"), args["bad"])
except config_validation.ConfigError as e:
  out["bad"] = str(e)
out["bad_written"] = os.path.exists(args["bad"])
state = train.train_and_evaluate(get(), args["w8"])
out["replicated"] = all(len(x.sharding.device_set) == 8
                        and x.sharding.is_fully_replicated
                        for x in jax.tree.leaves(state))
state = train.train_and_evaluate(get("mesh.shard_params=True"), args["fsdp"])
out["fsdp_split"] = sum(not x.sharding.is_fully_replicated
                        for x in jax.tree.leaves(state.params))
train.train_and_evaluate(get(), args["w1to8"])  # from step 6
params = checkpoint.load_checkpoint(args["w8"]).params
out["loaded_on"] = len(jax.tree.leaves(params)[0].sharding.device_set)
print(json.dumps(out))
"""


def _config(data_dir, *overrides):
  return default.get_config(
      ",".join(OVERRIDES + (f"data.data_dir={data_dir}",) + overrides))


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _losses(workdir):
  return {r["step"]: r["loss"] for r in _rows(workdir) if "loss" in r}


def _starts(workdir):
  """(step, devices) of each start of the run in ``workdir``."""
  return [(r["step"], r["provenance"]["device_count"])
          for r in _rows(workdir) if "provenance" in r]


def _assert_same_losses(workdir, reference_dir):
  got, want = _losses(workdir), _losses(reference_dir)
  assert sorted(got) == sorted(want)
  np.testing.assert_allclose([got[s] for s in sorted(got)],
                             [want[s] for s in sorted(want)], rtol=RTOL)


def _assert_same_params(workdir, reference_dir):
  got = mha.load_checkpoint(workdir).params
  want = mha.load_checkpoint(reference_dir).params
  flat_got = jax.tree_util.tree_leaves_with_path(got)
  flat_want = jax.tree_util.tree_leaves_with_path(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (path, a), (_, b) in zip(flat_got, flat_want):
    if "['key']['bias']" in jax.tree_util.keystr(path):
      # Its true gradient is 0 (softmax ignores a shift shared by all keys):
      # Adam turns the rounding noise of that 0 into updates of size lr, so
      # it differs from run to run on any change of summation order.
      continue
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                               err_msg=jax.tree_util.keystr(path))


def _from_step_6(source, target):
  """A copy of the workdir ``source`` without its checkpoint 10: a run
  there continues from step 6."""
  copy = copy_workdir(source, target)
  shutil.rmtree(os.path.join(copy, "checkpoints", "10"))
  return copy


def _env(subprocess_env, **extra):
  # Compiles faster; the same float32 sums.
  env = dict(subprocess_env, JAX_DISABLE_MOST_OPTIMIZATIONS="1", **extra)
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
  return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, subprocess_env):
  """One-device runs, then every 8-device run (one subprocess):
  {name: workdir}, plus what the subprocess reported."""
  root = tmp_path_factory.mktemp("runs")
  dirs = {"data_dir": data_dir, "w1": str(root / "w1")}
  train.train_and_evaluate(_config(data_dir), dirs["w1"])  # 1 device
  dirs["w1to8"] = _from_step_6(dirs["w1"], root / "w1to8")  # continued on 8
  args = {"overrides": list(OVERRIDES) + [f"data.data_dir={data_dir}"],
          **{k: str(root / k) for k in ("bad", "w8", "fsdp")},
          "w1to8": dirs["w1to8"]}
  result = subprocess.run(
      [sys.executable, "-c", EIGHT_DEVICES, CONFIG_FILE, json.dumps(args)],
      capture_output=True, text=True, timeout=300, env=_env(
          subprocess_env, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                     " --xla_force_host_platform_device_count=8").strip()))
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  return {**dirs, **args, "report": report}


def test_eight_devices_train_like_one(runs):
  assert runs["report"]["devices"] == 8
  assert runs["report"]["replicated"]
  _assert_same_losses(runs["w8"], runs["w1"])
  _assert_same_params(runs["w8"], runs["w1"])


def test_fsdp_splits_the_parameters_and_trains_the_same(runs):
  assert runs["report"]["fsdp_split"] > 0
  _assert_same_losses(runs["fsdp"], runs["w1"])


def test_a_batch_that_does_not_split_is_refused_before_any_write(runs):
  assert runs["report"]["bad"] == (
      "batch_size=12 is not divisible by the 8 devices of the data axis; use "
      "a multiple of 8")
  assert not runs["report"]["bad_written"]


def test_checkpoints_move_from_8_devices_to_1_and_back(runs, tmp_path):
  # 8 -> 1: continue from step 6 on this process's one device.
  w8to1 = _from_step_6(runs["w8"], tmp_path / "w8to1")
  train.train_and_evaluate(_config(runs["data_dir"]), w8to1)
  assert _starts(w8to1) == [(0, 8), (6, 1)]
  _assert_same_losses(w8to1, runs["w1"])
  _assert_same_params(w8to1, runs["w1"])
  # 1 -> 8: continued in the subprocess.
  assert _starts(runs["w1to8"]) == [(0, 1), (6, 8)]
  _assert_same_losses(runs["w1to8"], runs["w1"])
  _assert_same_params(runs["w1to8"], runs["w1"])
  # load_checkpoint: on every device there is.
  assert runs["report"]["loaded_on"] == 8
  assert mha.load_checkpoint(runs["w8"]).step == 10


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_as_one(runs, tmp_path, subprocess_env):
  port = _free_port()
  address = f"127.0.0.1:{port}"
  workdir = str(tmp_path / "two")
  command = [
      sys.executable, os.path.join(ROOT, "train.py"),
      f"--config={CONFIG_FILE}:{','.join(OVERRIDES)}", f"--workdir={workdir}",
      f"--config.data.data_dir={runs['data_dir']}",
      # One save, the final one (each is a round of the two processes).
      "--config.checkpoint_every_steps=10",
      f"--coordinator_address={address}", "--num_processes=2"]
  # Loopback only: the coordinator binds there (gloo uses the host name,
  # which resolves to it here).
  env = dict(subprocess_env, JAX_COORDINATOR_BIND_ADDRESS=address)
  procs = [start(command + [f"--process_id={i}"], env=env) for i in range(2)]
  try:
    results = [p.wait(timeout=240) for p in procs]
  finally:
    for p in procs:
      p.kill()  # Nothing where it has exited.
  for result in results:
    assert result.returncode == 0, result.stderr[-3000:]
  assert "2 cpu devices in 2 processes" in results[0].stdout
  assert "step 10/10" in results[0].stdout
  assert "step" not in results[1].stdout  # process 0 alone logs
  assert workdir_lock.holder(workdir)["pid"] == procs[0].pid  # and locks
  _assert_same_losses(workdir, runs["w1"])
  _assert_same_params(workdir, runs["w1"])


def test_bad_mesh_on_the_command_line_is_one_line_and_exit_code_2(
    tmp_path, subprocess_env):
  workdir = tmp_path / "never"
  for flag, message in (
      ("--config.mesh.data=4", "mesh.data=4 does not match the 1 device of"),
      ("--config.batch_size=0", "batch_size=0 must be >= 1"),
      ("--config.mesh.data=-2", "mesh.data=-2 must be -1 (all devices)"),
  ):
    result = run([sys.executable, os.path.join(ROOT, "train.py"),
                  f"--config={CONFIG_FILE}:tiny", f"--workdir={workdir}",
                  flag], env=subprocess_env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not workdir.exists()


def test_device_problems():
  config = default.get_config("tiny")
  assert config_validation.device_problems(config, 8) == []
  assert config_validation.device_problems(config, 1) == []
  assert config_validation.device_problems(config, 3) == [
      "batch_size=32 is not divisible by the 3 devices of the data axis; use "
      "a multiple of 3"]
  config = default.get_config("tiny,mesh.data=8")
  assert config_validation.device_problems(config, 8) == []
  assert "does not match the 4 devices" in (
      config_validation.device_problems(config, 4)[0])


def test_process_rows_build_the_global_batch_bitwise():
  rows = np.arange(100 * 6, dtype=np.int32).reshape(100, 6)
  split = data.Split(inputs=rows, targets=-rows)
  config = default.get_config("tiny,batch_size=24")
  for step in (0, 3, 9):  # 9: the batch crosses an epoch boundary
    whole = data.train_batch(split, seed=config.seed, step=step,
                             batch_size=24)
    for processes in (1, 2, 4):
      size = 24 // processes
      parts = [train.process_train_batch(split, config, step,
                                         slice(p * size, (p + 1) * size))
               for p in range(processes)]
      for key in ("inputs", "targets"):
        np.testing.assert_array_equal(
            np.concatenate([part[key] for part in parts]), whole[key])


def test_fsdp_spec_splits_the_largest_dimension_that_divides():
  assert sharding.fsdp_spec((16, 32), 8) == P(None, "data")
  assert sharding.fsdp_spec((32, 12), 8) == P("data")
  assert sharding.fsdp_spec((11, 5), 8) == P()
  assert sharding.fsdp_spec((), 8) == P()
  assert sharding.fsdp_spec((16, 32), 1) == P()


def test_one_device_mesh_and_eval_batches():
  mesh = sharding.make_mesh()
  assert sharding.data_size(mesh) == jax.device_count() == 1
  with pytest.raises(ValueError, match="does not match the 1 device of"):
    sharding.make_mesh(2)
  split = data.Split(inputs=np.ones((5, 4), np.int32),
                     targets=np.ones((5, 4), np.int32))
  batches = list(sharding.eval_batches(split, 3, mesh))
  assert [b["inputs"].shape for b in batches] == [(3, 4), (3, 4)]
  assert int(batches[1]["inputs"].sum()) == 8  # the padding row is zeros
  # A batch size past the split's: one batch of the split's rows, not of
  # 10**8 (an eval_batch_size of 10**8 ran out of memory).
  assert sharding.eval_batch_rows(10**8, 5, mesh) == 5
  assert sharding.eval_batch_rows(3, 5, mesh) == 3
  assert [b["inputs"].shape for b in
          sharding.eval_batches(split, 10**8, mesh)] == [(5, 4)]
