"""Evaluates a trained run and draws what each head attends to.

    python eval.py --workdir runs/reverse [--split test] [--step N]
    python eval.py --workdir runs/reverse --html [--examples 8]

Restores the config and parameters from the workdir (nothing else to pass),
prints the metrics, writes layers x heads attention heatmaps of a few
examples to ``workdir/eval/``, and prints a final line of JSON, with each
head's roles (``head_roles``, :mod:`mha.head_roles`). With ``--html`` it also
writes ``workdir/eval/attention.html``, the interactive attention explorer of
``--examples`` examples (:mod:`mha.explorer`). The metrics
are computed on every device, each batch split across them, whatever the
device count of the run that saved the checkpoint. It writes nothing but
``workdir/eval/`` (never the checkpoints), and takes no lock: it works
while a run trains.

Exit codes: 0 done; 2 a bad command line or workdir (no checkpoint, a
damaged one asked for, an ``eval/`` folder it cannot write: one line on
stderr, checked before anything is computed or written); 1 a write that
failed midway (the disk filled up: one line).
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

from mha.run import cli
from mha.run.figures import PLOT_FORMATS

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's workdir.")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "validation", "test"],
                           "The split to evaluate.")
_STEP = flags.DEFINE_integer("step", None,
                             "Checkpoint step to load (default: the latest).")
_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", 4, "Examples drawn as attention heatmaps, at least 1 and "
    "at most the split's size.")
_HTML = flags.DEFINE_bool(
    "html", False, "Also write the attention explorer, eval/attention.html.")
_EXAMPLES = flags.DEFINE_integer(
    "examples", 8, "Examples in the explorer (--html), of lengths from the "
    "split's shortest to its longest.")
_PLOT_FORMAT = flags.DEFINE_enum(
    "plot_format", "png", list(PLOT_FORMATS),
    "File format of the heatmaps: png, or svg or pdf (vector graphics).")
flags.mark_flags_as_required(["workdir"])


def _check_examples(num_examples: int | None) -> None:
  """Fails (exit 2) on ``--num_examples`` outside ``[1, num_examples]``, on
  ``--examples`` without ``--html``, or outside ``[1, num_examples]`` (the
  split's size, once known: the config's, before the data is read)."""
  if _NUM_EXAMPLES.value < 1:
    cli.fail("eval.py",
             f"--num_examples must be at least 1, got {_NUM_EXAMPLES.value}")
  # The default (4) on a smaller split draws all of it; a value given is
  # checked.
  if (num_examples is not None and _NUM_EXAMPLES.value > num_examples
      and flags.FLAGS["num_examples"].present):
    cli.fail("eval.py", f"--num_examples={_NUM_EXAMPLES.value} is more than "
             f"the {num_examples} examples of the {_SPLIT.value} split")
  value = _EXAMPLES.value
  if not _HTML.value:
    if flags.FLAGS["examples"].present:
      cli.fail("eval.py", "--examples needs --html")
    return
  if value < 1:
    cli.fail("eval.py", f"--examples must be at least 1, got {value}")
  if num_examples is not None and value > num_examples:
    cli.fail("eval.py", f"--examples={value} is more than the {num_examples} "
             f"examples of the {_SPLIT.value} split")


def _write_explorer(ckpt, split, workdir: str, roles, result,
                    study) -> None:
  """Writes ``workdir/eval/attention.html``."""
  from mha import data, explorer

  path = explorer.write_explorer(
      ckpt.model, ckpt.params, split,
      os.path.join(workdir, "eval", "attention.html"),
      num_examples=_EXAMPLES.value, roles=roles, study=study,
      meta=explorer.run_meta(workdir, ckpt.config.task, ckpt.step,
                             _SPLIT.value, result),
      token_names=data.token_names(ckpt.config.task,
                                   ckpt.config.data.num_symbols))
  print(f"Wrote the attention explorer to {path}", file=sys.stderr)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  # The checks that need no checkpoint come first, and JAX, Flax, orbax and
  # TFDS are imported after them: --help, a mistyped flag or a missing
  # folder answer at once.
  workdir = cli.existing_dir("eval.py", _WORKDIR.value)
  _check_examples(None)
  from mha import build, checkpoint, data, evaluate
  from mha.run import compilation_cache

  try:
    ckpt = checkpoint.load_checkpoint(workdir, _STEP.value)
  except (FileNotFoundError, checkpoint.DamagedCheckpointError) as e:
    cli.fail("eval.py", e)
  config = ckpt.config
  _check_examples(config.data.num_train_examples if _SPLIT.value == "train"
                  else config.data.num_eval_examples)
  study = None
  if _HTML.value:  # The study the page shows, read before any work.
    page = os.path.join(workdir, "eval", "attention.html")
    if os.path.isdir(page):
      cli.fail("eval.py", f"{page} is a folder, where --html writes the "
               "explorer page: move it aside")
    from mha import explorer
    try:
      study = explorer.load_study(workdir)
    except ValueError as e:
      cli.fail("eval.py", e)
  try:  # A corpus changed under the checkpoint: before anything is written.
    data.check_corpus(config.task, workdir)
  except data.CorpusChangedError as e:
    cli.fail("eval.py", e)
  out_dir = cli.writable_dir("eval.py", os.path.join(workdir, "eval"))
  compilation_cache.configure(config.compilation_cache_dir, "eval.py")
  try:
    splits = data.load_splits(build.data_spec(config), config.data.data_dir)
  except data.DataDirError as e:  # The data to prepare, and nowhere to.
    cli.fail("eval.py", e)
  split = splits[_SPLIT.value]
  metrics = evaluate.evaluate(ckpt.model, ckpt.params, split,
                              config.eval_batch_size)
  try:
    _write_outputs(ckpt, split, workdir, out_dir, metrics, study)
  except OSError as e:  # The disk filled up meanwhile, say: exit code 1.
    from mha.run import write_failures
    print(f"eval.py: error: {write_failures.os_error_reason(e)}, while writing "
          f"the results to {out_dir}/ (they are incomplete)",
          file=sys.stderr, flush=True)
    sys.exit(1)


def _write_outputs(ckpt, split, workdir: str, out_dir: str,
                   metrics, study) -> None:
  """Writes the heatmaps, the head roles, the explorer (``--html``) and the
  metrics to ``out_dir`` (``workdir/eval``), and prints the final line of
  JSON."""
  from mha import data, evaluate, head_roles
  config = ckpt.config

  paths = evaluate.write_attention_plots(
      ckpt.model, ckpt.params, split, out_dir,
      num_examples=_NUM_EXAMPLES.value,
      prefix=f"attention_{_SPLIT.value}_step{ckpt.step}",
      plot_format=_PLOT_FORMAT.value,
      token_names=data.token_names(config.task, config.data.num_symbols))
  roles = head_roles.head_roles(ckpt.model, ckpt.params, split,
                                config.eval_batch_size)
  result = {"step": ckpt.step, "split": _SPLIT.value, **metrics,
            "head_roles": head_roles.to_json(roles)}
  if split.distances is not None:  # A recall task: is the recall local?
    correct = evaluate.predictions(ckpt.model, ckpt.params, split,
                                   config.eval_batch_size) == split.targets
    by_distance = evaluate.accuracy_by_distance(correct, split.distances)
    result["accuracy_by_distance"] = [
        {"distances": [int(lo), int(hi)], "accuracy": float(acc),
         "answers": int(n)} for lo, hi, acc, n in zip(*by_distance) if n]
    for row in result["accuracy_by_distance"]:
      print(f"answers planted {row['distances'][0]}-{row['distances'][1]} "
            f"back: accuracy {row['accuracy']:.4f} ({row['answers']:,})",
            file=sys.stderr)
    # Is the recall an induction head's? Ambiguous where the token read
    # occurs twice or more earlier (a passkey repeating a digit).
    result["accuracy_by_earlier_occurrences"] = (
        evaluate.accuracy_by_earlier_occurrences(
            correct, split.inputs, split.distances > 0))
    for name, row in result["accuracy_by_earlier_occurrences"].items():
      if row["answers"]:
        print(f"answers whose input token occurs {name} times earlier: "
              f"accuracy {row['accuracy']:.4f} ({row['answers']:,})",
              file=sys.stderr)
  if _HTML.value:
    _write_explorer(ckpt, split, workdir, roles, result, study)
  with open(os.path.join(out_dir, f"metrics_{_SPLIT.value}_step{ckpt.step}"
                         ".json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"Wrote {len(paths)} attention heatmaps to {out_dir}/",
        file=sys.stderr)
  print(json.dumps(result))


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser("eval.py"))
