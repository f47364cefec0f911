"""Tests for mha/data.py (toy seq2seq tasks stored as a TFDS array_record dataset)."""

import collections
import logging
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from mha import data

TINY = dict(num_symbols=5, min_len=2, max_len=8, num_train_examples=200,
            num_eval_examples=50)
# The tasks on symbols 1..num_symbols, output as long as the input (spell,
# digits to words, has tests of its own: tests/test_spell.py).
SYMBOL_TASKS = ("reverse", "sort", "histogram")


def tiny(task: str = "reverse", **kw) -> data.DataSpec:
  return data.DataSpec(task=task, **{**TINY, **kw})


@pytest.fixture(scope="module")
def prepared(data_dir):
  """{task: splits} for tiny specs, prepared in the session's data_dir."""
  return {task: data.load_splits(tiny(task), data_dir)
          for task in SYMBOL_TASKS}


# ---------------------------------------------------------------- reference


def _reference_target(task, seq):
  """Naive per-position targets for one valid prefix (a python list)."""
  if task == "reverse":
    return seq[::-1]
  if task == "sort":
    return sorted(seq)
  if task == "histogram":
    counts = collections.Counter(seq)
    return [counts[s] for s in seq]
  raise ValueError(task)


def _prefix(row):
  n = int((row != 0).sum())
  assert np.all(row[:n] != 0), "valid tokens must be a prefix"
  return [int(v) for v in row[:n]]


# ---------------------------------------------------------------- contents


def test_vocab_size():
  assert data.vocab_size("reverse", 10, 16) == 11
  assert data.vocab_size("sort", 10, 16) == 11
  assert data.vocab_size("histogram", 10, 16) == 17
  assert data.vocab_size("histogram", 20, 16) == 21
  # pad, 10 digits, the blank, 15 letters; whatever num_symbols and max_len.
  assert data.vocab_size("spell", 5, 40) == 1 + 10 + 1 + 15
  with pytest.raises(ValueError):
    data.vocab_size("nope", 10, 16)


def test_bad_spec_rejected():
  with pytest.raises(ValueError):
    data.DataSpec(task="nope")
  with pytest.raises(ValueError):
    data.DataSpec(min_len=5, max_len=4)


@pytest.mark.parametrize("task", SYMBOL_TASKS)
def test_targets_correct_and_padding(prepared, task):
  spec = tiny(task)
  vocab = data.vocab_size(task, spec.num_symbols, spec.max_len)
  splits = prepared[task]
  assert set(splits) == {"train", "validation", "test"}
  assert len(splits["train"]) == spec.num_train_examples
  assert len(splits["validation"]) == spec.num_eval_examples
  assert len(splits["test"]) == spec.num_eval_examples
  for split in splits.values():
    x, y = split.inputs, split.targets
    assert x.dtype == np.int32 and y.dtype == np.int32
    assert x.shape == y.shape == (len(split), spec.max_len)
    lengths = (x != 0).sum(axis=1)
    np.testing.assert_array_equal(lengths, split.lengths)
    assert lengths.min() >= spec.min_len and lengths.max() <= spec.max_len
    assert x.max() <= spec.num_symbols and y.max() < vocab
    pad = np.arange(spec.max_len)[None, :] >= lengths[:, None]
    assert np.all(x[pad] == 0) and np.all(y[pad] == 0)
    assert np.all(x[~pad] >= 1) and np.all(y[~pad] >= 1)
    for xr, yr in zip(x, y):
      seq = _prefix(xr)
      assert [int(v) for v in yr[: len(seq)]] == _reference_target(task, seq)
  # Lengths actually span the range (uniform over [min_len, max_len]).
  assert set(splits["train"].lengths.tolist()) == set(
      range(spec.min_len, spec.max_len + 1))


def test_histogram_needs_counts():
  # Sanity: histogram targets are not a function of the symbol alone.
  x = np.array([[3, 1, 3, 3, 0]], np.int32)
  np.testing.assert_array_equal(
      data._compute_targets("histogram", x), [[3, 1, 3, 3, 0]])
  np.testing.assert_array_equal(
      data._compute_targets("reverse", x), [[3, 3, 1, 3, 0]])
  np.testing.assert_array_equal(
      data._compute_targets("sort", x), [[1, 3, 3, 3, 0]])


@pytest.mark.parametrize("task", SYMBOL_TASKS)
def test_splits_disjoint(prepared, task):
  splits = prepared[task]
  keys = {name: {tuple(_prefix(r)) for r in s.inputs}
          for name, s in splits.items()}
  assert not keys["validation"] & keys["train"]
  assert not keys["test"] & keys["train"]
  assert not keys["test"] & keys["validation"]


def test_too_small_sequence_space_raises():
  spec = data.DataSpec(num_symbols=1, min_len=1, max_len=1,
                       num_train_examples=5, num_eval_examples=2)
  with pytest.raises(ValueError, match="too small"):
    data._generate_arrays(spec)


# ---------------------------------------------------------------- on disk


def test_deterministic_across_data_dirs(tmp_path, capsys):
  spec = tiny("histogram", seed=7)
  a = data.load_splits(spec, str(tmp_path / "a"))
  assert "Preparing" in capsys.readouterr().out
  b = data.load_splits(spec, str(tmp_path / "b"))
  assert "Preparing" in capsys.readouterr().out
  again = data.load_splits(spec, str(tmp_path / "a"))  # reuses prepared data
  assert "Preparing" not in capsys.readouterr().out
  direct = data._generate_arrays(spec)  # on-disk order == generation order
  for name in ("train", "validation", "test"):
    for other in (b[name], again[name]):
      np.testing.assert_array_equal(a[name].inputs, other.inputs)
      np.testing.assert_array_equal(a[name].targets, other.targets)
    np.testing.assert_array_equal(a[name].inputs, direct[name]["inputs"])
    np.testing.assert_array_equal(a[name].targets, direct[name]["targets"])


def test_second_load_does_not_prepare(tmp_path, capsys):
  spec = tiny("sort")
  data.load_splits(spec, str(tmp_path))
  # One line says what happens (TFDS's "Downloading and preparing dataset
  # Unknown size ..." and "... will reuse this data." are left out).
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1 and lines[0].startswith("Preparing"), lines
  data.load_splits(spec, str(tmp_path))
  assert "Preparing" not in capsys.readouterr().out


def test_a_data_dir_through_a_file_is_one_clear_error(tmp_path):
  (tmp_path / "afile").write_text("x")
  with pytest.raises(data.DataDirError) as error:
    data.load_splits(tiny("sort"), str(tmp_path / "afile" / "tfds"))
  assert str(error.value) == (
      f"data_dir {tmp_path / 'afile' / 'tfds'} cannot be used: "
      f"{tmp_path / 'afile'} is a file, not a folder; set data.data_dir to "
      "a folder this process can write")
  assert isinstance(error.value, ValueError)  # train.py: one line, exit 2
  assert (tmp_path / "afile").read_text() == "x"


def test_custom_specs_load_without_tfds_warnings(tmp_path, caplog):
  """A spec other than a task's default is a custom TFDS config by design:
  preparing and loading it logs neither TFDS's custom-config warning nor,
  while it is prepared, the missing-dataset_info one; other warnings of the
  ``absl`` logger still get through."""
  with caplog.at_level(logging.WARNING):
    data.load_splits(tiny("sort", seed=3), str(tmp_path))  # prepares
    data.load_splits(tiny("sort", seed=3), str(tmp_path))  # reads
    with data._quiet_tfds():  # pylint: disable=protected-access
      logging.getLogger("absl").warning("another warning")
  messages = [r.getMessage() for r in caplog.records]
  assert messages == ["another warning"], messages


def test_preparing_leaves_no_temporary_folder(tmp_path, monkeypatch):
  """Preparing a spec writes under its data_dir and nowhere else: TFDS's own
  metadata lookup left an empty ``tmp*tfds`` folder in the temporary
  directory at every preparation (2,493 of them on one machine)."""
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  splits = data.load_splits(tiny("reverse", seed=7), str(tmp_path / "data"))
  assert splits["train"].inputs.shape[0] > 0
  assert list(scratch.iterdir()) == []


def test_config_names_and_no_collisions(tmp_path):
  # Defaults use the predefined config names.
  for task in SYMBOL_TASKS:
    b = data.make_builder(data.DataSpec(task=task), str(tmp_path))
    assert b.builder_config_name == task
    assert b.builder_config is data.ToySeq2Seq.builder_configs[task]
  specs = [tiny("reverse"), tiny("reverse", seed=1), tiny("reverse", max_len=6),
           tiny("sort"), data.DataSpec(task="reverse", seed=3)]
  builders = [data.make_builder(s, str(tmp_path)) for s in specs]
  names = [b.builder_config_name for b in builders]
  assert len(set(names)) == len(names)
  assert all(n.startswith(s.task + "_") for n, s in zip(names, specs))
  assert len({os.fspath(b.data_dir) for b in builders}) == len(builders)
  # Names are stable (not Python's hash()), and the same as before spell
  # added `max_digits` (which the other tasks do not hash): data prepared
  # before stays valid.
  assert names[0] == data.make_builder(tiny("reverse"), "/x").builder_config_name
  assert names[0] == "reverse_e24a104957"
  assert data.config_name(tiny("reverse", max_digits=7)) == names[0]
  assert data.config_name(data.DataSpec(task="sort", max_digits=2)) == "sort"
  # Two specs prepared side by side in one data_dir each read their own data.
  s0 = data.load_splits(specs[0], str(tmp_path))
  s1 = data.load_splits(specs[1], str(tmp_path))
  s2 = data.load_splits(specs[2], str(tmp_path))
  assert not np.array_equal(s0["train"].inputs, s1["train"].inputs)
  assert s2["train"].inputs.shape == (200, 6)
  np.testing.assert_array_equal(
      s1["train"].inputs, data._generate_arrays(specs[1])["train"]["inputs"])


def test_stored_feature_is_inputs_and_targets_as_bytes(prepared, data_dir):
  del prepared  # prepared in data_dir
  builder = data.make_builder(tiny("sort"), data_dir)
  assert builder.is_prepared()
  (name, feature), = builder.info.features.items()
  assert name == "tokens"  # [inputs, targets], raw int32 bytes
  assert feature.shape == (2, tiny().max_len) and feature.np_dtype == np.int32
  # A new version: data prepared by older code (a `length` feature in 1.0.0,
  # separate int64-encoded `inputs` and `targets` in 1.1.0) is in another
  # folder, never read as this version.
  assert str(builder.info.version) == "1.2.0"
  assert os.path.basename(os.fspath(builder.data_dir)) == "1.2.0"


def test_no_tensorflow_import(tmp_path):
  code = textwrap.dedent(f"""
      import sys
      import mha.data as d
      spec = d.DataSpec(task="histogram", num_train_examples=50,
                        num_eval_examples=10, max_len=6)
      s = d.load_splits(spec, {str(tmp_path)!r})   # prepare + read
      s = d.load_splits(spec, {str(tmp_path)!r})   # read only
      assert len(s["train"]) == 50
      assert "tensorflow" not in sys.modules, "tensorflow was imported"
      print("OK")
  """)
  root = os.path.dirname(os.path.dirname(os.path.abspath(data.__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  res = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "OK" in res.stdout


# ---------------------------------------------------------------- batching


def _split(n, max_len=4):
  rows = np.arange(1, n + 1, dtype=np.int32)[:, None].repeat(max_len, axis=1)
  return data.Split(inputs=rows, targets=rows + 100)


def test_train_batch_deterministic_and_shapes():
  split = _split(37)
  b1 = data.train_batch(split, seed=3, step=5, batch_size=8)
  data.train_batch(split, seed=3, step=6, batch_size=8)  # interleave
  b2 = data.train_batch(split, seed=3, step=5, batch_size=8)
  assert b1["inputs"].shape == b1["targets"].shape == (8, 4)
  assert b1["inputs"].dtype == np.int32
  np.testing.assert_array_equal(b1["inputs"], b2["inputs"])
  np.testing.assert_array_equal(b1["targets"], b1["inputs"] + 100)
  other = data.train_batch(split, seed=4, step=5, batch_size=8)
  assert not np.array_equal(b1["inputs"], other["inputs"])


@pytest.mark.parametrize("n,batch_size", [(40, 8), (37, 8), (5, 12)])
def test_train_batch_epochs(n, batch_size):
  split = _split(n)
  num_steps = 4 * n // batch_size + 2
  ids = np.concatenate([
      data.train_batch(split, seed=11, step=s, batch_size=batch_size)
      ["inputs"][:, 0] - 1 for s in range(num_steps)])
  # Concatenated stream == epoch permutations back to back.
  expected = np.concatenate([
      np.random.default_rng([11, e]).permutation(n)
      for e in range(len(ids) // n + 1)])[: len(ids)]
  np.testing.assert_array_equal(ids, expected)
  # Every example exactly once per epoch.
  for e in range(len(ids) // n):
    np.testing.assert_array_equal(np.sort(ids[e * n:(e + 1) * n]), np.arange(n))
  # Different epochs use different orders.
  assert not np.array_equal(ids[:n], ids[n:2 * n])


def test_train_batch_pure_in_step_order():
  split = _split(23)
  fwd = [data.train_batch(split, seed=0, step=s, batch_size=5)["inputs"]
         for s in range(12)]
  data._epoch_permutation.cache_clear()
  bwd = [data.train_batch(split, seed=0, step=s, batch_size=5)["inputs"]
         for s in reversed(range(12))][::-1]
  for a, b in zip(fwd, bwd):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n,batch_size", [(20, 5), (23, 5), (3, 8)])
def test_eval_batches(n, batch_size):
  split = _split(n)
  batches = list(data.eval_batches(split, batch_size))
  assert len(batches) == -(-n // batch_size)
  for b in batches:
    assert b["inputs"].shape == b["targets"].shape == (batch_size, 4)
    assert b["inputs"].dtype == np.int32
  x = np.concatenate([b["inputs"] for b in batches])
  y = np.concatenate([b["targets"] for b in batches])
  np.testing.assert_array_equal(x[:n], split.inputs)
  np.testing.assert_array_equal(y[:n], split.targets)
  assert np.all(x[n:] == 0) and np.all(y[n:] == 0)


def test_next_token_arrays_score_targets_after_the_prompt():
  tokens = np.array([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]], np.int32)
  arrays = data.next_token_arrays(tokens, scored_from=np.array([1, 3]))
  np.testing.assert_array_equal(arrays["inputs"], tokens[:, :-1])
  np.testing.assert_array_equal(arrays["targets"], tokens[:, 1:])
  # Row 0: every real target (the padding after 8 is not one); row 1: the
  # targets from position 3 of the tokens on.
  np.testing.assert_array_equal(arrays["weights"], [[1, 1, 1, 0], [0, 0, 1, 1]])
  assert arrays["weights"].dtype == np.float32


def test_batches_carry_weights_when_the_split_has_them():
  split = _split(3)
  weighted = data.Split(split.inputs, split.targets,
                        weights=np.full(split.inputs.shape, 0.5, np.float32))
  assert "weights" not in data.train_batch(split, seed=0, step=0, batch_size=2)
  batch = data.train_batch(weighted, seed=0, step=0, batch_size=2)
  assert batch["weights"].shape == (2, 4)
  last = list(data.eval_batches(weighted, 2))[-1]
  np.testing.assert_array_equal(last["weights"], [[0.5] * 4, [0.0] * 4])
  assert last["weights"].dtype == np.float32
