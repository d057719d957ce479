"""The group writers' lanes (service/group_commit.py): a group at most every `pace` seconds, the
requests that arrive meanwhile in it, and no wait after a quiet `pace`."""

import asyncio

from service.group_commit import Waiting


def test_a_lane_takes_a_group_at_most_every_pace_and_at_once_after_a_quiet_one():
    pace = 0.5

    async def taken_before_a_pace_passes(take):
        # An order, not a time: the take wins against a pace's sleep started with it, however
        # loaded the machine (both wait on the same loop).
        taking, pacing = asyncio.ensure_future(take), asyncio.ensure_future(asyncio.sleep(pace))
        done, _ = await asyncio.wait({taking, pacing}, return_when=asyncio.FIRST_COMPLETED)
        pacing.cancel()
        assert taking in done and pacing not in done
        return taking.result()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        lane: Waiting[object] = Waiting(pace)
        lane.put("a")
        assert await taken_before_a_pace_passes(lane.take(10)) == ["a"]  # an idle lane: taken at once
        first = loop.time()

        lane.put("b")
        taking = asyncio.create_task(lane.take(10))
        await asyncio.sleep(pace / 5)
        lane.put("c")  # arrives while the lane waits out its pace: same group
        assert await taking == ["b", "c"]
        assert loop.time() - first >= pace

        await asyncio.sleep(pace)
        lane.put("d")
        assert await taken_before_a_pace_passes(lane.take(10)) == ["d"]  # after a quiet pace: at once

    asyncio.run(run())
