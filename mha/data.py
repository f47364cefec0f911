"""Toy per-position sequence-to-sequence tasks, stored as a real TFDS dataset.

Every task maps an input sequence ``x`` of length ``n`` (uniform in
``[min_len, max_len]``, symbols ``1..num_symbols``, ``0`` = padding) to a target
sequence of the same length, one target token per input position:

* ``reverse``:   ``target[i] = x[n - 1 - i]``
* ``sort``:      ``target = sorted(x[:n])``
* ``histogram``: ``target[i] = #{j < n : x[j] == x[i]}`` (a count in ``1..max_len``)

Inputs and targets are padded with ``0`` up to ``max_len``.

``spell`` writes digits as English words, so its output is longer than the
digits: the input is ``1..max_digits`` digits (``0-9``, uniform in number)
followed by blanks up to the length of the spelling, then padding; the target
at each non-padding position is the letter at that position of the digits'
words written one after the other (``3 1 _ _ _ _ _ _`` -> ``t h r e e o n e``).
Digits, the blank and the letters have token ids of their own (``0`` stays
padding); ``num_symbols`` and ``min_len`` play no part in it, and ``max_len``
must hold the longest spelling (``MAX_WORD_LEN * max_digits``).

The data is generated deterministically from ``DataSpec.seed`` with numpy,
written to disk by ``tfds`` in the ``array_record`` format and read back with
``builder.as_data_source()`` (random access, no TensorFlow needed or imported).
Each example is one feature, ``tokens`` ``[2, max_len]`` (inputs, targets) as
raw int32 bytes, so a split is read as raw records and decoded at once (the
default 22,000 examples in well under a second).

Causal tasks (:data:`CAUSAL_TASKS`), for a decoder's next-token loss: an
example is a sequence of ``context_length + 1`` tokens, whose first
``context_length`` are the ``inputs`` and last ``context_length`` the
``targets`` (the next token at each position), with a per-position loss
``weights`` (1 where the loss counts) and, for the recall tasks
(:data:`RECALL_TASKS`), per-position ``distances``: how many tokens back the
answer at that position was planted (0 where nothing is recalled).

* ``mqar`` (multi-query associative recall, Arora et al. 2023, "Zoology"):
  ``num_pairs`` key-value pairs (distinct keys ``k1..kS``, distinct values
  ``v1..vS``, ``S = num_symbols``) open the sequence; the rest is filler
  (``S`` tokens of its own) cut into two-token slots, of which ``num_pairs``
  at random hold a query, ``key value``, each pair asked once in a random
  order. Weights: 1 on the values of the queries only. (Zoology draws the
  query slots from a power law favouring early slots and its filler from the
  whole vocabulary; here both are uniform, and the filler its own.)
* ``passkey``: a key marker and ``PASSKEY_DIGITS`` digits planted in random
  filler, a query marker and the digits again at the end; weights on those
  last digits. The distance, drawn uniformly per example in
  ``[PASSKEY_DIGITS + 1, context_length - PASSKEY_DIGITS]``, is how far each
  digit lies before its recall.
* ``pylm``: bytes (tokens ``0..255``; 0 never occurs in Python source) of
  the Python standard library's own ``.py`` files (:func:`load_corpus`), split
  into train, validation and test by a hash of each file's path, each split's
  stream cut into windows (:func:`corpus_windows`); weights all 1. It
  depends on the corpus and ``context_length`` only (not on the seed or the
  example counts); the corpus hash is part of its config name, and it and
  the Python version are in the dataset's metadata and description.

Their tokens are stored as one feature, ``tokens`` ``[3, context_length + 1]``
int32 (the sequence, its weights and distances, both aligned with the
sequence's token they score) or, for ``pylm``, ``[1, context_length + 1]``
uint8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import platform
import sysconfig
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.proto import tf_example_pb2

from mha.run import absl_logs
from mha.run import write_failures

TASKS: tuple[str, ...] = ("reverse", "sort", "histogram", "spell")
# The next-token (language-model style) tasks: their targets at position i
# are the token at i + 1, so only a causal model (``model.causal``) may train
# on them, and a causal model only on them (today's seq2seq tasks need the
# whole input: reverse's first output is the last input).
#: The tasks for a causal decoder (next-token targets and loss weights).
CAUSAL_TASKS: tuple[str, ...] = ("mqar", "passkey", "pylm")
#: The causal tasks that recall a planted token: they have ``distances``.
RECALL_TASKS: tuple[str, ...] = ("mqar", "passkey")
#: The causal tasks on text, whose loss is also given in bits per character.
LANGUAGE_MODEL_TASKS: tuple[str, ...] = ("pylm",)
_ALL_TASKS = TASKS + CAUSAL_TASKS

# Bump when the generation code changes so that stale prepared data on disk is
# never silently reused (the version is part of the on-disk path).
_VERSION = "1.2.0"
_SPLITS: tuple[str, ...] = ("train", "validation", "test")


# --------------------------------------------------------------------------
# The spell task's tokens
# --------------------------------------------------------------------------

DIGIT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five",
                                "six", "seven", "eight", "nine")
MAX_WORD_LEN = max(map(len, DIGIT_WORDS))  # "three", "seven", "eight": 5.
LETTERS = "".join(sorted(set("".join(DIGIT_WORDS))))  # the 15 letters used.
_DIGIT_0 = 1  # Token of the digit 0; digit d is token 1 + d.
BLANK = _DIGIT_0 + len(DIGIT_WORDS)  # Token 11: a position still to spell.
_LETTER_0 = BLANK + 1  # Token of LETTERS[0]; LETTERS[i] is token 12 + i.


def spell(digits: Iterable[int]) -> str:
  """The digits' English words written one after the other: [3, 1] ->
  "threeone"."""
  return "".join(DIGIT_WORDS[int(d)] for d in digits)


def spell_tokens(digits: Sequence[int]) -> tuple[list[int], list[int]]:
  """The ``spell`` task's (inputs, targets) for ``digits``, unpadded:
  [3, 1] -> ([4, 2, 11, 11, 11, 11, 11, 11], tokens of "threeone")."""
  letters = spell(digits)
  inputs = [_DIGIT_0 + int(d) for d in digits]
  inputs += [BLANK] * (len(letters) - len(inputs))
  return inputs, [_LETTER_0 + LETTERS.index(c) for c in letters]


# --------------------------------------------------------------------------
# The causal tasks' tokens
# --------------------------------------------------------------------------

PASSKEY_DIGITS = 5  # Digits of a passkey.
PASSKEY_MARK = 1  # passkey: the token before the planted key.
PASSKEY_ASK = 2  # passkey: the token before the key's recall.
_PASSKEY_DIGIT_0 = 3  # passkey: digit d is token 3 + d; filler follows them.
_PASSKEY_FILLER_0 = _PASSKEY_DIGIT_0 + 10
PYLM_VOCAB = 256  # pylm: one token a byte.


def _byte_name(byte: int) -> str:
  """A byte as the explorer shows it: printable ASCII as itself."""
  escapes = {9: "\\t", 10: "\\n", 13: "\\r", 32: "\u2423"}
  if byte in escapes:
    return escapes[byte]
  return chr(byte) if 32 < byte < 127 else f"\\x{byte:02x}"


def token_names(task: str, num_symbols: int = 10) -> tuple[str, ...] | None:
  """What each token id of ``task`` reads as, indexed by id (``0``: ``""``,
  padding), where it is not the number itself: spell's digits, blank (``_``)
  and letters; mqar's keys ``k1..``, values ``v1..`` and filler ``f1..``;
  passkey's markers ``KEY`` and ``ASK``, digits and filler ``f1..``; pylm's
  bytes (printable ASCII as itself, a space as ``\u2423``, others escaped).
  ``num_symbols`` (``DataSpec.num_symbols``) sizes mqar's and passkey's.
  None for the other tasks (their tokens are numbers)."""
  symbols = range(1, num_symbols + 1)
  if task == "spell":
    return ("", *map(str, range(len(DIGIT_WORDS))), "_", *LETTERS)
  if task == "mqar":
    return ("", *(f"{kind}{i}" for kind in "kvf" for i in symbols))
  if task == "passkey":
    return ("", "KEY", "ASK", *map(str, range(10)),
            *(f"f{i}" for i in symbols))
  if task == "pylm":
    return ("", *map(_byte_name, range(1, PYLM_VOCAB)))
  return None


# --------------------------------------------------------------------------
# Spec and vocabulary
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """Everything that determines the dataset contents."""

  task: str = "reverse"
  num_symbols: int = 10
  min_len: int = 1
  max_len: int = 16
  num_train_examples: int = 20000
  num_eval_examples: int = 1000  # size of EACH of validation and test
  seed: int = 0  # data-generation seed
  max_digits: int = 4  # spell only: inputs of 1..max_digits digits.
  # Causal tasks only: the tokens of an example's inputs (and targets).
  context_length: int = 128
  num_pairs: int = 8  # mqar only: key-value pairs (and queries) an example.
  # pylm only: the corpus folder; "" = the interpreter's standard library.
  corpus_dir: str = ""

  def __post_init__(self) -> None:
    if self.task not in _ALL_TASKS:
      raise ValueError(
          f"Unknown task {self.task!r}; expected one of {_ALL_TASKS}.")
    problems = causal_problems(self.task, context_length=self.context_length,
                               num_pairs=self.num_pairs,
                               num_symbols=self.num_symbols)
    if problems:
      raise ValueError(f"{problems[0]}.")
    if self.num_symbols < 1:
      raise ValueError(f"num_symbols must be >= 1, got {self.num_symbols}.")
    if not 1 <= self.min_len <= self.max_len:
      raise ValueError(
          f"Need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}."
      )
    if self.num_train_examples < 1 or self.num_eval_examples < 1:
      raise ValueError("num_train_examples and num_eval_examples must be >= 1.")
    if self.seed < 0:
      raise ValueError(f"seed must be >= 0 (numpy seeding), got {self.seed}.")
    if self.max_digits < 1:
      raise ValueError(f"max_digits must be >= 1, got {self.max_digits}.")
    if self.task == "spell" and self.max_len < self.longest_spelling:
      raise ValueError(
          f"max_len={self.max_len} cannot hold the longest spelling of "
          f"max_digits={self.max_digits} digits ({self.longest_spelling} "
          "letters).")

  @property
  def longest_spelling(self) -> int:
    """Letters in the longest ``spell`` target (of ``max_digits`` digits)."""
    return MAX_WORD_LEN * self.max_digits

  @property
  def length(self) -> int:
    """Positions of an example (the model's): ``example_length``."""
    return example_length(self.task, self.max_len, self.context_length)


def causal_problems(task: str, *, context_length: int, num_pairs: int,
                    num_symbols: int) -> list[str]:
  """What keeps a causal task's fields from making examples, one phrase
  each (empty for the other tasks, which ignore these fields)."""
  if task not in CAUSAL_TASKS:
    return []
  problems = []
  if context_length < 1:
    problems.append(f"data.context_length={context_length} must be >= 1")
  if task == "mqar":
    if num_pairs < 1:
      problems.append(f"data.num_pairs={num_pairs} must be >= 1")
    elif num_symbols < num_pairs:
      problems.append(
          f"mqar: data.num_symbols={num_symbols} keys cannot make "
          f"data.num_pairs={num_pairs} pairs of distinct keys")
    elif context_length < 4 * num_pairs - 1:
      problems.append(
          f"mqar: data.context_length={context_length} cannot hold "
          f"data.num_pairs={num_pairs} pairs and their queries (needs "
          f">= {4 * num_pairs - 1})")
  if task == "passkey" and context_length < 2 * PASSKEY_DIGITS + 1:
    problems.append(
        f"passkey: data.context_length={context_length} cannot hold a "
        f"planted key and its recall at any distance (needs >= "
        f"{2 * PASSKEY_DIGITS + 1})")
  return problems


def example_length(task: str, max_len: int, context_length: int) -> int:
  """Positions of one example of ``task`` (the model's ``max_len``):
  ``context_length`` for a causal task, else ``max_len``."""
  return context_length if task in CAUSAL_TASKS else max_len


#: The file in a language-model run's workdir naming the corpus it trained on.
CORPUS_RECORD = "corpus.json"


class CorpusChangedError(ValueError):
  """A workdir's run was trained on another corpus than the one here now."""


def check_corpus(task: str, workdir: str, root: str | None = None) -> None:
  """Raises :class:`CorpusChangedError` (one line) if ``workdir``'s
  :data:`CORPUS_RECORD` names another corpus than ``root``'s (default: this
  interpreter's standard library) now; nothing for a task without a corpus
  or a workdir without the record."""
  if task not in LANGUAGE_MODEL_TASKS:
    return
  try:
    with open(os.path.join(workdir, CORPUS_RECORD), encoding="utf-8") as f:
      saved = json.load(f)
  except FileNotFoundError:
    return
  except (OSError, ValueError) as e:
    raise CorpusChangedError(f"{os.path.join(workdir, CORPUS_RECORD)} "
                             f"cannot be read: {e}") from e
  now = corpus_hash(root)
  if saved.get("corpus_hash") != now:
    raise CorpusChangedError(
        f"the corpus changed under {workdir}: it was trained on corpus "
        f"{str(saved.get('corpus_hash'))[:12]} (Python "
        f"{saved.get('python_version')}), the corpus here is {now[:12]} "
        f"(Python {python_version()}): another interpreter or edited files; "
        "evaluate with the interpreter that trained it, or train anew in "
        "another workdir")


def write_corpus_record(task: str, workdir: str,
                        root: str | None = None) -> None:
  """Writes :data:`CORPUS_RECORD` (the corpus hash and Python version) in
  ``workdir`` for a language-model task, unless it is there already."""
  path = os.path.join(workdir, CORPUS_RECORD)
  if task not in LANGUAGE_MODEL_TASKS or os.path.exists(path):
    return
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"corpus_hash": corpus_hash(root),
               "python_version": python_version()}, f)
    f.write("\n")


def bits_per_char(loss: Any) -> Any:
  """A mean next-token loss in nats as bits per token (per byte for pylm,
  which is per character for its ASCII: :func:`load_corpus`): ``loss / ln
  2``. Numbers and arrays alike."""
  return loss / math.log(2)


def vocab_size(task: str, num_symbols: int, max_len: int) -> int:
  """Size of the token space covering inputs and targets (including pad 0).

  Args:
    task: one of `TASKS` or `CAUSAL_TASKS`.
    num_symbols: input symbols are ``1..num_symbols``.
    max_len: maximum sequence length.

  Returns:
    ``num_symbols + 1`` for reverse/sort (targets are input symbols);
    ``max(num_symbols, max_len) + 1`` for histogram (targets are counts in
    ``1..max_len``); for spell the pad, 10 digits, the blank and the letters
    (27, whatever ``num_symbols`` and ``max_len``); for mqar the pad and
    ``num_symbols`` keys, values and fillers each; for passkey the pad, two
    markers, 10 digits and ``num_symbols`` fillers; for pylm 256 (bytes).
  """
  if task == "mqar":
    return 1 + 3 * num_symbols
  if task == "passkey":
    return _PASSKEY_FILLER_0 + num_symbols
  if task == "pylm":
    return PYLM_VOCAB
  if task == "spell":
    return _LETTER_0 + len(LETTERS)
  if task in ("reverse", "sort"):
    return num_symbols + 1
  if task == "histogram":
    return max(num_symbols, max_len) + 1
  raise ValueError(f"Unknown task {task!r}; expected one of {TASKS}.")


# --------------------------------------------------------------------------
# The character LM's corpus: the Python standard library's own source.
# --------------------------------------------------------------------------

#
# The ``.py`` files under the running interpreter's standard library
# (``sysconfig.get_paths()["stdlib"]``), read as bytes; nothing is downloaded.
# Left out: ``site-packages`` (what is installed, not the library) and the test
# folders (``test``, ``tests``, ``idle_test``: two thirds of the bytes, much of
# them generated tables and deliberately malformed files). On CPython 3.11.7
# that leaves 734 files and 12.1 MB, 99.98% of the bytes ASCII, so bits per
# byte are bits per character up to those 2,185 bytes.
#
# Each file goes to train, validation or test by a hash of its path relative to
# the root (90/5/5, :func:`corpus_split_of`), so the split of a file does not depend on
# which other files exist. A split's stream is its files' bytes, one after the
# other in the order of their paths; :func:`corpus_windows` cuts a stream into
# fixed-length windows. :func:`corpus_hash` names the contents, so a run can
# tell that the corpus under it changed (another Python, an edited file).

CORPUS_SPLITS: tuple[str, ...] = ("train", "validation", "test")
#: Per cent of the files (by path hash) in train and validation; test is the
#: rest.
CORPUS_SPLIT_PERCENT: tuple[int, int] = (90, 5)
#: Folders never entered: installed packages and the library's own tests.
CORPUS_EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test",
     "__pycache__"})


def stdlib_dir() -> str:
  """The running interpreter's standard library folder."""
  return sysconfig.get_paths()["stdlib"]


def python_version() -> str:
  """The running interpreter's version, e.g. ``3.11.7``."""
  return platform.python_version()


def corpus_source_files(root: str) -> list[str]:
  """The ``.py`` files under ``root`` outside :data:`CORPUS_EXCLUDED_DIRS`, as
  sorted ``/``-separated paths relative to ``root`` (symlinked folders are
  not followed)."""
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in CORPUS_EXCLUDED_DIRS]
    rel = os.path.relpath(folder, root)
    for name in files:
      if name.endswith(".py"):
        path = name if rel == "." else os.path.join(rel, name)
        found.append(path.replace(os.sep, "/"))
  return sorted(found)


def corpus_split_of(path: str) -> str:
  """The split of the file at ``path`` (relative, ``/``-separated): the first
  8 bytes of its SHA-256 modulo 100, below 90 train, below 95 validation,
  else test."""
  bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8],
                          "big") % 100
  train, validation = CORPUS_SPLIT_PERCENT
  if bucket < train:
    return "train"
  return "validation" if bucket < train + validation else "test"


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The corpus read once: each split's stream and what names it."""

  root: str
  python_version: str  # Of the interpreter that read it.
  hash: str  # :func:`corpus_hash` of these contents.
  files: dict[str, tuple[str, ...]]  # {split: relative paths, in order}.
  streams: dict[str, bytes]  # {split: the files' bytes, concatenated}.

  def describe(self) -> str:
    """One line: the root, the Python, files and bytes a split, the hash."""
    parts = ", ".join(f"{s} {len(self.files[s])} files {len(self.streams[s]):,}"
                      " bytes" for s in CORPUS_SPLITS)
    return (f"{self.root} (Python {self.python_version}): {parts}; "
            f"corpus hash {self.hash[:16]}")


def _corpus_dir(root: str | None) -> str:
  return os.path.abspath(os.path.expanduser(root or stdlib_dir()))


def _read_corpus(root: str) -> tuple[list[str], list[bytes], str]:
  """The files under ``root``, their bytes and the corpus hash.

  Raises:
    ValueError: no file (one line), or a file holding a NUL byte (token 0
      is padding; Python refuses such source too).
  """
  if not os.path.isdir(root):
    raise ValueError(f"the pylm corpus folder {root} is not a folder")
  paths = corpus_source_files(root)
  if not paths:
    raise ValueError(f"the pylm corpus is empty: no .py files under {root} "
                     f"(outside {', '.join(sorted(CORPUS_EXCLUDED_DIRS))})")
  contents, digest = [], hashlib.sha256()
  for path in paths:
    with open(os.path.join(root, path), "rb") as f:
      content = f.read()
    if b"\0" in content:
      raise ValueError(f"the pylm corpus file {path} under {root} holds a NUL "
                       "byte (not Python source; byte 0 is padding)")
    contents.append(content)
    digest.update(path.encode() + b"\0")
    digest.update(hashlib.sha256(content).digest())
  return paths, contents, digest.hexdigest()


def corpus_hash(root: str | None = None) -> str:
  """SHA-256 (hex) of the corpus under ``root`` (default: the standard
  library): of every file's relative path and its contents' SHA-256, in path
  order. Raises ``ValueError`` (one line) for an empty corpus."""
  return _read_corpus(_corpus_dir(root))[2]


def load_corpus(root: str | None = None) -> Corpus:
  """Reads the corpus under ``root`` (default: the standard library) into
  its three split streams. Raises ``ValueError`` (one line) for an empty
  corpus."""
  root = _corpus_dir(root)
  paths, contents, digest = _read_corpus(root)
  files = {split: [] for split in CORPUS_SPLITS}
  streams = {split: [] for split in CORPUS_SPLITS}
  for path, content in zip(paths, contents):
    files[corpus_split_of(path)].append(path)
    streams[corpus_split_of(path)].append(content)
  return Corpus(root=root, python_version=python_version(), hash=digest,
                files={s: tuple(files[s]) for s in CORPUS_SPLITS},
                streams={s: b"".join(streams[s]) for s in CORPUS_SPLITS})


def corpus_windows(stream: bytes, context_length: int) -> np.ndarray:
  """``stream`` cut into ``[N, context_length + 1]`` uint8 windows that
  overlap by one byte: window ``i`` is ``stream[i*L : i*L + L + 1]``, so
  its first ``L`` bytes are a model's inputs and its last ``L`` the next
  bytes, and every byte after the first is a target once. The tail that
  fills no whole window (under ``L`` bytes) is left out."""
  if context_length < 1:
    raise ValueError(f"context_length must be >= 1, got {context_length}")
  data = np.frombuffer(stream, np.uint8)
  count = max(len(data) - 1, 0) // context_length
  starts = np.arange(count)[:, None] * context_length
  return data[starts + np.arange(context_length + 1)[None, :]]


# --------------------------------------------------------------------------
# Generation (pure numpy, vectorised)
# --------------------------------------------------------------------------


def _sample_inputs(
    rng: np.random.Generator, spec: DataSpec, num: int
) -> np.ndarray:
  """Samples `num` padded input rows [num, max_len] int32."""
  if spec.task == "spell":
    return _sample_spell_inputs(rng, spec, num)
  lengths = rng.integers(spec.min_len, spec.max_len + 1, size=num)
  tokens = rng.integers(1, spec.num_symbols + 1, size=(num, spec.max_len))
  mask = np.arange(spec.max_len)[None, :] < lengths[:, None]
  return np.where(mask, tokens, 0).astype(np.int32)


def _sample_spell_inputs(
    rng: np.random.Generator, spec: DataSpec, num: int
) -> np.ndarray:
  """`num` padded spell input rows: 1..max_digits digit tokens, blanks up to
  the length of their spelling, then padding."""
  counts = rng.integers(1, spec.max_digits + 1, size=num)
  digits = rng.integers(0, len(DIGIT_WORDS), size=(num, spec.max_digits))
  inputs = np.zeros((num, spec.max_len), np.int32)
  for row, (count, ds) in enumerate(zip(counts, digits)):
    tokens, _ = spell_tokens(ds[:count])
    inputs[row, : len(tokens)] = tokens
  return inputs


def _spell_targets(inputs: np.ndarray) -> np.ndarray:
  """Letter tokens [N, L] of padded spell `inputs` [N, L]."""
  out = np.zeros_like(inputs)
  is_digit = (inputs >= _DIGIT_0) & (inputs < BLANK)
  for row, (x, digit) in enumerate(zip(inputs, is_digit)):
    _, letters = spell_tokens(x[digit] - _DIGIT_0)
    out[row, : len(letters)] = letters
  return out


def _compute_targets(task: str, inputs: np.ndarray) -> np.ndarray:
  """Per-position targets [N, L] int32 for padded `inputs` [N, L] (0 = pad)."""
  inputs = np.asarray(inputs, dtype=np.int32)
  n_rows, max_len = inputs.shape
  mask = inputs != 0
  lengths = mask.sum(axis=1)
  pos = np.arange(max_len)[None, :]
  if task == "reverse":
    src = np.clip(lengths[:, None] - 1 - pos, 0, max_len - 1)
    out = np.take_along_axis(inputs, src, axis=1)
  elif task == "sort":
    big = np.iinfo(np.int32).max
    out = np.sort(np.where(mask, inputs, big), axis=1)
  elif task == "histogram":
    out = np.empty_like(inputs)
    chunk = max(1, (1 << 22) // max(1, max_len * max_len))  # bound memory
    for s in range(0, n_rows, chunk):
      x = inputs[s : s + chunk]
      m = mask[s : s + chunk]
      eq = (x[:, :, None] == x[:, None, :]) & m[:, None, :]
      out[s : s + chunk] = eq.sum(axis=2)
  elif task == "spell":
    out = _spell_targets(inputs)
  else:
    raise ValueError(f"Unknown task {task!r}; expected one of {TASKS}.")
  return np.where(mask, out, 0).astype(np.int32)


def _row_keys(inputs: np.ndarray) -> list[bytes]:
  """Hashable keys identifying each row's valid prefix (padding is all 0)."""
  inputs = np.ascontiguousarray(inputs, dtype=np.int32)
  return [row.tobytes() for row in inputs]


def _generate_arrays(spec: DataSpec) -> dict[str, dict[str, np.ndarray]]:
  """Generates all splits for `spec`: {split: {inputs, targets}}.

  Deterministic in `spec` only. The train split is sampled i.i.d.; validation
  and test are sampled by rejection so that their valid prefixes never occur in
  train, and test's never occur in validation. Within a split, repeats are
  allowed (same distribution as train, restricted to unseen sequences).
  """
  sizes = {
      "train": spec.num_train_examples,
      "validation": spec.num_eval_examples,
      "test": spec.num_eval_examples,
  }
  seen: set[bytes] = set()
  out: dict[str, dict[str, np.ndarray]] = {}
  for split_id, split in enumerate(_SPLITS):
    rng = np.random.default_rng([spec.seed, split_id])
    need = sizes[split]
    if split == "train":
      inputs = _sample_inputs(rng, spec, need)
    else:
      parts_x, have = [], 0
      for _ in range(1000):
        if have >= need:
          break
        cand_x = _sample_inputs(rng, spec, max(2 * (need - have), 256))
        keep = np.fromiter(
            (k not in seen for k in _row_keys(cand_x)), bool, len(cand_x)
        )
        parts_x.append(cand_x[keep][: need - have])
        have += len(parts_x[-1])
      if have < need:
        raise ValueError(
            f"Could not sample {need} {split} sequences unseen in earlier "
            f"splits for {spec}; the sequence space is too small."
        )
      inputs = np.concatenate(parts_x)
    seen.update(_row_keys(inputs))
    out[split] = {
        "inputs": inputs,
        "targets": _compute_targets(spec.task, inputs),
    }
  return out


def _mqar_tokens(rng: np.random.Generator, spec: DataSpec,
                 num: int) -> np.ndarray:
  """``num`` mqar examples ``[num, 3, L + 1]`` int32: sequence, weights,
  distances (module docstring)."""
  symbols, pairs, width = spec.num_symbols, spec.num_pairs, spec.context_length + 1
  rows = np.arange(num)[:, None]

  def distinct(count: int, first: int) -> np.ndarray:
    """``count`` distinct tokens a row from ``first .. first + S - 1``."""
    order = np.argsort(rng.random((num, symbols)), axis=1)
    return order[:, :count] + first

  keys, values = distinct(pairs, 1), distinct(pairs, 1 + symbols)
  seq = rng.integers(1 + 2 * symbols, 1 + 3 * symbols, size=(num, width))
  seq[:, 0:2 * pairs:2], seq[:, 1:2 * pairs:2] = keys, values
  num_slots = (width - 2 * pairs) // 2
  slots = np.argsort(rng.random((num, num_slots)), axis=1)[:, :pairs]
  asked = np.argsort(rng.random((num, pairs)), axis=1)  # The pair of a slot.
  key_at = 2 * pairs + 2 * slots  # Where each query's key is.
  seq[rows, key_at] = keys[rows, asked]
  seq[rows, key_at + 1] = values[rows, asked]
  weights, distances = np.zeros_like(seq), np.zeros_like(seq)
  weights[rows, key_at + 1] = 1
  distances[rows, key_at + 1] = key_at + 1 - (2 * asked + 1)
  return np.stack([seq, weights, distances], axis=1).astype(np.int32)


def _passkey_tokens(rng: np.random.Generator, spec: DataSpec,
                    num: int) -> np.ndarray:
  """``num`` passkey examples ``[num, 3, L + 1]`` int32: sequence, weights,
  distances (module docstring)."""
  length, digits = spec.context_length, PASSKEY_DIGITS
  rows = np.arange(num)[:, None]
  seq = rng.integers(_PASSKEY_FILLER_0, _PASSKEY_FILLER_0 + spec.num_symbols,
                     size=(num, length + 1))
  distance = rng.integers(digits + 1, length - digits + 1, size=num)
  mark = length - digits - distance  # The planted key's marker, >= 0.
  key = rng.integers(0, 10, size=(num, digits)) + _PASSKEY_DIGIT_0
  seq[rows, mark[:, None]] = PASSKEY_MARK
  seq[rows, mark[:, None] + 1 + np.arange(digits)] = key
  seq[:, length - digits] = PASSKEY_ASK
  seq[:, length - digits + 1:] = key
  weights, distances = np.zeros_like(seq), np.zeros_like(seq)
  weights[:, length - digits + 1:] = 1
  distances[:, length - digits + 1:] = distance[:, None]
  return np.stack([seq, weights, distances], axis=1).astype(np.int32)


def _generate_causal(spec: DataSpec,
                     text: Corpus | None = None
                     ) -> dict[str, np.ndarray]:
  """Every split's records of causal ``spec``: {split: ``[N, rows, L + 1]``}
  (int32 sequence, weights, distances; pylm's uint8 sequence alone).

  mqar and passkey: deterministic in ``spec``, each split from its own
  stream ``default_rng([seed, split index])`` (their example spaces are too
  large for repeats across splits to matter, so none are rejected). pylm:
  the windows of ``text`` (default: :func:`load_corpus` of
  ``spec.corpus_dir``).

  Raises:
    ValueError: a pylm split too short for one window (one line).
  """
  if spec.task == "pylm":
    text = text or load_corpus(spec.corpus_dir or None)
    out = {}
    for split in _SPLITS:
      windows = corpus_windows(text.streams[split], spec.context_length)
      if not len(windows):
        raise ValueError(
            f"pylm: the {split} split of {text.root} ({len(text.files[split])}"
            f" files, {len(text.streams[split])} bytes) is shorter than one "
            f"window of data.context_length + 1 = {spec.context_length + 1} "
            "bytes")
      out[split] = windows[:, None, :]
    return out
  make = {"mqar": _mqar_tokens, "passkey": _passkey_tokens}[spec.task]
  sizes = {"train": spec.num_train_examples,
           "validation": spec.num_eval_examples,
           "test": spec.num_eval_examples}
  return {split: make(np.random.default_rng([spec.seed, split_id]), spec,
                      sizes[split])
          for split_id, split in enumerate(_SPLITS)}


def causal_split(records: np.ndarray, task: str) -> "Split":
  """The :class:`Split` of a causal task's records ``[N, rows, L + 1]``
  (as stored: :func:`_generate_causal`)."""
  seq = records[:, 0].astype(np.int32)
  inputs = np.ascontiguousarray(seq[:, :-1])
  targets = np.ascontiguousarray(seq[:, 1:])
  if task in RECALL_TASKS:
    weights = records[:, 1, 1:].astype(np.float32)
    distances = np.ascontiguousarray(records[:, 2, 1:], dtype=np.int32)
  else:
    weights, distances = np.ones(targets.shape, np.float32), None
  for array in (inputs, targets, weights, distances):
    if array is not None:
      array.setflags(write=False)
  return Split(inputs=inputs, targets=targets, task=task, weights=weights,
               distances=distances)


# --------------------------------------------------------------------------
# TFDS builder
# --------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class ToySeq2SeqConfig(tfds.core.BuilderConfig):
  """BuilderConfig carrying the `DataSpec` fields."""

  task: str = "reverse"
  num_symbols: int = 10
  min_len: int = 1
  max_len: int = 16
  num_train_examples: int = 20000
  num_eval_examples: int = 1000
  seed: int = 0
  max_digits: int = 4
  context_length: int = 128
  num_pairs: int = 8
  corpus_dir: str = ""
  corpus_hash: str = ""  # pylm: the hash of the corpus it was named for.

  @property
  def spec(self) -> DataSpec:
    """The `DataSpec` this config generates."""
    return DataSpec(**{
        f.name: getattr(self, f.name) for f in dataclasses.fields(DataSpec)
    })

  @classmethod
  def from_spec(cls, name: str, spec: DataSpec,
                corpus_hash: str = "") -> "ToySeq2SeqConfig":
    """Config named `name` carrying `spec` (and, for pylm, the hash of the
    corpus it was named for)."""
    kind = ("Causal next-token" if spec.task in CAUSAL_TASKS
            else "Toy per-position seq2seq")
    return cls(
        name=name,
        description=f"{kind}: {spec}",
        corpus_hash=corpus_hash,
        **dataclasses.asdict(spec),
    )


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """The metadata of data generated on this machine, with nothing to fetch.

  A builder whose data is not prepared yet asks its info to look for
  published metadata on GCS (``initialize_from_bucket``). For these toy
  datasets that lookup can only miss, and TFDS's version also leaves an empty
  ``tmp*tfds`` folder in the system's temporary directory each time (one per
  preparation, thousands over a test suite's runs), so it does nothing
  here.
  """

  def initialize_from_bucket(self) -> None:
    """Nothing is published for generated data: no lookup, no folder."""


class ToySeq2Seq(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Toy per-position sequence-to-sequence tasks (reverse, sort, histogram,
  spell) and the causal tasks (mqar, passkey, pylm).

  Not registered in the global tfds registry (build it with `make_builder`),
  so re-importing this module (e.g. as `__main__`) cannot collide.
  """

  name = "toy_seq2seq"
  # tfds derives `code_path` (used only to look for a download-checksums file)
  # via `importlib_resources`, which is not installed here; there is nothing to
  # download, so no code path / checksums file is needed.
  code_path = None
  VERSION = tfds.core.Version(_VERSION)
  RELEASE_NOTES = {
      "1.0.0": "Initial release.",
      "1.1.0": "No stored `length` feature (it is `inputs != 0`).",
      "1.2.0": "One feature, `tokens` [2, max_len]: inputs and targets as "
               "raw int32 bytes, so that a split decodes at once. (Later, "
               "without changing these: the causal tasks mqar, passkey and "
               "pylm, `tokens` [3 or 1, context_length + 1].)",
  }
  # spell has none: its DataSpec defaults (max_len 16) cannot hold 4 digits;
  # pylm neither: its name holds the hash of the corpus it reads.
  BUILDER_CONFIGS = [
      ToySeq2SeqConfig.from_spec(task, DataSpec(task=task))
      for task in ("reverse", "sort", "histogram", "mqar", "passkey")
  ]
  DEFAULT_BUILDER_CONFIG_NAME = "reverse"

  def _info(self) -> tfds.core.DatasetInfo:
    config = self.builder_config
    spec = config.spec
    shape, dtype = _record_layout(spec)
    description = ("Toy per-position seq2seq tasks for encoder-only "
                   "Transformers. Symbols 1..num_symbols, 0 = padding.")
    metadata = None
    if spec.task == "pylm":
      # What a run compares with its checkpoint's (and what to read the
      # bits per character against).
      metadata = tfds.core.MetadataDict(
          python_version=python_version(),
          corpus_hash=config.corpus_hash,
          corpus_dir=_corpus_root(spec))
      description = (
          "Bytes of the .py files of the Python standard library (pylm), "
          f"read by Python {python_version()} from "
          f"{_corpus_root(spec)}; corpus hash {config.corpus_hash}.")
    elif spec.task in CAUSAL_TASKS:
      description = (f"Causal recall task {spec.task}: next-token targets, "
                     "loss weights on the answers, planted distances.")
    return _LocalDatasetInfo(
        builder=self,
        description=description,
        # One fixed-length raw-bytes value per example (inputs, then
        # targets; a causal task's sequence, weights and distances), which
        # `read_split` decodes for a whole split at once.
        features=tfds.features.FeaturesDict({
            "tokens": tfds.features.Tensor(
                shape=shape, dtype=dtype,
                encoding=tfds.features.Encoding.BYTES),
        }),
        metadata=metadata,
        disable_shuffling=True,  # keep the generation order on disk.
    )

  # TFDS prints two lines of its own around a preparation ("Downloading and
  # preparing dataset Unknown size ..." and "... Subsequent calls will reuse
  # this data."): nothing is downloaded here, and data_sources prints the one
  # line that says what happens.
  def _log_download_bytes(self) -> None:
    """Prints nothing (see :func:`data_sources`)."""

  def _log_download_done(self) -> None:
    """Prints nothing (see :func:`data_sources`)."""

  def _split_generators(self, dl_manager):  # pylint: disable=unused-argument
    del dl_manager
    spec = self.builder_config.spec
    if spec.task in CAUSAL_TASKS:
      return {split: self._generate_records(records)
              for split, records in self._causal_records(spec).items()}
    arrays = _generate_arrays(spec)
    return {split: self._generate_examples(arrays[split]) for split in _SPLITS}

  def _causal_records(self, spec: DataSpec) -> dict[str, np.ndarray]:
    """The records of a causal ``spec``; pylm's corpus checked against the
    hash in the config's name, its files and bytes a split put in the
    metadata."""
    if spec.task != "pylm":
      return _generate_causal(spec)
    text = load_corpus(_corpus_root(spec))
    if text.hash != self.builder_config.corpus_hash:
      raise ValueError(f"pylm: the corpus under {text.root} changed while "
                       "its dataset was being prepared; prepare it again")
    self.info.metadata.update(
        num_files={s: len(text.files[s]) for s in _SPLITS},
        num_bytes={s: len(text.streams[s]) for s in _SPLITS})
    return _generate_causal(spec, text)

  def _generate_examples(self, arrays: dict[str, np.ndarray]):
    tokens = np.stack([arrays["inputs"], arrays["targets"]], axis=1)
    for i, example in enumerate(tokens):
      yield i, {"tokens": example}

  def _generate_records(self, records: np.ndarray):
    for i, example in enumerate(records):
      yield i, {"tokens": example}


def _record_layout(spec: DataSpec) -> tuple[tuple[int, int], type]:
  """Shape and dtype of one stored example's ``tokens`` (module
  docstring)."""
  if spec.task == "pylm":
    return (1, spec.context_length + 1), np.uint8
  if spec.task in CAUSAL_TASKS:
    return (3, spec.context_length + 1), np.int32
  return (2, spec.max_len), np.int32


def _corpus_root(spec: DataSpec) -> str:
  """The folder pylm reads: ``corpus_dir``, else the standard library."""
  return os.path.abspath(os.path.expanduser(
      spec.corpus_dir or stdlib_dir()))


# The fields each kind of task ignores (added after the seq2seq tasks, or
# theirs alone): left out of the name of its data on disk.
_SEQ2SEQ_ONLY = ("min_len", "max_len", "max_digits")
_CAUSAL_ONLY = ("context_length", "num_pairs", "corpus_dir")


def _identity(spec: DataSpec) -> dict[str, object]:
  """The fields that name `spec`'s data on disk: for the seq2seq tasks all of
  them, except ``max_digits`` (added with spell) for the other tasks and the
  causal tasks' fields, so that every spec of theirs keeps the name, and the
  prepared data, it had before; for mqar and passkey the fields they use;
  for pylm ``context_length`` and the corpus hash (reads the corpus)."""
  fields = dataclasses.asdict(spec)
  if spec.task == "pylm":
    return {"task": spec.task, "context_length": spec.context_length,
            "corpus_hash": corpus_hash(_corpus_root(spec))}
  unused = _CAUSAL_ONLY if spec.task in TASKS else _SEQ2SEQ_ONLY + (
      "corpus_dir",) + (("num_pairs",) if spec.task == "passkey" else ())
  if spec.task in TASKS and spec.task != "spell":
    unused += ("max_digits",)
  for name in unused:
    del fields[name]
  return fields


def config_name(spec: DataSpec) -> str:
  """Builder config name for `spec` (see `make_builder`)."""
  return _config_name(spec, _identity(spec))


def _config_name(spec: DataSpec, identity: dict[str, object]) -> str:
  if (spec.task in ToySeq2Seq.builder_configs
      and identity == _identity(DataSpec(task=spec.task))):
    return spec.task
  blob = json.dumps(identity, sort_keys=True).encode()
  return f"{spec.task}_{hashlib.sha256(blob).hexdigest()[:10]}"


def make_builder(spec: DataSpec, data_dir: str) -> ToySeq2Seq:
  """Builder for `spec` rooted at `data_dir`.

  A spec equal to a task's default BuilderConfig uses that config's name
  ('reverse', ...); any other spec gets its own config named
  f"{task}_{short hash of the spec}" so that prepared data for different specs
  never collide on disk (``data_dir/toy_seq2seq/<config>/<version>/``). A
  pylm spec's name hashes the corpus too (read once here), so a changed
  corpus is prepared anew, never read stale.
  """
  identity = _identity(spec)
  name = _config_name(spec, identity)
  if name == spec.task:
    # tfds requires predefined configs to be passed by name (or by identity).
    return ToySeq2Seq(data_dir=data_dir, config=name)
  with _quiet_tfds():
    return ToySeq2Seq(
        data_dir=data_dir, config=ToySeq2SeqConfig.from_spec(
            name, spec, corpus_hash=str(identity.get("corpus_hash", ""))))


class _ToyDataFilter(logging.Filter):
  """Drops two TFDS warnings that are expected here: that a builder config
  is not predefined (every spec other than a task's default is one, by
  design: ``make_builder``; the warning printed the whole spec on one line
  at every run), and, while a new spec is prepared, that its version folder
  has no ``dataset_info.json`` yet."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Using custom data configuration")
                or (message.startswith("Variant folder")
                    and message.endswith("has no dataset_info.json")))


def _quiet_tfds() -> contextlib.AbstractContextManager[None]:
  """TFDS's expected warnings about our toy data left out; other records
  untouched."""
  return absl_logs.filtered(_ToyDataFilter())


# --------------------------------------------------------------------------
# In-memory splits and batching
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
  """One split held in memory."""

  inputs: np.ndarray  # [N, max_len] int32
  targets: np.ndarray  # [N, max_len] int32
  task: str | None = None  # What `token_names` to read the tokens as.
  # Causal tasks: [N, context_length] float32, 1 where the loss counts.
  weights: np.ndarray | None = None
  # Recall tasks: [N, context_length] int32, how far back each position's
  # answer was planted (0: no answer there).
  distances: np.ndarray | None = None

  def __len__(self) -> int:
    return int(self.inputs.shape[0])

  @property
  def lengths(self) -> np.ndarray:
    """[N] int32 number of valid (non-padding) positions per example."""
    return (self.inputs != 0).sum(axis=1).astype(np.int32)


def next_token_arrays(tokens: np.ndarray, scored_from: int | np.ndarray = 0
                      ) -> dict[str, np.ndarray]:
  """A next-token task's ``inputs``, ``targets`` and ``weights`` ``[N, L]``
  from token rows ``[N, L + 1]`` (0 = padding): position i reads
  ``tokens[:, i]`` and predicts ``tokens[:, i + 1]``; it is scored (weight
  1) when that target is not padding and ``i + 1 >= scored_from`` (an int,
  or one per row ``[N]``: the first target token that counts, so a prompt
  before it is context only)."""
  tokens = np.asarray(tokens, np.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  first = np.reshape(np.asarray(scored_from), (-1, 1))
  scored = (targets != 0) & (np.arange(1, tokens.shape[1]) >= first)
  return {"inputs": np.ascontiguousarray(inputs),
          "targets": np.ascontiguousarray(targets),
          "weights": scored.astype(np.float32)}


#: A target below 0 is not scored (PyTorch's ``ignore_index`` convention):
#: where the metrics read no ``weights``, they count a position when its
#: input is not padding and its target is >= 0 (:func:`scored`).
UNSCORED = -1


def scored(inputs: Any, targets: Any) -> Any:
  """``[..., L]`` bool: the positions the metrics count when they read no
  ``weights``: a non-padding input with a target >= 0 (numpy or jax)."""
  return (inputs != 0) & (targets >= 0)


def scored_targets(split: Split) -> Split:
  """``split`` with its ``weights`` folded into its targets: ``UNSCORED``
  where a position's weight is 0, its target elsewhere, and no weights.
  The head study reads next-token tasks this way, so every pruning
  technique scores the positions the task's weights choose (the answers of
  a recall task) through the same ``(inputs, targets)`` as an encoder's. A
  split without weights is returned as it is."""
  if split.weights is None:
    return split
  targets = np.where(np.asarray(split.weights) > 0, split.targets,
                     UNSCORED).astype(np.int32)
  targets.setflags(write=False)
  return dataclasses.replace(split, targets=targets, weights=None)


def read_split(source: Any, spec: DataSpec) -> Split:
  """Reads a whole data source of :func:`data_sources` (raw records) into
  memory at once."""
  records = source.__getitems__(range(len(source)))
  shape, dtype = _record_layout(spec)
  tokens = _decode_tokens(records, shape, dtype)
  if spec.task in CAUSAL_TASKS:
    return causal_split(tokens, spec.task)
  inputs, targets = (np.ascontiguousarray(tokens[:, i]) for i in (0, 1))
  inputs.setflags(write=False)
  targets.setflags(write=False)
  return Split(inputs=inputs, targets=targets, task=spec.task)


def _decode_tokens(records: list[bytes], shape: tuple[int, int],
                   dtype: type) -> np.ndarray:
  """The ``tokens`` [N, *shape] of serialized ``tf.train.Example`` records,
  decoded at once (``shape`` and ``dtype``: :func:`_record_layout`).

  Every record holds one feature of the same byte length, so records of
  equal length share their layout: the bytes before the value (the proto's
  tags and lengths and the feature's name) are the same in all of them and
  the value is the last ``prod(shape) * itemsize`` bytes (``8 * max_len``
  for a seq2seq task). Checked (equal lengths, equal heads, the first record
  parsed as a proto); if a check fails, each record is parsed as a proto
  instead (slower, same result).
  """
  size = int(np.prod(shape)) * np.dtype(dtype).itemsize
  width = len(records[0]) if records else 0
  if records and all(len(r) == width for r in records):
    table = np.frombuffer(b"".join(records), np.uint8).reshape(-1, width)
    head = width - size
    if (head >= 0 and np.array_equal(table[0, head:].tobytes(),
                                     _parse_value(records[0]))
        and (table[:, :head] == table[0, :head]).all()):
      values = np.ascontiguousarray(table[:, head:])
      return values.view(dtype).reshape(-1, *shape)
  joined = b"".join(_parse_value(r) for r in records)
  return np.frombuffer(joined, dtype).reshape(-1, *shape)


def _parse_value(record: bytes) -> bytes:
  """The ``tokens`` bytes of one serialized ``tf.train.Example``."""
  example = tf_example_pb2.Example.FromString(record)
  return example.features.feature["tokens"].bytes_list.value[0]


def load_splits(spec: DataSpec, data_dir: str) -> dict[str, Split]:
  """Prepares the dataset if needed and reads all splits into memory.

  ``data_dir`` may start with ``~``. :func:`data_sources`, then
  :func:`read_split` for each split.

  Returns:
    {'train': Split, 'validation': Split, 'test': Split}.
  """
  sources = data_sources(spec, data_dir)
  return {split: read_split(sources[split], spec) for split in _SPLITS}


class DataDirError(ValueError):
  """The data directory cannot hold the prepared data (a path through a file,
  a read-only file system, no permission): a user's mistake, as a spec that
  cannot be generated is."""


def data_sources(spec: DataSpec, data_dir: str) -> dict[str, object]:
  """Prepares the dataset if needed; returns its splits' data sources.

  Preparation uses ``download_and_prepare(file_format='array_record')``;
  reading goes through ``builder.as_data_source()`` (random access via
  ArrayRecord, no TensorFlow), as raw records for :func:`read_split`. A spec
  whose data cannot be generated (e.g. too few distinct sequences for the
  splits) raises ``ValueError`` here, before anything is read, and a
  ``data_dir`` that cannot hold the data :class:`DataDirError` (a
  ``ValueError`` too).

  Returns:
    {'train': source, 'validation': source, 'test': source}.
  """
  data_dir = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))

  @contextlib.contextmanager
  def data_dir_errors() -> Iterator[None]:
    """The data_dir's own failures (a path through a file, a read-only
    disk, ...) as :class:`DataDirError`; not stdout's (a closed pipe)."""
    try:
      yield
    except OSError as e:
      raise DataDirError(f"data_dir {data_dir} cannot be used: "
                         f"{write_failures.os_error_reason(e)}; set "
                         "data.data_dir to a folder this process can write"
                         ) from e

  with data_dir_errors():
    builder = make_builder(spec, data_dir)
    with _quiet_tfds():
      prepared = builder.is_prepared()
  if not prepared:
    print(
        f"Preparing toy_seq2seq/{builder.builder_config_name} ({spec}) "
        f"in {builder.data_dir}",
        flush=True,
    )
    tfds.disable_progress_bar()  # one line above says what is happening
    try:
      with data_dir_errors(), _quiet_tfds():
        builder.download_and_prepare(file_format="array_record")
    finally:
      tfds.enable_progress_bar()
  sources = builder.as_data_source(
      deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
  return {split: sources[split] for split in _SPLITS}


@functools.lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  perm = np.random.default_rng([seed, epoch]).permutation(n)
  perm.setflags(write=False)
  return perm


def train_batch(
    split: Split, *, seed: int, step: int, batch_size: int
) -> dict[str, np.ndarray]:
  """The batch for training step `step` (0-based).

  A pure, deterministic function of (seed, step): epoch-based shuffling without
  replacement, where epoch ``e`` visits the examples in the order
  ``np.random.default_rng([seed, e]).permutation(N)`` and batches are
  consecutive windows of the concatenation of all epochs' permutations (so a
  batch crossing an epoch boundary takes the tail of one permutation and the
  head of the next).

  Returns:
    {'inputs': [B, L] int32, 'targets': [B, L] int32}, and 'weights' [B, L]
    float32 when the split has them.
  """
  n = len(split)
  if n == 0:
    raise ValueError("Cannot draw training batches from an empty split.")
  if step < 0 or batch_size < 1:
    raise ValueError(f"Need step >= 0 and batch_size >= 1: {step}, {batch_size}")
  flat = step * batch_size + np.arange(batch_size, dtype=np.int64)
  epochs, pos = np.divmod(flat, n)
  idx = np.empty(batch_size, dtype=np.int64)
  for e in np.unique(epochs):
    sel = epochs == e
    idx[sel] = _epoch_permutation(int(seed), int(e), n)[pos[sel]]
  batch = {"inputs": split.inputs[idx], "targets": split.targets[idx]}
  if split.weights is not None:
    batch["weights"] = split.weights[idx]
  return batch


def eval_batches(split: Split, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Deterministic in-order batches covering `split` exactly once.

  The last partial batch is padded to `batch_size` with all-zero rows (pure
  padding: no valid tokens and zero weights, so metrics ignore them); every
  batch has shape [batch_size, max_len] (a single compilation). A split with
  weights gives 'weights' too.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  n = len(split)
  arrays = {"inputs": (split.inputs, np.int32),
            "targets": (split.targets, np.int32)}
  if split.weights is not None:
    arrays["weights"] = (split.weights, np.float32)
  for start in range(0, n, batch_size):
    batch = {}
    for key, (values, dtype) in arrays.items():
      rows = values[start : start + batch_size]
      if len(rows) < batch_size:
        rows = np.pad(rows, ((0, batch_size - len(rows)), (0, 0)))
      batch[key] = np.asarray(rows, dtype)
    yield batch
