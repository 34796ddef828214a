"""The fp8 checkpoints scripts/fp8_quality.py writes from a bf16 one, in the layouts users download: Qwen's
FP8 (128x128 blocks, `weight_scale_inv`), AutoFP8's (per-channel weights, static `input_scale`s calibrated
on prompts) and llm-compressor's calibrated KV-cache scales (a `k_scale` / `v_scale` a layer); and the
calibration, transformers' model run over prompts with hooks that record the largest magnitudes. Imported
by fp8_quality.py (its folder is first on sys.path when it runs); nothing to run on its own."""

import functools
import glob
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from nanovllm.layers.fp8 import FP8_MAX, quantize_blocks, quantize_groups

# The decoder's linear weights: what an FP8 checkpoint stores in e4m3 (embeddings, norms, the LM head and
# MoE routers stay as they are).
LINEAR_WEIGHT = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")
# An expert's weight: (the layer's experts.)(index)(.projection.weight)
EXPERT_WEIGHT = re.compile(r"(.*\.experts\.)\d+(\.\w+\.weight)")
BLOCK = (128, 128)


def write_block_checkpoint(src: str, dst: str) -> str:
    """dst: src's checkpoint with its decoder linear weights in e4m3, a weight_scale_inv per 128x128
    block, and the quantization_config of Qwen's FP8 releases."""
    shutil.copytree(src, dst)
    added = {}
    for file in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if LINEAR_WEIGHT.fullmatch(n)]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name], BLOCK)
            added[name + "_scale_inv"] = os.path.basename(file)
        save_file(tensors, file, metadata={"format": "pt"})
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            content = json.load(f)
        content["weight_map"].update(added)
        with open(index, "w") as f:
            json.dump(content, f)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def run_hooked(model: torch.nn.Module, prompts: list[list[int]], device: str, hooks: list) -> None:
    """Run the prompts through the model with its recording hooks, then take the hooks off."""
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt], device=device))
    for hook in hooks:
        hook.remove()


def calibrate(model: torch.nn.Module, prompts: list[list[int]], device: str) -> dict[str, float]:
    """The largest input magnitude of each decoder projection over `prompts`, by checkpoint weight name
    (MoE experts, which transformers keeps stacked, each under its own: the rows routed to it)."""
    amax, hooks = {}, []

    def keep(key: str, x: torch.Tensor) -> None:
        amax[key] = max(amax.get(key, 0.0), x.abs().max().item())

    def record_experts(module, args, name):
        hidden, ids = args[0], args[1]
        for e in ids.unique().tolist():
            rows = hidden[(ids == e).any(dim=-1)]
            gate, up = torch.nn.functional.linear(rows, module.gate_up_proj[e]).chunk(2, dim=-1)
            for proj, x in (("gate", rows), ("up", rows), ("down", module.act_fn(gate) * up)):
                keep(f"{name}.{e}.{proj}_proj.weight", x)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and LINEAR_WEIGHT.fullmatch(name + ".weight"):
            hook = functools.partial(lambda key, m, args: keep(key, args[0]), name + ".weight")
        elif name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            hook = functools.partial(lambda key, m, args: record_experts(m, args, key), name)
        else:
            continue
        hooks.append(module.register_forward_pre_hook(hook))
    run_hooked(model, prompts, device, hooks)
    return amax


def calibrate_kv(model: torch.nn.Module, prompts: list[list[int]], device: str) -> dict[str, float]:
    """Each layer's largest cached key and value over `prompts`, by checkpoint scale name
    (`...self_attn.k_scale` / `v_scale`): a key's rotated pair never exceeds its norm, so the largest pair
    norm before the rotation bounds the cached keys."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    amax, hooks = {}, []

    def recorder(key: str, pairs: bool):
        def record(module, args, out):
            if pairs:  # [..., heads x head_dim] or [..., heads, head_dim] -> each rotated pair's norm
                out = out.unflatten(-1, (-1, head_dim)) if out.shape[-1] != head_dim else out
                out = torch.hypot(out[..., :head_dim // 2], out[..., head_dim // 2:])
            amax[key] = max(amax.get(key, 0.0), out.abs().max().item())
        return record

    for name, module in model.named_modules():
        if name.endswith(".self_attn"):
            keys = getattr(module, "k_norm", None) or module.k_proj
            hooks.append(keys.register_forward_hook(recorder(f"{name}.k_scale", True)))
            hooks.append(module.v_proj.register_forward_hook(recorder(f"{name}.v_scale", False)))
    run_hooked(model, prompts, device, hooks)
    return amax


def write_kv_scales_checkpoint(src: str, dst: str, amax: dict[str, float]) -> str:
    """dst: src's checkpoint with a k_scale / v_scale a layer from `amax` (calibrate_kv's) over 448, and
    llm-compressor's quantization_config for KV-cache scales alone (no weights quantized)."""
    shutil.copytree(src, dst)
    files = glob.glob(os.path.join(dst, "*.safetensors"))
    if len(files) != 1:
        raise SystemExit("the KV-scales checkpoint is written for a single-file model")
    tensors = load_file(files[0])
    tensors.update({name: torch.tensor(value / FP8_MAX) for name, value in amax.items()})
    save_file(tensors, files[0], metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "quantization_status": "compressed", "config_groups": {},
                                     "kv_cache_scheme": kv}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def write_static_checkpoint(src: str, dst: str, amax: dict[str, float]) -> str:
    """dst: src's checkpoint with its decoder linear weights in e4m3 with a weight_scale per output channel,
    an input_scale per projection from `amax` (calibrate's; an MoE expert no calibration row reached takes
    its layer's largest for that projection), and AutoFP8's quantization_config."""
    shutil.copytree(src, dst)
    fallback = {}
    for name, value in amax.items():
        if EXPERT_WEIGHT.fullmatch(name):
            key = EXPERT_WEIGHT.sub(r"\1\2", name)
            fallback[key] = max(fallback.get(key, 0.0), value)
    for file in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if LINEAR_WEIGHT.fullmatch(n)]:
            weight, scale = quantize_groups(tensors[name], tensors[name].shape[1])
            tensors[name], tensors[name + "_scale"] = weight, scale[:, 0].contiguous()
            largest = amax[name] if name in amax else fallback[EXPERT_WEIGHT.sub(r"\1\2", name)]
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(largest / FP8_MAX)
        save_file(tensors, file, metadata={"format": "pt"})
    if os.path.exists(os.path.join(dst, "model.safetensors.index.json")):
        raise SystemExit("the static checkpoint is written for a single-file model")
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst
