"""The fused decode kernel (kernels/decode_rope.py) against the two kernels it replaces, norm_rope_store
then paged_decode_attention, on CPU tensors through the Triton interpreter (or on CUDA with
TRITON_INTERPRET=0): the same attention output and the same cache contents, for float32, bf16 and fp8
caches, with and without q/k norm, at GQA groups of 2 and 5, with the new key in a later chunk than the first
and a padding row."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels.decode_attention import paged_decode_attention  # noqa: E402
from nanovllm.kernels.decode_rope import paged_decode_rope_attention  # noqa: E402
from nanovllm.kernels.rope_store import norm_rope_store  # noqa: E402

DEVICE = triton_test_device()
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16
# Row 1's context (300 keys) spans many chunks: its new key lands in a later one than the first.
SEQLENS = [5, 300, 0]  # the last row is batch padding
PER_ROW = ("q", "k", "v", "positions", "slot_mapping", "seqlens_k", "block_tables")


def case(dtype, cache_dtype, seed=0, num_heads=NUM_HEADS):
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(SEQLENS), (num_heads + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(rows, width, generator=gen).to(dtype)  # q, k and v are strided slices of it
    q = qkv[:, :num_heads * HEAD_DIM].view(rows, num_heads, HEAD_DIM)
    k = qkv[:, num_heads * HEAD_DIM:(num_heads + NUM_KV_HEADS) * HEAD_DIM].view(rows, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (num_heads + NUM_KV_HEADS) * HEAD_DIM:].view(rows, NUM_KV_HEADS, HEAD_DIM)
    blocks_per_row = -(-max(SEQLENS) // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(rows, blocks_per_row)
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32)
    positions = (seqlens - 1).clamp(min=0).long()
    slots = torch.tensor([int(tables[r, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          if n else -1 for r, n in enumerate(SEQLENS)])
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(2)]
    angles = torch.randn(max(SEQLENS), HEAD_DIM, generator=gen)
    norms = [((1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).to(dtype), 1e-6) for _ in range(2)]
    tensors = dict(q=q, k=k, v=v, positions=positions, cos=angles.cos(), sin=angles.sin(), slot_mapping=slots,
                   seqlens_k=seqlens, block_tables=tables)
    norms = [(weight.to(DEVICE), eps) for weight, eps in norms]
    return {name: t.to(DEVICE) for name, t in tensors.items()}, caches, norms


def unfused(t, k_cache, v_cache, q_norm, k_norm, scales):
    q, _ = norm_rope_store(t["q"], t["k"], t["v"], t["positions"], t["cos"], t["sin"], k_cache, v_cache,
                           t["slot_mapping"], q_norm, k_norm, *scales)
    return paged_decode_attention(q, k_cache, v_cache, t["seqlens_k"], t["block_tables"], HEAD_DIM**-0.5,
                                  k_scale=scales[0], v_scale=scales[1])


def fused(t, k_cache, v_cache, q_norm, k_norm, scales):
    return paged_decode_rope_attention(t["q"], t["k"], t["v"], t["positions"], t["cos"], t["sin"], k_cache,
                                       v_cache, t["slot_mapping"], t["seqlens_k"], t["block_tables"],
                                       HEAD_DIM**-0.5, q_norm=q_norm, k_norm=k_norm, k_scale=scales[0],
                                       v_scale=scales[1])


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn)])  # fp8: "words" tiles
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("num_heads", [NUM_HEADS, 10])  # GQA groups of 2 and 5 (Qwen3-14B's: not a power of two)
def test_fused_equals_rope_store_then_decode(dtype, cache_dtype, with_norm, num_heads):
    t, caches, norms = case(dtype, cache_dtype, num_heads=num_heads)
    q_norm, k_norm = norms if with_norm else (None, None)
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    results = []
    for run in (unfused, fused):
        k_cache, v_cache = (c.clone().to(DEVICE) for c in caches)
        out = run(t, k_cache, v_cache, q_norm, k_norm, scales)
        results.append((out.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu()))
    (want, want_k, want_v), (got, got_k, got_v) = results
    # Only the order of the norm's float32 sum of squares may differ: one rounding of the output at most.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_k, want_k, rtol=tol, atol=tol)
    assert torch.equal(got_v, want_v)  # values are stored as given (or scaled alike)
    assert not got[-1].any()  # the padding row attends to nothing
    changed = (got_k != caches[0].float()).any(-1).any(-1)  # [block, offset]: a new key there
    assert changed.sum() == 2  # row 0's and row 1's, none for the padding row


def test_norms_come_in_pairs():
    t, caches, norms = case(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        fused(t, *(c.to(DEVICE) for c in caches), norms[0], None, (1.0, 1.0))


@pytest.mark.parametrize("rows", [1, len(SEQLENS)], ids=["early-trigger", "late-trigger"])
def test_pdl_launch_gives_the_same_bits(rows):
    """As a programmatic dependent of the kernel that writes its q/k/v (an sm_90+ GPU), eagerly and replayed
    from a CUDA graph: the same output and cache bits as a plain launch, with the dependent let go right
    after the wait (one row) or after the K/V loop (late_trigger: the Triton backend's from two rows)."""
    from nanovllm.kernels.common import supports_pdl

    if DEVICE != "cuda" or not supports_pdl(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    t, caches, (q_norm, k_norm) = case(torch.bfloat16, torch.bfloat16)
    t = {name: x[:rows] if name in PER_ROW else x for name, x in t.items()}
    source = torch.cat([t["q"].flatten(1), t["k"].flatten(1), t["v"].flatten(1)], dim=1)
    qkv = torch.empty_like(source)
    nq, nk = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM

    def run(pdl: bool, k_cache, v_cache):
        qkv.copy_(source * 1.0)  # the kernel before, whose output the PDL launch waits for
        rows = qkv.shape[0]
        q = qkv[:, :nq].view(rows, NUM_HEADS, HEAD_DIM)
        k, v = (qkv[:, nq + i * nk:nq + (i + 1) * nk].view(rows, NUM_KV_HEADS, HEAD_DIM) for i in range(2))
        return paged_decode_rope_attention(
            q, k, v, t["positions"], t["cos"], t["sin"], k_cache, v_cache, t["slot_mapping"], t["seqlens_k"],
            t["block_tables"], HEAD_DIM**-0.5, q_norm=q_norm, k_norm=k_norm, pdl=pdl, late_trigger=rows > 1)

    plain_caches = [c.clone().to(DEVICE) for c in caches]
    want = run(False, *plain_caches)
    eager_caches = [c.clone().to(DEVICE) for c in caches]
    assert torch.equal(run(True, *eager_caches), want)
    graph_caches = [c.clone().to(DEVICE) for c in caches]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(True, *graph_caches)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    for plain, pdl_eager, pdl_graph in zip(plain_caches, eager_caches, graph_caches):
        assert torch.equal(pdl_eager, plain) and torch.equal(pdl_graph, plain)
