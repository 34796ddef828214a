"""The fused MoE with fp8 experts (e4m3 weights, float32 scales per row and K group: layers/fp8.py's
layout) against the torch path on the exactly dequantized weights with unrounded activations (W8A16),
and with w8a8 against the CPU's reference (activations rounded per token and group), on CPU tensors
through the Triton interpreter (or on CUDA with TRITON_INTERPRET=0): 128-wide scale groups (a block-wise
checkpoint's) and one scale a row (per channel), few and many tokens, either operand order (swap_ab); with
f16, the same outputs as widening to bf16; the launch parameters it picks for fp8 experts; and the misuse
it refuses."""

from dataclasses import astuple

import pytest
import torch
from conftest import triton_test_device

pytest.importorskip("triton")

from nanovllm.kernels import moe_launch  # noqa: E402
from nanovllm.kernels.fused_moe import MoeConfig, fit_shared_memory, fused_moe, moe_config  # noqa: E402
from nanovllm.layers.fp8 import dequantize, fp8_dequant_linear, quantize_groups  # noqa: E402
from nanovllm.layers.fused_moe import route, torch_moe  # noqa: E402

DEVICE = triton_test_device()
# K = 320 for gate/up (128-wide groups: two and a partial one), 124 for down (one partial group); N not a
# multiple of the column tiles.
NUM_EXPERTS, HIDDEN, INTERMEDIATE = 4, 320, 128
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# float32: the same products, summed in another order. bf16: each weight tile widened to bf16 in
# registers (the block-wise case) and bf16 activations, against a float32 reference.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def fp8_experts(group13: int, group2: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE - 8, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE - 4, generator=gen) / INTERMEDIATE**0.5
    (q13, s13), (q2, s2) = quantize_groups(w13, group13), quantize_groups(w2, group2)
    return (q13.contiguous().to(DEVICE), s13.to(DEVICE), q2.contiguous().to(DEVICE), s2.to(DEVICE))


def scale_groups(grouping: str) -> tuple[int, int]:
    # The down projection's K is 124: per channel one group, block-wise a single partial 128 group.
    return (128, 128) if grouping == "block-128" else (HIDDEN, INTERMEDIATE - 4)


def routed_tokens(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    return x, *route(torch.randn(num_tokens, NUM_EXPERTS, generator=gen).to(DEVICE), 2, True)


def w8a8_reference(x, q13, s13, q2, s2, groups, topk_weights, topk_ids) -> torch.Tensor:
    """The CPU's fp8 experts (layers/fused_moe.MoEExperts on the CPU): each expert's rows through
    layers/fp8.fp8_dequant_linear, which rounds them to e4m3 per token and group first."""
    scales = {id(q13): (s13, groups[0]), id(q2): (s2, groups[1])}

    def linear(rows, weight, expert):
        scale, group = scales[id(weight)]
        return fp8_dequant_linear(rows, weight[expert], scale[expert], group, None)

    return torch_moe(x, q13, q2, topk_weights, topk_ids, linear)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grouping", ["block-128", "per-channel"])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fp8_experts_match_the_dequantized_weights(num_tokens, grouping, dtype):
    groups = scale_groups(grouping)
    q13, s13, q2, s2 = fp8_experts(*groups)
    x, topk_weights, topk_ids = routed_tokens(num_tokens, dtype)
    config = MoeConfig(16, 32, 64 if dtype == torch.float32 else 128, swap_ab=num_tokens == 5)
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, config, w13_scale=s13, w2_scale=s2,
                    scale_groups=groups)
    ref = torch_moe(x.float(), dequantize(q13, s13, groups[0]), dequantize(q2, s2, groups[1]), topk_weights,
                    topk_ids)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("config", [MoeConfig(16, 64, 64, w8a8=True),
                                    MoeConfig(16, 64, 64, swap_ab=True, w8a8=True),
                                    MoeConfig(64, 256, 128, num_warps=8, num_stages=3, w8a8=True)],
                         ids=["a-w", "w-a", "prefill-tiles"])
@pytest.mark.parametrize("grouping", ["block-128", "per-channel"])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_w8a8_experts_round_the_activations_as_the_reference(num_tokens, grouping, config):
    """float32 in and out: the kernel lands on the reference's rounding of x and of the intermediate, far
    from the unrounded (W8A16) result that rounding moves it from. In the interpreter the e4m3 products
    are exact and summed in float32, so only where an intermediate value, summed in another order, falls
    on the other side of an e4m3 rounding boundary does it take the neighbouring value (one e4m3 step),
    moving the outputs it feeds by up to a few 1e-3. sm_90's fp8 tensor cores keep ~14 bits while they
    sum a K tile (kernels/fp8_gemm.py): outputs ~1e-4 off the float32 sum, so more intermediates cross a
    boundary (on an H200: up to 1.7e-2 at 40 tokens)."""
    groups = scale_groups(grouping)
    q13, s13, q2, s2 = fp8_experts(*groups)
    x, topk_weights, topk_ids = routed_tokens(num_tokens, torch.float32)
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, config, w13_scale=s13, w2_scale=s2,
                    scale_groups=groups)
    ref = w8a8_reference(x, q13, s13, q2, s2, groups, topk_weights, topk_ids)
    unrounded = torch_moe(x, dequantize(q13, s13, groups[0]), dequantize(q2, s2, groups[1]), topk_weights,
                          topk_ids)
    assert (out - unrounded).abs().max() > 0.03  # 0.06-0.11 here: the rounding of x and the intermediate
    if DEVICE == "cpu":
        torch.testing.assert_close(out, ref, atol=5e-3, rtol=0)
        assert (out - ref).abs().gt(1e-4).float().mean() < 0.03  # the rest agree to float32's rounding
    else:
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=0)
        assert (out - ref).abs().mean() < 0.2 * (unrounded - ref).abs().mean()


@pytest.mark.parametrize("swap_ab", [False, True], ids=["a-w", "w-a"])
@pytest.mark.parametrize("grouping", ["block-128", "per-channel"])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_float16_rows_give_the_bf16_widened_experts_bit_for_bit(num_tokens, grouping, swap_ab):
    """f16 configs: bf16 x and intermediate as float16 rows times powers of two (exact), the e4m3 tiles
    widened to float16: the same products as widening to bf16, each a power of two apart, the same float32
    sums (the interpreter sums float16 dots as bf16 ones), so the same bf16 outputs. Rows of x thousands of
    times apart in magnitude, as float16's range alone could not hold."""
    groups = scale_groups(grouping)
    q13, s13, q2, s2 = fp8_experts(*groups)
    x, topk_weights, topk_ids = routed_tokens(num_tokens, torch.bfloat16)
    x = (x.float() * torch.logspace(4, -3, num_tokens, device=DEVICE)[:, None]).to(torch.bfloat16)
    outs = [fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 128, swap_ab=swap_ab, f16=f16),
                      w13_scale=s13, w2_scale=s2, scale_groups=groups) for f16 in (False, True)]
    assert outs[1].dtype == torch.bfloat16 and outs[1].abs().max() > 1e4
    if DEVICE == "cpu":
        assert torch.equal(outs[1], outs[0])
    else:  # the GPU's float16 and bf16 tensor cores may sum in other orders: a row's rounding apart
        rows = outs[0].float().abs().amax(dim=1, keepdim=True)
        assert ((outs[1].float() - outs[0].float()).abs() / rows).max() < 1e-2


def test_float16_rows_are_a_choice_for_bf16_fp8_experts_left_w8a16(monkeypatch):
    bf16 = torch.bfloat16
    monkeypatch.setattr(moe_launch, "F16_EXPERTS", True)
    monkeypatch.setattr(moe_launch, "W8A8_EXPERTS", False)
    config = moe_config(2048, 128, bf16, fp8_weights=True)
    assert config.f16 and not config.w8a8 and config.swap_ab  # 32-row blocks: the weight on wgmma's side
    assert moe_config(2048, 128, bf16, fp8_weights=True, w8a8=False).f16  # a static checkpoint's experts
    assert not moe_config(2048, 128, torch.float32, fp8_weights=True).f16  # float32 is not exact in float16
    assert not moe_config(2048, 128, bf16).f16  # bf16 experts widen nothing
    monkeypatch.setattr(moe_launch, "W8A8_EXPERTS", True)
    config = moe_config(2048, 128, bf16, fp8_weights=True)
    assert config.w8a8 and not config.f16  # W8A8 first where allowed
    q13, s13, q2, s2 = fp8_experts(128, 128)
    x, topk_weights, topk_ids = routed_tokens(3, torch.float32)
    with pytest.raises(ValueError, match="an f16 config takes bf16 activations"):
        fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 128, f16=True), w13_scale=s13,
                  w2_scale=s2, scale_groups=(128, 128))


def test_fp8_experts_take_k_tiles_that_split_their_scale_groups():
    bf16 = torch.bfloat16
    # 16 slots an expert (256 rows at top-8 of 128): fp8 K tiles as wide in bytes as bf16's
    assert moe_config(2048, 128, bf16).block_k == 64
    assert moe_config(2048, 128, bf16, fp8_weights=True).block_k == 128
    assert moe_config(2048, 128, bf16, fp8_weights=True, k_group=128).block_k == 128
    # a checkpoint's narrower blocks narrow the tiles to split them
    assert moe_config(8, 128, bf16, fp8_weights=True, k_group=64).block_k == 64
    assert moe_config(8, 128, bf16, fp8_weights=True, k_group=96).block_k == 32


def test_fast_accumulation_chains_the_w8a8_dots_of_per_channel_experts():
    """MoeConfig.fast_accum: the interpreter sums e4m3 products in float32 either way, so the chained dots
    give the fresh-dot-a-tile outputs exactly; on the GPU the fp8 tensor cores' narrower accumulator may
    move them, as far as the W8A8 test allows. 128-input scale groups need a fresh dot a tile: refused."""
    groups = scale_groups("per-channel")
    q13, s13, q2, s2 = fp8_experts(*groups)
    x, topk_weights, topk_ids = routed_tokens(40, torch.float32)
    outs = [fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 64, 64, w8a8=True, fast_accum=fast),
                      w13_scale=s13, w2_scale=s2, scale_groups=groups) for fast in (False, True)]
    if DEVICE == "cpu":
        assert torch.equal(outs[1], outs[0])
    else:
        ref = w8a8_reference(x, q13, s13, q2, s2, groups, topk_weights, topk_ids)
        torch.testing.assert_close(outs[1], ref, atol=3e-2, rtol=0)
    b13, bs13, b2, bs2 = fp8_experts(128, 128)
    with pytest.raises(ValueError, match="fast_accum config chains"):
        fused_moe(x, b13, b2, topk_weights, topk_ids, MoeConfig(16, 64, 64, w8a8=True, fast_accum=True),
                  w13_scale=bs13, w2_scale=bs2, scale_groups=(128, 128))


def test_fast_accumulation_is_the_configs_choice_only_where_its_switch_and_scales_allow(monkeypatch):
    bf16 = torch.bfloat16
    monkeypatch.setattr(moe_launch, "FAST_ACCUM_EXPERTS", False)
    assert not moe_config(65536, 128, bf16, fp8_weights=True).fast_accum
    monkeypatch.setattr(moe_launch, "FAST_ACCUM_EXPERTS", True)
    for slots in (8, 2048, 65536):
        assert moe_config(slots, 128, bf16, fp8_weights=True).fast_accum
    assert not moe_config(2048, 128, bf16, fp8_weights=True, k_group=128).fast_accum  # block scales
    assert not moe_config(2048, 128, bf16, fp8_weights=True, w8a8=False).fast_accum  # W8A16
    assert not moe_config(2048, 128, bf16).fast_accum


def test_prefill_takes_256_column_tiles_where_they_were_timed():
    bf16, prefill = torch.bfloat16, 65536  # 8,192 tokens at top-8 of 128 experts
    assert astuple(moe_config(prefill, 128, bf16))[:5] == (64, 256, 64, 8, 3)
    per_channel = moe_config(prefill, 128, bf16, fp8_weights=True)
    assert per_channel.w8a8 and astuple(per_channel)[:6] == (64, 256, 128, 8, 3, False)
    blocks = moe_config(prefill, 128, bf16, fp8_weights=True, k_group=128)  # 256 columns spill registers
    assert blocks.w8a8 and (blocks.block_n, blocks.block_k) == (128, 128)
    assert moe_config(prefill, 128, bf16, fp8_weights=True, k_group=64).block_k == 64
    widened = moe_config(prefill, 128, bf16, fp8_weights=True, w8a8=False)  # a static checkpoint's experts
    assert not widened.w8a8 and (widened.block_n, widened.block_k) == (128, 64)


def test_tiles_shrink_to_the_devices_shared_memory():
    prefill = moe_config(65536, 128, torch.bfloat16)  # 3 stages of 72 KB
    assert fit_shared_memory(prefill, 2, 2, 232448) == prefill  # Hopper's 227 KB
    a100 = fit_shared_memory(prefill, 2, 2, 166912)
    assert (a100.num_stages, a100.block_n) == (2, 256)
    ada = fit_shared_memory(prefill, 2, 2, 101376)
    assert (ada.num_stages, ada.block_n) == (2, 128)
    decode = moe_config(8, 128, torch.bfloat16)  # 4 stages of 16 x 128 activations, 2 x 32 x 128 weights
    assert fit_shared_memory(decode, 2, 2, 101376) == decode


def test_w8a8_is_the_configs_choice_for_fp8_experts_only(monkeypatch):
    bf16 = torch.bfloat16
    for slots in (8, 2048, 65536):  # one token, 256 rows and prefill at top-8 of 128 experts
        config = moe_config(slots, 128, bf16, fp8_weights=True)
        assert config.w8a8 and config.swap_ab == (config.block_m < 64)  # the weight tile on wgmma's side
    assert not moe_config(2048, 128, bf16).w8a8  # bf16 experts have nothing to quantize against
    assert not moe_config(8, 128, bf16, fp8_weights=True, k_group=16).w8a8  # no e4m3 dot tiles 16 inputs
    # a static checkpoint's experts keep their activations unrounded (layers/fused_moe.py): W8A16's config
    unrounded = moe_config(2048, 128, bf16, fp8_weights=True, w8a8=False)
    assert not unrounded.w8a8
    monkeypatch.setattr(moe_launch, "W8A8_EXPERTS", False)  # the switch off: every fp8 config is W8A16's
    assert unrounded == moe_config(2048, 128, bf16, fp8_weights=True)


def test_fp8_experts_in_narrow_groups_run_with_the_default_config(monkeypatch):
    """32-wide scale groups, narrower than every default K tile: fused_moe picks tiles that split them (32
    wide: still an e4m3 dot's, so W8A8, x rounded a group of 32), and with W8A8 off (W8A16)."""
    q13, s13, q2, s2 = fp8_experts(32, 32)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, HIDDEN, generator=gen).to(DEVICE)
    topk_weights, topk_ids = route(torch.randn(5, NUM_EXPERTS, generator=gen).to(DEVICE), 2, True)
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2, scale_groups=(32, 32))
    ref = w8a8_reference(x, q13, s13, q2, s2, (32, 32), topk_weights, topk_ids)
    torch.testing.assert_close(out, ref, atol=5e-3 if DEVICE == "cpu" else 3e-2, rtol=0)
    monkeypatch.setattr(moe_launch, "W8A8_EXPERTS", False)
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2, scale_groups=(32, 32))
    ref = torch_moe(x, dequantize(q13, s13, 32), dequantize(q2, s2, 32), topk_weights, topk_ids)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_fp8_experts_without_scales_or_with_odd_groups_are_refused():
    q13, s13, q2, s2 = fp8_experts(128, 128)
    x = torch.randn(3, HIDDEN).to(DEVICE)
    topk_weights, topk_ids = route(torch.randn(3, NUM_EXPERTS).to(DEVICE), 2, True)
    with pytest.raises(ValueError, match="need their scales"):
        fused_moe(x, q13, q2, topk_weights, topk_ids)
    _, s13_odd, _, _ = fp8_experts(96, 128)  # 96-wide groups: not a whole number of 64-wide K tiles
    with pytest.raises(ValueError, match="do not split into"):
        fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 64), w13_scale=s13_odd, w2_scale=s2,
                  scale_groups=(96, 128))
    with pytest.raises(ValueError, match="not fp8"):
        w13, w2 = dequantize(q13, s13, 128), dequantize(q2, s2, 128)
        fused_moe(x, w13, w2, topk_weights, topk_ids, MoeConfig(16, 32, 64, w8a8=True))
    _, s13_16, _, s2_16 = fp8_experts(16, 16)  # no e4m3 dot tiles 16 inputs
    with pytest.raises(ValueError, match="K tiles of at least 32"):
        fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 16, w8a8=True), w13_scale=s13_16,
                  w2_scale=s2_16, scale_groups=(16, 16))
    with pytest.raises(ValueError, match="one column per 64"):
        fused_moe(x, q13, q2, topk_weights, topk_ids, MoeConfig(16, 32, 64), w13_scale=s13, w2_scale=s2,
                  scale_groups=(64, 128))
