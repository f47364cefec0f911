"""Evaluates a trained run and draws what each head attends to.

    python eval.py --workdir runs/reverse [--split test] [--step N]

Restores the config and parameters from the workdir (nothing else to pass),
prints the metrics, writes layers x heads attention heatmaps of a few
examples to ``workdir/eval/``, and prints a final line of JSON. The metrics
are computed on every device, each batch split across them, whatever the
device count of the run that saved the checkpoint.
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

from mha import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's workdir.")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "validation", "test"],
                           "The split to evaluate.")
_STEP = flags.DEFINE_integer("step", None,
                             "Checkpoint step to load (default: the latest).")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 4,
                                     "Examples drawn as attention heatmaps.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  # Deferred: --help and a mistyped flag answer without importing orbax and
  # TFDS (``mha.cli`` already brings in JAX and Flax through ``mha``).
  from mha import build, checkpoint, compilation_cache, data, evaluate

  workdir = cli.existing_dir("eval.py", _WORKDIR.value)
  try:
    ckpt = checkpoint.load_checkpoint(workdir, _STEP.value)
  except (FileNotFoundError, checkpoint.DamagedCheckpointError) as e:
    cli.fail("eval.py", e)
  config = ckpt.config
  compilation_cache.configure(config.compilation_cache_dir, "eval.py")
  splits = data.load_splits(build.data_spec(config), config.data.data_dir)
  split = splits[_SPLIT.value]
  metrics = evaluate.evaluate(ckpt.model, ckpt.params, split,
                              config.eval_batch_size)
  out_dir = os.path.join(workdir, "eval")
  paths = evaluate.write_attention_plots(
      ckpt.model, ckpt.params, split, out_dir,
      num_examples=_NUM_EXAMPLES.value,
      prefix=f"attention_{_SPLIT.value}_step{ckpt.step}")
  result = {"step": ckpt.step, "split": _SPLIT.value, **metrics}
  with open(os.path.join(out_dir, f"metrics_{_SPLIT.value}_step{ckpt.step}"
                         ".json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"Wrote {len(paths)} attention heatmaps to {out_dir}/",
        file=sys.stderr)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser("eval.py"))
