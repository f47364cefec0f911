"""The package's layout: no import cycle in mha/, techniques below the study.

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
  from mha import lazy
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
