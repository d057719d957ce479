import pytest

from agent.supervisor import Supervisor


@pytest.fixture
def supervisor(tmp_path):
    supervisor = Supervisor(tmp_path / "spool", "node-a", stop_grace_seconds=1.0)
    yield supervisor
    supervisor.shutdown()
