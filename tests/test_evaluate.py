"""Tests of mha.evaluate's metric sums: weighted positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import evaluate


def test_weights_choose_the_positions_the_metrics_count():
  # The sums jitted, one program: op by op, each operation compiled alone.
  @jax.jit
  def sums(probabilities, targets, inputs, ones, first):
    logits = jnp.log(probabilities)
    return (evaluate.metric_sums(logits, targets, inputs),
            evaluate.metric_sums(logits, targets, inputs, ones),
            evaluate.batch_metric_sums(logits, {
                "inputs": inputs, "targets": targets, "weights": first}))
  plain, ones, first = sums(
      np.array([[[0.1, 0.9], [0.9, 0.1], [0.5, 0.5]]], np.float32),
      np.array([[1, 1, 0]], np.int32), np.array([[3, 3, 0]], np.int32),
      np.array([[1.0, 1.0, 0.0]], np.float32),
      np.array([[1.0, 0.0, 0.0]], np.float32))
  for key in evaluate.SUM_KEYS:  # Weights of 1 on the valid positions.
    np.testing.assert_allclose(ones[key], plain[key], rtol=1e-6)
  first = evaluate.summarize(first)
  assert first["token_accuracy"] == first["exact_match"] == 1.0
  np.testing.assert_allclose(first["loss"], -np.log(0.9), rtol=1e-6)


@pytest.mark.slow
def test_recall_by_distance_buckets_the_models_answers():
  from mha import data  # pylint: disable=import-outside-toplevel
  from mha.model import Transformer, TransformerConfig  # pylint: disable=import-outside-toplevel
  config = TransformerConfig(vocab_size=12, max_len=6, num_layers=1,
                             num_heads=2, d_model=8, mlp_dim=8, causal=True)
  model = Transformer(config)
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 12, (5, 6)).astype(np.int32)
  targets = rng.integers(1, 12, (5, 6)).astype(np.int32)
  distances = rng.integers(0, 6, (5, 6)).astype(np.int32)
  split = data.Split(inputs=inputs, targets=targets, task="mqar",
                     weights=(distances > 0).astype(np.float32),
                     distances=distances)
  # Jitted: eagerly each op of the initialisation compiles alone.
  params = jax.jit(model.init)(jax.random.key(0), inputs[:1])["params"]
  got = evaluate.recall_by_distance(model, params, split, batch_size=2)
  # The reference jitted: op by op, it compiles dozens of programs.
  logits, _ = jax.jit(model.apply)({"params": params}, inputs)
  want = evaluate.accuracy_by_distance(
      np.argmax(logits, -1) == targets, distances)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  with np.testing.assert_raises(ValueError):
    evaluate.recall_by_distance(model, params, data.Split(
        inputs=inputs, targets=targets, task="reverse"), 2)


@pytest.mark.slow  # trains a tiny recall model and runs eval.py
def test_eval_script_on_a_recall_task_splits_its_answers_two_ways(
    tmp_path, data_dir, subprocess_env):
  """eval.py on mqar: the answers by distance and by how often the token
  read occurs earlier each count every answer once, and their weighted
  accuracies are the run's token accuracy on the answers."""
  import glob  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from conftest import ROOT, run, tiny_config  # pylint: disable=import-outside-toplevel
  from mha import train  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "mqar")
  # The grouped decoder of test_study_faults.py's study on a decoder (one
  # layer), the same config: its programs may be in the session's
  # compilation cache.
  train.train_and_evaluate(tiny_config(
      data_dir, "mqar", "model.num_layers=1", "model.num_heads=4", "gqa",
      "num_train_steps=2",
      "data.context_length=24", "data.num_pairs=2",
      "data.num_train_examples=64", "data.num_eval_examples=16",
      "eval_batch_size=16", "batch_size=8"), workdir)
  # One heatmap (the default draws 4): the test reads the metrics alone.
  result = run([sys.executable, os.path.join(ROOT, "eval.py"),
                f"--workdir={workdir}", "--split=test", "--num_examples=1"],
               env=subprocess_env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "answers whose input token occurs 1 times earlier" in result.stderr
  [path] = glob.glob(os.path.join(workdir, "eval", "metrics_test_step2.json"))
  with open(path, encoding="utf-8") as f:
    got = json.load(f)
  by_distance = got["accuracy_by_distance"]
  by_earlier = got["accuracy_by_earlier_occurrences"]
  answers = sum(r["answers"] for r in by_distance)
  assert answers == 16 * 2  # two queries an example
  assert sum(r["answers"] for r in by_earlier.values()) == answers
  for rows in (by_distance, list(by_earlier.values())):
    right = sum(r["accuracy"] * r["answers"] for r in rows if r["answers"])
    assert right / answers == pytest.approx(got["token_accuracy"], abs=1e-9)
