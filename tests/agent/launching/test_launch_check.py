"""What the rank runner checks before it starts a rank (agent/launching/launch_check.py): the program is found
on the ranks' PATH and may be run, the script a Python interpreter is handed exists and may be read;
each refusal names the file and the error. The run as an unprivileged user: tests/e2e/apart/test_job_user.py."""

import os
import sys

import pytest

from agent.launching.launch_check import launch_problem, python_script


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.path.dirname(sys.executable)}")
    (tmp_path / "bin").mkdir()
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def test_a_runnable_program_and_a_readable_script_pass(in_tmp):
    assert launch_problem(["python", "train.py", "--steps", "3"]) is None
    assert launch_problem([sys.executable, "-u", "-X", "importtime", "train.py"]) is None
    assert launch_problem(["python", "-m", "no.such.module"]) is None  # a module is Python's to find
    assert launch_problem(["python", "-c", "pass"]) is None


def test_a_missing_script_is_named_with_the_working_folder(in_tmp):
    assert launch_problem(["python", "trian.py"]) == f"trian.py (in {in_tmp}): No such file or directory"
    assert launch_problem(["python3.11", "-u", "/nowhere/x.py"]) == "/nowhere/x.py: No such file or directory"
    assert launch_problem(["python", "bin"]) == f"bin (in {in_tmp}): Is a directory"


def test_a_program_not_found_or_not_executable_is_named(in_tmp):
    assert launch_problem(["no-such-program", "x"]).startswith("no-such-program: not found on the ranks' PATH")
    assert launch_problem(["./missing.sh"]) == f"./missing.sh (in {in_tmp}): No such file or directory"
    script = in_tmp / "bin" / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    assert launch_problem(["train.sh"]) == f"{script}: Permission denied"  # found on PATH, not executable
    script.chmod(0o755)
    assert launch_problem(["train.sh"]) is None


def test_the_script_of_a_python_command_line():
    assert python_script(["-u", "a.py", "b.py"]) == "a.py"
    assert python_script(["-W", "ignore", "-X", "dev", "a.py"]) == "a.py"
    assert python_script(["-mtorch.distributed.run", "a.py"]) is None
    assert python_script(["-", "a.py"]) is None and python_script(["-u"]) is None
