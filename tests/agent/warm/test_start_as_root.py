"""A warm server an agent started as root starts becomes its job's user itself (agent.confinement.become,
RunAs.start_kept): it then has the sys.path a start as that user gives, the user's site-packages
processed as that user and never as root; root runs no interpreter another user may change, nor one
when it runs jobs as itself. Real interpreters, a real uid."""

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.confinement.become import MODULE, root_may_run
from agent.confinement.job_user import JobUser, RunAs
from agent.warm.client import python_module
from tests.support.job_user import job_python, open_folder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to start as another uid")

REPO = Path(__file__).resolve().parents[3]
UID = 1_700_000_000 + random.randrange(100_000) * 10
# What a process sees of itself as its first module runs: what the warm server's own imports then see.
SEEN = """
import ctypes, json, os, site, sys
print(json.dumps({"path": sys.path, "uids": os.getresuid(), "groups": os.getgroups(), "umask": os.umask(0o077),
                  "argv": sys.argv, "user_site": site.ENABLE_USER_SITE, "pth_ran_as": os.environ.get("PTH_RAN_AS"),
                  "usercustomize": "usercustomize" in sys.modules,
                  "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)}))  # PR_GET_DUMPABLE
"""
# In the user's own site-packages: a folder it adds, and a line it runs (as whom, each time).
USER_PTH = "{extra}\nimport os; os.environ['PTH_RAN_AS'] = os.environ.get('PTH_RAN_AS', '') + str(os.getuid()) + ','\n"


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    """Interpreters, the module it runs and the user's home, where that user may reach them."""
    with open_folder("ett-start-as-root-") as root:
        (root / "modules").mkdir()
        (root / "modules" / "ett_seen.py").write_text(SEEN)
        (root / "extra").mkdir()
        yield root


def home_with_a_user_site(folder: Path, python: str) -> Path:
    """The user's home, whose site-packages (for `python`'s version) add a folder and run a line."""
    version = subprocess.run([python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                             capture_output=True, text=True, check=True).stdout.strip()
    home = folder / f"home-{version}"
    user_site = home / ".local" / "lib" / f"python{version}" / "site-packages"
    user_site.mkdir(parents=True, exist_ok=True)
    (user_site / "ett-user.pth").write_text(USER_PTH.format(extra=folder / "extra"))
    (user_site / "usercustomize.py").write_text("")
    for path in [home, *home.rglob("*")]:
        os.chown(path, UID, UID)
    return home


def interpreters(folder: Path) -> dict[str, str]:
    """A system interpreter (the user's site-packages before the system's), a virtual environment with
    the system's packages (after its own) and one without (no user site at all: the suite's job one)."""
    base = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    base = base if os.path.exists(base) else sys._base_executable  # type: ignore[attr-defined]
    with_system = folder / "venv-system"
    if not with_system.exists():
        subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", str(with_system)], check=True)
    alone = folder / "venv-alone"
    return {"system": base, "venv with the system's packages": str(with_system / "bin" / "python"),
            "venv of its own": str(alone / "bin" / "python" if alone.exists() else job_python(alone))}


def started(argv: list[str], popen: dict, env: dict[str, str]) -> dict:
    done = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=120, **popen)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_started_by_root_without_a_user_site_it_has_the_sys_path_a_start_as_its_user_gives(folder):
    python = interpreters(folder)["system"]
    home = folder / "home-empty"
    home.mkdir(exist_ok=True)
    os.chown(home, UID, UID)
    run_as = RunAs(python, JobUser(f"ett-{UID}", UID, UID, str(home), owners_alone=True))
    argv = python_module(python, "ett_seen")
    env = run_as.base_env() | {"PYTHONPATH": f"{REPO}{os.pathsep}{folder / 'modules'}"}
    before, now = started(argv, run_as.popen(), env), started(*run_as.start_kept(argv), env)
    assert before.pop("dumpable") == 1 and now.pop("dumpable") == 0
    assert now == before and now["user_site"] and now["uids"] == [UID] * 3


@pytest.mark.parametrize("kind", ["system", "venv with the system's packages", "venv of its own"])
def test_started_by_root_it_has_the_sys_path_a_start_as_its_user_gives(folder, kind):
    python = interpreters(folder)[kind]
    home = home_with_a_user_site(folder, python)
    run_as = RunAs(python, JobUser(f"ett-{UID}", UID, UID, str(home), owners_alone=True))
    assert root_may_run(python) is None, root_may_run(python)
    argv = [*python_module(python, "ett_seen"), "a", "b"]
    env = run_as.base_env() | {"PYTHONPATH": f"{REPO}{os.pathsep}{folder / 'modules'}"}
    kept_argv, kept_popen = run_as.start_kept(argv)
    assert kept_argv[4] == MODULE and kept_popen == {}  # exec'd as root
    before = started(argv, run_as.popen(), env)  # as it started until now: exec'd as the user
    now = started(kept_argv, kept_popen, env)
    assert before.pop("dumpable") == 1 and now.pop("dumpable") == 0  # the window that was open, closed
    assert now == before
    assert now["uids"] == [UID] * 3 and now["groups"] == [] and now["umask"] == 0o077
    if kind == "venv of its own":
        assert now["pth_ran_as"] is None and str(folder / "extra") not in now["path"]
    else:  # the user's .pth ran once, as the user; its folder where a start as the user puts it
        assert now["pth_ran_as"] == f"{UID}," and now["usercustomize"] and now["user_site"]
        user_site = now["path"].index(str(folder / "extra")) - 1
        assert now["path"][user_site].startswith(str(home)) and "-packages" in now["path"][user_site + 2]


def test_an_interpreter_another_user_may_change_is_exec_d_as_its_user_and_said_once(folder, caplog):
    """Root running it would run what that user put there: it starts as before, exec'd as the job's
    user (open to that user's processes until its first line), and the agent's log says so once."""
    theirs = folder / "theirs"
    theirs.mkdir()
    os.symlink(sys.executable, theirs / "python")
    os.chown(theirs, UID, UID)
    shared = folder / "shared"
    shared.mkdir()
    os.symlink(sys.executable, shared / "python")
    shared.chmod(0o775)
    venv = folder / "venv-theirs"  # root's, but its interpreter's home (the standard library) is theirs
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {theirs}\ninclude-system-site-packages = false\n")
    os.symlink(theirs / "python", venv / "bin" / "python")
    try:
        assert f"{theirs} (drwxr-xr-x, uid {UID})" in root_may_run(str(theirs / "python"))
        assert f"{shared} (drwxrwxr-x, uid 0)" in root_may_run(str(shared / "python"))
        assert f"{theirs} (drwxr-xr-x, uid {UID})" in root_may_run(str(venv / "bin" / "python"))
        os.unlink(venv / "bin" / "python")
        os.symlink(sys.executable, venv / "bin" / "python")  # no link into their folder left: the home alone
        assert f"{theirs} (drwxr-xr-x, uid {UID})" in root_may_run(str(venv / "bin" / "python"))
        run_as = RunAs(str(theirs / "python"), JobUser(f"ett-{UID}", UID, UID, str(folder), owners_alone=True))
        argv = python_module(run_as.python, "agent.warm.server")
        with caplog.at_level(logging.WARNING, logger="agent.confinement.job_user"):
            assert run_as.start_kept(argv) == (argv, run_as.popen())
            assert run_as.start_kept(argv) == (argv, run_as.popen())
        said = [r.getMessage() for r in caplog.records if r.name == "agent.confinement.job_user"]
        assert len(said) == 1 and str(theirs / "python") in said[0] and "not root's alone" in said[0], said
    finally:
        for made in (theirs, shared, venv):
            shutil.rmtree(made)


def test_an_agent_that_runs_jobs_as_itself_starts_it_as_before():
    argv = python_module(sys.executable, "agent.warm.server")
    assert RunAs().start_kept(argv) == (argv, {})
    assert RunAs(sys.executable, JobUser("root", 0, 0, "/root")).start_kept(argv) == (argv, {})
