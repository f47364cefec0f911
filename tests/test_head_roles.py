"""Head roles (mha.head_roles): planted patterns get their role, in the
eval JSON and beside importance in the pruning report."""

from __future__ import annotations

import numpy as np
import pytest

from mha import build
from mha import data
from mha import head_roles
from mha.pruning.study import report



def _planted_weights(tokens: np.ndarray) -> np.ndarray:
  """``[B, 6, L, L]`` weights, one head per pattern, in PATTERNS order:
  previous, next, same position, anti-diagonal, same token, uniform. Where a
  pattern has no key (the first query of `previous`), the head attends to
  the query itself."""
  batch, length = tokens.shape
  weights = np.zeros((batch, 6, length, length), np.float32)
  for b in range(batch):
    n = int(np.sum(tokens[b] != 0))
    for i in range(n):
      targets = [[i - 1] if i > 0 else [i], [i + 1] if i < n - 1 else [i],
                 [i], [n - 1 - i],
                 [j for j in range(n) if tokens[b, j] == tokens[b, i] and
                  j != i] or [i],
                 list(range(n))]
      for head, keys in enumerate(targets):
        weights[b, head, i, keys] = 1.0 / len(keys)
  return weights


def test_planted_heads_get_their_role():
  rng = np.random.default_rng(0)
  lengths = rng.integers(2, 13, size=32)
  tokens = np.zeros((32, 12), np.int32)
  for b, n in enumerate(lengths):
    tokens[b, :n] = rng.integers(1, 5, size=n)  # few symbols: repeats
  weights = _planted_weights(tokens)
  # Two layers: the planted heads, and the same heads in reverse order.
  roles = head_roles.roles_of_attention([weights, weights[:, ::-1]], tokens)
  patterns = list(head_roles.PATTERNS)
  assert head_roles.top_roles(roles) == [patterns, patterns[::-1]]
  for head, pattern in enumerate(patterns):
    # Exact by construction (float32 sums of weights 1 / k over the queries).
    assert roles[pattern][0, head] == pytest.approx(1.0, abs=1e-5), pattern
    for value in (roles[p][0, head] for p in patterns):
      assert 0.0 <= value <= 1.0 + 1e-6
  # A head on one key is not diffuse; previous and next never overlap.
  assert roles["diffuse"][0, 2] == pytest.approx(0.0, abs=1e-6)
  assert roles["next_position"][0, 0] == 0.0


def test_a_causal_uniform_head_is_diffuse_over_the_keys_it_sees():
  # Query i of a causal model spreads its weight over keys 0..i: diffuse 1
  # (normalised by log(i + 1), not by the log of the sequence's length),
  # and a head on its own position 0.
  tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int32)
  length = tokens.shape[1]
  uniform = np.tril(np.ones((length, length), np.float32))
  uniform /= uniform.sum(axis=1, keepdims=True)
  weights = np.stack([uniform, np.eye(length, dtype=np.float32)])[None]
  roles = head_roles.roles_of_attention([weights], tokens, causal=True)
  assert roles["diffuse"][0, 0] == pytest.approx(1.0, abs=1e-5)
  assert roles["diffuse"][0, 1] == pytest.approx(0.0, abs=1e-6)
  # Read as an encoder's, the same head is below 1.
  assert head_roles.roles_of_attention([weights], tokens)["diffuse"][0, 0] < 0.9


def test_role_sums_pass_through_jit_and_vmap():  # stacked batches
  import jax
  rng = np.random.default_rng(2)
  tokens = rng.integers(1, 4, size=(2, 8, 6)).astype(np.int32)
  tokens[:, :, 4:] = 0
  weights = np.stack([_planted_weights(t) for t in tokens])
  one = jax.jit(head_roles.role_sums)
  single = [one(w, t) for w, t in zip(weights, tokens)]
  sums, counts = jax.jit(jax.vmap(head_roles.role_sums))(weights, tokens)
  for i, (one_sums, one_counts) in enumerate(single):
    for p in head_roles.PATTERNS:
      # Same float32 sums, in another order: a few ulps.
      np.testing.assert_allclose(sums[p][i], one_sums[p], rtol=1e-6)
      assert counts[p][i] == one_counts[p]


def _planted_model(max_len: int):
  """A one-layer model whose attention logits are set by hand: positions
  one-hot (learned position embeddings = identity, token embeddings 0), and
  each head's query/key kernels a scaled position map ``M`` (query i ->
  key f(i)); the LayerNorm before attention only shifts and scales the
  one-hot rows by the same amount everywhere. Every other parameter is 0
  (LayerNorm scales 1)."""
  import jax
  import jax.numpy as jnp
  from configs import default
  config = default.get_config(
      f"model.num_layers=1,model.num_heads=4,model.d_model={max_len},"
      f"model.head_dim={max_len},data.max_len={max_len}")
  model = build.make_model(config)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.ones((1, max_len), jnp.int32))["params"])
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: np.full(x.shape, 1.0 if path[-1].key == "scale" else
                              0.0, np.float32), shapes)
  params["pos_embedding"] = np.eye(max_len, dtype=np.float32)
  maps = [np.eye(max_len, k=-1), np.eye(max_len, k=1), np.eye(max_len),
          np.zeros((max_len, max_len))]  # previous, next, same, uniform
  attention = params["layer_0"]["attention"]
  for head, m in enumerate(maps):
    # logits[i, j] = 40 (LN e_i) . (M LN e_j) / sqrt(Dh) ~ 40 M[i, j] / ...
    attention["query"]["kernel"][:, head, :] = 40.0 * np.eye(max_len)
    attention["key"]["kernel"][:, head, :] = m.T
  return model, params


def test_planted_model_gets_the_right_top_role():
  model, params = _planted_model(8)
  rng = np.random.default_rng(1)
  inputs = rng.integers(1, 10, size=(40, 8)).astype(np.int32)
  lengths = rng.integers(2, 9, size=40)
  inputs[np.arange(8)[None] >= lengths[:, None]] = 0
  split = data.Split(inputs=inputs, targets=inputs)
  roles = head_roles.head_roles(model, params, split, batch_size=16)
  assert head_roles.top_roles(roles) == [[
      "previous_position", "next_position", "same_position", "diffuse"]]
  # The LayerNorm leaves a key-dependent shift of 1/8 of the logit gap (the
  # column sums of M); at a logit gap of 40 / var(one-hot) / sqrt(8) ~ 130
  # the planted key takes all but ~e^-100 of the weight.
  for head, name in enumerate(("previous_position", "next_position",
                               "same_position")):
    assert roles[name][0, head] > 0.99, name
  assert roles["diffuse"][0, 3] > 0.99


def _seed(seed: int, anti_diagonal: list[list[float]],
          loo: list[list[float]]) -> dict:
  """A pruning study's seed entry (2 layers x 4 heads) with the keys
  ``roles_section`` reads."""
  roles = {p: [[0.1] * 4, [0.1] * 4] for p in head_roles.PATTERNS}
  roles["anti_diagonal"] = anti_diagonal
  roles["diffuse"] = [[0.9, 0.8, 0.7, 0.65], [0.2, 0.3, 0.2, 0.1]]
  return {"seed": seed, "head_roles": roles,
          "importance": {"leave_one_out": loo,
                         "shapley_token_accuracy": [[None] * 4] * 2},
          "single_head_ablation": {"token_accuracy_change": [[-0.1] * 4] * 2}}


def test_pruning_report_sets_roles_beside_importance():
  # Importance ranks exactly as the anti-diagonal score, in both seeds.
  anti = [[0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9]]
  loo = np.arange(8.0).reshape(2, 4)
  results = {"seeds": [_seed(0, anti, loo.tolist()),
                       _seed(1, anti, (loo + 0.5).tolist())]}
  text = "\n".join(report.roles_section(results))
  assert "| 1 | 3 | anti-diagonal (0.90) | 7.000 | n/a | -0.100 |" in text
  assert "| 0 | 0 | diffuse (0.90) |" in text
  # rho = 1 in both seeds: Fisher's mean counts it as 1 - 6 / (n (n^2 - 1))
  # = 0.988 for n = 8 heads. Shapley is all NaN: no correlation.
  row = next(l for l in text.splitlines() if l.startswith("| anti-diagonal"))
  assert row.startswith("| anti-diagonal | 0.99 [") and row.endswith(
      "| n/a |")
  assert "averaged over 2 seeds" in text
  assert "rises (+) or falls (-) with: anti-diagonal (+), diffuse (-)" in text
  # Within layers, the top role is diffuse in layer 0 (falling with
  # importance: rho -1) and the anti-diagonal in layer 1 (rho +1): the
  # mean of the four is 0.
  assert "Within a layer, ρ = 0.00 [" in text and "includes 0" in text
  # Old results without roles: no section.
  assert report.roles_section({"seeds": [{"seed": 0}]}) == []
