"""Start-up: the compilation cache, bulk data loading, compile counts
and lazy imports. No test asserts a time."""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from tensorflow_datasets.proto import tf_example_pb2

from conftest import ROOT, assert_same_bits, tiny_config
from mha.run import compilation_cache
from mha import data
from mha import train
from mha.run.compilation_cache import CompileCounts

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
  layout = data._record_layout(spec)
  np.testing.assert_array_equal(data._decode_tokens(records, *layout),
                                tokens)
  longer = tf_example_pb2.Example.FromString(records[0])
  longer.features.feature["extra"].int64_list.value.append(1)
  mixed = [longer.SerializeToString(), *records[1:]]
  np.testing.assert_array_equal(data._decode_tokens(mixed, *layout),
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


def test_cache_directory_default(monkeypatch):
  from configs import default  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  assert default.get_config().compilation_cache_dir == "~/.cache/mha/jax"
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/env/cache")
  assert default.get_config().compilation_cache_dir == "/env/cache"
  assert compilation_cache.resolve_dir("~/x") == os.path.expanduser("~/x")
  assert compilation_cache.resolve_dir("") == ""  # off


def test_second_run_loads_every_program_from_the_cache_bitwise_equal(
    tmp_path, data_dir, jax_cache_settings):
  del jax_cache_settings
  # One layer: its programs compile faster (measured: 5.4 -> 3.9 s of CPU
  # for both runs); the cache, not the model, is under test.
  config = tiny_config(data_dir, "num_train_steps=4", "eval_every_steps=2",
                       "checkpoint_every_steps=4", "model.num_layers=1")
  cache = str(tmp_path / "cache")
  assert compilation_cache.configure(cache) == cache
  counts = []
  finals = []
  for name in ("compiled", "cached"):
    jax.clear_caches()  # Only the persistent cache may save compiling.
    before = compilation_cache.counts()
    finals.append(train.train_and_evaluate(config, tmp_path / name))
    counts.append(compilation_cache.counts() - before)
  # A run compiles four programs (the initial state, the dropout key, the
  # train program and the evaluation step); the second run loads all four
  # from JAX's persistent compilation cache.
  assert counts == [CompileCounts(4, 0), CompileCounts(4, 4)]
  # On CPU, the run on loaded programs ends with bitwise the parameters and
  # optimizer state of the run on compiled ones.
  assert_same_bits(finals[0], finals[1])


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
