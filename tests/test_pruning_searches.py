"""Tests of mha.pruning.searches on planted value functions."""

import itertools

import numpy as np
import pytest

from mha import head_masks
from mha.model import TransformerConfig
from mha.pruning import searches

CONFIG = TransformerConfig(vocab_size=5, num_layers=2, num_heads=3,
                           d_model=6, mlp_dim=8, max_len=4)
HEADS = [0, 1, 2, 3, 4, 5]  # flat indices: 2 layers x 3 heads


def _brute_force(value_fn):
  """The best removal and value for every k, by evaluating every subset."""
  best = []
  for k in range(len(HEADS) + 1):
    removals = list(itertools.combinations(HEADS, k))
    values = value_fn(np.stack([head_masks.mask_without(CONFIG, list(r))
                                for r in removals]))
    best.append(float(np.max(values)))
  return best


def _layer_additive(rng):
  """v(mask) = sum over layers of a random value of that layer's kept set."""
  tables = [rng.normal(size=8) for _ in range(2)]

  def value_fn(masks):
    codes = [np.sum((masks[:, l, :3] > 0.5) * (1 << np.arange(3)), axis=1)
             for l in range(2)]
    return tables[0][codes[0]] + tables[1][codes[1]]
  return value_fn


def _interacting(rng):
  """A value with interactions across layers (not layer-additive)."""
  weights = rng.normal(size=(6, 6))

  def value_fn(masks):
    kept = masks.reshape(len(masks), -1)
    return np.einsum("bi,ij,bj->b", kept, weights, kept)
  return value_fn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_surrogate_is_exact_when_the_value_is_layer_additive(seed):
  value_fn = _layer_additive(np.random.default_rng(seed))
  found = searches.layer_surrogate(value_fn, CONFIG, polish_rounds=0)
  assert [e["k"] for e in found] == list(range(7))
  for entry, best in zip(found, _brute_force(value_fn)):
    assert len(entry["removed"]) == entry["k"]
    assert entry["value"] == pytest.approx(best)


def test_polished_surrogate_never_loses_to_the_unpolished_one():
  value_fn = _interacting(np.random.default_rng(3))
  plain = searches.layer_surrogate(value_fn, CONFIG, polish_rounds=0)
  polished = searches.layer_surrogate(value_fn, CONFIG, polish_rounds=4)
  best = _brute_force(value_fn)
  for a, b, truth in zip(plain, polished, best):
    assert a["value"] <= b["value"] + 1e-12 <= truth + 2e-12


def test_wide_beam_is_exhaustive_and_values_are_the_removals_values():
  value_fn = _interacting(np.random.default_rng(4))
  found = searches.beam_search(value_fn, CONFIG, width=20)  # C(6, 3) = 20
  for entry, best in zip(found, _brute_force(value_fn)):
    assert entry["value"] == pytest.approx(best)
    mask = head_masks.mask_without(CONFIG, entry["removed"])[None]
    assert value_fn(mask)[0] == pytest.approx(entry["value"])


def test_beam_of_width_one_is_greedy():
  value_fn = _interacting(np.random.default_rng(5))
  found = searches.beam_search(value_fn, CONFIG, width=1)
  removed = []
  for k in range(1, 7):
    options = [h for h in HEADS if h not in removed]
    values = value_fn(np.stack([head_masks.mask_without(CONFIG, removed + [h])
                                for h in options]))
    removed.append(options[int(np.argmax(values))])
    assert sorted(found[k]["removed"].tolist()) == sorted(removed)
  with pytest.raises(ValueError, match="width"):
    searches.beam_search(value_fn, CONFIG, width=0)


def test_long_searches_report_progress(monkeypatch):
  config = CONFIG
  rng = np.random.default_rng(0)
  weights = rng.normal(size=(2, 3))
  value_fn = lambda masks: (masks * weights).sum(axis=(1, 2))
  monkeypatch.setattr(searches, "PROGRESS_AFTER_S", -1.0)  # every search
  lines = []
  searches.beam_search(value_fn, config, width=2, log=lines.append)
  assert lines and all(line.startswith("    beam search: ") for line in lines)
  assert "/6 sizes" in lines[0] and "ETA" in lines[0]
  lines.clear()
  searches.layer_surrogate(value_fn, config, top=2, log=lines.append)
  assert lines and all("surrogate search" in line for line in lines)
  # Nothing under the threshold.
  lines.clear()
  monkeypatch.setattr(searches, "PROGRESS_AFTER_S", 1e9)
  searches.beam_search(value_fn, config, width=2, log=lines.append)
  searches.layer_surrogate(value_fn, config, top=2, log=lines.append)
  assert not lines
