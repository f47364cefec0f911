"""Trains an encoder-only Transformer on a toy sequence task.

    python train.py --config configs/default.py --workdir runs/reverse \
        --config.model.num_heads=8

Running it again on the same workdir resumes from the newest checkpoint.
Compiled programs are kept in JAX's persistent compilation cache,
``config.compilation_cache_dir`` (default ``~/.cache/mha/jax``; ``""`` turns
it off), so a second run of the same config compiles nothing.
It trains on every device; launched as several processes (one a host), each
joins the run through ``jax.distributed`` with ``--distributed`` (coordinator
detected from the cluster: Cloud TPU, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS)
or with the coordinator given:

    python train.py --workdir /shared/runs/reverse \
        --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0

Exit codes: 0 done; 2 a bad command line, config or workdir, a workdir
another run holds, or one whose checkpoints are all damaged (one line on
stderr naming ``--restart_from_scratch``, which starts it over); 1 a failed run (a
non-finite loss; a disk full or read-only: one line naming the intact
checkpoints); 130 / 143
stopped by SIGINT / SIGTERM after saving a checkpoint (run the same command
again to resume). The logic lives in ``mha.train.train_and_evaluate``.
"""

import os
import shlex
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from mha.run import cli

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               "configs", "default.py")

_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Directory for checkpoints, metrics and logs.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Join a multi-process run (jax.distributed.initialize); implied by the "
    "three flags below. What they leave unset is detected from the cluster.")
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0's coordinator service (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (multi-process runs).",
    lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, 0 to num_processes - 1.",
    lower_bound=0)
_RESTART_FROM_SCRATCH = flags.DEFINE_bool(
    "restart_from_scratch", False,
    "Train from step 0 in a workdir whose checkpoints are all damaged (they "
    "stay in workdir/damaged_checkpoints/). Without it such a run stops with "
    "exit code 2 rather than silently start over.")
flags.mark_flags_as_required(["workdir"])


def _host_and_port(address: str | None) -> bool:
  """Whether ``address`` is None or ``host:port`` with a port of 1-65535
  (jax.distributed raised an IndexError on one without a port)."""
  if address is None:
    return True
  host, _, port = address.rpartition(":")
  return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


flags.register_validator(
    "coordinator_address", _host_and_port,
    message="must be host:port (e.g. 10.0.0.1:1234)")


def _parse_flags(argv: list[str]) -> list[str]:
  """Parses the flags and loads the config; a mistake in them is reported as
  one line on stderr with exit code 2 (no traceback, no usage text)."""
  try:
    # Defined here rather than at import: the --config.* overrides are
    # registered from argv, and one naming no config field raises (here
    # with the default config; while parsing with a --config given).
    config_flags.DEFINE_config_file(
        "config", _DEFAULT_CONFIG, "Training config file (path[:variant]).",
        lock_config=True, sys_argv=argv)
    rest = cli.parse_flags(argv, "train.py")
    flags.FLAGS.config.to_dict()  # Loads the file, applies the overrides.
  except Exception as e:  # A config file can raise anything.
    cli.fail("train.py", cli.unknown_config_override(e) or e)
  cli.nonempty_path("train.py", _WORKDIR.value)
  return rest


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  # Deferred: --help, a mistyped flag or config key answer without importing
  # JAX, Flax, orbax or TFDS.
  from mha import checkpoint, train
  from mha.run import (compilation_cache, config_validation, sharding,
                       write_failures)
  compilation_cache.configure(flags.FLAGS.config.compilation_cache_dir,
                              "train.py")
  distributed = (_COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value,
                 _PROCESS_ID.value)
  if _DISTRIBUTED.value or distributed != (None, None, None):
    try:
      sharding.initialize_distributed(*distributed)
    except (ValueError, TypeError) as e:  # e.g. no coordinator to be found
      cli.fail("train.py", f"jax.distributed: {e}")
  try:
    train.train_and_evaluate(flags.FLAGS.config, _WORKDIR.value,
                             restart_from_scratch=_RESTART_FROM_SCRATCH.value)
  except config_validation.ConfigError as e:
    cli.fail("train.py", e)
  except train.TrainingInterrupted as e:
    print(f"{e}. Resume with: python {shlex.join(sys.argv)}",
          file=sys.stderr, flush=True)
    sys.exit(128 + e.signum)
  except (FloatingPointError, checkpoint.DamagedCheckpointError,
          write_failures.WriteFailure) as e:
    print(f"train.py: error: {cli.one_line(e)}",
          file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=_parse_flags)
