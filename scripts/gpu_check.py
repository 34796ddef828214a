"""GPU checks for the fast path, in one command (see BENCHMARKS.md for recorded results):

    python scripts/gpu_check.py kernels e2e        # numerics: backends vs torch, engine vs transformers
    python scripts/gpu_check.py bench stream       # throughput and single-stream decode latency

kernels: each GPU attention backend against the torch backend (float32 reference) on the same paged
  inputs: prefill, prefill over a cached prefix, decode; page sizes 16 and 256; GQA 16/8; bf16.
e2e: a random-weight Qwen3-0.6B (config in configs/) in bf16: prefill logits vs transformers, and
  greedy tokens of every backend / CUDA-graph / prefix-cache / chunked-prefill setting against the
  torch backend, equal until the first near-tie (top-2 margin of transformers' logits below a bound).
bench, stream, profile (scripts/gpu_speed.py): bench.py's classic workload per backend, CUDA graphs on
  and off; one 512-token prompt, 1024 output tokens: ms per decode step; a one-row step's kernels.
Writes a JSON of everything to $OUT (or the current folder) and prints a short table last."""

import argparse
import gc
import json
import os
import sys
from types import SimpleNamespace

import torch
from transformers import AutoConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.attention import triton_backend  # noqa: E402
from nanovllm.attention.layer import RotaryEmbedding  # noqa: E402
from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.registry import select_backend  # noqa: E402
from nanovllm.llm import prompt_logits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_speed import CONFIG, GPU_BACKENDS, run_bench, run_profile, run_stream  # noqa: E402

# The checks' prompts are short: let triton-fa3 take FA3 for every prefill chunk, as long prompts do.
triton_backend.TritonBackend.FA3_MIN_MEAN_CHUNK = 1
# Random weights drawn wider than the usual 0.02 so that greedy decoding has clear winners.
E2E_INIT_STD = 0.05
results: dict = {}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def paged_case(q_lens, ctx_lens, block_size, heads=16, kv_heads=8, head_dim=128, prefill=True):
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 4
    kw = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, **kw)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, **kw)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables, slots, used = [], [], 0
    for q_len, ctx in zip(q_lens, ctx_lens):
        n = -(-ctx // block_size)
        tables.append(perm[used : used + n])
        used += n
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    width = max(map(len, tables))
    cu_q, cu_k = [0], [0]
    for q_len, ctx in zip(q_lens, ctx_lens):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + ctx)
    i32 = dict(device="cuda", dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=prefill,
        slot_mapping=torch.tensor(slots, device="cuda"),
        seqlens_k=torch.tensor(ctx_lens, **i32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
        cu_seqlens_q=torch.tensor(cu_q, **i32),
        cu_seqlens_k=torch.tensor(cu_k, **i32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(ctx_lens),
        has_prefix=any(q < c for q, c in zip(q_lens, ctx_lens)),
        cu_seqlens_q_host=cu_q,
        seqlens_k_host=ctx_lens,
    )
    total = sum(q_lens)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen, **kw) for h in (heads, kv_heads, kv_heads))
    return q, k, v, k_cache, v_cache, meta


def check_kernels() -> None:
    cases = {
        "prefill": ([300, 1000, 17], [300, 1000, 17], True),
        "prefill-prefix": ([100, 700, 1], [900, 1500, 333], True),
        "decode": ([1] * 6, [1, 77, 512, 1023, 2900, 4096], False),
    }
    cuda = torch.device("cuda")
    torch_backend = select_backend("torch", cuda, 16, torch.float32, max_num_seqs=8, num_kv_heads=8)
    rotary = RotaryEmbedding(AutoConfig.from_pretrained(CONFIG), 128, 8192).to(cuda)

    def layer(k_cache, v_cache):
        return SimpleNamespace(num_heads=16, num_kv_heads=8, head_dim=128, scale=128**-0.5, rotary=rotary,
                               qk_norm=None, k_cache=k_cache, v_cache=v_cache, k_scale=1.0, v_scale=1.0)

    for name in GPU_BACKENDS:
        backend = select_backend(name, cuda, 16, torch.bfloat16, max_num_seqs=8, num_kv_heads=8)
        for block_size in (16, 256):
            for case, (q_lens, ctx, prefill) in cases.items():
                q, k, v, kc, vc, meta = paged_case(q_lens, ctx, block_size, prefill=prefill)
                positions = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx)]).to(cuda)
                ref = torch_backend.forward(layer(kc.float(), vc.float()), q.float(), k.float(), v.float(),
                                            positions, meta)
                out = backend.forward(layer(kc, vc), q, k, v, positions, meta)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                results.setdefault("kernels", {})[f"{name}/bs{block_size}/{case}"] = err
                print(f"kernels {name:7s} block {block_size:3d} {case:15s} rel err {err:.2e}", flush=True)


def make_random_checkpoint(path: str):
    """Save random bf16 weights; return transformers' model on them in float32 and in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(CONFIG)
    config.initializer_range = E2E_INIT_STD
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(path)
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
    return model.float(), bf16


def hf_last_logits(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()


def check_e2e() -> None:
    path = "/tmp/qwen3-0.6b-random"
    hf32, hf16 = make_random_checkpoint(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (37, 300, 1000, 5, 129, 700)]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    base = dict(skip_tokenizer_init=True, gpu_memory_utilization=0.4, max_num_seqs=16, max_model_len=2048)
    ref32 = [hf_last_logits(hf32, p) for p in prompts]
    baseline = [rel_err(hf_last_logits(hf16, p), r) for p, r in zip(prompts, ref32)]
    results["logits"] = {"transformers-bf16": dict(max_rel_err=max(baseline))}
    del hf16
    settings = {"torch/eager": dict(attention_backend="torch", enforce_eager=True)}
    settings |= {
        f"{b}/{'eager' if eager else 'graphs'}": dict(attention_backend=b, enforce_eager=eager)
        for b in GPU_BACKENDS
        for eager in (False, True)
    }
    settings["fa3/graphs/chunked-64"] = dict(attention_backend="fa3", max_num_batched_tokens=64)
    settings["triton/graphs/chunked-64"] = dict(attention_backend="triton", max_num_batched_tokens=64)
    # One sequence at a time: every decode step is one row, through the skinny GEMV and its prologues.
    settings["triton/graphs/one-row"] = dict(attention_backend="triton", max_num_seqs=1)
    if os.environ.get("E2E_QUICK") == "1":  # the CUDA-graph runs only (when device time is short)
        settings = {k: v for k, v in settings.items()
                    if k in ("torch/eager", "fa3/graphs", "triton/graphs", "triton/graphs/one-row")}
    runs, noise = {}, 0.0
    for label, options in settings.items():
        llm = LLM(path, **{**base, **options})
        runs[label] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if "graphs" in label and "chunked" not in label:
            hits = llm.engine.scheduler.block_manager.num_cache_hit_tokens
            runs[label + "/prefix-hit"] = [
                o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)
            ]
            assert llm.engine.scheduler.block_manager.num_cache_hit_tokens > hits
        # Last: this writes prompts' KV over blocks 0.. of the cache, which the prefix cache may own.
        if "chunked" not in label and label != "triton/eager" and label != "fa3/eager":
            logits = our_last_logits(llm, prompts)
            errs = [rel_err(a, b) for a, b in zip(logits, ref32)]
            noise = max(noise, max((a - b).abs().max().item() for a, b in zip(logits, ref32)))
            results["logits"][label] = dict(
                max_rel_err=max(errs),
                top1_agree=sum(int(a.argmax() == b.argmax()) for a, b in zip(logits, ref32)),
            )
            print(
                f"logits {label:28s} max rel err vs transformers fp32 {max(errs):.2e} "
                f"(transformers bf16: {max(baseline):.2e})",
                flush=True,
            )
        llm.shutdown()
    near_tie = 2 * noise  # two bf16 runs, each off the float32 logits by up to `noise`
    results["near_tie_bound"] = near_tie
    for label, outs in runs.items():
        # Against the torch backend, and against the same backend's plain run with CUDA graphs.
        backend = label.split("/")[0]
        for ref_label in {"torch/eager", f"{backend}/graphs"}:
            if ref_label != label and ref_label in runs:
                compare(label, ref_label, outs, runs[ref_label], prompts, hf32, near_tie)
    del hf32
    gc.collect()
    torch.cuda.empty_cache()


def compare(label, ref_label, outs, ref, prompts, hf32, near_tie) -> None:
    agree, gaps = 0, []
    for prompt, out, expected in zip(prompts, outs, ref):
        n = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), len(expected))
        agree += n
        if n < len(expected):
            logits = hf_last_logits(hf32, prompt + expected[:n])
            gaps.append(round((logits[expected[n]] - logits[out[n]]).abs().item(), 4))
    bad = sum(g > near_tie for g in gaps)
    results.setdefault("greedy", {})[f"{label} vs {ref_label}"] = dict(
        agree=agree, total=sum(map(len, ref)), divergence_gaps=gaps, real_mismatches=bad
    )
    print(
        f"greedy {label:26s} vs {ref_label:12s} agree {agree}/{sum(map(len, ref))}; fp32 logit gaps at "
        f"first divergences {gaps} (near-tie bound {near_tie:.3f}; beyond it: {bad})",
        flush=True,
    )


def our_last_logits(llm, prompts) -> list[torch.Tensor]:
    return [prompt_logits(llm, p).float() for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser()
    sections = {
        "kernels": check_kernels,
        "e2e": check_e2e,
        "bench": lambda: run_bench(results),
        "stream": lambda: run_stream(results),
        "bench-graphs": lambda: run_bench(results, (False,)),
        "profile": lambda: run_profile(results),
        "bench-eager": lambda: run_bench(results, (True,)),
    }
    parser.add_argument("sections", nargs="+", choices=list(sections))
    args = parser.parse_args()
    results["gpu"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    for section in args.sections:
        sections[section]()
        gc.collect()  # engines hold reference cycles; free their GPU memory before the next section
        torch.cuda.empty_cache()
    out = os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
