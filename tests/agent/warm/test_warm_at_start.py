"""What an agent warms as it starts (ETT_AGENT_WARM_AT_START, agent.daemon): the built-in trainer's server by
default, the base server of users' scripts, both, or none. Real agents against the real service; each server
that starts is there (its log, its process) by the time the agent has registered, as its imports overlap
registration."""

import os

import pytest

from agent.warm.servers import SCRIPT_BASE_IMPORTS, imports_key
from tests.support.cluster import cluster

pytestmark = pytest.mark.slow
TRAINER_LOG, SCRIPTS_LOG = "warm-{uid}.log", "warm-{uid}-{key}.log"


@pytest.mark.parametrize(("setting", "expected"), [("trainer", {TRAINER_LOG}), ("scripts", {SCRIPTS_LOG}),
                                                   ("both", {TRAINER_LOG, SCRIPTS_LOG}), ("none", set())])
def test_an_agent_warms_at_its_start_what_it_is_told(tmp_path, setting, expected):
    with cluster(tmp_path) as c:
        c.start_agent("node-a", warm_at_start=setting)
        logs = {p.name for p in (c.root / "node-a").glob("warm-*.log")}  # the suite's user runs the jobs
        assert logs == {name.format(uid=os.geteuid(), key=imports_key(SCRIPT_BASE_IMPORTS)) for name in expected}
