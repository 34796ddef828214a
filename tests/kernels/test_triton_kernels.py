"""Triton kernels against plain PyTorch references, on CPU tensors through the Triton interpreter.

Cache slots that no sequence owns are filled with NaN (and block-table padding points at such a block),
so a kernel that reads a position it should have masked produces NaN and fails the comparison.
"""


import pytest
import torch
from conftest import triton_test_device
from paged_case import make_paged_cache, reference_attention

pytest.importorskip("triton")

from nanovllm.kernels.decode_attention import (  # noqa: E402
    MAX_NUM_SPLITS,
    decode_num_splits,
    paged_decode_attention,  # noqa: E402
)
from nanovllm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

DEVICE = triton_test_device()

# The interpreter computes in float32 numpy, so float32 kernels match the reference to rounding.
ATOL = RTOL = 1e-4
HEAD_DIM = 32
# 1 and 12 exercise per-token block lookup (12 is not a power of two); 16 is the usual page;
# 256 is a multiple of the key tile, so it takes the one-lookup-per-tile path.
BLOCK_SIZES = [1, 12, 16, 256]
HEAD_LAYOUTS = [(4, 2), (2, 2)]  # (num_heads, num_kv_heads): GQA and plain multi-head


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("cached_prefix", [False, True])
def test_paged_prefill_attention_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, cached_prefix: bool
) -> None:
    # Three sequences: a short one, one spanning two query tiles (BLOCK_M = 64), a single token.
    q_lens = [5, 70, 1]
    kv_lens = [5 + 19, 70 + 30, 1 + 130] if cached_prefix else q_lens
    k_cache, v_cache, block_tables = make_paged_cache(
        kv_lens, block_size, num_kv_heads, HEAD_DIM, torch.float32, 1, device=DEVICE
    )
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cu_seqlens_q = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5

    out = paged_prefill_attention(
        q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, scale, max(q_lens)
    )

    expected = reference_attention(q, k_cache, v_cache, q_lens, kv_lens, block_tables, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=RTOL)


def test_paged_prefill_attention_reads_strided_q() -> None:
    # q sliced out of a fused qkv tensor: rows are strided, heads are not contiguous with the next row.
    num_heads, num_kv_heads, q_lens, kv_lens = 4, 2, [9, 3], [9, 20]
    k_cache, v_cache, block_tables = make_paged_cache(
        kv_lens, 16, num_kv_heads, HEAD_DIM, torch.float32, 3, device=DEVICE
    )
    qkv = torch.randn(
        sum(q_lens), (num_heads + 2 * num_kv_heads) * HEAD_DIM, generator=torch.Generator().manual_seed(4)
    )
    q = qkv.to(DEVICE)[:, : num_heads * HEAD_DIM].view(-1, num_heads, HEAD_DIM)
    cu_seqlens_q = torch.tensor([0, 9, 12], dtype=torch.int32, device=DEVICE)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)

    out = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, 0.2, 9)

    expected = reference_attention(q, k_cache, v_cache, q_lens, kv_lens, block_tables, 0.2)
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_paged_decode_attention_matches_reference(
    block_size: int, num_heads: int, num_kv_heads: int, num_splits: int | None
) -> None:
    # 300 tokens span several 64-token tiles and, with 4 splits, three chunks plus an empty one;
    # 0 is a CUDA-graph padding row whose block table points only at NaN blocks.
    kv_lens = [300, 0, 37, 129]
    k_cache, v_cache, block_tables = make_paged_cache(
        [max(n, 1) for n in kv_lens], block_size, num_kv_heads, HEAD_DIM, torch.float32, 5, device=DEVICE
    )
    block_tables[1] = 0  # the padding row owns nothing
    q = torch.randn(len(kv_lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5

    counters = torch.zeros(len(kv_lens) * num_kv_heads, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, scale, num_splits=num_splits,
                                 counters=counters)

    assert not counters.any()  # left ready for the next call
    expected = reference_attention(q, k_cache, v_cache, [1] * len(kv_lens), kv_lens, block_tables, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(out[1].cpu(), torch.zeros(num_heads, HEAD_DIM))  # padding row: zeros, not NaN
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=RTOL)


def test_paged_decode_attention_writes_into_given_out_and_workspace() -> None:
    num_heads, num_kv_heads, kv_lens, num_splits = 4, 1, [70, 5], 2
    k_cache, v_cache, block_tables = make_paged_cache(
        kv_lens, 16, num_kv_heads, HEAD_DIM, torch.float32, 7, device=DEVICE
    )
    q = torch.randn(2, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    workspace = torch.full((2 * num_heads * num_splits * (HEAD_DIM + 1),), float("nan"), device=DEVICE)

    result = paged_decode_attention(
        q, k_cache, v_cache, seqlens_k, block_tables, 0.3, num_splits=num_splits, out=out, workspace=workspace
    )

    assert result is out
    expected = reference_attention(q, k_cache, v_cache, [1, 1], kv_lens, block_tables, 0.3)
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(
            q, k_cache, v_cache, seqlens_k, block_tables, 0.3, num_splits=4, workspace=workspace
        )
    with pytest.raises(ValueError, match="counters"):
        paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, 0.3,
                               counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_prefill_and_decode_stay_close_to_float32_reference(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those integers.
        pytest.skip("Triton's interpreter computes bf16 tl.dot on the raw bits; runs on CUDA only")
    num_heads, num_kv_heads, q_lens, kv_lens = 4, 2, [3, 1], [40, 17]
    k_cache, v_cache, block_tables = make_paged_cache(
        kv_lens, 16, num_kv_heads, HEAD_DIM, dtype, 9, device=DEVICE
    )
    q = torch.randn(4, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(10)).to(dtype).to(DEVICE)
    cu_seqlens_q = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)

    prefill = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, 0.2, 3)
    decode = paged_decode_attention(q[[2, 3]], k_cache, v_cache, seqlens_k, block_tables, 0.2, num_splits=2)

    expected = reference_attention(q, k_cache, v_cache, q_lens, kv_lens, block_tables, 0.2)
    assert prefill.dtype == decode.dtype == dtype
    # Softmax weights are rounded to the cache dtype before P @ V, and so is the output:
    # bf16 keeps 8 mantissa bits, fp16 11.
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(prefill.cpu().float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(decode.cpu().float(), expected[[2, 3]], atol=tol, rtol=tol)


def test_decode_num_splits_fills_the_gpu_from_static_shapes_only() -> None:
    # Batch 1, long context: as many splits as allowed.
    assert decode_num_splits(1, 8, 40960, 64, num_sms=132) == MAX_NUM_SPLITS
    # Large batches already fill the GPU: no split.
    assert decode_num_splits(256, 8, 40960, 64, num_sms=132) == 1
    # Never more chunks than key tiles in the longest possible context.
    assert decode_num_splits(1, 8, 100, 64, num_sms=132) == 2
    assert decode_num_splits(2, 8, 40960, 64, num_sms=132) == 33  # cdiv(132 * 4, 16)


def test_rejects_head_dim_that_is_not_a_power_of_two() -> None:
    k_cache = torch.zeros(2, 16, 2, 48)
    q = torch.zeros(1, 2, 48)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(
            q, k_cache, k_cache, torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1.0
        )


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_fp8_cache_is_read_through_its_scales(kind: str, q_dtype: torch.dtype) -> None:
    """An fp8 (e4m3) cache holds k / k_scale and v / v_scale: the kernels widen it and multiply the
    scales back in, so they match the reference over the dequantized float32 cache (exactly for a
    float32 q; for a bfloat16 q the dots run in float16, within its rounding)."""
    num_heads, num_kv_heads = 4, 2
    q_lens, kv_lens = ([3, 1], [20, 37]) if kind == "prefill" else ([1, 1], [20, 37])
    k_cache, v_cache, block_tables = make_paged_cache(
        kv_lens, 16, num_kv_heads, HEAD_DIM, torch.float32, 11, device=DEVICE
    )
    k_scale, v_scale = 0.5, 2.0
    k8, v8 = (k_cache / k_scale).to(torch.float8_e4m3fn), (v_cache / v_scale).to(torch.float8_e4m3fn)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(12))
    q = q.to(DEVICE, q_dtype)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    if kind == "prefill":
        cu_seqlens_q = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(q, k8, v8, cu_seqlens_q, seqlens_k, block_tables, scale, max(q_lens),
                                      k_scale=k_scale, v_scale=v_scale)
    else:
        out = paged_decode_attention(q, k8, v8, seqlens_k, block_tables, scale, k_scale=k_scale,
                                     v_scale=v_scale)
    expected = reference_attention(q.float(), k8.float() * k_scale, v8.float() * v_scale, q_lens, kv_lens,
                                   block_tables, scale)
    tol = ATOL if q_dtype == torch.float32 else 2e-2  # bfloat16's output rounding (8 bits)
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)
