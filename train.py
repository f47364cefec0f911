"""Trains an encoder-only Transformer on a toy sequence task.

    python train.py --config configs/default.py --workdir runs/reverse \
        --config.model.num_heads=8

Running it again on the same workdir resumes from the latest checkpoint.
The logic lives in ``mha.train.train_and_evaluate``.
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               "configs", "default.py")

_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Directory for checkpoints, metrics and logs.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Training config file (path[:variant]).",
    lock_config=True)
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  from mha import train  # Deferred so that --help is fast.
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
