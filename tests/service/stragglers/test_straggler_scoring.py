"""Straggler scoring at scale (service/stragglers/scoring.py): a window scored in O(world log world)
finds exactly the ranks the rule, each rank against the median of its peers, finds; an attempt's
score fed its windows in pieces, as the watch reads them, finds what it finds fed all at once.
The rules themselves, threshold by threshold: tests/service/stragglers/test_stragglers.py."""

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from service.stragglers.scoring import (RELATIVE_LIMIT, REREAD_RANKS, STEP_SHARE, AttemptScore, Timing,
                                        find_stragglers, peer_median, slow_in_window)

# Few distinct values, so that ties (a rank equal to the median, several ranks alike) are common.
VALUES = st.one_of(st.sampled_from([0.0, 0.01, 0.02, 0.03, 0.05, 0.08, 0.2]), st.floats(0, 1))


def slow_by_the_rule(window: list[Timing]) -> list[int]:
    """The rule as docs/reliability.md words it, each rank's peers' median taken anew: O(world^2)."""
    step = statistics.median(t.duration for t in window)
    found = []
    for t in window:
        peers = [p for p in window if p.rank != t.rank]
        if all(mine - theirs >= STEP_SHARE * step and mine >= RELATIVE_LIMIT * theirs
               for mine, theirs in ((t.value, statistics.median(p.value for p in peers)),
                                    (t.steady, statistics.median(p.steady for p in peers)))):  # fmt: skip
            found.append(t.rank)
    return found


@st.composite
def windows(draw, step: int = 5) -> list[Timing]:
    world = draw(st.integers(2, 40))
    durations = draw(st.lists(st.sampled_from([0.05, 0.1, 0.2]), min_size=world, max_size=world))
    works = draw(st.lists(VALUES, min_size=world, max_size=world))
    lows = draw(st.lists(st.one_of(st.none(), VALUES), min_size=world, max_size=world))
    return [Timing(r, step, durations[r], works[r], work_low=lows[r]) for r in range(world)]


@settings(max_examples=400, deadline=None)
@given(windows())
def test_a_window_scored_in_world_log_world_finds_what_the_rule_finds(window):
    assert sorted(s.rank for s in slow_in_window(window)) == slow_by_the_rule(window)


def test_the_middle_rank_of_an_odd_world_has_its_two_neighbours_for_peers():
    window = [Timing(rank, 5, 0.05, work) for rank, work in enumerate([0.0, 0.08, 0.1])]  # rank 1's peers: 0.05
    assert sorted(s.rank for s in slow_in_window(window)) == slow_by_the_rule(window) == [1, 2]


@given(st.lists(st.floats(0, 10), min_size=2, max_size=30))
def test_a_peers_median_read_from_the_order_is_the_median_without_the_rank(values):
    ordered = sorted(values)
    for i in range(len(ordered)):
        assert peer_median(ordered, i) == statistics.median(ordered[:i] + ordered[i + 1:])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_score_fed_in_pieces_finds_what_it_finds_fed_at_once(data):
    world = data.draw(st.integers(2, 6))
    slow_rank = data.draw(st.integers(0, world - 1))
    slow = data.draw(st.lists(st.booleans(), min_size=3, max_size=12))  # which windows the rank is slow in
    timings = [Timing(rank, 5 * (i + 1), 0.5, 0.3 if rank == slow_rank and is_slow else 0.1)
               for i, is_slow in enumerate(slow) for rank in range(world)]  # oldest first, as the watch reads
    cuts = sorted(data.draw(st.lists(st.integers(0, len(timings)), max_size=6)))
    pieces, score, found = [timings[a:b] for a, b in zip([0, *cuts], [*cuts, len(timings)])], AttemptScore(world), []
    for i, piece in enumerate(pieces):
        found += score.add(timings[:cuts[i - 1]] if i else [])  # windows read again are passed over
        found += score.add(piece)
    assert [s.rank for s in score.current()] == [s.rank for s in find_stragglers(timings, world)]
    run, expected = 0, []
    for i, is_slow in enumerate(slow):  # each run of three slow windows or more: found once, at its third
        run = run + 1 if is_slow else 0
        if run == 3:
            expected.append(5 * (i + 1))
    assert [(s.rank, s.flagged_step) for s in found] == [(slow_rank, step) for step in expected]


def test_a_window_some_rank_never_reported_is_passed_over_once_a_newer_one_is_complete():
    score = AttemptScore(2)
    score.add([Timing(0, 5, 0.5, 0.1)])  # rank 1's window 5 never comes
    score.add([Timing(r, 10, 0.5, 0.1) for r in (0, 1)])
    assert (score.done_step, score.pending) == (10, {})


def test_a_window_completed_late_is_read_again_for_its_missing_ranks_alone_and_scored():
    asked = []

    def reread(step: int, ranks: list[int]) -> list[Timing]:
        asked.append((step, ranks))
        return [Timing(rank, step, 0.5, 0.1) for rank in ranks]  # committed after the newer window's rows

    score = AttemptScore(3)
    score.add([Timing(0, 5, 0.5, 0.1), Timing(2, 5, 0.5, 0.1)])
    score.add([Timing(r, 10, 0.5, 0.1) for r in range(3)], reread)
    assert asked == [(5, [1])] and score.early is not None and len(score.early) == 2  # both windows scored
    many = AttemptScore(REREAD_RANKS + 2)  # more missing than a pass reads: passed over unread
    many.add([Timing(0, 5, 0.5, 0.1)])
    many.add([Timing(r, 10, 0.5, 0.1) for r in range(REREAD_RANKS + 2)], reread)
    assert asked == [(5, [1])] and many.done_step == 10 and many.early is not None and len(many.early) == 1
