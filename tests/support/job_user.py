"""Who the suite's agents run jobs as.

Most agents of the suite run jobs as the suite's own user (root on CI), said explicitly as an
operator would have to (SUITE_USER_JOBS). The unprivileged path has its own tests
(tests/e2e/apart/test_job_user.py), with an interpreter the job's user can run: built here as a
deployment would build one, outside root's home folder.
"""

import getpass
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SUITE_USER_JOBS = {"ETT_AGENT_JOB_USER": getpass.getuser(), "ETT_AGENT_ALLOW_ROOT_JOBS": "true"}


@contextmanager
def open_folder(prefix: str) -> Iterator[Path]:
    """A folder other users may enter (pytest's own are closed to them, as root's home is): for the
    agents' data, checkpoints and a job interpreter of a job's user. Removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def closed_folder(path: Path) -> Path | None:
    """The first folder above `path` that other users cannot enter, if any."""
    for folder in [*reversed(path.parents), path]:
        if folder.is_dir() and not folder.stat().st_mode & 0o001:
            return folder
    return None


def job_python(folder: Path) -> Path:
    """A virtual environment in `folder` that any user can run, sharing this one's packages (torch,
    ett in editable form): the system's interpreter of the same version, whose site folder
    adds ours. The repository and this environment's packages must be open to other users."""
    base = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not base.exists():
        base = Path(sys._base_executable)  # type: ignore[attr-defined]
    packages = Path(sysconfig.get_paths()["purelib"])
    for path in (base, packages):
        closed = closed_folder(path)
        assert closed is None, f"{path} is under {closed}, which other users cannot enter: no job interpreter"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(folder)], check=True)  # umask 022: all may read
    folder.chmod(0o755)
    python = folder / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip()
    Path(own_site, "ett-shared.pth").write_text(f"import site; site.addsitedir({str(packages)!r})\n")
    return python
