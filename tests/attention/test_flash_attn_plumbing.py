"""FlashAttention backends' argument plumbing, checked on CPU against the torch backend by standing
in for `flash_attn` (FA2) and `flash_attn_interface` (FA3) with PyTorch implementations of their
documented semantics. The real kernels are checked on the GPU by scripts/gpu_check.py."""

import sys
import types

import pytest
import torch
from conftest import triton_test_device
from paged_case import make_paged_cache, seq_slots
from transformers import Qwen3Config

from nanovllm.attention.backend import QKNorm
from nanovllm.attention.layer import RotaryEmbedding
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchBackend, gather_kv

pytest.importorskip("triton")  # the fused norm + rotary + store kernel runs in Triton's interpreter here
DEVICE = triton_test_device()


def _attend(q, k, v, scale, causal=True):
    """q: [Lq, H, D], k/v: [Lk, Hkv, D]; bottom-right aligned causal mask, as FlashAttention does."""
    lq, lk, groups = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        keys, queries = torch.arange(lk, device=q.device), torch.arange(lk - lq, lk, device=q.device)
        mask = keys[None, :] <= queries[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def _paged(cache, table, n):
    return gather_kv(cache, table, int(n))


def fake_fa2():
    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False, block_table=None):
        assert causal and softmax_scale is not None
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            if block_table is None:
                ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
                ki, vi = k[ks:ke], v[ks:ke]
            else:  # k, v are the paged caches; cu_seqlens_k gives each sequence's context length
                n = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
                ki, vi = _paged(k, block_table[i], n), _paged(v, block_table[i], n)
            out[qs:qe] = _attend(q[qs:qe], ki, vi, softmax_scale)
        return out

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                     causal=False):
        assert q.dim() == 4 and causal
        return torch.stack([_attend(q[b], _paged(k_cache, block_table[b], cache_seqlens[b]),
                                    _paged(v_cache, block_table[b], cache_seqlens[b]), softmax_scale)
                            for b in range(q.shape[0])])

    return types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)


def fake_fa3():
    fa2 = fake_fa2()

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False):
        return fa2.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=softmax_scale, causal=causal)

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, page_table=None, cu_seqlens_q=None,
                     max_seqlen_q=None, softmax_scale=None, causal=False):
        if cu_seqlens_q is None:
            return fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                               block_table=page_table, softmax_scale=softmax_scale,
                                               causal=causal)
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            n = cache_seqlens[i]
            out[qs:qe] = _attend(q[qs:qe], _paged(k_cache, page_table[i], n),
                                 _paged(v_cache, page_table[i], n), softmax_scale)
        return out

    return types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)


@pytest.fixture(params=["flash-attn", "fa3"])
def backend(request, monkeypatch):
    from nanovllm.attention import flash_attn_backend
    if request.param == "flash-attn":
        monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2())
        return flash_attn_backend.FlashAttention2Backend()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3())
    return flash_attn_backend.FlashAttention3Backend()


H, HKV, D, BS = 4, 2, 16, 4


def make_case(q_lens, ctx_lens, is_prefill):
    """A layer and a batch where sequence i computes its last q_lens[i] of ctx_lens[i] tokens."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = make_paged_cache(ctx_lens, BS, HKV, D, torch.float32, seed=0, device=DEVICE,
                                                 unowned=0.0)  # the references mask after multiplying
    slots = torch.cat([seq_slots(t, ctx, BS)[ctx - q:] for t, q, ctx in zip(tables, q_lens, ctx_lens)])
    positions = torch.cat([torch.arange(ctx - q, ctx) for q, ctx in zip(q_lens, ctx_lens)])
    cu_q, cu_k = [0], [0]
    for q_len, ctx in zip(q_lens, ctx_lens, strict=True):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + ctx)
    meta = AttentionMetadata(
        is_prefill=is_prefill, slot_mapping=slots.to(DEVICE),
        seqlens_k=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), block_tables=tables,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx_lens),
        has_prefix=any(q < c for q, c in zip(q_lens, ctx_lens, strict=True)),
        cu_seqlens_q_host=cu_q, seqlens_k_host=list(ctx_lens))
    norm = QKNorm(torch.randn(D, generator=gen).to(DEVICE), torch.randn(D, generator=gen).to(DEVICE), 1e-6)
    rotary = RotaryEmbedding(Qwen3Config(head_dim=D), D, max_position=64).to(DEVICE)
    layer = types.SimpleNamespace(num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D**-0.5, rotary=rotary,
                                  qk_norm=norm, k_cache=k_cache, v_cache=v_cache, k_scale=1.0,
                                  v_scale=1.0)
    qkv = [torch.randn(sum(q_lens), h, D, generator=gen).to(DEVICE) for h in (H, HKV, HKV)]
    return layer, qkv, positions.to(DEVICE), meta


@pytest.mark.parametrize("q_lens, ctx_lens, is_prefill", [
    ([5, 9, 1], [5, 9, 1], True),  # prefill, no cached prefix: attends over the step's own k/v
    ([3, 9, 2], [11, 9, 6], True),  # prefill over cached prefixes: reads the paged cache
    ([1, 1, 1], [13, 4, 7], False),  # decode
], ids=["prefill", "prefill-prefix", "decode"])
def test_flash_attn_backends_match_torch_backend(backend, q_lens, ctx_lens, is_prefill):
    layer, (q, k, v), positions, meta = make_case(q_lens, ctx_lens, is_prefill)
    reference = types.SimpleNamespace(**vars(layer))
    reference.k_cache, reference.v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    expected = TorchBackend().forward(reference, q, k, v, positions, meta)
    out = backend.forward(layer, q, k, v, positions, meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # new K/V (k normed and rotated) stored into the same slots
    torch.testing.assert_close(layer.k_cache, reference.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.v_cache, reference.v_cache)


@pytest.mark.parametrize("q_lens, ctx_lens, pad", [
    ([5, 9, 1], [5, 9, 1], 0),  # prefill, no cached prefix
    ([3, 9, 2], [11, 9, 6], 3),  # prefill over cached prefixes, 3 padding rows (a bucketed step)
    ([1, 1, 4, 2], [13, 4, 7, 2], 2),  # mixed: two decoding rows first, then prefill chunks
], ids=["prefill", "prefill-prefix-padded", "mixed-padded"])
def test_triton_fa3_prefill_matches_torch_backend(monkeypatch, q_lens, ctx_lens, pad):
    """triton-fa3: the Triton backend with FA3's paged prefill: decoding rows of a mixed step through the
    Triton decode kernel, the rest through FA3 from their own cu_seqlens (from 0); padding rows zero."""
    from nanovllm.attention import triton_backend
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3())
    monkeypatch.setattr(triton_backend.TritonBackend, "FA3_MIN_MEAN_CHUNK", 1)  # these chunks are short
    backend = triton_backend.TritonBackend(8, HKV, torch.device(DEVICE), fa3_prefill=True)
    assert backend.name == "triton-fa3"
    layer, (q, k, v), positions, meta = make_case(q_lens, ctx_lens, True)
    d = next(i for i, n in enumerate(q_lens) if n != 1)
    meta.num_decode_rows = d
    if d:
        cu_q = meta.cu_seqlens_q_host
        meta.prefill_cu_seqlens_q = torch.tensor([n - d for n in cu_q[d:]], dtype=torch.int32, device=DEVICE)
        meta.decode_order = torch.arange(d, dtype=torch.int32, device=DEVICE)
    reference = types.SimpleNamespace(**vars(layer))
    reference.k_cache, reference.v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    expected = TorchBackend().forward(reference, q, k, v, positions, meta)
    # Padding rows as the runner adds them: slot -1 (stored nowhere), position 0.
    q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:]).to(DEVICE)]) for t in (q, k, v))
    positions = torch.cat([positions, torch.zeros(pad, dtype=positions.dtype, device=DEVICE)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    out = backend.forward(layer, q, k, v, positions, meta)
    torch.testing.assert_close(out[: len(expected)], expected, atol=1e-5, rtol=1e-5)
    assert out[len(expected):].abs().sum() == 0
    torch.testing.assert_close(layer.k_cache, reference.k_cache, atol=1e-5, rtol=1e-5)


def test_triton_fa3_leaves_short_chunks_to_the_triton_kernel(monkeypatch):
    from nanovllm.attention import triton_backend
    fa3 = fake_fa3()
    calls = []
    fa3.flash_attn_with_kvcache = lambda *args, **kwargs: calls.append(kwargs) or torch.zeros(0)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    monkeypatch.setattr(triton_backend.TritonBackend, "FA3_MIN_MEAN_CHUNK", 5)
    backend = triton_backend.TritonBackend(8, HKV, torch.device(DEVICE), fa3_prefill=True)
    layer, (q, k, v), positions, meta = make_case([3, 6], [11, 6], True)  # mean chunk 4.5 < 5
    expected = TorchBackend().forward(types.SimpleNamespace(**vars(layer)), q, k, v, positions, meta)
    out = backend.forward(layer, q, k, v, positions, meta)
    assert not calls
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
