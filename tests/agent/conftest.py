import os

import pytest

from agent.confinement.cgroups import NodeCgroups
from agent.groups.supervisor import Supervisor


@pytest.fixture
def cgroups(tmp_path):
    """This test's own cgroups, as an agent started as root makes them (none for another user)."""
    node_cgroups = NodeCgroups(f"test-{os.getpid()}-{tmp_path.name}") if os.geteuid() == 0 else None
    yield node_cgroups
    if node_cgroups is not None and node_cgroups.root is not None:
        for folder in sorted(node_cgroups.root.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            folder.rmdir()  # only once empty: a process left in one fails the test here


@pytest.fixture
def supervisor(tmp_path, cgroups):
    supervisor = Supervisor(tmp_path / "spool", "node-a", stop_grace_seconds=1.0, cgroups=cgroups)
    yield supervisor
    supervisor.shutdown()
