"""Weight loading: (Hugging Face name, tensor) pairs, from safetensors checkpoints (one file or many
shards, with or without the index file) or a GGUF file (utils/gguf_loader.py), mapped onto the
model's fused tensor-parallel parameters by one function, `load_weights`; or random "dummy"
weights for benchmarks where only a config exists (the same model whatever the tensor_parallel_size)."""

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
# An MoE expert weight: one expert's ("...mlp.experts.3.gate_proj.weight") or every expert's stacked
# ("...mlp.experts.gate_up_proj", as transformers names GGUF expert tensors).
EXPERT_NAME = re.compile(r"(?P<prefix>.*\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>\w+?)(?:\.weight)?")


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}; download the full model, or pass "
                         "load_format='dummy' to run on random weights")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy (Hugging Face name, tensor) pairs into the model, through `packed_modules_mapping` onto
    fused parameters and each parameter's `weight_loader`; raises if the model is left incomplete."""
    packed = getattr(model, "packed_modules_mapping", {})
    # MoE checkpoint projection name -> (stacked parameter, part): see layers/fused_moe.py
    experts = getattr(model, "expert_params_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    skip = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in skip:
            continue
        match = EXPERT_NAME.fullmatch(name) if experts else None
        if match and match["proj"] in experts:
            param_name, part = experts[match["proj"]]
            target = f"{match['prefix']}.{param_name}"
            param = params.get(target)
            if param is None:
                continue
            expert = None if match["expert"] is None else int(match["expert"])
            param.weight_loader(param, tensor, (expert, part))
            # Stacked parameters count as loaded piece by piece: a missing expert is reported.
            loaded.update(f"{target}:{piece}" for piece in _expert_pieces(param, expert, part))
            continue
        target, shard_id = name, None
        for ckpt_name, (fused_name, fused_shard) in packed.items():
            if f".{ckpt_name}." in name:
                target, shard_id = name.replace(ckpt_name, fused_name), fused_shard
                break
        param = params.get(target)
        if param is None:
            continue  # e.g. rotary inv_freq buffers saved by old checkpoints
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(target)
    missing = sorted(_required_pieces(model) - loaded - skip)
    if missing:
        raise ValueError(f"checkpoint {source!r} lacks {len(missing)} weights the model needs, "
                         f"e.g. {missing[:5]}; is it the model its config describes?")


def _expert_pieces(param: nn.Parameter, expert: int | None, part: str) -> list[str]:
    parts = part.split("_")  # "gate_up" fills both the gate and the up rows
    experts = range(param.shape[0]) if expert is None else (expert,)
    return [f"{e}.{p}" for e in experts for p in parts]


def _required_pieces(model: nn.Module) -> set[str]:
    """Every parameter name, a stacked expert parameter as one `name:expert.part` per piece."""
    required = set()
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        if hasattr(module, "checkpoint_parts"):
            required.update(f"{name}:{piece}" for piece in module.checkpoint_parts(param))
        else:
            required.add(name)
    return required


def load_model(model: nn.Module, path: str) -> None:
    """Load a safetensors checkpoint folder."""
    load_weights(model, safetensors_weights(path), path)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64, as manual_seed wants


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights (norm scales stay 1) for throughput runs where no checkpoint exists.

    Each full checkpoint tensor is drawn from its own seed (the run's seed and the tensor's name), on
    the parameter's device, and goes through the parameter's weight loader like a checkpoint tensor:
    every tensor_parallel_size then shards the very same model."""
    for name, param in model.named_parameters():  # tied weights appear once
        module = model.get_submodule(name.rpartition(".")[0])
        if hasattr(module, "checkpoint_shapes"):
            shapes = module.checkpoint_shapes(param)
        else:
            shapes = {None: tuple(param.shape)}
        loader = getattr(param, "weight_loader", default_weight_loader)
        for shard_id, shape in shapes.items():
            if name.endswith("norm.weight"):
                full = torch.ones(shape, dtype=param.dtype, device=param.device)
            else:
                gen = torch.Generator(device=param.device)
                gen.manual_seed(_tensor_seed(seed, f"{name}/{shard_id}"))
                full = torch.randn(shape, generator=gen, dtype=param.dtype, device=param.device).mul_(std)
            if shard_id is None:
                loader(param, full)
            else:
                loader(param, full, shard_id)
