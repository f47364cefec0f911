"""Reliability: bad input is refused up front, runs are never mixed, and a run
survives SIGTERM/SIGINT, kill -9, damaged checkpoints and non-finite losses."""

import asyncio
import glob
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import ml_collections
import numpy as np
import pytest

from configs import default
from conftest import (assert_same_bits, copy_workdir, run, start,
                      tiny_config)
import mha
from mha import checkpoint as ckpt_lib
from mha.run import cli
from mha.run import config_validation
from mha.run import interrupt
from mha.run import metric_writers
from mha import train
from mha.run import workdir_lock
from mha.run import write_failures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(ROOT, "configs", "default.py")

# The run every resumed run is compared with: four checkpoints, so that a
# run can be stopped (at named steps: ``MHA_TEST_SIGNAL_AT``) between them;
# with dropout, so that a resumed run must draw the dropout masks of an
# uninterrupted one. One layer: faults, resumes and checkpoints are under
# test, not the model, and most of the CPU of each of the file's two dozen
# train.py processes goes to tracing its programs and loading them from the
# compilation cache afresh, less for one layer than for the ``tiny``
# config's two (measured 2026-12-07, the file in one process: 82 -> 65 s of
# CPU, the chaos test's 12 processes 31 -> 26 s).
STEPS, EVERY = 20, 5
MODEL = "model.num_layers=1"
RUN_OVERRIDES = (f"num_train_steps={STEPS}", f"checkpoint_every_steps={EVERY}",
                 "eval_every_steps=1000", "log_every_steps=1000",
                 "model.dropout_rate=0.1", "model.attention_dropout_rate=0.1",
                 MODEL)


def _run_config(data_dir, *overrides):
  return tiny_config(data_dir, *overrides)


def _command(script, *args):
  return [sys.executable, os.path.join(ROOT, script), *args]


def _train_command(data_dir, workdir, *overrides):
  return _command(
      "train.py", f"--config={CONFIG_FILE}:tiny", f"--workdir={workdir}",
      f"--config.data.data_dir={data_dir}",
      *(f"--config.{o}" for o in RUN_OVERRIDES + overrides))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """An uninterrupted run: (config, workdir, final state)."""
  config = _run_config(data_dir, *RUN_OVERRIDES)
  workdir = str(tmp_path_factory.mktemp("reference"))
  handler = signal.getsignal(signal.SIGTERM)
  state = train.train_and_evaluate(config, workdir)
  assert signal.getsignal(signal.SIGTERM) is handler  # put back
  return config, workdir, state


def _assert_params_equal(workdir, state, *, subprocess_trained):
  assert_same_bits(mha.load_checkpoint(workdir).params, state.params,
                   subprocess_trained=subprocess_trained)


def _steps(workdir):
  directory = os.path.join(workdir, "checkpoints")
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(n) for n in names if n.isdigit())


def _tmp_dirs(workdir):
  return glob.glob(os.path.join(workdir, "checkpoints", "*orbax-checkpoint-tmp*"))


def _snapshot(path):
  """Every file below ``path`` with its size and modification time."""
  return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size,
                               os.stat(os.path.join(d, f)).st_mtime_ns)
          for d, _, files in os.walk(path) for f in files}


# What a quiet exit never prints (orbax's event loops, threads at shutdown).
NOISE = ("Traceback", "Event loop is closed", "Exception ignored",
         "sys.meta_path is None", "Using custom data configuration")


def _assert_quiet(stderr):
  for noise in NOISE:
    assert noise not in stderr, stderr[-3000:]


def _last_line(stderr):
  return stderr.strip().splitlines()[-1] if stderr.strip() else ""


# --------------------------------------------------------------------------
# Bad input: one line on stderr, exit code 2, nothing written.
# --------------------------------------------------------------------------


def test_every_config_field_has_a_declared_type():
  types = config_validation.declared_types()
  keys = config_validation.flatten(default.get_config().to_dict())
  assert set(keys) == set(types)
  assert types["learning_rate"] is float and types["model.pre_norm"] is bool
  assert types["model.head_dim"] is int  # a placeholder's declared type
  assert config_validation.config_problems(default.get_config("tiny")) == []
  assert config_validation.RESUMABLE_KEYS <= set(types)


def test_per_layer_heads_and_configs_saved_before_head_dim():
  # A pruned model: one head count per layer, 0 allowed, head_dim required.
  fields = default.get_config("tiny").to_dict()
  fields["model"]["num_heads"] = [2, 0]
  problems = config_validation.config_problems(ml_collections.ConfigDict(
      fields))
  assert problems == ["model.num_heads=[2, 0] is per layer: it needs "
                      "model.head_dim"]
  fields["model"]["head_dim"] = 8
  assert config_validation.config_problems(
      ml_collections.ConfigDict(fields)) == []
  fields["model"]["num_heads"] = [2, -1, 1]
  assert config_validation.config_problems(
      ml_collections.ConfigDict(fields)) == [
          "model.num_heads=[2, -1, 1] has 3 entries, not one per layer "
          "(model.num_layers=2)",
          "model.num_heads=[2, -1, 1] must be >= 0 each"]
  fields["model"]["num_heads"] = [2, "x"]
  assert config_validation.config_problems(
      ml_collections.ConfigDict(fields)) == [
          "model.num_heads=[2, 'x'] must be of type int, not list"]
  # A config saved before model.head_dim existed: valid, and resuming it
  # with head_dim at its default is no conflict; with another value it is.
  config = default.get_config("tiny")
  saved = config.to_dict()
  del saved["model"]["head_dim"]
  assert config_validation.config_problems(
      ml_collections.ConfigDict(saved)) == []
  assert config_validation.resume_conflicts(saved, config) == []
  assert config_validation.resume_conflicts(
      saved, default.get_config("tiny,model.head_dim=4")) == [
          "model.head_dim (saved None, now 4)"]
  # init_from names the same folder however it is written.
  here = os.getcwd()
  saved = default.get_config(f"tiny,init_from={here}/pruned").to_dict()
  assert config_validation.resume_conflicts(
      saved, default.get_config("tiny,init_from=pruned")) == []
  assert config_validation.resume_conflicts(
      saved, default.get_config("tiny,init_from=other")) == [
          f"init_from (saved '{here}/pruned', now '{here}/other')"]


@pytest.mark.parametrize("override, message", [
    ("model.num_heads=3", "model.d_model=16 is not divisible by "
     "model.num_heads=3"),
    ("data.min_len=9", "data.min_len=9 is larger than data.max_len=8"),
    ("data.min_len=0", "data.min_len=0 must be >= 1"),
    ("num_train_steps=0", "num_train_steps=0 must be >= 1"),
    ("batch_size=-4", "batch_size=-4 must be >= 1"),
    ("learning_rate=0.0", "learning_rate=0.0 must be a positive number"),
    ("learning_rate=-1e-3", "learning_rate=-0.001 must be a positive number"),
    ("model.dropout_rate=1.0", "model.dropout_rate=1.0 must be in [0, 1)"),
    ("model.attention_dropout_rate=-0.1",
     "model.attention_dropout_rate=-0.1 must be in [0, 1)"),
    ("task=copy", "task='copy' is not a task; the tasks are reverse, sort, "
     "histogram"),
    ("eval_every_steps=0", "eval_every_steps=0 must be >= 1"),
    ("checkpoint_every_steps=0", "checkpoint_every_steps=0 must be >= 1"),
    # numpy's batch order takes no negative seed (a run trained, wrote its
    # checkpoints and then crashed on it).
    ("seed=-1", "seed=-1 must be >= 0"),
    # jax.random.key(2**32) is key(0): a seed sweep would repeat its inits.
    ("seed=4294967296", "seed=4294967296 must be < 2**32 = 4294967296"),
])
def test_bad_config_values_are_named(override, message):
  with pytest.raises(config_validation.ConfigError) as error:
    config_validation.validate_config(default.get_config(f"tiny,{override}"))
  assert message in str(error.value)


def test_wrong_types_and_unknown_keys_are_named():
  # A hand-built config (say, in a notebook) has no type safety or lock.
  fields = default.get_config("tiny").to_dict()
  fields["batch_size"] = "32"
  fields["model"]["dropout"] = 0.1  # a typo of dropout_rate
  with pytest.raises(config_validation.ConfigError) as error:
    config_validation.validate_config(ml_collections.ConfigDict(fields))
  assert "batch_size='32' must be of type int, not str" in str(error.value)
  assert "unknown config key 'model.dropout'" in str(error.value)


def test_train_and_evaluate_writes_nothing_for_bad_input(tmp_path, data_dir):
  workdir = tmp_path / "run"
  with pytest.raises(config_validation.ConfigError, match="divisible"):
    train.train_and_evaluate(
        _run_config(data_dir, "model.num_heads=3"), workdir)
  assert not workdir.exists()
  workdir.write_text("not a directory")
  with pytest.raises(config_validation.ConfigError, match="is an existing file"):
    train.train_and_evaluate(_run_config(data_dir), workdir)


def _tree(path):
  """Every file and folder below ``path``: kind, size and modification
  time."""
  entries = {}
  for folder, dirs, files in os.walk(path):
    for name in dirs + files:
      stat = os.lstat(os.path.join(folder, name))
      entries[os.path.relpath(os.path.join(folder, name), path)] = (
          name in dirs, stat.st_size, stat.st_mtime_ns)
  return entries


def _write(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


# A workdir that cannot hold a run: how to make it in ``tmp_path / "run"``,
# and what the refusal says. Each failed only after training (a folder where
# a file goes, a file where a folder goes), with a traceback (a damaged
# config.json), or trained in the current folder (an empty path).
_BAD_WORKDIRS = {
    "empty path": (lambda run: None, "", 'the workdir path is empty'),
    "through a file": (lambda run: _write(run, "x"), "run/sub",
                       "/run is a file, not a folder"),
    "metrics.jsonl a folder": (
        lambda run: (run / "metrics.jsonl").mkdir(parents=True), "run",
        "/run/metrics.jsonl is a folder, not the file a run writes there"),
    "checkpoints a file": (
        lambda run: _write(run / "checkpoints", ""), "run",
        "/run/checkpoints is a file, not the folder a run writes there"),
    "run.lock a folder": (
        lambda run: (run / "run.lock").mkdir(parents=True), "run",
        "/run/run.lock is a folder, not the file a run writes there"),
    "config.json cut short": (
        lambda run: _write(run / "config.json", '{"seed": 0, "task'), "run",
        "/run/config.json is damaged: not valid JSON"),
    "config.json a list": (
        lambda run: _write(run / "config.json", "[1, 2]"), "run",
        "/run/config.json is not a config: a JSON array, not an object of "
        "config fields"),
}


@pytest.mark.parametrize("case", _BAD_WORKDIRS)
def test_a_workdir_that_cannot_hold_a_run_is_refused_untouched(
    case, tmp_path, data_dir, monkeypatch):
  make, workdir, message = _BAD_WORKDIRS[case]
  make(tmp_path / "run")
  monkeypatch.chdir(tmp_path)  # "" would be this folder
  before = _tree(tmp_path)
  with pytest.raises(config_validation.ConfigError) as error:
    train.train_and_evaluate(_run_config(data_dir), workdir)
  assert message in str(error.value)
  assert _tree(tmp_path) == before
  if case.startswith("config.json"):  # The library call says the same.
    with pytest.raises(ckpt_lib.DamagedConfigFileError, match=message):
      ckpt_lib.saved_config(tmp_path / "run")


def test_command_line_mistakes_are_one_line_and_exit_code_2(tmp_path,
                                                            subprocess_env):
  workdir = str(tmp_path / "run")
  a_file = tmp_path / "file"
  a_file.write_text("")
  cwd = tmp_path / "cwd"  # "--workdir=" would train here
  cwd.mkdir()
  cases = [
      (_command("train.py", f"--workdir={workdir}", "--config.batch_size=abc"),
       "flag --config.batch_size=abc"),
      (_command("train.py", f"--workdir={workdir}", "--config.nope=1"),
       "unknown config key in the --config.* flags: 'nope'"),
      # With --config given, config_flags raises it while parsing instead.
      (_command("train.py", f"--workdir={workdir}",
                f"--config={CONFIG_FILE}:tiny", "--config.model.bogus=1"),
       "unknown config key in the --config.* flags: 'bogus'"),
      (_command("train.py", "--workdir=", f"--config={CONFIG_FILE}:tiny"),
       '--workdir is empty; name a folder ("." for the current one)'),
      (_command("train.py", f"--workdir={workdir}",
                f"--config={CONFIG_FILE}:tiny,model.nope=3"),
       "unknown config key 'model.nope'"),
      (_command("train.py", f"--workdir={workdir}",
                "--config.model.d_model=30"),
       "model.d_model=30 is not divisible by model.num_heads=4"),
      (_command("train.py", f"--workdir={a_file}"), "is an existing file"),
      (_command("train.py"), "--workdir"),
      (_command("eval.py", f"--workdir={workdir}", "--step=last"),
       "flag --step=last"),
      (_command("train.py", f"--workdir={workdir}",
                f"--config={CONFIG_FILE}:tiny,foo.bar=1"),
       "unknown config key 'foo.bar'"),
      (_command("train.py", f"--workdir={workdir}",
                "--config.model.num_heads=[2,1]"),
       "a count per layer goes in the config argument: --config "
       "configs/default.py:model.num_heads=[4,2],model.head_dim=8"),
      # jax.distributed raised an IndexError on an address without a port.
      (_command("train.py", f"--workdir={workdir}", "--num_processes=1",
                "--process_id=0", "--coordinator_address=notahost"),
       "--coordinator_address=notahost: must be host:port"),
  ]
  procs = [start(command, env=subprocess_env, cwd=cwd) for command, _ in cases]
  for proc, (command, message) in zip(procs, cases):
    result = proc.wait()
    stderr = result.stderr
    script = os.path.basename(command[1])
    assert result.returncode == 2, (command, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), (
        command, stderr)
    assert message in lines[0], (command, stderr)
  assert not os.path.exists(workdir)
  assert not os.listdir(cwd)


# --------------------------------------------------------------------------
# Never mix runs.
# --------------------------------------------------------------------------


def test_resuming_with_another_model_data_or_optimizer_is_refused(reference):
  config, workdir, _ = reference
  before = _snapshot(workdir)
  other = default.get_config(
      f"tiny,data.data_dir={config.data.data_dir},model.d_model=32,"
      "learning_rate=0.02,data.num_symbols=12,num_train_steps=400")
  with pytest.raises(config_validation.ConfigError) as error:
    train.train_and_evaluate(other, workdir)
  message = str(error.value)
  for key in ("model.d_model (saved 16, now 32)", "learning_rate",
              "data.num_symbols"):
    assert key in message
  assert "num_train_steps (" not in message  # may change
  assert _snapshot(workdir) == before

  saved = ckpt_lib.saved_config(workdir)
  assert saved == config.to_dict()
  resumable = default.get_config(
      "tiny,data.data_dir=/elsewhere,num_train_steps=900,log_every_steps=7,"
      "eval_every_steps=9,checkpoint_every_steps=11,max_checkpoints_to_keep=1,"
      f"eval_batch_size=16,model.dropout_rate=0.1,{MODEL},"
      "model.attention_dropout_rate=0.1")
  assert config_validation.resume_conflicts(saved, resumable) == []


# --------------------------------------------------------------------------
# Preemption and crashes.
# --------------------------------------------------------------------------


def _newest(workdir):
  return max(_steps(workdir), default=0)


def _closed_pipe_run(command, env):
  """``command`` with its stdout into a pipe whose reader is already gone."""
  read_end, write_end = os.pipe()
  os.close(read_end)
  try:
    return subprocess.run(command, env=env, stdout=write_end,
                          stderr=subprocess.PIPE, text=True, check=False)
  finally:
    os.close(write_end)


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_the_run_quietly(tmp_path, data_dir,
                                                        subprocess_env):
  # ``python train.py | head -1``, without the race: the pipe's reader is
  # gone before the run writes its first line, so that write finds the pipe
  # broken. The run ends with the status SIGPIPE gives ``cat`` (no
  # traceback, which a BrokenPipeError used to print).
  result = _closed_pipe_run(_train_command(data_dir, str(tmp_path / "run")),
                            subprocess_env)
  assert result.returncode == cli.BROKEN_PIPE_STATUS, result.stderr
  assert result.stderr == ""


def test_only_the_standard_streams_end_the_process_on_a_closed_pipe(
    subprocess_env):
  # Another closed pipe or socket is an error to its writer, as Python has
  # it: asyncio (under orbax's saves) writes to its wake-up socket after
  # another thread may have closed it, and SIGPIPE's default action, set for
  # the standard streams' sake, ended a training run so at random. A print
  # from another thread into the closed stdout still ends the process.
  code = textwrap.dedent("""
      import socket, sys, threading
      from mha.run import cli
      cli.end_quietly_on_broken_pipe()
      ours, theirs = socket.socketpair()
      theirs.close()
      try:
        ours.send(b"x")
      except BrokenPipeError:
        print("raised", file=sys.stderr, flush=True)
      thread = threading.Thread(target=lambda: print("line", flush=True))
      thread.start()
      thread.join()
      raise SystemExit(3)
      """)
  result = _closed_pipe_run([sys.executable, "-c", code], subprocess_env)
  assert (result.returncode, result.stderr) == (cli.BROKEN_PIPE_STATUS,
                                                "raised\n")


def test_sigint_stops_after_the_step_with_a_checkpoint(tmp_path, data_dir,
                                                       monkeypatch):
  workdir = str(tmp_path / "run")
  # SIGINT to this process at the step after the first checkpoint
  # (``MHA_TEST_SIGNAL_AT``: no thread, no timing); its count starts here.
  monkeypatch.setenv(interrupt.TEST_ENV, f"train#{EVERY + 3}:SIGINT")
  monkeypatch.setattr(interrupt, "_times_reached", {})
  # Ours while training runs: a signal arriving late must not stop pytest.
  previous = signal.signal(signal.SIGINT, lambda *_: None)
  ours = signal.getsignal(signal.SIGINT)
  try:
    with pytest.raises(train.TrainingInterrupted) as error:
      # Calls of one step, one ``train`` point each.
      train.train_and_evaluate(
          _run_config(data_dir, *RUN_OVERRIDES, "log_every_steps=1"),
          workdir)
    assert signal.getsignal(signal.SIGINT) is ours  # handlers restored
  finally:
    signal.signal(signal.SIGINT, previous)
  assert error.value.signum == signal.SIGINT
  assert error.value.step == EVERY + 3
  assert _steps(workdir) == [EVERY, EVERY + 3]
  assert mha.load_checkpoint(workdir).step == error.value.step


def _damage(step_dir, how):
  if how == "truncate":  # the largest array file, to half its size
    path = max(glob.glob(os.path.join(step_dir, "state", "d", "*")),
               key=os.path.getsize)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  else:
    os.remove(os.path.join(step_dir, "state", "_METADATA"))


def test_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes(
    reference, tmp_path, capfd):
  config, workdir, final = reference
  copy = str(tmp_path / "run")
  copy_workdir(workdir, copy)
  newest = os.path.join(copy, "checkpoints", str(STEPS))
  _damage(newest, "truncate")

  state = train.train_and_evaluate(config, copy)
  out, err = capfd.readouterr()
  assert f"checkpoint {newest} is damaged" in err
  assert f"Resumed from checkpoint at step {STEPS - EVERY}" in out
  moved = glob.glob(os.path.join(copy, "damaged_checkpoints", f"{STEPS}-*"))
  assert len(moved) == 1 and f"moved it to {moved[0]}" in err
  assert int(state.step) == STEPS and _steps(copy)[-1] == STEPS  # saved again
  _assert_params_equal(copy, final, subprocess_trained=False)


def test_load_checkpoint_and_eval_skip_or_name_a_damaged_checkpoint(
    reference, tmp_path, capfd, subprocess_env):
  _, workdir, _ = reference
  copy = str(tmp_path / "run")
  copy_workdir(workdir, copy)
  newest = os.path.join(copy, "checkpoints", str(STEPS))
  _damage(newest, "delete")

  assert mha.load_checkpoint(copy).step == STEPS - EVERY
  assert f"checkpoint {newest} is damaged" in capfd.readouterr().err
  with pytest.raises(ckpt_lib.DamagedCheckpointError, match=newest):
    mha.load_checkpoint(copy, step=STEPS)
  result = run(
      _command("eval.py", f"--workdir={copy}", f"--step={STEPS}"),
      env=subprocess_env)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith(f"eval.py: error: checkpoint {newest} is damaged")


def test_a_damaged_checkpoints_message_keeps_only_what_reads():
  # TensorStore's errors end with the repr of a bound method (seen with a
  # truncated file), which the one line leaves out.
  manager = types.SimpleNamespace(directory="/runs/r/checkpoints")
  error = ValueError(
      'DATA_LOSS: Error reading "state/d/1": unexpected end of data [source '
      'locations=\'tensorstore/x.cc:1\'] See full TensorStore details: '
      '<bound method pybind11_detail_function_record_v1.spec of '
      'TensorStore({...})>\nmore')
  message = str(ckpt_lib._damaged(manager, 20, error))  # pylint: disable=protected-access
  assert message == (
      "checkpoint /runs/r/checkpoints/20 is damaged: ValueError: DATA_LOSS: "
      'Error reading "state/d/1": unexpected end of data [source '
      "locations='tensorstore/x.cc:1']")


def test_an_unverified_checkpoint_never_deletes_an_intact_one(tmp_path):
  state = {"w": np.arange(4.0, dtype=np.float32)}
  config = ml_collections.ConfigDict({"note": "test"})
  checkpoints = ckpt_lib.TrainCheckpoints(
      tmp_path, keep=1, abstract_state=jax.eval_shape(lambda: state))
  checkpoints.save(1, state, config)
  checkpoints.save(2, state, config)  # verifies 1; keeps it (2 unverified)
  checkpoints.wait_until_finished()
  _damage(checkpoints.step_path(2), "delete")
  with pytest.raises(ckpt_lib.DamagedCheckpointError,
                     match=checkpoints.step_path(2)):
    checkpoints.verify()
  assert _steps(tmp_path) == [1, 2]  # orbax's max_to_keep=1 would keep [2]
  checkpoints.save(3, state, config)  # 2 is done with; 3 verified next
  checkpoints.verify()
  assert _steps(tmp_path) == [3]
  checkpoints.close()


@pytest.mark.parametrize("overrides, saved", [
    # Step 3 is also the last (final save), each step saved.
    (("num_train_steps=3", "checkpoint_every_steps=1"), [1, 2]),
    # The loop fetches a step's metrics once the next step is dispatched
    # (log_every_steps is 1000 here): the NaN of step 3 is found when step 4
    # is dispatched, long before the first save (at step 120).
    (("num_train_steps=120", "checkpoint_every_steps=120"), []),
], ids=["each_step_saved", "inside_a_fetch_window"])
def test_non_finite_loss_stops_naming_the_step_without_saving_it(
    tmp_path, data_dir, subprocess_env, overrides, saved):
  # lr 1e30 (after one warmup step at lr 0): the parameters blow up at step
  # 2 and the loss of step 3 is NaN.
  workdir = str(tmp_path / "run")
  result = run(
      _train_command(data_dir, workdir, "learning_rate=1e30",
                     "grad_clip_norm=1e30", "warmup_steps=1", *overrides),
      env=subprocess_env)
  assert result.returncode == 1, result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py: error: non-finite training metrics at "
                         "step 3"), result.stderr
  newest = (f"step {saved[-1]} in {workdir}/checkpoints" if saved
            else "none")
  assert f"(newest checkpoint: {newest})" in last, last
  _assert_quiet(result.stderr)
  assert _steps(workdir) == saved
  for step in saved:
    params = mha.load_checkpoint(workdir, step=step).params
    assert all(np.isfinite(p).all() for p in jax.tree.leaves(params))


# --------------------------------------------------------------------------
# One run per workdir.
# --------------------------------------------------------------------------

def test_workdir_lock_names_its_holder_and_is_released(tmp_path):
  first = workdir_lock.WorkdirLock(tmp_path / "run")
  first.acquire()
  holder = workdir_lock.holder(tmp_path / "run")
  assert holder["pid"] == os.getpid() and holder["host"]
  with pytest.raises(workdir_lock.WorkdirLockedError) as error:
    workdir_lock.WorkdirLock(tmp_path / "run").acquire()  # another descriptor
  assert (f"{tmp_path / 'run'} is in use by another run (pid {os.getpid()} "
          f"on host {holder['host']}, started {holder['started']})"
          in str(error.value))
  assert isinstance(error.value, config_validation.ConfigError)  # exit 2
  first.release()
  with workdir_lock.WorkdirLock(tmp_path / "run"):  # free again
    pass


def test_a_second_run_is_refused_and_the_first_ends_as_if_alone(
    reference, tmp_path, data_dir, subprocess_env):
  _, _, final = reference
  workdir = str(tmp_path / "run")
  command = _train_command(data_dir, workdir)
  # Frozen (it stops itself: ``MHA_TEST_SIGNAL_AT``) at the step after its
  # second save began, while orbax may still write it in the background,
  # with an older checkpoint complete: what a second run must neither clean
  # up nor append to.
  first = subprocess.Popen(
      command, env=dict(subprocess_env, **{
          interrupt.TEST_ENV: f"train#{2 * EVERY + 1}:SIGSTOP"}),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _, status = os.waitpid(first.pid, os.WUNTRACED)  # every thread stopped
  assert os.WIFSTOPPED(status), status
  try:
    before = _snapshot(workdir)
    # Readers keep working: the newest complete checkpoint, never the one
    # being written.
    assert mha.load_checkpoint(workdir).step == _newest(workdir)
    second = run(command, env=subprocess_env)
    assert second.returncode == 2, second.stderr
    assert _last_line(second.stderr).startswith(
        f"train.py: error: {workdir} is in use by another run (pid "
        f"{first.pid} on host "), second.stderr
    _assert_quiet(second.stderr)
    assert _snapshot(workdir) == before  # nothing written
  finally:
    first.send_signal(signal.SIGCONT)
  _, stderr = first.communicate()
  assert first.returncode == 0, stderr
  _assert_quiet(stderr)
  steps = [row["step"] for row in _rows(workdir) if "loss" in row]
  assert steps == sorted(set(steps))  # one run's rows, none twice
  # Last: skipped off CPU.
  _assert_params_equal(workdir, final, subprocess_trained=True)


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


# --------------------------------------------------------------------------
# Write failures: one line, older checkpoints intact, resumable.
# --------------------------------------------------------------------------


def test_prune_heads_locks_its_output_folder(reference, tmp_path,
                                             subprocess_env):
  _, workdir, _ = reference
  out = tmp_path / "out"
  with workdir_lock.WorkdirLock(out):
    result = run(
        _command("scripts/prune_heads.py", f"--workdir={workdir}",
                 f"--out={out}", "--num_seeds=1", "--nospeed"),
        env=subprocess_env)
  assert result.returncode == 2, result.stderr
  assert _last_line(result.stderr).startswith(
      f"prune_heads.py: error: {out} is in use by another run (pid "
      f"{os.getpid()} on host "), result.stderr
  _assert_quiet(result.stderr)
  assert os.listdir(out) == [workdir_lock.LOCK_FILE]  # nothing written


def _mount(*args):
  """Runs ``mount *args``; skips the test where mounting is not allowed."""
  result = subprocess.run(["mount", *args], capture_output=True, text=True)
  if result.returncode != 0:
    pytest.skip("mounting needs root (and a sandbox that lets root mount): "
                f"{result.stderr.strip()}; test_write_faults_below_orbax "
                "covers the same paths without")


def _allocated_kib(directory):
  """KiB that ``directory``'s files and folders take on a tmpfs (whole 4 KiB
  pages)."""
  pages = 0
  for folder, dirs, files in os.walk(directory):
    pages += 1  # the folder itself
    for name in files:
      pages += -(-os.path.getsize(os.path.join(folder, name)) // 4096)
  return 4 * pages


@pytest.fixture
def small_disk(tmp_path, reference):
  """A folder on a tmpfs that holds about two and a half checkpoints of the
  run (2.5 times the largest checkpoint of the reference run: orbax's files
  differ in size from run to run, so a fixed size held two on one run and
  one on another), and a function that grows it."""
  _, workdir, _ = reference
  root = os.path.join(workdir, "checkpoints")
  largest = max(_allocated_kib(os.path.join(root, step))
                for step in os.listdir(root) if step.isdigit())
  disk = tmp_path / "disk"
  disk.mkdir()
  _mount("-t", "tmpfs", "-o", f"size={int(2.5 * largest) + 16}k", "tmpfs",
         str(disk))

  def grow():
    subprocess.run(["mount", "-o", "remount,size=16m", str(disk)],
                   check=True)

  yield disk, grow
  subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_full_disk_stops_in_one_line_and_the_rerun_resumes(
    reference, small_disk, data_dir, subprocess_env, capfd):
  config, _, final = reference
  disk, grow = small_disk
  workdir = str(disk / "run")
  command = _train_command(data_dir, workdir)
  result = run(command, env=subprocess_env)
  assert result.returncode == 1, result.stderr
  # Orbax's files differ in size from run to run, so which save fills the
  # disk varies (the third, usually); whichever it is, the line names it and
  # exactly the checkpoints left intact before it.
  intact = _steps(workdir)
  assert intact and intact == list(range(EVERY, intact[-1] + 1, EVERY))
  failed = intact[-1] + EVERY
  assert failed <= STEPS
  listed = (f"checkpoints {', '.join(map(str, intact))} are" if len(intact) > 1
            else f"checkpoint {intact[0]} is")
  assert _last_line(result.stderr) == (
      f"train.py: error: no space left on device while saving checkpoint "
      f"{failed} in {workdir}/checkpoints; {listed} intact; free space and "
      "run the same command to resume")
  _assert_quiet(result.stderr)
  assert not _tmp_dirs(workdir)
  assert mha.load_checkpoint(workdir).step == intact[-1]

  grow()  # space freed; the same run again (in this process: faster)
  state = train.train_and_evaluate(config, workdir)
  assert (f"Resumed from checkpoint at step {intact[-1]}"
          in capfd.readouterr().out)
  _assert_params_equal(workdir, final, subprocess_trained=True)
  assert_same_bits(state.params, final.params, subprocess_trained=True)


@pytest.fixture
def file_size_limit():
  """``limit(n)``: writes beyond ``n`` bytes of a file fail with EFBIG in
  this process (the kernel's RLIMIT_FSIZE: a fault below orbax, tensorstore
  and Python's io, and no root needed); put back afterwards."""
  previous = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death
  yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE,
                                     (n, previous[1]))
  resource.setrlimit(resource.RLIMIT_FSIZE, previous)
  signal.signal(signal.SIGXFSZ, handler)


def test_write_faults_below_orbax(tmp_path, file_size_limit):
  # A checkpoint save: step 1 (zeros, compressed small) fits under the
  # limit, step 2 (random numbers) does not.
  zeros = {"w": np.zeros((128, 128), np.float32)}
  noise = {"w": np.random.default_rng(0).random((128, 128), np.float32)}
  config = ml_collections.ConfigDict({"note": "test"})
  checkpoints = ckpt_lib.TrainCheckpoints(
      tmp_path, keep=3, abstract_state=jax.eval_shape(lambda: zeros))
  file_size_limit(32 * 1024)
  with pytest.raises(write_failures.WriteFailure) as error:
    with write_failures.reported(checkpoints.directory):
      try:
        checkpoints.save(1, zeros, config)
        checkpoints.save(2, noise, config)
        checkpoints.verify()
      finally:
        checkpoints.close()
  assert str(error.value) == (
      f"file too large while saving checkpoint 2 in {tmp_path}/checkpoints; "
      "checkpoint 1 is intact; raise the file size limit (ulimit -f) and run "
      "the same command to resume")
  assert not _tmp_dirs(tmp_path) and _steps(tmp_path) == [1]

  # metrics.jsonl (an old run's rows near the limit already): the line that
  # does not fit is taken back whole.
  with open(tmp_path / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.write(json.dumps({"step": -1, "note": "x" * 30_000}) + "\n")
  writer = metric_writers.MetricWriter(tmp_path)
  with pytest.raises(write_failures.WriteFailure,
                     match=f"file too large while writing {tmp_path}/"
                           "metrics.jsonl$"):
    for step in range(100):
      writer.write_scalars(step, {f"metric_{i}": i / 7 for i in range(20)})
  writer.close()
  steps = [row["step"] for row in _rows(str(tmp_path))]
  assert len(steps) > 2 and steps == list(range(-1, len(steps) - 1))


def test_read_only_filesystem_is_one_error_at_once(tmp_path):
  # A read-only view of a workdir holding checkpoint 1 (a bind mount).
  state = {"w": np.arange(4.0, dtype=np.float32)}
  config = ml_collections.ConfigDict({"note": "test"})
  abstract = jax.eval_shape(lambda: state)
  checkpoints = ckpt_lib.TrainCheckpoints(tmp_path / "rw", keep=3,
                                          abstract_state=abstract)
  checkpoints.save(1, state, config)
  checkpoints.close()
  view = tmp_path / "ro"
  view.mkdir()
  _mount("--bind", str(tmp_path / "rw"), str(view))
  try:
    subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
    directory = ckpt_lib.checkpoint_dir(view)
    with pytest.raises(write_failures.WriteFailure) as error:
      with write_failures.reported(directory):
        metric_writers.MetricWriter(view)
    assert str(error.value) == (
        f"read-only file system while writing {view}/metrics.jsonl; "
        "checkpoint 1 is intact; make the filesystem writable and run the "
        "same command to resume")
    # Refused before orbax starts (its threads would wait 300 s for the
    # step folder that it cannot create).
    checkpoints = ckpt_lib.TrainCheckpoints(view, keep=3,
                                            abstract_state=abstract)
    with pytest.raises(write_failures.WriteFailure,
                       match=f"^read-only file system while saving "
                             f"checkpoint 2 in {directory}$"):
      checkpoints.save(2, state, config)
    checkpoints.close()
  finally:
    subprocess.run(["umount", "--lazy", str(view)], check=True)


# --------------------------------------------------------------------------
# Damaged checkpoints, seen from the command line; one row per step.
# --------------------------------------------------------------------------


def test_a_damaged_checkpoint_is_one_line_and_its_steps_one_row_each(
    reference, tmp_path, subprocess_env):
  _, workdir, final = reference
  copy = copy_workdir(workdir, tmp_path / "run")
  newest = os.path.join(copy, "checkpoints", str(STEPS))
  _damage(newest, "truncate")

  evaluated = run(_command("eval.py", f"--workdir={copy}"),
                  env=subprocess_env)
  assert evaluated.returncode == 0, evaluated.stderr
  lines = evaluated.stderr.strip().splitlines()
  assert lines[0].startswith(f"warning: checkpoint {newest} is damaged: "), (
      evaluated.stderr)
  assert lines[0].endswith("; skipping it")
  assert all(line.startswith("Wrote ") for line in lines[1:]), lines
  assert json.loads(evaluated.stdout)["step"] == STEPS - EVERY

  result = run(_train_command(data_dir=reference[0].data.data_dir,
                              workdir=copy), env=subprocess_env)
  assert result.returncode == 0, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  moved = glob.glob(os.path.join(copy, "damaged_checkpoints", f"{STEPS}-*"))
  assert lines[0].startswith(f"warning: checkpoint {newest} is damaged: ")
  assert lines[0].endswith(f"; moved it to {moved[0]}; trying the next "
                           "older checkpoint")
  assert f"Resumed from checkpoint at step {STEPS - EVERY}" in result.stdout
  _assert_one_row_per_step(copy, starts=2)
  _assert_params_equal(copy, final, subprocess_trained=True)


def _assert_one_row_per_step(workdir, *, starts):
  """``metrics.jsonl`` holds each metric once per step, and the provenance
  row of each of the ``starts`` starts of the run."""
  rows = _rows(workdir)
  assert sum("provenance" in row for row in rows) == starts
  seen = set()
  for row in rows:
    if "provenance" not in row:
      for key in set(row) - {"step", "time"}:
        assert (row["step"], key) not in seen, (row["step"], key)
        seen.add((row["step"], key))


def test_every_checkpoint_damaged_stops_until_told_to_start_over(
    reference, tmp_path, subprocess_env):
  config, workdir, _ = reference
  copy = copy_workdir(workdir, tmp_path / "run")
  steps = _steps(copy)
  for step in steps:
    _damage(os.path.join(copy, "checkpoints", str(step)), "truncate")
  command = _train_command(config.data.data_dir, copy)
  result = run(command, env=subprocess_env)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == len(steps) + 1, result.stderr[-3000:]
  assert all(line.startswith("warning: checkpoint ") for line in lines[:-1])
  listed = ", ".join(map(str, steps))
  assert lines[-1] == (
      f"train.py: error: no intact checkpoint left in {copy}/checkpoints: "
      f"every one is damaged (steps {listed}, kept in "
      f"{copy}/damaged_checkpoints); to start the run over from step 0, run "
      "the same command with --restart_from_scratch")
  assert ckpt_lib.damaged_steps(copy) == steps and not _steps(copy)

  # Started over; the damaged checkpoints stay.
  result = run(command + ["--restart_from_scratch"], env=subprocess_env)
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines()[0] == (
      "Starting over from step 0 with --restart_from_scratch: no intact "
      f"checkpoint left in {copy}/checkpoints (damaged steps {listed}, kept "
      f"in {copy}/damaged_checkpoints)")
  assert result.stderr == ""
  assert ckpt_lib.damaged_steps(copy) == steps and _steps(copy)[-1] == STEPS
  # The old rows gone: the new run wrote the same steps' rows again, so a
  # row left of the old run would be a second one of its step.
  _assert_one_row_per_step(copy, starts=2)
  assert max(row["step"] for row in _rows(copy)) == STEPS

  # With an intact checkpoint, the flag is a mistake.
  result = run(command + ["--restart_from_scratch"], env=subprocess_env)
  assert result.returncode == 2, result.stderr
  assert _last_line(result.stderr).startswith(
      "train.py: error: --restart_from_scratch starts a run over only when "
      "no intact checkpoint is left"), result.stderr


def test_orbax_abandoned_async_work_is_dropped_and_nothing_else(monkeypatch):
  # What orbax leaves when one read of a restore fails: coroutines of its
  # code that fail as they are collected, and futures whose TensorStore
  # error nobody retrieves. Made here in code that names orbax's folder.
  def failing_coroutine(folder):
    namespace = {}
    exec(compile(textwrap.dedent("""
        import types
        @types.coroutine
        def pause():
          yield
        async def read():
          try:
            await pause()
          finally:
            raise ValueError("abandoned")
        """), f"/site-packages/{folder}/serialization.py", "exec"), namespace)
    coroutine = namespace["read"]()
    coroutine.send(None)
    return coroutine

  # Judged inside the hook: keeping the report would resurrect the
  # coroutine being collected.
  reports = []
  monkeypatch.setattr(sys, "unraisablehook", lambda report: reports.append(
      (type(report.exc_value), ckpt_lib._abandoned_async_report(report))))  # pylint: disable=protected-access
  for folder in ("orbax", "mine"):
    coroutine = failing_coroutine(folder)
    del coroutine
  assert reports == [(ValueError, True), (ValueError, False)]

  records = []
  logger = logging.getLogger("asyncio")
  monkeypatch.setattr(logger, "filters", [])
  handler = logging.Handler()
  handler.emit = records.append
  logger.addHandler(handler)
  try:
    loop = asyncio.new_event_loop()
    for error in (ValueError('DATA_LOSS: Error reading "state/d/1"'),
                  ValueError("a bug of ours")):
      future = loop.create_future()
      future.set_exception(error)
      del future
    loop.close()
  finally:
    logger.removeHandler(handler)
  drop = ckpt_lib._DropAbandonedAsyncLogs()  # pylint: disable=protected-access
  assert [drop.filter(r) for r in records] == [False, True], [
      r.getMessage() for r in records]


def test_orbax_coroutines_never_awaited_are_collected_silently():
  # A failed restore also abandons coroutines orbax created and never
  # awaited; Python warns as each is collected ("coroutine ... was never
  # awaited"), a line that broke the one line per damaged checkpoint.
  def unawaited_coroutine(folder):
    namespace = {}
    exec(compile("async def read():\n  pass\n",
                 f"/site-packages/{folder}/metadata_store.py", "exec"),
         namespace)
    coroutine = namespace["read"]()
    cycle = [coroutine]
    cycle.append(cycle)  # freed by the garbage collector only
    return coroutine

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for folder in ("orbax", "mine"):
      unawaited_coroutine(folder)
    ckpt_lib._collect_abandoned()  # pylint: disable=protected-access
  messages = [str(w.message) for w in caught]
  assert messages == ["coroutine 'read' was never awaited"], messages
  assert caught[0].source.cr_code.co_filename.startswith("/site-packages/mine")


def test_resumed_metrics_drop_redone_steps_atomically(tmp_path, monkeypatch):
  path = str(tmp_path / "metrics.jsonl")
  writer = metric_writers.MetricWriter(tmp_path)
  writer.write_header(0, {"run": 1})
  for step in range(1, 11):
    writer.write_scalars(step, {"loss": step})
  writer.write_header(10, {"run": 2})  # a start at step 10, then killed
  writer.write_scalars(11, {"loss": 11})
  writer.close()
  with open(path, encoding="utf-8") as f:
    before = f.read()

  # Killed while dropping (before the rename): the file is as it was.
  def killed(*_):
    raise OSError("killed")

  monkeypatch.setattr(os, "replace", killed)
  with pytest.raises(OSError):
    metric_writers.drop_rows_from(path, 6)
  monkeypatch.undo()
  with open(path, encoding="utf-8") as f:
    assert f.read() == before

  writer = metric_writers.MetricWriter(tmp_path, purge_step=6)
  writer.write_scalars(6, {"loss": 6.5})
  writer.close()
  rows = _rows(str(tmp_path))
  assert [(r["step"], r.get("loss"), r.get("provenance")) for r in rows] == [
      (0, None, {"run": 1}), (1, 1, None), (2, 2, None), (3, 3, None),
      (4, 4, None), (5, 5, None), (10, None, {"run": 2}), (6, 6.5, None)]
  assert not os.path.exists(path + ".tmp")
  # TensorBoard drops the older event files' steps from 6 on at this event.
  events = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  purge = [e for e in map(_event, _records(max(events, key=os.path.getmtime)))
           if e.HasField("session_log")]
  assert [(e.step, e.session_log.status) for e in purge] == [
      (6, purge[0].session_log.START)]


def _records(path):
  """The records of a TFRecord file (an event file)."""
  with open(path, "rb") as f:
    data = f.read()
  records, offset = [], 0
  while offset < len(data):
    length = int.from_bytes(data[offset:offset + 8], "little")
    records.append(data[offset + 12:offset + 12 + length])
    offset += 12 + length + 4
  return records


def _event(record):
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  event = event_pb2.Event()
  event.ParseFromString(record)
  return event


# --------------------------------------------------------------------------
# Chaos: kill -9 at ten chosen moments, resume each time.
# --------------------------------------------------------------------------

# The reference run (its steps, seed, model and dropout) with a row per step
# and validation every 10 steps: cadences, which change no bit of the state, so
# the reference's final state is the uninterrupted run's.
CHAOS_STEPS, CHAOS_EVERY = STEPS, EVERY
CHAOS_OVERRIDES = (f"num_train_steps={CHAOS_STEPS}",
                   f"checkpoint_every_steps={CHAOS_EVERY}",
                   "eval_every_steps=10", "log_every_steps=1",
                   "model.dropout_rate=0.1", "model.attention_dropout_rate=0.1",
                   MODEL)


def _chaos_moments(seed, count=10):
  """``count`` kill moments (``STEP:PHASE``), in the order a run meets them:
  at least three during a save, the rest after a step, drawn with ``seed``."""
  rng = np.random.default_rng(seed)
  saves = rng.choice(np.arange(CHAOS_EVERY, CHAOS_STEPS + 1, CHAOS_EVERY),
                     3, replace=False)
  steps = rng.choice(np.arange(1, CHAOS_STEPS), count - 3, replace=False)
  moments = sorted([(int(s), 1) for s in saves] + [(int(s), 0) for s in steps])
  return [f"{s}:{('after_step', 'during_save')[p]}" for s, p in moments]


def _sigterm_saves_the_step_and_says_how_to_resume(command, workdir, env, *,
                                                   before):
  """SIGTERM at the second step of a resumed run (``MHA_TEST_SIGNAL_AT``):
  the run saves that step, says how to resume, ends with 128 + SIGTERM, and
  a kill's half-written checkpoint is gone; it stops before the moment
  ``before`` (so that the next kill still comes)."""
  resumed_from = _newest(workdir)
  result = run(command, env=dict(env, **{interrupt.TEST_ENV: "train#2"}))
  assert result.returncode == 128 + signal.SIGTERM, result.stderr
  stopped = resumed_from + 2
  assert stopped < int(before.split(":")[0]), (stopped, before)
  assert _newest(workdir) == stopped
  assert (f"Interrupted by SIGTERM at step {stopped}; checkpoint saved"
          in result.stderr), result.stderr
  assert "Resume with: python " in result.stderr
  assert "--workdir=" in result.stderr
  _assert_quiet(result.stderr)
  assert not _tmp_dirs(workdir)


def test_chaos_kill_9_at_ten_moments_then_resume_equals_an_uninterrupted_run(
    reference, tmp_path, data_dir, subprocess_env):
  # The uninterrupted run: the reference, of the same config but cadences.
  config, _, final = reference
  cadences = ("checkpoint_every_steps", "eval_every_steps", "log_every_steps")
  same = lambda c: {k: v for k, v in c.to_dict().items() if k not in cadences}
  assert same(config) == same(_run_config(data_dir, *CHAOS_OVERRIDES))
  workdir = str(tmp_path / "run")
  command = _command(
      "train.py", f"--config={CONFIG_FILE}:tiny", f"--workdir={workdir}",
      f"--config.data.data_dir={data_dir}",
      *(f"--config.{o}" for o in CHAOS_OVERRIDES))
  moments = _chaos_moments(seed=21)
  last_save_kill = max(i for i, m in enumerate(moments)
                       if m.endswith("during_save"))
  for i, moment in enumerate(moments):
    killed = run(command, env=dict(subprocess_env, MHA_TEST_KILL_AT=moment))
    assert killed.returncode == -signal.SIGKILL, (moment, killed.stderr)
    _assert_quiet(killed.stderr)
    if i == last_save_kill:  # SIGTERM too, at the second step of a run.
      _sigterm_saves_the_step_and_says_how_to_resume(
          command, workdir, subprocess_env, before=moments[i + 1])
  result = run(command, env=subprocess_env)
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""
  assert not _tmp_dirs(workdir)
  rows = _rows(workdir)
  assert [r["step"] for r in rows if "loss" in r] == list(
      range(1, CHAOS_STEPS + 1))
  assert [r["step"] for r in rows if "validation/loss" in r] == [10, 20]
  _assert_one_row_per_step(workdir, starts=12)  # 10 kills, SIGTERM, the end
  _assert_params_equal(workdir, final, subprocess_trained=True)
