"""Tests of the causal tasks of mha/data.py (mqar, passkey, pylm), of their
batches, and of accuracy by distance (mha/evaluate.py); the seq2seq tasks'
data and batches pinned bitwise as they were before the causal tasks."""

import hashlib
import math
import os

import numpy as np
import pytest

from mha import data
from mha import evaluate

TINY_MQAR = dict(num_symbols=6, context_length=24, num_pairs=4,
                 num_train_examples=64, num_eval_examples=16)
TINY_PASSKEY = dict(num_symbols=4, context_length=20, num_train_examples=400,
                    num_eval_examples=16)


def _generated_split(spec, name="train"):
  return data.causal_split(data._generate_causal(spec)[name], spec.task)


# ------------------------------------------------- seq2seq tasks unchanged


def _seq2seq_digest(spec):
  """Digest of a spec's generated splits and of their train and eval
  batches (keys included)."""
  arrays = data._generate_arrays(spec)
  digest = hashlib.sha256()
  for name in ("train", "validation", "test"):
    split = data.Split(inputs=arrays[name]["inputs"],
                       targets=arrays[name]["targets"])
    batches = [data.train_batch(split, seed=1, step=step, batch_size=64)
               for step in (0, 7)] + list(data.eval_batches(split, 48))
    for batch in batches:
      for key in sorted(batch):
        digest.update(key.encode())
        digest.update(batch[key].tobytes())
  return digest.hexdigest()[:16]


@pytest.mark.parametrize("task,expected", [
    ("reverse", "98a6c30e3a3c41d9"), ("sort", "26d163d71d8fc47c"),
    ("histogram", "af0fe2ec79e9ac7b"), ("spell", "f6ad9a67808a6074")])
def test_seq2seq_data_and_batches_bitwise_as_before(task, expected):
  # The digests of the code before the causal tasks (commit cd8ab62).
  kw = (dict(max_len=20) if task == "spell" else
        dict(num_symbols=5, min_len=2, max_len=8))
  spec = data.DataSpec(task=task, num_train_examples=200,
                       num_eval_examples=50, **kw)
  assert _seq2seq_digest(spec) == expected
  # The causal fields name no seq2seq data: same name, same data on disk.
  other = data.DataSpec(task=task, num_train_examples=200,
                        num_eval_examples=50, context_length=7, num_pairs=1,
                        corpus_dir="/nowhere", **kw)
  assert data.config_name(other) == data.config_name(spec)


# ---------------------------------------------------------------- mqar


def test_mqar_examples():
  spec = data.DataSpec(task="mqar", **TINY_MQAR)
  split = _generated_split(spec)
  symbols, pairs, length = 6, 4, 24
  assert split.inputs.shape == split.targets.shape == (64, length)
  assert split.weights.dtype == np.float32 and split.distances.dtype == np.int32
  np.testing.assert_array_equal(split.inputs[:, 1:], split.targets[:, :-1])
  assert split.inputs.min() >= 1
  assert split.inputs.max() < data.vocab_size("mqar", symbols, 0) == 19
  for x, y, w, d in zip(split.inputs, split.targets, split.weights,
                        split.distances):
    keys, values = x[0:2 * pairs:2], x[1:2 * pairs:2]
    assert len(set(keys)) == pairs and np.all((keys >= 1) & (keys <= 6))
    assert len(set(values)) == pairs and np.all((values > 6) & (values <= 12))
    asked = np.flatnonzero(w)
    assert len(asked) == pairs and np.all(asked >= 2 * pairs)
    np.testing.assert_array_equal(np.sort(x[asked]), np.sort(keys))
    for t in asked:  # The value of the key at t, planted d tokens back.
      pair = int(np.flatnonzero(keys == x[t])[0])
      assert y[t] == values[pair]
      assert d[t] == (t + 1) - (2 * pair + 1)
    assert np.all(d[w == 0] == 0)
    rest = np.ones(length + 1, bool)  # Of the sequence: inputs + 1.
    rest[: 2 * pairs] = False
    rest[asked] = rest[asked + 1] = False
    x = np.append(x, y[-1])
    assert np.all(x[rest] > 12)  # Filler elsewhere (own tokens).


def test_mqar_and_passkey_deterministic_and_split_apart():
  for task, kw in (("mqar", TINY_MQAR), ("passkey", TINY_PASSKEY)):
    spec = data.DataSpec(task=task, **kw)
    a, b = data._generate_causal(spec), data._generate_causal(spec)
    for name in ("train", "validation", "test"):
      np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["validation"], a["test"])
    other = data._generate_causal(data.DataSpec(task=task, seed=1, **kw))
    assert not np.array_equal(a["test"], other["test"])


# ---------------------------------------------------------------- passkey


def test_passkey_examples():
  spec = data.DataSpec(task="passkey", **TINY_PASSKEY)
  split = _generated_split(spec)
  digits, length = data.PASSKEY_DIGITS, 20
  np.testing.assert_array_equal(split.inputs[:, 1:], split.targets[:, :-1])
  answer = np.arange(length - digits, length)  # Target positions of the key.
  assert np.all(split.weights[:, answer] == 1)
  assert split.weights.sum() == len(split) * digits
  assert np.all(split.inputs[:, length - digits] == data.PASSKEY_ASK)
  distance = split.distances.max(axis=1)
  assert np.all(split.distances[:, answer] == distance[:, None])
  for x, y, d in zip(split.inputs, split.targets, distance):
    mark = int(np.flatnonzero(x == data.PASSKEY_MARK)[0])
    key = x[mark + 1: mark + 1 + digits]
    np.testing.assert_array_equal(y[answer], key)
    assert np.all((key >= 3) & (key <= 12))
    # The digit recalled at target t (sequence position t + 1) was planted
    # d tokens before it.
    assert (length - digits + 1) - (mark + 1) == d
  # Distances spread over their whole range, up to the context length.
  assert set(distance.tolist()) == set(range(digits + 1, length - digits + 1))


@pytest.mark.parametrize("task,fields,phrase", [
    ("mqar", dict(context_length=14, num_pairs=4), "cannot hold"),
    ("mqar", dict(num_symbols=3, num_pairs=4), "distinct keys"),
    ("mqar", dict(num_pairs=0), "num_pairs=0 must be >= 1"),
    ("passkey", dict(context_length=10), "planted key"),
    ("pylm", dict(context_length=0), "context_length=0 must be >= 1"),
])
def test_causal_spec_problems(task, fields, phrase):
  with pytest.raises(ValueError, match=phrase) as raised:
    data.DataSpec(task=task, **fields)
  assert "\n" not in str(raised.value)
  data.DataSpec(task="mqar", context_length=15, num_pairs=4)  # The least.
  data.DataSpec(task="passkey", context_length=11)


def test_causal_vocab_length_and_bits():
  assert data.vocab_size("mqar", 10, 16) == 31
  assert data.vocab_size("passkey", 10, 16) == 23
  assert data.vocab_size("pylm", 10, 16) == 256
  assert data.DataSpec(task="mqar").length == 128
  assert data.DataSpec(task="reverse").length == 16
  assert len(data.token_names("mqar", 10)) == 31
  assert len(data.token_names("passkey", 10)) == 23
  names = data.token_names("pylm")
  assert len(names) == 256 and names[ord("a")] == "a" and names[10] == "\\n"
  assert data.bits_per_char(math.log(2)) == pytest.approx(1.0)
  np.testing.assert_allclose(data.bits_per_char(np.array([0.0, 2 * math.log(2)])),
                             [0.0, 2.0])
  assert set(data.RECALL_TASKS) < set(data.CAUSAL_TASKS)
  assert not set(data.CAUSAL_TASKS) & set(data.TASKS)


def test_causal_batches_carry_weights():
  split = _generated_split(data.DataSpec(task="mqar", **TINY_MQAR))
  batch = data.train_batch(split, seed=0, step=3, batch_size=8)
  assert sorted(batch) == ["inputs", "targets", "weights"]
  assert batch["weights"].shape == (8, 24)
  assert batch["weights"].dtype == np.float32
  assert batch["weights"].sum() == 8 * 4
  batches = list(data.eval_batches(split, 48))  # 64 rows: 48 + 16 padded.
  assert [b["weights"].shape for b in batches] == [(48, 24)] * 2
  np.testing.assert_array_equal(
      np.concatenate([b["weights"] for b in batches])[:64], split.weights)
  assert np.all(batches[1]["weights"][16:] == 0)


def test_recall_tasks_on_disk(data_dir):
  for task, kw in (("mqar", TINY_MQAR), ("passkey", TINY_PASSKEY)):
    spec = data.DataSpec(task=task, **{**kw, "num_train_examples": 32})
    splits = data.load_splits(spec, data_dir)
    direct = data._generate_causal(spec)
    for name, split in splits.items():
      expected = data.causal_split(direct[name], task)
      for field in ("inputs", "targets", "weights", "distances"):
        np.testing.assert_array_equal(getattr(split, field),
                                      getattr(expected, field))
    assert splits["train"].task == task
  # Defaults have predefined names; fields a task ignores do not name it.
  assert data.config_name(data.DataSpec(task="mqar")) == "mqar"
  assert data.config_name(data.DataSpec(task="passkey", num_pairs=3,
                                        max_len=5, min_len=2)) == "passkey"
  assert data.config_name(data.DataSpec(task="mqar", num_pairs=3)) != "mqar"
  builder = data.make_builder(data.DataSpec(task="mqar", **TINY_MQAR),
                              data_dir)
  assert builder.info.features["tokens"].shape == (3, 25)


# ---------------------------------------------------------------- pylm


def test_pylm_on_disk(tiny_corpus, data_dir):
  spec = data.DataSpec(task="pylm", context_length=16, corpus_dir=tiny_corpus)
  splits = data.load_splits(spec, data_dir)
  text = data.load_corpus(tiny_corpus)
  for name, split in splits.items():
    windows = data.corpus_windows(text.streams[name], 16)
    assert len(split) == len(windows) > 0
    np.testing.assert_array_equal(split.inputs, windows[:, :-1])
    np.testing.assert_array_equal(split.targets, windows[:, 1:])
    assert split.weights.shape == (len(split), 16)
    assert np.all(split.weights == 1) and split.distances is None
  builder = data.make_builder(spec, data_dir)
  assert builder.builder_config_name.startswith("pylm_")
  metadata = builder.info.metadata
  assert metadata["corpus_hash"] == data.corpus_hash(tiny_corpus)
  assert metadata["python_version"] == data.python_version()
  assert metadata["num_files"] == {s: len(text.files[s])
                                   for s in data.CORPUS_SPLITS}
  assert metadata["corpus_hash"] in builder.info.description
  assert builder.info.features["tokens"].np_dtype == np.uint8
  # The seed and example counts name nothing: one dataset.
  assert data.config_name(data.DataSpec(
      task="pylm", context_length=16, corpus_dir=tiny_corpus, seed=3,
      num_train_examples=5)) == builder.builder_config_name


def test_pylm_changed_corpus_is_new_data(tiny_corpus, tmp_path):
  spec = data.DataSpec(task="pylm", context_length=16, corpus_dir=tiny_corpus)
  before = data.config_name(spec)
  path = os.path.join(tiny_corpus, sorted(data.corpus_source_files(tiny_corpus))[0])
  with open(path, "ab") as f:
    f.write(b"# one more line\n")
  assert data.config_name(spec) != before


def test_pylm_split_too_short(tmp_path):
  (tmp_path / "a.py").write_text("x = 1\n")
  spec = data.DataSpec(task="pylm", context_length=16,
                       corpus_dir=str(tmp_path))
  with pytest.raises(ValueError, match="shorter than one window") as raised:
    data._generate_causal(spec)
  assert "\n" not in str(raised.value)


# ------------------------------------------------------ accuracy by distance


def test_accuracy_by_distance():
  distances = np.array([[0, 1, 0, 3], [2, 0, 9, 200]])
  correct = np.array([[0, 1, 1, 1], [1, 1, 0, 0]], bool)
  got = evaluate.accuracy_by_distance(correct, distances)
  np.testing.assert_array_equal(got.lower, [1, 2, 4, 8, 16, 32, 64, 128])
  np.testing.assert_array_equal(got.upper, [1, 3, 7, 15, 31, 63, 127, 200])
  np.testing.assert_array_equal(got.count, [1, 2, 0, 1, 0, 0, 0, 1])
  np.testing.assert_array_equal(got.accuracy,
                                [1, 1, np.nan, 0, np.nan, np.nan, np.nan, 0])
  got = evaluate.accuracy_by_distance(correct, distances, edges=[2, 8])
  np.testing.assert_array_equal(got.count, [2, 2])  # distance 1 is below 2.
  np.testing.assert_array_equal(got.accuracy, [1.0, 0.0])
  # Per example (passkey): a model that recalls only near keys.
  split = _generated_split(data.DataSpec(task="passkey", **TINY_PASSKEY))
  distance = split.distances.max(axis=1)
  got = evaluate.accuracy_by_distance(distance <= 8, distance, edges=[6, 9])
  np.testing.assert_array_equal(got.accuracy, [1.0, 0.0])
  assert got.count.sum() == len(split)
  with pytest.raises(ValueError, match="shape"):
    evaluate.accuracy_by_distance(correct[0], distances)
  with pytest.raises(ValueError, match="increase"):
    evaluate.accuracy_by_distance(correct, distances, edges=[4, 2])


def test_accuracy_by_earlier_occurrences_separates_ambiguous_recalls():
  # A passkey-like row: marker 1, key 5 7 5, query 2, recall 5 7 5. At the
  # recall's answers the model reads 2 (0 earlier), 5 (twice earlier: the
  # key repeats it) and 7 (once earlier).
  inputs = np.array([[9, 1, 5, 7, 5, 9, 2, 5, 7]])
  answers = np.zeros_like(inputs, bool)
  answers[0, 6:] = True
  correct = np.array([[0, 0, 0, 0, 0, 0, 1, 0, 1]], bool)
  got = evaluate.accuracy_by_earlier_occurrences(correct, inputs, answers)
  assert got == {"0": {"accuracy": 1.0, "answers": 1},
                 "1": {"accuracy": 1.0, "answers": 1},
                 "2+": {"accuracy": 0.0, "answers": 1}}
  got = evaluate.accuracy_by_earlier_occurrences(correct, inputs,
                                                 np.zeros_like(answers))
  assert got["1"] == {"accuracy": None, "answers": 0}
  with pytest.raises(ValueError, match="shape"):
    evaluate.accuracy_by_earlier_occurrences(correct[0], inputs, answers)
