"""Tests of the spell task: digits to their English words (mha/data.py)."""

import ml_collections
import numpy as np
import pytest

from configs import default
from conftest import tiny_config
import mha
from mha import build
from mha.run import config_validation
from mha import data
from mha import evaluate
from mha import plotting
from mha import train

SPEC = data.DataSpec(task="spell", max_digits=2, max_len=10,
                     num_train_examples=60, num_eval_examples=15)


def _read(tokens):
  """Tokens as text: digits, '_' for a blank, letters; padding dropped."""
  names = data.token_names("spell")
  return "".join(names[t] for t in tokens if t)


@pytest.mark.parametrize("digits,words", [
    ([0], "zero"),
    ([3, 1], "threeone"),
    ([7, 7, 7], "sevensevenseven"),
    ([1, 0, 0, 8], "onezerozeroeight"),
    ([9, 4, 6, 2, 5], "ninefoursixtwofive"),
])
def test_spell_on_hand_written_examples(digits, words):
  assert data.spell(digits) == words
  inputs, targets = data.spell_tokens(digits)
  blanks = len(words) - len(digits)
  assert _read(inputs) == "".join(map(str, digits)) + "_" * blanks
  assert _read(targets) == words
  # The padded rows the dataset holds: targets computed from the inputs.
  row = np.zeros((1, 5 * 5), np.int32)
  row[0, :len(inputs)] = inputs
  out = data._compute_targets("spell", row)
  assert _read(out[0]) == words
  assert np.all(out[0, len(words):] == 0)


def test_tokens_are_distinct_and_pad_is_zero():
  names = data.token_names("spell")
  assert len(names) == data.vocab_size("spell", 10, 20) == 27
  assert names[0] == "" and len(set(names)) == len(names)
  assert data.token_names("reverse") is None


def test_splits_prepared_disjoint_and_correct(data_dir):
  splits = data.load_splits(SPEC, data_dir)
  prefixes = {}
  for name, split in splits.items():
    assert split.task == "spell"
    digits = [tuple(d for d in row if 1 <= d <= 10) for row in split.inputs]
    assert all(1 <= len(d) <= SPEC.max_digits for d in digits)
    for row, target, ds in zip(split.inputs, split.targets, digits):
      inputs, letters = data.spell_tokens(np.array(ds) - 1)
      n = len(inputs)
      assert list(row[:n]) == inputs and list(target[:n]) == letters
      assert not row[n:].any() and not target[n:].any()
    prefixes[name] = set(digits)
  assert not prefixes["validation"] & prefixes["train"]
  assert not prefixes["test"] & prefixes["train"]
  assert not prefixes["test"] & prefixes["validation"]


def test_max_len_too_small_is_refused_naming_the_numbers():
  config = tiny_config("/tmp", "spell", "data.max_digits=3", "data.max_len=14")
  with pytest.raises(config_validation.ConfigError) as error:
    config_validation.validate_config(config)
  assert str(error.value) == (
      "data.max_len=14 cannot hold the longest spelling of "
      "data.max_digits=3 digits (15 letters)")
  with pytest.raises(ValueError, match="max_len=14"):
    data.DataSpec(task="spell", max_digits=3, max_len=14)
  config_validation.validate_config(  # One more position is enough.
      tiny_config("/tmp", "spell", "data.max_digits=3", "data.max_len=15"))


def test_heatmap_labels_are_digits_blanks_and_letters():
  inputs, targets = data.spell_tokens([3, 1])
  fig = plotting.attention_grid_figure(
      np.array(inputs), [np.full((1, 8, 8), 1 / 8)], targets=np.array(targets),
      token_names=data.token_names("spell"))
  ax = fig.axes[0]
  assert [t.get_text() for t in ax.get_xticklabels()] == list("31______")
  assert [t.get_text() for t in ax.get_yticklabels()][:3] == [
      "3\u2192t", "1\u2192h", "_\u2192r"]


def test_tiny_end_to_end(data_dir, tmp_path, monkeypatch):
  """Trains, loads the checkpoint, and draws heatmaps labelled as spell's
  (on one layer: the task's labels are under test, not the model)."""
  config = tiny_config(
      data_dir, "spell", "model.num_layers=1", "num_train_steps=10",
      "data.max_digits=2",
      "data.max_len=10", "data.num_train_examples=60",
      "data.num_eval_examples=15")
  assert build.data_spec(config) == SPEC
  train.train_and_evaluate(config, str(tmp_path / "run"))
  ckpt = mha.load_checkpoint(str(tmp_path / "run"))
  assert ckpt.step == 10 and ckpt.model_config.vocab_size == 27

  names_drawn = []
  draw = plotting.plot_attention

  def recording_draw(*args, token_names=None, **kwargs):
    names_drawn.append(token_names)
    draw(*args, token_names=token_names, **kwargs)

  monkeypatch.setattr(plotting, "plot_attention", recording_draw)
  split = data.load_splits(SPEC, data_dir)["test"]
  paths = evaluate.write_attention_plots(ckpt.model, ckpt.params, split,
                                         str(tmp_path / "eval"), num_examples=2)
  assert len(paths) == 2
  assert names_drawn == [data.token_names("spell")] * 2


def test_a_config_saved_before_max_digits_reads_the_same_data():
  config = default.get_config("histogram")
  saved = config.to_dict()
  del saved["data"]["max_digits"]
  assert build.data_spec(ml_collections.ConfigDict(saved)) == (
      build.data_spec(config))
