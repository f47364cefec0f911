r"""Generation with the cache of keys and values against recomputing the prefix.

    python benchmarks/decode_benchmark.py                 # 256 tokens
    python benchmarks/decode_benchmark.py --kv_heads=1 --repeats=3

A random causal model of the given shape (untrained: speed does not depend on
the weights) generates ``--length`` tokens greedily from a one-token prompt,
two ways, each one jitted ``lax.scan`` over the positions:

* ``cache``: :func:`mha.decode.generate`, one position a step through the
  decode cache (``[B, length, H_kv, Dh]`` a layer);
* ``recompute``: each step runs the whole causal forward pass over the
  ``[B, length]`` buffer written so far (the positions not yet written are
  padding, masked) and reads the logits at the step's position: what
  generation costs without a cache, at one compiled shape.

Both must write the same tokens (checked). Also one token's cost at the last
position alone: a jitted decode step with a cache holding ``length - 1``
positions against a jitted forward pass over ``length`` tokens, one call
each (Python's dispatch included). Times are medians of ``--repeats``
interleaved rounds; ratio = recompute / cache (above 1: the cache is
faster). On a shared machine both sides slow together: compare the ratio.

Prints the table; writes it beside ``--out`` (JSON; by default
``benchmarks/results/<UTC date>_decode_<commit>.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

# Run as a file, the path holds this folder, not the repository's root: put
# it first, for the ``benchmarks`` package (which is not installed) and this
# checkout's ``mha`` (whose commit the results record).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from mha import build
from mha import decode
from mha.model import Transformer, TransformerConfig
from mha.run import cli

from benchmarks import benchmarking

_LENGTH = flags.DEFINE_integer("length", 256, "Tokens generated (and the "
                               "model's positions).", lower_bound=2)
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences generated at once.",
                              lower_bound=1)
_LAYERS = flags.DEFINE_integer("layers", 2, "Blocks.", lower_bound=1)
_HEADS = flags.DEFINE_integer("heads", 4, "Query heads a layer.",
                              lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("kv_heads", None, "Key/value heads a layer "
                                 "(default: --heads).", lower_bound=1)
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Residual width.",
                                lower_bound=1)
_MLP_DIM = flags.DEFINE_integer("mlp_dim", 512, "Feed-forward width.",
                                lower_bound=1)
_VOCAB = flags.DEFINE_integer("vocab", 128, "Vocabulary (a character LM's).",
                              lower_bound=2)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds.",
                                lower_bound=1)
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: benchmarks/results/<UTC "
    "date>_decode_<commit>.json); the table goes next to it (.md).")

_PROG = "decode_benchmark.py"


@functools.partial(jax.jit, static_argnames="config")
def generate_recomputing(config: TransformerConfig, params, prompt):
  """Greedy generation without a cache: ``prompt [B, 1]`` then a token a
  step, each from a full forward pass over the ``[B, max_len]`` buffer."""
  model = Transformer(config)
  tokens = jnp.zeros((prompt.shape[0], config.max_len), jnp.int32)
  tokens = tokens.at[:, :1].set(prompt)

  def step(tokens, t):
    logits, _ = model.apply({"params": params}, tokens, return_weights=False)
    chosen = decode.next_token(jax.lax.dynamic_index_in_dim(
        logits, t, axis=1, keepdims=False), jax.random.key(0), 0.0)
    return jax.lax.dynamic_update_slice_in_dim(tokens, chosen[:, None], t + 1,
                                               axis=1), None

  tokens, _ = jax.lax.scan(step, tokens, jnp.arange(config.max_len - 1))
  return tokens


def measure(config: TransformerConfig, batch: int, repeats: int) -> dict:
  """Seconds of each way (generation, and one token at the last position),
  the medians per token, and the ratios."""
  length = config.max_len
  # Jitted: one program, not each of the initialisation's operations.
  params = jax.jit(build.init_params, static_argnums=0)(Transformer(config),
                                                        jax.random.key(0))
  prompt = jnp.ones((batch, 1), jnp.int32)
  cached = lambda: decode.generate(config, params, prompt, length - 1,
                                   rng=jax.random.key(0))
  recomputed = lambda: generate_recomputing(config, params, prompt)
  tokens = np.asarray(cached())
  same_tokens = bool(np.array_equal(tokens, np.asarray(recomputed())))

  # One token at the last position: a cache holding length - 1 positions.
  step = jax.jit(functools.partial(decode.decode_step, config))
  full = jax.jit(lambda p, t: Transformer(config).apply(
      {"params": p}, t, return_weights=False)[0][:, -1])
  cache = decode.init_cache(config, batch, length)
  for t in range(length - 1):
    _, cache = step(params, cache, jnp.asarray(tokens[:, t]))
  last = jnp.asarray(tokens[:, -1])
  whole = jnp.asarray(tokens)
  np.testing.assert_allclose(step(params, cache, last)[0],
                             full(params, whole), atol=1e-4, rtol=1e-4)
  times = benchmarking.time_interleaved({
      "generate_cache": cached,
      "generate_recompute": recomputed,
      "token_cache": lambda: step(params, cache, last)[0],
      "token_recompute": lambda: full(params, whole),
  }, repeats)
  ms = {name: benchmarking.median_ms(t) for name, t in times.items()}
  per_token = {name: ms[name] / (length - 1) for name in
               ("generate_cache", "generate_recompute")}
  return {
      "same_tokens": same_tokens,
      "seconds": times,
      "ms_per_token": {**per_token, "token_cache": ms["token_cache"],
                       "token_recompute": ms["token_recompute"]},
      "ratio_generate": per_token["generate_recompute"]
                        / per_token["generate_cache"],
      "ratio_token": ms["token_recompute"] / ms["token_cache"],
  }


def format_table(results) -> str:
  """The markdown report of the results."""
  m, r = results["model"], results["measured"]
  per = r["ms_per_token"]
  lines = benchmarking.header_lines(
      results, rounds=f"Medians of {results['repeats']} interleaved rounds; "
      "ratio = recompute / cache (above 1: the cache is faster).") + [
          f"Model: {m['num_layers']} layers x {m['num_heads']} heads "
          f"({m['num_kv_heads'] or m['num_heads']} key/value), d_model "
          f"{m['d_model']}, mlp {m['mlp_dim']}, vocab {m['vocab_size']}, "
          f"causal, untrained; batch {results['batch']}, {m['max_len']} "
          "tokens.", "",
          "| what | cache (ms/token) | recompute (ms/token) | ratio |",
          "| --- | ---: | ---: | ---: |",
          f"| generating {m['max_len']} tokens (one scan) | "
          f"{per['generate_cache']:.3f} | {per['generate_recompute']:.3f} | "
          f"{r['ratio_generate']:.1f}x |",
          f"| one token at position {m['max_len']} (one call) | "
          f"{per['token_cache']:.3f} | {per['token_recompute']:.3f} | "
          f"{r['ratio_token']:.1f}x |", "",
          f"Both ways wrote the same tokens: {r['same_tokens']}."]
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  del argv
  if _D_MODEL.value % _HEADS.value:
    cli.fail(_PROG, f"--d_model={_D_MODEL.value} is not divisible by "
             f"--heads={_HEADS.value}")
  if _KV_HEADS.value is not None and _HEADS.value % _KV_HEADS.value:
    cli.fail(_PROG, f"--kv_heads={_KV_HEADS.value} does not divide "
             f"--heads={_HEADS.value}")
  out = benchmarking.checked_out(_PROG, _OUT.value, "decode")
  logging.set_verbosity(logging.WARNING)
  config = TransformerConfig(
      vocab_size=_VOCAB.value, num_layers=_LAYERS.value,
      num_heads=_HEADS.value, d_model=_D_MODEL.value, mlp_dim=_MLP_DIM.value,
      max_len=_LENGTH.value, causal=True, num_kv_heads=_KV_HEADS.value)
  results = benchmarking.record("decode", model=dataclasses.asdict(config),
                                batch=_BATCH.value, repeats=_REPEATS.value)
  results["measured"] = measure(config, _BATCH.value, _REPEATS.value)
  results["load_average_end"] = benchmarking.load_average()
  log = lambda message: print(message, file=sys.stderr, flush=True)
  benchmarking.write_results(out, results, format_table(results), log)


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
