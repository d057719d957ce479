"""The group writers' lanes (service/group_commit.py): a group at most every `pace` seconds, the
requests that arrive meanwhile in it, and no wait after a quiet `pace`."""

import asyncio

from service.group_commit import Waiting


def test_a_lane_takes_a_group_at_most_every_pace_and_at_once_after_a_quiet_one():
    pace = 0.5

    async def run() -> None:
        loop = asyncio.get_running_loop()
        lane: Waiting[object] = Waiting(pace)
        lane.put("a")
        started = loop.time()
        assert await lane.take(10) == ["a"]
        first = loop.time()
        assert first - started < pace  # an idle lane: taken at once

        lane.put("b")
        taking = asyncio.create_task(lane.take(10))
        await asyncio.sleep(pace / 5)
        lane.put("c")  # arrives while the lane waits out its pace: same group
        assert await taking == ["b", "c"]
        assert loop.time() - first >= pace

        await asyncio.sleep(pace)
        lane.put("d")
        quiet = loop.time()
        assert await lane.take(10) == ["d"]
        assert loop.time() - quiet < pace

    asyncio.run(run())
