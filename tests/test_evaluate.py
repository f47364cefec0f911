"""Tests of mha.evaluate's metric sums: weighted positions."""

import jax.numpy as jnp
import numpy as np

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
