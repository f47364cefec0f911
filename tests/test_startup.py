"""Start-up: the compilation cache, bulk data loading, compile counts, lazy
imports and the end-to-end benchmark. No test asserts a time."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from tensorflow_datasets.proto import tf_example_pb2

from conftest import ROOT, assert_same_bits, tiny_config
from mha import compilation_cache
from mha import data
from mha import executables
from mha import train
from mha.compilation_cache import CompileCounts

# sha256 (first 16 hex digits) of every split's inputs and targets, as the
# per-example reading of builder version 1.1.0 returned them (measured before
# the bulk reading and the 1.2.0 format): the arrays must not change.
TINY = dict(num_symbols=5, min_len=2, max_len=8, num_train_examples=200,
            num_eval_examples=50)  # tests/test_data.py's specs
BEFORE = {
    data.DataSpec(task="reverse", **TINY): "fa792137fa38c933",
    data.DataSpec(task="sort", **TINY): "93c48a9cb431d040",
    data.DataSpec(task="histogram", **TINY): "7516bc617c63cd31",
    data.DataSpec(task="spell", max_digits=2, max_len=10,  # test_spell's
                  num_train_examples=60, num_eval_examples=15):
        "7bac422716a16712",
    data.DataSpec(max_len=8, num_train_examples=256,  # the tiny config's
                  num_eval_examples=64): "b61e332b6c95e8dc",
}
_CACHE_FLAGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
                "jax_persistent_cache_min_compile_time_secs",
                "jax_persistent_cache_min_entry_size_bytes")


def _digest(splits) -> str:
  digest = hashlib.sha256()
  for name in ("train", "validation", "test"):
    digest.update(splits[name].inputs.tobytes())
    digest.update(splits[name].targets.tobytes())
  return digest.hexdigest()[:16]


@pytest.mark.parametrize("spec", list(BEFORE), ids=lambda s: s.task)
def test_splits_are_the_arrays_read_before(data_dir, spec):
  splits = data.load_splits(spec, data_dir)
  assert _digest(splits) == BEFORE[spec]
  for split in splits.values():
    assert split.inputs.dtype == split.targets.dtype == np.int32
    assert not split.inputs.flags.writeable


def test_bulk_reading_equals_tfds_per_example_decoding(data_dir):
  spec = data.DataSpec(task="histogram", **TINY)
  split = data.load_splits(spec, data_dir)["validation"]
  builder = data.make_builder(spec, data_dir)
  source = builder.as_data_source()["validation"]
  tokens = np.stack([source[i]["tokens"] for i in range(len(source))])
  np.testing.assert_array_equal(tokens[:, 0], split.inputs)
  np.testing.assert_array_equal(tokens[:, 1], split.targets)
  # The proto-by-proto path, taken when the records' layouts differ, reads
  # the same tokens.
  raw = builder.as_data_source(
      deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)["validation"]
  records = raw.__getitems__(range(len(raw)))
  np.testing.assert_array_equal(data._decode_tokens(records, spec.max_len),
                                tokens)
  longer = tf_example_pb2.Example.FromString(records[0])
  longer.features.feature["extra"].int64_list.value.append(1)
  mixed = [longer.SerializeToString(), *records[1:]]
  np.testing.assert_array_equal(data._decode_tokens(mixed, spec.max_len),
                                tokens)


# ---------------------------------------------------------------- the cache


@pytest.fixture
def jax_cache_settings():
  """Puts JAX's compilation cache settings back after the test."""
  saved = {name: getattr(jax.config, name) for name in _CACHE_FLAGS}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)
  jax_cache.reset_cache()


def test_cache_directory_rule(monkeypatch):
  default_dir = "~/.cache/mha/jax"
  monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
  assert compilation_cache.resolve_dir(default_dir) == os.path.expanduser(
      default_dir)
  monkeypatch.setenv(compilation_cache.ENV_VAR, "/env/cache")
  assert compilation_cache.resolve_dir(default_dir) == "/env/cache"
  assert compilation_cache.resolve_dir("/mine") == "/mine"  # explicit wins
  assert compilation_cache.resolve_dir("") == ""  # off, whatever the env


def test_second_run_loads_every_program_and_ends_bitwise_equal(
    tmp_path, data_dir, jax_cache_settings, monkeypatch):
  del jax_cache_settings
  config = tiny_config(data_dir, "num_train_steps=4", "eval_every_steps=2",
                       "checkpoint_every_steps=4")
  monkeypatch.setitem(executables._enabled, "on", True)  # as train.py does
  cache = str(tmp_path / "cache")
  assert compilation_cache.configure(cache) == cache
  store = os.path.join(cache, executables.SUBDIRECTORY)
  counts = []
  stored = []
  finals = []
  for name in ("compiled", "whole", "cached"):
    if name == "cached":
      shutil.rmtree(store)  # The programs remain in the compilation cache.
    jax.clear_caches()  # Only the persistent cache may save compiling.
    before = compilation_cache.counts()
    finals.append(train.train_and_evaluate(config, tmp_path / name))
    counts.append(compilation_cache.counts() - before)
    stored.append(len(os.listdir(store)) if os.path.isdir(store) else 0)
  # A run compiles three programs: the initial state, the train step and the
  # evaluation step (for every split and batch), and stores the last two
  # whole and the initial state's outputs (its program calls back into
  # Python for its random numbers: mha.host_prng); the second loads all
  # three, tracing nothing. With the store emptied, the third loads the two
  # steps from the compilation cache (traced, not compiled) and stores
  # neither (an XLA:CPU executable loaded from that cache serializes
  # incomplete); the initial state, which that cache does not keep either,
  # is compiled again and its outputs stored.
  assert counts == [CompileCounts(3, 0), CompileCounts(0, 0, 3),
                    CompileCounts(3, 2)]
  assert stored == [3, 3, 1]
  # On CPU, the runs on loaded programs end with bitwise the parameters and
  # optimizer state of the runs on compiled ones.
  for final in finals[1:]:
    assert_same_bits(finals[0], final)


def test_executable_key_covers_what_makes_the_program(monkeypatch):
  args = (jax.ShapeDtypeStruct((2, 3), np.float32),)
  key = executables.key("p", args, {"config": "a"})
  assert key == executables.key("p", args, {"config": "a"})
  assert len({key, executables.key("q", args, {"config": "a"}),
              executables.key("p", args, {"config": "b"}),
              executables.key("p", (jax.ShapeDtypeStruct((2, 4), np.float32),),
                              {"config": "a"})}) == 4
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --x")
  assert executables.key("p", args, {"config": "a"}) != key
  monkeypatch.undo()
  monkeypatch.setattr(executables, "source_digest", lambda: "edited")
  assert executables.key("p", args, {"config": "a"}) != key


def test_damaged_store_entry_is_compiled_again_and_replaced(
    tmp_path, jax_cache_settings):
  del jax_cache_settings
  assert compilation_cache.configure("") == ""  # so compiled here, not loaded
  jitted = jax.jit(lambda x: x * 2 + 1)
  args = (jax.ShapeDtypeStruct((3,), np.float32),)
  folder = str(tmp_path / "store")
  entry = executables.key("f", args, {})
  os.makedirs(folder)
  with open(os.path.join(folder, entry + executables._SUFFIX), "wb") as f:
    f.write(b"not an executable")
  assert executables.load(folder, entry) is None
  x = np.arange(3, dtype=np.float32)
  compiled = executables.compile_or_load("f", jitted, args, parts={},
                                         folder=folder)
  np.testing.assert_array_equal(compiled(x), [1, 3, 5])
  before = compilation_cache.counts()
  np.testing.assert_array_equal(executables.load(folder, entry)(x), [1, 3, 5])
  assert compilation_cache.counts() - before == CompileCounts(0, 0, 1)
  with pytest.raises(TypeError):  # a loaded program checks its arguments
    executables.load(folder, entry)(np.arange(4, dtype=np.float32))


def jnp_ones():
  return jax.numpy.ones(2)


def test_outputs_of_a_program_run_once_are_kept_and_loaded_as_they_were(
    tmp_path, jax_cache_settings):
  # executables.run_or_load keeps a nullary program's outputs: arrays,
  # a weak-typed scalar and a PRNG key come back with their bits, types and
  # shardings, with nothing compiled; a damaged entry is run again and
  # replaced; outputs with a weak-typed array are not kept.
  del jax_cache_settings
  assert compilation_cache.configure("") == ""  # so compiled here, not loaded
  mesh = jax.make_mesh((1,), ("data",))
  put = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = ([put, put], put)

  def outputs():
    key = jax.random.key(3)
    return [jax.random.normal(key, (4, 2)), 0], jax.random.split(key)[1]

  jitted = jax.jit(outputs, out_shardings=shardings)
  folder = str(tmp_path / "store")
  first = executables.run_or_load("init", jitted, parts={"c": 1},
                                  out_shardings=shardings, folder=folder)
  # The outputs, not the program.
  (outputs_entry,) = os.listdir(folder)
  assert ".outputs." in outputs_entry
  before = compilation_cache.counts()
  second = executables.run_or_load("init", jitted, parts={"c": 1},
                                   out_shardings=shardings, folder=folder)
  assert compilation_cache.counts() - before == CompileCounts(0, 0, 1)
  (normal, step), key = second
  assert step.weak_type and step.dtype == first[0][1].dtype
  assert str(jax.random.key_impl(key)) == "threefry2x32"
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second),
                  strict=True):
    assert a.sharding == b.sharding
  np.testing.assert_array_equal(normal, first[0][0])
  np.testing.assert_array_equal(jax.random.key_data(key),
                                jax.random.key_data(first[1]))
  # Damaged: run again, replaced.
  path = os.path.join(folder, outputs_entry)
  with open(path, "wb") as f:
    f.write(b"damaged")
  third = executables.run_or_load("init", jitted, parts={"c": 1},
                                  out_shardings=shardings, folder=folder)
  np.testing.assert_array_equal(third[0][0], first[0][0])
  assert os.path.getsize(path) > len(b"damaged")
  # A weak-typed array cannot be put back weak: not kept.
  weak = jax.jit(lambda: jax.lax.broadcast(1.0, (3,)), out_shardings=put)
  weak_folder = str(tmp_path / "weak")
  assert executables.run_or_load("weak", weak, parts={}, out_shardings=put,
                                 folder=weak_folder).weak_type
  assert not os.path.exists(weak_folder)
  # Nor are a key of a custom implementation (its name is not found again)
  # or outputs without a sharding each (None for one, or a prefix).
  from mha import host_prng
  for name, fn, out in (
      ("custom", lambda: jax.random.key(0, impl=host_prng.impl()), put),
      ("none", lambda: (jnp_ones(), jnp_ones()), (put, None)),
      ("prefix", lambda: (jnp_ones(), jnp_ones()), put)):
    other = str(tmp_path / name)
    executables.run_or_load(name, jax.jit(fn, out_shardings=out), parts={},
                            out_shardings=out, folder=other)
    assert not os.path.exists(other), name


def test_unusable_cache_directory_is_one_warning_and_compiling_goes_on(
    tmp_path, capsys, jax_cache_settings):
  del jax_cache_settings
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert compilation_cache.configure(str(blocker / "cache"), "train.py") == ""
  (line,) = capsys.readouterr().err.splitlines()
  assert line.startswith(f"train.py: warning: compilation cache {blocker}")
  assert line.endswith("compiling without it")
  assert not jax.config.jax_enable_compilation_cache
  jax.clear_caches()
  assert int(jax.jit(lambda x: 2 * x)(21)) == 42  # compiled, not cached


def test_first_step_row_says_when_and_what_was_compiled(tiny_run):
  with open(os.path.join(tiny_run.workdir, "metrics.jsonl"),
            encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  (row,) = [r for r in rows if "startup/seconds_since_process_start" in r]
  assert row["step"] == 1
  assert 0 < row["startup/seconds_since_call"] <= row[
      "startup/seconds_since_process_start"]
  assert 0 <= row["startup/programs_from_cache"] <= row[
      "startup/programs_compiled"] <= 3  # the initial state, the train step
  # (and the evaluation step, when its background compilation was quicker)


# ---------------------------------------------------------------- imports


def _imported(args, env) -> set[str]:
  """Every module a Python process imports (``-X importtime``)."""
  # (absl's --help exits with 1, a mistake with 2.)
  result = subprocess.run([sys.executable, "-X", "importtime", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True)
  assert result.returncode in (0, 1, 2), result.stderr[-2000:]
  return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
          if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("args, needs_jax", [
    (["-c", "import mha, mha.train"], True),
    (["train.py", "--help"], False),
    (["train.py", "--workdir=w", "--config.nope=1"], False),
    (["eval.py", "--workdir=/nowhere"], False),
], ids=["import mha", "train.py --help", "train.py bad key",
        "eval.py no workdir"])
def test_no_heavy_imports(args, needs_jax, subprocess_env):
  modules = {m.split(".")[0] for m in _imported(args, subprocess_env)}
  assert "absl" in modules  # The listing works.
  heavy = {"matplotlib", "tensorboardX", "scipy", "torch"}
  # Help and a mistake answer before JAX, Flax, orbax or TFDS are imported.
  if not needs_jax:
    heavy |= {"jax", "flax", "orbax", "tensorflow_datasets"}
  else:
    assert "jax" in modules
  assert not heavy & modules


# ---------------------------------------------------------------- benchmark


def test_end_to_end_benchmark_quick(tmp_path, data_dir, subprocess_env):
  out = tmp_path / "e2e.json"
  result = subprocess.run(
      [sys.executable, os.path.join("scripts", "benchmark.py"),
       "--end_to_end", "--quick", "--nopeer", f"--out={out}",
       f"--data_dir={data_dir}"],
      cwd=ROOT, env=subprocess_env, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr
  results = json.loads(out.read_text())["end_to_end"]
  runs = results["runs"]
  (cold,), (warm,) = runs["cold"], runs["warm"]
  # The warm run compiled nothing: every program was loaded whole (neither
  # traced nor compiled) from the executable store the cold run wrote.
  assert cold["run"] == {"programs": 3, "from_cache": 0, "whole": 0}
  assert warm["run"] == {"programs": 0, "from_cache": 0, "whole": 3}
  for run in (cold, warm, *runs.get("peer", [])):
    assert 0 < run["first_step_s"] < run["exit_s"]
    assert run["step_ms"] > 0  # the progress windows' ms a step
  assert ("| train.py, warm (same config again) |" in result.stdout)
  assert "Quick run (the tiny config, one round): a smoke test" in (
      result.stdout)
  assert results["summary"]["ratios"]["warm_first_step_over_floor"] > 0
  assert "peer" not in runs


def test_run_only_keys_leave_the_train_and_eval_programs_unchanged(data_dir):
  """The executable store's key of the train and evaluation steps leaves out
  ``train.RUN_ONLY_KEYS``: changing them all must not change the programs
  (a key that does, learning_rate say, fails this)."""
  from mha import build
  from mha import sharding as sharding_lib
  texts = []
  for overrides in ([], ["seed=7", "log_every_steps=3", "eval_every_steps=5",
                         "checkpoint_every_steps=9",
                         "max_checkpoints_to_keep=1",
                         "compilation_cache_dir=/elsewhere",
                         "init_from=/some/run",
                         f"data.data_dir={data_dir}/other"]):
    if overrides:  # every run-only key is changed
      assert {o.split("=")[0] for o in overrides} == set(train.RUN_ONLY_KEYS)
    config = tiny_config(data_dir, *overrides)
    model = build.make_model(config)
    mesh = sharding_lib.make_mesh()
    _, abstract_state = train._fresh_state(config, model)
    shardings = sharding_lib.state_shardings(
        abstract_state, mesh, shard_params=config.mesh.shard_params)
    texts.append([
        jitted.lower(*args).as_text() for jitted, args in (
            train.train_step_program(config, model, mesh, shardings,
                                     abstract_state),
            train.eval_step_program(config, model, mesh, shardings,
                                    abstract_state))])
  assert texts[0] == texts[1]
