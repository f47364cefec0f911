"""Faults a user meets in the study and the grid (issue 59): SIGINT and
SIGTERM at any moment are one line and 128 + signum, and a rerun redoes at
most what was under way; estimates before long work; arguments checked
before any work; warnings explained or scoped.

The signals are sent by the process to itself at a named point
(``MHA_TEST_SIGNAL_AT``, :func:`mha.run.interrupt.reached`): no sleep, no
timing, no race."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

import numpy as np
import pytest

from conftest import run, tiny_config

from mha.run import interrupt
from mha.pruning.study import grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = os.path.join(ROOT, "scripts", "prune_heads.py")
GRID = os.path.join(ROOT, "scripts", "pruning_benchmark.py")
# A one-seed study as small as it goes: seconds.
_SMALL = ["--num_seeds=1", "--num_random_orders=3", "--num_bootstrap=20",
          "--nospeed", "--noplots", "--nokwon", "--noattribution"]


def _signal_at(env, phase: str) -> dict[str, str]:
  return dict(env, **{interrupt.TEST_ENV: phase})


def _one_line_no_traceback(stderr: str, prog: str, signame: str) -> None:
  assert "Traceback" not in stderr, stderr[-3000:]
  lines = [l for l in stderr.splitlines() if l.startswith(f"{prog}: ")]
  assert len(lines) == 1, stderr[-3000:]
  assert lines[0].startswith(f"{prog}: stopped by {signame}"), lines
  assert "the same command resumes" in lines[0], lines


@pytest.fixture
def sigint_not_ignored():
  """SIGINT as an interactive shell leaves it: a suite started in the
  background (``cmd &``) ignores it, and children inherit that, so a
  test's SIGINT would never reach them."""
  previous = signal.getsignal(signal.SIGINT)
  if previous is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def _held(folder) -> bool:
  return grid._is_held(str(folder))  # pylint: disable=protected-access


@pytest.mark.slow
def test_an_oracle_estimated_above_30_minutes_is_refused_unless_accepted(
    tiny_run, tmp_path, monkeypatch):
  from mha.pruning import oracle  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import StudyOptions  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import experiment  # pylint: disable=import-outside-toplevel
  # The estimate grows with the scored tokens and the cost of a token; the
  # character LM's 5-seed study (docs/kv_cache.md, 96 windows of 128) is
  # estimated under the 30 minutes that need --accept_estimate.
  from mha.model import TransformerConfig  # pylint: disable=import-outside-toplevel
  deep64 = TransformerConfig(vocab_size=11, num_layers=3, num_heads=4,
                             d_model=64, mlp_dim=64)
  one = oracle.expected_seconds(deep64, oracle.REFERENCE_POSITIONS)
  assert oracle.expected_seconds(deep64, 2 * oracle.REFERENCE_POSITIONS) > one
  assert oracle.expected_seconds(
      dataclasses.replace(deep64, mlp_dim=256),
      oracle.REFERENCE_POSITIONS) > one
  pylm = TransformerConfig(vocab_size=256, num_layers=3, num_heads=4,
                           d_model=128, mlp_dim=512, max_len=128,
                           causal=True)
  assert 5 * oracle.expected_seconds(pylm, 96 * 128) < oracle.ACCEPT_ABOVE_S
  # Given the windows, the layers below the last on each of their positions.
  below = oracle.expected_seconds(pylm, 96 * 128, 96)
  assert oracle.expected_seconds(pylm, 96 * 128) < below
  assert below < oracle.expected_seconds(pylm, 96 * 128, 192)
  assert 5 * below < oracle.ACCEPT_ABOVE_S
  # The tiny model's 16 subsets, estimated at an hour.
  monkeypatch.setattr(oracle, "expected_seconds",
                      lambda config, positions=None, examples=None: 3600.0)
  out = str(tmp_path / "pruning")
  options = StudyOptions(num_seeds=1)
  with pytest.raises(ValueError, match=(
      r"--oracle_max_heads=16: the oracle is every subset of 4 heads "
      r"\(2\*\*4 = 16\) for 1 model: about 1.0 h \(estimate, 2 CPU cores\) "
      r"and [0-9.]+ GiB, over 30 min; to run it, give --oracle_max_heads "
      r"explicitly with --accept_estimate, or lower --oracle_max_heads "
      r"below 4")):
    experiment.check_inputs(tiny_run.workdir, out, options)
  first = experiment.check_inputs(tiny_run.workdir, out, options,
                                  accept_estimate=True)
  assert experiment.estimate(first, options).startswith(
      "Estimate: the oracle is every subset of 4 heads")
  assert not os.path.exists(out)  # Nothing written.


def test_accept_estimate_needs_an_explicit_oracle_max_heads(
    tmp_path, subprocess_env):
  result = run([sys.executable, STUDY, f"--workdir={tmp_path}",
                "--accept_estimate"], env=subprocess_env, timeout=120)
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip() == (
      "prune_heads.py: error: --accept_estimate needs --oracle_max_heads "
      "given explicitly (the number of heads whose oracle you accept)")


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "trian"}, "split must be one of train, validation, test; got "
                         "'trian'"),
    ({"height": "big"}, "height must be an int >= 1 (pixels); got 'big'"),
    ({"num_examples": 0}, "num_examples must be an int >= 1; got 0"),
    ({"step": -1}, "step must be None (the newest) or an int >= 0; got -1"),
])
def test_show_checks_its_arguments_before_loading_anything(
    tmp_path, monkeypatch, kwargs, message):
  from mha import checkpoint  # pylint: disable=import-outside-toplevel
  from mha import explorer  # pylint: disable=import-outside-toplevel

  def no_loading(*args, **kw):
    raise AssertionError("loaded a checkpoint before checking arguments")
  monkeypatch.setattr(checkpoint, "load_checkpoint", no_loading)
  with pytest.raises(ValueError) as e:
    explorer.show(str(tmp_path), **kwargs)
  assert str(e.value) == message


def test_a_constant_shift_gives_p_0_without_a_warning():
  import warnings  # pylint: disable=import-outside-toplevel
  from mha.pruning import stats  # pylint: disable=import-outside-toplevel
  base = np.random.default_rng(0).random(50)
  shifted = base + 0.1
  shifted[0] += 1e-12  # Nearly identical differences: scipy's precision loss.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    p = stats.paired_ttest_pvalues(base, shifted[None])
  assert p[0] == pytest.approx(0.0, abs=1e-12)


def test_a_table_written_before_the_last_cell_ends_says_interim(tmp_path):
  from mha.pruning.study import StudyOptions  # pylint: disable=import-outside-toplevel
  root = str(tmp_path / "grid")
  cells = grid.cells(["reverse"], ["tiny"])
  grid.run_grid(root, cells, StudyOptions(num_seeds=1), log=lambda m: None,
                max_cells=0)
  table = json.loads((tmp_path / "grid" / "results.json").read_text())
  assert table["interim"] is True
  first = (tmp_path / "grid" / "leaderboard.md").read_text().splitlines()[0]
  assert first.startswith("# INTERIM table (0 of 1 cells finished")


def _without_timings(value):
  """``value`` without its timings (``timings``, ``*_s``, ``*seconds*``)."""
  if isinstance(value, dict):
    return {k: _without_timings(v) for k, v in value.items()
            if k != "timings" and not k.endswith("_s") and "seconds" not in k}
  if isinstance(value, list):
    return [_without_timings(v) for v in value]
  return value


def test_a_kept_analysis_round_trips_exactly_and_only_under_its_key(tmp_path):
  from mha.pruning.study import kept_analyses  # pylint: disable=import-outside-toplevel
  kept = {"result": {"a": np.arange(3.0), "nan": float("nan"), "n": None,
                     "t": (1, "x"), "s": np.float32(0.1), "i": np.int64(4),
                     "__array__": 1},
          "statistics": {("all", "oracle", "auc"): np.ones((2, 3), bool)}}
  rng = np.random.default_rng(0)
  rng.random(5)
  path = str(tmp_path / "seed_0" / kept_analyses.FILE)
  kept_analyses.save(path, "key", kept, rng)
  fresh, lines = np.random.default_rng(1), []
  assert kept_analyses.load(path, "another key", fresh, lines.append) is None
  assert "computing it again" in lines[0]
  back = kept_analyses.load(path, "key", fresh, lines.append)
  assert fresh.random() == rng.random()  # The generator where it was.
  np.testing.assert_array_equal(back["result"].pop("a"), np.arange(3.0))
  assert np.isnan(back["result"].pop("nan"))
  assert back["result"] == {"n": None, "t": (1, "x"), "s": np.float32(0.1),
                            "i": np.int64(4), "__array__": 1}
  assert type(back["result"]["s"]) is np.float32
  (stat_key, stat), = back["statistics"].items()
  assert stat_key == ("all", "oracle", "auc") and stat.dtype == bool
  assert os.listdir(tmp_path / "seed_0") == [kept_analyses.FILE]
  with open(path, "r+b") as f:  # Damaged: computed again, said in a line.
    f.truncate(100)
  assert kept_analyses.load(path, "key", fresh, lines.append) is None
  assert "does not read" in lines[-1]


@pytest.mark.parametrize("heads_per_layer", [(2, 2), (3, 1, 2), (4,)])
def test_the_searches_evaluate_as_many_subsets_as_their_estimate_says(
    heads_per_layer):
  from mha.model import TransformerConfig  # pylint: disable=import-outside-toplevel
  from mha.pruning import searches  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import StudyOptions  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import analysis  # pylint: disable=import-outside-toplevel
  config = TransformerConfig(
      vocab_size=8, max_len=4, num_layers=len(heads_per_layer),
      num_heads=heads_per_layer, head_dim=4, d_model=16, mlp_dim=8)
  weights = np.random.default_rng(0).random(config.max_heads * len(
      heads_per_layer))
  counted = []

  def value_fn(masks):  # A value no search finds at once: swaps improve it.
    counted.append(len(masks))
    flat = masks.reshape(len(masks), -1)
    return flat @ weights + 0.3 * np.sin(7 * flat.sum(1))
  for top, rounds in ((8, 4), (2, 1), (1, 0)):
    counted.clear()
    searches.layer_surrogate(value_fn, config, top=top, polish_rounds=rounds)
    low, high = searches.surrogate_evaluations(config, top=top,
                                               polish_rounds=rounds)
    assert low <= sum(counted) <= high
  for width in (1, 3, 100):
    counted.clear()
    searches.beam_search(value_fn, config, width=width)
    bound = searches.beam_evaluations(config, width=width)
    assert sum(counted) <= bound
    if width == 100:  # Every subset kept: exactly 2**N.
      assert sum(counted) == bound == 2 ** sum(heads_per_layer)
  line = analysis.search_estimate(config, StudyOptions(), 0.5e-3)
  assert line.startswith("  Estimate: the searches evaluate ")
  assert "ms each (measured): about " in line


# Every public entry of mha.patching, mha.pruning and mha.nnx that takes a
# count or a size, with the argument and its smallest allowed value.
_COUNTS = {
    "mha.patching": {"position_patch_masks": {"length": 1},
                     "every_position": {"length": 1}},
    "mha.nnx": {"MultiHeadAttention": {"num_heads": 1}},
    "mha.pruning.core": {
        "gradient_importance": {"batch_size": 1},
        "evaluate_masks": {"batch_size": 1, "chunk_size": 1},
        "evaluate_masks_loop": {"batch_size": 1},
        "leave_one_out": {"batch_size": 1}, "all_but_one": {"batch_size": 1},
        "attention_confidence": {"batch_size": 1},
        "iterative_gradient_order": {"batch_size": 1},
        "random_orders": {"num_orders": 0}, "pruning_counts": {"num_heads": 0}},
    "mha.pruning.oracle": {
        "evaluate_subsets": {"batch_size": 1},
        "subset_totals": {"batch_size": 1, "rows": 1},
        "call_shape": {"batch_size": 1}, "oracle_bytes": {"rows": 1},
        "ranked_removals": {"top": 1}, "table_bytes": {"num_examples": 0},
        "oracle_applies": {"max_heads": 1}, "removals_by_variant": {"top": 1},
        "oracle_removals": {"batch_size": 1},
        "evaluate_oracle": {"batch_size": 1}},
    "mha.pruning.gates": {"train_gates": {"steps": 1},
                          "train_exact_k": {"steps": 1},
                          "removal_of_size": {"count": 0}},
    "mha.pruning.kwon": {"fisher_blocks": {"batch_size": 1}, "search": {"k": 0}},
    "mha.pruning.mean_ablation": {
        "head_means": {"batch_size": 1},
        "evaluate_masks": {"batch_size": 1, "chunk_size": 1}},
    "mha.pruning.ablation": {"position_means": {"batch_size": 1},
                             "attribution": {"batch_size": 1},
                             "batched": {"batch_size": 1}},
    "mha.pruning.orderings": {"attribution_baselines": {"batch_size": 1},
                              "measure_importance": {"batch_size": 1},
                              "compute_orders": {"batch_size": 1}},
    "mha.pruning.retrain": {"retrain_config": {"steps": 1},
                            "scratch_b_steps": {"train_steps": 1},
                            "stack": {"count": 1},
                            "example_sums": {"batch_size": 1}},
    "mha.pruning.searches": {
        "layer_surrogate": {"top": 1, "polish_rounds": 0},
        "beam_search": {"width": 1},
        "surrogate_evaluations": {"top": 1, "polish_rounds": 0},
        "beam_evaluations": {"width": 1}},
    "mha.pruning.shapley": {"sampled_shapley": {"num_heads": 1},
                            "interaction_pairs": {"top": 1}},
    "mha.pruning.stats": {"example_weights": {"num_examples": 1},
                          "seed_weights": {"num_seeds": 1},
                          "seed_t_weights": {"num_seeds": 1},
                          "interval_method": {"num_seeds": 1}},
    "mha.pruning.speed": {"rotation": {"num_models": 1},
                          "run_rounds": {"num_models": 1}},
    "mha.pruning.export": {"heads_of_order": {"batch_size": 1}},
}


@pytest.mark.parametrize("module, function, argument, minimum", [
    (m, f, a, v) for m, functions in _COUNTS.items()
    for f, args in functions.items() for a, v in args.items()])
def test_a_count_is_checked_before_anything_is_loaded_or_computed(
    module, function, argument, minimum):
  import importlib  # pylint: disable=import-outside-toplevel
  import inspect  # pylint: disable=import-outside-toplevel
  fn = getattr(importlib.import_module(module), function)
  # Every other argument None: touching any of them would fail otherwise.
  signature = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
  kwargs = {p.name: None for p in signature.parameters.values()
            if p.default is p.empty and p.name != "self" and p.kind not in (
                p.VAR_POSITIONAL, p.VAR_KEYWORD)}
  for bad in (minimum - 1, "2", 2.0, True):
    with pytest.raises(ValueError) as e:
      out = fn(**{**kwargs, argument: bad})
      if inspect.isgenerator(out):  # Checked as the first batch is asked.
        next(out)
    assert str(e.value) == (f"{argument} must be an int >= {minimum}; got "
                            f"{bad!r}") or str(e.value).startswith(
                                f"{argument} must be None ("), str(e.value)


def test_batch_sizes_of_the_speed_table_are_checked_first():
  from mha.pruning import speed  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="batch_sizes must be a non-empty "
                     "sequence of ints >= 1; got"):
    speed.speed_table(None, None, None, None, fractions=None,
                      batch_sizes=[8, 0])


# Kill moments of a two-seed study, in the order the study meets them, each
# for one run: the second seed's training (after a step, during a save), the
# first seed's analysis, the second's (the rerun redoes the first and keeps
# it), the report. Phases count within one process: ``#2`` is the second
# time that rerun reaches it.
# The stops of the chaos test, in the order a study meets them: kill -9
# (``-SIGKILL``) at five moments, and SIGTERM and SIGINT (one line, 128 +
# signum) where the work kept by then must survive them too.
_STUDY_STOPS = (
    ({interrupt.TEST_ENV: "train#7:SIGKILL"}, -signal.SIGKILL),
    ({"MHA_TEST_KILL_AT": "20:during_save"}, -signal.SIGKILL),
    ({interrupt.TEST_ENV: "analysis#1:SIGKILL"}, -signal.SIGKILL),
    # The first seed's analysis is kept, the second one's killed.
    ({interrupt.TEST_ENV: "analysis#2:SIGKILL"}, -signal.SIGKILL),
    # The first seed's analysis reused: the second seed's is the first one
    # reached now.
    ({interrupt.TEST_ENV: "analysis#1"}, 128 + signal.SIGTERM),
    ({interrupt.TEST_ENV: "report:SIGINT"}, 128 + signal.SIGINT),
    ({interrupt.TEST_ENV: "report:SIGKILL"}, -signal.SIGKILL),
)


@pytest.mark.slow
def test_chaos_kill_9_through_a_two_seed_study_then_it_ends_as_if_never_killed(
    tmp_path, data_dir, subprocess_env, sigint_not_ignored):
  # tiny on one layer: the study's kills and reruns are under test, not the
  # model, and each of its nine processes traces and loads half the layers.
  from mha import train  # pylint: disable=import-outside-toplevel
  config = tiny_config(data_dir, "model.num_layers=1")
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  killed_out, plain_out = tmp_path / "killed", tmp_path / "plain"
  options = [f"--workdir={workdir}", *_SMALL, "--num_seeds=2",
             "--mean_ablation"]
  plain = run([sys.executable, STUDY, f"--out={plain_out}", *options],
              env=subprocess_env, timeout=600)
  assert plain.returncode == 0, plain.stderr[-3000:]
  assert plain.stdout.count("distinct masks on validation") == 2
  # The only two-seed study through the script: the run's seed and the
  # next one, trained by the study in its own folder.
  first = config.seed
  seeds = json.loads((plain_out / "results.json").read_text())["seeds"]
  assert [s["seed"] for s in seeds] == [first, first + 1]
  assert seeds[1]["config"]["seed"] == first + 1
  assert (plain_out / "seeds" / f"seed_{first + 1}" / "checkpoints").is_dir()
  # Each seed's searches are estimated first (issue 59).
  estimate = plain.stdout.find("  Estimate: the searches evaluate ")
  assert -1 < estimate < plain.stdout.find("surrogate search")
  args = [sys.executable, STUDY, f"--out={killed_out}", *options]
  for stop, code in _STUDY_STOPS:
    stopped = run(args, env=dict(subprocess_env, **stop), timeout=600)
    assert stopped.returncode == code, (stop, stopped.stderr[-3000:])
    if code > 0:  # SIGTERM or SIGINT: one line, the lock let go.
      signame = signal.Signals(code - 128).name
      _one_line_no_traceback(stopped.stderr, "prune_heads.py", signame)
      assert not (killed_out / "run.lock").exists() or not _held(killed_out)
    if code == 128 + signal.SIGTERM:  # Only the first seed's analysis kept.
      seeds = killed_out / "seeds"
      assert (seeds / f"seed_{first}" / "analysis.npz").exists()
      assert not (seeds / f"seed_{first + 1}" / "analysis.npz").exists()
  again = run(args, env=subprocess_env, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Traceback" not in again.stderr, again.stderr[-3000:]
  # Both seeds' analyses were kept by the stops before, so none is redone
  # (nor their analyses of the earlier checkpoint, over training).
  reused = [l for l in again.stdout.splitlines()
            if "reusing its analysis kept in" in l]
  assert sum(l.endswith("analysis.npz") for l in reused) == 2, again.stdout
  assert "distinct masks on validation" not in again.stdout
  resumed, uninterrupted = (
      _without_timings(json.loads((o / "results.json").read_text()))
      for o in (killed_out, plain_out))
  resumed.pop("workdir", None), uninterrupted.pop("workdir", None)
  assert resumed == uninterrupted
  assert (killed_out / "report.md").exists()
  rows = [json.loads(l) for l in (killed_out / "seeds" /
          f"seed_{first + 1}" / "metrics.jsonl").open()]
  steps = [r["step"] for r in rows if "loss" in r]
  assert steps == sorted(set(steps)), steps  # One row per step.


@pytest.mark.slow
def test_the_study_runs_on_a_grouped_decoder_scoring_its_answers(
    tmp_path, data_dir, subprocess_env):
  """The head study on a decoder (issue 57) scores the positions the task's
  weights choose: its unpruned validation figures are the training run's
  own (answer tokens of a recall task). On a GQA model it also prunes whole
  KV groups, with the head-level study's keys. One layer of 4 query heads
  in 2 groups, since what each study traces and compiles (programs of this
  test alone) grows with the layers; the groups' layout over layers and a
  decoder's oracle through the layers below the last are tested on
  2-layer models (test_pruning_kv_groups.py, test_pruning_oracle.py,
  test_streaming_ablation.py)."""
  from configs import default  # pylint: disable=import-outside-toplevel
  from mha import train  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "mqar")
  train.train_and_evaluate(default.get_config(
      f"tiny,mqar,model.num_layers=1,model.num_heads=4,gqa,num_train_steps=2,"
      f"data.data_dir={data_dir},data.context_length=24,data.num_pairs=2,"
      "data.num_train_examples=64,data.num_eval_examples=16,"
      "eval_batch_size=16,batch_size=8"), workdir)
  out = tmp_path / "pruning"
  result = run([sys.executable, STUDY, f"--workdir={workdir}",
                f"--out={out}", *_SMALL, "--noover_training",
                "--nosearches", "--noreestimate", "--nobootstrap_importance"],
               env=subprocess_env)
  assert result.returncode == 0, result.stderr[-3000:]
  seed = json.loads((out / "results.json").read_text())["seeds"][0]
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  final = [r for r in rows if "validation/loss" in r][-1]
  unpruned = seed["oracle"][0]["validation"]
  for key in ("loss", "token_accuracy", "exact_match"):
    np.testing.assert_allclose(unpruned[key], final[f"validation/{key}"],
                               rtol=1e-5)
  assert [e["k"] for e in seed["oracle"]] == list(range(5))  # 4 heads
  groups = seed["kv_groups"]  # 1 layer of 2 groups of 2 query heads
  assert groups["num_groups"] == 2 and groups["heads_per_group"] == [2]
  assert [e["k"] for e in groups["oracle"]] == list(range(3))
  # The unpruned model at both levels (one of them may come from the table
  # of every subset, the other from its mask: float32 rounding apart).
  for key, value in seed["oracle"][0]["validation"].items():
    np.testing.assert_allclose(groups["oracle"][0]["validation"][key], value,
                               rtol=1e-6)
  # Removing every group is removing every head.
  for split in ("validation", "test"):
    np.testing.assert_allclose(groups["oracle"][2][split]["token_accuracy"],
                               seed["oracle"][4][split]["token_accuracy"])
  for name in ("oracle", "random"):  # the head-level study's keys
    assert set(groups["curve_summary"][name]) <= set(
        seed["curve_summary"][name])
  assert "prunable_heads_token_accuracy" in groups["curve_summary"]["oracle"]
  assert "## KV groups" in (out / "report.md").read_text()
  # Issue 58: the same model under the streaming ablation (context 24).
  kv_out = tmp_path / "kv"
  result = run([sys.executable, STUDY, f"--workdir={workdir}",
                f"--out={kv_out}", *_SMALL, "--noover_training",
                "--nosearches", "--noreestimate", "--nobootstrap_importance",
                "--ablation=streaming:2,4", "--duo_gates_steps=8"],
               env=subprocess_env)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads((kv_out / "results.json").read_text())
  streamed = results["seeds"][0]
  assert results["ablation"] == "streaming:2,4"
  assert results["options"]["duo_gates_steps"] == 8
  np.testing.assert_allclose(  # k full heads of 4 at 24 tokens, 6 kept
      streamed["kv_memory"], [(k * 24 + (4 - k) * 6) / (4 * 24)
                              for k in range(4, -1, -1)])
  assert streamed["curves"]["oracle"]["kv_memory"] == streamed["kv_memory"]
  # The groups stream too: the KV memory counts groups (2 of them), and a
  # group streaming is its query heads streaming, so none streaming and all
  # streaming are the head level's (float32 rounding apart).
  groups = streamed["kv_groups"]
  assert groups["ablation"] == "streaming:2,4"
  np.testing.assert_allclose(groups["kv_memory"], [
      (k * 24 + (2 - k) * 6) / (2 * 24) for k in range(2, -1, -1)])
  assert groups["curves"]["oracle"]["kv_memory"] == groups["kv_memory"]
  for g, h in ((0, 0), (2, 4)):
    for split in ("validation", "test"):
      for key, value in streamed["oracle"][h][split].items():
        np.testing.assert_allclose(groups["oracle"][g][split][key], value,
                                   rtol=1e-5, atol=1e-7)
  # The published KV scores order the groups too, each group by its heads.
  from mha import checkpoint  # pylint: disable=import-outside-toplevel
  from mha.pruning import kv_groups  # pylint: disable=import-outside-toplevel
  config = checkpoint.load_checkpoint(workdir).model_config
  for name in ("retrieval_score", "echo", "induction", "headkv",
               "attention_distance", "duo_gates"):
    np.testing.assert_array_equal(
        groups["orders"][name],
        kv_groups.induced_order(config, streamed["orders"][name]))
    assert "prunable_heads_token_accuracy" in groups["curve_summary"][name]
  report = (kv_out / "report.md").read_text()
  assert "KV memory kept there" in report
  assert "DuoAttention gates, by group" in report
  for name in ("retrieval_score", "echo", "induction", "headkv",
               "attention_distance", "duo_gates"):
    assert name in streamed["importance"] and name in streamed["orders"]
    assert name in streamed["curve_summary"]
  for key in ("loss", "token_accuracy", "exact_match"):  # all heads full
    np.testing.assert_allclose(streamed["oracle"][0]["validation"][key],
                               unpruned[key], rtol=1e-5)
  assert "## KV cache: which heads need their whole context" in (
      kv_out / "report.md").read_text()


def test_max_examples_keeps_evenly_spaced_examples_of_validation_and_test(
    data_dir):
  from mha.pruning.study import StudyOptions  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import experiment  # pylint: disable=import-outside-toplevel
  config = tiny_config(data_dir)
  full = experiment.study_splits(config, StudyOptions())
  cut = experiment.study_splits(config, StudyOptions(max_examples=5))
  for name in ("validation", "test"):
    rows = np.linspace(0, len(full[name]) - 1, 5).round().astype(int)
    np.testing.assert_array_equal(cut[name].inputs, full[name].inputs[rows])
    np.testing.assert_array_equal(cut[name].targets, full[name].targets[rows])
  assert len(cut["train"]) == len(full["train"])
  with pytest.raises(ValueError, match="--max_examples must be >= 0"):
    StudyOptions(max_examples=-1).validate()
