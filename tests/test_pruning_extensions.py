"""Learned gates, mean ablation, retraining after pruning, and the study's
``--full`` outputs (``gates``, ``retraining``, ``mean_ablation``)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha
from configs import default
from mha import build
from mha.run import config_validation
from mha import data
from mha.model import Transformer, TransformerConfig
from mha import head_masks
from mha.pruning import core
from mha.pruning import gates
from mha.pruning import mean_ablation
from mha.pruning import oracle
from mha.pruning.study import StudyOptions
from mha.pruning.study import analysis
from mha.pruning.study import extensions
from conftest import init_params, random_model_and_split

# Gates, retraining and mean ablation train or evaluate many models.
pytestmark = pytest.mark.slow

CONFIG = TransformerConfig(vocab_size=8, num_layers=2, num_heads=2, d_model=8,
                           mlp_dim=8, max_len=6)
PLANTED = (1, 0)


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, inputs):
  """Jitted: a reference runs as one program, not op by op."""
  return model.apply({"params": params}, inputs)[0]


def _planted():
  """A model whose output depends on head ``PLANTED`` alone (every other
  head's output projection is zero), its targets its own confident
  predictions."""
  model = Transformer(CONFIG)
  params = jax.tree.map(np.array, init_params(model, jax.random.key(0)))
  for layer in range(CONFIG.num_layers):
    out = params[f"layer_{layer}"]["attention"]["out"]["kernel"]
    for head in range(CONFIG.num_heads):
      out[head] *= 10.0 if (layer, head) == PLANTED else 0.0
  params["logits"]["kernel"] *= 20.0  # confident: removing the head costs
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, CONFIG.vocab_size, (256, CONFIG.max_len))
  inputs = inputs.astype(np.int32)
  logits = _logits(model, params, inputs)
  targets = np.argmax(np.asarray(logits), -1).astype(np.int32)
  return model, params, data.Split(inputs, targets)


def test_gates_keep_the_planted_head_at_every_strength(caplog):
  model, params, split = _planted()
  flat = PLANTED[0] * CONFIG.max_heads + PLANTED[1]
  drop = core.evaluate_masks(model, params, split, head_masks.mask_without(
      CONFIG, [flat])[None])["loss"][0]
  strengths = (0.01, 0.1, 0.5)
  assert drop > 5 * max(strengths)  # the head is worth more than any penalty
  trained = gates.train_gates(model, params, split, strengths, steps=60,
                              batch_size=64, learning_rate=0.2)
  for log_alpha in trained["log_alpha"]:
    mask = gates.kept_mask(log_alpha, CONFIG)
    assert mask[PLANTED] == 1.0
    # The other heads cost nothing to remove: every penalty removes them.
    assert mask.sum() == 1.0, log_alpha
  np.testing.assert_allclose(trained["expected_heads"], 1.0, atol=0.1)
  # Another seed (the study's next one) trains on the step already compiled.
  caplog.clear()
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    gates.train_gates(model, params, split, strengths, steps=1,
                      batch_size=64, learning_rate=0.2, seed=1)
  assert not [r for r in caplog.records if "_step" in r.getMessage()]
  assert gates.removal_of_size(trained["log_alpha"][0], CONFIG, 3).tolist(
  ).count(flat) == 0
  # Never emptying a layer: layer 0 keeps its head of largest log_alpha.
  kept = gates.kept_mask(trained["log_alpha"][0], CONFIG,
                         no_layer_emptied=True)
  assert kept.sum(axis=1).tolist() == [1.0, 1.0]


def test_hard_concrete_gates_by_their_formulas():
  log_alpha = jnp.asarray([-3.0, 0.0, 3.0])
  # Jitted: the samples come from one program, not op by op.
  z = np.asarray(jax.jit(jax.vmap(lambda k: gates.sample(log_alpha, k)))(
      jax.random.split(jax.random.key(0), 20000)))
  assert float(z.min()) == 0.0 and float(z.max()) == 1.0  # exact 0 and 1
  # P(z != 0) of the samples against the closed form (3 sigma of 20000).
  np.testing.assert_allclose(np.mean(z > 0, axis=0),
                             gates.probability_open(log_alpha), atol=0.011)
  np.testing.assert_allclose(gates.deterministic(log_alpha),
                             [0.0, 0.5, 1.0], atol=1e-6)


@pytest.mark.parametrize("method", gates.EXACT_K_METHODS)
def test_exact_k_gates_keep_exactly_k_heads(method, caplog):
  # Three layers, one of them with no heads: the absent heads are never
  # counted, kept or removed.
  config = TransformerConfig(vocab_size=8, num_layers=3,
                             num_heads=(2, 0, 3), head_dim=4, d_model=8,
                             mlp_dim=8, max_len=6)
  model, params, split = random_model_and_split(config, n=32)
  n = 5
  targets = list(range(1, n))
  trained = gates.train_exact_k(model, params, split, targets, steps=3,
                                batch_size=16, method=method)
  exists = head_masks.existing_heads(config).reshape(-1)
  assert trained["log_alpha"].shape == (len(targets), 3, 3)
  for k, removed in zip(targets, trained["removed"]):
    removed = np.asarray(removed)
    assert len(set(removed.tolist())) == k and exists[removed].all()
    mask = head_masks.mask_without(config, removed)
    assert mask.sum() == n - k  # exactly N - k heads kept
  if method == "top_k":  # every step keeps exactly N - k heads
    np.testing.assert_array_equal(trained["expected_heads"],
                                  [n - k for k in targets])
  # Another seed (the study's next one) trains on the step already compiled.
  caplog.clear()
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    gates.train_exact_k(model, params, split, targets, steps=1,
                        batch_size=16, method=method, seed=1)
  assert not [r for r in caplog.records if "_step" in r.getMessage()]
  for bad in ([0], [n], [1, 2.5], []):
    with pytest.raises(ValueError, match="from 1 to 4"):
      gates.train_exact_k(model, params, split, bad, steps=1, batch_size=16)


def test_study_exact_k_entries_take_the_nearest_target():
  # --gate_targets=1,3 on 4 heads: k = 2 is ranked by the gates of 1 (the
  # smaller of two equally near), 0 and 4 need no gates; every k exact.
  model, params, split = random_model_and_split(CONFIG, n=32)
  run_config = types.SimpleNamespace(batch_size=16, seed=0)
  options = StudyOptions(gates=True, gate_targets=(3, 1), gate_steps=2)
  found = analysis.run_exact_k(model, params, split, options, run_config,
                               lambda _: None)
  assert found["targets"] == [1, 3] and found["log_alpha"].shape == (2, 2, 2)
  assert [e["k"] for e in found["entries"]] == [0, 1, 2, 3, 4]
  assert [e["target_k"] for e in found["entries"]] == [1, 1, 1, 3, 3]
  for e in found["entries"]:
    assert len(set(np.asarray(e["removed"]).tolist())) == e["k"]


def test_top_k_gates_are_exact_under_jit_and_vmap():
  exists = jnp.asarray([[True, True, True], [True, False, True]])
  log_alpha = jnp.asarray([[0.3, -1.0, 2.0], [0.0, 5.0, -0.5]])
  counts = jnp.arange(1, 5)
  keys = jax.random.split(jax.random.key(0), len(counts))
  sample = jax.jit(jax.vmap(
      lambda k, key: gates.top_k_sample(log_alpha, key, k, exists, 0.5)))
  z = np.asarray(sample(counts, keys))
  np.testing.assert_array_equal(z.sum(axis=(1, 2)), counts)  # exactly k
  assert set(np.unique(z)) <= {0.0, 1.0} and not z[:, 1, 1].any()
  soft = jax.jit(jax.vmap(lambda k: gates.relaxed_top_k(
      log_alpha, k, exists, 0.5)))(counts)
  # The relaxation: gates in [0, 1], at most k heads' worth of mass (a
  # head's share over the rounds is clipped at 1), more as k grows, none on
  # the absent head.
  soft = np.asarray(soft)
  assert soft.min() >= 0.0 and soft.max() <= 1.0
  total = soft.sum(axis=(1, 2))
  assert np.all(total <= np.asarray(counts) + 1e-5) and np.all(
      np.diff(total) > 0)
  assert soft[:, 1, 1].max() < 1e-6
  # Gradients flow to the scores (straight-through), and are finite.
  grad = jax.jit(jax.grad(lambda la: jnp.sum(gates.top_k_sample(
      la, keys[0], 2, exists, 0.5) * jnp.arange(6.0).reshape(2, 3))))(
          log_alpha)
  grad = np.asarray(grad)
  assert np.all(np.isfinite(grad)) and float(np.abs(grad).sum()) > 0


@pytest.fixture(scope="module")
def tiny(tiny_run):
  ckpt = mha.load_checkpoint(tiny_run.workdir)
  splits = data.load_splits(build.data_spec(ckpt.config),
                            ckpt.config.data.data_dir)
  return ckpt, splits


@pytest.mark.parametrize("heads", [[(0, 1)], [(1, 0), (1, 1)]])
def test_mean_ablation_equals_its_folded_bias_pruned_model(tiny, heads):
  ckpt, splits = tiny
  config = ckpt.model_config
  means = mean_ablation.head_means(ckpt.model, ckpt.params,
                                   splits["validation"])
  assert np.all(np.abs(means).sum(-1) > 0)  # every head has a mean
  inputs = splits["test"].inputs[:32]
  mask = head_masks.mask_without(config, [l * config.max_heads + h
                                    for l, h in heads])
  # Jitted: the references run as one program each, not op by op.
  defined = jax.jit(mean_ablation.mean_ablated_logits, static_argnums=0)(
      ckpt.model, ckpt.params, means, inputs, mask)
  params, pruned = mean_ablation.prune_mean_ablated(ckpt.params, config, heads,
                                                    means)
  logits = _logits(Transformer(pruned), params, inputs)
  # Float32 sums in another order: the fold is exact up to rounding.
  np.testing.assert_allclose(logits, defined, atol=1e-5, rtol=1e-5)
  zero = jax.jit(head_masks.masked_logits, static_argnums=0)(
      ckpt.model, ckpt.params, inputs, mask)
  # not zero ablation
  assert float(np.max(np.abs(np.asarray(zero) - np.asarray(defined)))) > 1e-2


def test_every_subset_under_mean_ablation(tiny):
  ckpt, splits = tiny
  config = ckpt.model_config
  means = mean_ablation.head_means(ckpt.model, ckpt.params,
                                   splits["validation"])
  shifts = mean_ablation.bias_shifts(ckpt.params, config, means)
  test = splits["test"]
  every = oracle.evaluate_subsets(ckpt.model, ckpt.params, test,
                                  per_example=True, bias_shifts=shifts)
  masks = oracle.subset_masks(config)
  one_by_one = mean_ablation.evaluate_masks(ckpt.model, ckpt.params, shifts,
                                            test, masks)
  for key in ("correct", "exact", "tokens"):
    np.testing.assert_array_equal(every[key], one_by_one[key])
  # float32 losses summed in another order.
  np.testing.assert_allclose(every["loss_sum"], one_by_one["loss_sum"],
                             rtol=1e-5, atol=1e-5)
  # The full mask has nothing to replace: zero and mean ablation agree.
  zero = oracle.evaluate_subsets(ckpt.model, ckpt.params, test,
                                 per_example=True)
  np.testing.assert_array_equal(every["correct"][-1], zero["correct"][-1])


def test_bad_options_are_refused():
  for changes, message in (({"gate_lambdas": (-1.0,)}, "--gate_lambdas"),
                           ({"gate_lambdas": ()}, "--gate_lambdas"),
                           ({"retrain_steps": 0}, "--retrain_steps"),
                           ({"retrain_fractions": (1.0,)},
                            "--retrain_fractions")):
    with pytest.raises(ValueError, match=message):
      StudyOptions(**changes).validate()
  assert not StudyOptions().extensions  # off by default


def test_wide_variant():
  config = default.get_config("wide")
  config_validation.validate_config(config)
  assert build.model_config(config).heads_per_layer == (8, 8)
  assert build.model_config(config).resolved_head_dim == 8


def test_identical_retraining_jobs_are_found():
  masks = np.ones((5, 2, 3), np.float32)
  masks[1, 0, 0] = masks[3, 0, 0] = 0  # rows 1 and 3: the same mask
  first, job = extensions._distinct(  # pylint: disable=protected-access
      [0, 0, 0, 0, 1], masks, np.asarray([100, 100, 200, 100, 100]))
  # Row 2 trains longer and row 4 starts elsewhere: both their own jobs.
  np.testing.assert_array_equal(first, [0, 1, 2, 4])
  np.testing.assert_array_equal(job, [0, 1, 2, 1, 3])
