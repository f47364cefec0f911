"""Pruned models saved as workdirs: mha.pruning.export and
``scripts/prune_heads.py --save_pruned``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha
from mha import build
from mha import config_validation
from mha import data
from mha.pruning import core
from mha.pruning import experiment
from mha.pruning import export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prune_heads.py")
EVAL = os.path.join(ROOT, "eval.py")

# The pruned model adds fewer head contexts than the masked one (which adds
# zeros), so float32 sums may round differently: ~1e-6 on logits of order 10.
LOGIT_ATOL = 1e-5


@pytest.fixture(scope="module")
def source(tiny_run):
  """The tiny run's checkpoint (2 layers x 2 heads, d_model 16)."""
  return mha.load_checkpoint(tiny_run.workdir)


@pytest.fixture(scope="module")
def splits(tiny_run):
  config = tiny_run.config
  return data.load_splits(build.data_spec(config), config.data.data_dir)


def _listing(path: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), path)
                for d, _, files in os.walk(path) for f in files)


def _masked_logits(ckpt, removed, inputs):
  flat = [layer * ckpt.model_config.max_heads + head for layer, head in removed]
  mask = jnp.asarray(core.mask_without(ckpt.model_config, flat))
  return core.masked_logits(ckpt.model, ckpt.params, inputs, mask)


@pytest.mark.parametrize("removed, heads_per_layer", [
    ([(0, 1)], [1, 2]),
    ([(0, 0), (1, 1)], [1, 1]),
    ([(1, 0), (1, 1)], [2, 0]),  # the whole last layer
    ([(0, 0), (0, 1)], [0, 2]),  # the whole first layer
])
def test_saved_model_loads_and_equals_masked(tiny_run, source, splits,
                                             tmp_path, removed,
                                             heads_per_layer):
  out = str(tmp_path / "pruned")
  provenance = export.save_pruned(source, removed, out,
                                  source=tiny_run.workdir,
                                  details={"note": "test"})
  loaded = mha.load_checkpoint(out)
  assert loaded.step == source.step
  assert list(loaded.model_config.heads_per_layer) == heads_per_layer
  assert list(loaded.config.model.num_heads) == heads_per_layer
  assert loaded.config.model.head_dim == 8  # 16 // 2, kept explicit
  assert config_validation.config_problems(loaded.config) == []
  inputs = jnp.asarray(splits["test"].inputs)
  logits, _ = loaded.model.apply({"params": loaded.params}, inputs,
                                 return_weights=False)
  np.testing.assert_allclose(logits, _masked_logits(source, removed, inputs),
                             rtol=0, atol=LOGIT_ATOL)
  # The removed heads' parameters are gone, not zeroed.
  assert core.count_params(loaded.params) < core.count_params(source.params)
  # Provenance, and config.json beside the checkpoint as training writes it.
  assert export.read_provenance(out) == provenance
  assert provenance["source_workdir"] == os.path.realpath(tiny_run.workdir)
  assert provenance["source_step"] == source.step
  assert provenance["removed"] == sorted([list(p) for p in removed])
  assert provenance["note"] == "test"
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    assert json.load(f) == loaded.config.to_dict()


def test_optimizer_moments_are_pruned_like_the_params(tiny_run, source,
                                                      tmp_path):
  out = str(tmp_path / "pruned")
  export.save_pruned(source, [(0, 1)], out, source=tiny_run.workdir)
  before = export.read_train_state(tiny_run.workdir, source)
  after = export.read_train_state(out, mha.load_checkpoint(out))
  assert int(after.step) == int(before.step)

  def moments(state):  # Adam's mu: the first params-shaped subtree.
    is_params = lambda n: isinstance(n, dict) and set(n) == set(state.params)
    return [n for n in jax.tree.leaves(state.opt_state, is_leaf=is_params)
            if is_params(n)][0]

  mu_before, mu_after = moments(before), moments(after)
  kernel = lambda mu: np.asarray(mu["layer_0"]["attention"]["query"]["kernel"])
  np.testing.assert_array_equal(kernel(mu_after), kernel(mu_before)[:, :1])
  np.testing.assert_array_equal(
      np.asarray(mu_after["layer_1"]["attention"]["query"]["kernel"]),
      np.asarray(mu_before["layer_1"]["attention"]["query"]["kernel"]))


def test_a_pruned_model_can_be_pruned_again(tiny_run, source, splits,
                                            tmp_path):
  first, second = str(tmp_path / "a"), str(tmp_path / "b")
  export.save_pruned(source, [(0, 0)], first, source=tiny_run.workdir)
  once = mha.load_checkpoint(first)
  # Heads are renumbered: the original (0, 1) is now (0, 0).
  export.save_pruned(once, [(0, 0), (1, 1)], second, source=first)
  twice = mha.load_checkpoint(second)
  assert list(twice.model_config.heads_per_layer) == [0, 1]
  inputs = jnp.asarray(splits["test"].inputs)
  logits, _ = twice.model.apply({"params": twice.params}, inputs,
                                return_weights=False)
  np.testing.assert_allclose(
      logits, _masked_logits(source, [(0, 0), (0, 1), (1, 1)], inputs),
      rtol=0, atol=LOGIT_ATOL)


def test_output_dir_rules(tiny_run, tmp_path):
  workdir = tiny_run.workdir
  export.check_output_dir(tmp_path / "new", workdir)  # missing: fine
  (tmp_path / "empty").mkdir()
  export.check_output_dir(tmp_path / "empty", workdir)  # empty: fine
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    export.check_output_dir(tmp_path / "file", workdir)
  with pytest.raises(ValueError, match="source workdir itself"):
    export.check_output_dir(workdir, workdir)
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="not a pruned model"):
    export.check_output_dir(other, workdir)
  (other / export.PROVENANCE_FILE).write_text(
      json.dumps({"source_workdir": str(tmp_path / "elsewhere")}))
  with pytest.raises(ValueError, match="another workdir"):
    export.check_output_dir(other, workdir)
  (other / export.PROVENANCE_FILE).write_text(
      json.dumps({"source_workdir": workdir}))
  export.check_output_dir(other, workdir)  # a pruned model of it: replace


def test_heads_for_fraction(source):
  config = source.model_config  # 4 heads
  order = np.array([3, 0, 2, 1])
  assert export.heads_for_fraction(config, order, 0.0) == []
  assert export.heads_for_fraction(config, order, 0.5) == [(1, 1), (0, 0)]
  assert len(export.heads_for_fraction(config, order, 1.0)) == 4
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    export.heads_for_fraction(config, order, 1.5)


# --------------------------------------------------------------------------
# The command lines.
# --------------------------------------------------------------------------


def _run(env, program, *args, timeout=300):
  return subprocess.run([sys.executable, program, *args], capture_output=True,
                        text=True, timeout=timeout, env=env, cwd=ROOT,
                        check=False)


def test_script_saves_a_pruned_model_and_eval_reads_it(tiny_run, source,
                                                       splits, tmp_path,
                                                       subprocess_env):
  out = str(tmp_path / "pruned")
  before = _listing(tiny_run.workdir)
  args = (f"--workdir={tiny_run.workdir}", "--remove_heads=0:0,0:1",
          f"--save_pruned={out}")
  result = _run(subprocess_env, SCRIPT, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"to {out}" in result.stdout
  printed = json.loads(result.stdout.strip().splitlines()[-1])
  assert printed["heads_per_layer"] == [0, 2]
  assert printed["removed"] == [[0, 0], [0, 1]]
  assert _listing(tiny_run.workdir) == before  # the source is untouched
  assert sorted(os.listdir(tmp_path)) == ["pruned"]  # no staging left over

  # eval.py on the pruned workdir: the masked model's metrics.
  result = _run(subprocess_env, EVAL, f"--workdir={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  metrics = json.loads(result.stdout.strip().splitlines()[-1])
  masked = core.evaluate_masks(
      source.model, source.params, splits["test"],
      core.mask_without(source.model_config, [0, 1])[None])
  # Same examples, logits equal to ~1e-6: the loss agrees to float32
  # rounding; an argmax could flip only on a near-tie (none expected).
  assert metrics["loss"] == pytest.approx(float(masked["loss"][0]), abs=1e-5)
  assert metrics["token_accuracy"] == pytest.approx(
      float(masked["token_accuracy"][0]), abs=1e-9)
  assert metrics["step"] == source.step

  # Saving again into a pruned model of the same workdir replaces it.
  result = _run(subprocess_env, SCRIPT, f"--workdir={tiny_run.workdir}",
                "--remove_heads=1:1", f"--save_pruned={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert export.read_provenance(out)["removed"] == [[1, 1]]
  assert not os.path.exists(os.path.join(out, "eval"))  # the old model's
  assert mha.load_checkpoint(out).model_config.heads_per_layer == (2, 1)


def _expected_removals(ckpt, validation, order: str, k: int) -> list[list[int]]:
  """The k heads the study's ``order`` (or its oracle) removes first."""
  options = experiment.Options()
  if order == "oracle":
    from mha.pruning import oracle  # pylint: disable=import-outside-toplevel
    metrics = oracle.evaluate_subsets(ckpt.model, ckpt.params, validation)
    flat = oracle.best_removals(experiment.subset_values(metrics),
                                ckpt.model_config)[k]
  else:
    flat = experiment.compute_orders(ckpt.model, ckpt.params, validation,
                                     options)[order][:k]
  return sorted([list(p) for p in core.flat_to_pairs(ckpt.model_config, flat)])


@pytest.mark.parametrize("order", ["gradient", "shapley", "oracle"])
def test_script_prunes_a_fraction_of_an_order(tiny_run, source, splits,
                                              tmp_path, subprocess_env,
                                              order):
  out = str(tmp_path / "pruned")
  result = _run(subprocess_env, SCRIPT, f"--workdir={tiny_run.workdir}",
                "--prune_fraction=0.5", f"--order={order}",
                f"--save_pruned={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  provenance = export.read_provenance(out)
  assert provenance["order"] == order
  assert provenance["prune_fraction"] == 0.5
  # Half of the 4 heads: the first two of the order, measured on validation.
  assert provenance["removed"] == _expected_removals(
      source, splits["validation"], order, 2)
  loaded = mha.load_checkpoint(out)
  assert sum(loaded.model_config.heads_per_layer) == 2


@pytest.mark.parametrize("args, message", [
    (["--prune_fraction=1.5", "--order=gradient"], "[0, 1]"),
    (["--prune_fraction=-0.1", "--order=gradient"], "[0, 1]"),
    (["--prune_fraction=0.5", "--order=nonsense"], "is not one of"),
    (["--prune_fraction=0.5", "--order=random"], "is not one of"),
    (["--prune_fraction=0.5"], "needs --order"),
    (["--prune_fraction=0.5", "--order=gradient", "--remove_heads=0:1"],
     "exactly one of"),
    ([], "exactly one of"),
    (["--remove_heads=0:1", "--order=gradient"], "--order goes with"),
    (["--remove_heads=0:7"], "head (0, 7) does not exist"),
    (["--remove_heads=zero"], "LAYER:HEAD"),
])
def test_script_bad_input_exits_2(tiny_run, tmp_path, subprocess_env, args,
                                  message):
  out = tmp_path / "out"
  before = _listing(tiny_run.workdir)
  result = _run(subprocess_env, SCRIPT, f"--workdir={tiny_run.workdir}",
                f"--save_pruned={out}", *args)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert lines[0].startswith("prune_heads.py: error: ")
  assert os.listdir(tmp_path) == []  # nothing written
  assert _listing(tiny_run.workdir) == before


def test_script_refuses_to_overwrite_what_is_not_its_pruned_model(
    tiny_run, tmp_path, subprocess_env):
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / export.PROVENANCE_FILE).write_text(
      json.dumps({"source_workdir": str(tmp_path / "elsewhere")}))
  for out, message in [(other, "not a pruned model"),
                       (foreign, "another workdir"),
                       (tiny_run.workdir, "source workdir itself")]:
    before = _listing(out)
    result = _run(subprocess_env, SCRIPT, f"--workdir={tiny_run.workdir}",
                  "--remove_heads=0:1", f"--save_pruned={out}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert _listing(out) == before


def test_export_flags_without_save_pruned_exit_2(tiny_run, tmp_path,
                                                 subprocess_env):
  out = tmp_path / "study"
  result = _run(subprocess_env, SCRIPT, f"--workdir={tiny_run.workdir}",
                f"--out={out}", "--prune_fraction=0.5", "--order=gradient")
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "need --save_pruned" in lines[0], result.stderr
  assert not out.exists()
