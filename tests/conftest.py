"""Test-wide JAX settings and the expensive setup every module shares.

Session-scoped, built once per test run:

* ``data_dir``: a TFDS data directory; the ``tiny`` datasets of every task are
  prepared there on first use (``mha.data.load_splits`` caches on disk).
* ``tiny_run``: the ``tiny`` config trained to completion in its own workdir:
  a ``TinyRun`` with the config, the workdir and the final train state. Tests
  that need a trained checkpoint read it; tests that write into a workdir copy
  it first (``copy_workdir``).
* ``subprocess_env``: the environment for ``train.py`` & co. run as
  subprocesses: CPU only, XLA's quick compilation as in-process, and the
  session's persistent compilation cache. ``run`` and ``start`` run them
  as children forked from a process that has already imported JAX & co.
  (``tests/preloaded.py``) where nothing the test sees changes.

The session's persistent compilation cache (``_jit_cache``, one folder shared
by both pytest-xdist workers and every subprocess, new each run) compiles each
program once per test run: a test that trains again with a fresh ``jax.jit``
of the same function loads what another test compiled. Results do not change
(``tests/test_startup.py`` shows a run on loaded programs ends bitwise equal).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
from typing import Any, Mapping, Sequence

# XLA:CPU flags of every test process, set before JAX starts its backend;
# ``subprocess_env`` copies them to the entry points run as subprocesses, so
# in-process and subprocess programs stay the same.
# * One XLA thread per process: the suite runs two pytest-xdist workers (and
#   their subprocesses) on two cores, and Eigen's intra-op thread pool in each
#   of them only oversubscribes the cores (measured on 2 cores: the suite
#   306 s -> 257 s, its CPU time 582 s -> 513 s).
# * XLA:CPU's older loop emitters instead of its MLIR fusion emitters: the
#   suite is mostly compiling, and they compile its small programs faster
#   (measured 2026-11-25 on 2 cores, test_attention + test_model +
#   test_pruning_oracle + test_train in one process: 39.8 s -> 24.6 s).
#   jaxlib 0.11 removed the flag (an unknown flag in XLA_FLAGS aborts the
#   process), so it is set only where jaxlib still has it.
# * The LLVM module of each program compiled as one piece, not split for
#   parallel code generation: splitting saves wall time where threads are
#   idle and costs CPU time, which two workers on two cores are short of.
#   Measured 2026-11-26 on 2 cores, the tiny train step at the suite's
#   optimization level: compile CPU 0.53-0.58 s against 0.65-0.78 s (medians
#   of 5, three rounds). The generated code is the same, so are the results.
def _jaxlib_version() -> tuple[int, ...]:
  version = importlib.metadata.version("jaxlib")
  return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def _jax_has_cuda() -> bool:
  """Whether a CUDA plugin of jaxlib is installed (a GPU machine's jax)."""
  for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
    try:
      importlib.metadata.version(name)
      return True
    except importlib.metadata.PackageNotFoundError:
      pass
  return False


# Where jax has CUDA, also XLA's deterministic GPU ops: without them two
# training runs on a GPU differ (an H100, 2026-11-27,
# benchmarks/determinism_check.py: 114 of 117 leaves, by up to 0.23 after 200
# steps); with them, two runs and a resumed one (in one process) were
# bitwise equal, so the suite checks those bits on a GPU too
# (``assert_same_bits``; its comparisons are within this process). So on a
# GPU the suite tests the deterministic configuration, not the default one.
# Not set on CPU-only machines, whose XLA:CPU programs are deterministic.
GPU_DETERMINISTIC_OPS = "--xla_gpu_deterministic_ops=true"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_cpu_use_fusion_emitters=false"
    if _jaxlib_version() < (0, 11) else "",
    GPU_DETERMINISTIC_OPS if _jax_has_cuda() else ""]))

import jax  # noqa: E402  (after XLA_FLAGS)
import ml_collections  # noqa: E402
import pytest  # noqa: E402

# Catch silent broadcasting between arrays of different rank.
jax.config.update("jax_numpy_rank_promotion", "raise")
# The tests run small programs once or twice: compiling them fast matters,
# running them fast does not. The subprocesses get the same setting
# (``subprocess_env``), so their results compare bitwise with in-process runs.
jax.config.update("jax_disable_most_optimizations", True)
# On a GPU, XLA runs float32 matrix products in TF32 by default (outputs of
# order 1 off by about 1e-3 on an H100, where the suite's first GPU run
# failed 11 comparisons made at 1e-5): the tests ask for full float32 there,
# so they check the math rather than TF32's rounding. CPU programs are
# unchanged.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import preloaded  # noqa: E402  (tests/, beside this file)



@dataclasses.dataclass(frozen=True)
class TinyRun:
  """A finished ``tiny`` training run."""

  config: ml_collections.ConfigDict
  workdir: str
  state: Any


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
  """A data directory shared by the whole session."""
  return str(tmp_path_factory.mktemp("tfds"))


#: A tiny pylm corpus (``tiny_corpus``): paths whose hash puts them in each
#: split (``mha.data.corpus_split_of``), and files that are not in the corpus.
TINY_CORPUS = {
    "mod1.py": "import os\n\n\ndef main():\n  return os.getcwd()\n" * 4,
    "pkg/sub0.py": "class A:\n  def f(self, x):\n    return x + 1\n" * 4,
    "pkg/sub12.py": "def g(a, b):\n  \"\"\"Adds.\"\"\"\n  return a + b\n" * 2,
    "mod0.py": "for i in range(10):\n  print(i * i)\n" * 2,
    "test/test_mod1.py": "import unittest\n" * 20,  # a test folder
    "site-packages/other.py": "x = 1\n" * 20,  # installed, not stdlib
    "README.txt": "not python\n" * 20,
}


@pytest.fixture
def tiny_corpus(tmp_path) -> str:
  """A fresh folder holding ``TINY_CORPUS``: a corpus of 4 files, 2 of them
  in train, 1 in validation, 1 in test."""
  root = tmp_path / "corpus"
  for path, text in TINY_CORPUS.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
  return str(root)


@pytest.fixture(scope="session", autouse=True)
def _jit_cache(tmp_path_factory) -> str:
  """The session's persistent compilation cache, on before any test runs."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # pytest-N/, shared by the workers' popen-gwK/
  directory = str(base / "jit-cache")
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # Also the run configs' default (``configs/default.py`` reads it): a
  # workdir trained in a test records this folder, so the entry points run
  # on it later (prune_heads.py, eval.py) use it too, not the user's
  # ~/.cache/mha/jax.
  os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory


@pytest.fixture(scope="session")
def subprocess_env(_jit_cache) -> dict[str, str]:
  """Environment of the entry points run as subprocesses; also starts this
  test process's preloaded server (``run``) with it."""
  global _SERVER
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             JAX_COMPILATION_CACHE_DIR=_jit_cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  # MHA_TESTS_NO_FORK_SERVER=1: every entry point as a real subprocess (to
  # measure what the server buys: docs/performance.md).
  if not os.environ.get("MHA_TESTS_NO_FORK_SERVER"):
    _SERVER = preloaded.Server(ROOT, env)
  yield env
  server, _SERVER = _SERVER, None
  if server is not None:
    server.close()


# This test process's server of preloaded entry points (tests/preloaded.py),
# while ``subprocess_env`` is set up.
_SERVER: preloaded.Server | None = None


def run(args: Sequence[str], *, env: Mapping[str, str],
        cwd: str | os.PathLike | None = None, timeout: float | None = None,
        input: str | None = None, check: bool = False  # pylint: disable=redefined-builtin
        ) -> subprocess.CompletedProcess:
  """``subprocess.run(args, env=env, cwd=cwd, timeout=timeout, input=input,
  capture_output=True, text=True, check=check)``, as a child of the
  preloaded server where that changes nothing the test sees
  (``preloaded.Server.serves``), else as a real subprocess."""
  if _SERVER is not None and _SERVER.serves(args, env, cwd):
    result = _SERVER.start(args, env=env, cwd=cwd, input=input).wait(timeout)
    if check:
      result.check_returncode()
    return result
  return subprocess.run(list(args), env=env, cwd=cwd, timeout=timeout,
                        input=input, capture_output=True, text=True,
                        check=check)


class _Popen:
  """A real subprocess with ``preloaded.Child``'s ``wait``."""

  def __init__(self, args: Sequence[str], env: Mapping[str, str],
               cwd: str | os.PathLike | None):
    self.args = list(args)
    self._process = subprocess.Popen(self.args, env=env, cwd=cwd,
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
    self.pid = self._process.pid

  def kill(self) -> None:
    self._process.kill()

  def wait(self, timeout: float | None = None
           ) -> subprocess.CompletedProcess:
    try:
      out, err = self._process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.communicate()
      raise
    return subprocess.CompletedProcess(self.args, self._process.returncode,
                                       out, err)


def start(args: Sequence[str], *, env: Mapping[str, str],
          cwd: str | os.PathLike | None = None) -> preloaded.Child | _Popen:
  """``args`` started as ``run`` would run them, without waiting: several
  at once. ``.wait(timeout)`` gives their ``subprocess.CompletedProcess``."""
  if _SERVER is not None and _SERVER.serves(args, env, cwd):
    return _SERVER.start(args, env=env, cwd=cwd)
  return _Popen(args, env, cwd)


@pytest.fixture
def read_only_dir(tmp_path, subprocess_env):
  """An empty folder that takes no writes: a read-only tmpfs where this
  process may mount one, else a folder without write permission (skipped
  where that is writable anyway: root that may not mount)."""
  path = tmp_path / "read_only"
  path.mkdir()
  mounted = shutil.which("mount") is not None and subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
      capture_output=True, env=subprocess_env, check=False).returncode == 0
  if not mounted:
    path.chmod(0o555)
  try:
    if os.access(path, os.W_OK):
      pytest.skip("no folder here refuses writes (root, no mount)")
    yield path
  finally:
    if mounted:
      subprocess.run(["umount", str(path)], check=True, env=subprocess_env)
    path.chmod(0o755)


def tiny_config(data_dir: str, *overrides: str) -> ml_collections.ConfigDict:
  """The ``tiny`` config on ``data_dir``, with ``key=value`` overrides."""
  from configs import default
  return default.get_config(",".join(["tiny", f"data.data_dir={data_dir}",
                                      *overrides]))


@functools.partial(jax.jit, static_argnums=0)
def init_params(model, key: jax.Array) -> Any:
  """``mha.build.init_params(model, key)`` as one jitted program: the same
  parameters, without compiling each of the initialisation's operations on
  its own as an eager call does."""
  from mha import build  # pylint: disable=import-outside-toplevel
  return build.init_params(model, key)


def random_model_and_split(config, *, seed: int = 0, n: int = 24,
                           min_length: int = 1):
  """An untrained ``Transformer(config)``, its parameters (``seed``) and a
  split of ``n`` random examples of ``min_length`` to ``config.max_len``
  tokens whose targets are a fixed function of each token: the pruning
  techniques' tests need a model, not a trained one."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from mha import data  # pylint: disable=import-outside-toplevel
  from mha.model import Transformer  # pylint: disable=import-outside-toplevel
  model = Transformer(config)
  params = init_params(model, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, config.vocab_size, (n, config.max_len))
  lengths = rng.integers(min_length, config.max_len + 1, n)
  tokens[np.arange(config.max_len)[None, :] >= lengths[:, None]] = 0
  targets = np.where(tokens != 0, (tokens * 3 + 1) % config.vocab_size, 0)
  return model, params, data.Split(tokens.astype(np.int32),
                                   targets.astype(np.int32))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_dir) -> TinyRun:
  """The ``tiny`` config trained to completion (20 steps)."""
  from mha import train
  config = tiny_config(data_dir)
  workdir = str(tmp_path_factory.mktemp("tiny_run"))
  state = train.train_and_evaluate(config, workdir)
  return TinyRun(config=config, workdir=workdir, state=state)


def gpu_deterministic_ops() -> bool:
  """Whether this process runs on a GPU under ``GPU_DETERMINISTIC_OPS``."""
  return (jax.default_backend() == "gpu" and GPU_DETERMINISTIC_OPS
          in os.environ.get("XLA_FLAGS", "").split())


def assert_same_bits(a: Any, b: Any, *, subprocess_trained: bool = False
                     ) -> None:
  """Two runs' trees (parameters, optimizer states), leaf by leaf, bitwise.

  A resumed run against an uninterrupted one, programs loaded against
  compiled ones, a stacked model against its twin: bitwise equal on XLA:CPU,
  and on a GPU under XLA's deterministic ops (``GPU_DETERMINISTIC_OPS``,
  which this file sets where jax has CUDA). Elsewhere the test is skipped at
  this point, after its other checks: XLA promises no bitwise-equal runs on
  a GPU without them (docs/performance.md, "On a GPU"). Also skipped off CPU
  when ``subprocess_trained``: one of the runs was trained, at least in part,
  by an entry point in a subprocess, and those run on the CPU
  (``subprocess_env``), while this process runs on the accelerator.
  """
  backend = jax.default_backend()
  if backend != "cpu":
    if subprocess_trained:
      pytest.skip("a run trained in a subprocess (on the CPU) against one "
                  f"in this process (on the {backend}): not bitwise")
    if not gpu_deterministic_ops():
      pytest.skip("bitwise-equal training runs are checked on CPU, and on a "
                  "GPU under XLA's deterministic ops")
  import numpy as np  # pylint: disable=import-outside-toplevel
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def copy_workdir(source: str, target: os.PathLike | str) -> str:
  """A copy of a workdir, to change without touching the shared one."""
  shutil.copytree(source, target)
  return str(target)


# The slowest files first, by their tests' summed CPU seconds in the suite
# (``--cpu-report``, 2026-12-07): with ``--dist loadfile`` pytest-xdist hands
# out whole files in collection order (``--no-loadscope-reorder`` in
# pyproject.toml: by default it orders them by their number of tests), so a
# slow file collected last would run alone at the end while the other worker
# idles. Files not named here follow, each under 5 s.
_SLOW_FIRST = ("test_reliability.py", "test_pruning.py",
               "test_study_faults.py", "test_benchmark.py",
               "test_sharding.py", "test_pruning_oracle.py",
               "test_attention.py", "test_streaming_ablation.py",
               "test_pruned_models.py", "test_train.py",
               "test_pruning_grid.py", "test_attention_dropin.py",
               "test_pruning_extensions.py", "test_retrain.py",
               "test_pruning_ablation.py", "test_export.py",
               "test_explorer.py", "test_decode.py", "test_pruning_kwon.py",
               "test_startup.py", "test_evaluate.py", "test_pruning_plots.py",
               "test_model.py", "test_finetune.py", "test_readme.py",
               "test_build.py", "test_spell.py", "test_layout.py",
               "test_plotting.py", "test_speed.py", "test_patching.py",
               "test_pruning_stats.py", "test_nnx.py", "test_preloaded.py")


# End-to-end files: whole training runs, resumes, kills, meshes of devices,
# the benchmarks, the browser. Every test in them is ``slow``.
_END_TO_END_FILES = ("test_reliability.py", "test_sharding.py",
                     "test_startup.py", "test_benchmark.py",
                     "test_finetune.py", "test_spell.py", "test_explorer.py",
                     "test_train.py", "test_pruned_models.py",
                     "test_readme.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Marks ``slow`` every test of an end-to-end file and every test that runs
  an entry point as a subprocess (it asks for ``subprocess_env``); others
  that run a whole study carry ``@pytest.mark.slow`` themselves. Runs the
  slowest files first (a stable sort: each file keeps its order).
  ``-m "not slow"`` is the edit loop."""
  for item in items:
    name = os.path.basename(str(item.fspath))
    if (name in _END_TO_END_FILES
        or "subprocess_env" in getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.slow)
  def rank(item: pytest.Item) -> int:
    name = os.path.basename(str(item.fspath))
    return _SLOW_FIRST.index(name) if name in _SLOW_FIRST else len(_SLOW_FIRST)
  items.sort(key=rank)


def pytest_configure(config: pytest.Config) -> None:
  """One garbage collection, not pytest's five, when a process's session
  ends, before it reports the last unraisable exceptions. With the traced and
  compiled programs of many tests in the heap, each full collection takes
  about 0.6 s (the fast loop in one process: five took 2.9 s). Exceptions
  raised in finalizers are still reported at every test's setup, call and
  teardown."""
  try:
    from _pytest import unraisableexception  # pylint: disable=import-outside-toplevel
    config.stash[unraisableexception.gc_collect_iterations_key] = 1
  except (ImportError, AttributeError):  # Another pytest: its own default.
    pass


# --------------------------------------------------------------------------
# --cpu-report: each test's CPU time, its subprocesses' included.
# --------------------------------------------------------------------------
# Wall times (--durations) move by a third with this machine's hour; CPU
# time moves less, and counts what a test's subprocesses (train.py & co.)
# spend, which --durations cannot tell from waiting.


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption(
      "--cpu-report", default=None, metavar="PATH",
      help="write each test's CPU seconds (its process and its waited-for "
      "subprocesses) to PATH as JSON lines, and print the costliest files "
      "and tests at the end")


def _cpu_seconds() -> tuple[float, float]:
  """This process's CPU seconds and its children's (those of the preloaded
  server included)."""
  import resource  # pylint: disable=import-outside-toplevel
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return (own.ru_utime + own.ru_stime,
          children.ru_utime + children.ru_stime + (_SERVER.cpu_s if _SERVER
                                                   else 0.0))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers
def pytest_sessionstart(session: pytest.Session) -> None:
  """A new report for each run: the controller (or a lone process) empties
  ``--cpu-report``'s file before any test runs."""
  path = session.config.getoption("--cpu-report")
  if path and not os.environ.get("PYTEST_XDIST_WORKER"):
    with open(path, "w", encoding="utf-8"):
      pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):  # pylint: disable=unused-argument
  path = item.config.getoption("--cpu-report")
  if not path:
    yield
    return
  import json  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  start, (own, children) = time.perf_counter(), _cpu_seconds()
  yield  # setup, call and teardown
  own_after, children_after = _cpu_seconds()
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({
        "test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "wall_s": time.perf_counter() - start, "cpu_s": own_after - own,
        "subprocess_cpu_s": children_after - children}) + "\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
  path = config.getoption("--cpu-report")
  if not path or os.environ.get("PYTEST_XDIST_WORKER") or not os.path.exists(
      path):
    return
  import collections  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  cpu = lambda r: r["cpu_s"] + r["subprocess_cpu_s"]
  files = collections.Counter()
  for r in rows:
    files[r["test"].split("::")[0]] += cpu(r)
  write = terminalreporter.write_line
  terminalreporter.section("CPU seconds (own + subprocesses)")
  write(f"{len(rows)} tests: {sum(map(cpu, rows)):.1f} s of CPU, "
        f"{sum(r['subprocess_cpu_s'] for r in rows):.1f} s of it in "
        f"subprocesses; {path}")
  for name, seconds in files.most_common(10):
    write(f"{seconds:7.1f}  {name}")
  for r in sorted(rows, key=cpu, reverse=True)[:15]:
    write(f"{cpu(r):7.1f}  {r['test']}")
