"""Who collects each request's output, so that none is ever dropped or handed to the wrong caller.

A request is its n sequences (one per completion; the first, its leader, gives the request its id).
It is either *returned* (queued with `add_request`: its output comes back from a later `step()`) or
*tracked* (queued by `generate`, `stream` or the server, which follow it themselves and collect its
output with `take`). Several callers may drive one engine, each from its own thread: whichever thread
runs a step, every finished output lands here until its owner asks for it. Pure Python; the engine's
lock guards it."""

from collections.abc import Container

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestOutput


def request_id_of(seq: Sequence) -> int:
    """The id of the request seq belongs to: its leader's seq_id (its own for completion 0)."""
    return (seq.leader or seq).seq_id


class RequestTracker:
    def __init__(self) -> None:
        self.live: dict[int, list[Sequence]] = {}  # request id -> its sequences, until it ends
        self.tracked: set[int] = set()  # ids whose output a generate/stream/server call collects
        self.done: dict[int, RequestOutput] = {}  # finished tracked outputs, until their caller takes them
        self.unreturned: list[tuple[int, RequestOutput]] = []  # finished add_request outputs, for step()

    def add(self, seqs: list[Sequence], tracked: bool) -> int:
        request_id = seqs[0].seq_id
        assert request_id not in self.live, f"request {request_id} queued twice"
        self.live[request_id] = seqs
        if tracked:
            self.tracked.add(request_id)
        return request_id

    def finish(self, request_id: int, output: RequestOutput, report: bool = True) -> None:
        """Record a request's end. An aborted add_request request is not reported (report=False):
        its caller asked for the abort; a tracked one always is, so its waiting caller wakes up."""
        self.live.pop(request_id)
        if request_id in self.tracked:
            self.done[request_id] = output
        elif report:
            self.unreturned.append((request_id, output))

    def take(self, request_id: int) -> RequestOutput | None:
        """The output of a finished tracked request (once), or None while it runs."""
        output = self.done.pop(request_id, None)
        if output is not None:
            self.tracked.discard(request_id)
        return output

    def take_done(self, request_ids: Container[int]) -> list[tuple[int, RequestOutput]]:
        """(id, output) of the finished tracked requests among request_ids, each taken once. Its cost is
        the outputs finished and not yet taken, not the size of request_ids: a caller that asks after
        every step for the few of its many requests that finished pays for those few."""
        ready = [request_id for request_id in self.done if request_id in request_ids]
        return [(request_id, self.take(request_id)) for request_id in ready]

    def forget(self, request_id: int) -> None:
        """The caller of a tracked request left (an exception, Ctrl-C): drop what it would collect."""
        self.tracked.discard(request_id)
        self.done.pop(request_id, None)

    def drain_unreturned(self) -> list[tuple[int, RequestOutput]]:
        outputs, self.unreturned = self.unreturned, []
        return outputs
