"""Attention-weight heatmaps: one example, a grid of layers x heads.

This is the d2l exercise "visualize attention weights of multiple heads".
For one input sequence, :func:`plot_attention` draws a grid with one row per
layer and one column per head; each cell is the ``[query, key]`` attention
matrix of that head, cropped to the valid (non-padding) part of the sequence,
with the input tokens labelling both axes. All cells share one colour scale
``0..1`` and a single colourbar.

Only the object-oriented matplotlib API is used (``Figure`` + ``FigureCanvasAgg``),
so nothing touches ``pyplot``'s global state, no GUI backend is needed and no
figure is left open when the function is called in a loop.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from mha.run import figures

__all__ = ["valid_length", "attention_grid_figure", "plot_attention",
           "key_stride"]

#: Colour map of the heatmaps (weights in ``[0, 1]``).
CMAP = "viridis"
#: Resolution of the written PNG.
DPI = 110
#: Side of one heatmap cell, in inches, for sequences up to ``_CELL_BASE_LEN``.
CELL_INCHES = 2.2
_CELL_BASE_LEN = 16
#: Colour of a query label whose prediction differs from its target.
MISMATCH_COLOR = "tab:red"


def valid_length(tokens: np.ndarray) -> int:
  """Number of leading non-zero tokens (``0`` is padding).

    Args:
      tokens: ``[L]`` integer sequence.

    Returns:
      The index of the first ``0``, or ``L`` when there is none.
    """
  tokens = np.asarray(tokens)
  pad = np.flatnonzero(tokens == 0)
  return int(pad[0]) if pad.size else int(tokens.shape[0])


def _check_inputs(
    tokens: np.ndarray,
    attention: Sequence[np.ndarray],
    targets: np.ndarray | None,
    predictions: np.ndarray | None,
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray | None, np.ndarray | None]:
  """Converts to numpy and validates shapes; raises ``ValueError`` on misuse."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(
        f"tokens must be a 1-D [L] array, got shape {tokens.shape}.")
  length = tokens.shape[0]
  if isinstance(attention, np.ndarray) and attention.ndim == 4:
    attention = list(attention)  # a stacked [layers, H, L, L] array is fine too
  attention = [np.asarray(a, dtype=np.float64) for a in attention]
  if not attention:
    raise ValueError("attention must hold at least one layer.")
  for layer, a in enumerate(attention):
    if a.ndim != 3:
      raise ValueError(
          f"attention[{layer}] must be [heads, L, L], got shape {a.shape}.")
    if a.shape[1:] != (length, length):
      raise ValueError(
          f"attention[{layer}] has shape {a.shape}; its last two dims must "
          f"both equal len(tokens) = {length} (query rows, key columns).")
  out = []
  for name, arr in (("targets", targets), ("predictions", predictions)):
    if arr is not None:
      arr = np.asarray(arr)
      if arr.shape != tokens.shape:
        raise ValueError(
            f"{name} must have the same shape as tokens {tokens.shape}, "
            f"got {arr.shape}.")
    out.append(arr)
  targets, predictions = out
  if predictions is not None and targets is None:
    raise ValueError(
        "predictions are only shown next to targets; pass targets too.")
  if valid_length(tokens) == 0:
    raise ValueError(
        "tokens has no valid (non-padding) prefix: tokens[0] == 0.")
  return tokens, attention, targets, predictions


def _tick_fontsize(n: int, cell: float) -> float:
  """Tick-label size (points) so that ``n`` labels fit along ``cell`` inches."""
  # The heatmap spans roughly 85% of the cell; give each label ~90% of its slot.
  slot_pt = 0.85 * cell * 72.0 / n
  return float(np.clip(0.9 * slot_pt, 5.0, 9.0))


def attention_grid_figure(
    tokens: np.ndarray,
    attention: Sequence[np.ndarray],
    *,
    targets: np.ndarray | None = None,
    predictions: np.ndarray | None = None,
    title: str | None = None,
    token_names: Sequence[str] | None = None,
    queries: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    causal: bool = False,
) -> Figure:
  """Builds (but does not save) the layers x heads attention-heatmap figure.

    See :func:`plot_attention` for the arguments. The returned figure is a plain
    :class:`matplotlib.figure.Figure` attached to an Agg canvas (no ``pyplot``),
    so it is garbage-collected like any object; ``fig.axes`` lists the grid
    cells row-major (layer 0 heads 0..H-1, layer 1, ...) followed by the
    colourbar axis. Each drawn cell holds exactly one image whose array is the
    ``[n, n]`` cropped attention matrix, ``n = valid_length(tokens)``.

    With ``queries`` (a window ``(start, stop)`` of query positions), each
    cell holds those rows and the ``keys`` columns (default: every key a
    causal model lets the window see, ``0 .. stop - 1``, or all ``n``), the
    queries labelled ``"position input→target"`` and the keys with their
    positions (every one, or every few when they do not fit).

    Raises:
      ValueError: on inconsistent shapes (see :func:`plot_attention`).
    """
  tokens, attention, targets, predictions = _check_inputs(
      tokens, attention, targets, predictions)
  n = valid_length(tokens)
  if queries is not None or keys is not None:
    return _window_figure(tokens, attention, targets, predictions, title,
                          token_names, queries, keys, causal, n)
  n_layers = len(attention)
  heads = [a.shape[0] for a in attention]
  n_cols = max(1, max(heads))

  # ~2.2 in per cell; grow past 16 tokens so that tick labels stay legible.
  cell = CELL_INCHES + 0.1 * max(0, n - _CELL_BASE_LEN)
  fontsize = _tick_fontsize(n, cell)
  # A layer without heads only needs a thin row for its "pruned" note.
  row_heights = [1.0 if h > 0 else 0.3 for h in heads]
  grid_height = cell * sum(row_heights)
  width = n_cols * cell + 1.0  # + colourbar
  height = grid_height + (0.5 if title else 0.0) + (0.3 if predictions
                                                    is not None else 0.0)

  fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(n_layers,
                      n_cols,
                      squeeze=False,
                      gridspec_kw={"height_ratios": row_heights})
  norm = Normalize(vmin=0.0, vmax=1.0)
  cmap = _cmap()

  def name(token: int) -> str:
    return str(token) if token_names is None else token_names[token]

  key_labels = [name(int(t)) for t in tokens[:n]]
  if targets is not None:
    query_labels = [
        f"{name(int(x))}\u2192{name(int(t))}"
        for x, t in zip(tokens[:n], targets[:n])
    ]
  else:
    query_labels = list(key_labels)
  mismatch = (predictions[:n] != targets[:n]
              if predictions is not None else np.zeros(n, dtype=bool))
  ticks = np.arange(n)
  title_size, label_size = 10.0, 9.0

  for layer in range(n_layers):
    for head in range(n_cols):
      ax = axes[layer, head]
      if head >= heads[layer]:
        _pruned_cell(ax, layer, head, heads[layer], title_size)
        continue
      weights = attention[layer][head, :n, :n]
      if causal:
        weights = np.ma.masked_array(weights, np.triu(np.ones((n, n), bool),
                                                      1))
      ax.imshow(weights,
                cmap=cmap,
                norm=norm,
                interpolation="nearest",
                aspect="equal")
      ax.set_title(f"layer {layer}, head {head}", fontsize=title_size)
      ax.set_xticks(ticks)
      ax.set_xticklabels(key_labels,
                         fontsize=fontsize,
                         rotation=90 if n > 8 else 0)
      ax.set_xlabel("key", fontsize=label_size)
      ax.set_yticks(ticks)
      ax.tick_params(length=2, pad=1.5)
      if head == 0:
        _query_labels(ax, query_labels, mismatch, fontsize)
        ax.set_ylabel("query", fontsize=label_size)
      else:
        ax.set_yticklabels([])

  _colorbar(fig, axes, norm, grid_height, width, label_size)
  if title:
    fig.suptitle(title, fontsize=11)
  if predictions is not None:
    fig.supxlabel(
        f"query labels: input\u2192target; red = prediction \u2260 target "
        f"({int(mismatch.sum())}/{n} wrong)",
        fontsize=label_size,
        color="0.3",
    )
  return fig


#: Colour of a causal model's masked cells (a key after its query).
MASKED_COLOR = "0.88"


def _pruned_cell(ax, layer: int, head: int, layer_heads: int,
                 fontsize: float) -> None:
  """An empty cell that says its head (or its whole layer) was pruned."""
  ax.set_axis_off()
  note = (f"layer {layer}\nno heads (pruned)" if layer_heads == 0 and
          head == 0 else f"layer {layer}, head {head}\n(pruned)")
  ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center",
          color="0.55", fontsize=fontsize, style="italic")


def _query_labels(ax, labels: Sequence[str], mismatch: np.ndarray,
                  fontsize: float) -> None:
  """The queries' tick labels, those whose prediction is wrong in red."""
  ax.set_yticklabels(labels, fontsize=fontsize)
  for label, bad in zip(ax.get_yticklabels(), mismatch):
    if bad:
      label.set_color(MISMATCH_COLOR)
      label.set_fontweight("bold")


def _colorbar(fig: Figure, axes, norm: Normalize, grid_height: float,
              width: float, fontsize: float) -> None:
  """The weights' colour bar: ~0.15 in wide, at most ~5 in long, never
  wider than its share."""
  shrink = min(0.9, 5.0 / grid_height)
  cbar = fig.colorbar(ScalarMappable(norm=norm, cmap=CMAP), ax=axes,
                      shrink=shrink, fraction=0.3 / width, pad=0.01,
                      aspect=max(10.0, shrink * grid_height / 0.15))
  cbar.set_label("attention weight", fontsize=fontsize)
  cbar.ax.tick_params(labelsize=fontsize)


def _cmap():
  """The heatmaps' colour map, masked cells in :data:`MASKED_COLOR`."""
  from matplotlib import colormaps
  return colormaps[CMAP].with_extremes(bad=MASKED_COLOR)


def key_stride(count: int, inches: float) -> int:
  """Every how many keys a tick label fits along ``inches`` (labels at
  least ~0.3 in apart): 1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, ..."""
  for stride in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128):
    if inches * stride / max(1, count) >= 0.3:
      return stride
  return 256


def _window_figure(tokens, attention, targets, predictions, title,
                   token_names, queries, keys, causal, n) -> Figure:
  """:func:`attention_grid_figure` of a window of queries x keys."""
  q0, q1 = queries if queries is not None else (0, n)
  if not 0 <= q0 < q1 <= n:
    raise ValueError(f"queries must be a window (start, stop) within the "
                     f"{n} valid positions, got {queries}.")
  k0, k1 = keys if keys is not None else (0, q1 if causal else n)
  if not 0 <= k0 < k1 <= n:
    raise ValueError(f"keys must be a window (start, stop) within the "
                     f"{n} valid positions, got {keys}.")
  rows, cols = q1 - q0, k1 - k0
  n_layers = len(attention)
  heads = [a.shape[0] for a in attention]
  n_cols = max(1, max(heads))
  cell_h = max(CELL_INCHES, 0.16 * rows + 0.8)
  cell_w = max(CELL_INCHES, 0.025 * cols + 0.8) if cols > 48 else max(
      CELL_INCHES, 0.16 * cols + 0.8)
  row_heights = [1.0 if h > 0 else 0.3 for h in heads]
  grid_height = cell_h * sum(row_heights)
  width = n_cols * cell_w + 1.6
  height = grid_height + (0.5 if title else 0.0) + (0.3 if predictions
                                                    is not None else 0.0)
  fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(n_layers, n_cols, squeeze=False,
                      gridspec_kw={"height_ratios": row_heights})
  norm = Normalize(vmin=0.0, vmax=1.0)
  cmap = _cmap()

  def name(token: int) -> str:
    return str(token) if token_names is None else token_names[token]

  positions = np.arange(q0, q1)
  query_labels = [
      f"{i} {name(int(tokens[i]))}" + (
          f"\u2192{name(int(targets[i]))}" if targets is not None else "")
      for i in positions]
  mismatch = (predictions[q0:q1] != targets[q0:q1]
              if predictions is not None else np.zeros(rows, dtype=bool))
  if cols <= 48:
    key_ticks = np.arange(k0, k1)
    key_labels = [f"{k} {name(int(tokens[k]))}" for k in key_ticks]
  else:
    stride = key_stride(cols, 0.85 * cell_w)
    key_ticks = np.arange(-(-k0 // stride) * stride, k1, stride)
    key_labels = [str(k) for k in key_ticks]
  fontsize = _tick_fontsize(rows, cell_h)
  title_size, label_size = 10.0, 9.0
  mask = (np.arange(k0, k1)[None, :] > positions[:, None]) if causal else \
      np.zeros((rows, cols), bool)
  for layer in range(n_layers):
    for head in range(n_cols):
      ax = axes[layer, head]
      if head >= heads[layer]:
        _pruned_cell(ax, layer, head, heads[layer], title_size)
        continue
      weights = np.ma.masked_array(attention[layer][head, q0:q1, k0:k1],
                                   mask)
      ax.imshow(weights, cmap=cmap, norm=norm, interpolation="nearest",
                aspect="auto", extent=(k0 - 0.5, k1 - 0.5, q1 - 0.5,
                                       q0 - 0.5))
      ax.set_title(f"layer {layer}, head {head}", fontsize=title_size)
      ax.set_xticks(key_ticks)
      ax.set_xticklabels(key_labels, fontsize=min(fontsize, 8.0),
                         rotation=90 if cols <= 48 else 0)
      ax.set_xlabel(f"key position ({k0}\u2013{k1 - 1} of {n})",
                    fontsize=label_size)
      ax.set_yticks(positions)
      ax.tick_params(length=2, pad=1.5)
      if head == 0:
        _query_labels(ax, query_labels, mismatch, fontsize)
        ax.set_ylabel(f"query position ({q0}\u2013{q1 - 1} of {n})",
                      fontsize=label_size)
      else:
        ax.set_yticklabels([])
  _colorbar(fig, axes, norm, grid_height, width, label_size)
  if title:
    fig.suptitle(title, fontsize=11)
  if predictions is not None:
    fig.supxlabel(
        f"queries {q0}\u2013{q1 - 1} of {n}: position input\u2192target; red "
        f"= prediction \u2260 target ({int(mismatch.sum())}/{rows} wrong)"
        + ("; grey: masked (a key after its query)" if causal else ""),
        fontsize=label_size, color="0.3")
  return fig


def plot_attention(
    tokens: np.ndarray,
    attention: Sequence[np.ndarray],
    path: str | os.PathLike,
    *,
    targets: np.ndarray | None = None,
    predictions: np.ndarray | None = None,
    title: str | None = None,
    token_names: Sequence[str] | None = None,
    queries: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    causal: bool = False,
) -> None:
  """Writes a PNG grid of attention heatmaps (rows = layers, columns = heads).

    Every heatmap is cropped to the valid length ``n = valid_length(tokens)``
    (the leading non-zero tokens), so padding never appears as attention. Rows
    are layers, columns heads (as many as the widest layer); cells of a layer
    with fewer heads (or none, e.g. after pruning) are blanked with a "pruned"
    note. One shared colour scale ``0..1`` with a single colourbar.

    Args:
      tokens: ``[L]`` int input sequence, ``0`` = padding (may trail).
      attention: one ``[H_l, L, L]`` float array per layer (query rows, key
        columns); ``H_l`` may differ per layer and may be ``0``. A stacked
        ``[layers, H, L, L]`` array is accepted too.
      path: where to write the PNG (parent directories are created).
      targets: optional ``[L]`` int target tokens; the query axis then shows
        ``"x→t"`` (input → target) labels.
      predictions: optional ``[L]`` int predicted tokens (requires ``targets``);
        query labels where ``prediction != target`` are drawn in bold red.
      title: optional figure title (``fig.suptitle``).
      token_names: optional label of each token id (``token_names[t]``, e.g.
        ``mha.data.token_names("spell")``: digits, ``_`` and letters); by
        default a token is labelled with its number.
      queries: optional window ``(start, stop)`` of query positions to draw
        (a long sequence); the keys then default to those the window can
        see (``0 .. stop - 1`` with ``causal``, else all), or ``keys``.
      keys: optional window ``(start, stop)`` of key positions.
      causal: draw the keys after each query (a causal model's mask) in
        grey (:data:`MASKED_COLOR`).

    Raises:
      ValueError: if ``tokens`` is not 1-D or starts with padding, an attention
        array is not 3-D or its last two dims differ from ``len(tokens)``,
        ``targets``/``predictions`` do not match ``tokens``' shape, or
        ``predictions`` come without ``targets``.
    """
  fig = attention_grid_figure(
      tokens,
      attention,
      targets=targets,
      predictions=predictions,
      title=title,
      token_names=token_names,
      queries=queries,
      keys=keys,
      causal=causal,
  )
  path = os.fspath(path)
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  fig.savefig(path, dpi=DPI, format=figures.figure_format(path))
  fig.clear()  # drop artists now; the Figure has no pyplot reference to leak
