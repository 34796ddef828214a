"""fp8 numerics and checkpoints' refusals (layers/fp8.py, utils/config_checks.py, utils/weight_tracker.py):
e4m3 rounding per group, the block-wise linear layer equal to dequantized weights times rounded activations,
and every quantization nanovllm does not implement refused before any step, naming what it is."""

import json
import os
import shutil

import pytest
import torch
from conftest import make_model_dir
from fp8_files import dequantize_block, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from nanovllm import LLM
from nanovllm.layers.fp8 import (
    Fp8LinearMethod,
    block_scales,
    dequantize,
    quantize_activations,
    quantize_blocks,
    quantize_groups,
)
from nanovllm.layers.fp8_methods import (
    W8A8_ROWS_MAX,
    Fp8BlockScaledMmLinearMethod,
    Fp8ScaledMmLinearMethod,
    Fp8TritonLinearMethod,
    block_scaled_mm_available,
    fp8_linear_method,
)
from nanovllm.layers.linear import QKVParallelLinear, ReplicatedLinear
from nanovllm.utils.config_checks import Fp8Scheme
from nanovllm.utils.weight_tracker import WeightTracker

ENGINE = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512)


def test_groups_scale_to_the_e4m3_range_and_round_trip_within_its_precision():
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)
    q, scale = quantize_groups(x, 128)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 3)
    # each group's largest magnitude lands on the top of the e4m3 range
    padded = torch.nn.functional.pad(q.float().abs(), (0, 84)).unflatten(-1, (3, 128))
    assert torch.equal(padded.amax(-1), torch.full((5, 3), 448.0))
    back = dequantize(q, scale, 128)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values in the normal range of their group
    big = x.abs() > scale.repeat_interleave(128, -1)[:, :300] * 2**-6
    assert ((back - x).abs() <= x.abs() * 2**-4)[big].all()
    assert torch.equal(quantize_activations(torch.zeros(2, 8), 8), torch.zeros(2, 8))


def test_block_linear_is_dequantized_weight_times_rounded_activations():
    """q/k/v with 16x16 blocks whose shards start mid-block in the fused weight (q 40 rows, k/v 24)."""
    layer = QKVParallelLinear(32, 8, 5, 3, quant_method=Fp8LinearMethod(Fp8Scheme((16, 16), True)))
    model = torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({"qkv_proj": layer})})
    tracker, exact = WeightTracker(model), []
    tracker.packed = {f"{part}_proj": ("qkv_proj", part) for part in "qkv"}
    for part, rows in (("q", 40), ("k", 24), ("v", 24)):
        q, scale = quantize_blocks(torch.randn(rows, 32), (16, 16))
        tracker.load(f"attn.{part}_proj.weight", q, "f")
        tracker.load(f"attn.{part}_proj.weight_scale_inv", scale, "f")
        exact.append(dequantize_block(q, scale, (16, 16)))
    tracker.check_complete("f")
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(7, 32)
    expected = quantize_activations(x, 16) @ torch.cat(exact).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device, capability, block, method, gemm", [
    # Hopper: torch's block-scaled GEMM for 128 x 128 blocks where this torch has it
    ("cuda", (9, 0), (128, 128), *((Fp8BlockScaledMmLinearMethod, "fp8_block_scaled_mm")
                                   if block_scaled_mm_available() else (Fp8TritonLinearMethod, "fp8_gemm"))),
    ("cuda", (9, 0), (64, 64), Fp8TritonLinearMethod, "fp8_gemm"),  # other blocks: the Triton GEMM
    ("cuda", (10, 0), (128, 128), Fp8TritonLinearMethod, "fp8_gemm"),  # not measured past Hopper
    ("cuda", (9, 0), None, Fp8ScaledMmLinearMethod, "fp8_scaled_mm"),  # per channel: row-wise _scaled_mm
    ("cuda", (8, 9), (128, 128), Fp8TritonLinearMethod, "fp8_gemm"),  # Ada
    ("cuda", (8, 9), None, Fp8TritonLinearMethod, "fp8_gemm"),  # no row-wise _scaled_mm before Hopper
    ("cuda", (8, 0), (128, 128), Fp8LinearMethod, None),  # Ampere: no fp8 MMA, the dequantizing reference
    ("cpu", None, None, Fp8LinearMethod, None),
])
def test_fp8_kernels_run_on_gpus_with_fp8_tensor_cores(device, capability, block, method, gemm):
    chosen = fp8_linear_method(Fp8Scheme(block, True), torch.device(device), True, capability)
    assert type(chosen) is method and chosen.pdl
    few_rows = W8A8_ROWS_MAX if method is Fp8ScaledMmLinearMethod else 16  # the few-row kernels' last row
    names = [chosen.bucket(rows).plain.__name__ for rows in (1, few_rows, few_rows + 1, 4096)]
    # One scale a row on sm_90: bf16's one-row and few-row kernels over the e4m3 weight (the few-row one
    # over e4m3 rows, W8A8); 128 x 128 blocks there: the block GEMV at one row, the rows kernel scaling
    # each tile's product at 2-16 (over float16 rows).
    sm90 = {Fp8ScaledMmLinearMethod: ["fp8_skinny", "fp8_rows_e4m3"],
            Fp8BlockScaledMmLinearMethod: ["fp8_gemv_blocks", "fp8_rows_blocks_f16"]}
    few = sm90.get(method, ["fp8_gemv"] * 2)
    assert names == (few + [gemm] * 2 if gemm else ["fp8_dequant_linear"] * 4)
    if method in sm90:  # one row's norm and SiLU-mul: their own kernels, chained to the GEMV under PDL
        one_row = chosen.bucket(1)
        assert (one_row.normed.__name__, one_row.silu.__name__) == (f"{few[0]}_norm", f"{few[0]}_silu")


def test_block_scales_are_compact_only_where_the_weight_is_whole_blocks():
    """Fp8BlockScaledMmLinearMethod hands torch's GEMM one scale a 128 x 128 block, taken from the layout's
    per-row copy; a layer whose rows are not whole blocks, or whose block rows differ (a merged layer's
    part starting inside a block), keeps the per-row layout and the Triton GEMM."""
    weight = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    compact = torch.rand(2, 3) + 0.5
    per_row = compact.repeat_interleave(128, dim=0)
    # K = 384 is 3 blocks: padded to 4 (zeros), the layout torch's block-scaled GEMM checks for
    padded = torch.cat([compact, torch.zeros(2, 1)], dim=1)
    torch.testing.assert_close(block_scales(per_row, weight, (128, 128)), padded, rtol=0, atol=0)
    uneven = per_row.clone()
    uneven[200] += 1  # one row of the second block differs
    assert block_scales(uneven, weight, (128, 128)) is None
    assert block_scales(per_row[:200], weight[:200], (128, 128)) is None  # 200 rows: not whole blocks
    assert block_scales(per_row[:, :2], weight[:, :300], (128, 128)) is None  # K = 300


def test_the_block_method_falls_back_to_the_triton_gemm_without_whole_blocks(monkeypatch):
    """Its kernel from 17 rows takes torch's block-scaled GEMM with the compact scales, and the Triton
    GEMM where the layer has none; one row the block GEMV and 2-16 rows the block rows kernel, or the W8A16
    GEMV without them (and for float32 rows, which the rows kernel's dot would round to TF32)."""
    from nanovllm.kernels import fp8_scaled_mm
    from nanovllm.layers import fp8_methods

    calls = []
    monkeypatch.setattr(fp8_scaled_mm, "block_scaled_mm_linear", lambda x, w, blocks, bias: calls.append(
        ("torch", tuple(blocks.shape))) or x.new_zeros(x.shape[0], w.shape[0]))
    monkeypatch.setattr(fp8_methods, "fp8_gemm", lambda *args: calls.append(("triton",)))
    method = Fp8BlockScaledMmLinearMethod(Fp8Scheme((128, 128), True))
    assert [method.bucket(r).plain.__name__ for r in (1, 16, 17)] == [
        "fp8_gemv_blocks", "fp8_rows_blocks_f16", "fp8_block_scaled_mm"]
    layer = ReplicatedLinear(384, 256, bias=False, quant_method=method)  # loaded: the per-row layout
    layer.weight_scale_inv.data.copy_((torch.rand(2, 3) + 0.5).repeat_interleave(128, dim=0))
    method.process_weights_after_loading(layer)
    scale = layer.weight_scale
    x = torch.zeros(17, 384, dtype=torch.bfloat16)
    fp8_methods.fp8_block_scaled_mm(x, layer.weight, scale, 128, None)
    scale.blocks = None
    fp8_methods.fp8_block_scaled_mm(x, layer.weight, scale, 128, None)
    assert calls == [("torch", (2, 4)), ("triton",)]  # K blocks padded to 4: padded_block_scales
    # 1 and 2-16 rows: the block kernels with the compact scales, the W8A16 GEMV without them.
    from nanovllm.kernels import fp8_skinny
    calls.clear()
    for name in ("fp8_block_gemv_linear", "fp8_rows_block_linear"):
        monkeypatch.setattr(fp8_skinny, name, lambda x, w, blocks, block, bias, pdl, *rest, name=name:
                            calls.append((name, x.shape[0], tuple(blocks.shape), block)))
    monkeypatch.setattr(fp8_methods, "fp8_gemv", lambda x, *args: calls.append(("gemv", x.shape[0])))
    scale.blocks = block_scales(scale.data, layer.weight, (128, 128))
    fp8_methods.fp8_gemv_blocks(x[:1], layer.weight, scale, 128, None)
    fp8_methods.fp8_rows_blocks(x[:5], layer.weight, scale, 128, None)
    fp8_methods.fp8_rows_blocks(x[:5].float(), layer.weight, scale, 128, None)
    scale.blocks = None
    fp8_methods.fp8_gemv_blocks(x[:1], layer.weight, scale, 128, None)
    fp8_methods.fp8_rows_blocks(x[:5], layer.weight, scale, 128, None)
    assert calls == [("fp8_block_gemv_linear", 1, (2, 4), (128, 128)),
                     ("fp8_rows_block_linear", 5, (2, 4), (128, 128)), ("gemv", 5), ("gemv", 1), ("gemv", 5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_refusals")
    make_model_dir(str(root / "fp32"))
    write_fp8_checkpoint(str(root / "fp32"), str(root / "block"), "block")
    return root


def with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**config["quantization_config"], **changes}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def with_tensor(src: str, dst: str, name: str, value: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> str:
    """A copy of the checkpoint folder src at dst with tensor `name` replaced by value (or cast to dtype)."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    tensors[name] = value if value is not None else tensors[name].to(dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("changes, match", [
    (dict(quant_method="awq"), r"quant_method='awq'.*implements 'fp8'"),
    (dict(activation_scheme="static"), r"static activation scales with block-scaled fp8 weights"),
    (dict(activation_scheme="smooth"), r"activation_scheme 'smooth' is not implemented"),
    (dict(kv_cache_scheme="fp8"), r"fields \['kv_cache_scheme'\]"),
    (dict(weight_block_size=[128]), r"weight_block_size must be two positive integers"),
    (dict(modules_to_not_convert=["model.layers.0.self_attn.q_proj"]), r"leaves .*q_proj.* unquantized"),
])
def test_unimplemented_quantization_configs_are_refused(tiny, tmp_path, changes, match):
    path = with_config(str(tiny / "block"), str(tmp_path / "changed"), **changes)
    with pytest.raises(ValueError, match=match):
        LLM(path, **ENGINE)


def test_unknown_quantization_option_and_a_conflicting_one_are_refused(tiny):
    options = r"\[None, 'fp8', 'compressed-tensors', 'modelopt'\]"
    with pytest.raises(ValueError, match=rf"quantization must be one of {options}, got 'int8'"):
        LLM(str(tiny / "fp32"), **ENGINE, quantization="int8")
    with pytest.raises(TypeError, match="option quantization must be str or None"):
        LLM(str(tiny / "fp32"), **ENGINE, quantization=8)


def test_int8_tensors_are_refused_naming_the_tensor(tiny, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    path = with_tensor(tiny / "fp32", str(tmp_path / "int8"), name, dtype=torch.int8)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is stored as torch.int8, a quantized format"):
        LLM(path, **ENGINE)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is stored as torch.int8"):
        LLM(path, **ENGINE, quantization="fp8")


def test_a_scale_of_the_wrong_block_count_is_refused(tiny, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    path = with_tensor(tiny / "block", str(tmp_path / "bad_scale"), name, torch.ones(3, 1))
    with pytest.raises(ValueError, match=rf"'{name}'.*does not fit a weight of 128 rows in blocks of 128"):
        LLM(path, **ENGINE)


def test_each_fp8_layer_holds_its_own_split_counters_and_its_rows_launches_pass_them(monkeypatch):
    """The few-row kernels' split-K arrival counters (kernels/split_k.py; linear_methods.SPLIT_COUNTERS):
    int32 zeros, one an output, made after loading for each layer (never shared), and what the few-row
    launches sum their splits with; none with the switch off."""
    from nanovllm.layers import linear_methods
    method = Fp8ScaledMmLinearMethod(Fp8Scheme(None, False))
    monkeypatch.setattr(linear_methods, "SPLIT_COUNTERS", False)
    off = ReplicatedLinear(32, 48, quant_method=method)
    method.process_weights_after_loading(off)
    assert not hasattr(off.weight, "split_counters")
    monkeypatch.setattr(linear_methods, "SPLIT_COUNTERS", True)
    layers = [ReplicatedLinear(32, 48, quant_method=method) for _ in range(2)]
    for layer in layers:
        layer.weight.data.normal_()
        method.process_weights_after_loading(layer)
        assert layer.weight.split_counters.dtype == torch.int32 and layer.weight.split_counters.shape == (48,)
        assert not layer.weight.split_counters.any()
    assert layers[0].weight.split_counters.data_ptr() != layers[1].weight.split_counters.data_ptr()
    from nanovllm.kernels import fp8_skinny
    seen = []
    monkeypatch.setattr(fp8_skinny, "fp8_rows_linear", lambda *args: seen.append(args[-1]))
    layer = layers[1]
    method.bucket(5).plain(torch.randn(5, 32, dtype=torch.bfloat16), *method.weights(layer), None, False)
    assert len(seen) == 1 and seen[0] is layer.weight.split_counters
