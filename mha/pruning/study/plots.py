"""Plots of a head-pruning experiment.

A trained Transformer with ``L`` layers x ``H`` heads has its heads removed one
after another in the order of some importance measure, and the test accuracy is
measured after each removal. This module draws the figures of such a study:

* :func:`plot_pruning_curves`: accuracy vs fraction of heads removed, one mean
  line (with a spread band over runs) per ordering;
* :func:`plot_pruning_curve_panels`: the same as small multiples, one panel
  per family of orderings, each with the same reference curves;
* :func:`plot_importance_heatmaps`: one ``[layer, head]`` heatmap per measure;
* :func:`plot_importance_scatter`: one per-head measure against another, one
  colour per run (seed);
* :func:`plot_speed`: inference throughput of pruned models and the speed-up
  over the unpruned model, next to the speed-up predicted by FLOPs.

Each ``plot_*`` function writes a PNG (creating missing parent directories)
and returns its path; the matching ``*_figure`` function builds the same figure
without saving it. Like :mod:`mha.plotting`, only the object-oriented
matplotlib API is used (``Figure`` + ``FigureCanvasAgg``), never ``pyplot``, so
no GUI backend is needed and nothing is left open when called in a loop.
Colours come from the Okabe-Ito palette, which stays distinguishable under the
common forms of colour blindness.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Collection, Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from mha.run import figures

__all__ = [
    "pruning_curves_figure",
    "plot_pruning_curves",
    "pruning_curve_panels_figure",
    "plot_pruning_curve_panels",
    "importance_heatmaps_figure",
    "plot_importance_heatmaps",
    "importance_scatter_figure",
    "plot_importance_scatter",
    "speed_figure",
    "plot_speed",
    "retraining_figure",
    "plot_retraining",
]

#: Resolution of the written PNGs.
DPI = 130
#: Okabe-Ito colours (without yellow, too pale on white), colour-blind safe.
OKABE_ITO = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # bluish green
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#000000",  # black
)
#: Line style of the orderings a pruning study usually compares.
ORDERING_STYLES: dict[str, dict[str, object]] = {
    "gradient": dict(color="#0072B2", marker="o", linestyle="-"),
    "gradient (L2 per layer)": dict(color="#56B4E9", marker="s",
                                    linestyle="-"),
    "gradient (re-estimated)": dict(color="#009E73", marker="^",
                                    linestyle="-"),
    "leave-one-out": dict(color="#D55E00", marker="D", linestyle="-"),
    "confidence": dict(color="#CC79A7", marker="v", linestyle="-"),
    "entropy": dict(color="#E69F00", marker="P", linestyle="-"),
    "random": dict(color="0.35", marker="o", linestyle="--"),
    "reverse gradient": dict(color="#000000", marker="x", linestyle=":"),
    "Shapley value": dict(color="#7A5195", marker="*", linestyle="-"),
    # Kwon et al.'s Fisher ordering and its two searches: one brown family,
    # dash-dotted, told apart by their markers.
    "Fisher (Kwon et al.)": dict(color="#8C564B", marker="h", linestyle="-."),
    # Attribution patching under its three baselines: one teal family.
    "attribution patching (zero)": dict(color="#17BECF", marker="1",
                                        linestyle="-"),
    "attribution patching (mean per position)": dict(
        color="#17BECF", marker="2", linestyle="--"),
    "attribution patching (resample)": dict(color="#17BECF", marker="3",
                                            linestyle=":"),
    "Kwon et al. (Fisher search, rearranged)": dict(
        color="#8C564B", marker="<", linestyle="-.", fillstyle="none"),
    "Kwon et al., mask tuned": dict(color="#8C564B", marker=">",
                                    linestyle=(0, (5, 1, 1, 1, 1, 1))),
    "Kwon et al., mask tuned (layer output)": dict(
        color="#8C564B", marker=">", linestyle=(0, (5, 1, 1, 1, 1, 1))),
    "Kwon et al., mask tuned (attention output)": dict(
        color="#C49C94", marker="^", linestyle=(0, (5, 1, 1, 1, 1, 1))),
    "oracle's subset, mask tuned (Kwon et al.)": dict(
        color="#555555", marker="*", linestyle="-"),
    # The best nested chain of subsets: the ceiling of every ordering.
    "best ordering": dict(color="#000000", marker="", linestyle=(0, (4, 2))),
    "oracle (best subset)": dict(color="#000000", marker="", linestyle="-"),
    # The searches lie on or near the oracle: dashed and hollow-marked, in
    # colours no ordering has, so that the black line shows beneath them.
    "surrogate search (layer-additive)": dict(color="#E4007C", marker="o",
                                              linestyle="--",
                                              fillstyle="none"),
    "beam search": dict(color="#00A6A6", marker="s", linestyle=(0, (1, 1.5)),
                        fillstyle="none"),
    # The gates' main result: one subset per k, near the oracle as well.
    "exact-K gates (one per k)": dict(color="#B8860B", marker="d",
                                      linestyle="--", fillstyle="none"),
}
#: The colours of the curves within one panel of the small multiples: the
#: Okabe-Ito ones but black (the oracle's), then two more.
_PANEL_COLOURS = OKABE_ITO[:6] + ("#8C564B", "#7A5195")
#: Runs up to this many get a min-max band; more get a percentile band.
MINMAX_MAX_RUNS = 5
#: Percentiles of the band drawn for more than ``MINMAX_MAX_RUNS`` runs.
BAND_PERCENTILES = (10.0, 90.0)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_LABEL_SIZE = 10.0
_TICK_SIZE = 9.0


def _save(fig: Figure, path: str | os.PathLike) -> str:
  """Writes ``fig`` at ``path`` (creating its parent), as PNG, SVG or PDF
  by its suffix (:func:`mha.run.figures.figure_format`); returns it."""
  path = os.fspath(path)
  fmt = figures.figure_format(path)
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  fig.savefig(path, dpi=DPI, format=fmt, bbox_inches="tight", pad_inches=0.1)
  fig.clear()  # drop artists now; the Figure has no pyplot reference to leak
  return path


def _new_figure(width: float, height: float) -> Figure:
  fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _quiet_nan_reduce(fn, arr: np.ndarray, *args, **kwargs) -> np.ndarray:
  """``fn`` (a ``np.nan*`` reduction) without "all-NaN slice" warnings."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return fn(arr, *args, **kwargs)


# --------------------------------------------------------------------------
# Pruning curves.


def _check_curves(
    fractions: np.ndarray,
    curves: Mapping[str, np.ndarray],
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Validates and converts to ``[P]`` and ``{name: [R, P]}`` float arrays."""
  fractions = np.asarray(fractions, dtype=np.float64)
  if fractions.ndim != 1 or fractions.size == 0:
    raise ValueError(
        f"fractions must be a non-empty 1-D [P] array, got shape "
        f"{fractions.shape}.")
  if not np.all(np.isfinite(fractions)):
    raise ValueError("fractions must be finite.")
  if not curves:
    raise ValueError(
        "curves is empty: pass at least one ordering name -> [R, P] array.")
  num_points = fractions.shape[0]
  out = {}
  for name, values in curves.items():
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
      values = values[None, :]  # a single run
    if values.ndim != 2 or values.shape[1] != num_points or values.shape[0] < 1:
      raise ValueError(
          f"curves[{name!r}] must be [R, P] or [P] with P = len(fractions) = "
          f"{num_points}, got shape {np.shape(curves[name])}.")
    out[str(name)] = values
  return fractions, out


def _ordering_styles(names: Sequence[str]) -> dict[str, dict[str, object]]:
  """Known orderings keep a fixed style; others get the colours left over."""
  used = {ORDERING_STYLES[n]["color"] for n in names if n in ORDERING_STYLES}
  free = [c for c in OKABE_ITO if c not in used] or list(OKABE_ITO)
  styles, extra = {}, 0
  for name in names:
    if name in ORDERING_STYLES:
      styles[name] = dict(ORDERING_STYLES[name])
    else:
      styles[name] = dict(color=free[extra % len(free)],
                          marker=_MARKERS[extra % len(_MARKERS)],
                          linestyle="-")
      extra += 1
  return styles


def _band(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
  """Spread over runs (axis 0): (low, high, description)."""
  runs = values.shape[0]
  if runs <= MINMAX_MAX_RUNS:
    return (_quiet_nan_reduce(np.nanmin, values, axis=0),
            _quiet_nan_reduce(np.nanmax, values, axis=0), "min\u2013max")
  lo, hi = BAND_PERCENTILES
  low, high = _quiet_nan_reduce(np.nanpercentile, values, [lo, hi], axis=0)
  return low, high, f"{lo:g}\u2013{hi:g}th pct"


#: A curves figure whose values all lie within a band narrower than this
#: zooms its y-axis to the band instead of spanning 0 to 1.
ZOOM_BELOW = 0.3


def _y_limits(values: np.ndarray,
              drawn: np.ndarray | None = None) -> tuple[float, float]:
  """A curves figure's y-axis: 0 to 1 (further where ``values`` go), or the
  range of ``drawn`` (``values`` by default) where it is narrower than
  :data:`ZOOM_BELOW`; a margin of 3% either side."""
  values = values[np.isfinite(values)]
  drawn = values if drawn is None else drawn[np.isfinite(drawn)]
  low = min(0.0, float(values.min())) if values.size else 0.0
  high = max(1.0, float(values.max())) if values.size else 1.0
  if drawn.size and drawn.max() - drawn.min() < ZOOM_BELOW:
    # Every curve and band within a narrow range (a language model's
    # next-character accuracy): the axis spans it, not 0 to 1, or the
    # curves are one line.
    low, high = float(drawn.min()), float(drawn.max())
  margin = 0.03 * (high - low) if high > low else 0.01
  return low - margin, high + margin


def pruning_curves_figure(
    fractions: np.ndarray,
    curves: Mapping[str, np.ndarray],
    *,
    metric: str = "token accuracy",
    baseline: float | None = None,
    title: str | None = None,
    bands: Collection[str] | None = None,
    intervals: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    points: Mapping[str, Sequence[np.ndarray]] | None = None,
    xlabel: str = "fraction of heads removed",
    kv_axis: tuple[float, float] | None = None,
) -> Figure:
  """Builds (but does not save) the figure of :func:`plot_pruning_curves`."""
  fractions, curves = _check_curves(fractions, curves)
  num_points = fractions.shape[0]
  fig = _new_figure(8.4, 4.6)
  ax = fig.add_subplot()
  # Markers at every point, smaller when there are many (e.g. one per head).
  marker_size = 5.0 if num_points <= 25 else 2.5
  markevery = max(1, num_points // 60)

  styles = _ordering_styles(list(curves))
  handles = {}
  for name, values in curves.items():
    runs = values.shape[0]
    style = styles[name]
    is_random = name == "random"
    mean = _quiet_nan_reduce(np.nanmean, values, axis=0)
    label = f"{name} ({runs} run{'s' if runs > 1 else ''}" if (
        intervals is None) else name
    band_patch = None
    interval = (intervals or {}).get(name)
    if interval is not None or (runs > 1 and (bands is None or name in bands)
                                and intervals is None):
      if interval is not None:
        low, high = (np.asarray(v, np.float64) for v in interval)
        band = "95% CI"
      else:
        low, high, band = _band(values)
      band_style = dict(
          color="0.6" if is_random else style["color"],
          # Lighter for black, so that it does not read as the grey "random".
          alpha=0.35 if is_random else
          (0.08 if style["color"] == "#000000" else 0.15),
          linewidth=0,
      )
      # "random" lowest, so that it lies beneath the informative orderings.
      ax.fill_between(fractions,
                      low,
                      high,
                      zorder=1 if is_random else 2,
                      **band_style)
      band_patch = Patch(**band_style)
      label += f", band {band}" if intervals is None else f" (band: {band})"
    label += ")" if intervals is None else ""
    (line,) = ax.plot(
        fractions,
        mean,
        linewidth=1.6 if is_random else (2.6 if name.startswith("oracle")
                                         else 1.8),
        markersize=marker_size,
        markevery=markevery,
        zorder=3 if is_random else 4,
        markerfacecolor="none" if is_random else style["color"],
        **style,
    )
    handles[label] = (band_patch, line) if band_patch is not None else line

  for offset, (name, (x, y, low, high)) in enumerate((points or {}).items()):
    x, y, low, high = (np.asarray(v, np.float64) for v in (x, y, low, high))
    handles[f"{name} (95% CI)"] = ax.errorbar(
        x, y, yerr=np.stack([y - low, high - y]), fmt="*", markersize=11,
        color=("gold", "#E4007C", "#00CED1")[offset % 3],
        markeredgecolor="black", markeredgewidth=0.6, capsize=3, zorder=6)

  if baseline is not None:
    handles["unpruned \u2212 1 pt"] = ax.axhline(baseline - 0.01,
                                                  color="0.25",
                                                  linestyle=(0, (1, 2)),
                                                  linewidth=1.0,
                                                  zorder=2.5)

  finite = np.concatenate([np.ravel(v) for v in curves.values()] +
                          [np.array([] if baseline is None else
                                    [baseline - 0.01])])
  ax.set_ylim(*_y_limits(finite, np.concatenate([finite] + [
      np.asarray(b, np.float64).ravel() for pair in (intervals or {}).values()
      for b in pair])))
  if fractions.min() >= 0.0 and fractions.max() <= 1.0:
    ax.set_xlim(-0.02, 1.02)
  ax.set_xlabel(xlabel, fontsize=_LABEL_SIZE)
  if kv_axis is not None:
    start, stop = kv_axis
    top = ax.secondary_xaxis("top", functions=(
        lambda f: start + (stop - start) * f,
        lambda m: (m - start) / (stop - start)))
    top.set_xlabel("KV memory kept (share of the full cache)",
                   fontsize=_LABEL_SIZE)
    top.tick_params(labelsize=_TICK_SIZE)
  ax.set_ylabel(metric, fontsize=_LABEL_SIZE)
  ax.tick_params(labelsize=_TICK_SIZE)
  ax.grid(True, color="0.9", linewidth=0.8)
  ax.set_axisbelow(True)
  # Outside the axes: the curves span the whole plotting area.
  fig.legend(
      list(handles.values()),
      list(handles),
      loc="outside right upper",
      fontsize=8.5,
      title=("ordering (mean over runs;\nshaded band = spread)"
             if intervals is None else "ordering (mean over seeds)"),
      title_fontsize=8.5,
      alignment="left",
      frameon=False,
  )
  if title:
    ax.set_title(title, fontsize=11)
  return fig


def plot_pruning_curves(
    fractions: np.ndarray,
    curves: Mapping[str, np.ndarray],
    path: str,
    *,
    metric: str = "token accuracy",
    baseline: float | None = None,
    title: str | None = None,
    bands: Collection[str] | None = None,
    intervals: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    points: Mapping[str, Sequence[np.ndarray]] | None = None,
    xlabel: str = "fraction of heads removed",
    kv_axis: tuple[float, float] | None = None,
) -> str:
  """Writes a PNG of the metric vs the fraction of heads removed.

  One line per ordering at the mean over runs, with markers at the measured
  points and a shaded band for the spread over runs: min-max for up to
  ``MINMAX_MAX_RUNS`` (5) runs, the 10th-90th percentile for more (e.g. a
  random ordering with 3 seeds x 20 orders = 60 runs); each legend entry says
  how many runs and which band. ``"random"`` is drawn as a neutral grey band
  with a dashed mean, ``"reverse gradient"`` as a black dotted line; other
  known orderings (:data:`ORDERING_STYLES`) keep a fixed colour and marker.
  NaN values (runs without a measurement at a point) are skipped.

  Args:
    fractions: ``[P]`` fraction of heads removed at each point (0 ... 1,
      increasing).
    curves: ordering name -> ``[R, P]`` metric of ``R`` runs (or ``[P]``, a
      single run).
    path: where to write the PNG (parent directories are created).
    metric: y-axis label.
    baseline: the unpruned model's metric; a dotted line is drawn at
      ``baseline - 0.01`` ("unpruned - 1 pt").
    title: optional axes title.
    bands: the orderings that get a spread band (default: all); with many
      orderings and several seeds, bands on a few keep the plot readable.
    intervals: ordering name -> ``(low [P], high [P])``, e.g. 95% bootstrap
      intervals; when given, these are the only bands drawn (and the legend
      says so).
    xlabel: the x-axis label.
    kv_axis: ``(at 0, at 1)``: the KV memory kept at no and at every head
      removed (streaming ablation), drawn as a second x-axis on top (it is
      linear in the fraction).
    points: name -> ``(x, y, low, high)``: single points with a vertical
      interval drawn over the curves (e.g. the subsets of learned gates).

  Returns:
    ``path``.

  Raises:
    ValueError: if ``curves`` is empty, ``fractions`` is not a non-empty
      finite 1-D array, or a curve is not ``[R, P]`` / ``[P]``.
  """
  return _save(
      pruning_curves_figure(fractions,
                            curves,
                            metric=metric,
                            baseline=baseline,
                            title=title,
                            bands=bands,
                            intervals=intervals,
                            points=points,
                            xlabel=xlabel,
                            kv_axis=kv_axis), path)


def _panel_grid(count: int) -> tuple[int, int]:
  """Rows and columns of ``count`` small panels: at most 3 a row."""
  cols = min(3, count)
  return math.ceil(count / cols), cols


def pruning_curve_panels_figure(
    fractions: np.ndarray,
    panels: Mapping[str, Mapping[str, np.ndarray]],
    references: Mapping[str, np.ndarray],
    *,
    metric: str = "token accuracy",
    baseline: float | None = None,
    title: str | None = None,
    xlabel: str = "fraction of heads removed",
) -> Figure:
  """Builds (but does not save) the figure of
  :func:`plot_pruning_curve_panels`."""
  if not panels:
    raise ValueError("panels is empty: pass at least one title -> curves.")
  fractions, refs = _check_curves(fractions, references) if references else (
      np.asarray(fractions, np.float64), {})
  checked = {t: _check_curves(fractions, c)[1] for t, c in panels.items()}
  # One y-axis for every panel, zoomed as a curves figure's is (a KV-cache
  # study's curves stay within a few points).
  limits = _y_limits(np.concatenate([
      np.ravel(_quiet_nan_reduce(np.nanmean, v, axis=0)) for v in
      [*refs.values(), *(v for c in checked.values() for v in c.values())]]
      + [np.asarray([] if baseline is None else [baseline - 0.01])]))
  rows, cols = _panel_grid(len(checked))
  fig = _new_figure(3.6 * cols, 3.5 * rows + 0.5)
  axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
  ref_styles = {name: dict(ORDERING_STYLES.get(name, {}), marker="")
                for name in refs}
  ref_handles = {}
  for ax, (panel, curves) in zip(axes.flat, checked.items()):
    for name, values in refs.items():
      style = ref_styles[name]
      (line,) = ax.plot(fractions, _quiet_nan_reduce(np.nanmean, values,
                                                     axis=0),
                        linewidth=2.2 if style.get("color") == "#000000"
                        else 1.4, zorder=2,
                        **{**style, "color": style.get("color", "0.5")})
      ref_handles[name] = line
    styles = _ordering_styles(list(curves))
    for i, (name, values) in enumerate(curves.items()):
      # A panel's own colours, so that a family's curves (one hue in
      # ORDERING_STYLES) stay apart; markers and dashes kept.
      style = dict(styles[name], color=_PANEL_COLOURS[i % len(
          _PANEL_COLOURS)])
      ax.plot(fractions, _quiet_nan_reduce(np.nanmean, values, axis=0),
              linewidth=1.6, markersize=4.0,
              markevery=max(1, len(fractions) // 30), zorder=3,
              label=name, **style)
    if baseline is not None:
      ax.axhline(baseline - 0.01, color="0.25", linestyle=(0, (1, 2)),
                 linewidth=1.0, zorder=1.5)
    ax.set_title(panel, fontsize=10)
    ax.grid(True, color="0.9", linewidth=0.8)
    ax.set_axisbelow(True)
    # Every panel's fractions labelled: a row's panel may have none below.
    ax.tick_params(labelsize=_TICK_SIZE, labelbottom=True)
    ax.set_ylim(*limits)
    ax.set_xlim(-0.02, 1.02)
    # Every panel's axis named too, its curves listed below the name.
    ax.set_xlabel(xlabel, fontsize=_LABEL_SIZE)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=7.5,
              frameon=False, ncol=1)
  spare = list(axes.flat[len(checked):])
  for ax in spare:
    ax.set_axis_off()
  for ax in axes[:, 0]:
    ax.set_ylabel(metric, fontsize=_LABEL_SIZE)
  handles = dict(ref_handles)
  if baseline is not None:
    handles["unpruned \u2212 1 pt"] = Line2D([], [], color="0.25",
                                             linestyle=(0, (1, 2)))
  if handles and spare:  # In the first empty cell.
    spare[0].legend(list(handles.values()), list(handles), loc="center",
                    fontsize=8.5, frameon=False, title="in every panel",
                    title_fontsize=8.5)
  elif handles:
    fig.legend(list(handles.values()), list(handles),
               loc="outside lower center", ncol=len(handles), fontsize=8.5,
               frameon=False, title="in every panel", title_fontsize=8.5)
  if title:
    fig.suptitle(title, fontsize=11)
  return fig


def plot_pruning_curve_panels(
    fractions: np.ndarray,
    panels: Mapping[str, Mapping[str, np.ndarray]],
    references: Mapping[str, np.ndarray],
    path: str,
    *,
    metric: str = "token accuracy",
    baseline: float | None = None,
    title: str | None = None,
    xlabel: str = "fraction of heads removed",
) -> str:
  """Writes small multiples of pruning curves: one panel per family of
  orderings (``panels``: title -> ordering name -> ``[R, P]`` or ``[P]``),
  each with the ``references`` (name -> values, e.g. the oracle and random)
  drawn beneath its curves, the mean over runs of each, without bands.
  Panels share their axes (the y-axis zoomed as :func:`plot_pruning_curves`
  zooms it), at most three a row; each lists its curves below it, the
  references once above all. ``baseline``: as :func:`plot_pruning_curves`;
  ``xlabel``: each panel's x-axis label.

  Returns:
    ``path``.

  Raises:
    ValueError: if ``panels`` is empty or a curve is not ``[R, P]`` /
      ``[P]`` with ``P = len(fractions)``.
  """
  return _save(pruning_curve_panels_figure(
      fractions, panels, references, metric=metric, baseline=baseline,
      title=title, xlabel=xlabel), path)


# --------------------------------------------------------------------------
# Importance heatmaps.


def _check_measures(
    measures: Mapping[str, np.ndarray],
    head_counts: Sequence[int] | None,
) -> dict[str, np.ndarray]:
  """Validates; returns ``{name: [L, H]}`` with absent heads set to NaN."""
  if not measures:
    raise ValueError(
        "measures is empty: pass at least one name -> [L, H] array.")
  out = {}
  shape = None
  first = None
  for name, values in measures.items():
    values = np.array(values, dtype=np.float64)  # a copy: NaNs are written
    if values.ndim != 2 or 0 in values.shape:
      raise ValueError(
          f"measures[{name!r}] must be a non-empty 2-D [layers, heads] "
          f"array, got shape {values.shape}.")
    if shape is None:
      shape, first = values.shape, name
    elif values.shape != shape:
      raise ValueError(
          f"measures[{name!r}] has shape {values.shape}, but "
          f"measures[{first!r}] has {shape}; all measures must be "
          f"[layers, heads] of the same model.")
    out[str(name)] = values
  if head_counts is not None:
    counts = [int(c) for c in head_counts]
    layers, heads = shape
    if len(counts) != layers or any(c < 0 or c > heads for c in counts):
      raise ValueError(
          f"head_counts must hold {layers} values (one per layer) in "
          f"0..{heads}, got {list(head_counts)}.")
    absent = np.arange(heads)[None, :] >= np.array(counts)[:, None]
    for values in out.values():
      values[absent] = np.nan
  return out


def _heatmap_norm(values: np.ndarray) -> tuple[Normalize, str]:
  """Per-panel scale: sequential, or diverging around 0 for mixed signs."""
  finite = values[np.isfinite(values)]
  if finite.size == 0:
    return Normalize(0.0, 1.0), "viridis"
  low, high = float(finite.min()), float(finite.max())
  if low < 0.0 < high:
    bound = max(-low, high)
    return Normalize(-bound, bound), "RdBu_r"
  if low == high:
    pad = 0.5 if low == 0.0 else 0.05 * abs(low)
    low, high = low - pad, high + pad
  return Normalize(low, high), "viridis"


def _text_colour(rgba) -> str:
  """Black on light cells, white on dark ones."""
  r, g, b = rgba[:3]
  return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def importance_heatmaps_figure(
    measures: Mapping[str, np.ndarray],
    *,
    title: str | None = None,
    head_counts: Sequence[int] | None = None,
) -> Figure:
  """Builds (but does not save) the figure of :func:`plot_importance_heatmaps`.

  ``fig.axes`` lists the panels row-major (one per measure, then blank filler
  panels of the last row), followed by one colourbar axis per measure.
  """
  measures = _check_measures(measures, head_counts)
  layers, heads = next(iter(measures.values())).shape
  num = len(measures)
  cols = min(3, num)
  rows = math.ceil(num / cols)

  # Square cells, ~0.55-0.85 in each, and panels never too small for a title.
  cell = float(np.clip(6.6 / max(layers, heads), 0.55, 0.85))
  panel_w = max(heads * cell, 2.0) + 1.1  # + colourbar and its labels
  panel_h = max(layers * cell, 0.9) + 0.9  # + title and x label
  fig = _new_figure(cols * panel_w + 0.4,
                    rows * panel_h + (0.4 if title else 0.0))
  axes = fig.subplots(rows, cols, squeeze=False)
  labels = {
      name: np.array([[format(v, ".3g") for v in row] for row in values])
      for name, values in measures.items()
  }

  def fit(n_chars: int) -> float:
    # A label gets ~80% of its cell; a digit is ~0.64 em wide.
    return float(np.clip(0.8 * cell * 72.0 / (0.64 * max(n_chars, 4)), 4.5,
                         10.0))

  # One size for typical labels; only the longer ones (e.g. "5.51e-06") shrink.
  lengths = [
      len(s) for name, values in measures.items()
      for s in labels[name][np.isfinite(values)]
  ]
  fontsize = fit(int(np.median(lengths))) if lengths else 10.0
  any_absent = False

  for index, (name, values) in enumerate(measures.items()):
    ax = axes.flat[index]
    norm, cmap = _heatmap_norm(values)
    masked = np.ma.masked_invalid(values)
    image = ax.imshow(masked,
                      # NaN: transparent over the hatched patch drawn below.
                      cmap=colormaps[cmap].with_extremes(bad=(0, 0, 0, 0)),
                      norm=norm,
                      interpolation="nearest",
                      aspect="equal")
    for layer in range(layers):
      for head in range(heads):
        value = values[layer, head]
        if not np.isfinite(value):
          any_absent = True
          ax.add_patch(
              Rectangle((head - 0.5, layer - 0.5),
                        1.0,
                        1.0,
                        facecolor="0.95",
                        edgecolor="0.6",
                        hatch="////",
                        linewidth=0.0,
                        zorder=0.5))
          continue
        ax.text(head,
                layer,
                labels[name][layer, head],
                ha="center",
                va="center",
                fontsize=min(fontsize, fit(len(labels[name][layer, head]))),
                color=_text_colour(image.cmap(norm(value))))
    ax.set_title(name, fontsize=_LABEL_SIZE)
    ax.set_xticks(np.arange(heads))
    ax.set_yticks(np.arange(layers))
    ax.tick_params(labelsize=_TICK_SIZE, length=2)
    ax.set_xlabel("head", fontsize=_LABEL_SIZE)
    ax.set_ylabel("layer", fontsize=_LABEL_SIZE)
    cbar = fig.colorbar(image, ax=ax, fraction=0.08, pad=0.03, shrink=0.9)
    cbar.ax.tick_params(labelsize=8.0)
  for ax in axes.flat[num:]:
    ax.set_axis_off()
  if title:
    fig.suptitle(title, fontsize=11)
  if any_absent:
    fig.supxlabel("hatched: head absent (pruned)", fontsize=8.5, color="0.35")
  return fig


def plot_importance_heatmaps(
    measures: Mapping[str, np.ndarray],
    path: str,
    *,
    title: str | None = None,
    head_counts: Sequence[int] | None = None,
) -> str:
  """Writes a PNG with one ``[layer, head]`` heatmap per importance measure.

  Panels are laid out up to 3 per row, each with its own colour scale and
  colourbar (sequential ``viridis``, or ``RdBu_r`` symmetric around 0 when the
  values have both signs) and each cell annotated with its value (``.3g``, in
  black or white for contrast). NaN cells, and heads beyond ``head_counts``,
  are drawn hatched and left unannotated.

  Args:
    measures: measure name -> ``[L, H]`` (layers x heads) values; all the
      same shape.
    path: where to write the PNG (parent directories are created).
    title: optional figure title.
    head_counts: optional number of heads that exist in each layer (``L``
      values in ``0..H``); heads ``>= head_counts[l]`` of layer ``l`` are
      treated as absent (NaN) in every measure.

  Returns:
    ``path``.

  Raises:
    ValueError: if ``measures`` is empty, a measure is not a non-empty 2-D
      array, the shapes differ, or ``head_counts`` does not fit them.
  """
  return _save(
      importance_heatmaps_figure(measures, title=title,
                                 head_counts=head_counts), path)


# --------------------------------------------------------------------------
# Importance scatter.


def _corners_by_emptiness(x: np.ndarray, y: np.ndarray) -> list[str]:
  """Axes corners (``"upper left"``...), those with the fewest points first."""
  corners = ["upper left", "lower right", "upper right", "lower left"]
  if x.size == 0:
    return corners
  u = (x - x.min()) / (np.ptp(x) or 1.0)
  v = (y - y.min()) / (np.ptp(y) or 1.0)
  # Points within ~40% of the data range of a corner would be covered.
  counts = {
      "upper left": np.sum((u < 0.4) & (v > 0.6)),
      "upper right": np.sum((u > 0.6) & (v > 0.6)),
      "lower left": np.sum((u < 0.4) & (v < 0.4)),
      "lower right": np.sum((u > 0.6) & (v < 0.4)),
  }
  return sorted(corners, key=lambda k: counts[k])  # stable: ties keep order


def importance_scatter_figure(
    x: Sequence[np.ndarray],
    y: Sequence[np.ndarray],
    *,
    xlabel: str,
    ylabel: str,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    annotation: str | None = None,
) -> Figure:
  """Builds (but does not save) the :func:`plot_importance_scatter` figure."""
  if len(x) == 0:
    raise ValueError("x is empty: pass at least one run's per-head values.")
  if len(y) != len(x):
    raise ValueError(
        f"y must hold one array per run like x ({len(x)}), got {len(y)}.")
  if labels is not None and len(labels) != len(x):
    raise ValueError(
        f"labels must hold one label per run ({len(x)}), got {len(labels)}.")
  xs, ys = [], []
  for run, (xi, yi) in enumerate(zip(x, y)):
    xi = np.asarray(xi, dtype=np.float64).ravel()
    yi = np.asarray(yi, dtype=np.float64).ravel()
    if xi.shape != yi.shape:
      raise ValueError(
          f"x[{run}] and y[{run}] must hold the same number of values, got "
          f"{xi.size} and {yi.size}.")
    keep = np.isfinite(xi) & np.isfinite(yi)
    xs.append(xi[keep])
    ys.append(yi[keep])

  fig = _new_figure(5.8, 4.6)
  ax = fig.add_subplot()
  ax.axhline(0.0, color="0.75", linewidth=0.8, zorder=1)
  ax.axvline(0.0, color="0.75", linewidth=0.8, zorder=1)
  for run, (xi, yi) in enumerate(zip(xs, ys)):
    ax.scatter(
        xi,
        yi,
        s=28,
        color=OKABE_ITO[run % len(OKABE_ITO)],
        marker=_MARKERS[run % len(_MARKERS)],
        alpha=0.8,
        edgecolors="white",
        linewidths=0.4,
        label=labels[run] if labels is not None else f"run {run}",
        zorder=3,
    )
  ax.set_xlabel(xlabel, fontsize=_LABEL_SIZE)
  ax.set_ylabel(ylabel, fontsize=_LABEL_SIZE)
  ax.tick_params(labelsize=_TICK_SIZE)
  ax.grid(True, color="0.92", linewidth=0.8)
  ax.set_axisbelow(True)
  if title:
    ax.set_title(title, fontsize=11)

  all_x, all_y = np.concatenate(xs), np.concatenate(ys)
  # Headroom so that the legend and the annotation can sit beside the data.
  ax.margins(x=0.06, y=0.2)
  corners = _corners_by_emptiness(all_x, all_y)
  legend_loc = corners[0]
  if annotation:
    corner = corners[0]
    legend_loc = corners[1]
    top = corner.startswith("upper")
    left = corner.endswith("left")
    ax.text(0.02 if left else 0.98,
            0.98 if top else 0.02,
            annotation,
            transform=ax.transAxes,
            ha="left" if left else "right",
            va="top" if top else "bottom",
            fontsize=8.5,
            zorder=5,
            bbox=dict(boxstyle="round,pad=0.35",
                      facecolor="white",
                      edgecolor="0.7",
                      alpha=0.9))
  ax.legend(loc=legend_loc, fontsize=8.5, framealpha=0.9)
  return fig


def plot_importance_scatter(
    x: Sequence[np.ndarray],
    y: Sequence[np.ndarray],
    path: str,
    *,
    xlabel: str,
    ylabel: str,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    annotation: str | None = None,
) -> str:
  """Writes a PNG scatter of one per-head measure against another.

  ``x[i]`` and ``y[i]`` are the (flattened) per-head values of run ``i`` (e.g.
  seed ``i``: gradient importance vs leave-one-out loss increase); each run
  gets its own colour and marker. Linear axes (values may be negative), with
  thin grey lines at 0. Non-finite pairs are skipped.

  Args:
    x: one array of per-head values per run (any shape; flattened).
    y: one array per run, the same number of values as ``x[i]``.
    path: where to write the PNG (parent directories are created).
    xlabel: x-axis label.
    ylabel: y-axis label.
    labels: optional legend label per run (default ``"run i"``), e.g.
      ``"seed 0 (Spearman 0.83)"``.
    title: optional axes title.
    annotation: optional text drawn in a boxed corner of the axes (the corner
      with the fewest points).

  Returns:
    ``path``.

  Raises:
    ValueError: if ``x`` is empty, or ``y``/``labels`` do not hold one entry
      per run, or ``x[i]`` and ``y[i]`` differ in size.
  """
  return _save(
      importance_scatter_figure(x,
                                y,
                                xlabel=xlabel,
                                ylabel=ylabel,
                                labels=labels,
                                title=title,
                                annotation=annotation), path)


# --------------------------------------------------------------------------
# Inference speed.


def _fraction_label(fraction: float) -> str:
  return "unpruned" if fraction == 0.0 else f"{fraction:.0%} of heads removed"


def _check_speed_inputs(batch_sizes: np.ndarray, fractions: np.ndarray,
                        speed: np.ndarray, flop_ratio: np.ndarray | None,
                        speedup: np.ndarray | None,
                        speedup_ci: np.ndarray | None) -> None:
  """Raises ValueError on inputs :func:`speed_figure` cannot draw."""
  if batch_sizes.ndim != 1 or batch_sizes.size == 0:
    raise ValueError(
        f"batch_sizes must be a non-empty 1-D sequence, got shape "
        f"{batch_sizes.shape}.")
  if np.any(batch_sizes <= 0):
    raise ValueError(f"batch_sizes must be positive, got {batch_sizes}.")
  if fractions.ndim != 1 or fractions.size == 0:
    raise ValueError(
        f"fractions must be a non-empty 1-D sequence, got shape "
        f"{fractions.shape}.")
  if fractions[0] != 0.0:
    raise ValueError(
        f"fractions[0] must be 0.0 (the unpruned model, the reference of the "
        f"speed-up), got {fractions[0]}.")
  expected = (fractions.size, batch_sizes.size)
  if speed.shape != expected:
    raise ValueError(
        f"examples_per_sec must be [F, B] = [len(fractions), "
        f"len(batch_sizes)] = {list(expected)}, got shape {speed.shape}.")
  if np.any(speed[np.isfinite(speed)] <= 0.0):
    raise ValueError("examples_per_sec must be positive (or NaN if missing).")
  if flop_ratio is not None:
    if flop_ratio.shape != fractions.shape:
      raise ValueError(
          f"flop_ratio must hold one value per fraction ({fractions.size}), "
          f"got shape {flop_ratio.shape}.")
    if np.any(flop_ratio <= 0.0):
      raise ValueError(f"flop_ratio must be positive, got {flop_ratio}.")
  if speedup is not None and np.shape(speedup) != expected:
    raise ValueError(f"speedup must be [F, B] = {list(expected)}, got shape "
                     f"{np.shape(speedup)}.")
  if speedup_ci is not None and speedup_ci.shape != expected + (2,):
    raise ValueError(
        f"speedup_ci must be [F, B, 2] = {list(expected) + [2]}, got shape "
        f"{speedup_ci.shape}.")


def _throughput_panel(ax, batch_sizes: np.ndarray, fractions: np.ndarray,
                      speed: np.ndarray, colours: Sequence[str]) -> None:
  """Examples/s against batch size, log-log, a line per fraction."""
  for f, fraction in enumerate(fractions):
    ax.plot(batch_sizes,
            speed[f],
            color=colours[f],
            marker=_MARKERS[f % len(_MARKERS)],
            markersize=5,
            linewidth=1.8,
            label=_fraction_label(fraction))
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xticks(batch_sizes)
  ax.set_xticklabels([str(int(b)) for b in batch_sizes])
  ax.xaxis.set_minor_formatter("")
  ax.set_xlabel("batch size", fontsize=_LABEL_SIZE)
  ax.set_ylabel("examples / s", fontsize=_LABEL_SIZE)
  ax.set_title("throughput", fontsize=_LABEL_SIZE)
  ax.tick_params(labelsize=_TICK_SIZE)
  ax.grid(True, which="major", color="0.9", linewidth=0.8)
  ax.grid(True, which="minor", axis="y", color="0.95", linewidth=0.5)
  ax.set_axisbelow(True)


def _speedup_label_style(num_groups: int, pruned: int) -> dict[str, Any]:
  """Font size and rotation of the value labels, from the bars' width."""
  # The speed-up axis is ~5.4 in (~390 pt) wide; a "1.23x" label is ~3 em.
  bar_pt = 390.0 * 0.8 * 0.92 / (num_groups * max(pruned, 1))
  return dict(fontsize=float(np.clip(bar_pt / 3.6, 6.0, 8.0)),
              rotation=90 if bar_pt < 6.0 * 3.6 else 0, zorder=5,
              bbox=dict(boxstyle="square,pad=0.1", facecolor="white",
                        edgecolor="none", alpha=0.85))


def _speedup_whiskers(ax, offsets: np.ndarray, values: np.ndarray,
                      ci: np.ndarray, labels: Sequence[str],
                      label_style: Mapping[str, Any]) -> None:
  """The ``[B, 2]`` intervals as whiskers, each value above its whisker
  (below it for a slow-down)."""
  low, high = ci[:, 0], ci[:, 1]
  ax.errorbar(offsets, values, yerr=np.stack([values - low, high - values]),
              fmt="none", ecolor="0.2", elinewidth=1.0, capsize=2.0,
              zorder=4)
  for x, v, lo, hi, text in zip(offsets, values, low, high, labels):
    up = v >= 1.0
    ax.annotate(text, (x, max(hi, v) if up else min(lo, v)),
                xytext=(0, 1.5 if up else -1.5), textcoords="offset points",
                ha="center", va="bottom" if up else "top", **label_style)


def _speedup_bars(ax, speedup: np.ndarray, speedup_ci: np.ndarray | None,
                  flop_ratio: np.ndarray | None,
                  colours: Sequence[str]) -> None:
  """Grouped bars from 1x per batch size (``speedup`` ``[F - 1, B]``, the
  pruned models), labelled with their value, whiskers when ``speedup_ci``
  and a dashed line at 1 / FLOP ratio when ``flop_ratio``."""
  pruned, num_groups = speedup.shape
  groups = np.arange(num_groups)
  width = 0.8 / max(pruned, 1)
  label_style = _speedup_label_style(num_groups, pruned)
  for p in range(pruned):
    offsets = groups - 0.4 + width * (p + 0.5)
    # Bars start at 1x: their length is the gain (or, downwards, the loss).
    bars = ax.bar(offsets,
                  np.nan_to_num(speedup[p] - 1.0, nan=0.0),
                  bottom=1.0,
                  width=width * 0.92,
                  color=colours[p + 1],
                  zorder=3)
    labels = ["" if not np.isfinite(v) else f"{v:.2f}\u00d7"
              for v in speedup[p]]
    if speedup_ci is None:
      ax.bar_label(bars, labels=labels, padding=1.5, **label_style)
    else:
      _speedup_whiskers(ax, offsets, speedup[p], speedup_ci[p + 1], labels,
                        label_style)
    if flop_ratio is not None:
      ax.axhline(1.0 / flop_ratio[p + 1],
                 color=colours[p + 1],
                 linestyle="--",
                 linewidth=1.3,
                 zorder=4)


def _speedup_axis(ax, batch_sizes: np.ndarray, speedup: np.ndarray,
                  speedup_ci: np.ndarray | None,
                  flop_ratio: np.ndarray | None) -> None:
  """The 1x line, ticks, limits with room for the labels, titles."""
  ax.axhline(1.0, color="0.4", linewidth=1.0, zorder=4)
  ax.set_xticks(np.arange(batch_sizes.size))
  ax.set_xticklabels([str(int(b)) for b in batch_sizes])
  ax.set_xlim(-0.6, batch_sizes.size - 0.4)
  levels = np.array([1.0] + list(speedup[np.isfinite(speedup)]))
  if speedup_ci is not None:
    bounds = speedup_ci[1:]
    levels = np.concatenate([levels, bounds[np.isfinite(bounds)]])
  if flop_ratio is not None:
    levels = np.concatenate([levels, 1.0 / flop_ratio[1:]])
  span = max(levels.max() - levels.min(), 0.05)
  # Room above (and below, for slow-downs) for the value labels.
  ax.set_ylim(levels.min() - (0.22 if levels.min() < 1.0 else 0.08) * span,
              levels.max() + 0.15 * span)
  ax.set_xlabel("batch size", fontsize=_LABEL_SIZE)
  ax.set_ylabel("speed-up over unpruned (\u00d7)", fontsize=_LABEL_SIZE)
  ax.set_title("speed-up (bars: measured" +
               (", whiskers: 95% CI)" if speedup_ci is not None else ")"),
               fontsize=_LABEL_SIZE)
  ax.tick_params(labelsize=_TICK_SIZE)
  ax.grid(True, axis="y", color="0.9", linewidth=0.8)
  ax.set_axisbelow(True)


def _speed_legend(fig: Figure, fractions: np.ndarray, colours: Sequence[str],
                  with_flops: bool) -> None:
  """One legend for both panels: a fraction has the same colour in each."""
  handles = [
      Line2D([], [],
             color=colours[f],
             marker=_MARKERS[f % len(_MARKERS)],
             markersize=5,
             linewidth=1.8,
             label=_fraction_label(fraction))
      for f, fraction in enumerate(fractions)
  ]
  handles.append(Line2D([], [], color="0.4", linewidth=1.0,
                        label="1\u00d7 (no speed-up)"))
  if with_flops:
    handles.append(
        Line2D([], [],
               color="0.3",
               linestyle="--",
               linewidth=1.3,
               label="FLOP-predicted speed-up (1 / FLOP ratio),\n"
               "in the colour of its fraction"))
  fig.legend(handles=handles,
             loc="outside lower center",
             ncols=min(len(handles), 3),
             fontsize=8.5,
             frameon=False)


def speed_figure(
    batch_sizes: Sequence[int],
    fractions: Sequence[float],
    examples_per_sec: np.ndarray,
    *,
    flop_ratio: Sequence[float] | None = None,
    title: str | None = None,
    speedup: np.ndarray | None = None,
    speedup_ci: np.ndarray | None = None,
) -> Figure:
  """Builds (but does not save) the figure of :func:`plot_speed`.

  ``fig.axes`` is ``[throughput axis, speed-up axis]``.
  """
  batch_sizes = np.asarray(batch_sizes)
  fractions = np.asarray(fractions, dtype=np.float64)
  speed = np.asarray(examples_per_sec, dtype=np.float64)
  if flop_ratio is not None:
    flop_ratio = np.asarray(flop_ratio, dtype=np.float64)
  if speedup_ci is not None:
    speedup_ci = np.asarray(speedup_ci, dtype=np.float64)
  _check_speed_inputs(batch_sizes, fractions, speed, flop_ratio, speedup,
                      speedup_ci)
  colours = ["#000000"] + [
      OKABE_ITO[i % (len(OKABE_ITO) - 1)] for i in range(fractions.size - 1)
  ]
  fig = _new_figure(10.5, 4.4)
  left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.0, 1.15]})
  _throughput_panel(left, batch_sizes, fractions, speed, colours)
  # Right: speed-up over the unpruned model, grouped bars per batch size.
  if speedup is not None:
    speedup = np.asarray(speedup, np.float64)[1:]
  else:
    with np.errstate(invalid="ignore", divide="ignore"):
      speedup = speed[1:] / speed[:1]
  _speedup_bars(right, speedup, speedup_ci, flop_ratio, colours)
  _speedup_axis(right, batch_sizes, speedup, speedup_ci, flop_ratio)
  _speed_legend(fig, fractions, colours, flop_ratio is not None)
  if title:
    fig.suptitle(title, fontsize=11)
  return fig


def plot_speed(
    batch_sizes: Sequence[int],
    fractions: Sequence[float],
    examples_per_sec: np.ndarray,
    path: str,
    *,
    flop_ratio: Sequence[float] | None = None,
    title: str | None = None,
    speedup: np.ndarray | None = None,
    speedup_ci: np.ndarray | None = None,
) -> str:
  """Writes a PNG of the inference speed of pruned models.

  Left panel: examples/s vs batch size (log-log), one line per fraction of
  heads removed. Right panel: the speed-up over the unpruned model as grouped
  bars (one group per batch size, one bar per pruned fraction > 0, labelled
  with its value), a grey line at 1x and, when ``flop_ratio`` is given, a
  dashed line per pruned fraction at the FLOP-predicted speed-up
  ``1 / flop_ratio[f]``. NaN measurements are left out.

  Args:
    batch_sizes: ``[B]`` batch sizes measured.
    fractions: ``[F]`` fractions of heads removed; ``fractions[0]`` must be
      ``0.0`` (the unpruned model, the reference of the speed-up).
    examples_per_sec: ``[F, B]`` measured throughput.
    path: where to write the PNG (parent directories are created).
    flop_ratio: optional ``[F]`` FLOPs of each pruned model / FLOPs of the
      unpruned one.
    title: optional figure title.
    speedup: optional ``[F, B]`` speed-ups to draw (e.g. medians of paired
      per-round ratios); default: the ratio of ``examples_per_sec`` to the
      unpruned row.
    speedup_ci: optional ``[F, B, 2]`` interval (low, high) of each
      speed-up, drawn as whiskers on the bars.

  Returns:
    ``path``.

  Raises:
    ValueError: on empty or mis-shaped inputs, ``fractions[0] != 0``, or
      non-positive batch sizes, throughputs or FLOP ratios.
  """
  return _save(
      speed_figure(batch_sizes,
                   fractions,
                   examples_per_sec,
                   flop_ratio=flop_ratio,
                   title=title,
                   speedup=speedup,
                   speedup_ci=speedup_ci), path)


# --------------------------------------------------------------------------
# Retraining after pruning.

#: Marker and label of each arm of a retrained pruned model, in drawing
#: order (``scratch``: the old control, drawn only when the new ones are
#: missing, as in a ``results.json`` written before them).
_STAGES = {"before": ("o", "pruned, before fine-tuning"),
           "after": ("s", "fine-tuned, {steps} steps"),
           "scratch_e": ("X", "Scratch-E: architecture from scratch, "
                              "the run's steps"),
           "scratch_b": ("P", "Scratch-B: from scratch, the FLOPs of "
                              "run + fine-tuning"),
           "rewind": ("D", "rewind: kept heads' step-0 weights, "
                           "the run's steps"),
           "scratch": ("x", "same architecture from scratch, {steps} steps")}


def _drawn_stages(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
  present = set.union(*(set(r) for r in rows.values()))
  stages = [s for s in _STAGES if s in present]
  if "scratch_e" in stages and "scratch" in stages:
    stages.remove("scratch")
  return stages


def retraining_figure(fractions: Sequence[float],
                      rows: Mapping[str, Mapping[str, Sequence[Any]]], *,
                      steps: int, title: str | None = None) -> Figure:
  """Builds the figure of :func:`plot_retraining`."""
  if not rows or not len(fractions):
    raise ValueError("retraining_figure needs fractions and rows")
  stages = _drawn_stages(rows)
  offsets = dict(zip(stages, np.linspace(-0.3, 0.3, len(stages))
                     if len(stages) > 1 else [0.0]))
  fig = _new_figure(3.4 * len(fractions) + 3.4, 3.9)
  axes = fig.subplots(1, len(fractions), sharey=True, squeeze=False)[0]
  names = list(rows)
  styles = _ordering_styles(names)
  for f, (ax, fraction) in enumerate(zip(axes, fractions)):
    for x, name in enumerate(names):
      for stage in stages:
        if stage not in rows[name]:  # e.g. no controls of random subsets
          continue
        value, ci = rows[name][stage]
        v, (lo, hi) = float(value[f]), (float(c) for c in ci[f])
        ax.errorbar(x + offsets[stage], v, yerr=[[v - lo], [hi - v]],
                    fmt=_STAGES[stage][0], color=styles[name]["color"],
                    markersize=6, capsize=2,
                    markerfacecolor="white" if stage == "before" else
                    styles[name]["color"])
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right",
                  fontsize=_TICK_SIZE)
    ax.set_title(f"{fraction:.0%} of heads removed", fontsize=_LABEL_SIZE)
    ax.grid(True, axis="y", color="0.9")
    ax.set_axisbelow(True)
    ax.set_xlim(-0.6, len(names) - 0.4)
  axes[0].set_ylabel("test token accuracy", fontsize=_LABEL_SIZE)
  axes[0].set_ylim(-0.02, 1.02)
  handles = [Line2D([], [], marker=_STAGES[s][0], linestyle="", color="0.3",
                    markerfacecolor="white" if s == "before" else "0.3",
                    label=_STAGES[s][1].format(steps=steps))
             for s in stages]
  fig.legend(handles=handles, loc="outside right upper", fontsize=8.5,
             frameon=False, title="mean over seeds, 95% CI",
             title_fontsize=8.5)
  if title:
    fig.suptitle(title, fontsize=11)
  return fig


def plot_retraining(fractions: Sequence[float],
                    rows: Mapping[str, Mapping[str, Sequence[Any]]],
                    path: str, *, steps: int, title: str | None = None) -> str:
  """Writes a PNG of test accuracy before and after fine-tuning pruned
  models, and of their controls: the same architectures trained from
  scratch (Scratch-E, Scratch-B) and the kept heads rewound to step 0.

  Args:
    fractions: ``[F]`` fractions of heads removed (one panel each).
    rows: ordering -> ``{"before", "after", "scratch_e", "scratch_b",
      "rewind"}`` (or the old ``"scratch"`` instead of the last three) ->
      ``(values [F], intervals [F, 2])``.
    path: where to write the PNG.
    steps: the fine-tuning steps (for the legend).
    title: optional figure title.

  Returns:
    ``path``.
  """
  return _save(retraining_figure(fractions, rows, steps=steps, title=title),
               path)
