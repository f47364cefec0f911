r"""Coverage of the sampled Shapley values' intervals against the exact ones.

    python scripts/shapley_coverage.py --workdir runs/reverse --workdir runs/deep
    python scripts/shapley_coverage.py --workdir runs/wide --examples 200

For each workdir's model, on its validation split (its first ``--examples``
examples), every subset of heads is evaluated once, per example
(``mha.pruning.oracle.evaluate_subsets(..., per_example=True)``). The exact
Shapley value of each head (validation token accuracy) comes from that table,
and so do ``--repeats`` independent sampled estimates
(:func:`mha.pruning.shapley.sampled_shapley`, ``--pairs`` antithetic pairs of
permutations each, the study's value function: each example's share of the
token accuracy), looked up in the table instead of evaluated through the
model (the same numbers, far faster). Reports the share of (repeat, head)
intervals that contain the exact value, with a 95% bootstrap interval over the
repeats (heads within one repeat share its orders, so the repeats are the
independent units), and the lowest per-head coverage.

The exact values are those of the examples the intervals were computed on;
the intervals also count the sampling of examples (``var_examples / n``), so
they are wider than the permutation sampling alone needs.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np

from mha.run import cli

_PROG = "shapley_coverage.py"

def _define_flags() -> None:
  """The command line's flags, defined only when run as a program (the
  tests import :func:`coverage` beside other scripts' flags)."""
  flags.DEFINE_multi_string(
      "workdir", None, "A trained run's workdir (repeat for several).")
  flags.DEFINE_integer("repeats", 200, "Sampled estimates per model.",
                       lower_bound=2)
  flags.DEFINE_integer("pairs", 32, "Antithetic pairs of permutations per "
                       "estimate (the study's --shapley_pairs).",
                       lower_bound=2)
  flags.DEFINE_integer(
      "examples", None, "Use the first N validation examples (default: "
      "all; at least 2, for a variance).", lower_bound=2)
  flags.DEFINE_string("out", "runs/benchmarks/shapley_coverage.json",
                      "Results file (JSON); the table goes beside it (.md).")


def _bootstrap(per_repeat: np.ndarray, resamples: int = 4000
               ) -> tuple[float, float]:
  """95% percentile interval of the mean of ``per_repeat`` (the share of
  heads covered in each repeat), resampling the repeats: heads within one
  repeat share its orders, so the repeats are the independent units."""
  rng = np.random.default_rng(0)
  idx = rng.integers(0, len(per_repeat), (resamples, len(per_repeat)))
  means = per_repeat[idx].mean(axis=1)
  return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def coverage(workdir: str, repeats: int, pairs: int,
             examples: int | None) -> dict:
  """Coverage of ``repeats`` sampled estimates on one model."""
  # pylint: disable=import-outside-toplevel
  from mha import build
  from mha import checkpoint
  from mha import data
  from mha import head_masks
  from mha.pruning import core
  from mha.pruning import oracle
  from mha.pruning import shapley
  ckpt = checkpoint.load_checkpoint(workdir)
  config = ckpt.model_config
  val = data.scored_targets(data.load_splits(
      build.data_spec(ckpt.config), ckpt.config.data.data_dir)["validation"])
  if examples is not None:
    val = data.Split(val.inputs[:examples], val.targets[:examples])
  start = time.perf_counter()
  table = oracle.evaluate_subsets(ckpt.model, ckpt.params, val,
                                  per_example=True, batch_size=1000)
  table_s = time.perf_counter() - start
  n_heads = oracle.num_heads(config)
  flat = np.flatnonzero(head_masks.existing_heads(config))
  exact = oracle.shapley_values(
      core.summarize_examples(table)["token_accuracy"],
      config).reshape(-1)[flat]
  tokens = float(np.sum(val.inputs != 0))
  share = np.asarray(table["correct"], np.float64) * len(val) / tokens
  bits = 1 << np.arange(n_heads)

  def value_fn(kept: np.ndarray) -> np.ndarray:
    return share[np.asarray(kept, np.int64) @ bits]

  covered = np.zeros((repeats, n_heads), bool)
  widths = []
  for r in range(repeats):
    _, ci = shapley.sampled_shapley(value_fn, n_heads, num_pairs=pairs,
                                    rng=np.random.default_rng([7, r]))
    covered[r] = (ci[:, 0] <= exact) & (exact <= ci[:, 1])
    widths.append(float(np.mean(ci[:, 1] - ci[:, 0])))
  per_repeat = covered.mean(axis=1)
  rate = float(covered.mean())
  low, high = _bootstrap(per_repeat)
  return {"workdir": workdir, "heads": n_heads, "examples": len(val),
          "repeats": repeats, "pairs": pairs, "coverage": rate,
          "coverage_ci_repeats": [low, high],
          "coverage_min_head": float(covered.mean(axis=0).min()),
          "mean_interval_width": float(np.mean(widths)),
          "table_s": table_s}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  args = flags.FLAGS
  out = cli.checked_workdirs_and_out(_PROG, args.workdir, args.out,
                                     "shapley_coverage.json", load=True)
  rows = []
  for workdir in args.workdir:
    result = coverage(workdir, args.repeats, args.pairs, args.examples)
    rows.append(result)
    print(f"  {workdir}: {result['heads']} heads, coverage "
          f"{result['coverage']:.3f}", flush=True)
  lines = ["| model | heads | validation examples | repeats x pairs | "
           "coverage of nominal 95% | lowest head | mean width |",
           "|---|---:|---:|---|---|---:|---:|"]
  for r in rows:
    low, high = r["coverage_ci_repeats"]
    lines.append(
        f"| {os.path.basename(os.path.normpath(r['workdir']))} | {r['heads']} "
        f"| {r['examples']} | {r['repeats']} x {r['pairs']} | "
        f"{r['coverage']:.3f} [{low:.3f}, {high:.3f}] | "
        f"{r['coverage_min_head']:.3f} | {r['mean_interval_width']:.4f} |")
  table = "\n".join(lines) + "\n"
  print(table, end="")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump({"results": rows}, f, indent=1)
  with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
    f.write(table)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  _define_flags()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
