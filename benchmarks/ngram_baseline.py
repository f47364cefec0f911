r"""Bits per character of byte n-gram models on the character LM's corpus.

    python benchmarks/ngram_baseline.py
    python benchmarks/ngram_baseline.py --context_length 256 --out runs/ngram.json

Fits interpolated modified Kneser-Ney models (:mod:`benchmarks.ngram`) of every
order in ``--orders`` on the pylm train split (:func:`mha.data.load_corpus`: the
running interpreter's standard library, or ``--corpus_dir``) and prints
their bits per character on the validation and test splits: on exactly the
bytes a Transformer of context ``--context_length`` is scored on (its
windows' targets), each with the ``order - 1`` bytes before it as context
(crossing window starts, where the Transformer's context is shorter). With
``--out``, also writes the table as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Sequence

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from benchmarks import ngram
from mha import data
from mha.run import cli

_PROG = "ngram_baseline.py"


def _define_flags() -> None:
  from configs import default  # pylint: disable=import-outside-toplevel
  flags.DEFINE_list("orders", ["2", "3", "4", "5", "6"],
                    f"n-gram orders, 1..{ngram.MAX_ORDER}.")
  flags.DEFINE_integer("context_length", default.get_config().data.context_length,
                       "The Transformer's context (data.context_length): "
                       "which bytes are scored.", lower_bound=1)
  flags.DEFINE_string("corpus_dir", "", "Corpus folder; empty: the "
                      "standard library of this Python.")
  flags.DEFINE_string("out", "", "A JSON file for the table; empty: none.")


def baseline(orders: Sequence[int], context_length: int,
             corpus_dir: str | None = None) -> dict:
  """The table's rows, the corpus's description and the times taken."""
  start = time.perf_counter()
  text = data.load_corpus(corpus_dir or None)
  loaded = time.perf_counter()
  models = ngram.fit_all(text.streams["train"], tuple(orders))
  fitted = time.perf_counter()
  sizes = ngram.sizes(models)
  rows = []
  for order in orders:
    row = {"order": order, "ngrams": sizes[order]}
    for split in ("validation", "test"):
      stream = text.streams[split]
      row[split] = ngram.bits_per_char(
          models[order], stream, ngram.pylm_targets(len(stream),
                                                    context_length))
    rows.append(row)
  return {"corpus": text.describe(), "python_version": text.python_version,
          "corpus_hash": text.hash, "context_length": context_length,
          "rows": rows, "seconds": {
              "read": loaded - start, "fit": fitted - loaded,
              "score": time.perf_counter() - fitted}}


def table(results: dict) -> str:
  """The results as a Markdown table."""
  lines = ["| order | distinct n-grams | validation bits/char | test bits/char |",
           "| ---: | ---: | ---: | ---: |"]
  lines += [f"| {r['order']} | {r['ngrams']:,} | {r['validation']:.3f} | "
            f"{r['test']:.3f} |" for r in results["rows"]]
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
  del argv
  args = flags.FLAGS
  orders = cli.numbers("orders", args.orders, int)
  if not orders or min(orders) < 1 or max(orders) > ngram.MAX_ORDER:
    cli.fail(_PROG, f"--orders must lie in 1..{ngram.MAX_ORDER}, got "
             f"{','.join(args.orders)}")
  out = cli.checked_output_path(_PROG, args.out, "ngram.json") if (
      args.out) else ""
  try:
    results = baseline(orders, args.context_length, args.corpus_dir)
  except (ValueError, OSError) as e:  # An empty or unreadable corpus.
    cli.fail(_PROG, e)
  print(f"Corpus: {results['corpus']}")
  print(f"Scored: the targets of windows of {args.context_length} bytes.")
  print(table(results), end="")
  seconds = results["seconds"]
  print(f"Read {seconds['read']:.1f} s, fit {seconds['fit']:.1f} s, "
        f"scored {seconds['score']:.1f} s.")
  if out:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
    print(f"Wrote {out}")


if __name__ == "__main__":
  cli.end_quietly_on_broken_pipe()
  _define_flags()
  app.run(main, flags_parser=cli.flags_parser(_PROG))
