"""RequestTracker.take_done, what generate's loop asks after every step: a caller gets exactly its own
finished outputs, each once, and asking costs what finished rather than how many requests it waits for."""

from nanovllm.engine.requests import RequestTracker
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


class CountingSet(set):
    """A set that counts membership tests."""

    tests = 0

    def __contains__(self, item) -> bool:
        CountingSet.tests += 1
        return super().__contains__(item)


def queued(tracker: RequestTracker, count: int) -> list[int]:
    """The ids of `count` new requests (a generate call's)."""
    return [tracker.add([Sequence([1, 2, 3], SamplingParams(), 4)]) for _ in range(count)]


def test_take_done_gives_each_caller_its_own_finished_outputs_once():
    tracker = RequestTracker()
    mine, theirs = queued(tracker, 4), queued(tracker, 2)
    for request_id in (mine[1], mine[3], theirs[0]):
        tracker.finish(request_id, {"id": request_id})
    assert tracker.take_done(set(mine)) == [(mine[1], {"id": mine[1]}), (mine[3], {"id": mine[3]})]
    assert tracker.take_done(set(mine)) == []  # taken once
    assert tracker.take_done(set(theirs)) == [(theirs[0], {"id": theirs[0]})]  # left for its owner
    assert mine[1] not in tracker.done and mine[0] in tracker.live


def test_take_done_costs_what_finished_not_what_is_pending():
    tracker = RequestTracker()
    pending = CountingSet(queued(tracker, 1000))
    tracker.finish(next(iter(pending)), {})
    CountingSet.tests = 0
    assert len(tracker.take_done(pending)) == 1
    assert CountingSet.tests == 1  # one finished output looked up, not the 1,000 pending ids
