"""Tests for mha.cli: every command line reports a mistake as one line on
stderr and exits with code 2 (the scripts' own tests run one such mistake
through a real process; these cover the shared helpers in-process)."""

import pytest
from absl import flags

from mha import cli


@pytest.fixture
def flag_values():
  """A private FlagValues with one flag of each kind the scripts use."""
  fv = flags.FlagValues()
  flags.DEFINE_integer("num_seeds", 5, "seeds", lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("retrain_seeds", False, "retrain", flag_values=fv)
  flags.DEFINE_list("batch_sizes", ["1", "16"], "sizes", flag_values=fv)
  return fv


def _parse(monkeypatch, fv, argv):
  monkeypatch.setattr(flags, "FLAGS", fv)
  return cli.parse_flags(argv, "prog.py")


@pytest.mark.parametrize("argv, message", [
    (["prog.py", "--num_seeds=abc"], "num_seeds"),
    (["prog.py", "--num_seeds=0"], "num_seeds"),
    (["prog.py", "--retrain_seeds=maybe"], "retrain_seeds"),
    (["prog.py", "--no_such_flag=1"], "no_such_flag"),
    (["prog.py", "stray"], "unexpected arguments: stray"),
])
def test_flag_mistakes_are_one_line_and_exit_2(monkeypatch, capsys,
                                               flag_values, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    _parse(monkeypatch, flag_values, argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("prog.py: error: ") and message in err
  assert err.count("\n") == 1 and "Traceback" not in err


def test_good_flags_parse(monkeypatch, flag_values):
  assert _parse(monkeypatch, flag_values,
                ["prog.py", "--num_seeds=3", "--retrain_seeds"]) == ["prog.py"]
  assert flag_values.num_seeds == 3 and flag_values.retrain_seeds


def test_numbers_parses_or_names_the_flag():
  assert cli.numbers("batch_sizes", ["1", "16"], int) == (1, 16)
  assert cli.numbers("fractions", ["0.5"], float) == (0.5,)
  with pytest.raises(cli.UsageError, match="--batch_sizes must be integers"):
    cli.numbers("batch_sizes", ["1", "x"], int)


def test_existing_dir(tmp_path, capsys):
  assert cli.existing_dir("prog.py", str(tmp_path)) == str(tmp_path)
  for path, says in [(tmp_path / "missing", "does not exist"),
                     (tmp_path / "file", "is a file")]:
    if says == "is a file":
      path.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
      cli.existing_dir("prog.py", str(path))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"prog.py: error: workdir {path} {says}" + (
        ", not a directory\n" if says == "is a file" else "\n")
  assert not (tmp_path / "missing").exists()


def test_one_line_unwraps_key_errors_and_quoted_tracebacks():
  assert cli.one_line(KeyError("unknown key 'x'")) == "unknown key 'x'"
  quoted = ValueError("bad config:\nTraceback (most recent call last):\n"
                      "  File ...\nValueError: the real reason")
  assert cli.one_line(quoted) == "bad config: ValueError: the real reason"
  assert cli.one_line(ValueError()) == "ValueError"
