"""Tests for mha.pruning.study.plots: the figures of a head-pruning experiment."""

from __future__ import annotations

import matplotlib.image as mimage
import numpy as np
import pytest

from mha.pruning.study import plots as pp

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path, returned, min_width: int = 200,
                min_height: int = 150) -> np.ndarray:
  """``path`` was written, returned as a string, and decodes to a real image."""
  assert returned == str(path)
  data = path.read_bytes()
  assert len(data) > 1000
  assert data[:8] == PNG_MAGIC
  image = mimage.imread(str(path))
  height, width = image.shape[:2]
  assert min_width <= width <= 5000
  assert min_height <= height <= 5000
  # Not a blank canvas.
  assert np.ptp(image[..., :3]) > 0.5
  return image


def _curve(rng: np.random.Generator, fractions: np.ndarray, runs: int,
           knee: float) -> np.ndarray:
  clean = 1.0 - 0.9 / (1.0 + np.exp(-(fractions - knee) / 0.07))
  return np.clip(clean + 0.01 * rng.normal(size=(runs, fractions.size)), 0, 1)


def _legend_texts(fig) -> list[str]:
  return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


# --------------------------------------------------------------------------
# Pruning curves.


def test_pruning_curves_png_with_bands_baseline_and_nan(tmp_path):
  rng = np.random.default_rng(0)
  fractions = np.linspace(0.0, 1.0, 9)
  curves = {
      "gradient": _curve(rng, fractions, 3, 0.65),
      "leave-one-out": _curve(rng, fractions, 3, 0.6),
      "random": _curve(rng, fractions, 60, 0.45),
      "reverse gradient": _curve(rng, fractions, 3, 0.2),
  }
  curves["gradient"][1, 4] = np.nan  # a missing measurement is skipped
  path = tmp_path / "sub" / "dir" / "curves.png"  # parents are created
  returned = pp.plot_pruning_curves(fractions,
                                    curves,
                                    str(path),
                                    baseline=0.99,
                                    title="copy task")
  _assert_png(path, returned)


def test_pruning_curves_legend_names_runs_and_band():
  rng = np.random.default_rng(1)
  fractions = np.linspace(0.0, 1.0, 5)
  curves = {
      "gradient": _curve(rng, fractions, 3, 0.6),
      "random": _curve(rng, fractions, 60, 0.4),
      "entropy": _curve(rng, fractions, 1, 0.5)[0],  # [P]: a single run
  }
  fig = pp.pruning_curves_figure(fractions, curves, baseline=0.98)
  texts = _legend_texts(fig)
  assert texts[:3] == [
      "gradient (3 runs, band min\u2013max)",
      "random (60 runs, band 10\u201390th pct)",
      "entropy (1 run)",
  ]
  assert "unpruned \u2212 1 pt" in texts
  ax = fig.axes[0]
  assert ax.get_xlabel() == "fraction of heads removed"
  assert ax.get_ylabel() == "token accuracy"
  low, high = ax.get_ylim()
  assert -0.1 < low < 0.0 and 1.0 < high < 1.1
  # The mean lines are drawn with markers; NaN-free here, so all finite.
  lines = [line for line in ax.get_lines() if line.get_marker() != "None"]
  assert len(lines) == 3
  baseline = [line for line in ax.get_lines() if line not in lines]
  assert np.allclose(baseline[0].get_ydata(), 0.97)


def test_pruning_curves_single_run_all_nan_point(tmp_path):
  fractions = np.array([0.0, 0.5, 1.0])
  path = tmp_path / "single.png"
  returned = pp.plot_pruning_curves(
      fractions, {"gradient": np.array([1.0, np.nan, 0.1])}, path)
  _assert_png(path, returned)


def test_pruning_curves_errors(tmp_path):
  fractions = np.linspace(0.0, 1.0, 4)
  with pytest.raises(ValueError, match="curves is empty"):
    pp.plot_pruning_curves(fractions, {}, tmp_path / "x.png")
  with pytest.raises(ValueError, match=r"curves\['gradient'\]"):
    pp.plot_pruning_curves(fractions, {"gradient": np.ones((2, 5))},
                           tmp_path / "x.png")
  with pytest.raises(ValueError, match="fractions"):
    pp.plot_pruning_curves(np.ones((2, 2)), {"gradient": np.ones(2)},
                           tmp_path / "x.png")
  assert not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------
# Importance heatmaps.


@pytest.mark.slow  # over 2 s on 2 cores: the full suite only
def test_importance_heatmaps_grid_png(tmp_path):
  rng = np.random.default_rng(2)
  measures = {
      name: rng.gamma(1.0, 0.02, size=(2, 4))
      for name in ("gradient", "leave-one-out", "entropy", "confidence")
  }
  measures["leave-one-out"][0, 0] = -0.01  # mixed signs: diverging scale
  path = tmp_path / "heat.png"
  returned = pp.plot_importance_heatmaps(measures,
                                         path,
                                         title="importance",
                                         head_counts=[4, 3])
  _assert_png(path, returned, min_width=600)

  fig = pp.importance_heatmaps_figure(measures)
  panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
  colourbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
  assert len(panels) == 6  # 2 rows of 3; the last 2 blank
  assert len(colourbars) == 4  # one per measure
  assert [ax.get_title() for ax in panels[:4]] == list(measures)
  assert all(not ax.axison for ax in panels[4:])
  first = panels[0]
  assert first.get_xlabel() == "head" and first.get_ylabel() == "layer"
  assert list(first.get_xticks()) == [0, 1, 2, 3]
  assert list(first.get_yticks()) == [0, 1]
  assert len(first.texts) == 8
  assert first.texts[0].get_text() == format(measures["gradient"][0, 0],
                                             ".3g")
  # Own colour scale per panel.
  assert panels[0].images[0].get_clim() != panels[2].images[0].get_clim()
  low, high = panels[1].images[0].get_clim()
  assert low == -high  # symmetric around 0 for mixed signs


def test_importance_heatmaps_nan_cells_are_hatched_not_annotated():
  rng = np.random.default_rng(3)
  gradient = rng.random((2, 4))
  entropy = rng.random((2, 4))
  entropy[0, 1] = np.nan
  measures = {"gradient": gradient, "entropy": entropy}
  fig = pp.importance_heatmaps_figure(measures, head_counts=[4, 2])
  panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
  # Layer 1 has heads 0, 1 only: 2 absent cells; entropy also misses (0, 1).
  assert len(panels[0].texts) == 6
  assert len(panels[1].texts) == 5
  assert len(panels[0].patches) == 2
  assert all(p.get_hatch() for p in panels[1].patches)
  assert np.isfinite(gradient).all()  # the caller's array is untouched


def test_importance_heatmaps_single_head_and_12x12(tmp_path):
  path = tmp_path / "one.png"
  _assert_png(path,
              pp.plot_importance_heatmaps({"gradient": np.array([[0.5]])},
                                          path),
              min_width=100,
              min_height=100)
  # A flat measure still gets a proper (non-degenerate) colour scale.
  fig = pp.importance_heatmaps_figure({"gradient": np.zeros((1, 3))})
  low, high = fig.axes[0].images[0].get_clim()
  assert low < 0.0 < high
  rng = np.random.default_rng(4)
  path = tmp_path / "big.png"
  image = _assert_png(
      path,
      pp.plot_importance_heatmaps({"gradient": rng.random((12, 12)) * 1e-3},
                                  path))
  assert image.shape[0] > 600 and image.shape[1] > 600  # cells stay legible


def test_importance_heatmaps_errors(tmp_path):
  with pytest.raises(ValueError, match="measures is empty"):
    pp.plot_importance_heatmaps({}, tmp_path / "x.png")
  with pytest.raises(ValueError, match=r"measures\['b'\]"):
    pp.plot_importance_heatmaps({"a": np.ones((2, 4)), "b": np.ones((2, 3))},
                                tmp_path / "x.png")
  with pytest.raises(ValueError, match=r"measures\['a'\]"):
    pp.plot_importance_heatmaps({"a": np.ones(4)}, tmp_path / "x.png")
  with pytest.raises(ValueError, match="head_counts"):
    pp.plot_importance_heatmaps({"a": np.ones((2, 4))},
                                tmp_path / "x.png",
                                head_counts=[4])
  with pytest.raises(ValueError, match="head_counts"):
    pp.plot_importance_heatmaps({"a": np.ones((2, 4))},
                                tmp_path / "x.png",
                                head_counts=[4, 5])


# --------------------------------------------------------------------------
# Importance scatter.


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"),
                                           (".pdf", b"%PDF")])
def test_figures_in_vector_formats_by_suffix(tmp_path, suffix, magic):
  measures = {"gradient": np.arange(8.0).reshape(2, 4)}
  path = pp.plot_importance_heatmaps(measures, tmp_path / f"imp{suffix}")
  with open(path, "rb") as f:
    assert f.read().startswith(magic)
  with pytest.raises(ValueError, match=r"imp\.jpg"):
    pp.plot_importance_heatmaps(measures, tmp_path / "imp.jpg")


def test_importance_scatter_png(tmp_path):
  rng = np.random.default_rng(5)
  x = [rng.gamma(1.0, 0.02, size=(2, 4)) for _ in range(3)]
  y = [3.0 * xi + rng.normal(0.0, 0.01, xi.shape) for xi in x]  # some < 0
  y[0][0, 0] = np.nan  # skipped
  labels = [f"seed {i} (Spearman 0.8{i})" for i in range(3)]
  path = tmp_path / "scatter.png"
  returned = pp.plot_importance_scatter(
      x,
      y,
      path,
      xlabel="gradient importance",
      ylabel="leave-one-out loss increase",
      labels=labels,
      title="gradient vs leave-one-out",
      annotation="pooled Spearman 0.84",
  )
  _assert_png(path, returned)

  fig = pp.importance_scatter_figure(x,
                                     y,
                                     xlabel="gx",
                                     ylabel="gy",
                                     labels=labels,
                                     annotation="note")
  ax = fig.axes[0]
  assert ax.get_xscale() == "linear" and ax.get_yscale() == "linear"
  assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
  assert len(ax.collections) == 3
  assert len(ax.collections[0].get_offsets()) == 7  # the NaN pair dropped
  assert "note" in [t.get_text() for t in ax.texts]


def test_importance_scatter_errors(tmp_path):
  with pytest.raises(ValueError, match="x is empty"):
    pp.plot_importance_scatter([], [], tmp_path / "x.png", xlabel="a",
                               ylabel="b")
  with pytest.raises(ValueError, match="y must"):
    pp.plot_importance_scatter([np.ones(3)], [np.ones(3)] * 2,
                               tmp_path / "x.png",
                               xlabel="a",
                               ylabel="b")
  with pytest.raises(ValueError, match=r"x\[0\] and y\[0\]"):
    pp.plot_importance_scatter([np.ones(3)], [np.ones(4)],
                               tmp_path / "x.png",
                               xlabel="a",
                               ylabel="b")
  with pytest.raises(ValueError, match="labels"):
    pp.plot_importance_scatter([np.ones(3)], [np.ones(3)],
                               tmp_path / "x.png",
                               xlabel="a",
                               ylabel="b",
                               labels=["a", "b"])


# --------------------------------------------------------------------------
# Speed.


def _throughput() -> tuple[list[int], list[float], np.ndarray]:
  batch_sizes = [1, 16, 64, 256]
  fractions = [0.0, 0.25, 0.5, 0.75]
  base = np.array([900.0, 12000.0, 38000.0, 90000.0])
  gains = np.array([[1.0] * 4, [0.98, 1.08, 1.15, 1.2],
                    [1.03, 1.15, 1.3, 1.42], [1.05, 1.2, 1.45, 1.7]])
  return batch_sizes, fractions, base * gains


@pytest.mark.slow  # over 2 s on 2 cores: the full suite only
def test_speed_png_with_flop_ratio(tmp_path):
  batch_sizes, fractions, speed = _throughput()
  path = tmp_path / "speed.png"
  returned = pp.plot_speed(batch_sizes,
                           fractions,
                           speed,
                           path,
                           flop_ratio=[1.0, 0.85, 0.7, 0.55],
                           title="inference")
  _assert_png(path, returned, min_width=600)

  fig = pp.speed_figure(batch_sizes,
                        fractions,
                        speed,
                        flop_ratio=[1.0, 0.85, 0.7, 0.55])
  left, right = fig.axes
  assert left.get_xscale() == "log" and left.get_yscale() == "log"
  assert len(left.get_lines()) == 4  # one per fraction
  assert len(right.patches) == 3 * 4  # pruned fractions x batch sizes
  levels = sorted(
      round(float(line.get_ydata()[0]), 4) for line in right.get_lines())
  assert levels == [1.0, round(1 / 0.85, 4), round(1 / 0.7, 4),
                    round(1 / 0.55, 4)]
  # A bar spans 1x .. the measured speed-up (here a slow-down: 0.98).
  bar = right.patches[0]
  assert bar.get_y() == pytest.approx(1.0)
  assert bar.get_y() + bar.get_height() == pytest.approx(0.98)


def test_speed_without_flop_ratio_and_nan():
  batch_sizes, fractions, speed = _throughput()
  speed[2, 1] = np.nan  # 50% pruned, batch 16: not measured
  fig = pp.speed_figure(batch_sizes, fractions, speed)
  left, right = fig.axes
  assert [round(float(line.get_ydata()[0]), 4) for line in right.get_lines()
         ] == [1.0]  # only the 1x line
  missing = right.patches[4 + 1]  # second pruned fraction, second batch size
  assert missing.get_height() == 0.0
  labels = [t.get_text() for t in right.texts]
  assert labels.count("") == 1 and "1.42\u00d7" in labels
  assert np.isnan(left.get_lines()[2].get_ydata()[1])


def test_speed_errors(tmp_path):
  batch_sizes, fractions, speed = _throughput()
  with pytest.raises(ValueError, match="examples_per_sec"):
    pp.plot_speed(batch_sizes, fractions, speed[:, :3], tmp_path / "x.png")
  with pytest.raises(ValueError, match=r"fractions\[0\]"):
    pp.plot_speed(batch_sizes, [0.1, 0.25, 0.5, 0.75], speed,
                  tmp_path / "x.png")
  with pytest.raises(ValueError, match="flop_ratio"):
    pp.plot_speed(batch_sizes,
                  fractions,
                  speed,
                  tmp_path / "x.png",
                  flop_ratio=[1.0, 0.5])
  with pytest.raises(ValueError, match="batch_sizes"):
    pp.plot_speed([], [0.0], np.ones((1, 0)), tmp_path / "x.png")


def test_pruning_curves_with_intervals_draw_only_those_bands(tmp_path):
  fractions = np.linspace(0.0, 1.0, 5)
  curves = {"gradient": 1 - fractions, "oracle (best subset)":
            1 - fractions ** 2, "random": 1 - fractions ** 0.5}
  intervals = {"oracle (best subset)": (curves["oracle (best subset)"] - 0.05,
                                        curves["oracle (best subset)"] + 0.05)}
  fig = pp.pruning_curves_figure(fractions, curves, intervals=intervals)
  (ax,) = fig.axes
  bands = [c for c in ax.collections if c.get_paths()]
  assert len(bands) == 1  # only the oracle's interval
  band = bands[0].get_paths()[0].vertices
  np.testing.assert_allclose(band[:, 1].max(), 1.05)
  texts = _legend_texts(fig)
  assert "oracle (best subset) (band: 95% CI)" in texts
  assert "gradient" in texts  # no run count, no band
  path = tmp_path / "ci.png"
  _assert_png(path, pp.plot_pruning_curves(fractions, curves, str(path),
                                           intervals=intervals))


def test_speed_with_given_speedups_and_intervals(tmp_path):
  rates = np.array([[100.0, 200.0], [120.0, 260.0]])
  speedup = np.array([[1.0, 1.0], [1.25, 1.2]])  # not rates[1] / rates[0]
  ci = np.stack([speedup - 0.05, speedup + 0.1], axis=-1)
  fig = pp.speed_figure([1, 16], [0.0, 0.5], rates, speedup=speedup,
                        speedup_ci=ci)
  right = fig.axes[1]
  heights = [1.0 + bar.get_height() for bar in right.patches]
  np.testing.assert_allclose(heights, [1.25, 1.2])
  texts = [t.get_text() for t in right.texts]
  assert texts == ["1.25\u00d7", "1.20\u00d7"]
  assert right.get_ylim()[1] > 1.3  # room for the upper whiskers
  with pytest.raises(ValueError, match=r"speedup_ci must be \[F, B, 2\]"):
    pp.speed_figure([1, 16], [0.0, 0.5], rates, speedup_ci=ci[:, :1])
  path = tmp_path / "speed.png"
  _assert_png(path, pp.plot_speed([1, 16], [0.0, 0.5], rates, str(path),
                                  speedup=speedup, speedup_ci=ci))


def test_pruning_curve_panels_png_with_references_in_every_panel(tmp_path):
  rng = np.random.default_rng(0)
  fractions = np.linspace(0.0, 1.0, 7)
  panels = {"gradient": {"gradient": _curve(rng, fractions, 1, 0.6),
                         "reverse gradient": _curve(rng, fractions, 1, 0.2)},
            "heuristics": {"entropy": _curve(rng, fractions, 1, 0.3)}}
  references = {"oracle (best subset)": _curve(rng, fractions, 1, 0.7)[0],
                "random": _curve(rng, fractions, 20, 0.4)}
  fig = pp.pruning_curve_panels_figure(fractions, panels, references,
                                       baseline=0.99)
  visible = [ax for ax in fig.axes if ax.axison]
  assert [ax.get_title() for ax in visible] == ["gradient", "heuristics"]
  # The references beneath each panel's own curves; listed once, below
  # (no empty cell in one row of two).
  assert [len(ax.get_lines()) for ax in visible] == [2 + 2 + 1, 2 + 1 + 1]
  assert _legend_texts(fig) == ["oracle (best subset)", "random",
                                "unpruned \u2212 1 pt"]
  # Four panels: two rows of three, the references in the first empty cell.
  fig = pp.pruning_curve_panels_figure(
      fractions, dict(panels, a=panels["heuristics"], b=panels["gradient"]),
      references)
  spare = [ax for ax in fig.axes if not ax.axison]
  assert len(spare) == 2 and not fig.legends
  assert [t.get_text() for t in spare[0].get_legend().get_texts()] == [
      "oracle (best subset)", "random"]
  path = tmp_path / "panels.png"
  _assert_png(path, pp.plot_pruning_curve_panels(fractions, panels,
                                                 references, str(path)))
  with pytest.raises(ValueError, match="panels is empty"):
    pp.pruning_curve_panels_figure(fractions, {}, references)


def test_curves_in_a_narrow_band_zoom_the_axis_and_streaming_adds_kv():
  """A language model's curves (every value within 0.06) get an axis that
  spans them, not 0 to 1; a streaming study's figure gains the KV-memory
  axis on top, linear in the fraction."""
  fractions = np.linspace(0.0, 1.0, 5)
  curves = {"gradient": np.array([0.63, 0.63, 0.62, 0.61, 0.60]),
            "random": np.array([0.63, 0.62, 0.61, 0.60, 0.59])}
  fig = pp.pruning_curves_figure(fractions, curves, baseline=0.63,
                                 kv_axis=(1.0, 0.2))
  ax = fig.axes[0]
  low, high = ax.get_ylim()
  assert 0.58 < low < 0.59 and 0.63 < high < 0.64
  (top,) = ax.child_axes
  assert top.get_xlabel() == "KV memory kept (share of the full cache)"


def test_panels_in_a_narrow_band_zoom_the_axis_and_name_it():
  """The small multiples span their curves too (a KV-cache study's stay
  within a few points), and every panel names its x-axis as told."""
  fractions = np.linspace(0.0, 1.0, 5)
  panels = {"gradient": {"gradient": np.array([0.63, 0.63, 0.62, 0.61,
                                               0.60])}}
  references = {"random": np.array([0.63, 0.62, 0.61, 0.60, 0.59])}
  fig = pp.pruning_curve_panels_figure(
      fractions, panels, references, baseline=0.63,
      xlabel="fraction of heads given a streaming cache")
  (ax,) = [ax for ax in fig.axes if ax.axison]
  low, high = ax.get_ylim()
  assert 0.58 < low < 0.59 and 0.63 < high < 0.64
  assert ax.get_xlabel() == "fraction of heads given a streaming cache"
