"""Tests for the corpus of mha/data.py (the character LM's corpus)."""

import os
import shutil

import numpy as np
import pytest

from mha import data



def test_files_and_splits(tiny_corpus):
  assert data.corpus_source_files(tiny_corpus) == [
      "mod0.py", "mod1.py", "pkg/sub0.py", "pkg/sub12.py"]
  # By the path's hash alone (pinned: a change would move files between
  # splits under every existing run).
  assert [data.corpus_split_of(p) for p in ("mod0.py", "mod1.py", "pkg/sub0.py",
                                       "pkg/sub12.py")] == [
      "test", "train", "train", "validation"]
  text = data.load_corpus(tiny_corpus)
  assert text.files == {"train": ("mod1.py", "pkg/sub0.py"),
                        "validation": ("pkg/sub12.py",), "test": ("mod0.py",)}
  with open(os.path.join(tiny_corpus, "mod1.py"), "rb") as f:
    assert text.streams["train"].startswith(f.read())
  assert sum(map(len, text.streams.values())) == sum(
      os.path.getsize(os.path.join(tiny_corpus, p))
      for p in data.corpus_source_files(tiny_corpus))
  assert text.python_version == data.python_version()
  assert "test 1 files" in text.describe()


def test_split_shares_of_many_paths():
  shares = np.array([sum(data.corpus_split_of(f"m{i}.py") == s for i in range(4000))
                     for s in data.CORPUS_SPLITS]) / 4000
  np.testing.assert_allclose(shares, [0.90, 0.05, 0.05], atol=0.015)


def test_corpus_hash(tiny_corpus, tmp_path):
  digest = data.corpus_hash(tiny_corpus)
  assert len(digest) == 64 and digest == data.load_corpus(tiny_corpus).hash
  # Names the contents, not the folder they are in.
  copy = str(tmp_path / "elsewhere")
  shutil.copytree(tiny_corpus, copy)
  assert data.corpus_hash(copy) == digest
  os.rename(os.path.join(copy, "mod0.py"), os.path.join(copy, "mod9.py"))
  assert data.corpus_hash(copy) != digest
  with open(os.path.join(tiny_corpus, "pkg", "sub0.py"), "a") as f:
    f.write(" ")
  assert data.corpus_hash(tiny_corpus) != digest
  # Files outside the corpus do not count.
  before = data.corpus_hash(tiny_corpus)
  with open(os.path.join(tiny_corpus, "test", "test_mod1.py"), "a") as f:
    f.write("more\n")
  assert data.corpus_hash(tiny_corpus) == before


def test_empty_corpus_and_nul_bytes(tmp_path):
  (tmp_path / "test").mkdir()
  (tmp_path / "test" / "only_a_test.py").write_text("x = 1\n")
  for read in (data.corpus_hash, data.load_corpus):
    with pytest.raises(ValueError, match="corpus is empty") as raised:
      read(str(tmp_path))
    assert "\n" not in str(raised.value)
  with pytest.raises(ValueError, match="not a folder"):
    data.load_corpus(str(tmp_path / "nowhere"))
  (tmp_path / "bad.py").write_bytes(b"x = 1\0\n")
  with pytest.raises(ValueError, match="NUL byte"):
    data.load_corpus(str(tmp_path))


def test_windows():
  got = data.corpus_windows(b"abcdefghij", 3)  # 10 bytes: 3 windows, tail "j"
  assert got.dtype == np.uint8
  assert [bytes(w) for w in got] == [b"abcd", b"defg", b"ghij"]
  assert [bytes(w) for w in data.corpus_windows(b"abcdefghi", 3)] == [
      b"abcd", b"defg"]
  assert data.corpus_windows(b"abc", 3).shape == (0, 4)
  with pytest.raises(ValueError):
    data.corpus_windows(b"abc", 0)


def test_stdlib_is_default():
  assert os.path.isfile(os.path.join(data.stdlib_dir(), "os.py"))
  assert "os.py" in data.corpus_source_files(data.stdlib_dir())


def test_a_corpus_changed_under_a_run_is_one_line(tiny_corpus, tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  data.check_corpus("pylm", workdir, tiny_corpus)  # No record yet: fine.
  data.write_corpus_record("pylm", workdir, tiny_corpus)
  data.check_corpus("pylm", workdir, tiny_corpus)  # The same corpus.
  data.write_corpus_record("reverse", str(tmp_path), tiny_corpus)
  assert not os.path.exists(tmp_path / data.CORPUS_RECORD)  # No corpus.
  with open(os.path.join(tiny_corpus, "mod1.py"), "ab") as f:
    f.write(b"# edited\n")
  with pytest.raises(data.CorpusChangedError) as e:
    data.check_corpus("pylm", workdir, tiny_corpus)
  message = str(e.value)
  assert "\n" not in message and message.startswith(
      f"the corpus changed under {workdir}: it was trained on corpus ")
