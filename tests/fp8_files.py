"""Tiny fp8 checkpoints written from a tiny float32 one (tests/conftest.py make_model_dir), in the layouts
Hugging Face FP8 models use: block-wise (`weight_scale_inv` per block, Qwen3-*-FP8's) and per-channel or
per-tensor (`weight_scale`, vLLM's "fp8"), each also as llm-compressor writes it (quant_method
"compressed-tensors": `weight_scale` [N, 1], [1] or per block); and the float32 checkpoint of the very
weights they dequantize to, so that a test can tell the weights' rounding from the activations'."""

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from nanovllm.layers.fp8 import quantize_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# The decoder's linear weights (dense and experts'); embeddings, norms, the LM head and routers stay float32.
QUANTIZED = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    expanded = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * expanded


# llm-compressor's kv_cache_scheme: calibrated fp8 KV-cache scales (`self_attn.k_scale`, `v_scale`).
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                   "strategy": "tensor", "block_structure": None, "dynamic": False, "actorder": None,
                   "observer": "minmax", "observer_kwargs": {}}


def compressed_tensors_config(strategy: str | None, block: tuple[int, int] = (128, 128),
                              ignore: tuple[str, ...] = ("lm_head", "re:.*mlp.gate$"), static: bool = False,
                              kv_cache: bool = False) -> dict:
    """The quantization_config llm-compressor writes for fp8 weights per `strategy` ("tensor", "channel"
    or "block"; None: no weights, config_groups empty) with dynamic activations per token (per group of
    the block's columns for blocks), or with `static` calibrated activation scales per tensor; kv_cache:
    with calibrated KV-cache scales per tensor."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
               "block_structure": list(block) if strategy == "block" else None, "dynamic": False,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "actorder": None,
              "strategy": "group" if strategy == "block" else "token",
              "group_size": block[1] if strategy == "block" else None, "observer": None,
              "observer_kwargs": {}, "block_structure": None}
    if static:
        inputs.update(dynamic=False, strategy="tensor", observer="minmax")
    groups = {} if strategy is None else {"group_0": {"targets": ["Linear"], "weights": weights,
                                                      "input_activations": inputs, "output_activations": None,
                                                      "format": "float-quantized"}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "ignore": list(ignore),
            "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv_cache else None, "sparsity_config": {},
            "transform_config": {}, "version": "0.12.2", "config_groups": groups}


# Calibrated activation scales of a static checkpoint, by projection (q/k/v and gate/up differ, so that
# the engine's rule for a fused projection, the largest of its parts, shows).
STATIC_INPUT_SCALES = {"q_proj": 0.010, "k_proj": 0.012, "v_proj": 0.014, "o_proj": 0.008, "gate_proj": 0.011,
                       "up_proj": 0.013, "down_proj": 0.020}
EXPERT = re.compile(r".*\.experts\.(\d+)\..*")


def static_input_scale(name: str) -> float:
    """A static checkpoint's input scale for the weight `name`: its projection's, and for MoE expert e
    that times 1 + e / 10 (each expert calibrated apart)."""
    expert = EXPERT.fullmatch(name)
    return STATIC_INPUT_SCALES[name.split(".")[-2]] * (1 + int(expert[1]) / 10 if expert else 1)


def modelopt_config(static: bool, kv_cache: bool = False, exclude: tuple[str, ...] = ("lm_head",)) -> dict:
    """ModelOpt's quantization_config (config.json's form) for per-tensor weights with static input scales
    (quant_algo "FP8") or per-channel weights with dynamic per-token ones."""
    quant = {"quant_method": "modelopt", "quant_algo": "FP8" if static else "FP8_PER_CHANNEL_PER_TOKEN",
             "ignore": list(exclude), "producer": {"name": "modelopt", "version": "0.33.1"},
             "config_groups": {"group_0": {"input_activations": {"dynamic": not static, "num_bits": 8,
                                                                 "type": "float"},
                                           "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}}}
    if kv_cache:
        quant["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return quant


def write_fp8_checkpoint(src: str, dst: str, layout: str, block: tuple[int, int] = (128, 128),
                         dequantized: str | None = None, static: bool = False, legacy: bool = False) -> None:
    """Copy the float32 checkpoint folder `src` to `dst` with its linear weights in fp8. layout: "block"
    (weight_scale_inv per block of `block`), "channel" (weight_scale [N]) or "tensor" (weight_scale []),
    or with a "ct-" prefix the same weights and scales in compressed-tensors' layout, or with "mo-"
    ModelOpt's ("mo-tensor" with static scales: quant_algo FP8; "mo-channel": FP8_PER_CHANNEL_PER_TOKEN;
    legacy: described by an hf_quant_config.json instead of config.json). static: calibrated activation
    scales too (`input_scale`, STATIC_INPUT_SCALES; [] or compressed-tensors' [1]). dequantized: also
    write, there, the float32 checkpoint of the weights the fp8 ones stand for."""
    compressed, modelopt = layout.startswith("ct-"), layout.startswith("mo-")
    layout = layout.removeprefix("ct-").removeprefix("mo-")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, exact = {}, {}
    for name, w in tensors.items():
        if not QUANTIZED.fullmatch(name):
            out[name] = exact[name] = w
            continue
        if layout == "block":
            q, scale = quantize_blocks(w, block)
            out[name], out[name + ("_scale" if compressed else "_scale_inv")] = q, scale
            exact[name] = dequantize_block(q, scale, block)
            continue
        amax = w.abs().amax(dim=1) if layout == "channel" else w.abs().amax()
        scale = amax.clamp(min=1e-10) / FP8_MAX
        q = (w / (scale[:, None] if layout == "channel" else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        exact[name] = q.float() * (scale[:, None] if layout == "channel" else scale)
        if compressed:  # [N, 1] per channel, [1] per tensor
            scale = scale[:, None] if layout == "channel" else scale.reshape(1)
        out[name], out[name + "_scale"] = q, scale
        if static:
            value = torch.tensor(static_input_scale(name))
            out[name.removesuffix("weight") + "input_scale"] = value.reshape(1) if compressed else value
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
             "modules_to_not_convert": ["lm_head"]}
    if layout == "block":
        quant["weight_block_size"] = list(block)
    if static:
        quant["activation_scheme"] = "static"
    if compressed:
        quant = compressed_tensors_config(layout, block, static=static)
    if modelopt:
        quant = modelopt_config(static)
    for folder, weights, extra in ((dst, out, {} if legacy else {"quantization_config": quant}),
                                   (dequantized, exact, {})):
        if folder is None:
            continue
        shutil.copytree(src, folder)
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
    if legacy:  # ModelOpt's older export: the description beside config.json
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": quant["producer"],
                       "quantization": {"quant_algo": quant["quant_algo"], "exclude_modules": quant["ignore"],
                                        "kv_cache_quant_algo": None}}, f)
