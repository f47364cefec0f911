"""Tests of head importance, masks, curves, physical pruning and the
pruning script."""

import dataclasses
import functools
import json
import os
import shutil
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha import build
from mha import checkpoint as ckpt_lib
from mha.run import config_validation
from mha import data
from mha import head_masks
from mha import pruning
from mha.run import workdir_lock
from mha.pruning import ablation as ablation_lib
from mha.pruning import core
from mha.pruning import study
from mha.pruning.study import outputs as study_outputs
from mha.pruning.study import report as report_lib
from mha.pruning.study import seeds as study_seeds
from mha.model import Transformer, TransformerConfig

from conftest import copy_workdir, init_params, run, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prune_heads.py")

CONFIG = TransformerConfig(vocab_size=8, num_layers=2, num_heads=3, d_model=12,
                           mlp_dim=16, max_len=6)


def _tokens(rng, n, config=CONFIG):
  """Random tokens with random lengths >= 2 (0 = padding at the end)."""
  tokens = rng.integers(1, config.vocab_size, (n, config.max_len))
  lengths = rng.integers(2, config.max_len + 1, n)
  tokens[np.arange(config.max_len)[None, :] >= lengths[:, None]] = 0
  return tokens.astype(np.int32)


def _init(config=CONFIG, seed=0):
  model = Transformer(config)
  params = init_params(model, jax.random.key(seed))
  return model, jax.tree.map(np.asarray, params)


@functools.partial(jax.jit, static_argnums=0)
def _apply(model, params, inputs):
  """``(logits, attention)``, jitted: a reference runs as one program, not
  op by op."""
  return model.apply({"params": params}, inputs)


# Jitted: the masked reference runs as one program, not op by op.
_masked_logits = jax.jit(pruning.masked_logits, static_argnums=0)


def _planted(seed, planted=(1, 1)):
  """A model whose output depends on head ``planted`` alone, with that head
  attending sharply and every other head uniformly; the targets are its own
  predictions. Every measure must rank ``planted`` first."""
  model, params = _init(seed=seed)
  params = jax.tree.map(np.array, params)  # writable copies
  for layer in range(CONFIG.num_layers):
    attention = params[f"layer_{layer}"]["attention"]
    for head in range(CONFIG.max_heads):
      if (layer, head) == planted:
        attention["query"]["kernel"][:, head] *= 20.0  # sharp weights
        attention["out"]["kernel"][head] *= 10.0  # a strong contribution
      else:
        attention["query"]["kernel"][:, head] = 0.0  # uniform weights
        attention["out"]["kernel"][head] = 0.0  # no contribution
  rng = np.random.default_rng(seed)
  inputs = _tokens(rng, 64)
  logits, _ = _apply(model, params, inputs)
  targets = np.where(inputs != 0, np.argmax(np.asarray(logits), -1),
                     0).astype(np.int32)
  return model, params, data.Split(inputs, targets)


# --------------------------------------------------------------------------
# Importance measures.
# --------------------------------------------------------------------------


@pytest.mark.slow  # seconds of compiling or training: the full suite only
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planted_head_ranks_first_by_every_measure(seed):
  planted = (1, 1)
  flat = planted[0] * CONFIG.max_heads + planted[1]
  model, params, split = _planted(seed, planted)

  grad = pruning.gradient_importance(model, params, split, batch_size=32)
  loo = pruning.leave_one_out(model, params, split, batch_size=32)
  attn = pruning.attention_confidence(model, params, split, batch_size=32)
  measures = {
      "gradient": grad,
      "gradient_l2": pruning.normalize_per_layer(grad),
      "leave_one_out": loo["loss_increase"],
      "confidence": attn["confidence"],
      "entropy": -attn["entropy"],
  }
  for name, importance in measures.items():
    order = pruning.order_from_importance(importance)
    assert order[-1] == flat, (name, importance)  # most important = last
  # Heads that contribute nothing have exactly zero gradient and no effect.
  others = np.ones(grad.shape, bool)
  others[planted] = False
  np.testing.assert_array_equal(grad[others], 0.0)
  np.testing.assert_allclose(loo["loss_increase"][others], 0.0, atol=1e-6)
  assert loo["loss_increase"][planted] > 0.1
  iterative = pruning.iterative_gradient_order(model, params, split,
                                               batch_size=32)
  assert iterative[-1] == flat


@pytest.mark.slow  # seconds of compiling: the full suite only
def test_gradients_are_per_example():
  model, params = _init()
  rng = np.random.default_rng(0)
  inputs = _tokens(rng, 5)
  targets = _tokens(rng, 5) * (inputs != 0)
  mask = jnp.asarray(pruning.full_head_mask(CONFIG))
  gradients = jax.jit(pruning.head_mask_gradients, static_argnames="model")
  # On the host: slicing a device array compiles a program per slice.
  grads = np.asarray(gradients(model, params, inputs, targets, mask))
  assert grads.shape == (5, CONFIG.num_layers, CONFIG.max_heads)
  one = jax.jit(jax.grad(lambda m, x, y: pruning.per_example_loss(
      model, params, x, y, m)[0]))
  for i in range(5):
    np.testing.assert_allclose(grads[i],
                               one(mask, inputs[i:i + 1], targets[i:i + 1]),
                               rtol=1e-5, atol=1e-7)
  split = data.Split(inputs, targets)
  importance = pruning.gradient_importance(model, params, split, batch_size=2)
  mean_abs = np.mean(np.abs(np.asarray(grads)), 0)
  np.testing.assert_allclose(importance, mean_abs, rtol=1e-5)
  # Signs differ between examples here, so the importance (mean |g|) is not
  # |mean g|: on the head where they differ most, by over 10% of it.
  abs_mean = np.abs(np.mean(np.asarray(grads), 0))
  worst = np.argmax(mean_abs - abs_mean)
  assert (mean_abs - abs_mean).flat[worst] > 0.1 * mean_abs.flat[worst]


@pytest.mark.slow  # seconds of compiling or training: the full suite only
def test_vmapped_masks_equal_the_loop_and_jit_vmap_pass_through():
  model, params = _init()
  rng = np.random.default_rng(1)
  inputs = _tokens(rng, 20)
  split = data.Split(inputs, (inputs * 3) % CONFIG.vocab_size)
  masks = np.concatenate([pruning.full_head_mask(CONFIG)[None],
                          pruning.leave_one_out_masks(CONFIG),
                          pruning.all_but_one_masks(CONFIG)])
  vmapped = pruning.evaluate_masks(model, params, split, masks, batch_size=8,
                                   chunk_size=4)
  loop = pruning.evaluate_masks_loop(model, params, split, masks,
                                     batch_size=8)
  for key in vmapped:
    np.testing.assert_allclose(vmapped[key], loop[key], rtol=1e-5, atol=1e-6)
  # No masks (an empty selection): empty results under the same keys.
  for per_example in (False, True):
    full = pruning.evaluate_masks(model, params, split, masks[:1],
                                  per_example=per_example)
    empty = pruning.evaluate_masks(model, params, split, masks[:0],
                                   per_example=per_example)
    assert set(empty) == set(full)
    assert all(v.shape == (0,) + full[k].shape[1:] for k, v in empty.items())

  # Stacked parameters of two "seeds", one vmapped call.
  _, params_b = _init(seed=1)
  stacked = jax.tree.map(lambda a, b: np.stack([a, b]), params, params_b)
  sums = lambda p: pruning.masked_metric_sums(model, p, inputs, split.targets,
                                              jnp.asarray(masks[1]))
  both = jax.jit(jax.vmap(sums))(stacked)
  # Each model alone, jitted too: an eager call compiled each operation of
  # the model on its own (1.8 s of 2 s).
  one = jax.jit(sums)
  for i, p in enumerate((params, params_b)):
    single = one(p)
    np.testing.assert_allclose(both["loss_sum"][i], single["loss_sum"],
                               rtol=1e-5)


@pytest.mark.slow
def test_real_valued_masks_are_evaluated_not_rounded_to_a_subset():
  # Kwon et al.'s tuned masks (values like 1.26) beside 0/1 ones: with the
  # oracle's table of every subset at hand, the 0/1 masks are looked up and
  # the others evaluated as they are (they were rounded to their subset, so
  # the tuned curve equalled the untuned one).
  from mha.pruning import oracle  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import analysis  # pylint: disable=import-outside-toplevel
  model, params = _init()
  rng = np.random.default_rng(3)
  inputs = _tokens(rng, 12)
  split = data.Split(inputs, (inputs * 3) % CONFIG.vocab_size)
  options = study.StudyOptions(num_seeds=1, batch_size=16)
  table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                  batch_size=16)
  full = pruning.full_head_mask(CONFIG)
  tuned = full.copy()
  tuned[0, 0], tuned[1, 2] = 1.26, 0.0
  masks = np.stack([full, tuned, pruning.leave_one_out_masks(CONFIG)[1]])
  got = analysis._per_example(model, params, split, masks, table, options)  # pylint: disable=protected-access
  want = core.evaluate_masks(model, params, split, masks, batch_size=16,
                             per_example=True)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)
  assert not np.allclose(got["loss_sum"][1],
                         table["loss_sum"][oracle.subset_index(CONFIG,
                                                               tuned)])


@pytest.mark.slow
def test_the_studys_masks_are_evaluated_or_looked_up_in_a_table(
    monkeypatch):
  """The study evaluates its masks sharing their lower layers
  (``oracle.evaluate_mask_list``); given the oracle's per-example table it
  looks the 0/1 masks up and evaluates only a real-valued one. Both give
  the masks' own sums."""
  from mha.pruning import oracle  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import analysis  # pylint: disable=import-outside-toplevel
  model, params = _init()
  rng = np.random.default_rng(4)
  inputs = _tokens(rng, 10)
  split = data.Split(inputs, (inputs * 5) % CONFIG.vocab_size)
  options = study.StudyOptions(num_seeds=1, batch_size=16)
  subsets = oracle.subset_masks(CONFIG)  # 64
  table = oracle.evaluate_subsets(model, params, split, per_example=True,
                                  batch_size=16)
  evaluated = []
  evaluate = oracle.evaluate_mask_list
  monkeypatch.setattr(oracle, "evaluate_mask_list", lambda m, p, s, masks,
                      **k: (evaluated.append(len(masks)),
                            evaluate(m, p, s, masks, **k))[1])
  masks = np.concatenate([subsets[rng.choice(64, 12, replace=False)],
                          subsets[-1:] * np.float32(0.5)])
  for given, count in ((None, 13), (table, 1)):
    evaluated.clear()
    got = analysis._per_example(model, params, split, masks, given, options)  # pylint: disable=protected-access
    assert evaluated == [count]
    want = core.evaluate_masks(model, params, split, masks, batch_size=16,
                               per_example=True)
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_attention_statistics_of_uniform_heads():
  model, params = _init()
  params = jax.tree.map(np.array, params)
  for layer in range(CONFIG.num_layers):
    params[f"layer_{layer}"]["attention"]["query"]["kernel"][:] = 0.0
  inputs = np.array([[1, 2, 3, 4, 0, 0]], np.int32)  # 4 valid keys
  stats = pruning.attention_confidence(model, params,
                                       data.Split(inputs, inputs))
  np.testing.assert_allclose(stats["confidence"], 0.25, rtol=1e-5)
  np.testing.assert_allclose(stats["entropy"], np.log(4.0), rtol=1e-5)


# --------------------------------------------------------------------------
# Orders and curves.
# --------------------------------------------------------------------------


def test_orders_masks_and_curves_are_well_formed():
  config = TransformerConfig(vocab_size=8, num_layers=2, num_heads=(3, 1),
                             d_model=12, head_dim=4, mlp_dim=16, max_len=6)
  exists = pruning.existing_heads(config)
  assert exists.tolist() == [[True, True, True], [True, False, False]]
  importance = np.where(exists, [[3.0, 1.0, 2.0], [0.5, 9, 9]], np.nan)
  order = pruning.order_from_importance(importance)
  np.testing.assert_array_equal(order, [3, 1, 2, 0])
  for order in pruning.random_orders(config, 5, np.random.default_rng(0)):
    assert sorted(order) == [0, 1, 2, 3]

  counts = pruning.pruning_counts(4)
  np.testing.assert_array_equal(counts, [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(pruning.pruning_counts(10, 0.25),
                                [0, 2, 5, 8, 10])
  masks = pruning.masks_from_order(config, [3, 1, 2, 0], counts)
  assert masks.shape == (5, 2, 3)
  np.testing.assert_array_equal(masks.sum((1, 2)), [4, 3, 2, 1, 0])
  assert masks[1, 1, 0] == 0 and masks[2, 0, 1] == 0
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    pruning.pruning_counts(4, 1.5)

  fractions = counts / 4
  assert pruning.curve_auc(fractions, np.ones(5)) == pytest.approx(1.0)
  assert pruning.curve_auc(fractions, 1 - fractions) == pytest.approx(0.5)
  assert pruning.max_prunable_fraction(
      fractions, np.array([1.0, 0.995, 0.97, 0.999, 0.5])) == 0.25
  assert pruning.max_prunable_fraction(fractions, np.ones(5)) == 1.0
  np.testing.assert_allclose(
      np.linalg.norm(pruning.normalize_per_layer(np.array([[3.0, 4.0]])),
                     axis=-1), 1.0)


# --------------------------------------------------------------------------
# Physical pruning.
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("heads", [
    [(0, 1)],
    [(0, 0), (1, 2), (1, 0)],
    [(1, 0), (1, 1), (1, 2)],  # layer 1 loses every head
    [(l, h) for l in range(2) for h in range(3)],  # every head
])
def test_pruned_model_equals_masked_model(heads):
  model, params = _init()
  inputs = _tokens(np.random.default_rng(2), 16)
  pruned_params, config = pruning.prune_heads(params, CONFIG, heads)
  assert sum(config.heads_per_layer) == 6 - len(heads)
  assert config.head_dim == CONFIG.resolved_head_dim
  flat = [l * 3 + h for l, h in heads]
  mask = pruning.mask_without(CONFIG, flat)
  masked = _masked_logits(model, params, inputs, mask)
  pruned, weights = _apply(Transformer(config), pruned_params, inputs)
  np.testing.assert_allclose(pruned, masked, atol=1e-5)
  assert [w.shape[1] for w in weights] == list(config.heads_per_layer)
  assert pruning.count_params(pruned_params) < pruning.count_params(params)
  # The fused path of the pruned model agrees too (host inputs: a device
  # copy compiled a program of its own).
  fused = pruning.compile_prediction(Transformer(config), pruned_params,
                                     inputs)(pruned_params, inputs)
  np.testing.assert_allclose(fused, masked, atol=1e-5)


@pytest.mark.slow
def test_pruning_twice_renumbers_heads_and_runs_under_vmap():
  _, params = _init()
  once, _ = pruning.prune_heads(params, CONFIG, [(0, 0), (0, 2)])
  p1, c1 = pruning.prune_heads(params, CONFIG, [(0, 0)])
  p2, c2 = pruning.prune_heads(p1, c1, {0: [1]})  # old head 2 is now 1
  assert c2.heads_per_layer == (1, 3)
  jax.tree.map(np.testing.assert_array_equal, once, p2)
  with pytest.raises(ValueError, match=r"head \(0, 2\) does not exist"):
    pruning.prune_heads(p2, c2, [(0, 2)])
  with pytest.raises(ValueError, match="does not exist"):
    pruning.prune_heads(params, CONFIG, [(2, 0)])

  # Over stacked parameters of two models at once.
  _, params_b = _init(seed=1)
  stacked = jax.tree.map(lambda a, b: np.stack([a, b]), params, params_b)
  pruned = jax.vmap(lambda p: pruning.prune_heads(p, CONFIG, [(1, 1)])[0])(
      stacked)
  single, config = pruning.prune_heads(params_b, CONFIG, [(1, 1)])
  # Compared on the host: indexing the device arrays compiles a program each.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[1],
                                                          b), pruned, single)
  assert config.heads_per_layer == (3, 2)


def test_parse_heads():
  assert pruning.parse_heads("0:1, 1:3") == [(0, 1), (1, 3)]
  assert pruning.parse_heads("") == []
  for bad in ("0", "a:1", "0:-1", "1:2:3"):
    with pytest.raises(ValueError, match="LAYER:HEAD"):
      pruning.parse_heads(bad)


@pytest.mark.slow  # over 2 s on 2 cores: the full suite only
def test_time_predictions_reports_rates_and_flops():
  model, params = _init()
  pruned_params, pruned_config = pruning.prune_heads(params, CONFIG,
                                                     [(0, 0), (1, 1)])
  inputs = {2: _tokens(np.random.default_rng(0), 2)}
  rates, flops = pruning.time_predictions(
      [(model, params), (Transformer(pruned_config), pruned_params)], inputs,
      repeats=1, min_seconds=0.0)
  assert rates.shape == flops.shape == (2, 1)
  assert np.all(rates > 0)
  assert flops[1, 0] < flops[0, 0]  # fewer heads, fewer FLOPs


# --------------------------------------------------------------------------
# The script, end to end, and its bad input.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_workdir(tiny_run):
  """The session's tiny trained run (read only)."""
  return tiny_run.workdir


def _run_script(*args, env, timeout=300):
  return run([sys.executable, SCRIPT, *args], timeout=timeout, env=env)


def _check_seed_contract(seed, num_heads):
  """The ``results.json`` contract of one seed (issue 14)."""
  oracle = seed["oracle"]
  assert [e["k"] for e in oracle] == list(range(num_heads + 1))
  for entry in oracle:
    assert len(entry["removed"]) == entry["k"]
    for split in ("validation", "test"):
      assert set(entry[split]) >= {"token_accuracy", "exact_match", "loss"}
  shapley = np.asarray(seed["importance"]["shapley_token_accuracy"])
  assert shapley.shape == np.asarray(seed["importance"]["gradient"]).shape
  # Efficiency on the real model: v(all) - v(none) on validation (float64
  # sums of 2**N accuracies).
  assert shapley.sum() == pytest.approx(
      oracle[0]["validation"]["token_accuracy"] -
      oracle[-1]["validation"]["token_accuracy"], abs=1e-9)
  for name, summary in seed["curve_summary"].items():
    for metric in ("token_accuracy", "exact_match"):
      # A percentile interval need not hold the point estimate; it is an
      # ordered pair inside the range of an AUC of accuracies.
      low, high = summary[f"auc_{metric}_ci"]
      assert 0.0 <= low <= high <= 1.0, name
  # Every subset evaluated: exact Shapley values and every pair's
  # interaction, largest magnitude first.
  assert seed["shapley_method"] == "exact"
  pairs = seed["interactions"]["pairs"]
  assert len(pairs) == num_heads * (num_heads - 1) // 2
  assert [abs(p["value"]) for p in pairs] == sorted(
      (abs(p["value"]) for p in pairs), reverse=True)
  assert all(len(p["heads"]) == 2 for p in pairs)
  oracle_auc = seed["curve_summary"]["oracle"]["auc_token_accuracy"]
  assert seed["curve_summary"]["oracle"]["auc_token_accuracy_minus_random"] \
      == pytest.approx(oracle_auc -
                       seed["curve_summary"]["random"]["auc_token_accuracy"])
  # Issue 56: the best ordering (nested: one head more at each k), the
  # oracle by loss (the lowest validation loss at each k), every method's
  # cost and the checkpoints along training.
  best, by_loss = seed["best_ordering"], seed["oracle_by_loss"]
  assert [e["k"] for e in best] == [e["k"] for e in by_loss] == list(
      range(num_heads + 1))
  for before, after in zip(best, best[1:]):
    assert set(map(tuple, before["removed"])) < set(map(tuple,
                                                        after["removed"]))
  for entry, chosen in zip(oracle, by_loss):
    assert chosen["validation"]["loss"] <= entry["validation"]["loss"] + 1e-6
  for name in seed["curve_summary"]:
    assert set(seed["cost"][name]) >= {"subset_evaluations",
                                       "forward_passes", "backward_passes",
                                       "seconds"}, name
  assert seed["cost"]["oracle"]["subset_evaluations"] == 2 ** num_heads
  steps = [e["step"] for e in seed["checkpoints_over_training"]]
  assert steps == [10, 20] and steps[-1] == seed["step"]
  assert "gradient" in seed["checkpoints_over_training"][0]["orderings"]


def test_script_end_to_end(tiny_workdir, tmp_path, subprocess_env):
  # One seed: every key of the contract, the aggregate's intervals included
  # (the example bootstrap's, stats.interval_method), is there with one; the
  # aggregation code is the same over any number of seeds. A two-seed study
  # through this script (the extra seed trained, analysed, aggregated) is
  # test_study_faults' chaos test; training a seed in-process,
  # test_mismatched_seed_directory_is_refused.
  out = str(tmp_path / "pruning")
  result = _run_script(
      f"--workdir={tiny_workdir}", f"--out={out}", "--num_seeds=1",
      "--num_random_orders=3", "--num_bootstrap=20",
      "--speed_fractions=0.5", "--batch_sizes=4", "--speed_repeats=1",
      "--speed_max_repeats=1", "--speed_min_seconds=0.01",
      "--batch_size=32", "--remove_heads=1:0",
      # Gates, retraining and mean ablation (issue 15), as small as they go.
      "--full", "--gate_steps=2", "--gate_lambdas=0.01,1", "--retrain_steps=2",
      "--retrain_random=1", "--retrain_fractions=0.5", "--noattribution",
      env=subprocess_env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().splitlines()[-1] == (
      f"Wrote {out}/results.json, {out}/report.md and the report's PNG "
      "plots.")
  with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  assert [s["seed"] for s in results["seeds"]] == [0]
  assert results["seeds"][0]["config"]["seed"] == 0
  assert results["interval_method"] == "example_bootstrap_percentile"
  num_heads = 4  # tiny: 2 layers x 2 heads
  seed = results["seeds"][0]
  _check_seed_contract(seed, num_heads)
  # Both searches always run: one subset per k, entries like the oracle's,
  # a curve each with its gap to the oracle, their cost recorded.
  for name in ("surrogate", "beam"):
    entries = seed["searches"][name]
    assert [e["k"] for e in entries] == list(range(num_heads + 1))
    for e in entries:
      assert len(e["removed"]) == e["k"]
      assert set(e["test"]) == {"loss", "token_accuracy", "exact_match"}
    # Never better on validation than the oracle, which saw every subset.
    for e, o in zip(entries, seed["oracle"]):
      assert (e["validation"]["token_accuracy"] <=
              o["validation"]["token_accuracy"] + 1e-12)
    assert len(results["aggregate"]["curve_summary"][name][
        "auc_token_accuracy_minus_oracle_ci"]) == 2
    assert seed["timings"][f"{name}_s"] > 0
    assert seed["search_evaluations"][name] > 0
  # Kwon et al.: a subset per k like the searches', no subset evaluated;
  # tuned masks are 0 exactly on the removed heads.
  tuned = ("kwon_tuned", "kwon_tuned_attention_output", "oracle_kwon_tuned")
  for name in ("kwon",) + tuned:
    entries = seed["searches"][name]
    assert [e["k"] for e in entries] == list(range(num_heads + 1))
    assert seed["search_evaluations"][name] == (
        2 ** num_heads if name == "oracle_kwon_tuned" else 0)
    assert seed["timings"][f"{name}_s"] > 0
  for name, untuned in (("kwon_tuned", seed["searches"]["kwon"]),
                        ("kwon_tuned_attention_output",
                         seed["searches"]["kwon"]),
                        ("oracle_kwon_tuned", seed["oracle"])):
    for e, plain in zip(seed["searches"][name], untuned):
      assert e["removed"] == plain["removed"]
      mask = np.asarray(e["mask"])
      assert mask.shape == (2, 2)
      assert sorted(map(list, zip(*np.nonzero(mask == 0)))) == sorted(
          e["removed"])
      assert e["rejected_layer"] in (None, 1)
    # Tuned minus untuned, paired, with its interval.
    assert len(results["aggregate"]["curve_summary"][name][
        "auc_token_accuracy_minus_untuned_ci"]) == 2
  # Exact-K gates (--full has --gates): every k, exactly k removed, the
  # oracle's keys plus the target whose gates chose it (every k trained).
  entries = seed["searches"]["gates_k"]
  assert [e["k"] for e in entries] == list(range(num_heads + 1))
  for e in entries:
    assert len({tuple(h) for h in e["removed"]}) == e["k"]
    assert set(e) == {"k", "removed", "validation", "test", "target_k"}
  assert [e["target_k"] for e in entries[1:-1]] == [1, 2, 3]
  assert seed["gates_k"]["targets"] == [1, 2, 3]
  assert seed["search_evaluations"]["gates_k"] == 0
  assert np.asarray(seed["importance"]["fisher"]).shape == (2, 2)
  assert results["ablation"] == "zero"
  assert "attribution" not in seed  # --noattribution
  # The gradient and leave-one-out orderings, re-estimated per resample.
  info = seed["bootstrap_importance"]
  assert info["reestimated"] == ["gradient", "gradient_l2",
                                 "reverse_gradient", "leave_one_out"]
  assert info["conditional"] == [] and info["distinct_orders"]["gradient"] >= 1
  for name in ("gradient", "gradient_l2", "gradient_iterative", "shapley",
               "fisher", "leave_one_out", "confidence", "entropy",
               "reverse_gradient"):
    assert sorted(seed["orders"][name]) == list(range(num_heads)), name
    curve = seed["curves"][name]["token_accuracy"]
    assert len(curve) == num_heads + 1
    assert curve[0] == pytest.approx(seed["test"]["token_accuracy"])
  assert np.asarray(seed["orders"]["random"]).shape == (3, num_heads)
  assert seed["orders"]["reverse_gradient"] == seed["orders"]["gradient"][::-1]
  # Never emptying a layer: 2 layers x 2 heads leave at most 2 removable.
  nle = seed["no_layer_emptied"]
  assert nle["counts"] == [0, 1, 2] and len(nle["oracle"]) == 3
  for entry in nle["oracle"]:
    assert len({layer for layer, _ in entry["removed"]}) == entry["k"]
  agg = results["aggregate"]
  assert len(agg["curve_summary"]["gradient"]["auc_token_accuracy_ci"]) == 2
  assert "gradient_halves" in agg["spearman"]
  assert results["custom_pruning"]["heads_per_layer"] == [2, 1]
  with np.load(os.path.join(out, "examples_seed0.npz")) as examples:
    assert examples["test_correct"].shape == (len(examples["masks"]), 64)
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    report = f.read()
  pngs = [line.split("(")[1].rstrip(")") for line in report.splitlines()
          if line.startswith("![")]
  assert len(pngs) >= 7
  assert "## Does importance follow role?" in report  # mha.head_roles
  for png in pngs:
    with open(os.path.join(out, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
  _check_extensions_contract(results, out)
  _check_rerendered_report(out)
  _check_a_study_without_plots_over_one_with_them(out)


def _check_a_study_without_plots_over_one_with_them(out):
  """A study written with ``--noplots`` where one with plots was removes
  that one's figures (they showed other results), and nothing else."""
  again = os.path.join(os.path.dirname(out), "again")
  shutil.copytree(out, again)
  with open(os.path.join(again, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  figures = report_lib.figure_files(results)
  assert len(figures) >= 7 and all(
      os.path.exists(os.path.join(again, name)) for name in figures)
  others = sorted(set(os.listdir(again)) - set(figures))
  study_outputs.write_outputs(
      dict(results, options=dict(results["options"], plots=False)), again)
  assert sorted(os.listdir(again)) == others
  assert report_lib.figure_files(
      dict(results, options=dict(results["options"], plots=False))) == []


def _check_rerendered_report(out):
  """``python -m mha.pruning.study.report OUT --noplots`` renders, from
  results.json alone, the report the study wrote, byte for byte, and leaves
  the figures alone. (The study itself renders its figures from the
  results.json it wrote, as a re-render does: ``outputs.write_outputs``.)"""
  path = os.path.join(out, "report.md")
  with open(path, "rb") as f:
    written = f.read()
  os.remove(path)
  figure = os.path.join(out, "curves_token_accuracy.png")
  before = os.stat(figure).st_mtime_ns
  assert report_lib.main([out, "--noplots"]) == 0
  with open(path, "rb") as f:
    assert f.read() == written
  assert os.stat(figure).st_mtime_ns == before
  # A results.json with a part missing: one line, and the report there is
  # left as it was (it used to be emptied before the render failed).
  with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  del results["seeds"][0]["curves"]
  damaged = os.path.join(os.path.dirname(out), "damaged")
  os.makedirs(damaged)
  with open(os.path.join(damaged, "results.json"), "w", encoding="utf-8") as f:
    json.dump(results, f)
  shutil.copy(path, os.path.join(damaged, "report.md"))
  assert report_lib.main([damaged, "--noplots"]) == 2
  with open(os.path.join(damaged, "report.md"), "rb") as f:
    assert f.read() == written
  assert sorted(os.listdir(damaged)) == ["report.md", "results.json"]


def test_report_of_a_folder_without_results_exits_2(tmp_path, capsys):
  assert report_lib.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "results.json" in err[0], err
  assert os.listdir(tmp_path) == []
  # A benchmark grid's results.json is not a study's.
  (tmp_path / "results.json").write_text(
      json.dumps({"cells": {}, "leaderboard": []}), encoding="utf-8")
  assert report_lib.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is not a pruning study's results" in err[0], err
  assert os.listdir(tmp_path) == ["results.json"]


def _check_extensions_contract(results, out):
  """``--full``'s keys in results.json, its report sections and plots."""
  rows = results["gates"]["all"]
  assert [r["lambda"] for r in rows] == [0.01, 1.0]
  seed = rows[0]["per_seed"][0]
  assert {"kept", "heads_removed", "validation", "test"} <= set(seed)
  assert set(seed["test"]) == {"loss", "token_accuracy", "exact_match"}
  assert len(rows[0]["test_token_accuracy_ci"]) == 2
  assert "lowest_loss_minus_oracle_token_accuracy_ci" in rows[0]
  exact = results["gates"]["exact_k"]
  assert [r["target_k"] for r in exact] == [1, 2, 3]
  for r in exact:
    assert r["k"] == r["target_k"] and len(r["per_seed"]) == 1
    assert all(len(s["removed"]) == r["k"] for s in r["per_seed"])
    assert len(r["minus_oracle_token_accuracy_ci"]) == 2
    assert np.isfinite(r["minus_oracle_token_accuracy"])
  assert results["gates"]["exact_k_method"] == "top_k"
  assert len(results["aggregate"]["curve_summary"]["gates_k"][
      "auc_token_accuracy_minus_oracle_ci"]) == 2
  retrained = results["retraining"]["orderings"]
  assert set(retrained) == {"gradient", "oracle", "gates", "random"}
  for entry in retrained["oracle"].values():
    # The arms of issue 24 and the old control.
    for key in ("before", "after", "from_scratch", "fine_tuned", "scratch_e",
                "scratch_b", "rewind"):
      low, high = entry[f"{key}_ci"]
      assert low <= entry[key] <= high
    # Scratch-B: at least the run's 20 steps and the 2 of fine-tuning.
    assert entry["scratch_b_steps"] > 20 + 2
  assert "scratch_e" not in retrained["random"]["0.5"]  # controls_random off
  mean = results["mean_ablation"]
  assert set(mean["curves"]) == set(results["aggregate"]["curves"])
  assert "auc_token_accuracy_ci" in mean["curve_summary"]["oracle"]
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    report = f.read()
  for section in ("## Learned gates", "### Exact-K gates",
                  "## Retraining after pruning",
                  "## Mean ablation", "## Searches for the best subset",
                  "## The oracle by loss", "## Over training"):
    assert section in report
  assert "and, tuned, refits the kept heads' mask values" in report
  assert "## Mask tuning" in report and "Δ AUC (tuned − untuned)" in report
  for png in ("curves_mean_ablation.png", "retraining.png"):
    assert os.path.getsize(os.path.join(out, png)) > 10_000


@pytest.fixture(scope="module")
def resample_study_beyond_the_oracle(tiny_run, tmp_path_factory):
  """One in-process study shared by the two tests below: resample ablation,
  with an oracle limit (3 heads) below the tiny model's 4 heads (Shapley
  values sampled: 4 antithetic pairs of permutations, not 32; efficiency
  holds for each), no plots (the script's end-to-end test renders them).
  Batches of 32, as that test's: some of its programs load from the
  compilation cache.
  ``(options, out, results)``."""
  options = study.StudyOptions(num_seeds=1, speed=False, oracle_max_heads=3,
                               num_bootstrap=20, num_random_orders=1,
                               reestimate=False, batch_size=32, plots=False,
                               ablation="resample", over_training=False,
                               bootstrap_importance=False, shapley_pairs=4)
  out = str(tmp_path_factory.mktemp("resample_study") / "out")
  results = study.run(tiny_run.workdir, out, options, log=lambda _: None)
  return types.SimpleNamespace(options=options, out=out, results=results)


@pytest.mark.slow
def test_a_study_under_resample_ablation(tiny_run, tmp_path,
                                         resample_study_beyond_the_oracle):
  shared = resample_study_beyond_the_oracle
  options, out, results = shared.options, shared.out, shared.results
  assert results["ablation"] == "resample"
  seed = results["seeds"][0]
  # The tunings assume zero ablation.
  assert not {"kwon_tuned", "kwon_tuned_attention_output",
              "oracle_kwon_tuned"} & set(seed["searches"])
  # Attribution patching: an ordering per baseline, checked against actual
  # patching (leave-one-out under the same baseline; resample's is the
  # study's, on its own donors).
  for name in ("zero", "mean", "resample"):
    check = seed["attribution"][name]
    assert np.asarray(check["estimate"]).shape == (2, 2)
    np.testing.assert_allclose(check["estimate"],
                               seed["importance"][f"attribution_{name}"])
    assert -1.0 <= check["spearman"]["rho"] <= 1.0
    assert sorted(seed["orders"][f"attribution_{name}"]) == [0, 1, 2, 3]
    assert len(seed["curves"][f"attribution_{name}"]["token_accuracy"]) == 5
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    report = f.read()
  assert "## Attribution patching against actual patching" in report
  assert "(`--ablation resample`)" in report
  # Kwon et al.'s search is described without the tuning it skipped.
  assert "rearranges each layer's removals" in report
  assert "refits the kept heads' mask values" not in report
  _check_the_study_is_not_mixed_with_another(tiny_run, out, options,
                                             tmp_path)
  # Every head removed, on test (each curve's last point): each replaced by
  # its context on the test example's donor (drawn as the study draws them).
  want = _none_accuracy(tiny_run, "test", "resample")
  zero = _none_accuracy(tiny_run, "test")
  for name in ("gradient", "random", "attribution_resample"):
    got = seed["curves"][name]["token_accuracy"][-1]
    assert got == pytest.approx(want, abs=1e-6) and got != zero, name


def _check_the_study_is_not_mixed_with_another(tiny_run, out, options,
                                               tmp_path):
  """The same study again into its folder is allowed; a study of another
  workdir, or of another run of the same workdir (its config differs),
  into it is refused before anything is read or written."""
  first = study.check_inputs(tiny_run.workdir, out, options)
  study.check_inputs(tiny_run.workdir, out, options, checkpoint=first)
  results = os.path.join(out, "results.json")
  with open(results, "rb") as f:
    written = f.read()
  listing = sorted(os.listdir(out))
  other = tmp_path / "other"  # no checkpoint: refused before it is looked for
  other.mkdir()
  with pytest.raises(config_validation.ConfigError) as error:
    study.check_inputs(str(other), out, options)
  assert str(error.value) == (
      f"--out {out} holds the study of another workdir ({tiny_run.workdir})"
      "; refusing to mix it with this one's: choose another --out, or "
      "delete that study")
  # The same workdir retrained with another config.
  retrained = json.loads(written)
  retrained["seeds"][0]["config"]["model"]["mlp_dim"] += 1
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "results.json").write_text(json.dumps(retrained))
  with pytest.raises(config_validation.ConfigError,
                     match=r"holds the study of another run of .* \(its "
                           r"config differs in model.mlp_dim\)"):
    study.check_inputs(tiny_run.workdir, str(elsewhere), options,
                       checkpoint=first)
  with open(results, "rb") as f:
    assert f.read() == written
  assert sorted(os.listdir(out)) == listing


@pytest.mark.slow
def test_oracle_skipped_above_oracle_max_heads(
    tiny_run, tmp_path, resample_study_beyond_the_oracle):
  out = resample_study_beyond_the_oracle.out
  results = resample_study_beyond_the_oracle.results
  seed = results["seeds"][0]
  assert seed["oracle"] == [] and "oracle_max_heads=3" in seed[
      "oracle_skipped"]
  # Above the exhaustive limit the Shapley values are sampled, with
  # intervals, and order the heads as the exact ones would.
  assert seed["shapley_method"] == "sampled" and "interactions" not in seed
  values = np.asarray(seed["importance"]["shapley_token_accuracy"])
  ci = np.asarray(seed["importance"]["shapley_token_accuracy_ci"])
  assert ci.shape == values.shape + (2,)
  assert np.all(ci[..., 0] <= values) and np.all(values <= ci[..., 1])
  # Efficiency holds for every sampled order, so for their mean: v(all) -
  # v(none) on validation (float64 sums of per-example shares), every head
  # removed as the study removes them (resample ablation).
  assert values.sum() == pytest.approx(
      seed["validation"]["token_accuracy"] -
      _none_accuracy(tiny_run, "validation", "resample"), abs=1e-6)
  assert sorted(seed["orders"]["shapley"]) == list(range(4))
  assert "oracle" not in seed["curve_summary"]
  # Beyond the oracle's reach the searches still run: a subset per k, with
  # no gap to an oracle to report.
  for name in ("surrogate", "beam"):
    assert [e["k"] for e in seed["searches"][name]] == list(range(5))
    assert "auc_token_accuracy_minus_oracle" not in seed["curve_summary"][
        name]
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    report = f.read()
  assert "oracle_max_heads=3" in report
  # The report's text again from results.json alone (NaNs are nulls there);
  # the --full study's test re-renders the plots too.
  with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
    loaded = json.load(f)
  report_lib.write(loaded, str(tmp_path))
  assert (tmp_path / "report.md").read_text() == report
  assert os.listdir(tmp_path) == ["report.md"]  # no plots: --noplots
  # --plot_format pdf: report.md links the figures as PDF files (Markdown
  # viewers do not inline PDF); test_pruning_plots writes one.
  pdf = dict(loaded, options=dict(loaded["options"], plot_format="pdf"))
  text = "\n".join(report_lib.report_lines(pdf))
  assert "[token accuracy (PDF)](curves_token_accuracy.pdf)" in text
  assert "![" not in text and ".png" not in text


def _none_accuracy(tiny_run, split, ablation="zero"):
  """Token accuracy on ``split`` of the tiny model with every head removed
  under ``ablation`` (resample's donors drawn as the study draws them)."""
  model, params = build.make_model(tiny_run.config), tiny_run.state.params
  splits = data.load_splits(build.data_spec(tiny_run.config),
                            tiny_run.config.data.data_dir)
  abl = None if ablation == "zero" else ablation_lib.build(
      model, params, ablation, splits["validation"], splits[split],
      rng=np.random.default_rng([0, 4, ("validation", "test").index(split)]))
  none = np.zeros((1,) + head_masks.existing_heads(model.config).shape,
                  np.float32)
  return float(core.evaluate_masks(model, params, splits[split], none,
                                   ablation=abl)["token_accuracy"][0])


@pytest.mark.slow
def test_exact_shapley_above_the_oracle_limit_is_refused(tiny_workdir,
                                                         tmp_path):
  options = study.StudyOptions(num_seeds=1, oracle_max_heads=3,
                               shapley="exact")
  with pytest.raises(ValueError, match="--shapley=exact needs every subset"):
    study.check_inputs(tiny_workdir, str(tmp_path / "out"), options)
  assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_oracle_beyond_the_machines_memory_is_refused(tiny_workdir,
                                                         tmp_path,
                                                         monkeypatch):
  from mha.pruning import oracle  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(oracle, "machine_memory_bytes", lambda: 1000)
  with pytest.raises(ValueError) as raised:
    study.check_inputs(tiny_workdir, str(tmp_path / "out"),
                       study.StudyOptions(num_seeds=1))
  message = str(raised.value)
  assert message.startswith("--oracle_max_heads=16: every subset of this "
                            "model's 4 heads needs about ")
  assert "more than this machine's 0.0 GiB" in message
  # A limit below the model's heads evaluates no subset: nothing to refuse.
  study.check_inputs(tiny_workdir, str(tmp_path / "out"),
                     study.StudyOptions(num_seeds=1, oracle_max_heads=3))
  assert not (tmp_path / "out").exists()


def _write_seed_config(out, config, **changes):
  """A seed directory whose recorded config is ``config`` changed."""
  saved = config.to_dict()
  saved["seed"] = config.seed + 1
  for key, value in changes.items():
    group, name = key.split(".")
    saved[group][name] = value
  directory = out / "seeds" / f"seed_{config.seed + 1}"
  directory.mkdir(parents=True)
  (directory / "config.json").write_text(json.dumps(saved))
  return directory


@pytest.mark.slow
def test_mismatched_seed_directory_is_refused(tiny_run, tmp_path,
                                               subprocess_env):
  out = tmp_path / "out"
  directory = _write_seed_config(out, tiny_run.config, **{
      "model.mlp_dim": 64})
  result = _run_script(f"--workdir={tiny_run.workdir}", f"--out={out}",
                       "--num_seeds=2", env=subprocess_env)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "model.mlp_dim" in lines[0], lines
  assert "--retrain_seeds" in lines[0]
  assert sorted(os.listdir(out)) == ["seeds"]  # nothing written
  first = ckpt_lib.load_checkpoint(tiny_run.workdir)
  # A matching directory (only resumable keys differ) is not a conflict,
  other = tmp_path / "other"
  _write_seed_config(other, tiny_run.config, **{"data.data_dir": "/else"})
  assert study_seeds.seed_conflicts(first, str(other), 2) == {}
  # but a seed trained for another number of steps is.
  longer = tmp_path / "longer"
  _write_seed_config(longer, tiny_run.config)
  saved = json.loads((longer / "seeds" / "seed_1" / "config.json").read_text())
  saved["num_train_steps"] = 2 * tiny_run.config.num_train_steps
  (longer / "seeds" / "seed_1" / "config.json").write_text(json.dumps(saved))
  assert list(study_seeds.seed_conflicts(first, str(longer), 2).values()) == [
      ["num_train_steps"]]
  # --retrain_seeds trains the seed afresh in place of the stale directory;
  # every seed is analysed at the workdir's step (10 here, of 20).
  at_10 = ckpt_lib.load_checkpoint(tiny_run.workdir, 10)
  models = study_seeds.seed_models(at_10, str(out), 2, log=lambda _: None,
                                  retrain=True)
  assert models[1].config.seed == 1 and models[1].config.model.mlp_dim == (
      tiny_run.config.model.mlp_dim)
  assert [m.step for m in models] == [10, 10]
  assert study_seeds.seed_conflicts(first, str(out), 2) == {}
  assert directory.is_dir()
  # A finished seed directory without the step asked for is refused.
  shutil.rmtree(os.path.join(ckpt_lib.checkpoint_dir(directory), "10"))
  with pytest.raises(ValueError, match="has no checkpoint of step 10"):
    study_seeds.check_seeds(at_10, str(out), 2, retrain=False)


@pytest.mark.parametrize("args, lock_dir, message", [
    (["--oracle_max_heads=0"], False,
     "--oracle_max_heads must be >= 1, got 0"),
    (["--out="], False,
     '--out is empty; name a folder ("." for the current one)'),
    pytest.param(["--ablation=streaming:2,6"], False,
                 "--ablation 'streaming:2,6' needs a causal decoder; this "
                 "model is an encoder (model.causal=False)",
                 marks=pytest.mark.slow),
    # Found only when the study takes its lock: run.lock cannot be made.
    (["--num_seeds=1"], True, "cannot use {out}: is a directory: "
                              "{out}/run.lock; choose a folder this process "
                              "can write"),
    # A workdir whose config.json is damaged (and no checkpoint): it was a
    # traceback, from configuring the compilation cache.
    (["--workdir={damaged}"], False,
     "the run config {damaged}/config.json is damaged: not valid JSON "
     "(Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)); move it away or use another workdir"),
])
def test_bad_option_exits_2_writing_nothing(tiny_workdir, tmp_path,
                                            subprocess_env, args, lock_dir,
                                            message):
  """The script turns the ValueError of a check into one line and exit 2
  (each check is tested in-process below)."""
  out = tmp_path / "out"
  if lock_dir:
    (out / workdir_lock.LOCK_FILE).mkdir(parents=True)
  damaged = tmp_path / "damaged"
  damaged.mkdir()
  (damaged / "config.json").write_text("{not json")
  args = [a.format(damaged=damaged) for a in args]
  before = _tree(tmp_path)
  result = _run_script(f"--workdir={tiny_workdir}", f"--out={out}", *args,
                       env=subprocess_env)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0] == "prune_heads.py: error: " + message.format(
      out=out, damaged=damaged)
  assert _tree(tmp_path) == before  # nothing written


def _tree(path) -> list[str]:
  """Every folder and file under ``path``."""
  return sorted(os.path.relpath(os.path.join(d, name), path)
                for d, dirs, files in os.walk(path) for name in dirs + files)


def test_output_folders_that_may_not_be_written_are_refused(tmp_path,
                                                            data_dir):
  """--out: an empty path, a file (or one in the way), a run's checkpoints
  (a resume of that run deletes them), a results.json that is not this
  workdir's study; nothing written."""
  base = tmp_path.resolve()
  workdir = str(base / "workdir")
  run = base / "run"  # another run: config.json beside its checkpoints
  (run / "checkpoints" / "10").mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"model": {}, "data": {}}))
  (base / "afile").write_text("x")
  (base / "unreadable").mkdir()
  (base / "unreadable" / "results.json").write_text("{")
  (base / "study").mkdir()
  (base / "study" / "results.json").write_text(json.dumps({
      "workdir": workdir, "seeds": [{"config": {"seed": 0}}]}))
  before = _tree(base)
  for out, message in [
      ("", "--out is empty; name a folder"),
      (base / "afile", f"--out {base}/afile exists and is not a directory"),
      (base / "afile" / "x", f"cannot use --out {base}/afile/x: "
                             f"{base}/afile is a file, not a folder"),
      (run / "checkpoints" / "10", f"--out {run}/checkpoints/10 is inside "
       f"the checkpoints of the run in {run}, which a resume of that run "
       f"would delete; choose a folder outside {run}/checkpoints"),
      (run / "checkpoints", "is the checkpoints folder of the run in"),
      (run / "checkpoints" / "10" / "pruning", "is inside the checkpoints"),
      (base / "unreadable", f"--out {base}/unreadable holds a results.json "
       "that does not read as a study's"),
      (base / "study", f"--out {base}/study holds the study of another "
       f"workdir ({workdir})"),
  ]:
    with pytest.raises(config_validation.ConfigError) as error:
      study.check_out_dir(str(base / "this"), str(out))
    assert message in str(error.value) and "\n" not in str(error.value)
  # That workdir's own study: allowed; with its checkpoint, its config is
  # compared (the seed differs here).
  study.check_out_dir(workdir, str(base / "study"))
  config = tiny_config(data_dir, "seed=1")
  with pytest.raises(config_validation.ConfigError,
                     match=r"another run of .* \(its config differs in "
                           r".*\bseed\b"):
    study.check_out_dir(workdir, str(base / "study"),
                        types.SimpleNamespace(config=config))
  # A folder named checkpoints beside a config.json that is no run's (a
  # project's own, say) is an ordinary folder.
  project = base / "project"
  (project / "checkpoints").mkdir(parents=True)
  (project / "config.json").write_text('{"lr": 0.1}')
  study.check_out_dir(workdir, str(project / "checkpoints" / "study"))
  assert not (project / "checkpoints" / "study").exists()
  # A copied (or renamed) workdir's default --out, workdir/pruning: the same
  # run's study, whatever folder its results.json names (its config is
  # compared all the same).
  copied = base / "copied"
  (copied / "pruning").mkdir(parents=True)
  (copied / "pruning" / "results.json").write_text(json.dumps({
      "workdir": workdir, "seeds": [{"config": {"seed": 0}}]}))
  before = _tree(base)
  study.check_out_dir(str(copied), str(copied / "pruning"))
  assert _tree(base) == before


def test_an_output_folder_that_takes_no_writes_is_refused(read_only_dir):
  """A read-only workdir's default --out (workdir/pruning), or a read-only
  --out: one line, nothing written."""
  folder = os.path.realpath(read_only_dir)
  for out in (os.path.join(folder, "pruning"), folder):
    with pytest.raises(workdir_lock.WorkdirUnusableError) as error:
      study.check_out_dir(os.path.join(folder, "workdir"), out)
    message = str(error.value)
    assert message.startswith(f"cannot use --out {out}: ")
    assert message.endswith(f": {folder}") and "\n" not in message
  assert os.listdir(folder) == []


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_reported_once(tiny_run, tmp_path,
                                                      capfd, monkeypatch):
  """check_inputs reads the checkpoint (skipping the damaged newest one
  with a warning); run, given what it returned, checks again without
  reading it again, so the warning is printed once."""
  workdir = copy_workdir(tiny_run.workdir, tmp_path / "run")
  newest = os.path.join(ckpt_lib.checkpoint_dir(workdir),
                        str(tiny_run.config.num_train_steps))
  os.remove(os.path.join(newest, "state", "_METADATA"))
  options = study.StudyOptions(num_seeds=1)
  out = str(tmp_path / "out")
  capfd.readouterr()
  first = study.check_inputs(workdir, out, options)
  assert first.step < tiny_run.config.num_train_steps

  class Checked(Exception):
    pass

  def stop(*args, **kwargs):
    raise Checked

  monkeypatch.setattr(study_seeds, "seed_models", stop)  # after the checks
  with pytest.raises(Checked):
    study.run(workdir, out, options, log=lambda _: None, checkpoint=first)
  assert capfd.readouterr().err.count(f"checkpoint {newest} is damaged") == 1


def test_the_last_line_says_what_was_written():
  out = "/x/pruning"
  assert study_outputs.written(out, study.StudyOptions()) == (
      "Wrote /x/pruning/results.json, /x/pruning/report.md and the "
      "report's PNG plots.")
  assert study_outputs.written(
      out, study.StudyOptions(plots=False, plot_format="svg")) == (
          "Wrote /x/pruning/results.json and /x/pruning/report.md (no "
          "plots: --noplots).")


@pytest.mark.parametrize("changes, message", [
    ({"speed_fractions": (0.5, 1.5)}, "outside [0, 1]"),
    ({"step_fraction": -0.1}, "[0, 1]"),
    ({"oracle_max_heads": 0}, "--oracle_max_heads must be >= 1"),
    ({"num_bootstrap": 0}, "--num_bootstrap must be >= 1"),
    ({"speed_repeats": 0}, "--speed_repeats must be >= 1"),
    ({"speed_max_repeats": 5}, "--speed_max_repeats (5) must be >= "
                               "--speed_repeats (10)"),
    ({"speed_target_width": -0.1}, "--speed_target_width must be >= 0"),
    ({"batch_sizes": (1, 0)}, "--batch_sizes"),
    ({"speed_order": "random"}, "--speed_order 'random'"),
    ({"shapley": "maybe"}, "--shapley 'maybe' is not one of: auto, exact"),
    ({"shapley_pairs": 1}, "--shapley_pairs must be >= 2"),
    ({"plot_format": "gif"}, "--plot_format 'gif' is not one of: png, svg, pdf"),
    ({"ablation": "half"},
     "--ablation 'half' is not one of: zero, mean, mean_position, resample"),
    ({"gate_targets": (2, -1)}, "--gate_targets must be numbers of heads "
                                "removed >= 1, got [2, -1]"),
    ({"gate_method": "l1"}, "--gate_method 'l1' is not one of: top_k"),
    ({"duo_gates_steps": 0}, "--duo_gates_steps must be >= 1, got 0"),
    ({"ablation": "streaming:0,0"}, "SINKS + WINDOW must be at least 1"),
    ({"ablation": "streaming:4"}, "expected streaming:SINKS,WINDOW"),
    ({"ablation": "streaming:4,16", "gates": True},
     "--ablation streaming:4,16: gates, retraining and mean ablation"),
])
def test_bad_options_are_refused(changes, message):
  with pytest.raises(ValueError) as raised:
    study.StudyOptions(**changes).validate()
  assert message in str(raised.value)


def test_option_defaults():
  # Issue 14: at least 10 timing repeats, 5 seeds; issue 23: a 16-head
  # oracle (streamed) and both searches.
  options = study.StudyOptions()
  assert options.speed_repeats == pruning.speed.REPEATS >= 10
  assert (options.num_seeds, options.oracle_max_heads) == (5, 16)
  assert options.searches and options.beam_width >= 1


@pytest.mark.slow  # seconds of compiling or training: the full suite only
def test_bad_input_is_refused_before_any_work(tiny_workdir, tmp_path):
  out = str(tmp_path / "out")
  options = study.StudyOptions(num_seeds=1)
  with pytest.raises(ValueError, match=r"head \(0, 7\) does not exist"):
    study.check_inputs(tiny_workdir, out, dataclasses.replace(
        options, remove_heads=((0, 7),)))
  with pytest.raises(FileNotFoundError, match="steps saved: 10, 20"):
    study.check_inputs(tiny_workdir, out, options, step=15)
  for bad, message in ((dict(beam_width=0), "--beam_width must be >= 1"),
                       (dict(surrogate_top=0), "--surrogate_top must be >= 1"),
                       (dict(search_polish_rounds=-1),
                        "--search_polish_rounds must be >= 0"),
                       (dict(gates=True, gate_targets=(1, 4)),
                        r"--gate_targets: .* from 1 to 3 for this model's 4 "
                        r"heads, got \[1, 4\]"),
                       (dict(ablation="streaming:1,2"),
                        "needs a causal decoder; this model is an encoder")):
    with pytest.raises(ValueError, match=message):
      study.check_inputs(tiny_workdir, out, dataclasses.replace(options,
                                                                **bad))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    study.check_inputs(str(empty), out, options)
  assert os.listdir(empty) == [] and not os.path.exists(out)


def test_orders_are_re_estimated_from_per_example_values():
  # Two layers x two heads; example 0 says head 0 matters least, example 1
  # head 3 (gradients), and leave-one-out's losses likewise.
  from mha.model import TransformerConfig  # pylint: disable=import-outside-toplevel
  from mha.pruning.study import analysis  # pylint: disable=import-outside-toplevel
  config = TransformerConfig(vocab_size=8, num_layers=2, num_heads=2,
                             d_model=8, mlp_dim=8, max_len=4)
  grads = np.array([[[0.0, 1.0], [2.0, 3.0]], [[3.0, 2.0], [1.0, 0.0]]])
  plan = analysis.Plan()
  plan.add(head_masks.full_head_mask(config))
  plan.single = np.asarray([plan.add(m) for m in
                            head_masks.leave_one_out_masks(config)])
  # Loss sums [1 + 4 masks, 2 examples]: removing head h costs example 0
  # h, example 1 3 - h.
  loss = np.array([[0.0, 0.0], [0.0, 3.0], [1.0, 2.0], [2.0, 1.0],
                   [3.0, 0.0]])
  ones = np.ones_like(loss)
  sums = {"loss_sum": loss, "tokens": ones, "correct": ones, "exact": ones,
          "sequences": ones}
  weights = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
  orders = analysis.replicate_orders(config, plan, grads, sums, weights)
  for name in ("gradient", "leave_one_out"):
    assert orders[name][1].tolist() == [0, 1, 2, 3], name
    assert orders[name][2].tolist() == [3, 2, 1, 0], name
  assert orders["reverse_gradient"][1].tolist() == [3, 2, 1, 0]
  # Full sample (a tie everywhere): the index order, as the study's own.
  assert orders["gradient"][0].tolist() == [0, 1, 2, 3]
  # L2 per layer: within each layer as the raw gradient.
  assert orders["gradient_l2"][1][:2].tolist() == [0, 2]
