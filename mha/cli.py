"""What the command lines share: a user's mistake is one line and exit code 2.

``train.py``, ``eval.py`` and the scripts report every mistake in their flags,
config or workdir the same way, on stderr, without a traceback or the usage
text, before anything is written:

    prune_heads.py: error: --prune_fraction must be in [0, 1], got 1.5

The helpers here do only that; what counts as a mistake is checked where the
fact lives (``mha.config_validation`` for run configs, the scripts for their
own flags).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn, Sequence

from absl import flags


class UsageError(Exception):
  """A mistake in a command line; :func:`fail` reports it."""


def one_line(error: BaseException | str) -> str:
  """An error's message on one line: a ``KeyError``'s without its quotes, of
  a traceback quoted inside (config_flags quotes one) only its last line."""
  while isinstance(error, (KeyError, AttributeError)) and error.args:
    error = error.args[0]  # ml_collections wraps a KeyError in both.
  text = str(error)
  head, traceback_marker, _ = text.partition("Traceback (most recent call last)")
  if traceback_marker:
    text = head + text.strip().splitlines()[-1]
  text = " ".join(text.split())
  if not text and isinstance(error, BaseException):
    text = type(error).__name__
  return text


def fail(prog: str, error: BaseException | str) -> NoReturn:
  """Reports a user's mistake as ``prog: error: ...`` on stderr; exits 2."""
  print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
  sys.exit(2)


def parse_flags(argv: list[str], prog: str) -> list[str]:
  """absl's flag parsing for ``app.run(main, flags_parser=...)``: a mistake
  in the flags, or an argument no flag takes, is one line on stderr and exit
  code 2 (not a traceback or the usage text)."""
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    fail(prog, e)
  if len(rest) > 1:
    fail(prog, f"unexpected arguments: {' '.join(rest[1:])}")
  return rest


def flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
  """:func:`parse_flags` for ``prog``, as ``app.run``'s ``flags_parser``."""
  return lambda argv: parse_flags(argv, prog)


def numbers(name: str, values: Sequence[str], kind: type) -> tuple:
  """The values of the list flag ``--name`` as ``kind`` (int or float).

  Raises:
    UsageError: a value that is not a ``kind``.
  """
  try:
    return tuple(kind(v) for v in values)
  except ValueError:
    what = "integers" if kind is int else "numbers"
    raise UsageError(f"--{name} must be {what}, got {','.join(values)}"
                     ) from None


def existing_dir(prog: str, path: str, what: str = "workdir") -> str:
  """``path`` expanded and made absolute; fails (exit 2) unless it is an
  existing directory."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    fail(prog, f"{what} {path} " + (
        "is a file, not a directory" if os.path.exists(path)
        else "does not exist"))
  return path
