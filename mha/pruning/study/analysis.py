"""One seed of the study: importance, orders, the oracle, curves, tables.

Per seed, on the *validation* split: every importance measure and ordering
(:mod:`mha.pruning.orderings`) and, with at most ``oracle_max_heads`` heads,
every subset of heads (:mod:`mha.pruning.oracle`: the oracle, exact Shapley
values, and from the same table the best nested ordering,
:mod:`mha.pruning.best_ordering`, and the oracle chosen by validation
loss). Then the pruning curves of every order and the oracle, on
validation and test, plain and never emptying a layer; the level prunable
within ``tolerance`` chosen on validation and its test accuracy reported;
Michel et al.'s single-head ablation (paired t-tests, Benjamini-Hochberg)
and all-but-one tables. Intervals come from a paired bootstrap over examples
(and, across seeds, over seeds): :mod:`mha.pruning.study.summary`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np

from mha import data
from mha import head_masks
from mha import head_roles
from mha.aliases import Log, Params
from mha.model import Transformer, TransformerConfig
from mha.run.progress import timed
from mha.pruning import ablation as ablation_lib
from mha.pruning import best_ordering
from mha.pruning import core
from mha.pruning import duo_gates
from mha.pruning import gates as gates_lib
from mha.pruning import kwon
from mha.pruning import oracle
from mha.pruning import orderings
from mha.pruning import searches as searches_lib
from mha.pruning import shapley as shapley_lib
from mha.pruning import stats
from mha.pruning.study import kv_group_study
from mha.pruning.study import summary
from mha.pruning.study.options import StudyOptions

#: The searches for the best subset per number of heads removed
#: (:mod:`mha.pruning.searches`), each a curve and ``searches.<name>``.
SEARCH_LABELS = {"surrogate": "surrogate search (layer-additive)",
                 "beam": "beam search",
                 "kwon": "Kwon et al. (Fisher search, rearranged)",
                 "kwon_tuned": "Kwon et al., mask tuned (layer output)",
                 "kwon_tuned_attention_output":
                     "Kwon et al., mask tuned (attention output)",
                 "oracle_kwon_tuned":
                     "oracle's subset, mask tuned (Kwon et al.)",
                 "gates_k": "exact-K gates (one per k)"}
#: The tuned searches: real-valued masks (``searches.<name>`` entries keep
#: their ``mask``), each on the subsets of another curve (``summary.UNTUNED``):
#: Kwon et al.'s tuning (:func:`mha.pruning.kwon.tune_masks`) and the
#: attention-output fit (:func:`~mha.pruning.kwon.tune_masks_attention_output`)
#: of Kwon et al.'s subsets, and Kwon et al.'s tuning of the oracle's (a
#: ceiling for tuning: the best subset per k, tuned).
TUNED = ("kwon_tuned", "kwon_tuned_attention_output", "oracle_kwon_tuned")
#: The curves: every ordering, the oracle and the searches (not orderings:
#: their subsets for k and k + 1 heads removed need not be nested).
#: The curves read off the oracle's table besides the oracle: the best
#: nested chain (an ordering, :mod:`mha.pruning.best_ordering`) and the
#: oracle chosen by validation loss instead of token accuracy.
ORACLE_CURVE_LABELS = {
    "best_ordering": "best ordering (nested, from the oracle's table)",
    "oracle_by_loss": "oracle by loss (best subset by validation loss)"}
CURVE_LABELS = {**orderings.ORDERINGS, "oracle": "oracle (best subset)",
                **ORACLE_CURVE_LABELS, **SEARCH_LABELS}
#: The curves chosen again in each bootstrap replicate among their
#: candidates, and the validation metric that chooses (higher is better
#: but for the loss).
SELECTED = {"oracle": "token_accuracy", "oracle_by_loss": "loss"}


@dataclasses.dataclass
class Plan:
  """Distinct masks ``[M, L, H]`` and, per variant and curve, the ``[R, P]``
  mask ids of its points (R = 1 but for ``random``); the ids of the oracle
  at every ``k`` and of the single-head and all-but-one masks."""

  masks: list[np.ndarray] = dataclasses.field(default_factory=list)
  index: dict[bytes, int] = dataclasses.field(default_factory=dict)
  curves: dict[str, dict[str, np.ndarray]] = dataclasses.field(
      default_factory=dict)
  counts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  oracle: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  searches: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  #: ``best_ordering`` and ``oracle_by_loss``: their mask id at every ``k``.
  chains: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  #: Per variant, the oracle's ``[candidates, P]`` ids for its half-split
  #: statistics: the candidates ranked on the first validation half.
  half_split: dict[str, dict[str, np.ndarray]] = dataclasses.field(
      default_factory=dict)
  single: np.ndarray | None = None
  all_but_one: np.ndarray | None = None

  def add(self, mask: np.ndarray) -> int:
    """The id of ``mask``, added if new."""
    key = np.asarray(mask, np.float32).tobytes()
    if key not in self.index:
      self.index[key] = len(self.masks)
      self.masks.append(np.asarray(mask, np.float32))
    return self.index[key]

  def add_curve(self, variant: str, name: str, config: TransformerConfig,
                removals: Sequence[Sequence[int]]) -> None:
    """A curve whose point ``p`` removes the heads ``removals[p]``; several
    calls with one name stack (random orders)."""
    ids = [self.add(head_masks.mask_without(config, r)) for r in removals]
    self._add_ids(variant, name, ids)

  def add_mask_curve(self, variant: str, name: str,
                     masks: Sequence[np.ndarray]) -> None:
    """A curve whose point ``p`` is the (possibly real-valued) mask
    ``masks[p]``."""
    self._add_ids(variant, name, [self.add(m) for m in masks])

  def _add_ids(self, variant: str, name: str, ids: Sequence[int]) -> None:
    curves = self.curves.setdefault(variant, {})
    row = np.asarray(ids, np.int64)[None]
    curves[name] = row if name not in curves else np.concatenate(
        [curves[name], row])


def plan_masks(config: TransformerConfig, orders: Mapping[str, np.ndarray],
               random_orders: np.ndarray, oracle_removals: Mapping[str, Any],
               counts: np.ndarray,
               searches: Mapping[str, Sequence[Sequence[int]]] | None = None,
               tuned: Mapping[str, Sequence[np.ndarray]] | None = None,
               by_loss: Sequence[Sequence[np.ndarray]] | None = None,
               half_split: Mapping[str, Any] | None = None) -> Plan:
  """Every curve of both variants (``all``; ``no_layer_emptied``, which
  skips a layer's last head and stops at ``N - layers with heads``), the
  full mask (id 0) and the single-head and all-but-one masks.
  ``oracle_removals``: variant -> for each ``k`` the removals of the best
  subsets on validation, best first (the oracle's candidates).
  ``searches``: name -> for each ``k`` the removal a search found (curves
  of the ``all`` variant; their layers may be emptied); ``tuned``: name ->
  for each ``k`` a mask ``[L, H]`` whose kept heads' values need not be 1
  (Kwon et al.'s mask tuning), the same way. ``by_loss``: for each ``k``
  the removals of the best subsets by validation loss, best first (the
  oracle by loss's candidates; a curve of the ``all`` variant).
  ``orders["best_ordering"]``, when there, is also kept at every ``k``
  (``plan.chains``). ``half_split``: as ``oracle_removals``, the
  candidates ranked on the first half of validation alone; the oracle's
  half-split statistics choose among them (``plan.half_split``)."""
  plan = Plan()
  plan.add(head_masks.full_head_mask(config))
  limit = core.removable_keeping_layers(config)
  plan.counts = {"all": counts, "no_layer_emptied": counts[counts <= limit]}
  named = [(k, v) for k, v in orders.items()] + [
      ("random", o) for o in random_orders]
  for variant, points in plan.counts.items():
    for name, order in named:
      if variant == "no_layer_emptied":
        order = core.keep_one_per_layer(config, order)
      plan.add_curve(variant, name, config, [order[:k] for k in points])
    ranked = oracle_removals.get(variant)
    if ranked is not None:  # A row per candidate, the best first.
      for c in range(max(len(r) for r in ranked)):
        plan.add_curve(variant, "oracle", config,
                       [ranked[k][min(c, len(ranked[k]) - 1)]
                        for k in points])
      plan.oracle[variant] = np.asarray(
          [plan.add(head_masks.mask_without(config, r[0])) for r in ranked])
    halves = (half_split or {}).get(variant)
    if halves is not None:
      plan.half_split.setdefault(variant, {})["oracle"] = np.asarray(
          [[plan.add(head_masks.mask_without(
              config, halves[k][min(c, len(halves[k]) - 1)]))
            for k in points]
           for c in range(max(len(r) for r in halves))], np.int64)
  if by_loss is not None:
    for c in range(max(len(r) for r in by_loss)):
      plan.add_curve("all", "oracle_by_loss", config,
                     [by_loss[k][min(c, len(by_loss[k]) - 1)]
                      for k in counts])
    plan.chains["oracle_by_loss"] = np.asarray(
        [plan.add(head_masks.mask_without(config, r[0])) for r in by_loss])
  if "best_ordering" in orders:
    order = orders["best_ordering"]
    plan.chains["best_ordering"] = np.asarray(
        [plan.add(head_masks.mask_without(config, order[:k]))
         for k in range(len(order) + 1)])
  for name, removals in (searches or {}).items():
    plan.add_curve("all", name, config, [removals[k] for k in counts])
    plan.searches[name] = np.asarray(
        [plan.add(head_masks.mask_without(config, r)) for r in removals])
  for name, masks in (tuned or {}).items():
    plan.add_mask_curve("all", name, [masks[k] for k in counts])
    plan.searches[name] = np.asarray([plan.add(m) for m in masks])
  plan.single = np.asarray([plan.add(m) for m in
                            head_masks.leave_one_out_masks(config)])
  plan.all_but_one = np.asarray([plan.add(m) for m in
                                 head_masks.all_but_one_masks(config)])
  return plan


def _per_example(model: Transformer, params: Params, split: data.Split,
                 masks: np.ndarray, table: Mapping[str, np.ndarray] | None,
                 options: StudyOptions,
                 ablation: ablation_lib.Ablation | None = None
                 ) -> dict[str, np.ndarray]:
  """Per-example sums ``[M, n]`` of ``masks``: looked up in ``table`` (every
  subset per example: the oracle's, when it kept one) when given; else
  evaluated, the lower layers shared between masks that agree there
  (:func:`oracle.evaluate_mask_list`)."""
  evaluate = lambda chosen: oracle.evaluate_mask_list(
      model, params, split, chosen, batch_size=options.batch_size,
      ablation=ablation)
  if table is None:
    return evaluate(masks)
  # The table holds the 0/1 masks only: a real-valued one (Kwon et al.'s
  # tuned masks) is evaluated as it is, not rounded to its subset.
  masks = np.asarray(masks, np.float32)
  binary = np.all((masks == 0) | (masks == 1), axis=(-2, -1))
  ids = oracle.subset_index(model.config, masks)
  out = {k: np.asarray(v)[ids] for k, v in table.items()}
  if not binary.all():
    real = evaluate(masks[~binary])
    for k in out:
      out[k] = out[k].astype(np.result_type(out[k], real[k]))
      out[k][~binary] = real[k]
  return out


def _oracle_entries(config: TransformerConfig, plan: Plan, variant: str,
                    val: Mapping[str, np.ndarray],
                    test: Mapping[str, np.ndarray],
                    ids: np.ndarray | None = None) -> list[dict[str, Any]]:
  """The ``oracle`` list of ``results.json`` (or a search's, ``ids``): for
  every ``k`` the removed heads and their validation and test metrics."""
  entries = []
  ids = plan.oracle.get(variant, []) if ids is None else ids
  for k, mask_id in enumerate(ids):
    removed = np.flatnonzero(plan.masks[mask_id].reshape(-1) == 0)
    removed = removed[head_masks.existing_heads(config).reshape(-1)[removed]]
    entries.append({
        "k": k, "removed": [list(p) for p in
                            head_masks.flat_to_pairs(config, removed)],
        "validation": {m: float(v[mask_id]) for m, v in val.items()},
        "test": {m: float(v[mask_id]) for m, v in test.items()},
    })
  return entries


def _ablations(config: TransformerConfig, plan: Plan, val: Mapping[str, np.ndarray],
               test: Mapping[str, np.ndarray],
               test_sums: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """Michel et al.'s tables on test: each head removed alone (change, paired
  t-test over examples, Benjamini-Hochberg q), and each layer reduced to
  one head (the best head chosen on validation)."""
  single: dict[str, Any] = {}
  for metric, key in (("token_accuracy", "correct"), ("exact_match",
                                                      "exact")):
    single[f"{metric}_change"] = core.heads_to_array(
        config, test[metric][plan.single] - test[metric][0])
    p = stats.paired_ttest_pvalues(test_sums[key][0],
                                   test_sums[key][plan.single])
    single[f"{metric}_p"] = core.heads_to_array(config, p)
    single[f"{metric}_q"] = core.heads_to_array(
        config, stats.benjamini_hochberg(p))
  single["loss_change"] = core.heads_to_array(
      config, test["loss"][plan.single] - test["loss"][0])
  abo_val = {m: core.heads_to_array(config, v[plan.all_but_one])
             for m, v in val.items()}
  abo_test = {m: core.heads_to_array(config, v[plan.all_but_one])
              for m, v in test.items()}
  best = []
  for layer, count in enumerate(config.heads_per_layer):
    if count == 0:
      best.append(None)
      continue
    head = int(np.nanargmax(abo_val["token_accuracy"][layer]))
    best.append({
        "layer": layer, "head": head,
        "validation_token_accuracy": float(
            abo_val["token_accuracy"][layer, head]),
        **{f"test_{k}": float(abo_test[k][layer, head])
           for k in ("token_accuracy", "exact_match", "loss")}})
  return {"single_head_ablation": single,
          "all_but_one": {"test": abo_test, "validation": abo_val,
                          "best_head_per_layer": best}}


def _spearman(importance: Mapping[str, np.ndarray]) -> dict[str, Any]:
  pairs = {
      "gradient_vs_leave_one_out": ("gradient", "leave_one_out"),
      "gradient_l2_vs_leave_one_out": ("gradient_l2", "leave_one_out"),
      "gradient_halves": ("gradient_validation_half_a",
                          "gradient_validation_half_b"),
      "confidence_vs_leave_one_out": ("confidence", "leave_one_out"),
      "shapley_vs_leave_one_out": ("shapley_token_accuracy",
                                   "leave_one_out_token_accuracy_drop"),
      "shapley_vs_gradient": ("shapley_token_accuracy", "gradient"),
  }
  return {name: stats.spearman(importance[a], importance[b])
          for name, (a, b) in pairs.items()}


@dataclasses.dataclass(frozen=True)
class Resamples:
  """The bootstrap resamples shared by every seed: ``[R, n]`` example counts
  of validation and test, and ``[R, S]`` seed-level coefficients
  (:func:`mha.pruning.stats.seed_t_weights`)."""

  validation: np.ndarray
  test: np.ndarray
  seeds: np.ndarray

  @classmethod
  def draw(cls, splits: Mapping[str, data.Split], num_seeds: int,
           num_bootstrap: int, rng: np.random.Generator) -> "Resamples":
    """Independent resamples of both splits and of the seeds."""
    return cls(
        stats.example_weights(len(splits["validation"]), num_bootstrap, rng),
        stats.example_weights(len(splits["test"]), num_bootstrap, rng),
        stats.seed_t_weights(num_seeds, num_bootstrap, rng))


def _measure_seed(model: Transformer, params: Params,
                  splits: Mapping[str, data.Split], options: StudyOptions,
                  rng: np.random.Generator, log: Log,
                  timings: dict[str, float],
                  run_config: Any = None) -> dict[str, Any]:
  """Importance, orders, the oracle and the per-example sums of every mask
  the seed's curves and tables need, on validation and test
  (``run_config``: the run's config, for the exact-K gates' batches)."""
  config = model.config
  val, test = splits["validation"], splits["test"]
  ablations, baselines = _ablations_of(model, params, splits, options, log,
                                       timings)
  if oracle.oracle_applies(config, options.oracle_max_heads):
    log("  oracle: "
        + oracle.describe_cost(config, positions=oracle.tokens(val),
                               examples=len(val)))
  first_half: dict[str, np.ndarray] = {}
  val_table: dict[str, np.ndarray] = {}  # every subset per example, if small
  subsets, shapley, removals = oracle.evaluate_oracle(
      model, params, val, batch_size=options.batch_size,
      max_heads=options.oracle_max_heads, log=log, timings=timings,
      ablation=ablations["validation"], first_half=first_half,
      table=val_table)
  # The half-split level's oracle: candidates ranked on the first half.
  half_removals = (oracle.removals_by_variant(
      oracle.subset_values(first_half), config) if first_half else None)
  importance = orderings.measure_importance(
      model, params, val, batch_size=options.batch_size, log=log,
      timings=timings, subsets=subsets, ablation=ablations["validation"],
      baselines=baselines)
  validation = importance.pop("validation")
  fisher_blocks = importance.pop("fisher_blocks")
  gradient_per_example = importance.pop("gradient_per_example")
  importance["shapley_token_accuracy"] = shapley
  if ablations["validation"].streaming:  # DuoAttention's learned gates
    duo, timings["duo_gates_s"] = timed(
        log, f"DuoAttention gates ({options.duo_gates_steps} steps on "
        f"train, L1 {duo_gates.STRENGTH:g})",
        lambda: duo_gates.train(model, params, splits["train"],
                                ablations["validation"],
                                steps=options.duo_gates_steps,
                                seed=options.seed, log=log))
    importance["duo_gates"] = duo["alpha"]
  method = "exact" if subsets is not None and options.shapley != "sampled" else (
      "sampled" if options.shapley != "exact" else None)
  if method == "sampled":
    (importance["shapley_token_accuracy"],
     importance["shapley_token_accuracy_ci"]), timings["shapley_s"] = timed(
         log, f"Shapley values sampled: {options.shapley_pairs} antithetic "
         "pairs of permutations",
         lambda: sampled_shapley(model, params, val, options,
                                 ablations["validation"]))
  interactions = (None if subsets is None else
                  _interactions(config, subsets))
  orders = orderings.orders_from_importance(importance)
  if options.reestimate:
    orders["gradient_iterative"], timings["gradient_iterative_s"] = timed(
        log, "gradient importance re-estimated after each removal",
        lambda: core.iterative_gradient_order(
            model, params, val, batch_size=options.batch_size))
  random_orders = core.random_orders(config, options.num_random_orders,
                                        rng)
  n = oracle.num_heads(config)
  by_loss = None
  if subsets is not None:
    orders["best_ordering"], timings["best_ordering_s"] = timed(
        log, "best ordering: the nested chain of highest validation AUC "
        "(dynamic program over the oracle's table)",
        lambda: best_ordering.best_order(
            oracle.subset_values(subsets), config, best_ordering.auc_weights(
                core.pruning_counts(n, options.step_fraction), n)))
    by_loss = oracle.ranked_removals(-np.asarray(subsets["loss"]), config,
                                     top=oracle.ORACLE_CANDIDATES)
  evaluations: dict[str, int] = {}
  found = run_searches(model, params, val, options, log, timings,
                       evaluations, ablations["validation"])
  tuned, rejected = {}, {}
  if options.kwon:
    # The tuning fits the kept heads' mask values with removed heads at
    # zero: its masks mean nothing under another ablation.
    tune = options.ablation == "zero"
    found["kwon"], tunings = run_kwon(model, params, val, fisher_blocks, log,
                                      timings, tune=tune,
                                      oracle_removals=removals.get("all"))
    evaluations["kwon"] = 0
    for name, result in tunings.items():
      tuned[name], rejected[name] = result.masks, result.rejected_layers
      # The ceiling's subsets are the oracle's: every subset evaluated.
      evaluations[name] = 2 ** n if name == "oracle_kwon_tuned" else 0
    if not tune:
      log(f"  Kwon et al.'s mask tuning skipped: it assumes zero ablation, "
          f"not --ablation={options.ablation}")
  gates_k = None
  if options.gates and oracle.num_heads(config) > 1:
    gates_k, timings["gates_k_s"] = timed(
        log, f"{SEARCH_LABELS['gates_k']}: {options.gate_method}, "
        f"{options.gate_steps} steps",
        lambda: run_exact_k(model, params, splits["train"], options,
                            run_config, log))
    found["gates_k"], evaluations["gates_k"] = gates_k["entries"], 0
  plan = plan_masks(config, orders, random_orders, removals,
                    core.pruning_counts(n, options.step_fraction),
                    {name: [e["removed"] for e in entries]
                     for name, entries in found.items()}, tuned, by_loss,
                    half_removals)
  masks = np.stack(plan.masks)
  val_sums, timings["validation_masks_s"] = timed(
      log, f"{len(masks)} distinct masks on validation"
      + (" (looked up in the oracle's table)" if val_table else ""),
      lambda: _per_example(model, params, val, masks, val_table or None,
                           options, ablations["validation"]))
  test_sums, timings["test_masks_s"] = timed(
      log, f"{len(masks)} distinct masks on test (curves, oracle, tables)",
      lambda: _per_example(model, params, test, masks, None, options,
                           ablations["test"]))
  patching = None
  if baselines:
    patching, timings["attribution_check_s"] = timed(
        log, "attribution patching against actual patching (leave-one-out "
        "under each baseline)",
        lambda: _attribution_check(model, params, val, importance,
                                   baselines, options))
  return {"importance": importance, "validation": validation,
          "orders": {**orders, "random": random_orders}, "plan": plan,
          "val_sums": val_sums, "test_sums": test_sums, "num_heads": n,
          "oracle_ran": subsets is not None, "shapley_method": method,
          "search_evaluations": evaluations, "attribution": patching,
          "interactions": interactions, "ablations": ablations,
          "gradient_per_example": gradient_per_example, "gates_k": gates_k,
          "rejected_layers": rejected}


#: The orderings re-estimated in every bootstrap resample, from per-example
#: values (``--bootstrap_importance``).
BOOTSTRAP_ORDERINGS = ("gradient", "gradient_l2", "reverse_gradient",
                       "leave_one_out")


def replicate_orders(config: TransformerConfig, plan: Plan,
                     gradient_per_example: np.ndarray,
                     val_sums: Mapping[str, np.ndarray],
                     weights: np.ndarray) -> dict[str, np.ndarray]:
  """The orders of :data:`BOOTSTRAP_ORDERINGS` under each resample of
  validation: ``[R, N]`` flat head indices, least important first.

  Gradient importance is the ``weights``-weighted mean of the per-example
  ``|dL/d xi|`` (``[n, L, H]``); leave-one-out's loss increase is the
  resampled loss of each single-head mask (``plan.single``, per-example sums
  ``val_sums``) minus the full model's (mask 0)."""
  w = np.asarray(weights, np.float64)
  flat = gradient_per_example.reshape(len(gradient_per_example), -1)
  grad = (w @ np.nan_to_num(flat)) / np.maximum(w.sum(1, keepdims=True), 1)
  grad = np.where(np.isnan(flat[:1]), np.nan, grad).reshape(
      (len(w),) + gradient_per_example.shape[1:])
  loss = stats.resampled_metrics(
      {k: np.asarray(v)[np.concatenate([[0], plan.single])]
       for k, v in val_sums.items()}, w)["loss"]  # [R, 1 + N]
  loo = np.stack([core.heads_to_array(config, row[1:] - row[0])
                  for row in loss])
  orders = {
      "gradient": [core.order_from_importance(g) for g in grad],
      "gradient_l2": [core.order_from_importance(core.normalize_per_layer(g))
                      for g in grad],
      "leave_one_out": [core.order_from_importance(v) for v in loo],
  }
  orders["reverse_gradient"] = [o[::-1] for o in orders["gradient"]]
  return {name: np.stack(orders[name]) for name in BOOTSTRAP_ORDERINGS}


def _bootstrap_importance(model: Transformer, params: Params,
                          splits: Mapping[str, data.Split],
                          options: StudyOptions, resamples: "Resamples",
                          m: dict[str, Any], log: Log,
                          timings: dict[str, float]
                          ) -> tuple[dict[str, dict[str, np.ndarray]],
                                     dict[str, Any]]:
  """The curves of :data:`BOOTSTRAP_ORDERINGS` with a row of masks per
  resample (``[1 + R, 1, P]`` ids; row 0 the study's own order), the masks
  they add evaluated on validation and test and appended to ``m``'s sums
  (and ``m["plan"]``). An ordering whose masks would take the seed past
  ``--bootstrap_importance_max_masks`` new ones keeps its fixed curve.

  Returns:
    ``(curves, info)``: the statistics' curves (every variant), and for
    ``results.json`` the orderings re-estimated, those left conditional, the
    masks added and each ordering's number of distinct orders."""
  config, plan = model.config, m["plan"]
  curves = {variant: dict(by_name) for variant, by_name in plan.curves.items()}
  info: dict[str, Any] = {"reestimated": [], "conditional": [],
                          "masks_added": 0, "distinct_orders": {}}
  if not options.bootstrap_importance:
    return curves, info
  orders = replicate_orders(config, plan, m["gradient_per_example"],
                            m["val_sums"], resamples.validation)
  before = len(plan.masks)
  for name in BOOTSTRAP_ORDERINGS:
    if name not in plan.curves["all"]:
      continue
    rows = np.concatenate([np.asarray(m["orders"][name])[None], orders[name]])
    distinct, inverse = np.unique(rows, axis=0, return_inverse=True)
    info["distinct_orders"][name] = int(len(distinct))
    trial = Plan(masks=list(plan.masks), index=dict(plan.index))
    ids = {}
    for variant, points in plan.counts.items():
      per_order = []
      for order in distinct:
        if variant == "no_layer_emptied":
          order = core.keep_one_per_layer(config, order)
        per_order.append([trial.add(head_masks.mask_without(config,
                                                             order[:k]))
                          for k in points])
      ids[variant] = np.asarray(per_order, np.int64)[
          np.asarray(inverse).reshape(-1)][:, None]
    if len(trial.masks) - before > options.bootstrap_importance_max_masks:
      info["conditional"].append(name)
      continue
    plan.masks, plan.index = trial.masks, trial.index
    for variant in plan.counts:
      curves[variant][name] = ids[variant]
    info["reestimated"].append(name)
  new = np.stack(plan.masks[before:]) if len(plan.masks) > before else None
  info["masks_added"] = len(plan.masks) - before
  if new is not None:
    def evaluate():
      for key, split in (("val_sums", "validation"), ("test_sums", "test")):
        sums = _per_example(model, params, splits[split], new, None, options,
                            m["ablations"][split])
        m[key] = {k: np.concatenate([np.asarray(v), np.asarray(sums[k])])
                  for k, v in m[key].items()}
    _, timings["bootstrap_importance_s"] = timed(
        log, f"orderings re-estimated in every resample ("
        f"{', '.join(info['reestimated'])}): {len(new)} more masks on "
        "validation and test", evaluate)
  if info["conditional"]:
    log(f"  kept conditional (over {options.bootstrap_importance_max_masks} "
        f"masks): {', '.join(info['conditional'])}")
  return curves, info


def _ablations_of(model: Transformer, params: Params,
                  splits: Mapping[str, data.Split], options: StudyOptions,
                  log: Log, timings: dict[str, float]
                  ) -> tuple[dict[str, ablation_lib.Ablation],
                             dict[str, ablation_lib.Ablation]]:
  """``--ablation`` built for validation and test (means measured on
  validation; resample's donors drawn within each split), and attribution
  patching's baselines on validation."""
  val = splits["validation"]

  def build():
    means = ablation_lib.position_means(model, params, val,
                                        batch_size=options.batch_size)
    built = {name: ablation_lib.build(
        model, params, options.ablation, val, split, means=means,
        rng=np.random.default_rng([options.seed, 4, i]))
             for i, (name, split) in enumerate(
                 (("validation", val), ("test", splits["test"])))}
    baselines = {name: ablation_lib.build(
        model, params, mode, val, val, means=means,
        rng=np.random.default_rng([options.seed, 3]))
                 for name, mode in orderings.ATTRIBUTION_BASELINES.items()
                 if options.attribution}
    return built, baselines
  (built, baselines), timings["ablation_s"] = timed(
      log, f"ablation {options.ablation} (removed heads' replacements)"
      + (" and attribution patching's baselines" if options.attribution
         else ""), build)
  return built, baselines


def _attribution_check(model: Transformer, params: Params,
                       validation: data.Split, importance: Mapping[str, Any],
                       baselines: Mapping[str, ablation_lib.Ablation],
                       options: StudyOptions) -> dict[str, Any]:
  """Attribution patching against actual patching on validation: per
  baseline, the estimated and the actual loss increase of removing each
  head alone (``[L][H]``) and their Spearman correlation and mean
  absolute error."""
  config = model.config
  out = {}
  for name, abl in baselines.items():
    estimate = np.asarray(importance[f"attribution_{name}"])
    actual = core.leave_one_out(model, params, validation,
                                batch_size=options.batch_size,
                                ablation=abl)["loss_increase"]
    exists = head_masks.existing_heads(config)
    out[name] = {
        "mode": abl.mode, "estimate": estimate, "actual": actual,
        "spearman": stats.spearman(estimate[exists], actual[exists]),
        "mean_abs_error": float(np.mean(np.abs(estimate - actual)[exists])),
    }
  return out


def run_searches(model: Transformer, params: Params, validation: data.Split,
                 options: StudyOptions, log: Log,
                 timings: dict[str, float],
                 evaluations: dict[str, int],
                 ablation: ablation_lib.Ablation | None = None
                 ) -> dict[str, list[dict[str, Any]]]:
  """Both searches of :mod:`mha.pruning.searches` on ``validation`` (the
  oracle's value: :func:`mha.pruning.oracle.subset_values`, every subset
  evaluated through the model), unless ``options.searches`` is off:
  name -> for each ``k`` the search's entry (``removed``, flat indices).
  ``timings["<name>_s"]`` receives each search's seconds and
  ``evaluations[name]`` its number of subsets evaluated."""
  if not options.searches:
    return {}
  config = model.config

  def values(masks: np.ndarray) -> np.ndarray:
    # Padded to whole chunks of 8: one compiled program for every call.
    padded = np.concatenate([masks, np.repeat(masks[:1], -len(masks) % 8,
                                              axis=0)])
    return oracle.subset_values(core.evaluate_masks(
        model, params, validation, padded, batch_size=options.batch_size,
        chunk_size=8, ablation=ablation))[:len(masks)]

  log(search_estimate(config, options, _seconds_per_subset(config, values)))
  out = {}
  for name, search in (
      ("surrogate", lambda fn: searches_lib.layer_surrogate(
          fn, config, top=options.surrogate_top,
          polish_rounds=options.search_polish_rounds, log=log)),
      ("beam", lambda fn: searches_lib.beam_search(
          fn, config, width=options.beam_width, log=log))):
    evaluated = [0]

    def value_fn(masks: np.ndarray, evaluated=evaluated) -> np.ndarray:
      evaluated[0] += len(masks)
      return values(masks)
    out[name], timings[f"{name}_s"] = timed(
        log, f"{SEARCH_LABELS[name]}", lambda: search(value_fn))
    evaluations[name] = evaluated[0]
  return out


def _seconds_per_subset(config: TransformerConfig,
                        values: searches_lib.ValueFn) -> float:
  """The measured seconds of one subset evaluated by the searches'
  ``values``: a chunk of 8 full masks, timed on its second call (the first
  compiles the program the searches use)."""
  masks = np.repeat(head_masks.full_head_mask(config)[None], 8, axis=0)
  values(masks)
  start = time.perf_counter()
  values(masks)
  return (time.perf_counter() - start) / len(masks)


def search_estimate(config: TransformerConfig, options: StudyOptions,
                    seconds_per_subset: float) -> str:
  """One line: the searches' estimated time, their subset evaluations
  (:func:`mha.pruning.searches.surrogate_evaluations`,
  :func:`~mha.pruning.searches.beam_evaluations`) times the measured
  seconds of one."""
  low, high = searches_lib.surrogate_evaluations(
      config, top=options.surrogate_top,
      polish_rounds=options.search_polish_rounds)
  beam = searches_lib.beam_evaluations(config, width=options.beam_width)
  fewest, most = low + beam, high + beam
  return (f"  Estimate: the searches evaluate {fewest:,} to {most:,} subsets "
          f"(surrogate {low:,} to {high:,}, beam at most {beam:,}) at "
          f"{seconds_per_subset * 1e3:.2f} ms each (measured): about "
          f"{oracle.describe_seconds(fewest * seconds_per_subset)} to "
          f"{oracle.describe_seconds(most * seconds_per_subset)}")


def run_exact_k(model: Transformer, params: Params, train: data.Split,
                options: StudyOptions, run_config: Any, log: Log
                ) -> dict[str, Any]:
  """Exact-K gates (:func:`mha.pruning.gates.train_exact_k`) for
  ``options.gate_targets`` (empty: every ``k`` from 1 to ``N - 1``) on the
  train split, with the run's batch size and seed. ``entries``: for every
  ``k`` from 0 to ``N`` the removal of exactly ``k`` heads (lowest
  ``log_alpha``) by the gates of the nearest target (ties: the smaller),
  ``target_k``; besides, the training's ``targets``, ``method``,
  ``log_alpha`` ``[T][L][H]``, ``heads_kept`` in the last step, ``steps``
  and ``train_seconds``."""
  if run_config is None:
    raise ValueError("--gates: the exact-K gates need the run's config "
                     "(their batch size and seed): pass run_config")
  config = model.config
  n = oracle.num_heads(config)
  targets = sorted(set(options.gate_targets)) or list(range(1, n))
  trained = gates_lib.train_exact_k(
      model, params, train, targets, steps=options.gate_steps,
      batch_size=int(run_config.batch_size), method=options.gate_method,
      learning_rate=options.gate_learning_rate,
      temperature=options.gate_temperature, seed=int(run_config.seed),
      log=log)
  entries = []
  for k in range(n + 1):
    t = min(range(len(targets)), key=lambda i: (abs(targets[i] - k),
                                                targets[i]))
    entries.append({"k": k, "target_k": targets[t],
                    "removed": gates_lib.removal_of_size(
                        trained["log_alpha"][t], config, k)})
  return {"entries": entries, "targets": targets, "method": trained["method"],
          "log_alpha": trained["log_alpha"],
          "heads_kept": trained["expected_heads"], "steps": trained["steps"],
          "train_seconds": trained["seconds"]}


def run_kwon(model: Transformer, params: Params, validation: data.Split,
             blocks: np.ndarray, log: Log, timings: dict[str, float], *,
             tune: bool = True,
             oracle_removals: Sequence[Sequence[Sequence[int]]] | None = None
             ) -> tuple[list[dict[str, Any]], dict[str, kwon.Tuned]]:
  """Kwon et al.'s retraining-free pruning (:mod:`mha.pruning.kwon`) for
  every number of heads removed, on ``validation``: the Fisher search's
  removal, rearranged within layers (entries ``{k, removed}``), and with
  ``tune`` the tuned masks of :data:`TUNED` (``[L, H]`` per ``k``): its
  masks tuned as Kwon et al. do (``kwon_tuned``) and to the attention
  output alone (``kwon_tuned_attention_output``); given
  ``oracle_removals`` (per ``k`` the oracle's candidates, best first), the
  oracle's best subsets tuned as Kwon et al. do (``oracle_kwon_tuned``).
  ``blocks``: the Fisher information (:func:`kwon.fisher_blocks`).
  ``timings`` receives ``kwon_s`` (the search; the Fisher information is
  ``fisher_s``) and ``<name>_s`` of each tuning (besides)."""
  config = model.config
  n = oracle.num_heads(config)
  removals, timings["kwon_s"] = timed(
      log, SEARCH_LABELS["kwon"],
      lambda: [kwon.search(blocks, config, k) for k in range(n + 1)])
  entries = [{"k": k, "removed": r} for k, r in enumerate(removals)]
  if not tune:
    return entries, {}
  subsets = {"kwon_tuned": removals, "kwon_tuned_attention_output": removals}
  if oracle_removals is not None:
    subsets["oracle_kwon_tuned"] = [ranked[0] for ranked in oracle_removals]
  tuners = {"kwon_tuned": kwon.tune_masks,
            "kwon_tuned_attention_output": kwon.tune_masks_attention_output,
            "oracle_kwon_tuned": kwon.tune_masks}
  tuned = {}
  for name, chosen in subsets.items():
    tuned[name], timings[f"{name}_s"] = timed(
        log, f"{SEARCH_LABELS[name]}: least squares per layer, "
        f"{n + 1} subsets",
        lambda tune_fn=tuners[name], chosen=chosen: tune_fn(
            model, params, validation,
            [head_masks.mask_without(config, r) for r in chosen]))
    stopped = [layer for layer in tuned[name].rejected_layers
               if layer is not None]
    if stopped:
      log(f"  {len(stopped)} of {n + 1} masks stopped at a value outside "
          f"[-{kwon.LIMIT:g}, {kwon.LIMIT:g}] (layers "
          f"{', '.join(map(str, sorted(set(stopped))))})")
  return entries, tuned


def sampled_shapley(model: Transformer, params: Params, split: data.Split,
                    options: StudyOptions,
                    ablation: ablation_lib.Ablation | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Shapley values of validation token accuracy by antithetic permutation
  sampling (:func:`mha.pruning.shapley.sampled_shapley`): ``[L, H]`` values
  and ``[L, H, 2]`` 95% intervals (sampling and examples), NaN where no
  head."""
  config = model.config
  exists = head_masks.existing_heads(config)
  flat = np.flatnonzero(exists)
  tokens = float(np.sum(split.inputs != 0))

  def value_fn(kept: np.ndarray) -> np.ndarray:
    masks = np.zeros((len(kept), exists.size), np.float32)
    masks[:, flat] = kept
    sums = core.evaluate_masks(
        model, params, split, masks.reshape((-1,) + exists.shape),
        batch_size=options.batch_size, per_example=True, ablation=ablation)
    # Each example's share of the split's token accuracy: their mean is it.
    return np.asarray(sums["correct"], np.float64) * len(split) / tokens

  phi, ci = shapley_lib.sampled_shapley(
      value_fn, len(flat), num_pairs=options.shapley_pairs,
      rng=np.random.default_rng([options.seed, 2]))
  grid = core.heads_to_array(config, phi)
  intervals = np.stack([core.heads_to_array(config, ci[:, 0]),
                        core.heads_to_array(config, ci[:, 1])], axis=-1)
  return grid, intervals


def _interactions(config: TransformerConfig,
                  subsets: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """Pairwise Shapley interaction indices of validation token accuracy,
  from every subset: every pair, largest magnitude first, and whether the
  redundant (most negative) pairs lie within a layer."""
  pairs = shapley_lib.interaction_pairs(subsets["token_accuracy"], config)
  return {"pairs": pairs, "summary": shapley_lib.layer_summary(pairs)}


#: The units of ``cost`` in ``results.json`` (:func:`method_costs`).
COST_UNITS = (
    "per seed, for the method alone: subset_evaluations, the subsets of "
    "heads (masks) whose validation metrics it evaluates; forward_passes "
    "and backward_passes, passes of the model over the validation split "
    "(one per subset evaluated; a gradient over every example is one "
    "forward and one backward pass; the exact-K gates count training "
    "batches instead, `unit`); seconds, measured on this machine (what it "
    "shares with another method, e.g. the oracle's table, counted in "
    "each: leave-one-out's seconds are a lookup where the oracle ran)")


def method_costs(names: Sequence[str], num_heads: int,
                 timings: Mapping[str, float],
                 evaluations: Mapping[str, int], options: StudyOptions,
                 shapley_method: str | None = None,
                 gates_k: Mapping[str, Any] | None = None
                 ) -> dict[str, dict[str, Any]]:
  """``cost`` of ``results.json``: per method of ``names`` (orderings,
  searches, the oracle and the curves read off its table) its subset
  evaluations, forward and backward passes over validation and seconds
  (:data:`COST_UNITS`), from the seed's ``timings`` and the searches'
  counted ``evaluations``."""
  n, t = num_heads, timings
  seconds = lambda *keys: float(sum(t.get(k, 0.0) for k in keys))
  entry = lambda subsets, forward, backward, secs: {
      "subset_evaluations": int(subsets), "forward_passes": int(forward),
      "backward_passes": int(backward), "seconds": secs}
  table = entry(2 ** n, 2 ** n, 0, seconds("oracle_s"))
  attribution = [k for k in names if k.startswith("attribution_")]
  out = {}
  for name in names:
    if name in ("oracle", "oracle_by_loss"):
      out[name] = table
    elif name == "best_ordering":
      out[name] = dict(table, seconds=seconds("oracle_s", "best_ordering_s"))
    elif name == "shapley":
      pairs = options.shapley_pairs
      out[name] = (table if shapley_method == "exact" else entry(
          2 * pairs * (n + 1), 2 * pairs * (n + 1), 0, seconds("shapley_s")))
    elif name in ("gradient", "gradient_l2", "reverse_gradient"):
      out[name] = entry(0, 1, 1, seconds("gradient_s"))
    elif name == "gradient_iterative":
      out[name] = entry(0, n, n, seconds("gradient_iterative_s"))
    elif name == "fisher":
      out[name] = entry(0, 1, 1, seconds("fisher_s"))
    elif name in attribution:  # A clean and a patched pass, one backward.
      out[name] = entry(0, 2, 1, seconds("attribution_s") / len(attribution))
    elif name == "leave_one_out":
      out[name] = entry(n + 1, n + 1, 0, seconds("leave_one_out_s"))
    elif name in ("confidence", "entropy"):
      out[name] = entry(0, 1, 0, seconds("confidence_s"))
    elif name == "random":
      out[name] = entry(0, 0, 0, 0.0)
    elif name in ("surrogate", "beam"):
      count = evaluations.get(name, 0)
      out[name] = entry(count, count, 0, seconds(f"{name}_s"))
    elif name == "kwon":  # The Fisher information, then no evaluation.
      out[name] = entry(0, 1, 1, seconds("fisher_s", "kwon_s"))
    elif name in ("kwon_tuned", "kwon_tuned_attention_output"):
      # Kwon et al.'s search, then the unpruned and each tuned mask.
      out[name] = entry(0, n + 3, 1, seconds("fisher_s", "kwon_s",
                                             f"{name}_s"))
    elif name == "oracle_kwon_tuned":  # The oracle's table, then the tuning.
      out[name] = dict(table, forward_passes=table["forward_passes"] + n + 2,
                       seconds=seconds("oracle_s", "oracle_kwon_tuned_s"))
    elif name == "gates_k" and gates_k is not None:
      steps = int(gates_k["steps"]) * len(gates_k["targets"])
      out[name] = dict(entry(0, steps, steps, seconds("gates_k_s")),
                       unit="training batches")
  return out


def analyze_seed(model: Transformer, params: Params,
                 splits: Mapping[str, data.Split], options: StudyOptions,
                 rng: np.random.Generator, resamples: Resamples,
                 log: Log = print, run_config: Any = None
                 ) -> tuple[dict[str, Any], dict[summary.Key, np.ndarray]]:
  """Importance measures (validation), the oracle, pruning curves and
  Michel et al.'s tables (test) of one model. ``run_config`` (the run's
  config: batch size and seed of the exact-K gates' training) is needed
  with ``options.gates``.

  Returns:
    ``(result, statistics)``: the JSON-able result of the seed, and its
    bootstrap statistics (:func:`mha.pruning.study.summary.seed_statistics`) for
    :func:`aggregate`.
  """
  config = model.config
  timings: dict[str, float] = {}
  m = _measure_seed(model, params, splits, options, rng, log, timings,
                    run_config)
  plan = m["plan"]
  curves, bootstrap_info = _bootstrap_importance(
      model, params, splits, options, resamples, m, log, timings)
  statistics = summary.seed_statistics(
      curves, plan.counts, m["num_heads"], m["val_sums"],
      m["test_sums"], resamples.validation, resamples.test,
      options.tolerance, select=SELECTED, half_split=plan.half_split,
      loss_tolerance_bits=options.loss_tolerance_bits)
  val = core.summarize_examples(m["val_sums"])
  test = core.summarize_examples(m["test_sums"])
  nested = summary.seed_summary(statistics)
  out: dict[str, Any] = {
      "importance": m["importance"], "validation": m["validation"],
      "test": {k: float(v[0]) for k, v in test.items()},
      "spearman": _spearman(m["importance"]), "orders": m["orders"],
      "counts": plan.counts["all"],
      "fractions": plan.counts["all"] / max(m["num_heads"], 1),
      **nested["all"],
      "oracle": _oracle_entries(config, plan, "all", val, test),
      "no_layer_emptied": {
          "counts": plan.counts["no_layer_emptied"],
          "fractions": plan.counts["no_layer_emptied"] / max(
              m["num_heads"], 1),
          **nested["no_layer_emptied"],
          "oracle": _oracle_entries(config, plan, "no_layer_emptied", val,
                                    test)},
      **_ablations(config, plan, val, test, m["test_sums"]),
      "bootstrap_importance": bootstrap_info,
      "timings": timings,
  }
  mode, sinks, window = ablation_lib.parse(options.ablation)
  if mode == ablation_lib.STREAMING:  # The share of the KV cache kept.
    context = splits["test"].inputs.shape[1]
    n = m["num_heads"]
    out["kv_memory"] = ablation_lib.kv_memory(
        n - plan.counts["all"], n, context, sinks, window)
    out["no_layer_emptied"]["kv_memory"] = ablation_lib.kv_memory(
        n - plan.counts["no_layer_emptied"], n, context, sinks, window)
    for group in (out, out["no_layer_emptied"]):
      for curve in group.get("curves", {}).values():
        curve["kv_memory"] = group["kv_memory"]
  if kv_group_study.applies(model, options):  # GQA: whole groups too
    out[kv_group_study.VARIANT], group_statistics = kv_group_study.analyze(
        model, params, splits, options, resamples.validation, resamples.test,
        log, ablations=m["ablations"], head_orders=m["orders"])
    statistics.update(group_statistics)
  for name, ids in plan.chains.items():  # best_ordering, oracle_by_loss
    out[name] = _oracle_entries(config, plan, "all", val, test, ids)
  out["cost"] = method_costs(
      list(plan.curves["all"]), m["num_heads"], timings,
      m["search_evaluations"], options, m["shapley_method"], m["gates_k"])
  if plan.searches:
    out["searches"] = {
        name: _oracle_entries(config, plan, "all", val, test, ids)
        for name, ids in plan.searches.items()}
    out["search_evaluations"] = m["search_evaluations"]
    # Mask tuning's real-valued masks, [L][H] per k (0: removed), and the
    # layer where Kwon et al.'s bound stopped it (None: every layer tuned).
    for name in TUNED:
      for k, (entry, mask_id) in enumerate(zip(
          out["searches"].get(name, []), plan.searches.get(name, []))):
        entry["mask"] = plan.masks[mask_id].tolist()
        entry["rejected_layer"] = m["rejected_layers"][name][k]
    # Exact-K gates: the target whose gates chose each subset.
    for entry, found in zip(out["searches"].get("gates_k", []),
                            m["gates_k"]["entries"] if m["gates_k"] else []):
      entry["target_k"] = found["target_k"]
  if m["gates_k"] is not None:  # How they trained.
    out["gates_k"] = {k: v for k, v in m["gates_k"].items()
                      if k != "entries"}
  # What each head attends to, on the split of the importance measures.
  out["head_roles"] = head_roles.head_roles(
      model, params, splits["validation"], options.batch_size)
  if m["shapley_method"] is not None:
    out["shapley_method"] = m["shapley_method"]
  if m["attribution"] is not None:
    # Attribution patching's estimates against actual patching.
    out["attribution"] = m["attribution"]
  if m["interactions"] is not None:
    out["interactions"] = m["interactions"]
  if not m["oracle_ran"]:
    out["oracle_skipped"] = (
        f"{m['num_heads']} heads > --oracle_max_heads="
        f"{options.oracle_max_heads}: 2**{m['num_heads']} subsets not "
        "evaluated")
  out["examples"] = {"masks": np.stack(plan.masks),
                     "validation": m["val_sums"], "test": m["test_sums"]}
  return out, statistics


def custom_pruning(model: Transformer, params: Params, test: data.Split,
                   heads: Sequence[tuple[int, int]],
                   batch_size: int) -> dict[str, Any]:
  """Test metrics of the model with ``heads`` physically pruned."""
  p, c = core.prune_heads(params, model.config, heads)
  metrics = core.evaluate_masks(Transformer(c), p, test,
                                   head_masks.full_head_mask(c)[None],
                                   batch_size=batch_size)
  return {"removed": [list(h) for h in heads],
          "heads_per_layer": list(c.heads_per_layer),
          "params": core.count_params(p),
          **{f"test_{k}": float(v[0]) for k, v in metrics.items()}}


def aggregate(seed_results: Sequence[Mapping[str, Any]],
              seed_statistics: Sequence[Mapping[summary.Key, np.ndarray]],
              seed_weights: np.ndarray) -> dict[str, Any]:
  """The mean over seeds of every curve statistic with two-level bootstrap
  intervals; Spearman correlations averaged through Fisher's z; per seed,
  the share of random orders at least as good as each ordering (a one-sided
  permutation p-value) and the heads whose removal alone changes test token
  accuracy significantly (Benjamini-Hochberg q < 0.05)."""
  nested = summary.aggregate_statistics(seed_statistics, seed_weights)
  out: dict[str, Any] = {**nested["all"],
                         "no_layer_emptied": nested["no_layer_emptied"]}
  if kv_group_study.VARIANT in nested:
    out[kv_group_study.VARIANT] = nested[kv_group_study.VARIANT]
  out["spearman"] = {
      key: stats.fisher_mean([r["spearman"][key] for r in seed_results])
      for key in seed_results[0]["spearman"]}
  share: dict[str, list[float]] = {}
  for r in seed_results:
    per_order = np.asarray(
        r["curve_summary"]["random"]["auc_token_accuracy_per_order"])
    for name, entry in r["curve_summary"].items():
      if name != "random":
        share.setdefault(name, []).append(float(
            (1 + np.sum(per_order >= entry["auc_token_accuracy"])) /
            (1 + len(per_order))))
  out["share_of_random_at_least_as_good"] = share
  out["significant_single_heads"] = [
      int(np.nansum(np.asarray(
          r["single_head_ablation"]["token_accuracy_q"], np.float64) < 0.05))
      for r in seed_results]
  return out


__all__ = ["CURVE_LABELS", "SEARCH_LABELS", "ORACLE_CURVE_LABELS", "TUNED",
           "SELECTED", "COST_UNITS", "method_costs", "BOOTSTRAP_ORDERINGS",
           "replicate_orders", "Plan", "run_searches", "search_estimate", "run_kwon",
           "run_exact_k", "plan_masks", "Resamples", "analyze_seed",
           "custom_pruning", "aggregate"]
