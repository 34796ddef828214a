"""The server's host overhead, measured on a CPU: the same workload once offline (`LLM.generate`) and
once through a real `nanovllm serve` with N concurrent streaming clients (token-id prompts,
temperature 0.6, ignore_eos, return_token_ids, as scripts/bench_serve.py), on a tiny random model
(tests/conftest.py's) and one CPU thread. Prints both throughputs and the CPU time per generated
token of each process; their difference is what serving costs per token (per step per stream).

By default the model step is a stand-in for a GPU's: it sleeps --step-ms in --gil-releases pieces
(releasing the GIL each time, as each launched torch op and the CUDA sync do) and samples random
tokens, while everything on the host (scheduler, batch records, the server) runs for real. That is
the regime of issue 14's target, where the server's Python work ran beside the engine's host work
while the device computes. Offline, a step takes --step-ms plus the engine's bookkeeping; served,
whatever the server adds shows in tok/s. (The server before serve-speed's changes measured 51% of
offline here, near the 45% that scripts/bench_serve.py measured on an H200.) --step-ms 0 runs the
tiny model itself instead; on a 2-core machine shared with other jobs that mode is too noisy to
compare. The server runs its engine in a process of its own (it used to be a thread, taking turns
with the event loop for the GIL): the stand-in is put there too (this script is the spawned
engine's main module, see STAND_IN_VAR), and the CPU time of the HTTP process and of the engine
process are reported apiece. On a machine with fewer cores than busy processes (2 cores: the
clients, the HTTP process and the engine) they compete for cores instead.

    python scripts/serve_overhead.py                # 256 clients, bench.py's lengths, 8 ms steps
    python scripts/serve_overhead.py --step-ms 0 --max-input-len 64 --max-output-len 300

The clients run in their own processes (scripts/stream_clients.py), and their CPU time is reported
too, so a run where they could not keep up is visible."""

import argparse
import json
import os
import sys
import tempfile
import time
from random import randint, seed

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU measurement, whatever the machine has
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "serve")]
from server_process import Server  # noqa: E402
from stream_clients import run_level  # noqa: E402

# The engine's shape for both runs: small blocks so that the tiny model's cache holds every request.
ENGINE_OPTIONS = {"max_model_len": 2048, "kvcache_block_size": 16, "num_kvcache_blocks": 16384,
                  "max_num_seqs": 512, "cpu_threads": 1}


def workload(num_seqs: int, vocab: int, min_len: int, max_input_len: int, max_output_len: int):
    seed(0)
    return [([randint(0, vocab - 1) for _ in range(randint(min_len, max_input_len))],
             randint(min_len, max_output_len)) for _ in range(num_seqs)]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def use_stand_in_step(step_ms: float, num_releases: int, vocab_size: int) -> None:
    """Make every model step sleep step_ms, in num_releases pieces, and sample uniformly random tokens."""
    import random

    from nanovllm.engine.step import StepOutput
    from nanovllm.runner.model_runner import ModelRunner

    def run(self, batch):
        for _ in range(num_releases):
            time.sleep(step_ms / 1000 / num_releases)
        return StepOutput([random.randrange(vocab_size) for _ in batch.sample_rows])
    ModelRunner.run = run


def offline(model: str, jobs, step_ms: float, num_releases: int, vocab_size: int) -> dict:
    from nanovllm import LLM, SamplingParams

    if step_ms:
        use_stand_in_step(step_ms, num_releases, vocab_size)
    llm = LLM(model, **ENGINE_OPTIONS)
    try:
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for _, n in jobs]
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        cpu, start = time.process_time(), time.perf_counter()
        outputs = llm.generate([p for p, _ in jobs], params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        llm.shutdown()
    num_tokens = sum(len(o["token_ids"]) for o in outputs)
    return {"tok_s": num_tokens / elapsed, "cpu_us_per_token": cpu / num_tokens * 1e6, "tokens": num_tokens}


def served(model: str, jobs, clients: int, extra: list[str], step_ms: float, num_releases: int,
           vocab_size: int) -> dict:
    options = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_OPTIONS.items()]
    launcher = ((os.path.abspath(__file__), SERVER_FLAG, str(step_ms), str(num_releases), str(vocab_size))
                if step_ms else ("-m", "nanovllm.serve"))
    server = Server(model, *options, *extra, api_key=None, launcher=launcher)
    try:
        run_level(server.url, [([1, 2, 3], 8)], 1)  # warm-up
        engines = server.engine_pids()
        http_cpu, engine_cpu = process_cpu_s(server.proc.pid), sum(map(process_cpu_s, engines))
        level = run_level(server.url, jobs, clients)
        http_cpu = process_cpu_s(server.proc.pid) - http_cpu
        engine_cpu = sum(map(process_cpu_s, engines)) - engine_cpu
    finally:
        server.terminate()
    per_token = 1e6 / level["tokens"]
    return {**level, "cpu_us_per_token": (http_cpu + engine_cpu) * per_token,
            "http_cpu_us_per_token": http_cpu * per_token, "engine_cpu_us_per_token": engine_cpu * per_token,
            "engine_processes": len(engines), "client_cpu_us_per_token": level["client_cpu_s"] * per_token}


# `serve_overhead.py --as-server STEP_MS RELEASES VOCAB MODEL [serve options]`: the server on the stand-in.
SERVER_FLAG = "--as-server"
# "STEP_MS RELEASES VOCAB" in the server's environment: its spawned engine process, which imports this
# script as its main module (not running main()), puts the stand-in step in place on import, below.
STAND_IN_VAR = "NANOVLLM_SERVE_OVERHEAD_STAND_IN"
if os.environ.get(STAND_IN_VAR) and __name__ != "__main__":
    _step_ms, _releases, _vocab = os.environ[STAND_IN_VAR].split()
    use_stand_in_step(float(_step_ms), int(_releases), int(_vocab))


def main() -> None:
    if sys.argv[1:2] == [SERVER_FLAG]:
        from nanovllm.serve.cli import serve_main

        os.environ[STAND_IN_VAR] = " ".join(sys.argv[2:5])
        sys.exit(serve_main(sys.argv[5:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a tiny random Qwen3 made in a temp dir")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=8.0,
                        help="the stand-in model step (a 256-row decode step of Qwen3-0.6B on an H200: "
                             "~8 ms); 0: run the tiny model")
    parser.add_argument("--gil-releases", type=int, default=30,
                        help="the stand-in step sleeps in this many pieces: a step launching that many "
                             "torch ops releases the GIL as often (a CUDA-graph decode step still runs a "
                             "few dozen: input copies, the replay, sampling)")
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--server-option", action="append", default=[],
                        help="passed to `nanovllm serve`, e.g. --server-option=--stream-interval=4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from conftest import make_model_dir
            make_model_dir(tmp, max_position_embeddings=ENGINE_OPTIONS["max_model_len"])
            model = tmp
        from transformers import AutoConfig
        vocab_size = AutoConfig.from_pretrained(model).vocab_size
        jobs = workload(args.clients, vocab_size, args.min_len, args.max_input_len, args.max_output_len)
        srv = served(model, jobs, args.clients, args.server_option, args.step_ms, args.gil_releases,
                     vocab_size)
        off = offline(model, jobs, args.step_ms, args.gil_releases, vocab_size)
    print(json.dumps({"offline": off, "server": srv}, indent=1))
    overhead = srv["cpu_us_per_token"] - off["cpu_us_per_token"]
    print(f"\n{args.clients} clients, {srv['tokens']} tokens: offline {off['tok_s']:.0f} tok/s, server "
          f"{srv['output_tok_s']:.0f} tok/s ({srv['output_tok_s'] / off['tok_s']:.1%}); ITL p50 "
          f"{srv['itl_p50_ms']:.1f}ms p99 {srv['itl_p99_ms']:.1f}ms")
    print(f"CPU per token: offline {off['cpu_us_per_token']:.0f}us, server {srv['cpu_us_per_token']:.0f}us "
          f"(HTTP process {srv['http_cpu_us_per_token']:.0f}us, engine process "
          f"{srv['engine_cpu_us_per_token']:.0f}us) -> serving overhead {overhead:.0f}us per token (per step "
          f"per stream); clients {srv['client_cpu_us_per_token']:.0f}us per token in "
          f"{srv['client_processes']} processes")


if __name__ == "__main__":
    main()
