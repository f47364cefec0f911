"""The entry points as processes forked from one that has imported them.

Each test process (a pytest-xdist worker) keeps one server process that
has imported JAX, Flax, optax, orbax, TFDS and ``mha`` once, without starting
a JAX backend. A test that would run ``python train.py ...`` as a subprocess
asks the server instead: it forks, and the child runs the script as
``__main__`` (``runpy``) with the test's arguments, environment, working
folder and standard streams, exits with the script's exit code, and the test
gets a ``subprocess.CompletedProcess`` as from ``subprocess.run``. The child
is a process of its own (its own pid, memory, exit code, signals); what it
skips is about 1.5 s of CPU spent importing (docs/performance.md, "The test
suite": about 70 such subprocesses in a run).

Used only where that changes nothing the test can see: the script is a
Python file run as ``python FILE ARGS``, and the environment differs from the
server's in no variable that a module reads when it is imported (``JAX_*``,
``XLA_*``, ``TF_*``, ``TFDS_*``, ``PYTHON*``, ``CUDA_*``, ``OMP_*``...).
Anything else (``python -c``, ``-X importtime``, a changed ``XLA_FLAGS``,
another program) runs as a real subprocess, and so do the tests that check
a fresh process's start-up itself (``tests/test_startup.py``).

The protocol (JSON lines): the test process writes ``{"id", "argv", "env",
"cwd", "stdin", "stdout", "stderr"}`` (the last three: paths of files) on the
server's standard input; the server answers ``{"id", "pid"}`` once it has
forked and ``{"id", "status", "cpu_s"}`` once the child has exited
(``os.wait4``: its exit status and CPU seconds, its own waited-for children
included).
"""

from __future__ import annotations

import gc
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

# Modules a child would import anyway: imported once, by the server.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.linen", "optax",
           "orbax.checkpoint", "tensorflow_datasets", "ml_collections",
           "absl.app", "absl.flags", "mha", "mha.train", "mha.cli",
           "mha.pruning")

# Environment variables read when a module is imported (or a backend
# starts): a request whose environment differs from the server's in one of
# these runs as a real subprocess instead.
_IMPORT_TIME_PREFIXES = ("JAX_", "XLA_", "TF_", "TFDS_", "PYTHON", "CUDA_",
                         "OMP_", "OPENBLAS_", "MKL_", "LD_", "ABSL_", "GRPC_",
                         "NVIDIA_", "TPU_", "LIBTPU")


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
  return {k: v for k, v in env.items()
          if k.startswith(_IMPORT_TIME_PREFIXES)}


class _Lines:
  """JSON lines read from a file descriptor, unbuffered, so that ``select``
  on the descriptor tells whether a line may come (a buffered file object
  may hold a second line that ``select`` cannot see)."""

  def __init__(self, fd: int):
    self.fd, self._pending = fd, b""

  def next(self, timeout: float | None) -> dict[str, Any] | None:
    """The next line; None if none came within ``timeout``; EOFError at
    the end."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in self._pending:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      ready, _, _ = select.select([self.fd], [], [], left)
      if not ready:
        return None
      chunk = os.read(self.fd, 65536)
      if not chunk:
        raise EOFError
      self._pending += chunk
    line, self._pending = self._pending.split(b"\n", 1)
    return json.loads(line)

  def has_line(self) -> bool:
    return b"\n" in self._pending


def _write_line(fd: int, fields: Mapping[str, Any]) -> None:
  data = (json.dumps(fields) + "\n").encode()
  while data:
    data = data[os.write(fd, data):]


# --------------------------------------------------------------------------
# The server (``python tests/preloaded.py ROOT``).
# --------------------------------------------------------------------------


def _child(request: dict[str, Any]) -> int:
  """Runs the request's script in this (forked) process; its exit code."""
  import runpy  # pylint: disable=import-outside-toplevel
  for fd, path, flags in ((0, request["stdin"], os.O_RDONLY),
                          (1, request["stdout"], os.O_WRONLY),
                          (2, request["stderr"], os.O_WRONLY)):
    new = os.open(path, flags)
    os.dup2(new, fd)
    os.close(new)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  script = request["argv"][0]
  sys.argv = list(request["argv"])
  sys.path[0] = os.path.dirname(os.path.abspath(script))
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    if e.code is None:
      return 0
    if isinstance(e.code, int):
      return e.code
    print(e.code, file=sys.stderr)
    return 1
  return 0


def _serve(root: str) -> None:
  """Imports ``PRELOAD``, then forks a child per request until stdin ends."""
  import importlib  # pylint: disable=import-outside-toplevel
  requests, answers = _Lines(os.dup(0)), os.dup(1)
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(2, 1)  # Stray prints of the server go to its stderr.
  os.close(null)
  sys.path[0] = root
  for name in PRELOAD:
    importlib.import_module(name)
  # What was imported is never collected: kept out of the collector's
  # sweeps, whose reference-count writes would make each child copy the
  # pages they touch.
  gc.collect()
  gc.freeze()
  sys.stdout.flush()
  sys.stderr.flush()

  wake_read, wake_write = os.pipe()
  os.set_blocking(wake_write, False)
  signal.set_wakeup_fd(wake_write)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  running: dict[int, str] = {}

  def reap() -> None:
    while running:
      pid, status, usage = os.wait4(-1, os.WNOHANG)
      if pid == 0:
        return
      _write_line(answers, {"id": running.pop(pid),
                            "status": os.waitstatus_to_exitcode(status),
                            "cpu_s": usage.ru_utime + usage.ru_stime})

  open_ = True
  while open_ or running:
    watched = [requests.fd, wake_read] if open_ else [wake_read]
    ready = [requests.fd] if requests.has_line() else select.select(
        watched, [], [], 1.0)[0]
    if wake_read in ready:
      os.read(wake_read, 4096)
    reap()
    if requests.fd not in ready:
      continue
    try:
      request = requests.next(None)
    except EOFError:
      open_ = False
      continue
    pid = os.fork()
    if pid == 0:
      signal.set_wakeup_fd(-1)
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      for fd in (requests.fd, answers, wake_read, wake_write):
        os.close(fd)
      code = 1
      try:
        code = _child(request)
      except BaseException:  # pylint: disable=broad-except
        import traceback  # pylint: disable=import-outside-toplevel
        traceback.print_exc()
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
      # A normal interpreter exit (atexit handlers, threads joined), as the
      # script's own process would have; never back into this loop.
      raise SystemExit(code)
    running[pid] = request["id"]
    _write_line(answers, {"id": request["id"], "pid": pid})


# --------------------------------------------------------------------------
# The client (a test process).
# --------------------------------------------------------------------------


class Server:
  """A preloaded server and the processes it forks for this test process."""

  def __init__(self, root: str, env: Mapping[str, str]):
    self._env = dict(env)
    self._folder = tempfile.mkdtemp(prefix="preloaded-")
    self._process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), root],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env,
        cwd=root)
    self._answers = _Lines(self._process.stdout.fileno())
    self._next = 0
    self._pids: dict[str, int] = {}
    self._done: dict[str, dict[str, Any]] = {}
    self.cpu_s = 0.0  # The finished children's, for --cpu-report.

  def serves(self, args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether ``args`` with ``env`` may run here (see the module doc)."""
    return (self._process.poll() is None and len(args) >= 2
            and args[0] == sys.executable and args[1].endswith(".py")
            and not args[1].startswith("-")
            and _import_time_env(env) == _import_time_env(self._env))

  def _read_answer(self, timeout: float | None) -> dict[str, Any] | None:
    try:
      answer = self._answers.next(timeout)
    except EOFError:
      raise RuntimeError("the preloaded server exited") from None
    if answer is None:
      return None
    if "status" in answer:
      self.cpu_s += answer["cpu_s"]
      self._done[answer["id"]] = answer
    else:
      self._pids[answer["id"]] = answer["pid"]
    return answer

  def start(self, args: Sequence[str], *, env: Mapping[str, str],
            cwd: str | os.PathLike | None = None,
            input: str | None = None) -> "Child":  # pylint: disable=redefined-builtin
    """Forks a child running ``args``; ``Child.wait`` collects it."""
    self._next += 1
    key = str(self._next)
    paths = {name: os.path.join(self._folder, f"{key}.{name}")
             for name in ("stdin", "stdout", "stderr")}
    with open(paths["stdin"], "w", encoding="utf-8") as f:
      f.write(input or "")
    for name in ("stdout", "stderr"):
      open(paths[name], "wb").close()
    request = {"id": key, "argv": list(map(str, args[1:])), "env": dict(env),
               "cwd": os.path.abspath(cwd or os.getcwd()), **paths}
    _write_line(self._process.stdin.fileno(), request)
    while key not in self._pids:
      self._read_answer(None)
    return Child(self, key, list(map(str, args)), paths)

  def close(self) -> None:
    """Ends the server once its children have exited."""
    if self._process.poll() is None:
      self._process.stdin.close()
      try:
        self._process.wait(timeout=60)
      except subprocess.TimeoutExpired:  # A child left running by a test.
        self._process.kill()
        self._process.wait()
    for name in os.listdir(self._folder):
      os.unlink(os.path.join(self._folder, name))
    os.rmdir(self._folder)


class Child:
  """One forked child, like a ``subprocess.Popen`` with captured output."""

  def __init__(self, server: Server, key: str, args: list[str],
               paths: dict[str, str]):
    self._server, self._key, self.args, self._paths = server, key, args, paths
    self.pid = server._pids[key]  # pylint: disable=protected-access

  def kill(self) -> None:
    try:
      os.kill(self.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass

  def wait(self, timeout: float | None = None
           ) -> subprocess.CompletedProcess:
    """The child's exit code and output, once it has exited; on
    ``timeout``, it is killed and ``subprocess.TimeoutExpired`` raised."""
    server = self._server
    deadline = None if timeout is None else time.monotonic() + timeout
    while self._key not in server._done:  # pylint: disable=protected-access
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        self.kill()
        while self._key not in server._done:  # pylint: disable=protected-access
          server._read_answer(None)  # pylint: disable=protected-access
        raise subprocess.TimeoutExpired(self.args, timeout)
      server._read_answer(left)  # pylint: disable=protected-access
    status = server._done.pop(self._key)["status"]  # pylint: disable=protected-access
    encoding = locale.getpreferredencoding(False)
    out = {}
    for name in ("stdout", "stderr"):
      with open(self._paths[name], encoding=encoding) as f:
        out[name] = f.read()
    for path in self._paths.values():
      os.unlink(path)
    return subprocess.CompletedProcess(self.args, status, out["stdout"],
                                       out["stderr"])


if __name__ == "__main__":
  _serve(sys.argv[1])
