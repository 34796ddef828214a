"""TritonBackend.warm_up builds every launch variant of the decode kernels an eager step can pick
(decode_launch.choose_launch's settings over all row counts and block-table widths), and writes nothing
into the KV cache it runs over."""

import types

import pytest
import torch
from conftest import triton_test_device
from transformers import Qwen3Config

from nanovllm.attention.backend import QKNorm
from nanovllm.attention.layer import RotaryEmbedding

pytest.importorskip("triton")

from nanovllm.attention import triton_backend  # noqa: E402
from nanovllm.kernels import decode_launch  # noqa: E402
from nanovllm.kernels.common import sm_count  # noqa: E402

DEVICE = triton_test_device()
H, HKV, D, BS = 4, 2, 32, 16
MAX_NUM_SEQS, MAX_BLOCKS = 8, 80  # 1,280-token contexts: enough chunks for the small-batch launch


def make_layer(cache_dtype):
    gen = torch.Generator().manual_seed(0)
    cache = [(torch.randn(12, BS, HKV, D, generator=gen) * 8).to(DEVICE, cache_dtype) for _ in range(2)]
    scales = [torch.rand(12, BS, HKV, generator=gen).to(DEVICE) for _ in range(2)]  # an int8 cache's
    norm = QKNorm(torch.ones(D, device=DEVICE), torch.ones(D, device=DEVICE), 1e-6)
    rotary = RotaryEmbedding(Qwen3Config(head_dim=D), D, max_position=MAX_BLOCKS * BS).to(DEVICE)
    return types.SimpleNamespace(num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D**-0.5, rotary=rotary,
                                 qk_norm=norm, k_cache=cache[0], v_cache=cache[1], k_scale=1.0, v_scale=1.0,
                                 k_cache_scales=scales[0], v_cache_scales=scales[1])


def variant(fused: bool, launch, splits: int, rows: int) -> tuple:
    """What selects a compiled variant of a decode kernel: its launch, whether it has one chunk a context
    (no combine), and for the fused kernel whether it lets its PDL dependent launch after its K/V loop
    (its decode bucket's late_trigger)."""
    return launch, splits == 1, fused and triton_backend.TritonBackend.decode_bucket(rows).late_trigger


def reachable_variants(fused: bool, element_size: int) -> set:
    """The variants the decode kernel (fused: the fused-rope one) takes at any shape."""
    max_rows = min(MAX_NUM_SEQS, triton_backend.TritonBackend.fused_max_rows()) if fused else MAX_NUM_SEQS
    device = torch.device(DEVICE)
    num_sms = sm_count(device)
    return {variant(fused, *decode_launch.choose_launch(rows, HKV, D, width * BS, element_size, device,
                                                        num_sms), rows)
            for rows in range(1, max_rows + 1) for width in range(1, MAX_BLOCKS + 1)}


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn, torch.int8],
                         ids=["fp16", "fp8", "int8"])
def test_warm_up_builds_every_decode_launch_and_leaves_the_cache(monkeypatch, cache_dtype):
    layer = make_layer(cache_dtype)
    before = [t.view(torch.uint8).clone() for t in (layer.k_cache, layer.v_cache, layer.k_cache_scales,
                                                      layer.v_cache_scales)]
    backend = triton_backend.TritonBackend(MAX_NUM_SEQS, HKV, torch.device(DEVICE))
    warmed, kernel = set(), [None]
    real_choose = decode_launch.choose_launch

    def choose(rows, *args, **kwargs):
        launch, splits = real_choose(rows, *args, **kwargs)
        if kernel[0] is not None:  # a launch, not the warm-up's own survey of the shapes
            warmed.add((kernel[0], variant(kernel[0], launch, splits, rows)))
        return launch, splits

    monkeypatch.setattr(decode_launch, "choose_launch", choose)
    def calling(fused, real):  # notes which kernel the launches chosen next belong to
        def call(*args, **kwargs):
            kernel[0] = fused
            try:
                return real(*args, **kwargs)
            finally:
                kernel[0] = None
        return call

    for name, fused in (("paged_decode_attention", False), ("paged_decode_rope_attention", True)):
        monkeypatch.setattr(triton_backend, name, calling(fused, getattr(triton_backend, name)))

    backend.warm_up(layer, torch.float16, MAX_NUM_SEQS, MAX_BLOCKS)

    for fused in (False, True):
        reachable = reachable_variants(fused, layer.k_cache.element_size())
        # 8-bit caches: and packed KV heads, which short contexts reach at one chunk a context even at these
        # rows (an int8 cache's calls then take the unpacked launch: DecodeCall.prepare)
        assert len({launch for launch, _, _ in reachable}) == (2 if cache_dtype == torch.float16 else 3), \
            "the case should reach both the large- and the small-batch launch"
        assert {one_split for _, one_split, _ in reachable} == {False, True}, \
            "the case should reach one chunk a context and several"
        assert reachable <= {v for f, v in warmed if f == fused}
    after = (layer.k_cache, layer.v_cache, layer.k_cache_scales, layer.v_cache_scales)
    assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(after, before, strict=True))


def test_warm_up_builds_the_fused_kernel_as_a_programmatic_dependent_where_forward_launches_it(monkeypatch):
    """On an sm_90+ GPU forward launches the fused kernel with pdl=True, a variant of its own: the warm-up
    must build that one (an eager decode step would otherwise compile it mid-run)."""
    layer = make_layer(torch.float16)
    backend = triton_backend.TritonBackend(MAX_NUM_SEQS, HKV, torch.device(DEVICE))
    backend.pdl = True  # as supports_pdl says on an H100/H200
    fused_calls = []
    monkeypatch.setattr(triton_backend, "paged_decode_attention", lambda *args, **kwargs: None)
    monkeypatch.setattr(triton_backend, "paged_decode_rope_attention",
                        lambda *args, **kwargs: fused_calls.append(kwargs.get("pdl", False)))
    backend.warm_up(layer, torch.float16, MAX_NUM_SEQS, MAX_BLOCKS)
    assert fused_calls and all(fused_calls)
