"""Tests for mha.plotting: attention heatmap grids (layers x heads)."""

from __future__ import annotations

import gc
import weakref

import matplotlib.colors as mcolors
import numpy as np
import pytest

from mha.plotting import attention_grid_figure, plot_attention, valid_length

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _weights(rng: np.random.Generator, heads: int, length: int,
             n: int) -> np.ndarray:
  """Softmax-like [heads, L, L] weights with zero mass on padded keys."""
  logits = rng.normal(size=(heads, length, length))
  logits[..., n:] = -np.inf
  w = np.exp(logits - logits.max(-1, keepdims=True))
  return w / w.sum(-1, keepdims=True)


def _tokens(rng: np.random.Generator, length: int, n: int) -> np.ndarray:
  tokens = np.zeros(length, dtype=np.int32)
  tokens[:n] = rng.integers(1, 10, size=n)
  return tokens


def _assert_png(path) -> None:
  data = path.read_bytes()
  assert len(data) > 1000
  assert data[:8] == PNG_MAGIC


def _cells(fig):
  """Grid cells (everything but the colourbar axis)."""
  return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def test_valid_length():
  assert valid_length(np.array([3, 1, 2, 0, 0])) == 3
  assert valid_length(np.array([3, 1, 2])) == 3
  assert valid_length(np.array([3, 0, 2, 0
                               ])) == 1  # only the leading run counts
  assert valid_length(np.array([0, 0])) == 0


@pytest.mark.slow  # over 2 s on 2 cores: the full suite only
def test_writes_png_2x4_with_trailing_padding(tmp_path):
  rng = np.random.default_rng(0)
  tokens = _tokens(rng, 16, 12)
  attention = [_weights(rng, 4, 16, 12) for _ in range(2)]
  path = tmp_path / "sub" / "attn.png"  # parent directory is created
  assert plot_attention(tokens, attention, path, title="example") is None
  _assert_png(path)


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"),
                                           (".pdf", b"%PDF")])
def test_vector_formats_by_suffix_and_other_suffixes_refused(tmp_path, suffix,
                                                             magic):
  rng = np.random.default_rng(0)
  tokens = _tokens(rng, 6, 4)
  attention = [_weights(rng, 2, 6, 4)]
  path = tmp_path / f"attn{suffix}"
  plot_attention(tokens, attention, path)
  assert path.read_bytes().startswith(magic)
  with pytest.raises(ValueError, match=r"attn\.gif.*\.png, \.svg, \.pdf"):
    plot_attention(tokens, attention, tmp_path / "attn.gif")
  assert not (tmp_path / "attn.gif").exists()


def test_grid_layout_titles_labels_and_single_colourbar():
  rng = np.random.default_rng(1)
  tokens = _tokens(rng, 10, 7)
  attention = [_weights(rng, 4, 10, 7) for _ in range(2)]
  fig = attention_grid_figure(tokens, attention, title="my title")
  cells = _cells(fig)
  assert len(cells) == 2 * 4
  assert len(fig.axes) == 2 * 4 + 1  # exactly one colourbar
  for i, ax in enumerate(cells):
    layer, head = divmod(i, 4)
    assert ax.get_title() == f"layer {layer}, head {head}"
    assert ax.get_xlabel() == "key"
    assert len(ax.images) == 1
    clim = ax.images[0].get_clim()
    assert clim == (0.0, 1.0)  # shared scale
  assert cells[0].get_ylabel() == "query"
  assert fig._suptitle is not None and fig._suptitle.get_text() == "my title"
  # ~2.2 inches per cell: 4 columns (+ colourbar) by 2 rows.
  w, h = fig.get_size_inches()
  assert 4 * 2.0 <= w <= 4 * 2.6 + 1.5
  assert 2 * 2.0 <= h <= 2 * 2.6 + 1.0


def test_per_layer_head_counts_with_pruned_layer(tmp_path):
  rng = np.random.default_rng(2)
  length, n = 9, 6
  tokens = _tokens(rng, length, n)
  attention = [
      _weights(rng, 2, length, n),
      np.zeros((0, length, length)),
      _weights(rng, 3, length, n),
  ]
  path = tmp_path / "pruned.png"
  plot_attention(tokens, attention, path)
  _assert_png(path)

  fig = attention_grid_figure(tokens, attention)
  cells = np.array(_cells(fig)).reshape(3, 3)
  drawn = [[len(ax.images) for ax in row] for row in cells]
  assert drawn == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
  for row, heads in zip(cells, (2, 0, 3)):
    for head, ax in enumerate(row):
      if head >= heads:
        assert not ax.axison
        assert any("pruned" in t.get_text() for t in ax.texts)


def test_all_layers_without_heads_still_renders(tmp_path):
  tokens = np.array([1, 2, 3, 0])
  path = tmp_path / "empty.png"
  plot_attention(tokens, [np.zeros((0, 4, 4))], path)
  _assert_png(path)


def test_targets_and_predictions_label_mismatches(tmp_path):
  rng = np.random.default_rng(3)
  length, n = 8, 5
  tokens = _tokens(rng, length, n)
  targets = np.zeros_like(tokens)
  targets[:n] = tokens[:n][::-1]
  predictions = targets.copy()
  predictions[2] = targets[2] % 9 + 1  # one mistake
  predictions[n:] = 7  # garbage on padding must be ignored
  attention = [_weights(rng, 2, length, n) for _ in range(2)]

  path = tmp_path / "pred.png"
  plot_attention(
      tokens,
      attention,
      path,
      targets=targets,
      predictions=predictions,
  )
  _assert_png(path)

  fig = attention_grid_figure(
      tokens,
      attention,
      targets=targets,
      predictions=predictions,
  )
  ax = _cells(fig)[0]
  labels = ax.get_yticklabels()
  assert [lab.get_text() for lab in labels
         ] == [f"{x}\u2192{t}" for x, t in zip(tokens[:n], targets[:n])]
  assert [lab.get_text() for lab in ax.get_xticklabels()
         ] == [f"{x}" for x in tokens[:n]]
  red = mcolors.to_rgba("tab:red")
  colours = [mcolors.to_rgba(lab.get_color()) for lab in labels]
  assert [c == red for c in colours] == [i == 2 for i in range(n)]


def test_padding_is_cropped():
  rng = np.random.default_rng(4)
  length, n = 8, 5
  tokens = _tokens(rng, length, n)
  attention = [rng.uniform(size=(3, length, length)) for _ in range(2)]
  fig = attention_grid_figure(tokens, attention)
  cells = _cells(fig)
  assert len(cells) == 2 * 3
  for i, ax in enumerate(cells):
    layer, head = divmod(i, 3)
    arr = np.asarray(ax.images[0].get_array())
    assert arr.shape == (5, 5)
    np.testing.assert_allclose(arr, attention[layer][head, :n, :n])
    assert len(ax.get_xticks()) == n and len(ax.get_yticks()) == n


def test_stacked_array_is_accepted():
  rng = np.random.default_rng(5)
  tokens = _tokens(rng, 6, 6)
  stacked = np.stack([_weights(rng, 2, 6, 6) for _ in range(3)
                     ])  # [layers, H, L, L]
  fig = attention_grid_figure(tokens, stacked)
  assert len(_cells(fig)) == 3 * 2


def test_shape_mismatch_raises():
  tokens = np.array([1, 2, 3, 0, 0])
  good = np.full((2, 5, 5), 0.2)
  with pytest.raises(ValueError, match=r"attention\[1\].*len\(tokens\) = 5"):
    attention_grid_figure(tokens, [good, np.full((2, 4, 4), 0.25)])
  with pytest.raises(ValueError, match=r"attention\[0\].*len\(tokens\) = 5"):
    plot_attention(tokens, [np.full((2, 5, 4), 0.25)], "/nonexistent/never.png")
  with pytest.raises(ValueError, match=r"\[heads, L, L\]"):
    attention_grid_figure(tokens, [np.full((5, 5), 0.2)])
  with pytest.raises(ValueError, match="targets"):
    attention_grid_figure(tokens, [good], targets=np.array([1, 2, 3]))
  with pytest.raises(ValueError, match="pass targets"):
    attention_grid_figure(tokens, [good], predictions=tokens)
  with pytest.raises(ValueError, match="at least one layer"):
    attention_grid_figure(tokens, [])
  with pytest.raises(ValueError, match="padding"):
    attention_grid_figure(np.array([0, 1, 2]), [np.zeros((1, 3, 3))])


@pytest.mark.slow
def test_no_figure_leaks_in_a_loop(tmp_path):
  import matplotlib.pyplot as plt

  rng = np.random.default_rng(6)
  tokens = _tokens(rng, 6, 4)
  attention = [_weights(rng, 2, 6, 4)]
  before = list(plt.get_fignums())
  for i in range(5):
    plot_attention(tokens, attention, tmp_path / f"{i}.png")
  assert plt.get_fignums() == before  # never registered with pyplot

  fig = attention_grid_figure(tokens, attention)
  ref = weakref.ref(fig)
  del fig
  gc.collect()
  assert ref() is None  # plain Figure, freed like any object


def _causal(rng: np.random.Generator, heads: int, n: int) -> np.ndarray:
  """Causal softmax-like [heads, n, n] weights: nothing above the diagonal."""
  logits = rng.normal(size=(heads, n, n))
  logits[:, np.triu(np.ones((n, n), bool), 1)] = -np.inf
  w = np.exp(logits - logits.max(-1, keepdims=True))
  return w / w.sum(-1, keepdims=True)


@pytest.mark.slow
def test_a_window_of_a_long_causal_sequence(tmp_path):
  """256 tokens: 32 query rows against the 256 keys they can see, the
  positions on both axes, masked keys masked (grey), a readable size."""
  rng = np.random.default_rng(0)
  n = 256
  tokens = rng.integers(1, 10, size=n).astype(np.int32)
  targets = np.roll(tokens, -1)
  attention = [_causal(rng, 2, n) for _ in range(2)]
  names = [""] + [f"t{i}" for i in range(1, 10)]
  fig = attention_grid_figure(tokens, attention, targets=targets,
                              predictions=targets, token_names=names,
                              queries=(224, 256), causal=True)
  cells = _cells(fig)
  assert len(cells) == 4
  array = cells[0].get_images()[0].get_array()
  assert array.shape == (32, 256)
  np.testing.assert_allclose(array.data, attention[0][0, 224:256])
  # Key 250 is masked for query 224 and not for query 255.
  assert array.mask[0, 250] and not array.mask[31, 250]
  labels = [t.get_text() for t in cells[0].get_yticklabels()]
  assert labels[0] == "224 t%d\u2192t%d" % (tokens[224], targets[224])
  assert len(labels) == 32
  keys = [t.get_text() for t in cells[0].get_xticklabels()]
  assert keys[0] == "0" and 8 <= len(keys) <= 32  # Every few positions.
  assert cells[0].get_xlabel() == "key position (0\u2013255 of 256)"
  width, height = fig.get_size_inches()
  assert width < 24 and height < 16
  # Given keys: only those columns; a window out of range is refused.
  fig = attention_grid_figure(tokens, attention, queries=(100, 110),
                              keys=(90, 110))
  assert _cells(fig)[0].get_images()[0].get_array().shape == (10, 20)
  with pytest.raises(ValueError, match="queries must be a window"):
    attention_grid_figure(tokens, attention, queries=(250, 300))
  path = tmp_path / "window.png"
  plot_attention(tokens, attention, path, queries=(0, 32), causal=True)
  _assert_png(path)


def test_causal_mask_on_a_whole_short_matrix():
  rng = np.random.default_rng(0)
  tokens = _tokens(rng, 8, 8)
  fig = attention_grid_figure(tokens, [_causal(rng, 2, 8)], causal=True)
  array = _cells(fig)[0].get_images()[0].get_array()
  assert array.shape == (8, 8) and array.mask[0, 7] and not array.mask[7, 0]
