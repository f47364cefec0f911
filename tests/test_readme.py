"""The README's Python snippets run, and print what the README says.

Each ```python block of README.md is a doctest. They run in a folder where
``runs/reverse`` is a short training run of the default model (the shapes and
names the snippets print are the default model's; the step count and the
accuracy are not printed, so a few steps suffice).
"""

from __future__ import annotations

import doctest
import os
import re

import pytest

from conftest import ROOT

_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _snippets(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return _BLOCK.findall(f.read())


@pytest.fixture(scope="module")
def readme_workdir(tmp_path_factory, data_dir) -> str:
  """A folder holding ``runs/reverse``: the default model, trained briefly."""
  from configs import default
  from mha import train
  config = default.get_config(",".join([
      f"data.data_dir={data_dir}", "data.num_train_examples=256",
      "data.num_eval_examples=64", "eval_batch_size=64", "num_train_steps=4",
      "warmup_steps=1", "log_every_steps=4", "eval_every_steps=4",
      "checkpoint_every_steps=4"]))
  folder = tmp_path_factory.mktemp("readme")
  train.train_and_evaluate(config, str(folder / "runs" / "reverse"))
  return str(folder)


def test_the_readme_has_snippets():
  snippets = _snippets(os.path.join(ROOT, "README.md"))
  assert len(snippets) >= 3 and all(">>> " in s for s in snippets)


def test_readme_snippets_print_what_they_say(readme_workdir, monkeypatch):
  monkeypatch.chdir(readme_workdir)
  parser = doctest.DocTestParser()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  globs: dict = {}  # One namespace: a later snippet uses an earlier one's.
  for i, text in enumerate(_snippets(os.path.join(ROOT, "README.md"))):
    test = parser.get_doctest(text, globs, f"README.md snippet {i}",
                              "README.md", 0)
    result = runner.run(test, clear_globs=False)
    globs = test.globs
    assert result.failed == 0, f"README.md snippet {i} failed (see output)"
