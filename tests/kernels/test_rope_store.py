"""The fused q/k-norm + rotary + KV-store kernel against the reference backend's PyTorch path, on CPU
tensors through the Triton interpreter (or on CUDA with TRITON_INTERPRET=0)."""

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from transformers import Qwen3Config  # noqa: E402

from nanovllm.attention.layer import (  # noqa: E402
    RotaryEmbedding,
    apply_rotary,
    rms_norm,  # noqa: E402
)
from nanovllm.attention.torch_backend import store_kvcache_torch  # noqa: E402
from nanovllm.kernels.rope_store import norm_rope_store  # noqa: E402

DEVICE = triton_test_device()
EPS = 1e-6


def run_both(num_heads, num_kv_heads, head_dim, dtype, with_norm, block_size=16, num_tokens=7):
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    config = Qwen3Config(head_dim=head_dim, rope_theta=10000.0)
    rope = RotaryEmbedding(config, head_dim, max_position=512).to(DEVICE)
    # q/k/v as strided slices of one fused projection, as the model hands them over
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens].to(DEVICE, torch.int32)
    slots[2] = -1  # a padded token: stores nothing
    weights = [(torch.randn(head_dim, generator=gen).to(DEVICE, dtype), EPS) for _ in range(2)]
    norms = weights if with_norm else [None, None]

    cache_shape = (4, block_size, num_kv_heads, head_dim)
    ref_caches = [torch.zeros(cache_shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    ref_q, ref_k = q.float(), k.float()  # the reference computes in float32 throughout
    if with_norm:
        ref_q = rms_norm(ref_q, weights[0][0].float(), EPS)
        ref_k = rms_norm(ref_k, weights[1][0].float(), EPS)
    ref_q, ref_k = apply_rotary(ref_q, ref_k, positions, rope.cos, rope.sin)
    store_kvcache_torch(ref_k.to(dtype), v, *ref_caches, slots)

    caches = [torch.zeros(cache_shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    out_q, out_k = norm_rope_store(q, k, v, positions, rope.cos, rope.sin, *caches, slots, *norms)
    return (ref_q, ref_k, ref_caches), (out_q, out_k, caches)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk-norm", "rope-only"])
# (6, 3): head counts that are not powers of two, so the program's head tiles have masked rows.
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (6, 3)], ids=["gqa", "mha", "odd-heads"])
@pytest.mark.parametrize("head_dim", [32, 128, 96])  # 96: halves of 48, not a power of two
def test_matches_unfused_path_float32(with_norm, heads, head_dim):
    (ref_q, ref_k, ref_caches), (q, k, caches) = run_both(*heads, head_dim, torch.float32, with_norm)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_rounds_once():
    """In bf16 the kernel computes in float32 and rounds once: within one bf16 ulp
    (2**-7 relative) of the float32 result."""
    (ref_q, ref_k, ref_caches), (q, k, caches) = run_both(4, 2, 64, torch.bfloat16, with_norm=True)
    torch.testing.assert_close(q.float(), ref_q, atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(k.float(), ref_k, atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(caches[1], ref_caches[1], atol=0, rtol=0)  # v is copied bit for bit


def test_bad_arguments_raise_value_errors():
    q = torch.zeros(3, 4, 32)
    k = v = torch.zeros(3, 2, 32)
    cache = torch.zeros(2, 16, 2, 32)
    cos = torch.zeros(64, 32)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="one entry per token"):
        norm_rope_store(q, k, v, torch.zeros(2, dtype=torch.long), cos, cos, cache, cache, slots)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        norm_rope_store(q, k, v, torch.zeros(3, dtype=torch.long), cos, cos, cache, cache, slots,
                        q_norm=(torch.ones(32), 1e-6))
    with pytest.raises(ValueError, match="must both hold torch.float32, torch.float8_e4m3fn or torch.int8"):
        norm_rope_store(q, k, v, torch.zeros(3, dtype=torch.long), cos, cos, cache.half(), cache, slots)


def test_fp8_cache_stores_scaled_and_clamped_keys_and_values():
    """With an fp8 cache the kernel stores k / k_scale and v / v_scale, clamped to e4m3's range and
    rounded to the nearest e4m3 (as torch's conversion rounds; tests/conftest.py makes the interpreter's
    cast do so too); the returned k stays in the model's dtype. Position 0 rotates nothing; the scales
    are powers of two, so that dividing and multiplying by the inverse agree."""
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(Qwen3Config(head_dim=64, rope_theta=10000.0), 64, max_position=512).to(DEVICE)
    k_scale, v_scale = 0.5, 2.0
    values = torch.randn(6, 2, 64, generator=gen).mul(100)
    k, v = (values * k_scale).to(DEVICE), (values * v_scale).to(DEVICE)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 224.0, -224.0])  # beyond 448 once scaled: clamped
    q = torch.randn(6, 4, 64, generator=gen).to(DEVICE)
    positions = torch.zeros(6, dtype=torch.long, device=DEVICE)
    slots = torch.arange(6, dtype=torch.int32, device=DEVICE)
    caches = [torch.zeros(1, 16, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    _, out_k = norm_rope_store(q, k, v, positions, rope.cos, rope.sin, *caches, slots, k_scale=k_scale,
                               v_scale=v_scale)
    assert out_k.dtype == torch.float32 and torch.equal(out_k, k)
    expected_k = (k / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(caches[0][0, :6].float(), expected_k)
    assert torch.equal(caches[1][0, :6].float(), (v / v_scale).to(torch.float8_e4m3fn).float())
    assert caches[0][0, 0, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
