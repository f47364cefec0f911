"""Tests of the benchmarks (benchmarks/benchmark.py dispatches to them):
they run and report; none asserts a time."""

import datetime
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import run

from benchmarks import benchmarking
from mha import attention_kernels
from mha.run import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCHMARKS, "benchmark.py")


@pytest.fixture(scope="module")
def bench():
  """The CPU benchmark as a module (its flags are defined once per process)."""
  from benchmarks import cpu_benchmark  # Defines its flags: import it once.
  return cpu_benchmark


def _run(env, *args, cwd=ROOT):
  # The entry points' environment (CPU, as in CI): on a machine with a GPU,
  # ``--gpu`` would otherwise run the whole accelerator benchmark, and the
  # quick run's float32 comparisons would see XLA's TF32 matmuls.
  return run([sys.executable, SCRIPT, *args], cwd=cwd, env=env, timeout=300)


def test_quick_run_prints_and_writes_the_tables(tmp_path, subprocess_env):
  out = tmp_path / "bench" / "result.json"
  res = _run(subprocess_env, "--quick", f"--out={out}")
  assert res.returncode == 0, res.stderr
  table = res.stdout
  assert table.startswith("Device: ")
  for row in ("| forward+backward, weights out | 2 / 8 / 16 / 2 |",
              "| inference, no weights | 2 / 8 / 16 / 2 |",
              "| weights out | 2 / 16 / 32 / 4 |",
              "| no weights | 2 / 16 / 32 / 4 |",
              "| tiny | 2 / 16 / 2 / 32 |"):
    assert row in table, table
  assert (tmp_path / "bench" / "result.md").read_text() == table

  results = json.loads(out.read_text())
  _check_record(results, "cpu_quick")
  assert results["quick"] and results["plan"]["name"] == "quick"
  (layer,) = results["layer"]
  for kind in ("fwd_bwd_weights", "inference"):
    assert len(layer[kind]["ours_times_ms"]) == 3
    assert layer[kind]["ratio"] > 0
  # Ours and Flax's compute the same thing on the same parameters (float32
  # sums of a few dozen terms: 1e-5 relative is ~100 ulps).
  assert max(layer["max_relative_diff"].values()) < 1e-5
  assert results["flop_rate"]["forward"]["fraction_of_peak"] > 0
  (step,) = results["train"]
  assert step["steps_per_s"] > 0
  assert step["tokens_per_s"] == pytest.approx(step["steps_per_s"] * 32 * 8)
  # The study's mask sets, two ways each: the same losses (float32 means
  # over the quick split: 1e-5 is ~100 ulps), both rows in the table.
  masks = results["pruning_masks"]
  heads = masks["heads"]
  loo, subsets = masks["leave_one_out"], masks["subsets"]
  assert loo["masks"] == heads + 1 and subsets["masks"] == 2 ** heads
  for entry in (loo, subsets):
    assert entry["speedup"] > 0 and entry["max_abs_loss_diff"] < 1e-5
  assert (f"| leave-one-out: vmapped vs loop of jitted calls | {loo['masks']} "
          "|") in table
  assert (f"| every subset: layer by layer vs evaluate_masks | "
          f"{subsets['masks']} |") in table
  assert (f"| pruning masks ({heads} heads, {masks['examples']} examples) |"
          in table)


@pytest.mark.parametrize("args, message", [
    (["--repeats=0"], "--repeats=0"),
    (["--no_such_flag"], "no_such_flag"),
    (["positional"], "unexpected arguments"),
    (["--gpu"], "--gpu needs a GPU"),
])
def test_bad_command_line_is_one_line_and_exit_2(args, message, tmp_path,
                                                subprocess_env):
  res = _run(subprocess_env, *args, f"--out={tmp_path / 'b.json'}")
  assert res.returncode == 2
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], res.stderr
  assert not (tmp_path / "b.json").exists()


def test_out_must_not_be_a_directory(tmp_path, subprocess_env):
  res = _run(subprocess_env, f"--out={tmp_path}")
  assert res.returncode == 2
  assert "is a directory" in res.stderr


def test_time_interleaved_alternates_the_order():
  calls = []
  fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
  times = benchmarking.time_interleaved(fns, repeats=4)
  assert calls[:3] == list("abc")  # untimed warm-up (compilation)
  assert calls[3:] == list("abccbaabccba")
  assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}


def test_forward_flops_count_the_matmuls_xla_counts(bench):
  shape = bench.Shape(batch=2, length=16, width=32, heads=4)
  ours, _, x, params = bench._layers(shape)
  compiled = jax.jit(ours.apply).lower(params, x).compile()
  xla = bench._xla_flops(compiled)
  if xla is None:
    pytest.skip("this backend's cost analysis counts no FLOPs")
  analytic = bench.forward_flops(shape)
  # XLA also counts biases, scaling and the softmax (O(B H L L) and
  # O(B L D) elementwise work); at this shape that is under 10% more.
  assert analytic <= xla <= 1.1 * analytic


def test_accelerator_section_compares_the_same_function():
  # A tiny plan in-process: every side computes the same attention on the
  # same parameters, and the tables name every row. (The vmapped-seeds part
  # is left out: compiling its two train steps took 20 s on the loaded
  # 2-core machine, more than the rest; `benchmark.py --vmapped_seeds` runs
  # it.)
  from benchmarks import accelerator_benchmark as acc
  plan = acc.AcceleratorPlan(
      name="quick", shapes=(acc.LayerShape(2, 8, 16, 2),),
      dtypes=("bfloat16",), repeats=1, num_seeds=0, fused_masks=("lengths",))
  results = acc.run(plan, benchmarking.time_interleaved)
  (layer,), (fused,) = results["layers"], results["fused"]
  diffs = layer["max_relative_diff"]
  # bfloat16 keeps 8 significant bits: weights agree to ~2 ulps (1e-2).
  assert diffs["weights_flax"] < 1e-2 and diffs["inference_flax"] < 1e-2
  assert diffs["weights_lse"] < 1e-2
  if layer["torch"] is not None:
    assert diffs["weights_torch"] < 1e-2
  # The device's own rule: XLA on a CPU; cuDNN for these bfloat16 heads on
  # an H100 (2026-11-27, where this test expected "xla" and failed).
  facts = attention_kernels.device_facts()
  expected = attention_kernels.select_implementation(
      facts, dtype=jnp.bfloat16, head_dim=8, value_head_dim=8, q_len=8,
      kv_len=8, mask_form="lengths")
  if facts.platform != "cuda" or facts.cudnn_version is None:
    assert expected == "xla"
  elif facts.compute_capability in ("9.0", "10.0"):  # Hopper, Blackwell
    assert expected == "cudnn"  # bfloat16 heads of 8, key lengths
  assert fused["implementation"] == expected
  assert max(fused["max_relative_diff"].values()) < 1e-2
  assert "seeds" not in results
  table = "\n".join(acc.format_tables(results))
  assert ("| forward+backward, weights out | bfloat16 | 2 / 8 / 16 / 2 |"
          in table)
  assert (f"| fwd_bwd | bfloat16 | 2 / 8 / 16 / 2 | {expected} | lengths |"
          in table)
  assert "seeds trained together" not in table


_COVERAGE_AND_ORACLE = [os.path.join("benchmarks", "oracle_benchmark.py"),
                        os.path.join("scripts", "shapley_coverage.py")]


@pytest.mark.parametrize("script", _COVERAGE_AND_ORACLE)
@pytest.mark.parametrize("args, message", [
    ((), "give at least one --workdir"),
    (("--workdir=/nowhere",), "--workdir /nowhere holds no checkpoints"),
    (("--workdir=/nowhere", "--no_such_flag"), "no_such_flag"),
])
def test_pruning_benchmarks_refuse_bad_input_in_one_line(script, args, message,
                                                         tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, script), *args],
      cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr
  prog = os.path.basename(script)
  assert lines[0].startswith(f"{prog}: error: ") and message in lines[0]
  assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.parametrize("script", _COVERAGE_AND_ORACLE)
def test_pruning_benchmarks_refuse_a_run_whose_checkpoints_are_all_damaged(
    script, tmp_path, subprocess_env):
  broken = tmp_path / "broken"
  (broken / "checkpoints" / "5").mkdir(parents=True)  # emptied by a crash
  out = tmp_path / "out" / "b.json"
  result = run([sys.executable, os.path.join(ROOT, script),
                f"--workdir={broken}", f"--out={out}"], cwd=tmp_path,
               env=subprocess_env, timeout=120)
  # The warnings of the damaged checkpoints (as eval.py prints them), then
  # one line of error; no traceback.
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2, result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  prog = os.path.basename(script)
  assert lines[-1].startswith(f"{prog}: error: --workdir {broken}: ")
  assert "damaged" in lines[-1]
  assert not out.parent.exists()


def test_oracle_benchmark_refuses_an_ablation_the_model_cannot_take(
    tiny_run, tmp_path, subprocess_env):
  script = os.path.join(ROOT, "benchmarks", "oracle_benchmark.py")
  out = tmp_path / "out" / "o.json"
  for spec, message in [
      ("streaming:4", "streaming"),  # malformed
      ("streaming:4,16", "needs a causal decoder")]:  # tiny is an encoder
    result = run([sys.executable, script, f"--workdir={tiny_run.workdir}",
                  f"--ablation={spec}", f"--out={out}"], cwd=tmp_path,
                 env=subprocess_env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("oracle_benchmark.py: error: --ablation: ")
    assert message in lines[0], lines
  assert not out.parent.exists()


def test_end_to_end_benchmark_refuses_a_data_dir_that_is_a_file(
    tmp_path, subprocess_env):
  (tmp_path / "afile").write_text("kept")
  result = run([sys.executable,
                os.path.join(BENCHMARKS, "end_to_end_benchmark.py"),
                "--quick", "--nopeer", f"--data_dir={tmp_path / 'afile'}",
                f"--out={tmp_path / 'e.json'}"], cwd=tmp_path,
               env=subprocess_env, timeout=120)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert lines[0] == (f"end_to_end_benchmark.py: error: --data_dir "
                      f"{tmp_path / 'afile'} is a file, not a folder")
  assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_benchmark_refuses_flags_of_another_job(tmp_path):
  for args, message in [
      (("--end_to_end", "--gpu"), "--end_to_end does not take --gpu"),
      (("--end_to_end", "--repeats=3"), "--end_to_end does not take --repeats"),
      (("--gpu", "--vmapped_seeds"), "not both"),
      (("--nopeer",), "--peer: only with --end_to_end"),
      (("--peer_python=python3",), "--peer_python: only with --end_to_end"),
      (("--end_to_end_rounds=2",),
       "--end_to_end_rounds: only with --end_to_end")]:
    result = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == f"benchmark.py: error: {message}" or (
        message in lines[0]), lines[0]
  assert os.listdir(tmp_path) == []


def test_output_paths_are_checked_before_any_work(tmp_path, monkeypatch):
  # Every benchmark's and script's --out (mha.run.cli.output_path): the JSON
  # goes there, the table (.md) and plot (.png) beside it under the same name.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "afile").write_text("")
  assert cli.output_path("r/x.json") == str(tmp_path / "r" / "x.json")
  for out, message in [
      ("", "--out is empty"), (str(tmp_path), "is a directory"),
      ("x.md", "ends in .md"), ("x.PNG", "ends in .png"),
      ("afile/x.json", f"{tmp_path / 'afile'} is a file, not a folder")]:
    with pytest.raises(ValueError, match=message):
      cli.output_path(out)
  assert sorted(os.listdir(tmp_path)) == ["afile"]
  # A workdir whose checkpoints folder is empty holds no checkpoints.
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  with pytest.raises(SystemExit) as exit_:
    cli.checked_workdirs_and_out("prog", [str(tmp_path / "run")], "x.json")
  assert exit_.value.code == 2


def test_results_go_to_dated_files_of_the_commit(tmp_path, monkeypatch):
  # By default benchmarks/results/<UTC date>_<name>_<short commit>.json; a
  # second run of the same day, name and commit never overwrites the first.
  commit = benchmarking.commit()
  assert commit == "unknown" or (4 <= len(commit) <= 40 and commit.isalnum())
  monkeypatch.setattr(benchmarking, "RESULTS", str(tmp_path))
  monkeypatch.setattr(benchmarking, "commit", lambda: "abc1234")
  day = datetime.datetime(2026, 11, 28, 23, 59, tzinfo=datetime.timezone.utc)
  first = benchmarking.default_out("cpu", day)
  assert first == str(tmp_path / "2026-11-28_cpu_abc1234.json")
  open(first, "w", encoding="utf-8").close()
  assert benchmarking.default_out("cpu", day) == str(
      tmp_path / "2026-11-28_cpu_abc1234_2.json")
  # Outside a git repository the commit is "unknown".
  monkeypatch.undo()
  monkeypatch.setattr(benchmarking, "ROOT", str(tmp_path))
  monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
  assert benchmarking.commit() == "unknown"
  assert benchmarking.uncommitted_changes() is None


def _check_record(results, name):
  """The fields every result file starts with (benchmarking.record)."""
  assert results["benchmark"] == name
  datetime.datetime.strptime(results["date_utc"], "%Y-%m-%dT%H:%M:%SZ")
  assert results["commit"]
  assert results["uncommitted_changes"] in (True, False, None)
  assert results["environment"]["jax"] == jax.__version__
  assert results["environment"]["backend"] == "cpu"
  assert results["host"]["threads"] >= 1
  assert {"load_average_start", "load_average_end"} <= set(results)


def test_a_config_argument_mistake_is_one_line_and_exit_2(tmp_path,
                                                         subprocess_env):
  script = os.path.join(BENCHMARKS, "compile_benchmark.py")
  for arg, message in [
      ("tny", "--config_arg=tny: unknown config variant 'tny'"),
      ("configs/default.py:tiny", "give get_config's argument (the part "
                                  "after the colon, e.g. 'tiny')"),
      ("tiny,batch_size=0", "batch_size=0 must be >= 1")]:
    result = run([sys.executable, script, f"--config_arg={arg}"],
                 cwd=tmp_path, timeout=120, env=subprocess_env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("compile_benchmark.py: error: ")
    assert message in lines[0], lines[0]
  assert os.listdir(tmp_path) == []


def test_determinism_check_refuses_bad_input_in_one_line(tmp_path):
  script = os.path.join(BENCHMARKS, "determinism_check.py")
  for args, message in [
      (("--steps=3",), "--steps must be an even number >= 2, got 3"),
      (("--dropout=1",), "--dropout must be in [0, 1), got 1.0"),
      (("--out=/dev/null/r.json",),
       "--out /dev/null/r.json: /dev/null is a file, not a folder"),
      (("--out=r.md",), "ends in .md"),
      (("--data_dir=/dev/null",), "--data_dir /dev/null is a file"),
      (("--no_such_flag",), "no_such_flag"),
      (("extra",), "unexpected arguments: extra")]:
    result = subprocess.run([sys.executable, script, *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("determinism_check.py: error: ")
    assert message in lines[0], lines[0]
  assert os.listdir(tmp_path) == []  # nothing written


def test_compile_benchmark_reports_the_three_programs(tmp_path,
                                                     subprocess_env):
  # Without --out, the JSON and the table go to benchmarks/results/, named by
  # the UTC date, the benchmark and the commit (here a copy of benchmarks/
  # outside git: the repository's results stay as they are, and the commit
  # is "unknown"). One layer: the report's shape is under test, and its
  # three programs compile faster.
  copy = tmp_path / "repo"
  shutil.copytree(BENCHMARKS, copy / "benchmarks",
                  ignore=shutil.ignore_patterns("results", "__pycache__"))
  result = run(
      [sys.executable, os.path.join("benchmarks", "compile_benchmark.py"),
       "--config_arg=tiny,model.num_layers=1", "--rounds=1", "--steps=3"],
      cwd=copy, env=subprocess_env, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  (path,) = (copy / "benchmarks" / "results").glob("*.json")
  date, name = path.name.split("_", 1)
  assert name == "compile_unknown.json"
  results = json.loads(path.read_text())
  _check_record(results, "compile")
  assert date == results["date_utc"][:10]
  assert results["commit"] == "unknown"
  assert results["uncommitted_changes"] is None
  report = results["programs"]
  assert set(report) == {"initial state", "train step", "evaluation"}
  for program in report.values():
    assert program["compile_wall_s"] > 0 and program["compile_cpu_s"] > 0
    assert program["hlo_lines"] > 0 and program["kernels"] > 0
  step = report["train step"]
  assert step["steps_per_s"] > 0
  # --steps=3: one timed window of the 3 steps, one call a step.
  assert (step["steps_per_window"], step["windows_timed"]) == (3, 1)
  assert "| train step |" in result.stdout
  assert "one call a step" in result.stdout
  assert path.with_suffix(".md").read_text() == result.stdout


def test_end_to_end_benchmark_quick_with_the_peer(tmp_path, data_dir,
                                                  subprocess_env):
  # The PyTorch peer runs under --peer_python (torch is no dependency of
  # mha: MHA_PEER_PYTHON names an interpreter with torch, by default this
  # one); without torch, --nopeer leaves it out.
  out = tmp_path / "e2e.json"
  peer_python = os.environ.get("MHA_PEER_PYTHON", sys.executable)
  with_peer = subprocess.run([peer_python, "-c", "import torch, numpy"],
                             capture_output=True, check=False).returncode == 0
  result = run([sys.executable, SCRIPT, "--end_to_end", "--quick",
                f"--out={out}", f"--data_dir={data_dir}",
                *([f"--peer_python={peer_python}"] if with_peer
                  else ["--nopeer"])],
               cwd=ROOT, env=subprocess_env, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  results = json.loads(out.read_text())
  _check_record(results, "end_to_end_quick")
  e2e = results["end_to_end"]
  runs = e2e["runs"]
  (cold,), (warm,) = runs["cold"], runs["warm"]
  # The warm run loads every program the cold run compiled from the
  # compilation cache.
  assert cold["run"]["from_cache"] == 0
  assert warm["run"]["from_cache"] == warm["run"]["programs"] > 0
  for one in (cold, warm, *runs.get("peer", [])):
    assert 0 < one["first_step_s"] < one["exit_s"]
    assert one["step_ms"] > 0  # the progress windows' ms a step
  assert "| train.py, warm (same config again) |" in result.stdout
  assert results["end_to_end"]["summary"]["ratios"][
      "warm_first_step_over_floor"] > 0
  if with_peer:
    (peer,) = runs["peer"]
    assert peer["environment"]["torch"]
    assert "| PyTorch peer (`nn.TransformerEncoder`) |" in result.stdout
  else:
    assert "peer" not in runs and e2e["peer_note"] == "--nopeer"


def test_end_to_end_benchmark_refuses_a_peer_python_without_torch(
    tmp_path, subprocess_env):
  # A --peer_python named that cannot import torch is a mistake, found before
  # any run (here: an interpreter that does not exist).
  missing = tmp_path / "no" / "python"
  result = run([sys.executable, os.path.join(BENCHMARKS,
                                             "end_to_end_benchmark.py"),
                "--quick", f"--peer_python={missing}",
                f"--out={tmp_path / 'e.json'}"], cwd=tmp_path,
               env=subprocess_env, timeout=120)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert lines[0].startswith(f"end_to_end_benchmark.py: error: --peer_python "
                             f"{missing}")
  assert os.listdir(tmp_path) == []


def test_decode_benchmark_compares_the_cache_with_recomputing(tmp_path,
                                                              subprocess_env):
  script = os.path.join(BENCHMARKS, "decode_benchmark.py")
  out = tmp_path / "decode.json"
  result = run([sys.executable, script, "--length=8", "--d_model=16",
                "--heads=2", "--kv_heads=1", "--mlp_dim=32", "--vocab=11",
                "--repeats=1", f"--out={out}"], cwd=tmp_path,
               env=subprocess_env, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  results = json.loads(out.read_text())
  _check_record(results, "decode")
  measured = results["measured"]
  assert measured["same_tokens"] is True
  assert measured["ratio_generate"] > 0 and measured["ratio_token"] > 0
  assert "| generating 8 tokens (one scan) |" in result.stdout
  result = run([sys.executable, script, "--heads=3", "--kv_heads=2",
                "--d_model=12"], cwd=tmp_path, env=subprocess_env, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip() == ("decode_benchmark.py: error: --kv_heads=2 "
                                   "does not divide --heads=3")


@pytest.mark.slow  # a subprocess compiling three scans
def test_mixed_cache_benchmark_measures_memory_against_the_formula(
    tmp_path, subprocess_env):
  script = os.path.join(BENCHMARKS, "mixed_cache_benchmark.py")
  out = tmp_path / "mixed.json"
  result = run([sys.executable, script, "--contexts=32", "--sinks=2",
                "--window=4", "--batch=2", "--repeats=1", f"--out={out}"],
               cwd=tmp_path, env=subprocess_env, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  results = json.loads(out.read_text())
  _check_record(results, "mixed_cache")
  (speed,) = results["speed"]
  # One full head of 8 at 32 positions, the others 6: the formula exactly.
  assert speed["kv_memory"] == pytest.approx((32 + 7 * 6) / (8 * 32))
  assert speed["kv_memory"] == pytest.approx(speed["kv_memory_formula"])
  assert all(v > 0 for v in speed["tokens_per_second"].values())
  result = run([sys.executable, script, "--contexts=16", "--sinks=4",
                "--window=16"], cwd=tmp_path, env=subprocess_env, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip() == ("mixed_cache_benchmark.py: error: every "
                                   "context must exceed --sinks + --window")
  result = run([sys.executable, script, "--num_kv_heads=3"], cwd=tmp_path,
               env=subprocess_env, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip() == ("mixed_cache_benchmark.py: error: "
                                   "--num_kv_heads must divide the 4 heads, "
                                   "got 3")
