"""Generates text (or tokens) from a trained causal model, through its cache.

    python sample.py --workdir runs/pylm --prompt "def " --num_tokens 64
    python sample.py --workdir runs/pylm --prompt "import " --temperature 0.8 \
        --num_samples 3 --seed 1
    python sample.py --workdir runs/mqar --prompt_ids 3,1,4 --num_tokens 4

Restores the model from the workdir (a run with ``model.causal``), reads the
prompt (text, one token a character, for a task whose tokens are characters;
or token ids) and prints one line of JSON a sample: its ``tokens`` (the
prompt's, then the generated ones) and, for a character task, its ``text``.
``--temperature 0`` (the default) is greedy (:mod:`mha.decode`).

Exit codes: 0 done; 2 a bad command line, workdir or prompt (an encoder's
workdir, a character that is no token, a prompt too long for the model: one
line on stderr).
"""

import json

from absl import app
from absl import flags
from absl import logging

from mha.run import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "A causal run's workdir.")
_STEP = flags.DEFINE_integer("step", None,
                             "Checkpoint step to load (default: the latest).")
_PROMPT = flags.DEFINE_string(
    "prompt", None, "The prompt as text (a task whose tokens are characters).")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None,
                                "The prompt as token ids, comma-separated.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 32, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 0.0, "Sampling temperature; 0 is greedy.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1,
                                    "Samples drawn, each from the prompt.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampling.")
flags.mark_flags_as_required(["workdir"])


def _check_flags() -> None:
  """The mistakes seen without the checkpoint: one line, exit 2."""
  if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
    cli.fail("sample.py", "give the prompt as --prompt (text) or --prompt_ids "
             "(token ids), one of them")
  if _NUM_SAMPLES.value < 1:
    cli.fail("sample.py", f"--num_samples must be at least 1, got "
             f"{_NUM_SAMPLES.value}")
  if not _TEMPERATURE.value >= 0:
    cli.fail("sample.py", f"--temperature must be >= 0, got "
             f"{_TEMPERATURE.value}")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO.
  workdir = cli.existing_dir("sample.py", _WORKDIR.value)
  _check_flags()
  try:
    ids = (None if _PROMPT_IDS.value is None
           else cli.numbers("prompt_ids", _PROMPT_IDS.value, int))
  except cli.UsageError as e:
    cli.fail("sample.py", e)
  # Deferred: --help and the mistakes above answer without importing JAX.
  import jax
  import numpy as np
  from mha import checkpoint, data, decode

  try:
    ckpt = checkpoint.load_checkpoint(workdir, _STEP.value)
  except (FileNotFoundError, checkpoint.DamagedCheckpointError) as e:
    cli.fail("sample.py", e)
  names = data.token_names(ckpt.config.task)
  try:
    if ids is None:
      ids = decode.encode_text(names, _PROMPT.value)
    prompt = np.tile(np.asarray([ids], np.int32), (_NUM_SAMPLES.value, 1))
    tokens = decode.generate(ckpt.model_config, ckpt.params, prompt,
                             _NUM_TOKENS.value, rng=jax.random.key(_SEED.value),
                             temperature=_TEMPERATURE.value)
  except ValueError as e:
    cli.fail("sample.py", e)
  text_tokens = names is not None and all(len(n) == 1 for n in names[1:])
  for row in np.asarray(tokens).tolist():
    line = {"tokens": row}
    if text_tokens:
      line["text"] = "".join(names[t] for t in row)
    print(json.dumps(line))


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser("sample.py"))
