"""The suite's preloaded entry points (tests/preloaded.py): a forked child
behaves, as far as a test can see, as ``subprocess.run`` of the same script
would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import conftest
import preloaded
from conftest import ROOT, run, start

SCRIPT = textwrap.dedent("""\
    import json, os, pickle, resource, signal, sys, threading
    mode = sys.argv[1]
    if mode == "pause":  # Until a signal ends it.
      signal.pause()
    elif mode == "interrupt":
      raise KeyboardInterrupt
    elif mode == "hook":
      sys.excepthook = lambda *a: print("HOOK", a[1], file=sys.stderr)
      raise ValueError("x")
    elif mode == "closed":
      sys.stdout.close()
    elif mode == "main":  # The script's module stays __main__.
      class A:
        pass
      t = threading.Thread(target=lambda: print(len(pickle.dumps(A())) > 0))
      t.start()
    else:
      umask = os.umask(0)
      print(json.dumps({
          "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
          "file": __file__, "home": os.environ.get("HOME"),
          "stdin": sys.stdin.read(), "main": __name__, "umask": umask,
          "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
          "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
          "pid": os.getpid()}))
      print("to stderr", file=sys.stderr)
      sys.exit(int(mode))
    """)


@pytest.fixture
def script(tmp_path):
  path = tmp_path / "bin" / "script.py"
  path.parent.mkdir()
  path.write_text(SCRIPT)
  return str(path)


def _served(args, env, cwd=None):
  server = conftest._SERVER  # pylint: disable=protected-access
  return server is not None and server.serves(args, env, cwd)


def test_a_child_runs_the_script_as_a_subprocess_would(script, tmp_path,
                                                       subprocess_env):
  env = dict(subprocess_env, HOME=str(tmp_path))
  args = [sys.executable, os.path.relpath(script, tmp_path), "3", "--b=c"]
  assert _served(args, env, tmp_path)
  # What a subprocess inherits besides its environment, changed here.
  umask = os.umask(0o027)
  sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    served = run(args, env=env, cwd=tmp_path, input="in")
    real = subprocess.run(args, env=env, cwd=tmp_path, input="in",
                          capture_output=True, text=True, check=False)
  finally:
    os.umask(umask)
    signal.signal(signal.SIGINT, sigint)
  assert served.returncode == real.returncode == 3
  assert served.stderr == real.stderr == "to stderr\n"
  seen, expected = json.loads(served.stdout), json.loads(real.stdout)
  assert seen.pop("pid") != os.getpid()
  expected.pop("pid")
  assert seen == expected
  assert seen["file"] == script and seen["umask"] == 0o027
  assert seen["sigint_ignored"] and seen["main"] == "__main__"


def test_exits_read_as_a_subprocesss(script, subprocess_env):
  for mode, code, err in [
      ("interrupt", -signal.SIGINT, None), ("hook", 1, "HOOK x\n"),
      ("closed", 0, ""), ("main", 0, "")]:
    args = [sys.executable, script, mode]
    served = run(args, env=subprocess_env)
    real = subprocess.run(args, env=subprocess_env, capture_output=True,
                          text=True, check=False)
    assert served.returncode == real.returncode == code, (mode, served)
    assert served.stdout == real.stdout
    if err is not None:
      assert served.stderr == real.stderr == err, mode


def test_a_killed_child_and_a_timeout_read_as_a_subprocesss(script,
                                                            subprocess_env):
  child = start([sys.executable, script, "pause"], env=subprocess_env)
  child.kill()
  result = child.wait()
  assert result.returncode == -signal.SIGKILL
  child.kill()  # Once it has exited: nothing, as Popen.kill.
  assert child.wait() is result
  with pytest.raises(subprocess.TimeoutExpired):
    run([sys.executable, script, "pause"], env=subprocess_env, timeout=0.1)


def test_closing_the_server_ends_the_children_no_test_waited_for(
    script, subprocess_env):
  server = preloaded.Server(ROOT, subprocess_env)
  child = server.start([sys.executable, script, "pause"], env=subprocess_env)
  server.close()
  with pytest.raises(ProcessLookupError):
    os.kill(child.pid, 0)  # Killed and reaped by the server.


def test_what_a_module_may_read_at_import_runs_as_a_real_subprocess(
    script, tmp_path, subprocess_env):
  for env in (dict(subprocess_env, XLA_FLAGS="--xla_dump_to=/nowhere"),
              dict(subprocess_env, JAX_ENABLE_X64="1"),
              dict(subprocess_env, TQDM_DISABLE="1")):
    assert not _served([sys.executable, script], env)
  assert not _served([sys.executable, "-c", "pass"], subprocess_env)
  assert not _served(["/bin/true", script], subprocess_env)
  # Where Python itself would fail (no such script or folder), a real one.
  assert not _served([sys.executable, str(tmp_path / "none.py")],
                     subprocess_env)
  assert not _served([sys.executable, script], subprocess_env,
                     tmp_path / "none")
  # Paths as objects, as subprocess takes them.
  assert _served([sys.executable, tmp_path / "bin" / "script.py"],
                 subprocess_env)
