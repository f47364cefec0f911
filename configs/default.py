"""Default config: a 2-layer, 4-head encoder learning to reverse sequences.

Train it (about 10 s on 2 CPU cores to 100% exact match on test; 11 s cold,
measured 2026-11-24 on an AMD EPYC):

    python train.py --config configs/default.py --workdir runs/reverse

Variants come from the argument after the colon, comma-separated: a task name
(`reverse`, `sort`, `histogram`, `spell`: the last one also sets its
`data.max_len` and training steps), a causal decoder on a next-token task
(`mqar`, `passkey`, `pylm`; `gqa` after them shares each key/value head
between two query heads), a model with more heads for the
pruning study (`wide`: 2 x 8 heads; `deep`: 3 x 4; `deep64`: 3 x 4 of width 16;
`wide6`: 2 x 6; `deep8`: 4 x 8),
`tiny` (a seconds-long smoke-test model), or `key=value` pairs; any field can
also be overridden with a flag:

    python train.py --config configs/default.py:sort --workdir runs/sort
    python train.py --config configs/default.py:spell --workdir runs/spell
    python train.py --config configs/default.py:tiny,num_train_steps=50 \
        --workdir /tmp/tiny
    python train.py --config configs/default.py:wide --workdir runs/wide

Training uses every device (``config.mesh``; see "Scaling out" in the README):
``batch_size`` is the global batch, split across them.
"""

from __future__ import annotations

import ast
import os

import ml_collections
from ml_collections import config_dict

TASKS = ("reverse", "sort", "histogram", "spell")
# Next-token tasks, for a causal decoder (mha.data.CAUSAL_TASKS); their
# variants also set model.causal and a model that learns them.
CAUSAL_TASKS = ("mqar", "passkey", "pylm")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the locked config; ``arg`` selects variants (see module doc)."""
  config = ml_collections.ConfigDict()
  config.task = "reverse"  # One of: reverse, sort, histogram, spell.
  config.seed = 0  # Seeds init, dropout and the batch order; < 2**32.
  config.batch_size = 128  # Global training batch, split across the devices.
  # Batch size of evaluation (the last one padded; at most a split's size;
  # rounded up to a multiple of the devices).
  config.eval_batch_size = 1000
  config.num_train_steps = 500  # Total optimizer steps.
  config.learning_rate = 1e-2  # Peak learning rate of the schedule.
  config.warmup_steps = 50  # Linear warmup steps, then cosine decay to 0.
  # AdamW decoupled weight decay, on the Dense kernels only (not on biases,
  # LayerNorm scales, or the token and position embeddings).
  config.weight_decay = 0.01
  config.adam_b2 = 0.98  # AdamW second-moment decay.
  config.grad_clip_norm = 1.0  # Clip gradients to this global norm.
  config.log_every_steps = 50  # Train metrics to console/TensorBoard/JSONL.
  config.eval_every_steps = 50  # Evaluate on validation this often.
  config.checkpoint_every_steps = 250  # Save a checkpoint this often.
  config.max_checkpoints_to_keep = 3  # Older checkpoints are deleted.
  # JAX's persistent compilation cache: a later run loads the programs an
  # earlier one compiled ("" turns it off); JAX's own variable
  # $JAX_COMPILATION_CACHE_DIR, when set, is the default.
  config.compilation_cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                "~/.cache/mha/jax")
  # A workdir whose newest checkpoint's parameters start this run (fresh
  # optimizer, step 0; its model config, e.g. a pruned model's); None: init.
  config.init_from = config_dict.placeholder(str)

  config.model = ml_collections.ConfigDict()
  config.model.num_layers = 2  # Transformer blocks.
  # Attention heads per layer: an int, or a list of one count per layer (a
  # pruned model; 0 allowed, model.head_dim required).
  config.model.num_heads = 4
  config.model.d_model = 32  # Residual stream width.
  config.model.mlp_dim = 64  # Feed-forward hidden width.
  config.model.dropout_rate = 0.0  # Dropout on embeddings and residual branches.
  config.model.attention_dropout_rate = 0.0  # Dropout on attention weights.
  config.model.pre_norm = True  # Pre-LayerNorm (True) or post-LayerNorm blocks.
  config.model.positional = "learned"  # Position embedding: learned|sinusoidal.
  # Per-head width; None: d_model // num_heads.
  config.model.head_dim = config_dict.placeholder(int)
  # Computation dtype: float32|bfloat16 (parameters, softmax and loss stay
  # float32; bfloat16 lets GPUs run cuDNN flash attention).
  config.model.dtype = "float32"
  # A decoder-only language model: causal masks, next-token targets (only
  # with a next-token task, mha.data.CAUSAL_TASKS).
  config.model.causal = False
  # Key/value heads shared by the query heads (grouped-query attention); it
  # must divide num_heads. None: num_heads (plain multi-head attention).
  config.model.num_kv_heads = config_dict.placeholder(int)

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # Devices along the data (batch) axis; -1 = all.
  config.mesh.shard_params = False  # FSDP: split params/optimizer along it too.

  config.data = ml_collections.ConfigDict()
  config.data.num_symbols = 10  # Input symbols are 1..num_symbols; 0 = padding.
  config.data.min_len = 1  # Shortest sequence.
  config.data.max_len = 16  # Longest sequence (and the model's positions).
  config.data.num_train_examples = 20000  # Size of the train split.
  config.data.num_eval_examples = 1000  # Size of each of validation and test.
  config.data.seed = 0  # Seed of the dataset generation (not of training).
  # spell only: 1..max_digits digits in; data.max_len must hold the longest
  # spelling, 5 letters a digit (spell ignores num_symbols and min_len).
  config.data.max_digits = 4
  # Causal tasks (mqar, passkey, pylm) only: the tokens of an example's
  # inputs, and the model's positions (they ignore min_len and max_len).
  config.data.context_length = 128
  config.data.num_pairs = 8  # mqar only: key-value pairs, each queried once.
  config.data.data_dir = "~/tensorflow_datasets"  # Where TFDS prepares data.

  for part in filter(None, _split_variants(arg or "")):
    _apply_variant(config, part.strip())
  config.lock()
  return config


def _split_variants(arg: str) -> list[str]:
  """``arg`` split at its commas, except those inside brackets: a list value
  (``model.num_heads=[4,2]``) stays one part."""
  parts, depth, start = [], 0, 0
  for i, char in enumerate(arg):
    depth += {"[": 1, "]": -1}.get(char, 0)
    if char == "," and depth == 0:
      parts.append(arg[start:i])
      start = i + 1
  return parts + [arg[start:]]


def _apply_variant(config: ml_collections.ConfigDict, part: str) -> None:
  if part == "spell":
    # Digits to their English words; the default model, trained longer.
    config.task = part
    config.data.max_len = 5 * config.data.max_digits  # The longest spelling.
    config.num_train_steps = 2000  # About 20 s on 2 CPU cores to 100% test.
  elif part in TASKS:
    config.task = part
  elif part == "mqar":
    # Multi-query associative recall (Arora et al. 2023): 8 key-value pairs,
    # then each key queried, in a context of 128 tokens. 1000 steps reached
    # test token accuracy 1.000 (exact match 1.000; the recall forms between
    # steps 500 and 750) in 7 min 49 s on 2 CPU cores alone (Intel Xeon,
    # JAX 0.10.2, 2026-11-29), in 3 min 22 s (AMD EPYC, 2026-11-30). At
    # learning rates 3e-3 and 6e-3 it stayed at 0.34 for 1500 steps.
    _decoder(config, part, context_length=128, num_train_steps=1000)
    config.data.num_pairs = 8
  elif part == "passkey":
    # A 5-digit key planted at a random distance in 256 tokens of filler,
    # recalled at the end. Sinusoidal positions and small batches learn it
    # fastest: 3000 steps reached test token accuracy 0.9998 on the digits
    # in 8 min 26 s on 2 CPU cores alone (AMD EPYC, JAX 0.10.2,
    # 2026-11-29); 2000 steps stopped at 0.934, the learning rate decayed
    # before the recall of repeated digits formed (docs/training.md).
    _decoder(config, part, context_length=256, num_train_steps=3000)
    config.model.positional = "sinusoidal"
    config.batch_size = 16
    config.learning_rate = 3e-3
  elif part == "pylm":
    # A character (byte) language model on the interpreter's own standard
    # library (3 x 4 = 12 heads: within the exact oracle's reach). 1600
    # steps reached test 1.907 bits per character (validation 1.999), below
    # the order-4 n-gram's 2.006 (order 5: 1.774), on 2 CPU cores (Intel
    # Xeon, JAX 0.10.2), 2026-11-29: 18 min wall with four validation passes
    # of about 35 s and other work on the cores part of the time.
    _decoder(config, part, context_length=128, num_train_steps=1600)
    config.model.num_layers = 3
    config.model.d_model = 128
    config.model.mlp_dim = 512
    config.learning_rate = 3e-3
    config.batch_size = 32
    config.eval_batch_size = 256
    config.log_every_steps = 100
    config.eval_every_steps = 800
    config.checkpoint_every_steps = 800
  elif part == "gqa":
    # Grouped-query attention: two query heads share each key/value head
    # (of the model as configured so far: put it after the model variants).
    if not isinstance(config.model.num_heads, int):
      raise ValueError("variant 'gqa' needs an int model.num_heads")
    config.model.num_kv_heads = max(1, config.model.num_heads // 2)
  elif part == "wide":
    # 8 heads per layer of width 8 (16 heads in all): the model of the
    # README's wide example, whose pruning study is then two commands.
    config.model.num_heads = 8
    config.model.d_model = 64
    config.learning_rate = 5e-3
  elif part == "deep":
    # 3 layers x 4 heads (12): more heads than reverse needs, and still
    # within the exhaustive oracle's default reach.
    config.model.num_layers = 3
  elif part == "deep64":
    # 3 layers x 4 heads of width 16 (12 heads): the model with the most
    # spare heads within the exhaustive oracle's reach (on one seed of
    # reverse the oracle removed 5 of 12 heads within 1 point).
    config.model.num_layers = 3
    config.model.d_model = 64
  elif part == "wide6":
    # 2 layers x 6 heads of width 8 (12 heads): as many heads as `deep`, in
    # two layers; on reverse none of them is spare (docs/pruning.md).
    config.model.num_heads = 6
    config.model.d_model = 48
    config.learning_rate = 5e-3
  elif part == "deep8":
    # 4 layers x 8 heads of width 8 (32 heads): beyond the exhaustive
    # oracle, for the searches and the sampled Shapley values.
    config.model.num_layers = 4
    config.model.num_heads = 8
    config.model.d_model = 64
    config.learning_rate = 5e-3
    config.num_train_steps = 1000  # 500 steps reached 0.905 test exact match
  elif part == "tiny":
    # A model that compiles and trains in seconds: for tests and smoke runs.
    config.batch_size = 32
    config.eval_batch_size = 64
    config.num_train_steps = 20
    config.warmup_steps = 5
    config.log_every_steps = 5
    config.eval_every_steps = 10
    config.checkpoint_every_steps = 10
    config.model.num_layers = 2
    config.model.num_heads = 2
    config.model.d_model = 16
    config.model.mlp_dim = 32
    config.data.max_len = 8
    config.data.num_train_examples = 256
    config.data.num_eval_examples = 64
  elif "=" in part:
    key, value = part.split("=", 1)
    *parents, name = key.strip().split(".")
    target = config
    for parent in parents:
      if not isinstance(target.get(parent), ml_collections.ConfigDict):
        raise KeyError(f"unknown config key {key.strip()!r} in {part!r}")
      target = target[parent]
    if name not in target:
      raise KeyError(f"unknown config key {key.strip()!r} in {part!r}")
    if isinstance(target[name], ml_collections.ConfigDict):
      raise ValueError(f"config key {key.strip()!r} is a group of keys: set "
                       f"one of its fields ({key.strip()}.<field>=...)")
    kind = target.get_type(name)  # Also of a placeholder (None) field.
    try:
      parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      parsed = value.strip()
    if key.strip() == "model.num_heads" and isinstance(parsed, list):
      # A count per layer (a pruned model's shape); the config checks
      # (mha.run.config_validation) check its length and counts.
      with target.ignore_type():
        target[name] = parsed
      return
    try:
      target[name] = kind(parsed)
    except (TypeError, ValueError) as e:
      raise ValueError(f"config key {key.strip()!r} must be of type "
                       f"{kind.__name__}, not {value.strip()!r}") from e
  else:
    raise ValueError(
        f"unknown config variant {part!r}: expected one of "
        f"{TASKS + CAUSAL_TASKS}, 'wide', 'deep', 'deep64', 'wide6', 'deep8', "
        "'gqa', 'tiny', or key=value")


def _decoder(config: ml_collections.ConfigDict, task: str, *,
             context_length: int, num_train_steps: int) -> None:
  """A causal decoder on next-token ``task``: 2 layers x 4 heads of width
  16, AdamW at 1e-3 after 200 warmup steps."""
  config.task = task
  config.model.causal = True
  config.data.context_length = context_length
  config.num_train_steps = num_train_steps
  config.model.d_model = 64
  config.model.mlp_dim = 256
  config.batch_size = 64
  config.eval_batch_size = 500
  config.learning_rate = 1e-3
  config.warmup_steps = 200
  config.log_every_steps = 100
  config.eval_every_steps = 250
  config.checkpoint_every_steps = 500
  config.data.num_train_examples = 20000
