"""The Triton kernels over an int8 KV cache (kv_cache_dtype="int8": int8 values, a float32 scale per
(token, KV head)) against the reference backend's PyTorch path (attention/torch_backend.py), on CPU tensors
through the Triton interpreter (or on CUDA with TRITON_INTERPRET=0): the store writes the values and scales
that `quantize_int8` gives, and prefill and decode attention read them as the reference attention over the
dequantized cache does. Unowned slots' scales are NaN, so a kernel that reads a position it should have
masked fails its comparison."""

import pytest
import torch
from conftest import triton_test_device
from paged_case import make_paged_cache, reference_attention

pytest.importorskip("triton")

from transformers import Qwen3Config  # noqa: E402

from nanovllm.attention.layer import RotaryEmbedding, apply_rotary, rms_norm  # noqa: E402
from nanovllm.attention.torch_backend import quantize_int8, store_kvcache_torch  # noqa: E402
from nanovllm.kernels import decode_words  # noqa: E402
from nanovllm.kernels.decode_attention import paged_decode_attention  # noqa: E402
from nanovllm.kernels.decode_rope import paged_decode_rope_attention  # noqa: E402
from nanovllm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from nanovllm.kernels.rope_store import norm_rope_store  # noqa: E402

DEVICE = triton_test_device()
ON_GPU = DEVICE != "cpu"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
EPS = 1e-6


def int8_paged_cache(kv_lens: list[int], block_size: int, seed: int):
    """(k, v, k_scales, v_scales, block_tables): an int8 cache of random keys/values quantized per row, NaN
    scales in the slots no sequence owns."""
    k_cache, v_cache, tables = make_paged_cache(kv_lens, block_size, NUM_KV_HEADS, HEAD_DIM, torch.float32,
                                                seed)
    out = []
    for cache in (k_cache, v_cache):
        owned = ~cache.isnan().any(-1)
        values, scales = quantize_int8(torch.nan_to_num(cache, 0.0) * 3)
        out.append((values, torch.where(owned, scales, float("nan"))))
    (k8, k_scales), (v8, v_scales) = out
    return *(t.to(DEVICE) for t in (k8, v8, k_scales, v_scales)), tables.to(DEVICE)


def dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return values.cpu().float() * scales.cpu()[..., None]


KINDS = ["prefill", "prefill-prefix", "decode", "decode-one-split"]
# Decode with 16-bit queries reads the cache as "cast" tiles or, with decode_words.INT8_WORDS, as words.
CASES = [(kind, q_dtype, "cast") for kind in KINDS for q_dtype in (torch.float32, torch.bfloat16)]
CASES += [("decode", torch.bfloat16, "words"), ("decode-one-split", torch.bfloat16, "words"),
          ("decode", torch.float16, "words")]


@pytest.mark.parametrize("kind,q_dtype,tiles", CASES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("block_size", [1, 16, 256])  # per-token lookups, the usual page, one per tile
def test_attention_reads_the_int8_cache_through_its_scales(kind: str, q_dtype, tiles: str, block_size: int,
                                                           monkeypatch) -> None:
    """Scores (q . k_int8) * k_scale, values p * v_scale * v_int8: the reference attention over the
    dequantized float32 cache, exactly for a float32 q (to float32 rounding), within bf16's for bf16."""
    monkeypatch.setattr(decode_words, "INT8_WORDS", tiles == "words")
    assert kind.startswith("prefill") or decode_words.tile_form(torch.int8, q_dtype) == tiles
    q_lens, kv_lens = {"prefill": ([5, 70, 1], [5, 70, 1]), "prefill-prefix": ([3, 1], [20, 137]),
                       "decode": ([1, 1, 1], [20, 300, 1]), "decode-one-split": ([1, 1], [20, 37])}[kind]
    k8, v8, k_scales, v_scales, tables = int8_paged_cache(kv_lens, block_size, seed=block_size)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(DEVICE, q_dtype)
    seqlens_k = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    if kind.startswith("prefill"):
        cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                    device=DEVICE)
        out = paged_prefill_attention(q, k8, v8, cu_seqlens_q, seqlens_k, tables, scale, max(q_lens),
                                      k_scales=k_scales, v_scales=v_scales)
    else:
        out = paged_decode_attention(q, k8, v8, seqlens_k, tables, scale, k_scales=k_scales,
                                     v_scales=v_scales, num_splits=1 if kind.endswith("one-split") else None)
    expected = reference_attention(q.float(), dequantized(k8, k_scales), dequantized(v8, v_scales), q_lens,
                                   kv_lens, tables, scale)
    tol = 1e-4 if q_dtype == torch.float32 else 3e-2  # bfloat16: p and the output rounded to 8 bits
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


def rope_case(num_tokens: int = 7, block_size: int = 16, head_dim: int = HEAD_DIM, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(Qwen3Config(head_dim=head_dim, rope_theta=10000.0), head_dim, max_position=512)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * head_dim, generator=gen)
    q, k, v = qkv.split([NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim, NUM_KV_HEADS * head_dim], -1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))  # strided slices, as the model's
    v[1, 0] = 0.0  # an all-zero row: its scale is INT8_MIN_AMAX / 127 and its values 0
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens].to(torch.int32)
    slots[2] = -1  # a padded token: stores nothing
    norms = [(1 + 0.1 * torch.randn(head_dim, generator=gen), EPS) for _ in range(2)]
    return dict(q=q, k=k, v=v, positions=positions, slots=slots, rope=rope, norms=norms,
                shape=(4, block_size, NUM_KV_HEADS, head_dim))


@pytest.mark.parametrize("head_dim", [32, 96])  # 96: the kernel's rows are padded to 128 columns
def test_rope_store_writes_what_the_reference_quantizes(head_dim: int) -> None:
    c = rope_case(head_dim=head_dim)
    ref_q, ref_k = (rms_norm(x, w, eps) for x, (w, eps) in zip((c["q"], c["k"]), c["norms"], strict=True))
    ref_q, ref_k = apply_rotary(ref_q, ref_k, c["positions"], c["rope"].cos, c["rope"].sin)
    ref = [torch.zeros(c["shape"], dtype=torch.int8), torch.zeros(c["shape"], dtype=torch.int8),
           torch.zeros(c["shape"][:3]), torch.zeros(c["shape"][:3])]
    store_kvcache_torch(ref_k, c["v"], ref[0], ref[1], c["slots"].long(), k_cache_scales=ref[2],
                        v_cache_scales=ref[3])

    out = [torch.zeros_like(t, device=DEVICE) for t in ref]
    rope = c["rope"].to(DEVICE)
    q, k = norm_rope_store(*(c[n].to(DEVICE) for n in ("q", "k", "v", "positions")), rope.cos, rope.sin,
                           out[0], out[1], c["slots"].to(DEVICE), *[(w.to(DEVICE), e) for w, e in c["norms"]],
                           k_scales=out[2], v_scales=out[3])
    torch.testing.assert_close(k.cpu(), ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2].cpu(), ref[2], atol=0, rtol=1e-6)  # the scales, to float32 rounding
    assert torch.equal(out[3].cpu(), ref[3])  # v is not rotated: bit for bit
    assert torch.equal(out[1].cpu(), ref[1])
    # k's rotation may differ from the reference's in the last bit, and a value on a rounding tie by one.
    assert (out[0].cpu().int() - ref[0].int()).abs().max() <= 1
    assert (out[0].cpu() != ref[0]).float().mean() < 0.01
    assert not out[0].view(-1, NUM_KV_HEADS, head_dim)[c["slots"][2]].any()  # nothing stored for padding


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, "cast"), (torch.bfloat16, "cast"),
                                         (torch.bfloat16, "words")])
def test_fused_decode_stores_and_attends_as_rope_store_then_decode(dtype, tiles: str, monkeypatch) -> None:
    """decode_rope over an int8 cache: the same cache contents (values and scales) and output as
    norm_rope_store then paged_decode_attention, with the new key in a later chunk than the first; with a
    16-bit model, either form of the tiles."""
    monkeypatch.setattr(decode_words, "INT8_WORDS", tiles == "words")
    seqlens, block_size = [5, 300, 0], 16  # the last row is batch padding
    gen = torch.Generator().manual_seed(5)
    rows = len(seqlens)
    blocks_per_row = -(-max(seqlens) // block_size)
    tables = torch.randperm(rows * blocks_per_row, generator=gen).to(torch.int32).view(rows, blocks_per_row)
    values, scales = quantize_int8(torch.randn(rows * blocks_per_row, block_size, 2, NUM_KV_HEADS, HEAD_DIM,
                                               generator=gen))
    seqlens_k = torch.tensor(seqlens, dtype=torch.int32)
    positions = (seqlens_k - 1).clamp(min=0).long()
    slots = torch.tensor([int(tables[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          if n else -1 for r, n in enumerate(seqlens)])
    q, k, v = (torch.randn(rows, heads, HEAD_DIM, generator=gen)
               for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    angles = torch.randn(max(seqlens), HEAD_DIM, generator=gen)
    norms = [((1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).to(DEVICE), EPS) for _ in range(2)]
    t = [*(x.to(DEVICE, dtype) for x in (q, k, v)), *(x.to(DEVICE) for x in (positions, angles.cos(),
                                                                             angles.sin()))]
    step = [x.to(DEVICE) for x in (slots, seqlens_k, tables)]

    def caches():
        return [x.select(2, i).contiguous().to(DEVICE) for x in (values, scales) for i in (0, 1)]

    unfused = caches()
    rotated, _ = norm_rope_store(*t, unfused[0], unfused[1], step[0], *norms, k_scales=unfused[2],
                                 v_scales=unfused[3])
    expected = paged_decode_attention(rotated, unfused[0], unfused[1], *step[1:], HEAD_DIM**-0.5,
                                      k_scales=unfused[2], v_scales=unfused[3])
    fused = caches()
    out = paged_decode_rope_attention(*t, fused[0], fused[1], *step, HEAD_DIM**-0.5, q_norm=norms[0],
                                      k_norm=norms[1], k_scales=fused[2], v_scales=fused[3])
    for got, want in zip(fused, unfused, strict=True):
        if got.dtype == torch.int8:  # the two kernels' norms may sum in another order: a tie may differ
            assert (got.int() - want.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(got, want, atol=0, rtol=1e-5)
    tol = 2e-3 if dtype == torch.float32 else 2e-2  # bfloat16's output rounding (8 bits)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert out[2].abs().max() == 0  # the padding row


def test_kernels_refuse_missing_or_misshapen_scales() -> None:
    k8, v8, k_scales, v_scales, tables = int8_paged_cache([5], 16, seed=1)
    q = torch.zeros(1, NUM_HEADS, HEAD_DIM, device=DEVICE)
    seqlens_k = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="an int8 cache needs k_scales"):
        paged_decode_attention(q, k8, v8, seqlens_k, tables, 1.0)
    with pytest.raises(ValueError, match="an int8 cache needs v_scales"):
        paged_decode_attention(q, k8, v8, seqlens_k, tables, 1.0, k_scales=k_scales, v_scales=v_scales[:, :8])
    with pytest.raises(ValueError, match="has no per-token scales"):
        paged_decode_attention(q, k8.float(), v8.float(), seqlens_k, tables, 1.0, k_scales=k_scales,
                               v_scales=v_scales)
