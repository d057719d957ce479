"""The agent refuses, in one line naming the setting, to start where its jobs would run as root or
could not run at all (an agent started as root; the tests here are run as root on CI)."""

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.confinement.job_user import PASSABLE, RunAs, make_passable, resolve_job_user
from tests.support.job_user import closed_folder, job_python, open_folder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="an agent started as root")


def start_agent(tmp_path, **settings: str) -> subprocess.CompletedProcess:
    env = os.environ | {"ETT_AGENT_TOKEN": "t", "ETT_AGENT_DATA_DIR": str(tmp_path / "agent")} | {
        f"ETT_AGENT_{name.upper()}": value for name, value in settings.items()}
    return subprocess.run([sys.executable, "-m", "agent.cli"], env=env, capture_output=True, text=True, timeout=120)


def test_root_is_no_job_user_unless_allowed_explicitly(tmp_path):
    result = start_agent(tmp_path, job_user="root")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ett agent: ETT_AGENT_JOB_USER=root is root: every user's job would run as root on this node; "
        "set ETT_AGENT_ALLOW_ROOT_JOBS=true to allow it"]


def test_an_unknown_job_user_is_named(tmp_path):
    result = start_agent(tmp_path, job_user="no-such-user-here")
    assert result.returncode == 2 and "ETT_AGENT_JOB_USER=no-such-user-here: no such user" in result.stderr


def test_an_interpreter_the_job_user_cannot_run_stops_the_agent_with_what_to_set(tmp_path):
    python = tmp_path / "python"  # pytest's folders are closed to other users, as /root is
    python.symlink_to(sys.executable)
    closed = closed_folder(tmp_path)
    assert closed is not None
    result = start_agent(tmp_path, job_python=str(python))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    # Checked as the first uid of the owners' range, which no owner gets (agent/confinement/job_user.py).
    assert last.startswith(f"ett agent: job user ett-2000000000 cannot run {python} (a link to "
                           f"{os.path.realpath(sys.executable)}): Permission denied: it cannot enter {closed} (")
    assert "ETT_AGENT_JOB_PYTHON" in last


def test_a_venv_linked_into_a_closed_folder_is_refused_naming_that_folder(open_root):
    """A venv made from a pyenv Python under /root: its bin/python is open to all, and links to an
    interpreter under a folder only root may enter. The refusal names that folder, not the venv."""
    home = open_root / "root-home"  # as /root: root's alone
    (home / "pyenv" / "bin").mkdir(parents=True)
    home.chmod(0o700)
    interpreter = home / "pyenv" / "bin" / "python3.11"
    shutil.copy2(os.path.realpath(sys.executable), interpreter)
    venv = open_root / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3.11").symlink_to(interpreter)
    (venv / "python").symlink_to("python3.11")  # as `python -m venv` lays them
    result = start_agent(open_root / "venv-agent", job_python=str(venv / "python"),
                         data_dir=str(open_root / "venv-agent"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"ett agent: job user ett-2000000000 cannot run {venv / 'python'} (a link to {interpreter}): Permission "
        f"denied: it cannot enter {home} (drwx------ root:root); set ETT_AGENT_JOB_PYTHON to an interpreter "
        "outside it that user can run, with ett installed (docs/agent.md, \"The job's user\")")


@pytest.fixture(scope="module")
def open_root() -> Iterator[Path]:
    """A folder other users may enter (pytest's are closed to them), with a job interpreter."""
    with open_folder("ett-job-user-") as root:
        job_python(root / "python")
        yield root


def test_the_agents_folders_let_the_job_user_through_whatever_the_umask(open_root):
    run_as = RunAs(str(open_root / "python" / "bin" / "python"), resolve_job_user("nobody", allow_root=False))
    attempt = open_root / "agent" / "spool" / "job-1" / "0"
    umask = os.umask(0o077)  # README's "umask 077" before the agents start
    try:
        make_passable(open_root / "agent" / "spool")
        run_as.make_own(attempt)
    finally:
        os.umask(umask)
    for folder in (open_root / "agent", open_root / "agent" / "spool", attempt.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == PASSABLE, folder
    assert attempt.stat().st_uid == run_as.user.uid and stat.S_IMODE(attempt.stat().st_mode) == 0o700
    assert run_as.problem([attempt]) is None  # checked as nobody, by a real interpreter


def test_a_folder_the_job_user_cannot_enter_is_named_with_its_mode_owner_and_the_fix(tmp_path, open_root):
    data = tmp_path / "agent"  # pytest's folders are closed to other users, as /root is
    closed = closed_folder(tmp_path)
    assert closed is not None
    result = start_agent(tmp_path, job_python=str(open_root / "python" / "bin" / "python"), data_dir=str(data))
    assert result.returncode == 1
    mode = stat.filemode(closed.stat().st_mode)
    assert result.stderr.strip().splitlines()[-1] == (
        f"ett agent: job user ett-2000000000 cannot enter {closed} ({mode} root:root), on the way to its job folders: "
        f"let other users pass through it (chmod o+x {closed}) or give the agent a --data-dir "
        "(and ETT_AGENT_LOCAL_CHECKPOINT_DIR) outside it")


def test_a_link_the_job_left_for_its_folder_is_refused_not_followed(open_root):
    """A job's checkpoint folder from an earlier attempt is the job's to replace: a link there must
    not make the agent give the job what it points at (chown follows links)."""
    run_as = RunAs(str(open_root / "python" / "bin" / "python"), resolve_job_user("nobody", allow_root=False))
    target = open_root / "root-owned"
    target.mkdir()
    folder = open_root / "ckpt" / "job-1"
    folder.parent.mkdir()
    folder.symlink_to(target)
    with pytest.raises(OSError, match="not a folder of its own"):
        run_as.make_own(folder)
    assert target.stat().st_uid == 0


def test_a_link_anywhere_below_the_area_is_refused_not_followed(open_root):
    """The job owns the folders between its checkpoint area and its checkpoint folder: a link it
    lays at any of them (not only the last) must not lead root outside the area."""
    run_as = RunAs(str(open_root / "python" / "bin" / "python"), resolve_job_user("nobody", allow_root=False))
    area, outside = open_root / "area-1", open_root / "outside-1"
    outside.mkdir()
    (area / "job-1").mkdir(parents=True)
    (area / "job-1" / "sub").symlink_to(outside)
    with pytest.raises(OSError, match="not a folder of its own"):
        run_as.make_own(area / "job-1" / "sub" / "run", anchor=area)
    assert list(outside.iterdir()) == [] and outside.stat().st_uid == 0


FLIPPER = """
import os, shutil, sys
sub, outside = sys.argv[1], sys.argv[2]
while True:  # a folder, then a link to outside, as fast as it can
    try:
        os.mkdir(sub)
        shutil.rmtree(sub)
        os.symlink(outside, sub)
        os.unlink(sub)
    except OSError:
        shutil.rmtree(sub, ignore_errors=True)
        if os.path.islink(sub):
            os.unlink(sub)
"""


def test_a_link_raced_in_while_root_makes_the_folder_leads_nowhere_outside(open_root):
    """A real process swaps a folder on the way for a link to outside the area as fast as it can,
    while root makes the job's folder below it, again and again: root creates and gives away
    nothing outside the area (the check at launch comes before, and cannot see this)."""
    run_as = RunAs(str(open_root / "python" / "bin" / "python"), resolve_job_user("nobody", allow_root=False))
    area, outside = open_root / "area-2", open_root / "outside-2"
    outside.mkdir()
    (area / "job-1").mkdir(parents=True)
    sub = area / "job-1" / "sub"
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(sub), str(outside)])
    made = 0
    try:
        for _ in range(500):
            try:
                run_as.make_own(sub / "run", anchor=area)
                made += 1
            except OSError:
                pass
    finally:
        flipper.kill()
        flipper.wait()
    assert list(outside.iterdir()) == [] and outside.stat().st_uid == 0
    assert made > 0  # the race was run: some tries found the folder and made the job's in it
