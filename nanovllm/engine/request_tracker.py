"""Who collects each request's output, so that none is ever dropped or handed to the wrong caller.

A request is either *returned* (queued with `add_request`: its output comes back from a later
`step()`) or *tracked* (queued by `generate`, `stream` or the server, which follow it themselves
and collect its output with `take`). Several callers may drive one engine, each from its own
thread: whichever thread runs a step, every finished output lands here until its owner asks for
it. Pure Python; the engine's lock guards it."""

from nanovllm.engine.sequence import Sequence


class RequestTracker:
    def __init__(self) -> None:
        self.live: dict[int, Sequence] = {}  # queued and not finished, aborted or failed
        self.tracked: set[int] = set()  # ids whose output a generate/stream/server call collects
        self.done: dict[int, dict] = {}  # finished tracked outputs, until their caller takes them
        self.unreturned: list[tuple[int, dict]] = []  # finished add_request outputs, for step()

    def add(self, seq: Sequence, tracked: bool) -> None:
        assert seq.seq_id not in self.live, f"request {seq.seq_id} queued twice"
        self.live[seq.seq_id] = seq
        if tracked:
            self.tracked.add(seq.seq_id)

    def finish(self, seq_id: int, output: dict, report: bool = True) -> None:
        """Record a request's end. An aborted add_request request is not reported (report=False):
        its caller asked for the abort; a tracked one always is, so its waiting caller wakes up."""
        self.live.pop(seq_id)
        if seq_id in self.tracked:
            self.done[seq_id] = output
        elif report:
            self.unreturned.append((seq_id, output))

    def take(self, seq_id: int) -> dict | None:
        """The output of a finished tracked request (once), or None while it runs."""
        output = self.done.pop(seq_id, None)
        if output is not None:
            self.tracked.discard(seq_id)
        return output

    def forget(self, seq_id: int) -> None:
        """The caller of a tracked request left (an exception, Ctrl-C): drop what it would collect."""
        self.tracked.discard(seq_id)
        self.done.pop(seq_id, None)

    def drain_unreturned(self) -> list[tuple[int, dict]]:
        outputs, self.unreturned = self.unreturned, []
        return outputs
