"""The package's layout: no import cycle in mha/, techniques below the study,
the benchmarks outside the package and never imported by it.

Imports are read from the source with ``ast``, function-level ones included,
so a deferred import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
  """Module name -> file, for every module under mha/."""
  out = {}
  for folder, _, files in os.walk(os.path.join(ROOT, "mha")):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        out[".".join(parts)] = path
  return out


def _imports(path: str, module: str, known: set[str]) -> set[str]:
  """The mha modules ``path`` imports anywhere in its body: ``from a import
  b`` counts ``a.b`` when that is a module, else ``a``."""
  package = module if path.endswith("__init__.py") else module.rpartition(
      ".")[0]
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) -
                                           node.level + 1] + [base]).strip(".")
      for alias in node.names:
        found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known
                  else base)
  return {m for m in found if m in known and m != module}


@functools.lru_cache(maxsize=1)
def _graph() -> dict[str, set[str]]:
  modules = _modules()
  known = set(modules)
  return {m: _imports(p, m, known) for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of ``graph``, or None."""
  state: dict[str, int] = {}  # 1: on the stack, 2: done
  stack: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_import_cycle_in_mha():
  graph = _graph()
  assert "mha.pruning.study.experiment" in graph  # the walk found the study
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(
    m for m in _graph() if not m.startswith("mha.pruning.study")))
def test_techniques_never_import_the_study(module):
  graph = _graph()
  assert not any(m.startswith("mha.pruning.study") for m in graph[module]), (
      module, sorted(graph[module]))


def test_aliases_are_defined_once():
  for module, path in _modules().items():
    if module == "mha.aliases":
      continue
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in tree.body:
      if isinstance(node, ast.Assign):
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        assert not set(names) & {"Array", "Params", "Log", "HeadSpec"}, (
            module, names)


def test_no_untyped_options():
  for module, path in _modules().items():
    text = open(path, encoding="utf-8").read()
    assert "options: Any" not in text, module


def test_the_pruning_packages_import_their_names_on_first_use():
  # mha.pruning and mha.pruning.study resolve their names lazily (PEP 562),
  # so that the study's flags import no JAX (tests/test_cli.py runs that);
  # the names are the same objects as before.
  # pylint: disable=import-outside-toplevel
  from mha import head_masks
  from mha.run import lazy
  from mha import pruning
  from mha.pruning import constants, core, orderings, speed, study
  from mha.pruning.study import experiment, options
  # pylint: enable=import-outside-toplevel
  modules = (head_masks, core, speed)
  assert pruning.__all__ == [n for m in modules for n in m.__all__]
  names: dict = {}
  exec("from mha.pruning import *", names)  # pylint: disable=exec-used
  for module in modules:
    for name in module.__all__:
      assert names[name] is getattr(module, name), name
  assert pruning.prune_heads is core.prune_heads
  assert pruning.oracle.__name__ == "mha.pruning.oracle"  # a submodule
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    pruning.nope  # pylint: disable=pointless-statement
  assert (study.StudyOptions, study.run, study.check_inputs) == (
      options.StudyOptions, experiment.run, experiment.check_inputs)
  assert study.__all__ == ["StudyOptions", "check_inputs", "check_out_dir",
                           "run"]
  # A submodule is found without importing it, whatever the name probed.
  assert lazy.submodule("mha.pruning.study", "experiment")
  assert not lazy.submodule("mha.pruning.study", "nope")
  assert not lazy.submodule("mha.pruning", "a.b")
  assert not lazy.submodule("mha", "__wrapped__")
  with pytest.raises(AttributeError):
    pruning.__wrapped__  # pylint: disable=pointless-statement
  assert orderings.ORDERINGS is constants.ORDERINGS
  assert speed.MAX_REPEATS == constants.MAX_REPEATS == 40


def _imported_names(path: str) -> set[str]:
  """Every module name ``path`` imports anywhere in its body, as written
  (``from a import b``: ``a`` and ``a.b``)."""
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      found.add(node.module or "")
      found.update(f"{node.module}.{a.name}" for a in node.names)
  return found


def test_the_package_never_imports_the_benchmarks():
  # The benchmarks (benchmarks/, outside the package, as Flax keeps its
  # own) import mha; the model, the layer, mha.nnx, mha.pruning and every
  # other module of mha never import them.
  modules = _modules()
  for module in ("mha.model", "mha.attention", "mha.nnx", "mha.pruning"):
    assert module in modules
  for module, path in modules.items():
    benchmarks = {name for name in _imported_names(path)
                  if name.split(".")[0] == "benchmarks"}
    assert not benchmarks, (module, sorted(benchmarks))
  assert not os.path.exists(os.path.join(ROOT, "mha", "benchmarking.py"))


def test_scripts_holds_the_research_scripts_only():
  # The speed scripts live in benchmarks/ (benchmarks/README.md).
  scripts = set(os.listdir(os.path.join(ROOT, "scripts"))) - {"__pycache__"}
  assert scripts == {"__init__.py", "gpu_check.sh", "prune_heads.py",
                     "pruning_benchmark.py", "shapley_coverage.py",
                     "interval_coverage.py"}
  for name in ("benchmark.py", "benchmarking.py", "torch_peer.py",
               "README.md", "results"):
    assert os.path.exists(os.path.join(ROOT, "benchmarks", name)), name


# ------------------------------------------------------ plain numerics rules

# Constructs that serve speed rather than semantics, and APIs without a
# compatibility promise: none of them in mha/ (docs/performance.md, "The
# rules"). weights_from_lse's custom derivative is for correctness (exact
# gradients of weights rebuilt from a kernel's log-sum-exp), and the one
# platform_dependent chooses which kernel computes the fused attention.
_FORBIDDEN = ("custom_vjp", "optimization_barrier", "compiler_options",
              "jax._src", "jax.extend", "_executable",
              "serialize_executable", "gc.freeze", "gc.disable")
_ALLOWED = {("mha/attention_kernels.py", "custom_jvp"): 1,
            ("mha/attention.py", "platform_dependent"): 1}


def _code(path: str) -> str:
  """The tokens of ``path``'s code, comments and strings left out."""
  import io  # pylint: disable=import-outside-toplevel
  import tokenize  # pylint: disable=import-outside-toplevel
  with open(path, encoding="utf-8") as f:
    tokens = tokenize.generate_tokens(io.StringIO(f.read()).readline)
    return " ".join(t.string for t in tokens
                    if t.type not in (tokenize.COMMENT, tokenize.STRING))


def test_no_speed_machinery_or_private_jax_api_in_the_library():
  found = {}
  for path in _modules().values():
    relative = os.path.relpath(path, ROOT)
    code = _code(path)
    for word in _FORBIDDEN + ("custom_jvp", "platform_dependent"):
      count = code.count(word)
      if count:
        found[(relative, word)] = count
  assert found == _ALLOWED


def test_the_root_of_mha_holds_at_most_18_modules():
  root = [name for name in os.listdir(os.path.join(ROOT, "mha"))
          if name.endswith(".py")]
  assert len(root) <= 18, sorted(root)
  with open(os.path.join(ROOT, "mha", "train.py"), encoding="utf-8") as f:
    assert sum(1 for _ in f) <= 700


@pytest.mark.slow  # a traced training run: the full suite only
def test_the_run_config_passes_through_at_most_8_modules(tmp_path, data_dir):
  """Followed from train_and_evaluate, the modules of mha/ whose functions
  receive the run config (a ConfigDict argument)."""
  import sys  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  from conftest import tiny_config  # pylint: disable=import-outside-toplevel
  from mha import train  # pylint: disable=import-outside-toplevel
  package = os.path.join(ROOT, "mha") + os.sep
  modules = set()

  def profile(frame, event, arg):
    del arg
    code = frame.f_code
    if event != "call" or not code.co_filename.startswith(package):
      return
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    if any(isinstance(frame.f_locals.get(n), ml_collections.ConfigDict)
           for n in names):
      modules.add(os.path.relpath(code.co_filename, package))

  config = tiny_config(data_dir, "num_train_steps=2", "eval_every_steps=1",
                       "checkpoint_every_steps=1", "model.num_layers=1")
  sys.setprofile(profile)
  try:
    train.train_and_evaluate(config, str(tmp_path / "run"))
  finally:
    sys.setprofile(None)
  assert "train.py" in modules and len(modules) <= 8, sorted(modules)
