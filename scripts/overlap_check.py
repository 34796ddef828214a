"""Overlap scheduling (async_scheduling) on a GPU, in one command:

    python scripts/overlap_check.py check speed

check: the tests' tiny random Qwen3 (float32, CUDA graphs, triton attention) gives the same tokens and
  finish reasons with async_scheduling on and off: requests finishing at different steps, seeded n > 1
  and top-k/top-p sampling, logprobs and prompt logprobs, logits processors, preemption under a small
  KV cache, chunked prefill, prefill-first batches, eager decode. Prints SAME or DIFF per case.
speed: a random-weight Qwen3-0.6B-shaped model (dummy weights, bf16), 128-token prompts and 256 greedy
  tokens at batch 1 and 64, with overlap off and on: output tokens per second."""
import os
import sys
import tempfile
import time

# conftest hides the GPU and picks Triton's interpreter unless these are set.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
os.environ["TRITON_INTERPRET"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the tests' tiny model (conftest.make_model_dir)
import torch  # noqa: E402
from conftest import PROMPTS, make_model_dir  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402


def gen(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c["token_ids"], c["finish_reason"]) for c in o["outputs"]] for o in outs]


def correctness():
    d = tempfile.mkdtemp()
    make_model_dir(d)
    base = dict(kvcache_block_size=4, num_kvcache_blocks=512, max_model_len=256, max_num_seqs=8,
                max_num_batched_tokens=512,
                dtype="float32", torch_compile=False)
    g = lambda m, **kw: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, **kw)  # noqa: E731
    cases = {
        "greedy lengths": ({}, [g(m) for m in (5, 17, 1, 9)]),
        "seeded n=3 + topk": ({}, [
            SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=13, ignore_eos=True),
            g(4), g(30)]),
        "logprobs": ({}, [g(6, logprobs=3), g(9, prompt_logprobs=2, logprobs=0), g(4), g(7, logprobs=5)]),
        "penalties mix": ({}, [g(10, repetition_penalty=1.5), g(12, min_tokens=6, logit_bias={5: 3.0}), g(8),
                               g(9, presence_penalty=0.5)]),
        "preemption": ({"num_kvcache_blocks": 14}, [g(m) for m in (24, 20, 24, 16)]),
        "chunked": ({"max_num_batched_tokens": 5}, [g(m) for m in (5, 17, 1, 9)]),
        "prefill first": ({"mixed_batches": False, "max_num_batched_tokens": 16},
                          [g(m) for m in (5, 17, 1, 9)]),
        "eager": ({"enforce_eager": True}, [g(m) for m in (5, 17, 1, 9)]),
    }
    for name, (opts, params) in cases.items():
        res, extra = [], ""
        for a in (False, True):
            llm = LLM(d, async_scheduling=a, **{**base, **opts})
            res.append(gen(llm, PROMPTS, params))
            if a:
                extra = f" preemptions={llm.engine.scheduler.num_preemptions}"
            llm.engine.shutdown()
        print(f"{name}: {'SAME' if res[0] == res[1] else 'DIFF'}{extra}", flush=True)
        if res[0] != res[1]:
            print("  sync ", res[0], "\n  async", res[1], flush=True)


def show_live_tensors() -> None:
    """The largest CUDA tensors still alive, and what refers to them: for a leak after shutdown."""
    import gc
    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    for t in sorted(live, key=lambda t: -t.untyped_storage().nbytes())[:8]:
        referrers = [type(r).__name__ for r in gc.get_referrers(t)][:5]
        mib = t.untyped_storage().nbytes() / 2**20
        print(f"  live: {tuple(t.shape)} {t.dtype} {mib:.0f} MiB <- {referrers}", flush=True)


def speed():
    from transformers import Qwen3Config
    d = tempfile.mkdtemp()
    Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=True, dtype="bfloat16").save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    for batch in (1, 64):
        prompts = [torch.randint(0, 150000, (128,), generator=g).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        for a in (False, True):
            llm = LLM(d, load_format="dummy", skip_tokenizer_init=True, async_scheduling=a, max_num_seqs=128,
                      max_model_len=1024, gpu_memory_utilization=0.5, torch_compile=False)
            llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o["token_ids"]) for o in out)
            llm.engine.shutdown()
            del llm
            held = torch.cuda.memory_allocated() / 2**30  # what the engine left behind: should be ~0
            print(f"batch {batch} async={a}: {n / dt:.0f} tok/s ({dt:.2f}s); "
                  f"{held:.2f} GiB held after shutdown", flush=True)
            if held > 0.5:
                show_live_tensors()


if __name__ == "__main__":
    sections = sys.argv[1:]
    if not sections or set(sections) - {"check", "speed"}:
        sys.exit(f"usage: python scripts/overlap_check.py check speed (one or both); got {sections}")
    if not torch.cuda.is_available():
        sys.exit("overlap_check.py runs the engine with CUDA graphs and Triton kernels: run it on a CUDA GPU")
    if "check" in sys.argv:
        correctness()
    if "speed" in sys.argv:
        speed()
