"""The Triton prefill kernel (nanovllm.kernels.prefill_attention) under other tile sizes, warps and
pipeline stages, at long-prompt shapes (Qwen3-0.6B heads: 16 query, 8 KV, head_dim 128; 256-token
blocks, no cached prefix), against FlashAttention-3's varlen kernel where it is installed: milliseconds
and causal-attention TFLOP/s per setting, and the largest difference from the engine's setting's output.
GPU only.

    python scripts/prefill_sweep.py"""

import argparse
import math

import torch
import triton.testing

from nanovllm.kernels import prefill_attention as pa

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256
CASES = [(2, 8192), (8, 2048)]  # (sequences, tokens each): one 16k-token step each
# (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES); the engine's own comes first.
SETTINGS = [(pa.BLOCK_M, pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES), (64, 64, 4, 3), (128, 64, 8, 2),
            (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 32, 4, 3)]
NAMES = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")


def causal_tflop(seqs: int, tokens: int) -> float:
    # QK^T and PV: 2 * 2 * tokens^2 * head_dim FLOPs per head, halved by the causal mask.
    return seqs * NUM_HEADS * 2 * tokens * tokens * HEAD_DIM / 1e12


def paged_case(seqs: int, tokens: int) -> dict:
    """q, k, v for `seqs` prompts of `tokens` tokens, k and v also written into scattered cache blocks."""
    total = seqs * tokens
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    per_seq = math.ceil(tokens / BLOCK_SIZE)
    tables = torch.randperm(seqs * per_seq, device="cuda", dtype=torch.int32).view(seqs, per_seq)
    k_cache = torch.zeros(seqs * per_seq * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                          dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    offsets = torch.arange(BLOCK_SIZE, device="cuda").repeat(per_seq)
    for s in range(seqs):
        slots = (tables[s].repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE + offsets)[:tokens]
        k_cache[slots] = k[s * tokens:(s + 1) * tokens]
        v_cache[slots] = v[s * tokens:(s + 1) * tokens]
    shape = (seqs * per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return dict(q=q, k=k, v=v, k_cache=k_cache.view(shape), v_cache=v_cache.view(shape), tables=tables,
                cu=torch.arange(0, total + 1, tokens, device="cuda", dtype=torch.int32),
                seqlens=torch.full((seqs,), tokens, device="cuda", dtype=torch.int32), tokens=tokens)


def triton_run(c: dict):
    return lambda: pa.paged_prefill_attention(c["q"], c["k_cache"], c["v_cache"], c["cu"], c["seqlens"],
                                              c["tables"], HEAD_DIM**-0.5, c["tokens"])


def sweep(seqs: int, tokens: int) -> None:
    c = paged_case(seqs, tokens)
    work = causal_tflop(seqs, tokens)
    run = triton_run(c)
    reference = run()
    print(f"{seqs} x {tokens} tokens ({work:.2f} TFLOP causal):", flush=True)
    engine = {name: getattr(pa, name) for name in NAMES}
    for setting in SETTINGS:
        for name, value in zip(NAMES, setting, strict=True):
            setattr(pa, name, value)
        try:
            diff = (run().float() - reference.float()).abs().max().item()
            ms = triton.testing.do_bench(run)
            print(f"  {setting}: {ms:.3f} ms, {work / ms * 1e3:.0f} TFLOP/s, max diff {diff:.1e}", flush=True)
        except Exception as error:  # a setting that does not fit in shared memory or does not compile
            print(f"  {setting}: {type(error).__name__}", flush=True)
        finally:
            for name, value in engine.items():
                setattr(pa, name, value)
    try:
        from flash_attn_interface import flash_attn_varlen_func
    except ImportError:
        return
    ms = triton.testing.do_bench(lambda: flash_attn_varlen_func(
        c["q"], c["k"], c["v"], c["cu"], c["cu"], tokens, tokens, softmax_scale=HEAD_DIM**-0.5, causal=True))
    print(f"  FA3 varlen (contiguous k/v): {ms:.3f} ms, {work / ms * 1e3:.0f} TFLOP/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()  # no options: --help, and anything else refused
    if not torch.cuda.is_available():
        parser.error("it times the Triton prefill kernel: run it on a CUDA GPU")
    torch.manual_seed(0)
    for seqs, tokens in CASES:
        sweep(seqs, tokens)


if __name__ == "__main__":
    main()
