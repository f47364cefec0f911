"""Metrics of a model on a split: loss, token accuracy, exact match.

Metrics are computed as sums plus counts on the device and divided on the
host, so batches of padding rows (the last, padded eval batch) count nothing.
Evaluation is data-parallel: each batch is split across the devices of a mesh
(``mha.run.sharding``), every device on its rows, the sums added up by XLA.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from mha import data
from mha.run import sharding as sharding_lib
from mha.aliases import Array, Params
from mha.model import Transformer

Metrics = dict[str, Array]

#: The sums and counts :func:`example_metric_sums` and :func:`metric_sums`
#: return, which :func:`summarize` turns into metrics.
SUM_KEYS = ("loss_sum", "correct", "tokens", "exact", "sequences")


def example_metric_sums(logits: Array, targets: Array, inputs: Array,
                        weights: Array | None = None) -> Metrics:
  """The sums and counts of :func:`metric_sums` per example, ``[B]`` each
  (their sums over the batch are the batch's): what a bootstrap resample
  over examples needs.

  Args:
    logits: ``[B, L, V]``.
    targets: ``[B, L]`` int; a target below 0 is not scored
      (``mha.data.UNSCORED``).
    inputs: ``[B, L]`` int, 0 = padding (defines the valid positions).
    weights: optional float ``[B, L]``, each position's weight in the sums
      (the Flax lm1b example's): a next-token task scores only some
      positions (``mha.data.next_token_arrays``). None: 1 at every valid
      position with a target >= 0 (``mha.data.scored``), the sums above
      exactly.

  Returns:
    ``loss_sum``, ``correct`` and ``tokens`` (token-level sums, weighted),
    and ``exact`` and ``sequences`` (1 when every valid position, or every
    position of nonzero weight, is right; 1 when there is one).
  """
  if weights is None:
    valid = data.scored(inputs, targets)
    targets = jnp.maximum(targets, 0)  # An unscored target's loss is not summed.
  ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets)
  if weights is None:
    right = (jnp.argmax(logits, -1) == targets) & valid
    loss_sum = jnp.sum(jnp.where(valid, ce, 0.0), axis=-1)
    correct, tokens = jnp.sum(right, axis=-1), jnp.sum(valid, axis=-1)
  else:
    weights = jnp.asarray(weights, jnp.float32)
    valid = weights != 0
    right = (jnp.argmax(logits, -1) == targets) & valid
    loss_sum = jnp.sum(weights * ce, axis=-1)
    correct = jnp.sum(jnp.where(right, weights, 0.0), axis=-1)
    tokens = jnp.sum(weights, axis=-1)
  nonempty = jnp.any(valid, axis=-1)
  return {
      "loss_sum": loss_sum,
      "correct": correct,
      "tokens": tokens,
      "exact": (jnp.all(right | ~valid, axis=-1) & nonempty).astype(jnp.int32),
      "sequences": nonempty.astype(jnp.int32),
  }


def metric_sums(logits: Array, targets: Array, inputs: Array,
                weights: Array | None = None) -> Metrics:
  """Sums and counts over the valid (non-padding, or nonzero-weight)
  positions of a batch: the sums over the batch of
  :func:`example_metric_sums` (same arguments)."""
  return {k: jnp.sum(v) for k, v in
          example_metric_sums(logits, targets, inputs, weights).items()}


def batch_metric_sums(logits: Array, batch: Mapping[str, Array]) -> Metrics:
  """:func:`metric_sums` of a batch of :mod:`mha.data`: its ``inputs``,
  ``targets`` and, when it has them, ``weights``."""
  return metric_sums(logits, batch["targets"], batch["inputs"],
                     batch.get("weights"))


def summarize(sums: Mapping[str, np.ndarray | float]
              ) -> dict[str, float | np.ndarray]:
  """Turns :func:`metric_sums` totals into ``loss``, ``token_accuracy``,
  ``exact_match``: floats for scalar totals, arrays elementwise for arrays
  of totals (one per head mask, say)."""
  total = lambda key: np.asarray(sums[key], np.float64)
  tokens = np.maximum(total("tokens"), 1.0)
  out = {
      "loss": total("loss_sum") / tokens,
      "token_accuracy": total("correct") / tokens,
      "exact_match": total("exact") / np.maximum(total("sequences"), 1.0),
  }
  return {k: float(v) if np.ndim(v) == 0 else v for k, v in out.items()}


@functools.partial(jax.jit, static_argnames="model")
def eval_step(model: Transformer, params: Params,
              batch: Mapping[str, Array]) -> Metrics:
  """Metric sums of ``model`` on one batch (deterministic, no weights)."""
  logits, _ = model.apply({"params": params}, batch["inputs"],
                          return_weights=False)
  return batch_metric_sums(logits, batch)


def evaluate(model: Transformer, params: Params, split: data.Split,
             batch_size: int, *, mesh: Mesh | None = None,
             compiled: Callable[[Any, Mapping[str, Array]], Metrics] | None
             = None) -> dict[str, float]:
  """``loss``, ``token_accuracy`` and ``exact_match`` of ``model`` on
  ``split``.

  Args:
    model, params: the model; ``params`` replicated or split on ``mesh``
      (or on no particular device).
    split: the examples (at least one).
    batch_size: examples per batch (at most the split's size), rounded up to
      a multiple of the devices.
    mesh: the devices, batches split along its data axis; by default every
      device (``mha.run.sharding.make_mesh()``).
    compiled: ``eval_step`` compiled for these batches and ``params``
      (``(params, batch) -> sums``, e.g. ``eval_step.lower(model, params,
      batch).compile()``); by default ``eval_step`` itself.

  Raises:
    ValueError: an empty split (its metrics are undefined).
  """
  if not len(split):
    raise ValueError("evaluate: the split holds no examples")
  mesh = sharding_lib.make_mesh() if mesh is None else mesh
  totals: dict[str, float] = {}
  for batch in sharding_lib.eval_batches(split, batch_size, mesh):
    sums = (eval_step(model, params, batch) if compiled is None
            else compiled(params, batch))
    for key, value in jax.device_get(sums).items():
      totals[key] = totals.get(key, 0.0) + float(value)
  return summarize(totals)


def pick_examples(split: data.Split, num_examples: int, *,
                  shortest: bool = False) -> np.ndarray:
  """Indices of ``num_examples`` examples with lengths spread from half the
  longest length to the longest (short sequences make dull heatmaps), or
  with ``shortest`` from the shortest length of the split to the longest;
  all of the split's (in another order) when ``num_examples`` is larger.

  Raises:
    ValueError: ``num_examples`` is less than 1.
  """
  if num_examples < 1:
    raise ValueError(f"num_examples must be at least 1, got {num_examples}")
  lengths = split.lengths
  longest = int(lengths.max())
  low = int(lengths.min()) if shortest else max(1, longest // 2)
  wanted = np.linspace(low, longest, num_examples).round()
  chosen: list[int] = []
  for length in wanted:
    candidates = [i for i in np.flatnonzero(lengths == length)
                  if i not in chosen]
    if not candidates:  # fall back to the closest unused length
      order = np.argsort(np.abs(lengths - length), kind="stable")
      candidates = [i for i in order if i not in chosen]
    if candidates:
      chosen.append(int(candidates[0]))
  return np.asarray(chosen, dtype=np.int64)


#: Sequences longer than this are shown a window of queries at a time (the
#: explorer's slider, eval.py's heatmaps); shorter ones whole.
WINDOW_FROM = 64
#: Queries in a window.
WINDOW_SIZE = 32


def answer_positions(split: data.Split, index: int) -> np.ndarray | None:
  """The positions of example ``index`` whose loss counts, where only some
  do (a recall task's answers: mqar's values, passkey's digits); None where
  every valid position counts (a language model, the seq2seq tasks)."""
  if split.weights is None:
    return None
  n = int(split.lengths[index])
  scored = np.flatnonzero(np.asarray(split.weights[index, :n]) > 0)
  return None if len(scored) in (0, n) else scored.astype(np.int64)


def query_window(n: int, answers: Sequence[int] | None = None,
                 size: int = WINDOW_SIZE,
                 whole_up_to: int = WINDOW_FROM) -> tuple[int, int]:
  """The default window ``[start, stop)`` of query positions shown of a
  sequence of ``n`` valid positions: all of them up to ``whole_up_to``;
  else ``size`` positions ending just after the last answer (two positions
  of context after it), or at the end without answers."""
  if n <= whole_up_to or n <= size:
    return 0, int(n)
  stop = n if answers is None or not len(answers) else min(
      n, int(max(answers)) + 3)
  stop = max(stop, size)
  return stop - size, stop


def write_attention_plots(model: Transformer, params: Params,
                          split: data.Split,
                          out_dir: str, *, num_examples: int = 4,
                          prefix: str = "attention",
                          plot_format: str = "png",
                          token_names: Sequence[str] | None = None
                          ) -> list[str]:
  """Writes one layers x heads heatmap grid per picked example, its tokens
  labelled as ``data.token_names(split.task)`` reads them (spell's digits,
  blanks and letters; the numbers themselves for the other tasks), or as
  ``token_names``. An example longer than :data:`WINDOW_FROM` is drawn as
  the window of :func:`query_window` (its answers, or its end) against the
  keys it can see; a causal model's masked keys are grey.

  Returns:
    The paths of the files written (``out_dir/<prefix>_<index>.png``, or
    ``.svg`` / ``.pdf`` with ``plot_format``): ``num_examples`` of them, or
    one for each example of a smaller split.

  Raises:
    ValueError: ``num_examples`` is less than 1.
  """
  from mha import plotting  # Deferred: matplotlib is only needed here.

  indices = pick_examples(split, num_examples)
  inputs = jnp.asarray(split.inputs[indices])
  logits, attention = jax.jit(model.apply)({"params": params}, inputs)
  predictions = np.asarray(jnp.argmax(logits, -1))
  attention = [np.asarray(a) for a in attention]
  names = token_names if token_names is not None else (
      data.token_names(split.task) if split.task else None)
  causal = model.config.causal
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for row, index in enumerate(indices):
    n = int(split.lengths[index])
    correct = int(np.sum(predictions[row, :n] == split.targets[index, :n]))
    path = os.path.join(out_dir, f"{prefix}_{index}.{plot_format}")
    answers = answer_positions(split, index)
    window = query_window(n, answers) if n > WINDOW_FROM else None
    title = (f"example {index}: input -> target, {correct}/{n} positions "
             "predicted right")
    if answers is not None:
      right = int(np.sum(predictions[row, answers] ==
                         split.targets[index, answers]))
      title += f", answers {right}/{len(answers)}"
    plotting.plot_attention(
        split.inputs[index], [a[row] for a in attention], path,
        targets=split.targets[index], predictions=predictions[row],
        token_names=names, title=title, queries=window, causal=causal)
    paths.append(path)
  return paths


class DistanceAccuracy(NamedTuple):
  """Accuracy by distance bucket: bucket ``k`` holds the distances
  ``lower[k] .. upper[k]`` (inclusive)."""

  lower: np.ndarray  # [K] int64
  upper: np.ndarray  # [K] int64
  accuracy: np.ndarray  # [K] float64; nan for a bucket that holds nothing.
  count: np.ndarray  # [K] int64: answers (or examples) in the bucket.


def accuracy_by_distance(correct: Any, distances: Any,
                         edges: Sequence[int] | None = None
                         ) -> DistanceAccuracy:
  """Accuracy of a recall task's answers by how far back each was planted,
  so that a model that only attends locally shows as accurate in the short
  buckets alone.

  Args:
    correct: bool, per answer position (``[N, L]``, e.g. ``argmax(logits)
      == targets``) or per example (``[N]``, e.g. every passkey digit right).
    distances: int, the same shape: ``Split.distances`` per position, or
      per example ``Split.distances.max(axis=1)`` (passkey's one distance).
      Entries of distance 0 are not answers and count nowhere.
    edges: increasing bucket starts (``>= 1``); bucket ``k`` is ``edges[k]
      .. edges[k+1] - 1``, the last one up to the largest distance. Default:
      powers of two, 1, 2, 4, ... up to the largest distance.

  Raises:
    ValueError: shapes that differ, or edges not increasing from >= 1.
  """
  correct = np.asarray(correct, bool)
  distances = np.asarray(distances, np.int64)
  if correct.shape != distances.shape:
    raise ValueError(f"correct {correct.shape} and distances "
                     f"{distances.shape} differ in shape")
  answers = distances > 0
  largest = int(distances.max(initial=0))
  if edges is None:
    edges = 2 ** np.arange(max(largest, 1).bit_length())
  edges = np.asarray(edges, np.int64)
  if edges.ndim != 1 or not len(edges) or edges[0] < 1 or np.any(
      np.diff(edges) <= 0):
    raise ValueError(f"edges {edges.tolist()} must increase from >= 1")
  upper = np.append(edges[1:] - 1, max(largest, edges[-1]))
  bucket = np.searchsorted(edges, distances[answers], side="right") - 1
  keep = bucket >= 0  # Distances below the first edge count nowhere.
  count = np.bincount(bucket[keep], minlength=len(edges))
  right = np.bincount(bucket[keep], weights=correct[answers][keep],
                      minlength=len(edges))
  with np.errstate(invalid="ignore", divide="ignore"):
    accuracy = np.where(count > 0, right / np.maximum(count, 1), np.nan)
  return DistanceAccuracy(lower=edges, upper=upper, accuracy=accuracy,
                          count=count)


def accuracy_by_earlier_occurrences(correct: Any, inputs: Any,
                                    answers: Any) -> dict[str, dict[str, Any]]:
  """Accuracy of a recall task's answers by how often the input token at
  the answer's position (the token the model reads there: passkey's previous
  digit, mqar's queried key) occurs earlier in the same sequence.

  An induction head predicts the token that followed an earlier occurrence
  of the current one; with two or more earlier occurrences (a passkey whose
  digit repeats) that rule is ambiguous, with none (passkey's first digit,
  after the query marker) it does not apply. A model that recalls by
  induction alone can be right wherever there is one occurrence and must
  guess between followers where there are two.

  Args:
    correct: bool ``[N, L]``, per position.
    inputs: int ``[N, L]``, the sequences the model read.
    answers: bool ``[N, L]``, the answer positions (e.g. ``Split.distances
      > 0``); the others count nowhere.

  Returns:
    ``{"0": ..., "1": ..., "2+": ...}``, each ``{"accuracy", "answers"}``
    (accuracy None where a group holds no answer).

  Raises:
    ValueError: shapes that differ or are not ``[N, L]``.
  """
  correct = np.asarray(correct, bool)
  inputs = np.asarray(inputs)
  answers = np.asarray(answers, bool)
  if not correct.shape == inputs.shape == answers.shape or correct.ndim != 2:
    raise ValueError(f"correct {correct.shape}, inputs {inputs.shape} and "
                     f"answers {answers.shape} must be one [N, L] shape")
  rows, cols = np.nonzero(answers)
  same = inputs[rows] == inputs[rows, cols][:, None]  # [M, L]
  before = np.arange(inputs.shape[1])[None, :] < cols[:, None]
  earlier = np.sum(same & before, axis=1)
  right = correct[rows, cols]
  out = {}
  for name, group in (("0", earlier == 0), ("1", earlier == 1),
                      ("2+", earlier >= 2)):
    n = int(group.sum())
    out[name] = {"accuracy": float(right[group].mean()) if n else None,
                 "answers": n}
  return out


@functools.partial(jax.jit, static_argnames="model")
def _predictions(model: Transformer, params: Params, inputs: Array) -> Array:
  logits, _ = model.apply({"params": params}, inputs, return_weights=False)
  return jnp.argmax(logits, -1)


def recall_by_distance(model: Transformer, params: Params, split: data.Split,
                       batch_size: int) -> DistanceAccuracy:
  """:func:`accuracy_by_distance` of ``model``'s answers on a recall task's
  ``split`` (one with ``distances``: ``mha.data.RECALL_TASKS``), per answer
  position."""
  if split.distances is None:
    raise ValueError(f"split of task {split.task!r} has no distances: only "
                     f"a recall task's ({', '.join(data.RECALL_TASKS)}) has")
  predicted = predictions(model, params, split, batch_size)
  return accuracy_by_distance(predicted == split.targets, split.distances)


def predictions(model: Transformer, params: Params, split: data.Split,
                batch_size: int) -> np.ndarray:
  """``[N, L]`` int: ``model``'s most likely token at each position of
  ``split``'s inputs, in batches of ``batch_size``."""
  return np.concatenate([
      np.asarray(_predictions(model, params, batch["inputs"]))
      for batch in data.eval_batches(split, batch_size)])[:len(split)]
