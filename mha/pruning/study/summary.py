"""Curve statistics of the pruning study, with bootstrap intervals.

Every statistic of a seed (a curve point, an AUC, the level prunable within
the tolerance and its test accuracy, the differences between orderings) is
computed once per bootstrap replicate from the per-example sums of the masks
it uses (:func:`seed_statistics`): an array ``[1 + R, ...]`` whose row 0 is
the full sample and rows ``1..R`` the resamples. One seed's interval is the
percentile interval of its rows; across seeds :func:`aggregate` combines the
rows with resampled seed weights (a two-level bootstrap,
:mod:`mha.pruning.stats`).

The prunable level is chosen on *validation* (the largest number of heads
removed up to which every validation point is within the tolerance of the
unpruned value) and reported with its *test* accuracy; each replicate
resamples both splits, so the interval of the level includes the choice.
Beside it, a *half-split* level guards against choosing and judging on the
same examples: the level is chosen on the first half of validation (the
first ``n // 2`` examples, as in :func:`mha.pruning.orderings.halves`),
checked on the second half (does every point up to it stay within the
tolerance there too?), and reported on test (``*_half_split`` statistics).
The oracle's candidates for it are ranked on the first half alone where the
study passes them (``half_split``), so the second half is held out from the
oracle; the orderings are still fitted on the whole of validation; test is
the split that nothing was fitted on.

The oracle is chosen again in each replicate: among its candidates (the
best few subsets for each number of heads removed on the full validation
split), the one of best resampled validation token accuracy; so its
intervals include the variability of that choice (restricted to the
candidates).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import numpy as np

from mha.pruning import stats

CURVE_METRICS = ("token_accuracy", "exact_match")
BASELINES = ("random", "reverse_gradient")
#: The curves every other curve's AUC is compared with. An ordering's gap
#: to the oracle is its gap to the best ordering (the ranking error) plus
#: the best ordering's gap to the oracle (the price of nesting).
#: DuoAttention's gates (streaming ablation only) against the attention-
#: pattern scores: the KV-cache report's second question, paired.
REFERENCES = ("random", "reverse_gradient", "oracle", "best_ordering",
              "duo_gates")
#: The reference of the loss curves: the oracle chosen by validation loss,
#: the objective the gradient family ranks by.
LOSS_REFERENCE = "oracle_by_loss"
#: Fractions of the heads removed at which each curve's test accuracy is
#: reported (``test_<metric>_at_<p>pct_removed``): the point with the most
#: heads removed not beyond the fraction.
REPORTED_FRACTIONS = (0.25, 0.5)

#: Each tuned curve and the curve of the same subsets untuned: its
#: ``<stat>_minus_untuned`` (AUC, prunable heads, test accuracy there, and
#: every curve point) is the paired difference tuning makes. The oracle is
#: chosen again in each replicate, the tuned oracle's subsets are the full
#: split's choice.
UNTUNED = {"kwon_tuned": "kwon", "kwon_tuned_attention_output": "kwon",
           "oracle_kwon_tuned": "oracle"}

Key = tuple[str, str, str]  # (variant, curve, statistic)


def with_full_sample(weights: np.ndarray) -> np.ndarray:
  """``[1 + R, n]``: a row of ones (the full sample) above the resamples."""
  return np.concatenate([np.ones((1, weights.shape[1]), weights.dtype),
                         weights])


def _auc(fractions: np.ndarray, curves: np.ndarray) -> np.ndarray:
  width = fractions[-1] - fractions[0]
  if width <= 0:
    return curves[..., 0]
  return np.trapezoid(curves, fractions, axis=-1) / width


def _within(values: np.ndarray, tolerance: float) -> np.ndarray:
  """Whether each point stays within ``tolerance`` of point 0 (axis -1)."""
  return values >= values[..., :1] - tolerance - 1e-12


def _prunable_index(validation: np.ndarray, tolerance: float) -> np.ndarray:
  """Index of the last point up to which every point stays within
  ``tolerance`` of point 0 (axis -1)."""
  ok = _within(validation, tolerance)
  first_bad = np.argmax(~ok, axis=-1)
  return np.where(ok.all(axis=-1), ok.shape[-1] - 1, first_bad - 1)


def _curve_statistics(fractions: np.ndarray, counts: np.ndarray,
                      val: np.ndarray, test: np.ndarray, metric: str,
                      tolerance: float,
                      per_order: bool = False) -> dict[str, np.ndarray]:
  """Statistics ``[1 + R, ...]`` of one curve (``val``, ``test``:
  ``[1 + R, orders, points]``), averaged over its orders (and each order's
  AUC with ``per_order``)."""
  auc = _auc(fractions, test)
  last = _prunable_index(val, tolerance)
  at = np.take_along_axis(test, last[..., None], axis=-1)[..., 0]
  out = {
      f"curve_{metric}": test.mean(1),
      f"validation_curve_{metric}": val.mean(1),
      f"auc_{metric}": auc.mean(1),
      f"max_prunable_{metric}": fractions[last].mean(1),
      f"prunable_heads_{metric}": counts[last].astype(np.float64).mean(1),
      f"test_{metric}_at_prunable": at.mean(1),
  }
  for fraction in REPORTED_FRACTIONS:
    point = _point_at(fractions, fraction)
    out[f"test_{metric}_at_{round(fraction * 100)}pct_removed"] = (
        test[..., point].mean(1))
  if per_order:
    out[f"auc_{metric}_per_order"] = auc
  return out


def _point_at(fractions: np.ndarray, fraction: float) -> int:
  """The index of the curve point with the most heads removed whose
  fraction (increasing along the curve) is at most ``fraction`` (up to
  rounding)."""
  return int(np.flatnonzero(fractions <= fraction + 1e-9)[-1])


def _loss_statistics(fractions: np.ndarray, counts: np.ndarray,
                     val: np.ndarray, test: np.ndarray,
                     loss_tolerance_bits: float) -> dict[str, np.ndarray]:
  """The loss curves (``[1 + R, orders, points]`` each) on test and
  validation, the area under the test one (the mean test loss over the
  fractions removed; lower is better), and the level prunable by loss: the
  most heads removed up to which every validation point's loss stays
  within ``loss_tolerance_bits`` bits (per scored token; for a character
  LM, bits per character) of the unpruned loss, with the test loss there in
  bits."""
  # Within the tolerance <=> minus the loss within it of minus point 0.
  last = _prunable_index(-val, loss_tolerance_bits * np.log(2.0))
  at = np.take_along_axis(test, last[..., None], axis=-1)[..., 0]
  return {"curve_loss": test.mean(1), "validation_curve_loss": val.mean(1),
          "auc_loss": _auc(fractions, test).mean(1),
          "prunable_heads_loss": counts[last].astype(np.float64).mean(1),
          "test_bits_at_prunable_loss": (at / np.log(2.0)).mean(1)}


def _select(ids: np.ndarray, val_m: Mapping[str, np.ndarray],
            test_m: Mapping[str, np.ndarray], metric: str,
            *others: Mapping[str, np.ndarray],
            by: str = "token_accuracy") -> tuple[np.ndarray, ...]:
  """``[1 + R, 1, P]`` validation and test values (and those of ``others``)
  of the candidate (a row of ``ids``) with the best validation ``by`` in
  each replicate (the highest; for the loss, the lowest; ties: the first,
  i.e. the best on the full split)."""
  sign = -1.0 if by == "loss" else 1.0
  choice = np.argmax(sign * val_m[by][:, ids], axis=1)[:, None]
  pick = lambda m: np.take_along_axis(m[metric][:, ids], choice, axis=1)
  return tuple(pick(m) for m in (val_m, test_m, *others))


def _values(name: str, ids: np.ndarray, val_m: Mapping[str, np.ndarray],
            test_m: Mapping[str, np.ndarray], metric: str,
            select: Collection[str], *others: Mapping[str, np.ndarray]
            ) -> tuple[np.ndarray, ...]:
  """The ``[1 + R, orders, P]`` values of curve ``name`` on validation, test
  and ``others``; a curve in ``select`` is chosen on ``val_m`` (by
  ``select[name]`` when ``select`` is a mapping; else by token accuracy).
  ``ids`` ``[orders, P]`` are the same masks in every replicate;
  ``[1 + R, 1, P]`` (an ordering re-estimated in each replicate) a row of
  masks per replicate."""
  if name in select:
    by = (select[name] if isinstance(select, Mapping)
          else "token_accuracy")
    return _select(ids, val_m, test_m, metric, *others, by=by)
  if ids.ndim == 3:
    return tuple(np.take_along_axis(m[metric], ids[:, 0], axis=1)[:, None]
                 for m in (val_m, test_m, *others))
  return tuple(m[metric][:, ids] for m in (val_m, test_m, *others))


def _half_split_statistics(counts: np.ndarray, first: np.ndarray,
                           second: np.ndarray, test: np.ndarray, metric: str,
                           tolerance: float) -> dict[str, np.ndarray]:
  """The level chosen on the first validation half (``[1 + R, orders, P]``
  each), checked on the second, reported on test: the heads removed there,
  whether every point up to it holds on the second half (1 or 0, averaged
  over orders), the second half's loss there, and test's value there."""
  last = _prunable_index(first, tolerance)
  ok = _within(second, tolerance)
  points = np.arange(second.shape[-1])
  holds = np.where(points <= last[..., None], ok, True).all(-1)
  at = lambda m: np.take_along_axis(m, last[..., None], axis=-1)[..., 0]
  return {
      f"prunable_heads_{metric}_half_split":
          counts[last].astype(np.float64).mean(1),
      f"half_split_holds_{metric}": holds.astype(np.float64).mean(1),
      f"half_split_second_half_loss_{metric}":
          (second[..., 0] - at(second)).mean(1),
      f"test_{metric}_at_prunable_half_split": at(test).mean(1),
  }


def seed_statistics(curves: Mapping[str, Mapping[str, np.ndarray]],
                    counts: Mapping[str, np.ndarray], num_heads: int,
                    val_sums: Mapping[str, np.ndarray],
                    test_sums: Mapping[str, np.ndarray],
                    val_weights: np.ndarray, test_weights: np.ndarray,
                    tolerance: float,
                    select: Collection[str] = ("oracle",),
                    half_split: Mapping[str, Mapping[str, np.ndarray]]
                    | None = None,
                    loss_tolerance_bits: float = 0.05
                    ) -> dict[Key, np.ndarray]:
  """Every statistic of one seed under the full sample and each resample.

  Args:
    curves: variant -> curve name -> ``[orders, points]`` mask ids (for a
      curve in ``select``: ``[candidates, points]``, the best first; for an
      ordering re-estimated in each replicate, ``[1 + R, 1, points]``, row
      0 the full sample's).
    counts: variant -> ``[points]`` heads removed.
    num_heads: ``N`` (fractions are ``counts / N``).
    val_sums, test_sums: per-example sums ``[M, n]`` of the masks.
    val_weights, test_weights: ``[R, n]`` resample counts.
    tolerance: accuracy loss counted as none.
    select: curves chosen again in each replicate among their candidates
      (by validation token accuracy; a mapping names the validation metric
      that chooses each, ``"loss"`` the lowest) rather than averaged over
      orders.
    half_split: variant -> curve name -> the ids its half-split statistics
      use instead of ``curves``' (the oracle's candidates ranked on the
      first half of validation alone, so that the second half is held out
      from them).
    loss_tolerance_bits: loss increase counted as none by the level
      prunable by loss (``prunable_heads_loss``), in bits per scored token.

  Returns:
    ``(variant, curve, statistic) -> [1 + R, ...]``.
  """
  val_w = with_full_sample(val_weights)
  val_m = stats.resampled_metrics(val_sums, val_w)
  test_m = stats.resampled_metrics(test_sums, with_full_sample(test_weights))
  first_half = np.arange(val_w.shape[1]) < val_w.shape[1] // 2
  half_m = [stats.resampled_metrics(val_sums, val_w * part)
            for part in (first_half, ~first_half)]
  out: dict[Key, np.ndarray] = {}
  for variant, by_name in curves.items():
    fractions = counts[variant] / max(num_heads, 1)
    for name, ids in by_name.items():
      for metric in CURVE_METRICS:
        val, test = _values(name, ids, val_m, test_m, metric, select)
        found = _curve_statistics(fractions, counts[variant], val, test,
                                  metric, tolerance,
                                  per_order=name == "random")
        # The oracle's candidate is chosen on the first half here (among
        # candidates ranked on the first half, where ``half_split`` has
        # them).
        half_ids = (half_split or {}).get(variant, {}).get(name, ids)
        first, test_h, second = _values(name, half_ids, half_m[0], test_m,
                                        metric, select, half_m[1])
        found.update(_half_split_statistics(counts[variant], first, second,
                                            test_h, metric, tolerance))
        out.update({(variant, name, k): v for k, v in found.items()})
      if variant in ("all", "kv_groups"):  # the granularities of units
        val, test = _values(name, ids, val_m, test_m, "loss", select)
        out.update({(variant, name, k): v for k, v in _loss_statistics(
            fractions, counts[variant], val, test,
            loss_tolerance_bits).items()})
    _differences(out, variant, list(by_name))
  _no_layer_emptied_change(out, curves, counts, num_heads, val_m, test_m,
                           select)
  return out


def _differences(out: dict[Key, np.ndarray], variant: str,
                 names: Sequence[str]) -> None:
  for metric in CURVE_METRICS:
    for ref in REFERENCES:
      if ref not in names:
        continue
      for name in names:
        if name == ref:
          continue
        for stat in (f"auc_{metric}", f"prunable_heads_{metric}"):
          out[(variant, name, f"{stat}_minus_{ref}")] = (
              out[(variant, name, stat)] - out[(variant, ref, stat)])
    for name, untuned in UNTUNED.items():
      if name not in names or untuned not in names:
        continue
      for stat in (f"auc_{metric}", f"prunable_heads_{metric}",
                   f"test_{metric}_at_prunable", f"curve_{metric}"):
        out[(variant, name, f"{stat}_minus_untuned")] = (
            out[(variant, name, stat)] - out[(variant, untuned, stat)])
  if LOSS_REFERENCE in names:  # Lower is better: the excess loss.
    for name in names:
      if name != LOSS_REFERENCE and (variant, name, "auc_loss") in out:
        for stat in ("auc_loss", "prunable_heads_loss"):
          out[(variant, name, f"{stat}_minus_{LOSS_REFERENCE}")] = (
              out[(variant, name, stat)]
              - out[(variant, LOSS_REFERENCE, stat)])


def _no_layer_emptied_change(out: dict[Key, np.ndarray],
                             curves: Mapping[str, Mapping[str, np.ndarray]],
                             counts: Mapping[str, np.ndarray], num_heads: int,
                             val_m: Mapping[str, np.ndarray],
                             test_m: Mapping[str, np.ndarray],
                             select: Collection[str]) -> None:
  """AUC of each ``no_layer_emptied`` curve minus the plain curve's AUC over
  the same points (the constrained curves stop earlier)."""
  if "no_layer_emptied" not in curves:
    return
  points = len(counts["no_layer_emptied"])
  fractions = counts["no_layer_emptied"] / max(num_heads, 1)
  for name, ids in curves["no_layer_emptied"].items():
    plain = curves["all"].get(name)
    if plain is None:
      continue
    for metric in CURVE_METRICS:
      _, test = _values(name, plain[..., :points], val_m, test_m, metric,
                        select)
      same_range = _auc(fractions, test)
      out[("no_layer_emptied", name, f"auc_{metric}_plain")] = (
          same_range.mean(1))
      out[("no_layer_emptied", name, f"auc_{metric}_change")] = (
          out[("no_layer_emptied", name, f"auc_{metric}")] -
          same_range.mean(1))


# --------------------------------------------------------------------------
# To JSON, one seed and across seeds.
# --------------------------------------------------------------------------


def _nest(values: Mapping[Key, tuple[Any, Any]]) -> dict[str, Any]:
  """``variant -> {"curve_summary": {curve: {stat: v, stat_ci: ci}},
  "curves": {curve: {metric: [P], metric_ci: [P, 2]}},
  "validation_curves": ...}``."""
  out: dict[str, Any] = {}
  for (variant, name, stat), (value, ci) in values.items():
    part = out.setdefault(variant, {"curve_summary": {}, "curves": {},
                                    "validation_curves": {}})
    if stat.startswith("curve_") or stat.startswith("validation_curve_"):
      group = "curves" if stat.startswith("curve_") else "validation_curves"
      metric = stat.split("curve_", 1)[1]
      part[group].setdefault(name, {})[metric] = value
      part[group][name][f"{metric}_ci"] = ci
    elif stat.endswith("_per_order"):
      part["curve_summary"].setdefault(name, {})[stat] = value
    else:
      entry = part["curve_summary"].setdefault(name, {})
      entry[stat], entry[f"{stat}_ci"] = value, ci
  return out


def seed_summary(statistics: Mapping[Key, np.ndarray]) -> dict[str, Any]:
  """One seed's statistics as JSON-able nested dicts (value, interval)."""
  return _nest({k: (v[0], _within_range(k[2], stats.interval(v[1:])))
                for k, v in statistics.items()})


def aggregate_statistics(per_seed: Sequence[Mapping[Key, np.ndarray]],
                         seed_weights: np.ndarray) -> dict[str, Any]:
  """The mean over seeds of every statistic, with intervals over examples
  and seeds, nested like :func:`seed_summary`; ``<stat>_per_seed`` beside
  each scalar.

  Args:
    per_seed: each seed's :func:`seed_statistics`.
    seed_weights: ``[R, S]`` seed-level coefficients
      (:func:`mha.pruning.stats.seed_t_weights`): the intervals are
      :func:`mha.pruning.stats.seed_t_replicates`' (one seed: the example
      bootstrap's percentile interval, as :func:`seed_summary`'s).

  Returns:
    ``variant -> {"curve_summary", "curves", "validation_curves"}`` as
    :func:`seed_summary`, and in each curve summary the simultaneous
    intervals of the AUC gaps to the oracle and to random
    (:func:`_simultaneous`).
  """
  values, replicates = {}, {}
  for key in per_seed[0]:
    if key[2].endswith("_per_order"):
      continue
    stacked = np.stack([s[key] for s in per_seed])  # [S, 1 + R, ...]
    replicates[key] = stats.seed_t_replicates(stacked, seed_weights)
    values[key] = (stacked[:, 0].mean(0),
                   _within_range(key[2], stats.interval(replicates[key])))
  out = _nest(values)
  _simultaneous(out, values, replicates)
  for (variant, name, stat) in values:
    entry = out[variant]["curve_summary"].get(name)
    if entry is not None and stat in entry:
      entry[f"{stat}_per_seed"] = [float(s[(variant, name, stat)][0])
                                   for s in per_seed]
  return out


# Statistics whose value cannot leave [0, 1] (accuracies and their AUCs
# over fractions in [0, 1]) or go below 0 (a count of heads): the seed-level
# t term of few seeds can reach past that, and the interval is cut to it
# (the true value lies inside, so the coverage is kept).
_PROPORTIONS = frozenset(
    [f"{kind}{metric}" for metric in CURVE_METRICS
     for kind in ("auc_", "curve_", "validation_curve_")]
    + [f"test_{metric}_at_prunable{half}" for metric in CURVE_METRICS
       for half in ("", "_half_split")]
    + [f"test_{metric}_at_{round(f * 100)}pct_removed"
       for metric in CURVE_METRICS for f in REPORTED_FRACTIONS]
    + [f"half_split_holds_{metric}" for metric in CURVE_METRICS])


def _within_range(stat: str, ci: np.ndarray) -> np.ndarray:
  """``ci`` cut to the range ``stat`` can take (see ``_PROPORTIONS``)."""
  if stat in _PROPORTIONS:
    return np.clip(ci, 0.0, 1.0)
  if ((stat.startswith("prunable_heads_") and "_minus_" not in stat)
      or stat == "auc_loss"):
    return np.maximum(ci, 0.0)
  return ci


#: The families of simultaneous intervals: every curve's AUC minus the
#: reference's, one family per reference, variant and metric.
FAMILIES = ("oracle", "random")
#: Curves that are references, not methods: left out of the families.
NOT_IN_FAMILIES = (LOSS_REFERENCE,)


def _simultaneous(out: dict[str, Any],
                  values: Mapping[Key, tuple[Any, Any]],
                  replicates: Mapping[Key, np.ndarray]) -> None:
  """Adds ``auc_<metric>_minus_<ref>_simultaneous_ci`` beside each curve's
  marginal ``auc_<metric>_minus_<ref>_ci`` (``ref`` in :data:`FAMILIES`):
  max-t intervals over the family of every curve of the variant against
  ``ref`` (:func:`mha.pruning.stats.simultaneous_intervals`), from the same
  replicates; and per variant ``simultaneous_critical_values``,
  ``"auc_<metric>_minus_<ref>" -> {"c": ..., "members": K}``."""
  families: dict[tuple[str, str], list[Key]] = {}
  for key in values:
    variant, name, stat = key
    if name in NOT_IN_FAMILIES:
      continue
    for ref in FAMILIES:
      for metric in CURVE_METRICS:
        if stat == f"auc_{metric}_minus_{ref}":
          families.setdefault((variant, stat), []).append(key)
  for (variant, stat), keys in families.items():
    intervals, c = stats.simultaneous_intervals(
        np.array([values[k][0] for k in keys]),
        np.stack([replicates[k] for k in keys], axis=1))
    for key, ci in zip(keys, intervals):
      out[variant]["curve_summary"][key[1]][f"{stat}_simultaneous_ci"] = ci
    out[variant].setdefault("simultaneous_critical_values", {})[stat] = {
        "c": c, "members": len(keys)}


__all__ = ["FAMILIES", "NOT_IN_FAMILIES", "CURVE_METRICS", "BASELINES",
           "REFERENCES", "LOSS_REFERENCE", "REPORTED_FRACTIONS", "UNTUNED",
           "with_full_sample", "seed_statistics", "seed_summary", "aggregate_statistics"]
