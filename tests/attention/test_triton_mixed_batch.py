"""A mixed batch through the Triton backend: its leading one-token (decoding) rows go to the decode
kernel, the prefill chunks behind them to the prefill kernel, and together they equal float32 causal
attention over each sequence's paged context."""

import math

import pytest
import torch
from conftest import triton_test_device
from paged_case import make_paged_cache, reference_attention

pytest.importorskip("triton")

from nanovllm.attention import triton_backend  # noqa: E402
from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = triton_test_device()
HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 32, 4, 2, 16


class Layer:
    """The part of an Attention layer a backend reads when attending (attention.backend.PagedLayer)."""

    def __init__(self, k_cache, v_cache) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.scale, self.k_scale, self.v_scale = 1 / math.sqrt(HEAD_DIM), 1.0, 1.0


@pytest.mark.parametrize("q_lens,kv_lens", [
    ([1, 1, 1, 9, 1, 20], [40, 3, 17, 30, 1, 20]),  # decoding rows, then chunks (one of 1 token)
    ([1, 1], [5, 33]),  # only decoding rows, in a step flagged prefill
    ([7, 1], [7, 12]),  # no leading decoding row: all through the prefill kernel
])
def test_mixed_batch_splits_between_decode_and_prefill_kernels(q_lens, kv_lens, monkeypatch):
    k_cache, v_cache, block_tables = make_paged_cache(kv_lens, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                                      torch.float32, seed=3, device=DEVICE)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    num_decode_rows = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.empty(0), block_tables=block_tables,
        seqlens_k=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE), max_seqlen_q=max(q_lens),
        num_decode_rows=num_decode_rows)
    backend = TritonBackend(max_num_seqs=8, num_kv_heads=NUM_KV_HEADS, device=torch.device(DEVICE))
    calls = []
    for kernel in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(triton_backend, kernel)
        monkeypatch.setattr(triton_backend, kernel,
                            lambda *a, _k=kernel, _real=real, **kw: calls.append(_k) or _real(*a, **kw))
    out = backend.attend(Layer(k_cache, v_cache), q, None, None, meta)
    scale = 1 / math.sqrt(HEAD_DIM)
    expected = reference_attention(q, k_cache, v_cache, q_lens, kv_lens, block_tables, scale)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
    assert ("paged_decode_attention" in calls) == (num_decode_rows > 0)
    assert ("paged_prefill_attention" in calls) == (num_decode_rows < len(q_lens))
