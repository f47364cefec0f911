r"""The mixed KV cache against the full cache: memory, tokens per second,
accuracy.

    python benchmarks/mixed_cache_benchmark.py --workdir runs/mqar \
        --full_heads=1:0

A causal model of the ``mqar`` shape (2 layers x 4 heads, d_model 64, mlp
256; random weights: speed does not depend on them) reads ``--contexts``
tokens one position a step (one jitted ``lax.scan``), three ways:

* ``mixed``: :mod:`mha.pruning.mixed_cache` with ``--full_heads`` keeping
  every position and the other heads ``--sinks`` + ``--window`` (a ring);
* ``full``: the same code with every head full (the fair peer: only the
  cache differs);
* ``flax``: :func:`mha.decode.cached_logits`, the model's own decode cache.

KV memory: the bytes of the mixed cache's keys and values over the full
cache's, beside the formula ``(k T + (N - k)(S + W)) / (N T)``. Tokens per
second: ``batch x context`` over the median of ``--repeats`` interleaved
rounds. With ``--workdir`` (a trained decoder at its own context), also the
test token accuracy on the task's scored positions through the mixed cache
against the model's own forward pass.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from mha import build
from mha import data
from mha import decode
from mha import head_masks
from mha.model import Transformer, TransformerConfig
from mha.pruning import ablation as ablation_lib
from mha.pruning import mixed_cache
from mha.run import cli

from benchmarks import benchmarking

_CONTEXTS = flags.DEFINE_list("contexts", ["256", "512", "1024", "2048"],
                              "Tokens read (and the model's positions).")
_FULL = flags.DEFINE_string("full_heads", "1:0", "The heads that keep every "
                            "position (LAYER:HEAD,...): the oracle's set.")
_SINKS = flags.DEFINE_integer("sinks", 4, "Sink positions of a streaming "
                              "head.", lower_bound=0)
_WINDOW = flags.DEFINE_integer("window", 16, "Recent positions of a "
                               "streaming head.", lower_bound=0)
_KV_HEADS = flags.DEFINE_integer(
    "num_kv_heads", None, "Key/value groups per layer (grouped-query "
    "attention; a group keeps every position when any of its query heads is "
    "full): 1, 2 or 4. Unset: one per head.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences at once.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds.",
                                lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", None, "A trained decoder: its test "
                               "accuracy through the mixed cache.")
_EXAMPLES = flags.DEFINE_integer("examples", 256, "Test examples for the "
                                 "accuracy.", lower_bound=1)
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_mixed_cache_<commit>.json); the table goes next to it (.md).")

_PROG = "mixed_cache_benchmark.py"


def _full_mask(config: TransformerConfig, text: str) -> np.ndarray:
  full = np.zeros(head_masks.existing_heads(config).shape, bool)
  for layer, head in head_masks.parse_heads(text):
    if layer >= config.num_layers or head >= config.heads_per_layer[layer]:
      raise ValueError(f"--full_heads: head {layer}:{head} does not exist")
    full[layer, head] = True
  return full


def measure_speed(context: int, full_text: str, batch: int, sinks: int,
                  window: int, repeats: int,
                  num_kv_heads: int | None = None) -> dict:
  """Memory and tokens per second at one context."""
  config = TransformerConfig(vocab_size=64, num_layers=2, num_heads=4,
                             d_model=64, mlp_dim=256, max_len=context,
                             causal=True, positional="sinusoidal",
                             num_kv_heads=num_kv_heads)
  model = Transformer(config)
  # Jitted: one program, not each of the initialisation's operations.
  params = jax.jit(build.init_params, static_argnums=0)(model,
                                                        jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (batch, context), 1, 64)
  full = _full_mask(config, full_text)
  every = np.ones_like(full)
  ways = {
      "mixed": lambda: mixed_cache.cached_logits(
          model, params, tokens, full, sinks=sinks, window=window),
      "full": lambda: mixed_cache.cached_logits(
          model, params, tokens, every, sinks=sinks, window=window),
      "flax": lambda: decode.cached_logits(config, params, tokens),
  }
  times = benchmarking.time_interleaved(ways, repeats)
  ms = {k: benchmarking.median_ms(v) for k, v in times.items()}
  caches = [mixed_cache.init_cache(config, f, batch_size=batch,
                                   length=context, sinks=sinks, window=window)
            for f in (full, every)]
  sizes = [mixed_cache.cache_bytes(c) for c in caches]
  # Key/value groups kept whole and in all (heads without GQA).
  kept, groups = (sum(map(len, c.full_groups)) for c in caches)
  return {
      "context": context, "seconds": times,
      "tokens_per_second": {k: batch * context / (v / 1e3)
                            for k, v in ms.items()},
      "kv_bytes": {"mixed": sizes[0], "full": sizes[1]},
      "kv_memory": sizes[0] / sizes[1],
      "kv_memory_formula": float(ablation_lib.kv_memory(
          kept, groups, context, sinks, window)),
  }


def measure_accuracy(workdir: str, full_text: str, sinks: int, window: int,
                     examples: int) -> dict:
  """Test token accuracy on the scored positions of a trained decoder:
  through the mixed cache, and the model's own forward pass."""
  from mha import build  # pylint: disable=import-outside-toplevel
  from mha import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  ck = ckpt_lib.load_checkpoint(workdir)
  test = data.scored_targets(data.load_splits(
      build.data_spec(ck.config), ck.config.data.data_dir)["test"])
  inputs, targets = test.inputs[:examples], test.targets[:examples]
  full = _full_mask(ck.model_config, full_text)
  scored = data.scored(inputs, targets)
  out = {}
  for name, fn in (
      ("mixed", lambda x: mixed_cache.cached_logits(
          ck.model, ck.params, x, full, sinks=sinks, window=window)),
      ("full", lambda x: ck.model.apply({"params": ck.params}, x)[0])):
    right = 0
    for start in range(0, len(inputs), 64):
      logits = np.asarray(fn(jnp.asarray(inputs[start:start + 64])))
      right += np.sum((logits.argmax(-1) == targets[start:start + 64])
                      & scored[start:start + 64])
    out[name] = float(right / max(scored.sum(), 1))
  return {"workdir": workdir, "examples": int(len(inputs)),
          "context": int(inputs.shape[1]), "token_accuracy": out}


def format_table(results) -> str:
  """The markdown report of the results."""
  lines = benchmarking.header_lines(
      results, rounds=f"Medians of {results['repeats']} interleaved rounds; "
      "tokens per second = batch x context / seconds of the whole scan.")
  lines += [
      f"Model: 2 layers x 4 heads, "
      f"{results.get('num_kv_heads') or 4} key/value heads per layer, "
      f"d_model 64, mlp 256, random weights; "
      f"batch {results['batch']}; full heads {results['full_heads']}, the "
      f"others {results['sinks']} sinks + {results['window']} recent "
      "positions.", "",
      "| context | KV memory (measured) | formula | tokens/s mixed | full | "
      "Flax's cache | mixed / full |",
      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in results["speed"]:
    t = r["tokens_per_second"]
    lines.append(
        f"| {r['context']} | {100 * r['kv_memory']:.2f}% | "
        f"{100 * r['kv_memory_formula']:.2f}% | {t['mixed']:,.0f} | "
        f"{t['full']:,.0f} | {t['flax']:,.0f} | "
        f"{t['mixed'] / t['full']:.2f}x |")
  acc = results.get("accuracy")
  if acc:
    lines += ["", f"Test token accuracy ({acc['workdir']}, {acc['examples']} "
              f"examples of {acc['context']} tokens, scored positions): "
              f"mixed cache {acc['token_accuracy']['mixed']:.4f}, full "
              f"{acc['token_accuracy']['full']:.4f}."]
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  try:
    contexts = [int(c) for c in _CONTEXTS.value]
  except ValueError:
    cli.fail(_PROG, f"--contexts must be integers, got {_CONTEXTS.value}")
  if any(c <= _SINKS.value + _WINDOW.value for c in contexts):
    cli.fail(_PROG, "every context must exceed --sinks + --window")
  if _KV_HEADS.value is not None and 4 % _KV_HEADS.value:
    cli.fail(_PROG, f"--num_kv_heads must divide the 4 heads, got "
             f"{_KV_HEADS.value}")
  try:
    head_masks.parse_heads(_FULL.value)
  except ValueError as e:
    cli.fail(_PROG, f"--full_heads: {e}")
  out = benchmarking.checked_out(_PROG, _OUT.value, "mixed_cache")
  logging.set_verbosity(logging.WARNING)
  log = lambda message: print(message, file=sys.stderr, flush=True)
  results = benchmarking.record(
      "mixed_cache", full_heads=_FULL.value, sinks=_SINKS.value,
      window=_WINDOW.value, batch=_BATCH.value, repeats=_REPEATS.value,
      num_kv_heads=_KV_HEADS.value)
  results["speed"] = []
  for context in contexts:
    log(f"context {context} ...")
    results["speed"].append(measure_speed(
        context, _FULL.value, _BATCH.value, _SINKS.value, _WINDOW.value,
        _REPEATS.value, _KV_HEADS.value))
  if _WORKDIR.value:
    results["accuracy"] = measure_accuracy(
        _WORKDIR.value, _FULL.value, _SINKS.value, _WINDOW.value,
        _EXAMPLES.value)
  results["load_average_end"] = benchmarking.load_average()
  benchmarking.write_results(out, results, format_table(results), log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
