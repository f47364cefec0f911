"""Tests for mha.run.cli: every command line reports a mistake as one line on
stderr and exits with code 2 (the scripts' own tests run one such mistake
through a real process; these cover the shared helpers in-process)."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from mha.run import cli

CONFIG_FILE = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "default.py")


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
  with pytest.raises(SystemExit) as exit_info:  # not the current folder
    cli.existing_dir("prog.py", "")
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
      'prog.py: error: --workdir is empty; name a folder ("." for the '
      'current one)\n')
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


def test_writable_dir_checks_by_writing_and_leaves_nothing(tmp_path, capsys):
  out = tmp_path / "eval"
  assert cli.writable_dir("prog.py", str(out)) == str(out)
  # Made for the check and kept, empty: the work writes there next (and
  # removing it could race another process checking the same folder).
  assert os.listdir(out) == []
  (out / "old.png").write_text("kept")
  cli.writable_dir("prog.py", str(out))
  assert os.listdir(out) == ["old.png"]
  in_the_way = tmp_path / "file"
  in_the_way.write_text("kept")
  with pytest.raises(SystemExit) as exit_info:
    cli.writable_dir("prog.py", str(in_the_way))
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
      f"prog.py: error: cannot write to {in_the_way}: {in_the_way} is a "
      "file, not a folder; choose a folder this process can write\n")
  assert in_the_way.read_text() == "kept"


def _config_flag_error(argv):
  """What parsing ``argv`` with a ``--config`` flag raises."""
  fv = flags.FlagValues()
  try:
    config_flags.DEFINE_config_file("config", CONFIG_FILE, flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    fv(argv)
    fv.config.to_dict()
  except Exception as e:  # pylint: disable=broad-except
    return e
  raise AssertionError(f"{argv} parsed")


# ml_collections' config_flags loads a config file with the deprecated
# loader.load_module() (config_flags.py, version 1.x).
@pytest.mark.filterwarnings(
    "ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
@pytest.mark.parametrize("argv, line", [
    # The default config: config_flags raises at the flag's definition.
    (["train.py", "--config.nope=1"], "'nope'"),
    # A --config given: it raises while parsing (an AttributeError then).
    (["train.py", f"--config={CONFIG_FILE}:tiny", "--config.nonexistent=1"],
     "'nonexistent'"),
    (["train.py", f"--config={CONFIG_FILE}:tiny", "--config.model.bogus=1"],
     "'bogus'"),
    (["train.py", f"--config={CONFIG_FILE}", "--config.nope.deeper=1"],
     "'nope'"),
    # The config file's own KeyError is reported as it is.
    (["train.py", f"--config={CONFIG_FILE}:tiny,model.nope=3"], None),
])
def test_unknown_config_overrides_are_named_with_or_without_config(argv,
                                                                   line):
  error = _config_flag_error(argv)
  assert isinstance(error, (AttributeError, KeyError))
  assert cli.unknown_config_override(error) == (
      line and f"unknown config key in the --config.* flags: {line}")
  assert cli.unknown_config_override(KeyError("'nope'")) is None


def test_quiet_ending_leaves_absl_logging_one_line_per_record():
  # end_quietly_on_broken_pipe wraps sys.stderr after absl made its handler
  # with the stream itself; absl prints a record to stderr a second time
  # when its stream is not sys.stderr (--alsologtostderr here), so the
  # handler must write through the wrapper.
  code = ("from absl import app, logging\n"
          "from mha.run import cli\n"
          "def main(argv):\n"
          "  logging.warning('the one record')\n"
          "cli.end_quietly_on_broken_pipe()\n"
          "app.run(main)\n")
  result = subprocess.run([sys.executable, "-c", code, "--alsologtostderr"],
                          capture_output=True, text=True, check=False,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr
  assert result.stderr.count("the one record") == 1, result.stderr


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs an entry point in this process (as `python SCRIPT ARGS...` would),
# then prints its exit code and which heavy packages it imported.
_RUN_AND_LIST_IMPORTS = r"""
import json, runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
  runpy.run_path(script, run_name="__main__")
  code = 0
except SystemExit as e:
  code = e.code
heavy = ("jax", "flax", "optax", "orbax", "tensorflow_datasets")
print(json.dumps({"code": code,
                  "imported": [m for m in heavy if m in sys.modules]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("script, args, message", [
    ("train.py", ["--bogus"], "Unknown command line flag 'bogus'"),
    ("eval.py", ["--bogus"], "Unknown command line flag 'bogus'"),
    ("scripts/prune_heads.py", ["--bogus"],
     "Unknown command line flag 'bogus'"),
    ("scripts/prune_heads.py", ["--workdir={tmp}", "--oracle_max_heads=0"],
     "--oracle_max_heads must be >= 1, got 0"),
    ("scripts/prune_heads.py", ["--workdir={tmp}/none"], "does not exist"),
    ("scripts/pruning_benchmark.py", ["--bogus"],
     "Unknown command line flag 'bogus'"),
    ("scripts/pruning_benchmark.py", ["--workdir={tmp}", "--tasks=nope"],
     "--tasks: unknown task 'nope'"),
])
def test_a_mistake_on_the_command_line_is_answered_without_jax(
    script, args, message, tmp_path):
  # JAX, Flax, orbax and TFDS take seconds to import; the entry points
  # import them only once the command line holds up.
  args = [a.format(tmp=tmp_path) for a in args]
  result = subprocess.run(
      [sys.executable, "-c", _RUN_AND_LIST_IMPORTS,
       os.path.join(ROOT, script), *args], capture_output=True, text=True,
      check=False, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert json.loads(result.stdout) == {"code": 2, "imported": []}
