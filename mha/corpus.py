"""The character LM's corpus: the Python standard library's own source.

The ``.py`` files under the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), read as bytes; nothing is downloaded.
Left out: ``site-packages`` (what is installed, not the library) and the test
folders (``test``, ``tests``, ``idle_test``: two thirds of the bytes, much of
them generated tables and deliberately malformed files). On CPython 3.11.7
that leaves 734 files and 12.1 MB, 99.98% of the bytes ASCII, so bits per
byte are bits per character up to those 2,185 bytes.

Each file goes to train, validation or test by a hash of its path relative to
the root (90/5/5, :func:`split_of`), so the split of a file does not depend on
which other files exist. A split's stream is its files' bytes, one after the
other in the order of their paths; :func:`windows` cuts a stream into
fixed-length windows. :func:`corpus_hash` names the contents, so a run can
tell that the corpus under it changed (another Python, an edited file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig

import numpy as np

SPLITS: tuple[str, ...] = ("train", "validation", "test")
#: Per cent of the files (by path hash) in train and validation; test is the
#: rest.
SPLIT_PERCENT: tuple[int, int] = (90, 5)
#: Folders never entered: installed packages and the library's own tests.
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test",
     "__pycache__"})


def stdlib_dir() -> str:
  """The running interpreter's standard library folder."""
  return sysconfig.get_paths()["stdlib"]


def python_version() -> str:
  """The running interpreter's version, e.g. ``3.11.7``."""
  return platform.python_version()


def source_files(root: str) -> list[str]:
  """The ``.py`` files under ``root`` outside :data:`EXCLUDED_DIRS`, as
  sorted ``/``-separated paths relative to ``root`` (symlinked folders are
  not followed)."""
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
    rel = os.path.relpath(folder, root)
    for name in files:
      if name.endswith(".py"):
        path = name if rel == "." else os.path.join(rel, name)
        found.append(path.replace(os.sep, "/"))
  return sorted(found)


def split_of(path: str) -> str:
  """The split of the file at ``path`` (relative, ``/``-separated): the first
  8 bytes of its SHA-256 modulo 100, below 90 train, below 95 validation,
  else test."""
  bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8],
                          "big") % 100
  train, validation = SPLIT_PERCENT
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
                      " bytes" for s in SPLITS)
    return (f"{self.root} (Python {self.python_version}): {parts}; "
            f"corpus hash {self.hash[:16]}")


def _resolve(root: str | None) -> str:
  return os.path.abspath(os.path.expanduser(root or stdlib_dir()))


def _read(root: str) -> tuple[list[str], list[bytes], str]:
  """The files under ``root``, their bytes and the corpus hash.

  Raises:
    ValueError: no file (one line), or a file holding a NUL byte (token 0
      is padding; Python refuses such source too).
  """
  if not os.path.isdir(root):
    raise ValueError(f"the pylm corpus folder {root} is not a folder")
  paths = source_files(root)
  if not paths:
    raise ValueError(f"the pylm corpus is empty: no .py files under {root} "
                     f"(outside {', '.join(sorted(EXCLUDED_DIRS))})")
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
  return _read(_resolve(root))[2]


def load(root: str | None = None) -> Corpus:
  """Reads the corpus under ``root`` (default: the standard library) into
  its three split streams. Raises ``ValueError`` (one line) for an empty
  corpus."""
  root = _resolve(root)
  paths, contents, digest = _read(root)
  files = {split: [] for split in SPLITS}
  streams = {split: [] for split in SPLITS}
  for path, content in zip(paths, contents):
    files[split_of(path)].append(path)
    streams[split_of(path)].append(content)
  return Corpus(root=root, python_version=python_version(), hash=digest,
                files={s: tuple(files[s]) for s in SPLITS},
                streams={s: b"".join(streams[s]) for s in SPLITS})


def windows(stream: bytes, context_length: int) -> np.ndarray:
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
