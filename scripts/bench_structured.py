"""Structured outputs' cost: bench.py's workload (256 requests, 100..1024 tokens in and out, temperature
0.6, ignore_eos) with a fraction of the requests constrained to a JSON schema, beside the same workload
unconstrained, on one engine, in alternating rounds. Then the token bitmask's parts per step at that
many rows: filling it on the host (xgrammar matchers) and applying it on the device.

    python scripts/bench_structured.py --model MODEL_DIR --tokenizer TOKENIZER_DIR [--fraction 0.5]

Throughput counts the tokens generated (a constrained request ends early when its JSON is complete, which
random weights seldom do: the schema's free strings take almost any token). The model's own tokenizer
must hold the JSON characters; a random model's word-level one does not, hence --tokenizer (any byte-level
tokenizer whose ids fit the model's vocabulary, e.g. SmolLM2's). Needs xgrammar (the `structured` extra)."""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import make_workload  # noqa: E402
from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["summary", "tags"]}


def constrained(params: list[SamplingParams], fraction: float) -> list[SamplingParams]:
    """The same params with every k-th request (k = 1 / fraction) held to SCHEMA."""
    every = max(1, round(1 / fraction)) if fraction > 0 else 0
    out = []
    for i, p in enumerate(params):
        q = p.clone()
        if every and i % every == 0:
            q.structured_outputs = StructuredOutputsParams(json=SCHEMA)
        out.append(q)
    return out


BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["red", "green"]}},
           "required": ["ok", "label"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]


def check_outputs(llm: LLM, prompts: list[list[int]]) -> str:
    """Constrained outputs on this device obey their constraints: a choice is one of the choices, a
    bounded schema's JSON parses to an allowed object (greedy and sampled). Raises when one does not."""
    import json

    cases = []
    for i, prompt in enumerate(prompts[:16]):
        temperature = 0.0 if i % 2 else 1.0
        if i % 4 < 2:
            cases.append((prompt, SamplingParams(temperature=temperature, max_tokens=32, seed=i,
                                                 structured_outputs=StructuredOutputsParams(choice=CHOICES))))
        else:
            cases.append((prompt, SamplingParams(temperature=temperature, max_tokens=64, seed=i,
                                                 structured_outputs=StructuredOutputsParams(
                                                     json=BOUNDED, disable_any_whitespace=True))))
    outputs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for (_, params), output in zip(cases, outputs):
        text = output.outputs[0].text
        if params.structured_outputs.choice is not None:
            ok = text in CHOICES
        else:
            value = json.loads(text)
            ok = (set(value) == {"ok", "label"} and isinstance(value["ok"], bool)
                  and value["label"] in ("red", "green"))
        if not ok:
            raise AssertionError(f"a constrained output broke its constraint: {text!r}")
    return f"{len(cases)}/{len(cases)} constrained outputs obey their constraints"


def fits_grammar(llm: LLM, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of SCHEMA accepts every token of an output (the bitmask held)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(llm.engine._grammars.compile(StructuredOutputsParams(json=SCHEMA)))
    return all(matcher.accept_token(token) for token in token_ids)


def timed_round(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for output, p in zip(outputs, params):
        if p.structured_outputs is not None and not fits_grammar(llm, output.outputs[0].token_ids):
            raise AssertionError("a constrained output left its schema's grammar")
    return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed


def bitmask_costs(llm: LLM, rows: int, constrained_rows: int, reps: int = 20) -> dict[str, float]:
    """ms per step: the host fill of `constrained_rows` matchers into a [rows, vocab/32] bitmask, its
    copy to the device, and xgrammar's in-place apply on [rows, vocab] logits."""
    import xgrammar

    engine = llm.engine
    compiled = engine._grammars.compile(StructuredOutputsParams(json=SCHEMA))
    vocab = llm.config.hf_config.vocab_size
    opening = llm.tokenizer.encode('{"summary": "', add_special_tokens=False)
    matchers = []
    for _ in range(constrained_rows):
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in opening:
            matcher.accept_token(token)
        matchers.append(matcher)
    bitmask = xgrammar.allocate_token_bitmask(rows, vocab)
    start = time.perf_counter()
    for _ in range(reps):
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
    out = {"fill_ms": (time.perf_counter() - start) / reps * 1e3}
    batch = xgrammar.BatchGrammarMatcher(max_threads="auto")
    indices = list(range(constrained_rows))
    start = time.perf_counter()
    for _ in range(reps):
        batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
    out["batch_fill_ms"] = (time.perf_counter() - start) / reps * 1e3
    if torch.cuda.is_available():
        logits = torch.randn(rows, vocab, device="cuda")
        start = time.perf_counter()
        for _ in range(reps):
            device_mask = bitmask.pin_memory().to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        out["copy_ms"] = (time.perf_counter() - start) / reps * 1e3
        xgrammar.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab, indices=indices)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            xgrammar.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab, indices=indices)
        torch.cuda.synchronize()
        out["apply_ms"] = (time.perf_counter() - start) / reps * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", default=None,
                        help="a byte-level tokenizer folder (default: the model's)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.5, help="of the requests constrained")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    llm = LLM(os.path.expanduser(args.model), tokenizer=args.tokenizer, load_format=args.load_format,
              max_model_len=args.max_model_len)
    min_len = min(args.min_len, args.max_input_len, args.max_output_len)
    prompts, plain = make_workload(args.num_seqs, llm.config.hf_config.vocab_size, min_len,
                                   args.max_input_len,
                                   min_len, args.max_output_len)
    mixed = constrained(plain, args.fraction)
    llm.generate(prompts[:4], mixed[:4], use_tqdm=False)  # warm-up, and the schema compiled once
    rates = {"plain": [], "constrained": []}
    for round_ in range(args.rounds):
        for name, params in (("plain", plain), ("constrained", mixed)):
            tokens, elapsed = timed_round(llm, prompts, params)
            rates[name].append(tokens / elapsed)
            print(f"round {round_ + 1} {name:11s}: {tokens} tok in {elapsed:.2f}s -> "
                  f"{tokens / elapsed:,.0f} tok/s",
                  flush=True)
    print(check_outputs(llm, prompts))
    best = {name: max(values) for name, values in rates.items()}
    num_constrained = sum(p.structured_outputs is not None for p in mixed)
    costs = bitmask_costs(llm, args.num_seqs, num_constrained)
    print(f"constrained {num_constrained}/{args.num_seqs}: {best['constrained']:,.0f} tok/s = "
          f"{best['constrained'] / best['plain']:.3f}x of plain {best['plain']:,.0f} tok/s (best of "
          f"{args.rounds})")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in costs.items())
    print(f"bitmask per step at {args.num_seqs} rows: {parts}")


if __name__ == "__main__":
    main()
