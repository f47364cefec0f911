"""The suite's preloaded entry points (tests/preloaded.py): a forked child
behaves, as far as a test can see, as ``subprocess.run`` of the same script
would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import conftest
from conftest import run, start

SCRIPT = textwrap.dedent("""\
    import json, os, signal, sys
    if sys.argv[1:] == ["pause"]:  # Until a signal ends it.
      signal.pause()
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(),
                      "path0": sys.path[0], "home": os.environ.get("HOME"),
                      "stdin": sys.stdin.read(), "main": __name__,
                      "pid": os.getpid()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("EXIT_CODE", "0")))
    """)


@pytest.fixture
def script(tmp_path):
  path = tmp_path / "bin" / "script.py"
  path.parent.mkdir()
  path.write_text(SCRIPT)
  return str(path)


def test_a_child_runs_the_script_as_a_subprocess_would(script, tmp_path,
                                                       subprocess_env):
  import json  # pylint: disable=import-outside-toplevel
  assert conftest._SERVER is not None  # pylint: disable=protected-access
  env = dict(subprocess_env, HOME=str(tmp_path), EXIT_CODE="3")
  args = [sys.executable, script, "a", "--b=c"]
  assert conftest._SERVER.serves(args, env)  # pylint: disable=protected-access
  served = run(args, env=env, cwd=tmp_path, input="in")
  real = subprocess.run(args, env=env, cwd=tmp_path, input="in",
                        capture_output=True, text=True, check=False)
  assert served.returncode == real.returncode == 3
  assert served.stderr == real.stderr == "to stderr\n"
  seen, expected = json.loads(served.stdout), json.loads(real.stdout)
  assert seen.pop("pid") != os.getpid()
  expected.pop("pid")
  assert seen == expected == {
      "argv": [script, "a", "--b=c"], "cwd": str(tmp_path),
      "path0": os.path.dirname(script), "home": str(tmp_path), "stdin": "in",
      "main": "__main__"}


def test_a_killed_child_and_a_timeout_read_as_a_subprocesss(script,
                                                            subprocess_env):
  child = start([sys.executable, script, "pause"], env=subprocess_env)
  child.kill()
  assert child.wait().returncode == -signal.SIGKILL
  with pytest.raises(subprocess.TimeoutExpired):
    run([sys.executable, script, "pause"], env=subprocess_env, timeout=0.1)


def test_what_a_module_reads_at_import_runs_as_a_real_subprocess(
    script, subprocess_env):
  server = conftest._SERVER  # pylint: disable=protected-access
  for env in (dict(subprocess_env, XLA_FLAGS="--xla_dump_to=/nowhere"),
              dict(subprocess_env, JAX_ENABLE_X64="1")):
    assert not server.serves([sys.executable, script], env)
  assert not server.serves([sys.executable, "-c", "pass"], subprocess_env)
  assert not server.serves(["/bin/true", script], subprocess_env)
