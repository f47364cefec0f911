"""Figure file formats, shared by the plotting modules and the command lines.

Kept apart from :mod:`mha.plotting` so that a command line can check
``--plot_format`` without importing matplotlib (half a second).
"""

from __future__ import annotations

import os

#: The file formats figures are written in (``--plot_format``): PNG, or
#: vector graphics for papers.
PLOT_FORMATS = ("png", "svg", "pdf")


def figure_format(path: str | os.PathLike) -> str:
  """The format of figure file ``path``, from its suffix: one of
  :data:`PLOT_FORMATS` (ValueError naming the file otherwise)."""
  suffix = os.path.splitext(os.fspath(path))[1].lstrip(".").lower()
  if suffix not in PLOT_FORMATS:
    raise ValueError(f"figure {os.fspath(path)!r}: the suffix must be one of "
                     f"{', '.join('.' + f for f in PLOT_FORMATS)}")
  return suffix


__all__ = ["PLOT_FORMATS", "figure_format"]
