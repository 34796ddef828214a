"""What compiles during bench.py's timed run (GPU): every Triton kernel variant the engine's own kernels
build (name, seconds, phase) and every torch.compile frame, split into start-up (LLM() and the warm-up
generate) and the timed generate. A variant built in the timed run stalls the whole batch while it
compiles (on a cold cache, tenths of a second each), so after start-up the count should be zero.

    python scripts/compile_watch.py [--model configs/Qwen3-0.6B] [bench.py's workload options]
    python scripts/compile_watch.py --enforce-eager --num-seqs 16     # decode steps without CUDA graphs
    python scripts/compile_watch.py --workload shared-prefix|long-prompts [--model M]
        (scripts/prefix_long_workloads.py's, one after the other as that script runs them: the named
        one is timed after the other has run, when it is long-prompts; alone when shared-prefix)

Prints one JSON line: per phase the Triton builds (count, seconds, by kernel) and Dynamo frames; then, for
each kernel built in the timed run, the cache keys of all its builds, to compare."""

import collections
import json
import os
import sys
import time

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "Qwen3-0.6B")


class TritonBuilds:
    """Wraps JITFunction._do_compile (an in-memory cache miss: a compile, or a load from the disk cache)
    and records each under the current phase, with its cache key (the specialization and launch options
    that made it a new variant)."""

    def __init__(self) -> None:
        self.phase = "start-up"
        self.builds: dict[str, list[tuple[str, float, str]]] = collections.defaultdict(list)
        original = JITFunction._do_compile
        watch = self

        def do_compile(fn, key, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(fn, key, *args, **kwargs)
            finally:
                watch.builds[watch.phase].append((fn.__name__, time.perf_counter() - start, str(key)))

        JITFunction._do_compile = do_compile

    def summary(self, phase: str) -> dict:
        builds = self.builds[phase]
        by_kernel = collections.Counter(name for name, _, _ in builds)
        return dict(count=len(builds), seconds=round(sum(s for _, s, _ in builds), 2),
                    by_kernel=dict(by_kernel))

    def keys_of_timed(self) -> dict[str, list[str]]:
        """For each kernel built in the timed run, the cache keys of all its builds (start-up's first):
        what differs between them is what a start-up warm-up missed."""
        timed = {name for name, _, _ in self.builds["timed"]}
        return {name: [key for phase in ("start-up", "timed")
                       for n, _, key in self.builds[phase] if n == name]
                for name in sorted(timed)}


def dynamo_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]  # frames compiled


def pop_workload() -> str:
    """The --workload argument (removed from sys.argv, whose rest is bench.py's options): bench by default."""
    if "--workload" not in sys.argv:
        return "bench"
    i = sys.argv.index("--workload")
    workload = sys.argv[i + 1]
    del sys.argv[i:i + 2]
    if workload not in WORKLOADS:
        sys.exit(f"--workload must be one of {WORKLOADS}")
    return workload


WORKLOADS = ("bench", "shared-prefix", "long-prompts")


def main() -> None:
    workload = pop_workload()
    sys.argv += [] if "--model" in sys.argv else ["--model", CONFIG, "--load-format", "dummy"]
    args = bench.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compile_watch.py: it watches the GPU kernels' builds: run it on a CUDA GPU")
    watch = TritonBuilds()
    start = time.perf_counter()
    options = dict(load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
                   attention_backend=args.attention_backend, skip_tokenizer_init=args.load_format == "dummy")
    if args.enforce_eager and workload != "bench":
        sys.exit(f"--enforce-eager applies to the bench workload only, not {workload}")
    if workload == "bench":
        llm = LLM(os.path.expanduser(args.model), max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager, **options)
        llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)
        prompts, params = bench.make_workload(args.num_seqs, llm.config.hf_config.vocab_size,
                                              args.min_input_len, args.max_input_len, args.min_output_len,
                                              args.max_output_len)
    else:
        os.environ["MODEL"] = os.path.expanduser(args.model)
        import prefix_long_workloads as workloads
        llm = workloads.make_llm(**options)
        if workload == "long-prompts":  # as prefix_long_workloads.py runs it: after the shared prefix
            llm.generate(*workloads.shared_prefix_workload(), use_tqdm=False)
            prompts, params = workloads.long_prompts_workload()
        else:
            prompts, params = workloads.shared_prefix_workload()
    startup_s, frames_startup = time.perf_counter() - start, dynamo_frames()
    watch.phase = "timed"
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    timed_s = time.perf_counter() - start
    print(json.dumps(dict(startup=dict(seconds=round(startup_s, 2), triton=watch.summary("start-up"),
                                       dynamo_frames=frames_startup),
                          timed=dict(seconds=round(timed_s, 2), tok_s=round(sum(p.max_tokens for p in params)
                                                                             / timed_s),
                                     triton=watch.summary("timed"),
                                     dynamo_frames=dynamo_frames() - frames_startup))))
    for name, keys in watch.keys_of_timed().items():
        print(f"{name} builds' keys (start-up first):", *keys, sep="\n  ")
    llm.shutdown()


if __name__ == "__main__":
    main()
