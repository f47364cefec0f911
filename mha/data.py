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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
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
CAUSAL_TASKS: frozenset[str] = frozenset()

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


def token_names(task: str) -> tuple[str, ...] | None:
  """What each token id of ``task`` reads as, indexed by id (``0``: ``""``,
  padding), where it is not the number itself: spell's digits, blank (``_``)
  and letters. None for the other tasks (their tokens are numbers)."""
  if task != "spell":
    return None
  return ("", *map(str, range(len(DIGIT_WORDS))), "_", *LETTERS)


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

  def __post_init__(self) -> None:
    if self.task not in TASKS:
      raise ValueError(f"Unknown task {self.task!r}; expected one of {TASKS}.")
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


def vocab_size(task: str, num_symbols: int, max_len: int) -> int:
  """Size of the token space covering inputs and targets (including pad 0).

  Args:
    task: one of `TASKS`.
    num_symbols: input symbols are ``1..num_symbols``.
    max_len: maximum sequence length.

  Returns:
    ``num_symbols + 1`` for reverse/sort (targets are input symbols);
    ``max(num_symbols, max_len) + 1`` for histogram (targets are counts in
    ``1..max_len``); for spell the pad, 10 digits, the blank and the letters
    (27, whatever ``num_symbols`` and ``max_len``).
  """
  if task == "spell":
    return _LETTER_0 + len(LETTERS)
  if task in ("reverse", "sort"):
    return num_symbols + 1
  if task == "histogram":
    return max(num_symbols, max_len) + 1
  raise ValueError(f"Unknown task {task!r}; expected one of {TASKS}.")


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

  @property
  def spec(self) -> DataSpec:
    """The `DataSpec` this config generates."""
    return DataSpec(**{
        f.name: getattr(self, f.name) for f in dataclasses.fields(DataSpec)
    })

  @classmethod
  def from_spec(cls, name: str, spec: DataSpec) -> "ToySeq2SeqConfig":
    """Config named `name` carrying `spec`."""
    return cls(
        name=name,
        description=f"Toy per-position seq2seq: {spec}",
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
  spell).

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
               "raw int32 bytes, so that a split decodes at once.",
  }
  # spell has none: its DataSpec defaults (max_len 16) cannot hold 4 digits.
  BUILDER_CONFIGS = [
      ToySeq2SeqConfig.from_spec(task, DataSpec(task=task))
      for task in ("reverse", "sort", "histogram")
  ]
  DEFAULT_BUILDER_CONFIG_NAME = "reverse"

  def _info(self) -> tfds.core.DatasetInfo:
    spec = self.builder_config.spec
    return _LocalDatasetInfo(
        builder=self,
        description=(
            "Toy per-position seq2seq tasks for encoder-only Transformers. "
            "Symbols 1..num_symbols, 0 = padding."
        ),
        # One fixed-length raw-bytes value per example (inputs, then
        # targets), which `_read_split` decodes for a whole split at once.
        features=tfds.features.FeaturesDict({
            "tokens": tfds.features.Tensor(
                shape=(2, spec.max_len), dtype=np.int32,
                encoding=tfds.features.Encoding.BYTES),
        }),
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
    arrays = _generate_arrays(self.builder_config.spec)
    return {split: self._generate_examples(arrays[split]) for split in _SPLITS}

  def _generate_examples(self, arrays: dict[str, np.ndarray]):
    tokens = np.stack([arrays["inputs"], arrays["targets"]], axis=1)
    for i, example in enumerate(tokens):
      yield i, {"tokens": example}


def _identity(spec: DataSpec) -> dict[str, object]:
  """The fields that name `spec`'s data on disk: all of them, except
  ``max_digits`` (added with spell) for the other tasks, so that every spec
  of theirs keeps the name, and the prepared data, it had before."""
  fields = dataclasses.asdict(spec)
  if spec.task != "spell":
    del fields["max_digits"]
  return fields


def _spec_hash(spec: DataSpec) -> str:
  """Short stable hash of `spec` (independent of Python's `hash()`)."""
  blob = json.dumps(_identity(spec), sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:10]


def config_name(spec: DataSpec) -> str:
  """Builder config name for `spec` (see `make_builder`)."""
  if (spec.task in ToySeq2Seq.builder_configs
      and _identity(spec) == _identity(DataSpec(task=spec.task))):
    return spec.task
  return f"{spec.task}_{_spec_hash(spec)}"


def make_builder(spec: DataSpec, data_dir: str) -> ToySeq2Seq:
  """Builder for `spec` rooted at `data_dir`.

  A spec equal to a task's default BuilderConfig uses that config's name
  ('reverse', ...); any other spec gets its own config named
  f"{task}_{short hash of the spec}" so that prepared data for different specs
  never collide on disk (``data_dir/toy_seq2seq/<config>/<version>/``).
  """
  name = config_name(spec)
  if name == spec.task:
    # tfds requires predefined configs to be passed by name (or by identity).
    return ToySeq2Seq(data_dir=data_dir, config=name)
  with _quiet_tfds():
    return ToySeq2Seq(
        data_dir=data_dir, config=ToySeq2SeqConfig.from_spec(name, spec)
    )


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
  # [N, max_len] float32 loss weight of each position, or None: every
  # non-padding input position counts (``inputs != 0``). A next-token task
  # gives 0 to the positions it does not score (a prompt, the last token).
  weights: np.ndarray | None = None

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


def read_split(source: Any, spec: DataSpec) -> Split:
  """Reads a whole data source of :func:`data_sources` (raw records) into
  memory at once."""
  records = source.__getitems__(range(len(source)))
  tokens = _decode_tokens(records, spec.max_len)
  inputs, targets = (np.ascontiguousarray(tokens[:, i]) for i in (0, 1))
  inputs.setflags(write=False)
  targets.setflags(write=False)
  return Split(inputs=inputs, targets=targets, task=spec.task)


def _decode_tokens(records: list[bytes], max_len: int) -> np.ndarray:
  """The ``tokens`` [N, 2, max_len] of serialized ``tf.train.Example``
  records, decoded at once.

  Every record holds one feature of the same byte length, so records of
  equal length share their layout: the bytes before the value (the proto's
  tags and lengths and the feature's name) are the same in all of them and
  the value is the last ``8 * max_len`` bytes. Checked (equal lengths, equal
  heads, the first record parsed as a proto); if a check fails, each record
  is parsed as a proto instead (slower, same result).
  """
  size = 2 * max_len * np.dtype(np.int32).itemsize
  width = len(records[0]) if records else 0
  if records and all(len(r) == width for r in records):
    table = np.frombuffer(b"".join(records), np.uint8).reshape(-1, width)
    head = width - size
    if (head >= 0 and np.array_equal(table[0, head:].tobytes(),
                                     _parse_value(records[0]))
        and (table[:, :head] == table[0, :head]).all()):
      values = np.ascontiguousarray(table[:, head:])
      return values.view(np.int32).reshape(-1, 2, max_len)
  joined = b"".join(_parse_value(r) for r in records)
  return np.frombuffer(joined, np.int32).reshape(-1, 2, max_len)


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
