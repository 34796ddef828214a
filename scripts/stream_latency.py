"""One stream's decode latency: a 512-token prompt of random ids, 1024 output tokens, temperature 0.6,
ignore_eos, after one warm-up request; prints ms per output token (prefill included) and tokens/s.

    python scripts/stream_latency.py --model MODEL_DIR [--quantization fp8] [--kv-cache-dtype fp8]
    python scripts/stream_latency.py --model MODEL_DIR --streams 16 --output-len 512
    python scripts/stream_latency.py --model M --workload copy --speculative-config '{"method": "ngram", ...}'

--streams N: N requests of the random workload at once, each its own prompt; prints ms per decode step
  (the run's time over --output-len steps, prefill included): BENCHMARKS.md's "16 streams" rows.
--workload copy: the prompt is a 256-token passage written twice, and the output is greedy with a
  repetition-prone random model, so n-gram proposals find matches (speculative decoding's copy case).
--repeating (with --load-format dummy): random weights drawn 1e-5 wide with tied embeddings, so that every
  layer's output is small against the token's embedding and greedy decoding repeats the last token; on the
  copy workload every n-gram draft is then right, whatever the shape (the speed of a step does not depend
  on the weights' values). Measures speculation with every proposal accepted at sizes such as Qwen3-8B,
  whose plain random weights never repeat their prompt. A draft model in --speculative-config (a folder
  with a config.json) is drawn the same way, so its proposals are right too: `"model": "configs/Qwen3-8B"`
  beside `--model configs/Qwen3-8B` is draft = target (the machinery's cost), `"configs/Qwen3-0.6B"` a
  small draft whose proposals all hold (its speed as the best case).
--workload summarize: a chat model (e.g. `--model smollm2`) asked to summarise a passage of ~280 words,
  greedy, up to --output-len tokens, ending at its EOS: a summary quotes its source, which n-gram drafts
  find (speculative decoding's realistic case on real weights).
--workload copy-code: the chat model asked to repeat a few lines of code and add one function in their
  style: an output that is mostly its prompt.
Only `from nanovllm import LLM, SamplingParams` is used, and only the options given reach LLM(...), so
the same command times any engine with nano-vllm's API (PYTHONPATH pointing at it)."""

import argparse
import json
import os
import tempfile
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams

# --repeating's weight scale: small enough that 36 layers of Qwen3-8B's width add far less than an
# embedding holds (a layer's output scales with its square), well inside bf16's exponent range.
REPEATING_INIT_STD = 1e-5

# A passage of our own for the summarize workload.
PASSAGE = (
    "The harbour town of Kellmouth grew around a single stone pier built in 1783 to shelter fishing boats"
    " from the autumn gales. For most of the nineteenth century the town lived on herring: in a good year"
    " more than two hundred boats landed their catch at the pier, and the smoke houses along Quay Street "
    "worked day and night. The railway reached Kellmouth in 1869, and with it came the first summer "
    "visitors, who rented rooms above the net lofts and walked the cliff path to the lighthouse at Garrow"
    " Point. When the herring shoals moved north after 1910, the fleet shrank to a dozen boats within a "
    "generation, and the town turned to the visitors instead. The smoke houses became tea rooms, the net "
    "lofts became guest houses, and the old lifeboat station became a museum of the fishing years. Today "
    "Kellmouth has about four thousand residents, a population that triples in August. The pier still "
    "stands, repaired after the storm of 1953 took away its seaward end, and six boats still fish from it"
    " for crab and lobster. The town council has argued for years about a marina: its supporters say it "
    "would bring sailing visitors in the spring and autumn, when the guest houses stand empty; its "
    "opponents say it would cut the harbour off from the few boats that still work there, and that the "
    "town would lose the last of the trade that built it. A public inquiry is due to report next year, "
    "and whatever it decides, the argument is likely to go on, because it is really an argument about "
    "what kind of place Kellmouth wants to be.")

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n")
CHAT_WORKLOADS = {
    "summarize": "Summarize this text in a few sentences, keeping its own words where you can:\n\n" + PASSAGE,
    "copy-code": f"Repeat this code exactly, then add a function div in the same style:\n{CODE}",
}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--workload", choices=["random", "copy", *CHAT_WORKLOADS], default="random")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--speculative-config", default=None, help="JSON, as vLLM's option")
    parser.add_argument("--load-format", default="auto",
                        help="dummy: random weights from config.json alone (no tokenizer: token ids only)")
    parser.add_argument("--repeating", action="store_true",
                        help="with --load-format dummy: weights whose greedy output repeats its last token")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap scheduling on or off (default: the engine's, on with CUDA); with "
                             "n-gram drafts, --no-async-scheduling times the synchronous loop")
    parser.add_argument("--streams", type=int, default=1,
                        help="requests at once, each its own random prompt (--workload random only)")
    parser.add_argument("--label", default="", help="printed first on the result line")
    args = parser.parse_args()
    if args.streams < 1:
        parser.error(f"--streams must be at least 1, got {args.streams}")
    if args.streams > 1 and args.workload != "random":
        parser.error(f"--streams {args.streams} runs the random workload; drop --workload {args.workload}")
    if args.load_format == "dummy" and args.workload in CHAT_WORKLOADS:
        parser.error(f"--workload {args.workload} needs the model's tokenizer; --load-format dummy has none")
    if args.repeating and args.load_format != "dummy":
        parser.error("--repeating draws random weights; add --load-format dummy")
    model = os.path.expanduser(args.model)
    scratch = tempfile.TemporaryDirectory(prefix="nanovllm-repeating-")  # removed when the script ends
    spec = json.loads(args.speculative_config) if args.speculative_config is not None else None
    if args.repeating:
        model = repeating_config(model, scratch.name)
        draft = os.path.expanduser(str(spec["model"])) if spec and spec.get("model") else None
        if draft and os.path.isfile(os.path.join(draft, "config.json")):  # a draft repeats its last token too
            os.mkdir(os.path.join(scratch.name, "draft"))
            spec["model"] = repeating_config(draft, os.path.join(scratch.name, "draft"))
    options = {"max_model_len": 4096, "load_format": args.load_format,
               "skip_tokenizer_init": args.load_format == "dummy"}
    for name in ("quantization", "kv_cache_dtype", "async_scheduling"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if spec is not None:
        options["speculative_config"] = spec
    llm = LLM(model, **options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16), use_tqdm=False)
    seed(1)
    # Token ids below 10,000 (as bench.py draws them), inside a smaller vocabulary where the engine says so.
    config = getattr(llm, "config", None)
    top = min(10000, config.hf_config.vocab_size - 1) if hasattr(config, "hf_config") else 10000
    if args.workload == "random":
        prompts = [[randint(0, top) for _ in range(args.prompt_len)] for _ in range(args.streams)]
        prompt = prompts[0]
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    elif args.workload == "copy":
        passage = [randint(0, top) for _ in range(args.prompt_len // 2)]
        prompt = passage + passage
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    else:
        question = CHAT_WORKLOADS[args.workload]
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                   add_generation_prompt=True, tokenize=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    if args.streams > 1:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(output["token_ids"]) for output in outputs)
        print(f"{args.label} {args.streams} streams (random): {tokens} tok in {elapsed:.2f}s -> "
              f"{tokens / elapsed:.1f} tok/s ({elapsed / args.output_len * 1e3:.3f} ms/step incl. prefill)",
              flush=True)
        return
    start = time.perf_counter()
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    tokens = len(output["token_ids"])
    print(f"{args.label} single stream ({args.workload}): {tokens} tok in {elapsed:.2f}s -> "
          f"{tokens / elapsed:.1f} "
          f"tok/s ({elapsed / tokens * 1e3:.3f} ms/token incl. prefill){acceptance(output)}", flush=True)


def repeating_config(model_dir: str, out_dir: str) -> str:
    """out_dir with model_dir's config.json, drawn 1e-5 wide with tied embeddings (see --repeating): each
    layer then adds under 1e-6 to a residual stream of ~1e-5 embeddings, so the final hidden state points at
    the current token's embedding, and with the LM head tied to the embeddings that token scores highest."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.update(initializer_range=REPEATING_INIT_STD, tie_word_embeddings=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def acceptance(output: dict) -> str:
    """", drafts accepted a / b (x%)" where the engine reports speculative decoding's counters."""
    metrics = output.get("metrics") or {}
    drafted = metrics.get("num_draft_tokens", 0)
    if not drafted:
        return ""
    accepted = metrics["num_accepted_tokens"]
    return f", drafts accepted {accepted} / {drafted} ({accepted / drafted:.0%})"


if __name__ == "__main__":
    main()
