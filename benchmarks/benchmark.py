r"""The benchmarks, one command: dispatches to the script of each job.

    python benchmarks/benchmark.py                  # benchmarks/cpu_benchmark.py
    python benchmarks/benchmark.py --quick          # the same, tiny shapes (a smoke test)
    python benchmarks/benchmark.py --end_to_end     # benchmarks/end_to_end_benchmark.py
    python benchmarks/benchmark.py --gpu            # benchmarks/accelerator_benchmark.py
    python benchmarks/benchmark.py --vmapped_seeds  # benchmarks/accelerator_benchmark.py --vmapped_seeds

Each job is its own script (run it directly for its own flags); the shared
helpers are ``benchmarks/benchmarking.py``. Each writes its results to
``benchmarks/results/`` unless ``--out`` says otherwise. This file checks
the flags (a bad one is one line on stderr and exit code 2) and replaces
itself with the job's script.
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

from mha.run import cli

_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny shapes, few repeats and XLA optimizations off: a "
    "smoke test of seconds whose numbers mean nothing.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_<job>_<commit>.json); the markdown tables go next to it (.md).")
_REPEATS = flags.DEFINE_integer(
    "repeats", None, "Timed rounds per comparison (default 20; 3 with "
    "--quick).", lower_bound=1)
_GPU = flags.DEFINE_bool(
    "gpu", False, "Run the accelerator section instead "
    "(benchmarks/accelerator_benchmark.py): ours vs Flax vs torch in float32 and "
    "bfloat16 up to length 4096, the fused path vs a direct cuDNN call, "
    "vmapped seeds. Needs a GPU; with --quick, tiny shapes on any device.")
_VMAPPED_SEEDS = flags.DEFINE_bool(
    "vmapped_seeds", False, "Run only the vmapped-seeds rows: the default "
    "config's train step, one model vs 4 trained together (any device).")
_END_TO_END = flags.DEFINE_bool(
    "end_to_end", False, "Instead of the timings above: spawn train.py "
    "processes, cold (a fresh compilation cache) and warm (the same config "
    "again), beside the import floor and the PyTorch peer, and time them "
    "from process start (with --quick: the tiny config, one round).")
_ROUNDS = flags.DEFINE_integer(
    "end_to_end_rounds", None, "Rounds of --end_to_end (default 3; 1 with "
    "--quick); the figures are medians over them.", lower_bound=1)
_PEER = flags.DEFINE_bool(
    "peer", True, "--end_to_end: also run the PyTorch peer "
    "(benchmarks/torch_peer.py) under --peer_python.")
_PEER_PYTHON = flags.DEFINE_string(
    "peer_python", None, "--end_to_end: the Python interpreter that runs the "
    "PyTorch peer, one that imports torch (default: this one, the peer left "
    "out if it cannot).")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "--end_to_end: the TFDS data directory (default: the "
    "config's data.data_dir); the data is prepared before any run is timed.")

_PROG = "benchmark.py"
_HERE = os.path.dirname(os.path.abspath(__file__))


def command() -> list[str]:
  """The job's script and its flags, from this script's parsed flags."""
  passed = lambda *names: [f"--{n}={flags.FLAGS[n].value}" for n in names
                           if flags.FLAGS[n].present]
  quick = ["--quick"] if _QUICK.value else []
  if _END_TO_END.value:
    return ["end_to_end_benchmark.py", *quick,
            *passed("out", "end_to_end_rounds", "data_dir", "peer_python"),
            *([] if _PEER.value else ["--nopeer"])]
  if _GPU.value or _VMAPPED_SEEDS.value:
    seeds = [] if _GPU.value else ["--vmapped_seeds"]
    return ["accelerator_benchmark.py", *quick, *seeds,
            *passed("out", "repeats")]
  return ["cpu_benchmark.py", *quick, *passed("out", "repeats")]


def _check_combination() -> None:
  """Flags of one job given with another's: one line and exit 2 (the job's
  script would drop them)."""
  given = lambda *names: [f"--{n}" for n in names if flags.FLAGS[n].present]
  if _END_TO_END.value:
    other = given("gpu", "vmapped_seeds", "repeats")
    if other:
      cli.fail(_PROG, f"--end_to_end does not take {', '.join(other)}")
  else:
    other = given("end_to_end_rounds", "peer", "peer_python", "data_dir")
    if other:
      cli.fail(_PROG, f"{', '.join(other)}: only with --end_to_end")
  if _GPU.value and _VMAPPED_SEEDS.value:
    cli.fail(_PROG, "give --gpu (every accelerator row) or --vmapped_seeds "
                    "(those rows alone), not both")


def main(argv: list[str]) -> None:
  del argv
  _check_combination()
  if _OUT.present:
    cli.checked_output_path(_PROG, _OUT.value, "benchmark.json")
  script, *args = command()
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable,
           [sys.executable, os.path.join(_HERE, script), *args])


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
