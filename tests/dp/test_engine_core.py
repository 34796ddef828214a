"""The engine process's loop without a process: one message per step carries every request's new
tokens, which join to its output; a request the engine refuses ends with an error while the others
run on; an abort frees the request's blocks and is published even when nothing else happens; "stop"
aborts what is left. An engine whose steps change nothing visible still speaks every KEEPALIVE_S."""

from types import SimpleNamespace

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.dp.engine_core import FINISH_REASONS, KEEPALIVE_S, EngineCore, _Tracked
from nanovllm.engine.llm_engine import SchedulerStats

pytestmark = pytest.mark.usefixtures("one_thread")


class Pipe:
    """A scripted inbox (each batch arrives once the loop has looked `after` times) and a recording
    outbox."""

    def __init__(self, batches: list[tuple[int, list[tuple]]]) -> None:
        self.batches, self.sent, self.num_polls = batches, [], 0

    def poll(self) -> bool:
        self.num_polls += 1
        return bool(self.batches) and self.num_polls >= self.batches[0][0]

    def recv(self) -> list[tuple]:
        return self.batches.pop(0)[1] if self.batches else [("stop",)]

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_steps_rejections_aborts_and_stop(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=64)
    greedy = dict(temperature=0.0, ignore_eos=True)
    inbox = Pipe([(0, [("add", 0, [5] * 70, SamplingParams(max_tokens=4, **greedy)),  # too long
                       ("add", 1, [1, 2, 3], SamplingParams(max_tokens=6, **greedy)),
                       ("add", 2, [4, 5, 6], SamplingParams(max_tokens=40, **greedy))]),
                  (12, [("abort", 2)])])  # after about ten steps
    outbox = Pipe([])
    try:
        core = EngineCore(llm.engine, outbox)
        core.run(inbox)
    finally:
        llm.shutdown()
    steps = [message for message in outbox.sent if message[0] == "step"]
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    outputs = {}
    for _, updates, _ in steps:
        assert len({request_id for request_id, _, _ in updates}) == len(updates)  # one update each
        for request_id, new_token_ids, output in updates:
            tokens[request_id] += new_token_ids
            if output is not None:
                outputs[request_id] = output
    assert outputs[0]["finish_reason"] == "error" and "max_model_len" in outputs[0]["error"]
    assert outputs[1]["finish_reason"] == "length" and tokens[1] == outputs[1]["token_ids"]
    assert len(tokens[1]) == 6
    assert outputs[2]["finish_reason"] == "abort" and tokens[2] == outputs[2]["token_ids"]
    assert 6 <= len(tokens[2]) < 40  # it ran beside request 1, and no further than the abort
    last = steps[-1][2]
    assert (last.num_running, last.num_waiting, last.num_free_blocks) == (0, 0, 64)  # blocks back
    assert dict(zip(FINISH_REASONS, last.finish_reasons)) == {"stop": 0, "length": 1, "abort": 1, "error": 1}
    assert last.num_prompt_tokens == 6 and last.num_generation_tokens == 6 + len(tokens[2])
    assert core.requests == {}


def test_keepalive_while_steps_change_nothing_visible():
    stats = SchedulerStats(num_running=1, num_waiting=0, num_free_blocks=8, num_total_blocks=8,
                           num_preemptions=0)
    engine = SimpleNamespace(stats=lambda: stats, completion_token_ids=lambda request_id, start: [])
    now = [0.0]
    outbox = Pipe([])
    core = EngineCore(engine, outbox, clock=lambda: now[0])
    core.requests[0] = _Tracked(engine_request_id=0)
    core.publish()  # the figures changed (from none): sent
    core.publish()  # nothing new, and too soon: not sent
    assert len(outbox.sent) == 1
    now[0] = KEEPALIVE_S
    core.publish()
    assert len(outbox.sent) == 2 and outbox.sent[-1][:2] == ("step", [])
    core.requests.clear()  # idle: silent, however long
    now[0] = 100 * KEEPALIVE_S
    core.publish()
    assert len(outbox.sent) == 2
