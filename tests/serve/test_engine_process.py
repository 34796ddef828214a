"""The server's engine process (nanovllm.dp.engine_core): a killed engine (with tensor-parallel
workers) fails the requests in flight at once, streamed or not, and /health reports it; the server
then still exits cleanly and leaves no process or shared memory behind. An engine that stops answering
with requests in flight is stopped by the watchdog, with the same outcome; an idle one is left alone.
Data-parallel replicas are one engine process each, and serve the same greedy tokens as transformers.
An engine that fails to start ends `nanovllm serve` with its error."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
from conftest import MAX_TOKENS, PROMPTS
from server_process import REPO, Server, descendants, is_running

OPTIONS = ("--kvcache-block-size", "4", "--max-model-len", "1024", "--num-kvcache-blocks", "512")
LONG = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}


def shm_segments(pid: int) -> list[str]:
    """The shared-memory segments a process made (nanovllm names them after their creator's pid)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"nanovllm-{pid}-")]


def wait_until_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if is_running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_killed_engine_fails_requests_in_flight_and_the_server_exits_clean(qwen3_dir):
    server = Server(qwen3_dir, *OPTIONS, "--tensor-parallel-size", "2")
    try:
        (engine,) = server.engine_pids()
        workers = descendants(engine)
        assert len(workers) == 1, workers  # the rank-1 worker
        assert shm_segments(engine)  # the tensor-parallel step channel
        full: dict = {}
        waiter = threading.Thread(target=lambda: full.update(response=httpx.post(
            f"{server.url}/v1/completions", json=LONG, headers=server.headers, timeout=60)))
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                          headers=server.headers, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data:")
            waiter.start()
            time.sleep(0.5)  # the second request is in the batch
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line]  # ends, and does not hang
        waiter.join(30)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert "killed by SIGKILL" in error["message"] and error["type"] == "server_error"
        assert full["response"].status_code == 500, full["response"].text
        assert "killed by SIGKILL" in full["response"].json()["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          headers=server.headers)
        assert late.status_code == 503, late.text
        assert wait_until_gone([engine, *workers]) == []  # the worker follows its engine
        deadline = time.monotonic() + 10
        while shm_segments(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shm_segments(engine) == []  # removed for the killed engine, while the server runs on
        assert server.terminate() == 0, server.output()
    finally:
        server.terminate()


def test_hung_engine_is_stopped_and_fails_its_requests_but_idle_is_not_hung(qwen3_dir):
    timeout = 1.5
    server = Server(qwen3_dir, *OPTIONS, "--engine-step-timeout", str(timeout))
    (engine,) = server.engine_pids()
    try:
        time.sleep(2 * timeout)  # idle, so silent: not hung
        short = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           headers=server.headers, timeout=30)
        assert short.status_code == 200, short.text
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                          headers=server.headers, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(engine, signal.SIGSTOP)  # alive, and answering nothing: as a hung kernel leaves it
            start = time.monotonic()
            rest = [line for line in lines if line]  # ends, and does not hang
        assert time.monotonic() - start < timeout + 15
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert "stopped responding" in error["message"] and error["type"] == "server_error", error
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "stopped responding" in health.json()["error"]["message"]
        assert wait_until_gone([engine]) == []  # SIGKILL ends even a stopped process
        assert server.terminate() == 0, server.output()
    finally:
        if is_running(engine):
            os.kill(engine, signal.SIGCONT)
        server.terminate()


def test_data_parallel_replicas_serve_and_leave_nothing_on_sigterm(qwen3_dir, reference):
    server = Server(qwen3_dir, *OPTIONS, "--data-parallel-size", "2", "--max-num-seqs", "8")
    try:
        engines = server.engine_pids()
        assert len(engines) == 2
        processes = descendants(server.proc.pid)  # the engines and multiprocessing's resource tracker
        for prompt, expected in zip(PROMPTS, reference):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == expected
        metrics = server.metrics()
        assert metrics["nanovllm:kv_cache_total_blocks"] == 2 * 512
        assert metrics["nanovllm:kv_cache_free_blocks"] == 2 * 512
        assert metrics["vllm:request_success_total{finished_reason=\"length\"}"] == len(PROMPTS)
        assert metrics["vllm:generation_tokens_total"] == len(PROMPTS) * MAX_TOKENS
    finally:
        assert server.terminate() == 0, server.output()
    assert wait_until_gone(processes) == []


def test_an_engine_that_fails_to_start_ends_serve_with_its_error(qwen3_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # the config reads fine; the weights do not
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "nanovllm.serve", str(broken), "--port", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nanovllm serve: the engine failed to start: engine process 0"), done.stderr
    assert "exited with code 1" in last and "model.safetensors" in last, last



def test_a_server_killed_by_sigkill_leaves_no_process_behind(qwen3_dir):
    """SIGKILL gives the HTTP process no chance to stop anything: its engine process and its tokenizer
    process notice that their parent is gone and leave by themselves."""
    server = Server(qwen3_dir, *OPTIONS)
    children = descendants(server.proc.pid)
    assert len(server.engine_pids()) == 1 and len(children) >= 2  # the engine and the tokenizer, at least
    server.proc.kill()
    server.proc.wait()
    assert wait_until_gone(children) == []
