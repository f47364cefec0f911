"""Markdown helpers of the study's reports: numbers, intervals, tables.

One home for the formatting that ``report.md``'s sections share
(:mod:`mha.pruning.study.report`, :mod:`mha.pruning.study.report_extensions`).
Values may be NumPy numbers or the ``None`` that JSON makes of NaN.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np


def finite(value: Any) -> bool:
  """Whether ``value`` is a finite number (``None`` is not)."""
  return value is not None and bool(np.isfinite(value))


def grid(value: Any) -> np.ndarray:
  """A ``[L, H]`` float64 array of a nested list, ``None`` as NaN."""
  rows = [[np.nan if v is None else v for v in row] for row in
          np.asarray(value, dtype=object).tolist()]
  return np.asarray(rows, np.float64)


def fmt(value: Any, digits: int = 3, sign: bool = False) -> str:
  """``value`` with ``digits`` decimals (and a sign), or ``n/a``."""
  if not finite(value):
    return "n/a"
  return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def ci(entry: Mapping[str, Any], key: str, digits: int = 3,
       sign: bool = False) -> str:
  """``value [low, high]`` of ``entry[key]`` and ``entry[key + "_ci"]``."""
  text = fmt(entry.get(key), digits, sign)
  interval = entry.get(f"{key}_ci")
  if text != "n/a" and interval is not None and all(
      finite(c) for c in interval):
    text += " [" + ", ".join(fmt(c, digits, sign) for c in interval) + "]"
  return text


def q_value(q: Any) -> str:
  """A Benjamini-Hochberg q as ``<1e-4``, ``=0.012`` or ``=n/a``."""
  return "=n/a" if not finite(q) else (
      "<1e-4" if q < 1e-4 else f"={q:.2g}")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  """A markdown table, then a blank line."""
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return lines + [""]


def heads_table(values: np.ndarray, form: str = "{:+.3f}") -> list[str]:
  """A layers x heads table of ``values`` (NaN: an empty cell)."""
  header = ["layer"] + [f"head {h}" for h in range(values.shape[1])]
  rows = [[str(layer)] + ["" if np.isnan(v) else form.format(v) for v in row]
          for layer, row in enumerate(values)]
  return table(header, rows)


def figure(results: Mapping[str, Any], name: str) -> str:
  """The file name of figure ``name`` (given as ``<stem>.png``) in the
  study's ``plot_format`` (``png``, ``svg`` or ``pdf``)."""
  fmt = results["options"].get("plot_format", "png")
  return f"{os.path.splitext(name)[0]}.{fmt}"


def image(results: Mapping[str, Any], alt: str, name: str) -> str:
  """``report.md``'s line for figure ``name`` (:func:`figure`): an inline
  image, or a link for a PDF (which Markdown viewers do not inline)."""
  path = figure(results, name)
  return f"[{alt} (PDF)]({path})" if path.endswith(".pdf") else (
      f"![{alt}]({path})")


def is_image(line: str) -> bool:
  """Whether ``line`` is one of :func:`image`'s."""
  return line.startswith("![") or (line.startswith("[")
                                    and line.endswith(".pdf)"))


__all__ = ["finite", "grid", "fmt", "ci", "q_value", "table", "heads_table",
           "figure", "image", "is_image"]
