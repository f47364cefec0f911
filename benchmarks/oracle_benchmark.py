r"""Time and memory of the exhaustive oracle: streamed against the table.

    python benchmarks/oracle_benchmark.py --workdir runs/deep --workdir runs/wide
    python benchmarks/oracle_benchmark.py --workdir runs/wide --rounds 1 --nobaseline
    python benchmarks/oracle_benchmark.py --workdir runs/pylm --nobaseline \
        --ablation streaming:4,16 --max_examples 96

For each workdir's model, on its validation split as the pruning study reads
it (a decoder's scored positions, ``--max_examples`` evenly spaced windows
where set), every subset of heads is evaluated once per round by each
method under ``--ablation``, each run in a process of its own
(so that its peak memory is its own), the methods alternating in order from
round to round:

* ``streamed``: :func:`mha.pruning.oracle.subset_totals`, the study's oracle
  (sums over the examples only, ``O(2**N)`` memory), then the metrics, the
  oracle's candidates and exact Shapley values from them;
* ``table``: the per-example table the study used before
  (``evaluate_subsets(..., per_example=True)``, ``[2**N, n]`` per metric),
  then the same selection from its sums: the peer.

Per method it reports the median seconds (the oracle, compiling included, as
the study's ``timings.oracle_s``), the median peak resident memory of the
whole process (``ru_maxrss``), the median CPU seconds of the process over the
same span (``time.process_time``, all its threads), and for ``streamed`` the
seconds per subset and example, the number that says how the cost grows with ``N`` (it is ``2**N``
times that per example). Writes everything to ``--out`` (JSON; by default
``benchmarks/results/<UTC date>_oracle_<commit>.json``) and the table beside
it (.md).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

# Run as a file, the path holds this folder, not the repository's root: put
# it first, for the ``benchmarks`` package (which is not installed) and this
# checkout's ``mha`` (whose commit the results record).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags
from absl import logging

from mha.run import cli

from benchmarks import benchmarking

_PROG = "oracle_benchmark.py"

_WORKDIRS = flags.DEFINE_multi_string(
    "workdir", None, "A trained run's workdir (repeat the flag for several).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds (a process per method "
                               "and round); the figures are medians.",
                               lower_bound=1)
_BASELINE = flags.DEFINE_boolean(
    "baseline", True, "Also time the per-example table (the peer).")
_OUT = flags.DEFINE_string("out", None,
                           "Results file (JSON; default: benchmarks/results/"
                           "<UTC date>_oracle_<commit>.json); the table goes "
                           "beside it (.md).")
_ABLATION = flags.DEFINE_string(
    "ablation", "zero", "What a removed head becomes, as the study's "
    "--ablation: zero, mean, mean_position, resample or "
    "streaming:SINKS,WINDOW (a causal decoder's KV cache).")
_MAX_EXAMPLES = flags.DEFINE_integer(
    "max_examples", 0, "Validation cut to this many evenly spaced examples, "
    "as the study's --max_examples (0: all).", lower_bound=0)
_ONE = flags.DEFINE_string("one", None, "Internal: run one method, print "
                           "JSON (method:workdir).")

METHODS = ("streamed", "table")


def _one(method: str, workdir: str, spec: str, max_examples: int) -> dict:
  """One method on one model in this process under the ablation ``spec``,
  on validation cut to ``max_examples`` (0: all): seconds, peak memory."""
  # pylint: disable=import-outside-toplevel
  import numpy as np
  from mha import checkpoint
  from mha import evaluate as eval_lib
  from mha.pruning import ablation as ablation_lib
  from mha.pruning import core
  from mha.pruning import oracle
  from mha.pruning.study import experiment
  from mha.pruning.study import StudyOptions
  ckpt = checkpoint.load_checkpoint(workdir)
  val = experiment.study_splits(
      ckpt.config, StudyOptions(max_examples=max_examples))["validation"]
  start, cpu = time.perf_counter(), time.process_time()
  ablation = ablation_lib.build(ckpt.model, ckpt.params, spec, val, val)
  if method == "streamed":
    metrics = eval_lib.summarize(oracle.subset_totals(
        ckpt.model, ckpt.params, val, batch_size=1000, ablation=ablation))
  else:
    metrics = core.summarize_examples(oracle.evaluate_subsets(
        ckpt.model, ckpt.params, val, batch_size=1000, per_example=True,
        ablation=ablation))
  oracle.removals_by_variant(oracle.subset_values(metrics),
                             ckpt.model_config)
  oracle.shapley_values(metrics["token_accuracy"], ckpt.model_config)
  seconds = time.perf_counter() - start
  cpu = time.process_time() - cpu
  n = oracle.num_heads(ckpt.model_config)
  return {"method": method, "workdir": workdir, "heads": n,
          "ablation": spec, "examples": len(val),
          "scored_positions": int(oracle.tokens(val)), "seconds": seconds,
          "cpu_seconds": cpu,
          "peak_rss_mb": resource.getrusage(
              resource.RUSAGE_SELF).ru_maxrss / 1024,
          "best_k1": float(np.max(metrics["token_accuracy"][
              oracle.kept_counts(ckpt.model_config) == n - 1]))}


def _check_ablation(workdirs: list[str], spec: str) -> None:
  """One line and exit 2 unless ``spec`` is an ablation every workdir's model
  takes (``streaming`` on a causal decoder with a window shorter than its
  context), before any work."""
  # pylint: disable=import-outside-toplevel
  from mha import checkpoint
  from mha.pruning import ablation as ablation_lib
  # pylint: enable=import-outside-toplevel
  try:  # check_streaming parses the spec first: a malformed one fails too
    for workdir in workdirs:
      ckpt = checkpoint.load_checkpoint(workdir)
      ablation_lib.check_streaming(spec, ckpt.model_config,
                                   ckpt.model_config.max_len)
  except ValueError as e:
    cli.fail(_PROG, f"--ablation: {e}")


def _spawn(method: str, workdir: str) -> dict:
  result = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--one={method}:{workdir}",
       f"--ablation={_ABLATION.value}",
       f"--max_examples={_MAX_EXAMPLES.value}"],
      capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{method} on {workdir} failed:\n{result.stderr[-2000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  if _ONE.value:
    method, workdir = _ONE.value.split(":", 1)
    print(json.dumps(_one(method, workdir, _ABLATION.value,
                          _MAX_EXAMPLES.value)))
    return
  out = cli.checked_workdirs_and_out(
      _PROG, _WORKDIRS.value,
      _OUT.value or benchmarking.default_out("oracle"), "oracle.json",
      load=True)
  _check_ablation(_WORKDIRS.value, _ABLATION.value)
  results = benchmarking.record("oracle", rounds=_ROUNDS.value,
                                ablation=_ABLATION.value,
                                max_examples=_MAX_EXAMPLES.value)
  methods = METHODS if _BASELINE.value else METHODS[:1]
  runs: list[dict] = []
  for workdir in _WORKDIRS.value:
    for r in range(_ROUNDS.value):
      order = methods if r % 2 == 0 else methods[::-1]
      for method in order:
        run = _spawn(method, workdir)
        runs.append(run)
        print(f"  {workdir} {method} round {r + 1}: {run['seconds']:.1f} s, "
              f"CPU {run['cpu_seconds']:.1f} s, peak "
              f"{run['peak_rss_mb']:.0f} MB, 1-min load "
              f"{benchmarking.load_average()}", flush=True)
  rows = ["| model (heads) | method | oracle s (median) | runs | CPU s "
          "(median) | peak memory MB (median) | us per subset x example |",
          "|---|---|---:|---|---:|---:|---:|"]
  summary = []
  for workdir in _WORKDIRS.value:
    for method in methods:
      mine = [r for r in runs if r["workdir"] == workdir and r["method"] == method]
      s = statistics.median(r["seconds"] for r in mine)
      mem = statistics.median(r["peak_rss_mb"] for r in mine)
      cpu = statistics.median(r["cpu_seconds"] for r in mine)
      per = s / (2 ** mine[0]["heads"] * mine[0]["examples"]) * 1e6
      summary.append({"workdir": workdir, "method": method,
                      "heads": mine[0]["heads"], "median_s": s,
                      "median_cpu_s": cpu,
                      "median_peak_rss_mb": mem, "us_per_row": per})
      rows.append(f"| {os.path.basename(workdir)} ({mine[0]['heads']}) | "
                  f"{method} | {s:.1f} | "
                  f"{' / '.join(format(r['seconds'], '.1f') for r in mine)} | "
                  f"{cpu:.1f} | {mem:.0f} | {per:.2f} |")
  results["oracle"] = {"runs": runs, "summary": summary}
  results["load_average_end"] = benchmarking.load_average()
  header = benchmarking.header_lines(
      results, rounds=f"Medians of {_ROUNDS.value} rounds, a process per "
      "method and round, methods alternating.") + [""]
  table = "\n".join(header + rows) + "\n"
  benchmarking.write_results(out, results, table, print)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
