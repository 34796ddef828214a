"""Data parallelism for real, on the CPU: DP=2 runs two engine replicas in spawned processes. Greedy
output must equal one engine's, in input order, whatever the split; the engine loop and streaming work
as with one engine; bad input raises in the caller before any replica gets work; a killed replica
raises within seconds and leaves no process or shared memory behind; garbage collection and a
terminal's Ctrl-C release everything."""

import _thread
import gc
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.distributed.executor import make_executor
from nanovllm.dp.engine import DataParallelEngine, DataParallelError
from nanovllm.dp.engine_core import FINISH_REASONS
from nanovllm.dp.receiver import Receiver
from nanovllm.dp.replica import _is_running
from nanovllm.engine.llm_engine import LLMEngine

OPTIONS = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, num_kvcache_blocks=96)
# Uneven prompts (1 to ~60 tokens) and uneven budgets: the split by tokens is uneven by count.
UNEVEN_PROMPTS = [*PROMPTS, " ".join(PROMPTS), PROMPTS[1] * 2, "Berlin", PROMPTS[3]]
MAX_TOKENS = [24, 6, 30, 3, 16, 8, 24, 2]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
# A failure must surface within this long, and leave nothing behind.
DEADLINE_S = 10
# Ctrl-Cs at random moments of a generate.
INTERRUPTS = 20


def token_ids(llm, prompts=UNEVEN_PROMPTS, params=PARAMS):
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_released(replicas: list):
    for replica in replicas:
        assert replica.closed
        assert replica.process.exitcode is not None, f"{replica} still runs"
        assert not os.path.exists(f"/proc/{replica.process.pid}"), f"{replica} was not reaped"
        info = replica.info
        for pid in info.worker_pids if info else []:
            assert not _is_running(pid), f"{replica}'s worker {pid} outlived it"
        for name in info.shm_names if info else []:
            assert not os.path.exists(f"/dev/shm/{name}")
    assert not {r.process for r in replicas} & set(multiprocessing.active_children())


@pytest.fixture
def ctrl_c_raises():
    """SIGINT (and _thread.interrupt_main) raises KeyboardInterrupt, as in a terminal: a test worker
    may have been started with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def dp1(qwen3_dir):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def dp2(qwen3_dir):
    """Two replicas of tensor_parallel_size=2: four processes, two TP groups and step channels."""
    llm = LLM(qwen3_dir, data_parallel_size=2, tensor_parallel_size=2, **OPTIONS)
    replicas = llm.engine.replicas
    yield weakref.proxy(llm)  # pytest keeps what a fixture yields: the tests get no strong reference
    # Dropping the last reference releases every replica (the garbage-collection path).
    assert all(replica.process.is_alive() for replica in replicas)
    del llm
    gc.collect()
    assert_released(replicas)


def test_dp2_matches_dp1_in_input_order(dp2, dp1):
    assert isinstance(dp2, LLM) and isinstance(dp2.engine, DataParallelEngine)
    names = [name for replica in dp2.engine.replicas for name in replica.info.shm_names]
    assert len(set(names)) == 2 and all(os.path.exists(f"/dev/shm/{name}") for name in names)
    expected = token_ids(dp1)
    assert [len(ids) for ids in expected] == MAX_TOKENS
    before = [replica.stats.num_generation_tokens for replica in dp2.engine.replicas]
    assert token_ids(dp2) == expected
    after = [replica.stats.num_generation_tokens for replica in dp2.engine.replicas]
    assert all(a > b for a, b in zip(after, before))  # both replicas worked
    outputs = dp2.generate(UNEVEN_PROMPTS[0], PARAMS[0], use_tqdm=True)  # one prompt: one replica idles
    assert outputs[0]["token_ids"] == expected[0]
    assert outputs[0]["text"] == dp1.tokenizer.decode(expected[0], skip_special_tokens=True)
    conversation = [{"role": "user", "content": "hello"}]
    expected_reply = dp1.chat(conversation, PARAMS[0], use_tqdm=False)
    assert dp2.chat(conversation, PARAMS[0], use_tqdm=False) == expected_reply


def test_vllm_prompt_forms_and_outputs_cross_the_pipes(dp2, dp1):
    ids = dp1.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompts = [{"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}, PROMPTS[2]]
    outputs, expected = (llm.generate(prompts, params, use_tqdm=False) for llm in (dp2, dp1))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.prompt for o in outputs] == [PROMPTS[1], None, PROMPTS[2]]
    assert len({o.request_id for o in outputs}) == 3
    token = outputs[0].outputs[0].token_ids[0]
    got, want = outputs[0].outputs[0].logprobs[0][token], expected[0].outputs[0].logprobs[0][token]
    text = dp1.tokenizer.decode([token])
    assert (got.rank, got.decoded_token) == (want.rank, want.decoded_token) == (1, text)
    assert abs(got - want) < 1e-4  # tensor parallelism sums in another order


def test_bad_input_raises_in_the_caller_and_the_replicas_keep_working(dp2):
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        dp2.generate([PROMPTS[0], PROMPTS[1]], [PARAMS[0], SamplingParams(max_tokens=1000)], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt must be"):
        dp2.generate([PROMPTS[0], 3.5], PARAMS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        dp2.add_request(PROMPTS[0], SamplingParams(max_tokens=1000))
    assert token_ids(dp2, PROMPTS[:2], PARAMS[:2])[1] == token_ids(dp2, PROMPTS[1:2], PARAMS[1:2])[0]


def test_stream_and_the_engine_loop_work_on_replicas(dp2, dp1):
    expected = dp1.generate(PROMPTS[:3], PARAMS[0], use_tqdm=False)
    assert "".join(dp2.stream(PROMPTS[0], PARAMS[0])) == expected[0]["text"]
    ids = [dp2.add_request(prompt, PARAMS[0]) for prompt in PROMPTS[:3]]
    outputs = {}
    while not dp2.is_finished():
        finished, _ = dp2.step()
        outputs.update(finished)
    assert [outputs[i]["token_ids"] for i in ids] == [o["token_ids"] for o in expected]
    request_id = dp2.add_request(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    assert dp2.abort_request(request_id) and dp2.is_finished() and dp2.step() == ([], 0)
    stats = dp2.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_an_interrupt_anywhere_in_generate_aborts_its_requests_and_the_next_call_works(dp2, dp1,
                                                                                       ctrl_c_raises):
    """Ctrl-C in a notebook: KeyboardInterrupt lands in the caller's thread at whatever it is doing
    (waiting, or taking in a replica's message); generate raises it, its requests end on the replicas,
    and nothing is left waiting for a message that was half taken in."""
    expected = token_ids(dp1, PROMPTS[:2], PARAMS[:2])
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    rng = random.Random(0)
    for _ in range(INTERRUPTS):
        timer = threading.Timer(rng.uniform(0.0, 0.1), _thread.interrupt_main)
        with pytest.raises(KeyboardInterrupt):
            timer.start()
            dp2.generate(PROMPTS * 2, long_params, use_tqdm=False)
        timer.join()
        assert dp2.engine.is_finished()
    assert token_ids(dp2, PROMPTS[:2], PARAMS[:2]) == expected
    stats = dp2.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_an_interrupt_as_a_request_ends_leaves_nothing_waiting_for_it(qwen3_dir, monkeypatch, ctrl_c_raises):
    """The worst moment for Ctrl-C: just as the message that ends a request has been read from its
    replica's pipe. The request must still end for the caller (one that read the message in its own
    thread and was interrupted before recording it waited for that request's end forever)."""
    with LLM(qwen3_dir, data_parallel_size=2, **OPTIONS) as llm:
        replicas = llm.engine.replicas
        interrupted = []
        for replica in replicas:
            def recv_then_interrupt(recv=replica.outbox.recv):
                message = recv()
                if not interrupted and message[0] == "step" and any(update[2] for update in message[1]):
                    interrupted.append(message)
                    _thread.interrupt_main()
                return message

            monkeypatch.setattr(replica.outbox, "recv", recv_then_interrupt)
        # Were the caller left waiting, this kills a replica: its end raises instead of hanging.
        watchdog = threading.Timer(DEADLINE_S, lambda: os.kill(replicas[0].process.pid, signal.SIGKILL))
        watchdog.start()
        short, long = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 200))
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS[:4], [short, long, short, long], use_tqdm=False)
        finally:
            watchdog.cancel()
        assert interrupted and llm.engine.is_finished()
        assert all(replica.process.is_alive() for replica in replicas)


def test_bad_options_raise_before_any_replica_starts(qwen3_dir):
    children = set(multiprocessing.active_children())
    for size in (0, -2):
        with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
            LLM(qwen3_dir, data_parallel_size=size)
    for size in (1.5, True):
        with pytest.raises(TypeError, match="data_parallel_size must be int"):
            LLM(qwen3_dir, data_parallel_size=size)
    with pytest.raises(TypeError, match="unknown LLM options"):
        LLM(qwen3_dir, data_parallel_size=2, data_parallel_sise=2)
    with pytest.raises(ValueError, match="need 2 GPUs but 0 are visible"):
        LLM(qwen3_dir, data_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 2, 4\]"):
        LLM(qwen3_dir, data_parallel_size=2, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"create LLM\(\.\.\., data_parallel_size=N\)"):
        LLMEngine(Config.from_options(qwen3_dir, data_parallel_size=2), make_executor)  # not two engines
    assert set(multiprocessing.active_children()) == children


def test_a_replica_killed_mid_generate_raises_and_leaves_nothing(qwen3_dir, monkeypatch):
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with LLM(qwen3_dir, data_parallel_size=2, **OPTIONS) as llm:
        replicas = llm.engine.replicas
        victim = replicas[1]
        killed_at = []
        step = DataParallelEngine.step

        def kill_on_first_step(engine):
            if not killed_at:
                os.kill(victim.process.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
            return step(engine)

        monkeypatch.setattr(DataParallelEngine, "step", kill_on_first_step)
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(error=raised(
            lambda: llm.generate(PROMPTS, long_params, use_tqdm=False))), daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "generate hung after a replica was killed"
        error = outcome["error"]
        assert isinstance(error, DataParallelError), error
        assert f"engine process 1 (pid {victim.process.pid}, CPUs" in str(error)
        assert "was killed by SIGKILL" in str(error)
        assert time.monotonic() - killed_at[0] < DEADLINE_S
        assert_released(replicas)  # the other replica too
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(PROMPTS[0], long_params, use_tqdm=False)


def test_an_interrupt_between_sending_a_request_and_recording_it_aborts_it(qwen3_dir, dp1, monkeypatch,
                                                                          ctrl_c_raises):
    """add_request sends a request, then records it: Ctrl-C in between leaves a request the caller never
    got the id of. Its replica must not go on generating it for nobody."""
    with LLM(qwen3_dir, data_parallel_size=2, **OPTIONS) as llm:
        replica = llm.engine.replicas[0]
        send = replica.send

        def send_then_interrupt(message):
            send(message)
            if message[0] == "add":
                _thread.interrupt_main()

        monkeypatch.setattr(replica, "send", send_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.add_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        monkeypatch.undo()
        assert llm.engine.is_finished()
        aborts = FINISH_REASONS.index("abort")
        deadline = time.monotonic() + DEADLINE_S
        while not replica.stats.finish_reasons[aborts] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = replica.stats
        assert stats.finish_reasons[aborts] == 1 and stats.num_running == stats.num_waiting == 0, stats
        assert stats.num_generation_tokens < 200  # ended early, not at its max_tokens
        assert token_ids(llm, PROMPTS[:2], PARAMS[:2]) == token_ids(dp1, PROMPTS[:2], PARAMS[:2])


def test_a_failure_in_the_receiving_thread_raises_in_the_caller(qwen3_dir, monkeypatch):
    """A bug in the thread that takes in the replicas' messages must not leave the caller waiting."""
    def broken(receiver, replica, updates, stats):
        raise RuntimeError("broken bookkeeping")

    monkeypatch.setattr(Receiver, "_record", broken)
    with LLM(qwen3_dir, data_parallel_size=2, **OPTIONS) as llm:
        replicas = llm.engine.replicas
        with pytest.raises(DataParallelError, match="(?s)messages failed.*broken bookkeeping"):
            llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
        assert_released(replicas)


def raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: B036 - handed back to the test
        return e
    return None


CTRL_C_SCRIPT = """
import faulthandler, json, signal, sys
# Ctrl-C raises KeyboardInterrupt, as in a terminal: Python leaves SIGINT ignored when it starts that way,
# as everything a non-interactive shell puts in the background does (a test run started with `&`).
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for our stacks if we hang
sys.path.insert(0, {root!r})
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({model!r}, data_parallel_size=2, **{options!r})
    print(json.dumps([replica.process.pid for replica in llm.engine.replicas]), flush=True)
    while True:
        llm.generate(["hello"] * 4, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
"""


def test_ctrl_c_in_a_terminal_stops_every_replica(qwen3_dir, tmp_path):
    """A terminal's Ctrl-C sends SIGINT to every process of the foreground group, replicas included:
    they ignore it, and the caller's KeyboardInterrupt shuts them all down on its way out."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT.format(root=root, model=qwen3_dir, options=OPTIONS))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        pids = json.loads(process.stdout.readline())
        time.sleep(1)  # generating
        os.killpg(process.pid, signal.SIGINT)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # say where the caller is stuck
            process.send_signal(signal.SIGUSR1)
            time.sleep(2)
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"the caller did not leave within 30 s of Ctrl-C; its threads:\n"
                        f"{process.communicate()[1][-6000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in stderr, stderr[-2000:]
    assert len(pids) == 2 and not any(_is_running(pid) for pid in pids)
