"""Soak test (not part of the CI run): thousands of mixed requests on a tiny random model for N minutes,
through the engine loop (add_request / step), with the scheduler's invariants checked after every
step and the process's memory sampled throughout.

    python scripts/soak.py                       # 2 minutes, CPU, a tiny random Qwen3 with a small cache
    python scripts/soak.py --minutes 30 --seed 7
    python scripts/soak.py --speculate           # n-gram drafts verified in the overlap loop
    python scripts/soak.py --structured --kv-cache-dtype int8   # constrained outputs; a quantized cache

Each round adds a few requests: prompts of random length built on a few shared prefixes (so the
prefix cache is hit), token ids or text, with random sampling parameters (greedy, temperature, top-k,
top-p, min-p, seeds, stop strings, ignore_eos, max_tokens), with --structured a quarter of them held to a
choice, a regex or a JSON schema; some bad inputs that must be refused with ValueError/TypeError at add
time; and some aborts of queued or running requests. The KV cache is small, so requests are preempted.
It fails (exit code 1) if:
- an invariant breaks (nanovllm.engine.invariants: ref counts, free list, prefix-cache hashes);
- a request is lost, finishes twice, finishes after its abort, or overruns max_tokens;
- a bad input is accepted, or a good one refused;
- a greedy canary prompt, resent every few rounds, changes its output;
- a constrained request stops (its constraint complete) with text its constraint does not allow;
- the resident memory grows by more than --rss-growth-mib after the warm-up (the first quarter).
Prints the figures at the end."""

import argparse
import gc
import json
import os
import random
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout
sys.path.insert(0, os.path.join(REPO, "tests"))  # conftest.make_model_dir builds the tiny model

import torch  # noqa: E402
from conftest import make_model_dir  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.invariants import check_invariants  # noqa: E402
from nanovllm.sampling_params import StructuredOutputsParams  # noqa: E402

# A small cache (64 blocks of 4 tokens) under up to 16 running requests of up to 96 tokens: preemption.
ENGINE = dict(kvcache_block_size=4, num_kvcache_blocks=64, max_model_len=96, max_num_seqs=16,
              max_num_batched_tokens=128)
# --speculate: short n-grams, so that the random model's few repeats give drafts, most of them rejected.
SPECULATE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_PROMPT_TOKENS = 48  # + max_tokens (at most 32) stays under max_model_len
MAX_IN_FLIGHT = 48  # queued requests beyond this wait for the next round
RSS_SAMPLE_S = 2.0
CANARY_EVERY = 25  # rounds
BAD_FRACTION = 0.05
ABORT_FRACTION = 0.05  # of the requests, aborted while queued or running
GOOD_ERRORS = (ValueError, TypeError)
# --structured: the share of good requests held to a constraint, and the constraints, each with the test
# a stopped request's text must pass.
STRUCTURED_FRACTION = 0.25
CHOICES = ["yes", "no", "maybe so"]
REGEX = "[a-c]{1,5}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict) or value.keys() != {"a"}:
        return False
    return isinstance(value["a"], int) and not isinstance(value["a"], bool)  # JSON's true is no integer


CONSTRAINTS = {
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), follows_schema),
}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    options = dict(max_tokens=rng.randint(1, 32), ignore_eos=rng.random() < 0.5)
    if kind < 0.3:
        options["temperature"] = 0.0
    else:
        options.update(temperature=rng.choice([0.3, 0.7, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9, 0.5]),
                       top_k=rng.choice([-1, 1, 5, 50]), min_p=rng.choice([0.0, 0.05]))
    if rng.random() < 0.2:
        options["seed"] = rng.randrange(2**31)
    if rng.random() < 0.1:
        options["stop"] = rng.choice(["the", ".", "capital"])
    if rng.random() < 0.1:
        options["stop_token_ids"] = [rng.randrange(1, 400)]
    return SamplingParams(**options)


def constrained_params(rng: random.Random, kind: str) -> SamplingParams:
    """random_params' sampling held to CONSTRAINTS[kind], with room for the output to complete (stop
    strings and ids left out: they would end it early)."""
    sampling = random_params(rng)
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p, seed=sampling.seed, max_tokens=32,
                          structured_outputs=CONSTRAINTS[kind][0])


def bad_request(rng: random.Random, vocab: int):
    """(prompt, params) that add_request must refuse; params may itself fail to construct."""
    case = rng.randrange(7)
    if case == 0:
        return "", SamplingParams()
    if case == 1:
        return [1, 2, vocab + rng.randrange(1000)], SamplingParams()
    if case == 2:
        return [-1, 5], SamplingParams()
    if case == 3:
        return [5] * 90, SamplingParams(max_tokens=20)  # beyond max_model_len
    if case == 4:
        return 3.5, SamplingParams()
    if case == 5:
        return [1, 2], "greedy"
    return [1, 2], SamplingParams(temperature=-1.0)  # raises while building the request


class Soak:
    def __init__(self, llm: LLM, rng: random.Random, structured: bool = False) -> None:
        self.llm, self.rng, self.structured = llm, rng, structured
        self.vocab = llm.config.hf_config.vocab_size
        self.prefixes = [[rng.randrange(1, self.vocab) for _ in range(rng.randint(4, 24))] for _ in range(6)]
        self.live: dict[int, SamplingParams] = {}  # id -> params of requests not yet finished/aborted
        self.done: set[int] = set()
        self.aborted: set[int] = set()
        self.counts = dict(added=0, finished=0, aborted=0, refused=0, steps=0, canaries=0, constrained=0)
        self.constraint: dict[int, str] = {}  # id -> CONSTRAINTS kind of the live constrained requests
        self.canary_prompt = self.prefixes[0] + [7, 8, 9]
        self.canary_ids: dict[int, None] = {}
        self.canary_output: list[int] | None = None

    def add_good(self) -> None:
        rng = self.rng
        prompt = rng.choice(self.prefixes) + [rng.randrange(1, self.vocab) for _ in range(rng.randint(0, 24))]
        if rng.random() < 0.2:  # text prompts go through the tokenizer
            text = self.llm.tokenizer.decode(prompt)
            if 0 < len(self.llm.tokenizer.encode(text)) <= MAX_PROMPT_TOKENS:  # re-encoding may grow it
                prompt = text
        constrained = self.structured and rng.random() < STRUCTURED_FRACTION
        kind = rng.choice(list(CONSTRAINTS)) if constrained else None
        params = constrained_params(rng, kind) if kind else random_params(rng)
        seq_id = self.llm.add_request(prompt, params)
        self.live[seq_id] = params
        if kind:
            self.constraint[seq_id] = kind
        self.counts["added"] += 1

    def add_bad(self) -> None:
        try:
            prompt, params = bad_request(self.rng, self.vocab)
            self.llm.add_request(prompt, params)
        except GOOD_ERRORS:
            self.counts["refused"] += 1
            return
        raise AssertionError(f"a bad request was accepted: {prompt!r:.60} {params!r:.80}")

    def abort_one(self) -> None:
        seq_id = self.rng.choice(list(self.live))
        if self.llm.abort_request(seq_id):
            del self.live[seq_id]
            self.constraint.pop(seq_id, None)
            self.aborted.add(seq_id)
            self.counts["aborted"] += 1

    def add_canary(self) -> None:
        seq_id = self.llm.add_request(self.canary_prompt, SamplingParams(temperature=0, max_tokens=16,
                                                                          ignore_eos=True))
        self.live[seq_id] = SamplingParams(max_tokens=16)
        self.canary_ids[seq_id] = None
        self.counts["added"] += 1

    def step(self) -> None:
        outputs, _ = self.llm.step()
        self.counts["steps"] += 1
        check_invariants(self.llm.engine.scheduler)
        for seq_id, output in outputs:
            assert seq_id not in self.done, f"request {seq_id} finished twice"
            assert seq_id not in self.aborted, f"request {seq_id} finished after its abort"
            params = self.live.pop(seq_id)
            assert output["finish_reason"] in ("stop", "length"), output["finish_reason"]
            assert len(output["token_ids"]) <= params.max_tokens, "max_tokens overrun"
            self.done.add(seq_id)
            self.counts["finished"] += 1
            kind = self.constraint.pop(seq_id, None)
            if kind and output["finish_reason"] == "stop":  # complete: its text must pass the constraint
                text = self.llm.tokenizer.decode(output["token_ids"], skip_special_tokens=True)
                assert CONSTRAINTS[kind][1](text), f"a {kind} constraint stopped with {text!r}"
                self.counts["constrained"] += 1
            if seq_id in self.canary_ids:
                self.counts["canaries"] += 1
                if self.canary_output is None:
                    self.canary_output = output["token_ids"]
                assert output["token_ids"] == self.canary_output, "the greedy canary changed its output"

    def round(self, index: int) -> None:
        rng = self.rng
        for _ in range(rng.randint(0, 4)):
            if len(self.live) >= MAX_IN_FLIGHT:
                break
            if rng.random() < BAD_FRACTION:
                self.add_bad()
            else:
                self.add_good()
        if index % CANARY_EVERY == 0:
            self.add_canary()
        if self.live and rng.random() < ABORT_FRACTION * 2:  # about 2 requests arrive per round
            self.abort_one()
        if not self.llm.is_finished():
            self.step()

    def drain(self) -> None:
        while not self.llm.is_finished():
            self.step()
        assert not self.live, f"{len(self.live)} requests never finished"
        bm = self.llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == len(bm.blocks), "blocks still held after every request ended"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-growth-mib", type=float, default=32.0,
                        help="largest RSS growth allowed after the warm-up (the first quarter of the run)")
    parser.add_argument("--structured", action="store_true",
                        help="a quarter of the requests held to a choice, a regex or a JSON schema "
                             "(needs xgrammar)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"])
    parser.add_argument("--speculate", action="store_true",
                        help="n-gram speculative decoding (k = 3) in the overlap loop (async_scheduling): "
                             "drafts taken as accepted until read, rejections voiding the next step's rows")
    args = parser.parse_args()
    engine = dict(ENGINE, kv_cache_dtype=args.kv_cache_dtype)
    if args.speculate:
        engine.update(async_scheduling=True, speculative_config=SPECULATE)
    rng = random.Random(args.seed)
    # The model is tiny: one thread computes a step in about a millisecond, and more threads only
    # contend for the cores (on a shared 2-core host, 100x slower).
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as path:
        make_model_dir(path)
        llm = LLM(path, **engine)
        soak = Soak(llm, rng, args.structured)
        start = time.monotonic()
        end, warm = start + args.minutes * 60, start + args.minutes * 15
        samples: list[tuple[float, float]] = []
        next_sample, index = start, 0
        while time.monotonic() < end:
            soak.round(index)
            index += 1
            if time.monotonic() >= next_sample:
                gc.collect()
                samples.append((time.monotonic() - start, rss_mib()))
                next_sample += RSS_SAMPLE_S
        soak.drain()
        gc.collect()
        samples.append((time.monotonic() - start, rss_mib()))
        elapsed = time.monotonic() - start
        llm.shutdown()
    after_warm = [rss for t, rss in samples if t >= warm - start]
    baseline = next(rss for t, rss in samples if t >= warm - start)
    growth = max(after_warm) - baseline
    c = soak.counts
    print(f"{'duration':<28}{elapsed:>10.1f} s")
    for name in ("added", "finished", "aborted", "refused", "canaries", "steps"):
        print(f"{name:<28}{c[name]:>10}")
    if args.structured:
        print(f"{'constrained, complete':<28}{c['constrained']:>10}")
    print(f"{'preemptions':<28}{llm.engine.scheduler.num_preemptions:>10}")
    print(f"{'prefix-cache hit tokens':<28}{llm.engine.scheduler.block_manager.num_cache_hit_tokens:>10}")
    print(f"{'steps/s':<28}{c['steps'] / elapsed:>10.1f}")
    if (spec := llm.engine.stats().spec_decode) is not None:
        print(f"{'drafts accepted':<28}{spec.num_accepted_tokens:>10} of {spec.num_draft_tokens}")
    print(f"{'RSS start / warm / peak / end':<28}{samples[0][1]:>7.1f} / {baseline:.1f} / "
          f"{max(rss for _, rss in samples):.1f} / {samples[-1][1]:.1f} MiB")
    print(f"{'RSS growth after warm-up':<28}{growth:>10.1f} MiB (bound {args.rss_growth_mib} MiB)")
    assert c["finished"] + c["aborted"] == c["added"], "requests lost"
    if growth > args.rss_growth_mib:
        print("FAIL: memory grew after the warm-up")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
