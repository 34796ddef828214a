"""Where a speculative cycle goes on the GPU: the device time of each CUDA graph the cycle replays (the
target's verification, the draft's catch-up and its one-token steps), timed with CUDA events around each
replay, against the cycle's wall time; what is left is the device waiting for the host (or work outside
graphs: prefill, eager steps). Without --draft, the same of plain decode steps (what a verification's
rows cost beside a decode step of as many sequences).

    python scripts/spec_cycle.py --model configs/Qwen3-8B --draft configs/Qwen3-0.6B --load-format dummy \
        --repeating --k 4 [--steps 64] [--streams 1] [--no-async-scheduling]
    python scripts/spec_cycle.py --model configs/Qwen3-8B --load-format dummy --streams 5

--streams requests (default one) on the copy workload (each prompt a passage twice, greedy);
`--repeating` draws both models so that every proposal holds (as scripts/stream_latency.py does). The
events add a few microseconds of host work a replay and no device work. Prints one JSON line: per engine
step, the wall milliseconds, the tokens emitted, and per graph kind the replays and device
milliseconds."""

import argparse
import collections
import json
import os
import tempfile
import time

import torch
from stream_latency import repeating_config

from nanovllm import LLM, SamplingParams


def time_replays(graphs, label: str, spans: list) -> None:
    """Wrap graphs.replay (a runner's decode or verification graphs) to record (label, start, end) CUDA
    events around each replay: its device time, the uploads it waits for excluded (queued before)."""
    replay = graphs.replay

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return replay(*args, **kwargs)
        finally:
            end.record()
            spans.append((label, start, end))
    graphs.replay = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", help="the draft model (a folder; a config folder with --load-format "
                                        "dummy); without it, plain decoding")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--steps", type=int, default=64, help="engine steps timed, after 16 warm-up steps")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--streams", type=int, default=1, help="requests run together")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--repeating", action="store_true",
                        help="with --load-format dummy: weights whose greedy output repeats its last token")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the cycle is timed with CUDA events: run it on a CUDA GPU")
    if args.repeating and args.load_format != "dummy":
        parser.error("--repeating draws random weights; add --load-format dummy")
    model = os.path.expanduser(args.model)
    draft = args.draft and os.path.expanduser(args.draft)
    scratch = tempfile.TemporaryDirectory(prefix="nanovllm-spec-cycle-")
    if args.repeating:
        os.mkdir(os.path.join(scratch.name, "target"))
        model = repeating_config(model, os.path.join(scratch.name, "target"))
        if draft:
            os.mkdir(os.path.join(scratch.name, "draft"))
            draft = repeating_config(draft, os.path.join(scratch.name, "draft"))
    options = dict(max_model_len=4096, load_format=args.load_format,
                   skip_tokenizer_init=args.load_format == "dummy")
    if draft:
        options["speculative_config"] = {"model": draft, "num_speculative_tokens": args.k}
    if args.async_scheduling is not None:
        options["async_scheduling"] = args.async_scheduling
    llm = LLM(model, **options)
    engine = llm.engine
    runners = [(engine.executor, "target")]
    if draft:
        runners.append((engine._spec.proposer.runner, "draft"))
    spans: list = []
    for runner, who in runners:
        for graphs, kind in ((runner.decode_graphs, "decode"), (runner.verify_graphs, "verify")):
            if graphs is not None:
                time_replays(graphs, f"{who} {kind}", spans)
    passage = list(range(100, 100 + args.prompt_len // 2))
    room = llm.config.max_model_len - len(passage) * 2  # runs out only where the steps outlast it
    for _ in range(args.streams):
        llm.add_request(passage + passage, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=room))
    for _ in range(16):  # prefill, then the cycles settle
        engine.step()
    torch.cuda.synchronize()
    spans.clear()
    tokens = 0
    start = time.perf_counter()
    for _ in range(args.steps):
        tokens += engine.step().num_decode_tokens  # emitted: a verification's kept drafts and its token
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    replays, device = collections.Counter(), collections.Counter()
    for label, begin, end in spans:
        replays[label] += 1
        device[label] += begin.elapsed_time(end)
    steps = args.steps
    busy = sum(device.values()) / steps
    print(json.dumps(dict(
        k=args.k if draft else 0, streams=args.streams, steps=steps,
        wall_ms_per_step=round(wall * 1e3 / steps, 3),
        tokens_per_step=round(tokens / steps, 2), ms_per_token=round(wall * 1e3 / max(tokens, 1), 3),
        graphs_ms_per_step=round(busy, 3), rest_ms_per_step=round(wall * 1e3 / steps - busy, 3),
        by_graph={label: dict(replays_per_step=round(replays[label] / steps, 2),
                              ms_per_step=round(device[label] / steps, 3)) for label in sorted(device)},
    )), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
