"""FlashAttention backends' argument plumbing, checked on CPU against the torch backend by standing
in for `flash_attn` (FA2) and `flash_attn_interface` (FA3) with PyTorch implementations of their
documented semantics. The real kernels are checked on the GPU by scripts/gpu_check.py."""

import sys
import types

import pytest
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchBackend, gather_kv

pytest.importorskip("triton")  # the store kernel runs in Triton's interpreter here


def _attend(q, k, v, scale, causal=True):
    """q: [Lq, H, D], k/v: [Lk, Hkv, D]; bottom-right aligned causal mask, as FlashAttention does."""
    lq, lk, groups = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        mask = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
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


H, HKV, D, BS, NUM_BLOCKS = 4, 2, 16, 4, 16


def make_case(q_lens, ctx_lens, is_prefill):
    """A batch where sequence i computes its last q_lens[i] of ctx_lens[i] tokens; blocks shuffled."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, slots, next_block = [], [], 0
    for q_len, ctx in zip(q_lens, ctx_lens, strict=True):
        n = -(-ctx // BS)
        tables.append(perm[next_block:next_block + n])
        next_block += n
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(ctx - q_len, ctx)]
    width = max(map(len, tables))
    total = sum(q_lens)
    cu_q = [0]
    for q_len in q_lens:
        cu_q.append(cu_q[-1] + q_len)
    cu_k = [0]
    for ctx in ctx_lens:
        cu_k.append(cu_k[-1] + ctx)
    meta = AttentionMetadata(
        is_prefill=is_prefill, slot_mapping=torch.tensor(slots),
        seqlens_k=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx_lens),
        has_prefix=any(q < c for q, c in zip(q_lens, ctx_lens, strict=True)),
        cu_seqlens_q_host=cu_q, seqlens_k_host=list(ctx_lens))
    qkv = [torch.randn(total, h, D, generator=gen) for h in (H, HKV, HKV)]
    return (*qkv, k_cache, v_cache, meta)


@pytest.mark.parametrize("q_lens, ctx_lens, is_prefill", [
    ([5, 9, 1], [5, 9, 1], True),  # prefill, no cached prefix: attends over the step's own k/v
    ([3, 9, 2], [11, 9, 6], True),  # prefill over cached prefixes: reads the paged cache
    ([1, 1, 1], [13, 4, 7], False),  # decode
], ids=["prefill", "prefill-prefix", "decode"])
def test_flash_attn_backends_match_torch_backend(backend, q_lens, ctx_lens, is_prefill):
    q, k, v, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, is_prefill)
    ref_cache = (k_cache.clone(), v_cache.clone())
    expected = TorchBackend().forward(q, k, v, *ref_cache, meta, D**-0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, ref_cache[0])  # new K/V stored into the same slots
    torch.testing.assert_close(v_cache, ref_cache[1])
