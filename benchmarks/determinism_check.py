r"""Are two training runs, and a resumed one, bitwise equal on this backend?

    # The default config with dropout, 200 steps:
    python benchmarks/determinism_check.py
    # The same under XLA's deterministic GPU ops:
    XLA_FLAGS=--xla_gpu_deterministic_ops=true \
        python benchmarks/determinism_check.py

Trains the default config (with dropout, so that resuming must redraw the
masks of the steps after its checkpoint) three times in one process on the
default device: twice from scratch, and once resumed from the first run's
middle checkpoint. Prints, for "second run" and "resumed run", whether every
parameter and optimizer-state leaf is bitwise equal to the first run's, and
otherwise how many leaves differ and the largest absolute difference, and
writes the result to ``--out`` (JSON; by default ``benchmarks/results/<UTC
date>_determinism_<commit>.json``). Exit code 0 either way: this measures, it
does not judge.

Those three runs share one process, so they share its compiled programs
(and, on a GPU, XLA's autotuning choices). A fourth, "resumed in a new
process", resumes the first run's middle checkpoint with ``train.py`` in a
subprocess (same device, same environment, no compilation cache), which
compiles and autotunes its programs again: it is what a run killed and
started again does. Only its parameters are compared (``load_checkpoint``).

On XLA:CPU both are bitwise equal (the suite checks it:
``tests/conftest.py``'s ``assert_same_bits``). XLA promises no bitwise-equal
runs on a GPU, where reductions may use atomics; ``XLA_FLAGS=
--xla_gpu_deterministic_ops=true`` is its switch for deterministic programs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

# Run as a file, the path holds this folder, not the repository's root: put
# it first, for the ``benchmarks`` package (which is not installed) and this
# checkout's ``mha`` (whose commit the results record).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags

from mha.run import cli

from benchmarks import benchmarking

_PROG = "determinism_check.py"
_STEPS = flags.DEFINE_integer("steps", 200, "Training steps of each run "
                              "(even; the resumed run starts at half).")
_DROPOUT = flags.DEFINE_float("dropout", 0.1, "Dropout and attention "
                              "dropout rate of the three runs.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory "
                                "(default: the config's).")
_OUT = flags.DEFINE_string("out", None, "The result's JSON path (default: "
                           "benchmarks/results/<UTC date>_determinism_"
                           "<commit>.json).")
_NEW_PROCESS = flags.DEFINE_bool(
    "new_process", True, "Also resume in a new process (train.py, no "
    "compilation cache) and compare its parameters.")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare(a: Any, b: Any) -> dict[str, Any]:
  """Leaf by leaf: how many of the trees' leaves differ, and by how much."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  differing, largest = 0, 0.0
  for x, y in zip(leaves_a, leaves_b, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if not np.array_equal(x, y):
      differing += 1
      if np.issubdtype(x.dtype, np.floating):
        largest = max(largest, float(np.max(np.abs(x.astype(np.float64)
                                                    - y.astype(np.float64)))))
  return {"bitwise_equal": differing == 0, "leaves": len(leaves_a),
          "leaves_differing": differing, "max_abs_difference": largest}


def _first_run_at_its_middle(root: str, name: str, steps: int) -> str:
  """A copy of the first run, ``root/name``, without its last checkpoint:
  a resume starts from the middle one."""
  workdir = os.path.join(root, name)
  shutil.copytree(os.path.join(root, "first"), workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(steps)))
  return workdir


def _resume_in_a_new_process(root: str, steps: int, overrides: Sequence[str],
                             data_dir: str, first: Any) -> dict[str, Any]:
  """The first run's middle checkpoint resumed by ``train.py`` in a
  subprocess without a compilation cache; its final parameters against the
  first run's."""
  import subprocess  # pylint: disable=import-outside-toplevel
  from mha import checkpoint  # pylint: disable=import-outside-toplevel
  workdir = _first_run_at_its_middle(root, "new_process", steps)
  config_arg = ",".join([*overrides, "compilation_cache_dir="])
  result = subprocess.run(
      [sys.executable, os.path.join(_ROOT, "train.py"), f"--workdir={workdir}",
       f"--config={os.path.join(_ROOT, 'configs', 'default.py')}:"
       f"{config_arg}", f"--config.data.data_dir={data_dir}"],
      capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"train.py failed to resume {workdir}:\n"
                       f"{result.stderr[-2000:]}")
  loaded = checkpoint.load_checkpoint(workdir)
  if loaded.step != steps:
    raise RuntimeError(f"train.py ended at step {loaded.step}, not {steps}")
  return compare(loaded.params, first.params)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    cli.fail(_PROG, f"unexpected arguments: {' '.join(argv[1:])}")
  if _STEPS.value < 2 or _STEPS.value % 2:
    cli.fail(_PROG, f"--steps must be an even number >= 2, got {_STEPS.value}")
  if not 0.0 <= _DROPOUT.value < 1.0:
    cli.fail(_PROG, f"--dropout must be in [0, 1), got {_DROPOUT.value}")
  out = benchmarking.checked_out(_PROG, _OUT.value, "determinism")
  data_dir = cli.data_dir(_PROG, _DATA_DIR.value)
  import jax  # pylint: disable=import-outside-toplevel
  from configs import default  # pylint: disable=import-outside-toplevel
  from mha import train  # pylint: disable=import-outside-toplevel

  steps, rate = _STEPS.value, _DROPOUT.value
  overrides = [f"num_train_steps={steps}", f"eval_every_steps={steps // 2}",
               f"checkpoint_every_steps={steps // 2}",
               f"model.dropout_rate={rate}",
               f"model.attention_dropout_rate={rate}"]
  config = default.get_config(",".join(overrides))
  if data_dir:  # Not an override: a path may hold a comma.
    config.data.data_dir = data_dir
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True)
  result = benchmarking.record("determinism", steps=steps, dropout=rate)
  root = tempfile.mkdtemp(prefix="determinism_")
  try:
    t0 = time.perf_counter()
    first = train.train_and_evaluate(config, os.path.join(root, "first"))
    second = train.train_and_evaluate(config, os.path.join(root, "second"))
    resumed = train.train_and_evaluate(
        config, _first_run_at_its_middle(root, "resumed", steps))
    legs = {"second_run": compare(second, first),
            "resumed_run": compare(resumed, first)}
    if _NEW_PROCESS.value:
      legs["resumed_in_a_new_process"] = _resume_in_a_new_process(
          root, steps, overrides, config.data.data_dir, first)
    result |= {**legs, "seconds": round(time.perf_counter() - t0, 1)}
  finally:
    shutil.rmtree(root, ignore_errors=True)
  result["load_average_end"] = benchmarking.load_average()
  lines = benchmarking.header_lines(
      result, rounds=f"The default config, dropout {rate}, {steps} steps "
      "a run.")
  for name in legs:
    r = result[name]
    verdict = ("bitwise equal" if r["bitwise_equal"] else
               f"{r['leaves_differing']} of {r['leaves']} leaves differ, "
               f"largest by {r['max_abs_difference']:.3g}")
    lines.append(f"{name.replace('_', ' ')} vs the first: {verdict}")
  benchmarking.write_results(out, result, "\n".join(lines) + "\n", print)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
