"""`ett submit`'s reading of a job file: each mistake one line naming the file, the line and the field."""

import subprocess
import sys

import pytest

from ett_cli.spec_file import SpecFileError, load_spec

CASES = {
    "syntax.toml": ('name = "x"\nnodes = 2\nentrypoint = ["python", "t.py"\n',
                    ["syntax.toml:3: Unclosed array"]),
    "no_equals.toml": ('name = "x"\nnodes 2\n', ["no_equals.toml:2: Expected '=' after a key in a key/value pair"]),
    "values.toml": ('name = "x"\nnodes = 2\nentrypoint = ["python", "t.py"]\n\n[checkpoint]\ninterval_steps = -5\n\n'
                    '[[faults]]\nattempt = 0\nrank = 0\nat_step = 3\naction = "kill"\n\n'
                    '[[faults]]\nattempt = 0\nrank = 9\nat_step = 3\naction = "kill"\n',
                    ["values.toml:6: checkpoint.interval_steps: Input should be greater than or equal to 1, or 'auto'",
                     "values.toml:16: faults.1.rank: rank 9 does not exist in a job of 2 ranks"]),
    "dotted.toml": ('name = "x"\n[trainer.overrides]\n"optim.lr" = 0.1\ntrain.steps = 60\n',
                    ['dotted.toml:4: trainer.overrides.train.steps: an override key with a dot must be quoted in TOML: '
                     'write "train.steps" = 60']),
    "misspelt.toml": ('name = "x"\nmax_restart = 2\n\n[checkpoint]\ninterval = 5\n\n[[faults]]\nattempt = 0\n'
                      'rank = 0\nat_step = 3\naction = "kill"\nsignal = "TERM"\n',
                      ["misspelt.toml:2: max_restart: not a field; did you mean 'max_restarts'?",
                       "misspelt.toml:5: checkpoint.interval: not a field; did you mean 'interval_steps'?",
                       "misspelt.toml:12: faults.0.signal: not a field (the fields here: attempt, rank, at_step, "
                       "action, code, exception, message, path, factor)"]),
    "env.toml": ('name = "x"\n\n[env]\nOMP_NUM_THREADS = "1"\nLD_PRELOAD = "/tmp/evil.so"\n',
                 ["env.toml:5: env.LD_PRELOAD: refused: it changes how the interpreter, the loader or the shell "
                  "starts, or the job's own ETT_ environment (docs/jobspec.md, \"env\")"]),
    "interval.json": ('{\n  "name": "x",\n  "checkpoint": {\n    "interval_steps": "often"\n  }\n}\n',
                      ["interval.json:4: checkpoint.interval_steps: Input should be a valid integer, or 'auto'"]),
}


@pytest.mark.parametrize("name", CASES)
def test_each_mistake_is_one_line_with_file_line_and_field(tmp_path, name):
    text, expected = CASES[name]
    (tmp_path / name).write_text(text)
    with pytest.raises(SpecFileError) as raised:
        load_spec(tmp_path / name)
    assert str(raised.value).splitlines() == [f"{tmp_path}/{line}" for line in expected]


def test_ett_submit_prints_them_without_a_traceback(tmp_path):
    text, expected = CASES["values.toml"]
    (tmp_path / "values.toml").write_text(text)
    result = subprocess.run([sys.executable, "-m", "ett_cli.main", "submit", str(tmp_path / "values.toml"), "--token",
                             "t"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"ett: {tmp_path}/{line}" for line in expected]
