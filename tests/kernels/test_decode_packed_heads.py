"""decode_launch.FP8_PACKED: at one chunk a context, an 8-bit cache's "words" tiles (fp8's, and int8's
where decode_words.INT8_WORDS says so) run several KV heads a program, their GQA groups stacked into one
query tile (decode_words' packed heads). Its output is the one-head-a-program kernel's, bit for bit, and
DecodeCall takes it only where it applies. On CPU tensors through the Triton interpreter."""

import os

import pytest
import torch
from conftest import triton_test_device
from paged_case import make_paged_cache, reference_attention

pytest.importorskip("triton")

from nanovllm.kernels import decode_launch, decode_words  # noqa: E402
from nanovllm.kernels.decode_attention import paged_decode_attention  # noqa: E402
from nanovllm.kernels.decode_launch import FP8_LARGE_BATCH, FP8_PACKED, DecodeCall, DecodeLaunch  # noqa: E402

DEVICE = triton_test_device()
HEAD_DIM = 32


def fp8_case(num_heads: int, num_kv_heads: int, kv_lens: list[int], block_size: int):
    """q (bfloat16), e4m3 caches holding every code but NaN (NaN where no sequence owns the slot: a read
    that should have been masked shows), block tables and context lengths; row 1 is graph padding."""
    k_cache, v_cache, block_tables = make_paged_cache(
        [max(n, 1) for n in kv_lens], block_size, num_kv_heads, HEAD_DIM, torch.float32, 21
    )
    block_tables[1] = 0
    owned = ~k_cache.isnan()
    gen = torch.Generator().manual_seed(22)
    codes = torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)
    k8 = torch.where(owned, codes.to(torch.uint8).view(torch.float8_e4m3fn).float(), float("nan"))
    v8 = torch.where(owned, codes.flip(-1).to(torch.uint8).view(torch.float8_e4m3fn).float() / 64,
                     float("nan"))
    q = torch.randn(len(kv_lens), num_heads, HEAD_DIM, generator=gen) / 64
    return (q.to(DEVICE, torch.bfloat16), k8.to(torch.float8_e4m3fn).to(DEVICE),
            v8.to(torch.float8_e4m3fn).to(DEVICE), block_tables.to(DEVICE),
            torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE))


def int8_case(num_heads: int, num_kv_heads: int, kv_lens: list[int], block_size: int):
    """As fp8_case over an int8 cache: every code (-128 too), random per-token scales, NaN scales where no
    sequence owns the slot."""
    k_cache, _, block_tables = make_paged_cache([max(n, 1) for n in kv_lens], block_size, num_kv_heads,
                                                HEAD_DIM, torch.float32, 23)
    block_tables[1] = 0
    owned = ~k_cache.isnan().any(-1)
    gen = torch.Generator().manual_seed(24)
    k8, v8 = (torch.randint(-128, 128, k_cache.shape, generator=gen, dtype=torch.int8) for _ in range(2))
    k_scales, v_scales = (torch.where(owned, (0.5 + torch.rand(owned.shape, generator=gen)) * size,
                                      float("nan")) for size in (1 / 32, 1 / 64))
    q = torch.randn(len(kv_lens), num_heads, HEAD_DIM, generator=gen)
    return (q.to(DEVICE, torch.bfloat16), k8.to(DEVICE), v8.to(DEVICE), block_tables.to(DEVICE),
            torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
            dict(k_scales=k_scales.to(DEVICE), v_scales=v_scales.to(DEVICE)))


def cache_case(cache: str, num_heads: int, num_kv_heads: int, kv_lens: list[int], block_size: int):
    """(q, k, v, block tables, context lengths, the decode call's scale arguments, k and v dequantized)."""
    if cache == "fp8":
        q, k8, v8, block_tables, seqlens_k = fp8_case(num_heads, num_kv_heads, kv_lens, block_size)
        return (q, k8, v8, block_tables, seqlens_k, dict(k_scale=0.5, v_scale=2.0), k8.cpu().float() * 0.5,
                v8.cpu().float() * 2.0)
    q, k8, v8, block_tables, seqlens_k, scales = int8_case(num_heads, num_kv_heads, kv_lens, block_size)
    k, v = (x.cpu().float() * s.cpu()[..., None] for x, s in zip((k8, v8), scales.values(), strict=True))
    return q, k8, v8, block_tables, seqlens_k, scales, k, v


@pytest.mark.parametrize("cache", ["fp8", "int8"])
@pytest.mark.parametrize("num_heads,num_kv_heads,kv_per_prog", [(8, 4, 2), (8, 4, 4), (4, 4, 2), (16, 4, 2)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_packed_heads_give_the_bits_of_one_head_a_program(cache: str, num_heads: int, num_kv_heads: int,
                                                           kv_per_prog: int, block_size: int,
                                                           monkeypatch) -> None:
    """GQA groups of 1, 2 and 4 query heads, 2 and 4 KV heads a program, several tiles, a partial last
    tile and a padding row: every output equals the unpacked launch's exactly (the rows of the other KV
    heads add exact zeros to each dot, and an int8 cache's scales reach each row from its own head), and
    the reference within the 16-bit operands' rounding."""
    monkeypatch.setattr(decode_words, "INT8_WORDS", True)
    q, k8, v8, block_tables, seqlens_k, scale_args, k, v = cache_case(cache, num_heads, num_kv_heads,
                                                                      [300, 0, 37, 129], block_size)
    # The interpreter's small batches would take a small-batch launch: take the large-batch ones.
    packed_launch = DecodeLaunch(64, 4, 3, kv_per_prog=kv_per_prog)
    monkeypatch.setattr(decode_launch, "choose_launch", lambda *args: (packed_launch, 1))
    calls = []
    real_prepare = DecodeCall.prepare

    def prepare(*args, **kwargs):
        calls.append(real_prepare(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(DecodeCall, "prepare", prepare)

    def attend() -> torch.Tensor:
        return paged_decode_attention(q, k8, v8, seqlens_k, block_tables, HEAD_DIM**-0.5,
                                      **scale_args).cpu().float()

    packed = attend()
    assert calls[-1].launch == packed_launch and calls[-1].grid == (num_kv_heads // kv_per_prog, 4, 1)
    monkeypatch.setattr(decode_launch, "choose_launch", lambda *args: (FP8_LARGE_BATCH, 1))
    plain = attend()
    assert calls[-1].launch == FP8_LARGE_BATCH and calls[-1].grid == (num_kv_heads, 4, 1)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter's numpy dots sum a packed tile's rows in another order: one output may land
        # one bfloat16 ulp away (seen with triton 3.9's interpreter). On the GPU the two are bit-equal.
        torch.testing.assert_close(packed, plain, atol=0, rtol=2**-7)
    else:
        assert torch.equal(packed, plain)
    assert packed[1].abs().max() == 0  # the padding row
    expected = reference_attention(q.cpu().float(), k, v, [1] * 4, [300, 0, 37, 129], block_tables.cpu(),
                                   HEAD_DIM**-0.5)
    torch.testing.assert_close(packed, expected, atol=2e-2, rtol=2e-2)


def call_for(num_heads: int, num_kv_heads: int, rows: int, *, q_dtype=torch.bfloat16, cache_dtype=None,
             num_splits: int | None = None, packs: bool = True) -> DecodeCall:
    """DecodeCall.prepare's choice (nothing launched) for Qwen3-like shapes: head_dim 128, 256-token
    blocks, 4,096-token contexts, fp8 cache unless told."""
    q = torch.zeros(rows, num_heads, 128, dtype=q_dtype)
    cache = torch.zeros(2, 256, num_kv_heads, 128, dtype=cache_dtype or torch.float8_e4m3fn)  # not read
    block_tables = torch.zeros(rows, 16, dtype=torch.int32)
    seqlens_k = torch.zeros(rows, dtype=torch.int32)
    return DecodeCall.prepare(q, cache, cache, seqlens_k, block_tables, num_splits, None, None, None, packs)


def test_decode_call_packs_only_where_it_applies() -> None:
    """Qwen3-0.6B's 16 query heads over 8 KV heads at 256 rows (one chunk a context) pack two KV heads a
    program; not with a split count above one, a float32 q (its tiles are "cast"), a 16-bit cache, a
    caller that cannot pack (decode_rope's kernel), an odd KV head count, GQA groups that already fill
    a dot's 16 rows, or rows too few to keep PROGRAMS_PER_SM programs an SM with packed heads."""
    packed = call_for(16, 8, 256)
    assert packed.launch == FP8_PACKED and packed.grid == (4, 256, 1)
    assert call_for(16, 8, 256, num_splits=2).grid == (8, 256, 2)
    assert packed.constexprs(torch.bfloat16, torch.float8_e4m3fn)["KV_PER_PROG"] == 2
    assert packed.constexprs(torch.bfloat16, torch.float8_e4m3fn)["NUM_KV_HEADS"] == 8
    # 64 query heads over 4 KV heads at 512 rows: choose_launch packs (shapes only), prepare does not.
    assert decode_launch.choose_launch(512, 4, 128, 4096, 1, torch.device("cpu"), 132)[0] == FP8_PACKED
    for call in (call_for(16, 8, 256, num_splits=2), call_for(16, 8, 256, q_dtype=torch.float32),
                 call_for(16, 8, 256, packs=False), call_for(15, 5, 256), call_for(64, 4, 512)):
        assert call.launch == FP8_LARGE_BATCH, call.grid
    assert call_for(16, 8, 256, cache_dtype=torch.bfloat16).launch.kv_per_prog == 1
    assert call_for(16, 8, 8).launch.kv_per_prog == 1  # a small batch: several chunks a context
    assert call_for(16, 8, 128).launch == FP8_LARGE_BATCH  # one chunk a context, 2 programs an SM packed


def test_an_int8_cache_packs_with_its_words_tiles_only(monkeypatch) -> None:
    monkeypatch.setattr(decode_words, "INT8_WORDS", False)
    assert call_for(16, 8, 256, cache_dtype=torch.int8).launch == FP8_LARGE_BATCH  # "cast" tiles
    monkeypatch.setattr(decode_words, "INT8_WORDS", True)
    packed = call_for(16, 8, 256, cache_dtype=torch.int8)
    assert packed.launch == FP8_PACKED and packed.constexprs(torch.bfloat16, torch.int8)["TILES"] == "words"
