"""What the command lines share: a user's mistake is one line and exit code 2.

``train.py``, ``eval.py`` and the scripts report every mistake in their flags,
config or workdir the same way, on stderr, without a traceback or the usage
text, before anything is written:

    prune_heads.py: error: --prune_fraction must be in [0, 1], got 1.5

The helpers here do only that; what counts as a mistake is checked where the
fact lives (``mha.run.config_validation`` for run configs, the scripts for their
own flags).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback
from typing import Any, Callable, NoReturn, Sequence

from absl import flags
from absl import logging as absl_logging

from mha.run import write_failures


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


# The shell status of a process that SIGPIPE ended (``cat`` into a closed
# pipe): 128 plus the signal's number.
BROKEN_PIPE_STATUS = 128 + getattr(signal, "SIGPIPE", 13)


class _EndOnBrokenPipe:
  """A standard text stream whose write into a closed pipe ends the process
  with :data:`BROKEN_PIPE_STATUS`, quietly; everything else is the wrapped
  stream's. A text stream into a pipe is block-buffered: the write that
  finds the pipe closed is the next flush (``print(..., flush=True)``, a
  full buffer, the process's end)."""

  def __init__(self, stream: Any) -> None:
    self._stream = stream

  def _end(self) -> NoReturn:
    # What is still buffered can never be read: nothing to flush, nothing to
    # report. os._exit, not sys.exit: from any thread, through any ``except``.
    os._exit(BROKEN_PIPE_STATUS)  # pylint: disable=protected-access

  def write(self, text: str) -> int:
    try:
      return self._stream.write(text)
    except BrokenPipeError:
      self._end()

  def writelines(self, lines: Any) -> None:
    for line in lines:
      self.write(line)

  def flush(self) -> None:
    try:
      self._stream.flush()
    except BrokenPipeError:
      self._end()

  def __getattr__(self, name: str) -> Any:
    if name == "_stream":  # Not set yet (a copy, an unpickled one).
      raise AttributeError(name)
    return getattr(self._stream, name)


def end_quietly_on_broken_pipe() -> None:
  """An entry point's output piped to a reader that stops early
  (``python train.py | head``) ends the process quietly, as it ends ``cat``
  or ``grep`` (shell status 141), where Python's ``BrokenPipeError`` surfaced
  as a traceback from the next ``print``.

  ``sys.stdout`` and ``sys.stderr`` are wrapped so that a write of theirs
  that finds the pipe closed ends the process, and the logging handlers
  that held either (absl's among them) write through the wrappers. Only
  text written through ``sys.stdout`` and ``sys.stderr`` is covered, not
  ``sys.stdout.buffer`` or ``os.write(1, ...)`` (nothing here writes so).
  An uncaught exception's traceback is lost when stdout still holds
  unwritten text for a closed pipe (Python flushes stdout first), as it was
  under SIGPIPE's default action. SIGPIPE itself stays ignored,
  as Python sets it: its default action would also end the process on any
  other closed pipe or socket, and asyncio (orbax saves through it) writes
  to its own wake-up socket while another thread may have closed it (a
  training run ended so, at random, before this was changed).

  For the ``__main__`` blocks of the entry points only, never on import: in a
  notebook it would end the kernel. Ending there is what ``kill -9`` does,
  which a training run survives (``tests/test_reliability.py``): rerun, it
  resumes from its last checkpoint.
  """
  wrapped = {}
  for name in ("stdout", "stderr"):
    stream = getattr(sys, name)
    if stream is not None and not isinstance(stream, _EndOnBrokenPipe):
      wrapped[id(stream)] = _EndOnBrokenPipe(stream)
      setattr(sys, name, wrapped[id(stream)])
  # Handlers made on import hold the streams themselves: absl's, for one,
  # which also compares its stream with ``sys.stderr`` and, told apart,
  # would print some records twice.
  handlers = list(logging.getLogger().handlers)
  handlers.append(absl_logging.get_absl_handler().python_handler)
  for handler in handlers:
    if (isinstance(handler, logging.StreamHandler)
        and id(handler.stream) in wrapped):
      handler.setStream(wrapped[id(handler.stream)])


def parse_flags(argv: list[str], prog: str) -> list[str]:
  """absl's flag parsing for ``app.run(main, flags_parser=...)``: a mistake
  in the flags, or an argument no flag takes, is one line on stderr and exit
  code 2 (not a traceback or the usage text)."""
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    message = one_line(e)
    if "--config.model.num_heads=[" in message:  # A flag takes one count.
      message += ("; a count per layer goes in the config argument: "
                  "--config configs/default.py:model.num_heads=[4,2],"
                  "model.head_dim=8")
    fail(prog, message)
  if len(rest) > 1:
    fail(prog, f"unexpected arguments: {' '.join(rest[1:])}")
  return rest


def unknown_config_override(error: BaseException,
                            flag: str = "config") -> str | None:
  """The line for ``error`` if it is ml_collections' ``config_flags`` not
  finding the field a ``--config.*`` override names, else None.

  ``config_flags`` resolves each override's path when the config is loaded,
  at its definition (the default config) or while the flags are parsed (a
  ``--config`` given), and raises a ``KeyError`` or an ``AttributeError``
  wrapping one, of the bare field name, from its ``config_path`` module.
  An error of the same kinds raised by a config file itself is not one.
  """
  if not isinstance(error, (AttributeError, KeyError)):
    return None
  if not any(os.path.basename(frame.filename) == "config_path.py"
             and "ml_collections" in frame.filename
             for frame in traceback.extract_tb(error.__traceback__)):
    return None
  return f"unknown config key in the --{flag}.* flags: {one_line(error)}"


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


def checked_config(prog: str, arg: str | None, flag: str = "config") -> Any:
  """``configs/default.py``'s ``get_config(arg)``, validated
  (:func:`mha.run.config_validation.config_problems`); a mistake is one line
  naming ``--flag`` and exit code 2 (:func:`fail`)."""
  # pylint: disable=import-outside-toplevel
  from configs import default
  from mha.run import config_validation
  # pylint: enable=import-outside-toplevel
  if arg and ".py" in arg:
    fail(prog, f"--{flag}={arg}: give get_config's argument (the part after "
               f"the colon, e.g. {arg.rpartition(':')[2] or 'tiny'!r}), not "
               "a config file")
  try:
    config = default.get_config(arg or None)
  except Exception as e:  # pylint: disable=broad-except  (a config can raise anything)
    fail(prog, f"--{flag}={arg}: {one_line(e)}")
  problems = config_validation.config_problems(config)
  if problems:
    fail(prog, f"--{flag}={arg}: {problems[0]}")
  return config


def nonempty_path(prog: str, path: str | None, flag: str = "workdir") -> str:
  """``path``, the value of ``--flag``; fails (exit 2) if it is empty: an
  empty path would be the current directory."""
  if not path:
    fail(prog, f'--{flag} is empty; name a folder ("." for the current one)')
  return path


def data_dir(prog: str, path: str | None) -> str | None:
  """``--data_dir``'s ``path`` expanded, or None where not given; fails (exit
  2) if it is empty or a file (TFDS would prepare nothing there)."""
  if path is None:
    return None
  path = os.path.expanduser(nonempty_path(prog, path, "data_dir"))
  if os.path.exists(path) and not os.path.isdir(path):
    fail(prog, f"--data_dir {path} is a file, not a folder")
  return path


def existing_dir(prog: str, path: str, what: str = "workdir") -> str:
  """``path`` expanded and made absolute; fails (exit 2) unless it is an
  existing directory (an empty ``path`` included: ``--<what>`` is empty)."""
  nonempty_path(prog, path, what)
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    fail(prog, f"{what} {path} " + (
        "is a file, not a directory" if os.path.exists(path)
        else "does not exist"))
  return path


def writable_dir(prog: str, path: str) -> str:
  """``path``, once known to be a folder this process can write in; fails
  (exit 2, one line) otherwise, leaving nothing behind.

  Checked for real, before the work whose results go there: the folder is
  made if missing (its parents must exist) and a small file written in it
  and removed; a folder made here is removed again if that fails, and kept
  otherwise (the work writes there next; removing it could race another
  process checking the same folder). (A read-only file system, a lost
  permission or a file in the way; a permission check alone would pass as
  root.)
  """
  made = False
  try:
    if not os.path.isdir(path):
      os.mkdir(path)
      made = True
    try:
      fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
    except OSError as e:  # Named by the folder, not the probe's random name.
      raise OSError(e.errno, e.strerror, path) from None
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    if made:
      try:
        os.rmdir(path)
      except OSError:
        pass
    fail(prog, f"cannot write to {path}: {write_failures.os_error_reason(e)}"
         "; choose a folder this process can write")
  return path


def output_path(out: str, example: str = "results.json") -> str:
  """``out`` (a script's ``--out``) expanded and made absolute, checked
  before any work.

  Raises:
    ValueError: ``out`` is empty or a directory, ends in ``.md`` or ``.png``
      (the table and plot go beside the JSON, under the same name with
      those: one would replace the JSON), or its folder cannot be made or
      written (a file in the way, no permission).
  """
  if not out or not out.strip():
    raise ValueError(f"--out is empty; give a file path such as {example}")
  path = os.path.abspath(os.path.expanduser(out))
  if os.path.isdir(path):
    raise ValueError(f"--out {path} is a directory; give a file path such as "
                     f"{os.path.join(path, example)}")
  suffix = os.path.splitext(path)[1].lower()
  if suffix in (".md", ".png"):
    raise ValueError(f"--out {path} ends in {suffix}, the name of the table or "
                     "plot written beside the results: give a .json path")
  existing = os.path.dirname(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"--out {path}: {existing} is a file, not a folder")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"--out {path}: {existing} is not writable")
  return path


def checked_output_path(prog: str, out: str,
                        example: str = "results.json") -> str:
  """:func:`output_path`, a mistake in it one line and exit 2 (:func:`fail`)."""
  try:
    return output_path(out, example)
  except ValueError as e:
    fail(prog, e)


def checked_workdirs_and_out(prog: str, workdirs: Sequence[str] | None,
                             out: str, example: str = "results.json",
                             *, load: bool = False) -> str:
  """The checks of a script over trained runs, before any work: at least
  one workdir, each holding checkpoints (with ``load``, one that loads: not
  every one damaged), and ``out`` not a directory (``example``: the file
  name a message suggests). A mistake is one line and exit 2 (:func:`fail`).
  Returns ``out`` made absolute (:func:`output_path`)."""
  if not workdirs:
    fail(prog, "give at least one --workdir")
  for workdir in workdirs:
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints) or not any(
        name.isdigit() for name in os.listdir(checkpoints)):
      fail(prog, f"--workdir {workdir} holds no checkpoints")
  out = checked_output_path(prog, out, example)
  if load:
    # pylint: disable=import-outside-toplevel
    from mha import checkpoint
    from mha.run import config_validation
    # pylint: enable=import-outside-toplevel
    for workdir in workdirs:
      try:
        checkpoint.load_checkpoint(workdir)
      except (checkpoint.DamagedCheckpointError,
              config_validation.ConfigError) as e:
        fail(prog, f"--workdir {workdir}: {e}")
  return out
