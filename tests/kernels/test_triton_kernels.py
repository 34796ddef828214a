"""Triton kernels against plain PyTorch references, on CPU tensors through the Triton interpreter.

Cache slots that no sequence owns are filled with NaN (and block-table padding points at such a block),
so a kernel that reads a position it should have masked produces NaN and fails the comparison.
"""


import pytest
import torch
from conftest import triton_test_device
from paged_case import make_paged_cache, reference_attention

pytest.importorskip("triton")

from nanovllm.kernels import decode_launch, decode_words  # noqa: E402
from nanovllm.kernels.decode_attention import paged_decode_attention  # noqa: E402
from nanovllm.kernels.decode_launch import choose_launch  # noqa: E402
from nanovllm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

DEVICE = triton_test_device()

# The interpreter computes in float32 numpy, so float32 kernels match the reference to rounding.
ATOL = RTOL = 1e-4
HEAD_DIM = 32
# 1 and 12 exercise per-token block lookup (12 is not a power of two); 16 is the usual page;
# 256 is a multiple of the key tile, so it takes the one-lookup-per-tile path.
BLOCK_SIZES = [1, 12, 16, 256]
# (num_heads, num_kv_heads): GQA, plain multi-head, and a group of 5 (Qwen3-14B: 40 query heads, 8 KV),
# which the kernels pad to a power of two.
HEAD_LAYOUTS = [(4, 2), (2, 2), (10, 2)]


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


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_a_given_row_order_gives_the_same_output(num_splits: int) -> None:
    """seq_order only changes which programs start first: each row's output is the same, bit for bit,
    and wrong arguments are refused."""
    kv_lens = [37, 300, 0, 129]
    k_cache, v_cache, block_tables = make_paged_cache([max(n, 1) for n in kv_lens], 16, 2, HEAD_DIM,
                                                      torch.float32, 9, device=DEVICE)
    q = torch.randn(len(kv_lens), 4, HEAD_DIM, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    plain = paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, 0.3, num_splits=num_splits)
    longest_first = torch.tensor([1, 3, 0, 2], dtype=torch.int32, device=DEVICE)
    ordered = paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, 0.3, num_splits=num_splits,
                                     seq_order=longest_first)
    assert torch.equal(ordered, plain)
    with pytest.raises(ValueError, match="seq_order must be int32"):
        paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, 0.3,
                               seq_order=longest_first.long())


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (2, 2)])
def test_decode_combines_more_chunks_than_one_load_holds(num_heads: int, num_kv_heads: int) -> None:
    """A 2,200-token context in 32 chunks of whole 128-key tiles uses 18 of them: more than the
    COMBINE_ROWS partials the epilogue reads at once, so the running max is rescaled between rounds
    (4 heads a group, and 1)."""
    kv_lens = [2200, 5]
    k_cache, v_cache, block_tables = make_paged_cache(kv_lens, 16, num_kv_heads, HEAD_DIM, torch.float32, 7,
                                                      device=DEVICE)
    gen = torch.Generator().manual_seed(8)
    q = 3 * torch.randn(len(kv_lens), num_heads, HEAD_DIM, generator=gen).to(DEVICE)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, 0.2, num_splits=32)
    expected = reference_attention(q, k_cache, v_cache, [1] * len(kv_lens), kv_lens, block_tables, 0.2)
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



@pytest.mark.parametrize("fp8", [False, True])
def test_one_split_stores_what_combining_its_one_partial_gives(fp8: bool, monkeypatch) -> None:
    """With one chunk a context (every large batch) each program stores its rows' output itself: bit for
    bit the combine's result (its one partial weighs 2^0 = 1), with the workspace left unwritten and
    the counters zero; an fp8 cache through its "words" tiles too. Row 1 is graph padding."""
    num_heads, num_kv_heads, kv_lens = 4, 2, [300, 0, 37, 129]
    k_cache, v_cache, block_tables = make_paged_cache(
        [max(n, 1) for n in kv_lens], 16, num_kv_heads, HEAD_DIM, torch.float32, 17, device=DEVICE
    )
    block_tables[1] = 0
    gen = torch.Generator().manual_seed(18)
    q = torch.randn(len(kv_lens), num_heads, HEAD_DIM, generator=gen).to(DEVICE)
    if fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        q = (q / 8).to(torch.float16)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    workspace_numel = len(kv_lens) * num_heads * (HEAD_DIM + 1)

    def attend() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        workspace = torch.full((workspace_numel,), float("nan"), device=DEVICE)
        counters = torch.zeros(len(kv_lens) * num_kv_heads, dtype=torch.int32, device=DEVICE)
        out = paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, HEAD_DIM**-0.5,
                                     num_splits=1, workspace=workspace, counters=counters, v_scale=2.0)
        return out.cpu(), workspace.cpu(), counters.cpu()

    direct, workspace, counters = attend()
    assert workspace.isnan().all() and not counters.any()
    constexprs = decode_launch.DecodeCall.constexprs
    monkeypatch.setattr(decode_launch.DecodeCall, "constexprs",
                        lambda call, *dtypes: dict(constexprs(call, *dtypes), ONE_SPLIT=False))
    combined, workspace, counters = attend()
    assert not workspace.isnan().all() and not counters.any()  # the combine path did run
    assert torch.equal(direct, combined)
    assert direct[1].abs().max() == 0  # the padding row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_prefill_and_decode_stay_close_to_float32_reference(dtype: torch.dtype) -> None:
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


@pytest.mark.parametrize("kv_lens", [[1100], [20 + i for i in range(48)]], ids=["small-batch", "large-batch"])
def test_decode_matches_reference_under_each_launch_setting(kv_lens: list[int]) -> None:
    """The small-batch and large-batch settings of a 16-bit cache give the same attention (the
    interpreter ignores warps and stages, but not the tile length or the chunk count they come with)."""
    num_heads, num_kv_heads, batch = 4, 2, len(kv_lens)
    k_cache, v_cache, block_tables = make_paged_cache(kv_lens, 16, num_kv_heads, HEAD_DIM, torch.float16, 5,
                                                      device=DEVICE)
    launch, _ = choose_launch(batch, num_kv_heads, HEAD_DIM, block_tables.shape[1] * 16, 2, k_cache.device,
                              num_sms=132)
    small = launch == decode_launch.SMALL_BATCH[2]
    assert small == (batch == 1)
    q = torch.randn(batch, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    q = q.to(DEVICE, torch.float16)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, seqlens_k, block_tables, 0.3)
    expected = reference_attention(q.float(), k_cache.float(), v_cache.float(), [1] * batch, kv_lens,
                                   block_tables, 0.3)
    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-3, rtol=2e-3)


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


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,num_splits", [(16, None), (256, 4)])
def test_fp8_words_tiles_match_the_reference(q_dtype: torch.dtype, block_size: int, num_splits: int | None
                                             ) -> None:
    """decode_words' "words" form of an fp8 cache's tiles (what 16-bit queries over an fp8 cache take)
    against the reference, over several tiles, a partial last tile, empty chunks and a padding row. Every
    e4m3 byte but NaN appears, in both bytes of a word: a swapped low/high byte, a wrong sign or exponent
    shows."""
    num_heads, num_kv_heads, head_dim, kv_lens = 4, 2, 32, [300, 0, 37, 129]
    k_cache, v_cache, block_tables = make_paged_cache(
        [max(n, 1) for n in kv_lens], block_size, num_kv_heads, head_dim, torch.float32, 15
    )
    block_tables[1] = 0  # the padding row owns nothing
    owned = ~k_cache.isnan()
    gen = torch.Generator().manual_seed(16)
    codes = torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN (0x7f, 0xff)
    k8 = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    v8 = codes.flip(-1).to(torch.uint8).view(torch.float8_e4m3fn)
    k8 = torch.where(owned, k8.float(), float("nan")).to(torch.float8_e4m3fn).to(DEVICE)
    v8 = torch.where(owned, v8.float() / 64, float("nan")).to(torch.float8_e4m3fn).to(DEVICE)
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=gen).to(DEVICE, q_dtype) / 64
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    assert decode_words.tile_form(torch.float8_e4m3fn, q_dtype) == "words"
    words = paged_decode_attention(q, k8, v8, seqlens_k, block_tables.to(DEVICE), head_dim**-0.5,
                                   num_splits=num_splits, k_scale=0.5, v_scale=2.0).cpu().float()
    assert words[1].abs().max() == 0  # the padding row
    expected = reference_attention(q.cpu().float(), k8.cpu().float() * 0.5, v8.cpu().float() * 2.0,
                                   [1] * len(kv_lens), kv_lens, block_tables, head_dim**-0.5)
    torch.testing.assert_close(words, expected, atol=2e-2, rtol=2e-2)
