"""Records of absl's logger (which TFDS and orbax log through) filtered for
the length of a ``with`` block."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def filtered(log_filter: logging.Filter) -> Iterator[None]:
  """Within: ``log_filter`` on Python's ``absl`` logger, removed on exit."""
  logger = logging.getLogger("absl")
  logger.addFilter(log_filter)
  try:
    yield
  finally:
    logger.removeFilter(log_filter)
