"""A tensor-parallel worker that stops responding (SIGSTOP) is detected by its missing heartbeat:
generate raises RuntimeError naming the rank within HEARTBEAT_TIMEOUT_S (lowered here to keep the
test short) instead of waiting out the 10-minute collective timeout, and no process is left."""

import os
import signal
import time

import pytest
from conftest import PROMPTS
from test_tensor_parallel import GREEDY, assert_shut_down, tp_llm, within_deadline

from nanovllm.distributed import state as tp_state

# Lowered from 30 s; still far above the heartbeat interval, so a loaded CI host does not trip it.
TEST_TIMEOUT_S = 4.0
# Detection takes the timeout plus a poll; killing the worker and unwinding rank 0's collective more.
SLACK_S = 10.0


@pytest.fixture
def short_heartbeat(monkeypatch):
    monkeypatch.setattr(tp_state, "HEARTBEAT_TIMEOUT_S", TEST_TIMEOUT_S)


def test_a_stopped_worker_is_detected_naming_its_rank(qwen3_dir, short_heartbeat):
    llm = tp_llm(qwen3_dir)
    worker, run = llm.engine.executor.workers.processes[0], llm.engine.executor.runner.run
    try:
        # A step longer than the timeout is no stall: the worker beats from its own thread while it
        # waits in the collective for rank 0.
        def slow_once(batch):
            llm.engine.executor.runner.run = run
            time.sleep(TEST_TIMEOUT_S + 2)
            return run(batch)

        llm.engine.executor.runner.run = slow_once
        assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]["token_ids"]) > 0

        def stopped_while_rank0_computes(batch):
            os.kill(worker.pid, signal.SIGSTOP)  # it has the step; rank 0 waits alone in the all-reduce
            return run(batch)

        llm.engine.executor.runner.run = stopped_while_rank0_computes
        _, error, seconds = within_deadline(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert isinstance(error, RuntimeError), error
        assert f"rank 1 (pid {worker.pid}) stopped responding" in str(error)
        assert "is stopped (SIGSTOP?)" in str(error)
        # The last beat can precede generate's start by up to one interval: detection is timed from it.
        assert TEST_TIMEOUT_S - tp_state.HEARTBEAT_INTERVAL_S <= seconds < TEST_TIMEOUT_S + SLACK_S
        assert_shut_down(llm.engine.executor.workers)  # the stopped worker was killed and reaped
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    finally:
        if worker.is_alive():  # only when the test failed: never leave a stopped orphan behind
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
            worker.join()
        llm.shutdown()
