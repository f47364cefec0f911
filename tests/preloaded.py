"""The entry points as processes forked from one that has imported them.

Each test process (a pytest-xdist worker) keeps one server process that
has imported JAX, Flax, optax, orbax, TFDS and ``mha`` once, without starting
a JAX backend. A test that would run ``python train.py ...`` as a subprocess
asks the server instead: it forks, and the child runs the script as
``__main__`` with the test's arguments, environment, working folder, standard
streams, umask, resource limits and ignored signals, exits with the script's
exit code, and the test gets a ``subprocess.CompletedProcess`` as from
``subprocess.run``. The child is a process of its own (its own pid, memory,
exit code, signals); what it skips is about 1.5 s of CPU spent importing
(docs/performance.md, "The test suite").

Used only where that changes nothing the test can see: the script is an
existing Python file run as ``python FILE ARGS`` in an existing folder, and
the environment is the server's but for a few variables no test-visible
behaviour of an import depends on (``HOME``, ``TMPDIR``,
``MHA_TEST_KILL_AT``, ``MHA_TEST_SIGNAL_AT``,
``JAX_COORDINATOR_BIND_ADDRESS``; matplotlib's font cache
follows the server's ``HOME``). Anything else (``python -c``, ``-X
importtime``, a changed ``XLA_FLAGS`` or any other variable, another
program) runs as a real subprocess, and so do the tests that check a fresh
process's start-up itself (``tests/test_startup.py``).

What still differs from a fresh process, none of which a test here reads:
``os.getppid()`` (the server), ``sys.orig_argv``, the string hash seed (one
per server), and modules imported before the script ran (the server's).
The random states of NumPy and ``random`` are drawn afresh in each child.

The protocol (JSON lines): the test process writes ``{"id", "argv", "env",
"cwd", "stdin", "stdout", "stderr", "umask", "limits", "ignored"}`` (the
streams: paths of files) or ``{"kill": id}`` on the server's standard input;
the server answers ``{"id", "pid"}`` once it has forked and ``{"id",
"status", "cpu_s"}`` once the child has exited (``os.wait4``: its exit status
and CPU seconds, its own waited-for children included). Only the server
reaps and kills its children, so a kill never reaches a reused pid.
"""

from __future__ import annotations

import gc
import json
import locale
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

# Modules a child would import anyway: imported once, by the server. The
# head study's (its modules, SciPy's statistics, matplotlib through its
# report) cost each study run 1.2-1.3 s of CPU to import after the rest
# (measured 2026-11-29, AMD EPYC, 2 cores); a train.py child never imports
# them, and holds them unused.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.linen", "optax",
           "orbax.checkpoint", "tensorflow_datasets", "ml_collections",
           "absl.app", "absl.flags", "mha", "mha.train", "mha.run.cli",
           "mha.pruning", "scipy.stats", "mha.head_roles",
           "mha.pruning.study.experiment", "mha.pruning.study.report",
           "mha.pruning.study.extensions",
           "mha.pruning.study.kv_group_study",
           "mha.pruning.study.over_training")

# The only variables in which a served request's environment may differ from
# the server's: none of the preloaded modules reads them when imported, but
# matplotlib, which finds its configuration folder (its font cache) through
# HOME: a child in another HOME uses the server's, which no test reads.
# MHA_TEST_KILL_AT (mha.run.kill_points) and MHA_TEST_SIGNAL_AT
# (mha.run.interrupt) are read at their points, never on import;
# JAX_COORDINATOR_BIND_ADDRESS when ``jax.distributed.initialize`` runs.
_HARMLESS_ENV = frozenset({"HOME", "TMPDIR", "PWD", "OLDPWD",
                           "MHA_TEST_KILL_AT", "MHA_TEST_SIGNAL_AT",
                           "JAX_COORDINATOR_BIND_ADDRESS"})

# Signals whose ignored disposition (SIG_IGN) a child inherits, as through
# exec; handlers do not survive exec, so the rest start at their defaults.
_INHERITED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1",
                      "SIGUSR2", "SIGALRM")
_LIMITS = tuple(name for name in dir(resource) if name.startswith("RLIMIT_"))


def _comparable_env(env: Mapping[str, str]) -> dict[str, str]:
  return {k: v for k, v in env.items() if k not in _HARMLESS_ENV}


def _process_state() -> dict[str, Any]:
  """What a subprocess inherits from this process beside its environment:
  the umask, the resource limits and the ignored signals."""
  umask = os.umask(0)
  os.umask(umask)
  return {"umask": umask,
          "limits": {name: resource.getrlimit(getattr(resource, name))
                     for name in _LIMITS},
          "ignored": [name for name in _INHERITED_SIGNALS
                      if signal.getsignal(getattr(signal, name))
                      is signal.SIG_IGN]}


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
  import builtins  # pylint: disable=import-outside-toplevel
  import random  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  for fd, path, flags in ((0, request["stdin"], os.O_RDONLY),
                          (1, request["stdout"], os.O_WRONLY),
                          (2, request["stderr"], os.O_WRONLY)):
    new = os.open(path, flags)
    os.dup2(new, fd)
    os.close(new)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  os.umask(request["umask"])
  for name, (soft, hard) in request["limits"].items():
    try:
      resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError):
      pass  # One this process may not set: as it was.
  for name in _INHERITED_SIGNALS:
    default = (signal.default_int_handler if name == "SIGINT"
               else signal.SIG_DFL)
    signal.signal(getattr(signal, name),
                  signal.SIG_IGN if name in request["ignored"] else default)
  np.random.seed()  # A fresh process's states: drawn from the OS.
  random.seed()
  script = request["argv"][0]
  path = os.path.abspath(script)
  sys.argv = list(request["argv"])
  sys.path[0] = os.path.dirname(os.path.realpath(script))
  with open(path, "rb") as f:
    code = compile(f.read(), path, "exec", dont_inherit=True)
  # The script's module stays ``__main__`` until the process exits (runpy
  # would put the server's back once the module's code returned).
  main = types.ModuleType("__main__")
  main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None,
                       __spec__=None, __loader__=None, __package__=None)
  sys.modules["__main__"] = main
  try:
    exec(code, main.__dict__)  # pylint: disable=exec-used
  except SystemExit as e:
    if e.code is None:
      return 0
    if isinstance(e.code, int):
      return e.code
    print(e.code, file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    # As Python does: killed by SIGINT itself, so the status reads -2.
    _flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    return 130  # Not reached.
  except BaseException as e:  # pylint: disable=broad-except
    # Through sys.excepthook (a script may set its own), from the script's
    # frames on, as an uncaught exception of the script's process.
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
      tb = tb.tb_next
    sys.excepthook(type(e), e, tb or e.__traceback__)
    return 1
  return 0


def _flush() -> None:
  """Flushes the standard streams a script may have closed or replaced."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass


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

  # Ctrl-C in the terminal reaches the test processes; the server ends with
  # its standard input instead (each child sets its own SIGINT).
  signal.signal(signal.SIGINT, signal.SIG_IGN)
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
      # No test will wait for a child left running now: end them.
      for pid in running:
        os.kill(pid, signal.SIGKILL)
      continue
    if "kill" in request:  # Only a child not reaped yet: never a reused pid.
      for pid, key in running.items():
        if key == request["kill"]:
          os.kill(pid, signal.SIGKILL)
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
        traceback.print_exc()  # The harness's own failure, not the script's.
      finally:
        _flush()
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
    self._log = os.path.join(self._folder, "server.log")
    with open(self._log, "wb") as log:
      self._process = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), root],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
          env=self._env, cwd=root)
    self._answers = _Lines(self._process.stdout.fileno())
    self._next = 0
    self._pids: dict[str, int] = {}
    self._done: dict[str, dict[str, Any]] = {}
    self.cpu_s = 0.0  # The finished children's, for --cpu-report.

  def serves(self, args: Sequence[str | os.PathLike],
             env: Mapping[str, str],
             cwd: str | os.PathLike | None = None) -> bool:
    """Whether ``args`` with ``env`` in ``cwd`` may run here (see the module
    doc)."""
    args = [os.fspath(a) for a in args]
    if (self._process.poll() is not None or len(args) < 2
        or args[0] != sys.executable or not args[1].endswith(".py")
        or args[1].startswith("-")):
      return False
    folder = os.fspath(cwd) if cwd is not None else os.getcwd()
    return (os.path.isdir(folder)
            and os.path.isfile(os.path.join(folder, args[1]))
            and _comparable_env(env) == _comparable_env(self._env))

  def _read_answer(self, timeout: float | None) -> dict[str, Any] | None:
    try:
      answer = self._answers.next(timeout)
    except EOFError:
      with open(self._log, encoding="utf-8", errors="replace") as f:
        tail = f.read()[-2000:]
      raise RuntimeError(f"the preloaded server exited; its stderr ends:\n"
                         f"{tail}") from None
    if answer is None:
      return None
    if "status" in answer:
      self.cpu_s += answer["cpu_s"]
      self._done[answer["id"]] = answer
    else:
      self._pids[answer["id"]] = answer["pid"]
    return answer

  def _send(self, request: Mapping[str, Any]) -> None:
    _write_line(self._process.stdin.fileno(), request)

  def start(self, args: Sequence[str | os.PathLike], *,
            env: Mapping[str, str], cwd: str | os.PathLike | None = None,
            input: str | None = None) -> "Child":  # pylint: disable=redefined-builtin
    """Forks a child running ``args``; ``Child.wait`` collects it."""
    args = [os.fspath(a) for a in args]
    self._next += 1
    key = str(self._next)
    paths = {name: os.path.join(self._folder, f"{key}.{name}")
             for name in ("stdin", "stdout", "stderr")}
    with open(paths["stdin"], "w", encoding="utf-8") as f:
      f.write(input or "")
    for name in ("stdout", "stderr"):
      open(paths[name], "wb").close()
    self._send({"id": key, "argv": args[1:], "env": dict(env),
                "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None
                                       else os.getcwd()),
                **paths, **_process_state()})
    while key not in self._pids:
      self._read_answer(None)
    return Child(self, key, args, paths)

  def close(self) -> None:
    """Ends the server: it kills the children no test waited for (a test
    that failed between ``start`` and ``wait``), reaps them and exits."""
    if self._process.poll() is None:
      self._process.stdin.close()
      try:
        self._process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
    self._process.stdout.close()
    for name in os.listdir(self._folder):
      os.unlink(os.path.join(self._folder, name))
    os.rmdir(self._folder)


class Child:
  """One forked child, like a ``subprocess.Popen`` with captured output."""

  def __init__(self, server: Server, key: str, args: list[str],
               paths: dict[str, str]):
    self._server, self._key, self.args, self._paths = server, key, args, paths
    self.pid = server._pids[key]  # pylint: disable=protected-access
    self._result: subprocess.CompletedProcess | None = None

  def kill(self) -> None:
    """SIGKILL, unless the child has exited (then nothing, as Popen)."""
    server = self._server
    if self._result is None and self._key not in server._done:  # pylint: disable=protected-access
      server._send({"kill": self._key})  # pylint: disable=protected-access

  def wait(self, timeout: float | None = None
           ) -> subprocess.CompletedProcess:
    """The child's exit code and output, once it has exited; on
    ``timeout``, it is killed and ``subprocess.TimeoutExpired`` raised."""
    if self._result is not None:
      return self._result
    server = self._server
    deadline = None if timeout is None else time.monotonic() + timeout
    while self._key not in server._done:  # pylint: disable=protected-access
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        self.kill()
        while self._key not in server._done:  # pylint: disable=protected-access
          server._read_answer(None)  # pylint: disable=protected-access
        self._collect()
        raise subprocess.TimeoutExpired(self.args, timeout)
      server._read_answer(left)  # pylint: disable=protected-access
    return self._collect()

  def _collect(self) -> subprocess.CompletedProcess:
    status = self._server._done.pop(self._key)["status"]  # pylint: disable=protected-access
    encoding = locale.getpreferredencoding(False)
    out = {}
    for name in ("stdout", "stderr"):
      with open(self._paths[name], encoding=encoding) as f:
        out[name] = f.read()
    for path in self._paths.values():
      os.unlink(path)
    self._result = subprocess.CompletedProcess(self.args, status,
                                               out["stdout"], out["stderr"])
    return self._result


if __name__ == "__main__":
  _serve(sys.argv[1])
