"""Tests of mha.evaluate's metric sums: weighted positions."""

import jax.numpy as jnp
import numpy as np
import pytest

from mha import evaluate


def test_weights_choose_the_positions_the_metrics_count():
  logits = jnp.log(jnp.array([[[0.1, 0.9], [0.9, 0.1], [0.5, 0.5]]]))
  targets = jnp.array([[1, 1, 0]])
  inputs = jnp.array([[3, 3, 0]])
  plain = evaluate.metric_sums(logits, targets, inputs)
  ones = evaluate.metric_sums(logits, targets, inputs,
                              jnp.array([[1.0, 1.0, 0.0]]))
  for key in evaluate.SUM_KEYS:  # Weights of 1 on the valid positions.
    np.testing.assert_allclose(ones[key], plain[key], rtol=1e-6)
  first = evaluate.summarize(evaluate.batch_metric_sums(logits, {
      "inputs": inputs, "targets": targets,
      "weights": jnp.array([[1.0, 0.0, 0.0]])}))
  assert first["token_accuracy"] == first["exact_match"] == 1.0
  np.testing.assert_allclose(first["loss"], -np.log(0.9), rtol=1e-6)


@pytest.mark.slow
def test_recall_by_distance_buckets_the_models_answers():
  import jax  # pylint: disable=import-outside-toplevel
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
  params = model.init(jax.random.key(0), inputs[:1])["params"]
  got = evaluate.recall_by_distance(model, params, split, batch_size=2)
  logits, _ = model.apply({"params": params}, inputs)
  want = evaluate.accuracy_by_distance(
      np.argmax(logits, -1) == targets, distances)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  with np.testing.assert_raises(ValueError):
    evaluate.recall_by_distance(model, params, data.Split(
        inputs=inputs, targets=targets, task="reverse"), 2)
