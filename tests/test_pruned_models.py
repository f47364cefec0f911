"""Pruned models saved as workdirs: mha.pruning.export and
``scripts/prune_heads.py --save_pruned``."""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run

import mha
from mha import build
from mha.run import cli
from mha.run import config_validation
from mha import data
from mha import head_masks
from mha.run import workdir_lock
from mha.pruning import ablation
from mha.pruning import core
from mha.pruning import export
from mha.pruning import orderings

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
  mask = jnp.asarray(head_masks.mask_without(ckpt.model_config, flat))
  return head_masks.masked_logits(ckpt.model, ckpt.params, inputs, mask)


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


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_optimizer_moments_are_pruned_like_the_params(tiny_run, source,
                                                      tmp_path):
  out = str(tmp_path / "pruned")
  os.mkdir(out)
  os.chmod(out, 0o750)  # An existing empty folder keeps its permissions.
  export.save_pruned(source, [(0, 1)], out, source=tiny_run.workdir)
  assert _mode(out) == 0o750
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
  # A pruned model of it, with a file of someone's beside it: kept.
  with pytest.raises(ValueError, match=r"changed since it was saved "
                                       r"\(notes.txt\)"):
    export.check_output_dir(other, workdir)
  (other / "notes.txt").unlink()
  export.check_output_dir(other, workdir)  # a pruned model of it: replace


def test_saving_again_replaces_the_previous_pruned_model(tiny_run, source,
                                                         tmp_path):
  out = tmp_path / "pruned"
  umask = os.umask(0o027)
  try:
    export.save_pruned(source, [(0, 0), (0, 1)], out,
                       source=tiny_run.workdir)
  finally:
    os.umask(umask)
  assert _mode(out) == 0o750  # as os.makedirs makes it (not mkdtemp's 700)
  (out / "eval").mkdir()  # what eval.py would add to the first model
  out.chmod(0o705)
  export.save_pruned(source, [(1, 1)], out, source=tiny_run.workdir)
  assert _mode(out) == 0o705  # the replaced folder's own
  assert export.read_provenance(out)["removed"] == [[1, 1]]
  assert not (out / "eval").exists()
  assert mha.load_checkpoint(out).model_config.heads_per_layer == (2, 1)
  assert sorted(os.listdir(tmp_path)) == ["pruned"]  # no staging left over


def test_a_pruned_model_trained_in_place_is_not_replaced(tiny_run, source,
                                                          tmp_path):
  # Fine-tuned where it was saved (train.py --workdir on the pruned model):
  # its later checkpoints and metrics are not save_pruned's to delete.
  out = tmp_path / "pruned"
  export.save_pruned(source, [(0, 0)], out, source=tiny_run.workdir)
  step = export.read_provenance(out)["source_step"]
  (out / "checkpoints" / str(step + 10)).mkdir()
  (out / "metrics.jsonl").write_text("{}\n")
  before = _tree(out)
  with pytest.raises(config_validation.ConfigError,
                     match=f"trained or changed since it was saved "
                           rf"\(metrics.jsonl, checkpoints/{step + 10}\)"):
    export.save_pruned(source, [(1, 1)], out, source=tiny_run.workdir)
  assert _tree(out) == before
  assert export.read_provenance(out)["removed"] == [[0, 0]]


def test_a_head_that_does_not_exist_writes_nothing(tiny_run, source,
                                                   tmp_path):
  with pytest.raises(ValueError, match=r"head \(0, 7\) does not exist"):
    export.save_pruned(source, [(0, 7)], tmp_path / "out",
                       source=tiny_run.workdir)
  assert os.listdir(tmp_path) == []


def _tree(path) -> list[str]:
  """Every folder and file under ``path``."""
  return sorted(os.path.relpath(os.path.join(d, name), path)
                for d, dirs, files in os.walk(path) for name in dirs + files)


def test_output_dirs_that_may_not_be_written_are_refused_first(
    tiny_run, source, tmp_path, monkeypatch):
  """An empty --save_pruned, the current directory or a folder holding it
  (replaced whole: it was deleted), a folder holding the source, a file in
  the way, a run's checkpoints (a resume deletes them): refused with one
  line before anything is written."""
  workdir = os.path.realpath(tiny_run.workdir)
  base = tmp_path.resolve()
  run = base / "run"  # another run: config.json beside its checkpoints
  (run / "checkpoints" / "10").mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"model": {}, "data": {}}))
  (base / "afile").write_text("x")
  cwd = base / "cwd"
  cwd.mkdir()
  cwd.chmod(0o751)
  monkeypatch.chdir(cwd)
  before, listing = os.stat(cwd), _tree(base)
  source_before = _tree(workdir)
  cases = [
      ("", "--save_pruned is empty; name a new folder for the pruned model"),
      ("  ", "--save_pruned is empty"),
      (".", f"--save_pruned {cwd} is the current directory; it would be "
            "replaced whole"),
      ("..", f"--save_pruned {base} holds the current directory {cwd}"),
      (os.path.dirname(workdir),
       f"holds the source workdir {workdir}; it would be replaced"),
      ("../afile/sub", f"cannot use --save_pruned {base}/afile/sub: "
                       f"{base}/afile is a file, not a folder"),
      (run / "checkpoints" / "10", f"--save_pruned {run}/checkpoints/10 is "
       f"inside the checkpoints of the run in {run}, which a resume"),
      (run / "checkpoints", f"--save_pruned {run}/checkpoints is the "
       f"checkpoints folder of the run in {run}"),
      (run / "checkpoints" / "new" / "x", "is inside the checkpoints"),
      (os.path.join(workdir, "checkpoints"), "is the checkpoints folder"),
  ]
  for out, message in cases:
    with pytest.raises(config_validation.ConfigError) as error:
      export.save_pruned(source, [(0, 1)], out, source=workdir)
    assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(config_validation.ConfigError):
      _request(tiny_run, out, remove_heads="0:1")
  after = os.stat(cwd)
  assert (after.st_ino, _mode(cwd)) == (before.st_ino, 0o751)
  assert _tree(base) == listing and _tree(workdir) == source_before


def test_a_folder_that_takes_no_writes_is_refused_first(tiny_run, source,
                                                        read_only_dir):
  folder = os.path.realpath(read_only_dir)
  out = os.path.join(folder, "pruned")
  with pytest.raises(workdir_lock.WorkdirUnusableError) as error:
    export.save_pruned(source, [(0, 1)], out, source=tiny_run.workdir)
  message = str(error.value)
  assert message.startswith(f"cannot use --save_pruned {out}: ")
  assert message.endswith(f": {folder}") and "\n" not in message
  assert os.listdir(read_only_dir) == []


def test_heads_for_fraction(source):
  config = source.model_config  # 4 heads
  order = np.array([3, 0, 2, 1])
  assert export.heads_for_fraction(config, order, 0.0) == []
  assert export.heads_for_fraction(config, order, 0.5) == [(1, 1), (0, 0)]
  assert len(export.heads_for_fraction(config, order, 1.0)) == 4
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    export.heads_for_fraction(config, order, 1.5)


# --------------------------------------------------------------------------
# What --save_pruned --prune_fraction --order removes.
# --------------------------------------------------------------------------


def _pairs(config, flat) -> list[tuple[int, int]]:
  return sorted(head_masks.flat_to_pairs(config, np.asarray(flat, np.int64)))


def _first_two(scores: np.ndarray) -> list[tuple[int, int]]:
  """The two heads of lowest score (``[L, H]``): removed first."""
  flat = scores.reshape(-1)
  ranked = np.argsort(flat, kind="stable")
  return sorted((int(i) // scores.shape[1], int(i) % scores.shape[1])
                for i in ranked[:2])


def _shapley(values: np.ndarray, n: int) -> np.ndarray:
  """Shapley values from the textbook formula: ``values[s]`` is v of the
  subset whose bit ``i`` says head ``i`` is kept."""
  phi = np.zeros(n)
  for i in range(n):
    for s in range(2 ** n):
      if not s >> i & 1:
        size = bin(s).count("1")
        weight = (math.factorial(size) * math.factorial(n - size - 1)
                  / math.factorial(n))
        phi[i] += weight * (values[s | 1 << i] - values[s])
  return phi


@pytest.fixture(scope="module")
def subsets(source, splits):
  """Validation metrics of every subset of the 4 heads, with plain
  ``core.evaluate_masks``: mask ``s`` keeps head ``i`` (``2 * layer + head``)
  iff bit ``i`` of ``s`` is set."""
  masks = np.array([[[s >> (2 * layer + head) & 1 for head in range(2)]
                     for layer in range(2)] for s in range(16)], np.float32)
  return core.evaluate_masks(source.model, source.params,
                             splits["validation"], masks)


@pytest.fixture(scope="module")
def scores(source, splits, subsets):
  """Per head ``[L, H]``, computed here from the model with mha.pruning.core
  only (not through the study): lower is removed first in each ordering."""
  model, params = source.model, source.params
  config, validation = source.model_config, splits["validation"]
  grad = core.gradient_importance(model, params, validation)
  attention = core.attention_confidence(model, params, validation)
  loss_without = np.array([subsets["loss"][15 - (1 << i)] for i in range(4)])
  # Fisher importance: the mean over examples of the squared per-example
  # mask gradient, from core's per-example gradients (jitted: op by op, the
  # vmapped gradient took 4 s of CPU, jitted 0.6 s).
  full = jnp.asarray(head_masks.full_head_mask(config))
  grads = np.asarray(jax.jit(core.head_mask_gradients, static_argnums=0)(
      model, params, jnp.asarray(validation.inputs),
      jnp.asarray(validation.targets), full), np.float64)
  fisher = np.mean(grads ** 2, axis=0)
  # Attribution patching: the estimated loss increase under each baseline.
  baselines = orderings.attribution_baselines(model, params, validation)
  attribution = {f"attribution_{name}": ablation.attribution(
      model, params, validation, abl) for name, abl in baselines.items()}
  return {
      **attribution,
      "fisher": fisher,
      "gradient": grad,
      "gradient_l2": core.normalize_per_layer(grad),
      "reverse_gradient": -grad,
      "leave_one_out": loss_without.reshape(2, 2),
      "confidence": attention["confidence"],
      "entropy": -attention["entropy"],
      "shapley": _shapley(subsets["token_accuracy"], 4).reshape(2, 2),
  }


@pytest.mark.parametrize("order", [o for o in export.ORDERS
                                   if o not in ("oracle",
                                                "gradient_iterative")])
def test_heads_of_order_are_its_least_important(source, splits, scores,
                                                order):
  removed = sorted(export.heads_of_order(
      source.model, source.params, splits["validation"], order, 0.5,
      batch_size=1000, oracle_max_heads=12))
  values = scores[order]
  kept = [(l, h) for l in range(2) for h in range(2) if (l, h) not in removed]
  assert len(removed) == 2
  # Every removed head scores at most every kept one. The study's gradient
  # is the two validation halves' weighted mean: equal to the whole's up to
  # float64 rounding of float32 sums (1e-6 relative is far above it).
  slack = 1e-6 * np.max(np.abs(values))
  assert max(values[p] for p in removed) <= min(values[p] for p in kept) + (
      slack), (order, values)


def test_gradient_iterative_removes_the_reestimated_order(source, splits):
  # --order gradient_iterative computes it without --reestimate too.
  removed = export.heads_of_order(source.model, source.params,
                                  splits["validation"], "gradient_iterative",
                                  0.5, batch_size=1000, oracle_max_heads=12)
  expected = core.iterative_gradient_order(source.model, source.params,
                                           splits["validation"])
  assert sorted(removed) == _pairs(source.model_config, expected[:2])


def test_oracle_removes_the_best_pair_on_validation(source, splits, subsets):
  removed = export.heads_of_order(source.model, source.params,
                                  splits["validation"], "oracle", 0.5,
                                  batch_size=1000, oracle_max_heads=12)
  assert len(removed) == 2
  accuracy = subsets["token_accuracy"]
  kept = lambda pairs: sum(1 << (2 * l + h) for l, h in pairs)
  everything = kept([(0, 0), (0, 1), (1, 0), (1, 1)])
  best = max(accuracy[everything - kept(pair)]
             for pair in itertools.combinations(
                 [(0, 0), (0, 1), (1, 0), (1, 1)], 2))
  # Same masks through the same evaluate_masks: equal, not close.
  assert accuracy[everything - kept(removed)] == best


@pytest.mark.parametrize("order", export.SUBSET_ORDERS)
def test_subset_orders_above_oracle_max_heads_are_refused_first(source,
                                                                order):
  with pytest.raises(cli.UsageError, match="--oracle_max_heads=3"):
    export.check_order(source.model_config, order,
                       oracle_max_heads=3)  # the model has 4
  # Refused before any data is touched (there is none to touch).
  with pytest.raises(cli.UsageError, match="2\\^4 subsets"):
    export.heads_of_order(source.model, source.params, None, order, 0.5,
                          batch_size=1000, oracle_max_heads=3)
  export.check_order(source.model_config, "gradient", oracle_max_heads=3)
  export.check_order(source.model_config, order, oracle_max_heads=4)


# --------------------------------------------------------------------------
# The export flags, checked before anything is loaded or written.
# --------------------------------------------------------------------------


def _request(tiny_run, out, *, remove_heads="", prune_fraction=None,
             order=None):
  return export.check_request(out, tiny_run.workdir,
                              remove_heads=remove_heads,
                              prune_fraction=prune_fraction, order=order)


def test_check_request_accepts(tiny_run, tmp_path):
  out = tmp_path / "out"
  assert _request(tiny_run, out, remove_heads="0:1,1:0") == (
      [(0, 1), (1, 0)], None)
  for order in export.ORDERS:
    assert _request(tiny_run, out, prune_fraction=0.5, order=order) == (
        [], order)
  assert _request(tiny_run, out, prune_fraction=0.0, order="gradient")[1]
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"prune_fraction": 1.5, "order": "gradient"}, "[0, 1]"),
    ({"prune_fraction": -0.1, "order": "gradient"}, "[0, 1]"),
    ({"prune_fraction": 0.5, "order": "nonsense"}, "is not one of"),
    ({"prune_fraction": 0.5, "order": "random"}, "is not one of"),
    ({"prune_fraction": 0.5}, "needs --order"),
    ({"prune_fraction": 0.5, "order": "gradient", "remove_heads": "0:1"},
     "exactly one of"),
    ({}, "exactly one of"),
    ({"remove_heads": "0:1", "order": "gradient"}, "--order goes with"),
    ({"remove_heads": "zero"}, "LAYER:HEAD"),
])
def test_check_request_refuses_bad_flags(tiny_run, tmp_path, kwargs,
                                         message):
  with pytest.raises(cli.UsageError) as error:
    _request(tiny_run, tmp_path / "out", **kwargs)
  assert message in str(error.value)
  assert os.listdir(tmp_path) == []


def test_check_request_needs_save_pruned(tiny_run):
  with pytest.raises(cli.UsageError, match="need --save_pruned"):
    _request(tiny_run, None, prune_fraction=0.5, order="gradient")


def test_check_request_refuses_what_is_not_its_pruned_model(tiny_run,
                                                            tmp_path):
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
    with pytest.raises(ValueError, match=message):
      _request(tiny_run, out, remove_heads="0:1")
    assert _listing(out) == before


# --------------------------------------------------------------------------
# The command lines: only what needs a process of its own.
# --------------------------------------------------------------------------


def _run(env, program, *args, timeout=300):
  return run([sys.executable, program, *args], timeout=timeout, env=env,
             cwd=ROOT)


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
      head_masks.mask_without(source.model_config, [0, 1])[None])
  # Same examples, logits equal to ~1e-6: the loss agrees to float32
  # rounding; an argmax could flip only on a near-tie (none expected).
  assert metrics["loss"] == pytest.approx(float(masked["loss"][0]), abs=1e-5)
  assert metrics["token_accuracy"] == pytest.approx(
      float(masked["token_accuracy"][0]), abs=1e-9)
  assert metrics["step"] == source.step


def test_script_prunes_a_fraction_of_an_order(tiny_run, source, scores,
                                              tmp_path, subprocess_env):
  out = str(tmp_path / "pruned")
  result = _run(subprocess_env, SCRIPT, f"--workdir={tiny_run.workdir}",
                "--prune_fraction=0.5", "--order=gradient",
                f"--save_pruned={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  provenance = export.read_provenance(out)
  assert provenance["order"] == "gradient"
  assert provenance["prune_fraction"] == 0.5
  # Half of the 4 heads: the two of least gradient importance on validation
  # (computed here with core; no tie among them on this model).
  grad = scores["gradient"]
  assert len(np.unique(grad)) == 4
  assert provenance["removed"] == [list(p) for p in _first_two(grad)]
  loaded = mha.load_checkpoint(out)
  assert sum(loaded.model_config.heads_per_layer) == 2


@pytest.mark.parametrize("args, message", [
    # Found by the flags alone; the study's --out is not created either.
    (["--prune_fraction=0.5", "--order=gradient", "--out={out}"],
     "need --save_pruned"),
    # Found once the checkpoint is read, still before anything is written.
    (["--remove_heads=0:7", "--save_pruned={out}"],
     "head (0, 7) does not exist"),
    # From an empty current directory, which a model saved there replaced
    # (the directory deleted).
    (["--remove_heads=0:1", "--save_pruned="], "--save_pruned is empty"),
    (["--workdir="], '--workdir is empty; name a folder ("." for the current '
                     'one)'),
])
def test_script_bad_input_is_one_line_exit_2_nothing_written(
    tiny_run, tmp_path, subprocess_env, args, message):
  out = tmp_path / "out"
  cwd = tmp_path / "cwd"  # empty
  cwd.mkdir()
  before, cwd_before = _listing(tiny_run.workdir), os.stat(cwd)
  result = run(
      [sys.executable, SCRIPT, f"--workdir={tiny_run.workdir}",
       *[a.format(out=out) for a in args]],
      timeout=300, env=subprocess_env, cwd=cwd)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert lines[0].startswith("prune_heads.py: error: ")
  assert os.listdir(tmp_path) == ["cwd"]  # nothing written
  cwd_after = os.stat(cwd)
  assert os.listdir(cwd) == [] and (cwd_after.st_ino, cwd_after.st_mode) == (
      cwd_before.st_ino, cwd_before.st_mode)
  assert _listing(tiny_run.workdir) == before
