"""Weight loading: (Hugging Face name, tensor) pairs, from safetensors checkpoints (one file or many
shards, with or without the index file) or a GGUF file (utils/gguf_loader.py), mapped onto the
model's fused tensor-parallel parameters by one function, `load_weights` (which sets a checkpoint's
KV-cache scales apart, utils/kv_scales.py); or random "dummy"
weights for benchmarks where only a config exists (the same model whatever the tensor_parallel_size)."""

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.utils.kv_scales import KvScales
from nanovllm.utils.weight_tracker import WeightTracker, checkpoint_shapes, default_weight_loader

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def _read_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A file's tensors; a truncated or corrupt file raises ValueError naming it (safetensors' own
    errors name neither the file nor, for a short read, the tensor)."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name!r} of {file!r} (truncated or corrupt?): "
                                     f"{e}") from e
                yield name, tensor
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot read safetensors file {file!r} (truncated or corrupt?): {e}") from e


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for every tensor of every shard."""
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}; download the full model, or pass "
                         "load_format='dummy' to run on random weights")
    for file in files:
        for name, tensor in _read_safetensors(file):
            yield name, tensor, file


# (Hugging Face name, tensor) or (Hugging Face name, tensor, the file it came from).
WeightItem = tuple[str, torch.Tensor] | tuple[str, torch.Tensor, str]


def load_weights(model: nn.Module, weights: Iterable[WeightItem], source: str) -> KvScales:
    """Copy (Hugging Face name, tensor[, file]) items into the model, through `packed_modules_mapping`
    onto fused parameters and each parameter's `weight_loader`. Every tensor's full shape is checked
    before it is copied, and every part of every parameter (each of q/k/v, gate/up) must arrive:
    otherwise ValueError naming the file and the tensor. Returns the checkpoint's KV-cache scales (none
    for most), which are not the model's parameters: the runner gives them to an fp8 cache."""
    tracker, kv_scales = WeightTracker(model), KvScales()
    for name, tensor, *file in weights:
        file = file[0] if file else source
        if not kv_scales.take(name, tensor, file):
            tracker.load(name, tensor, file)
    tracker.check_complete(source)
    return kv_scales


def load_model(model: nn.Module, path: str) -> KvScales:
    """Load a safetensors checkpoint folder; its KV-cache scales, as load_weights."""
    return load_weights(model, safetensors_weights(path), path)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64, as manual_seed wants


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights (norm scales and fp8 weight scales stay 1) for throughput runs where no checkpoint
    exists; fp8 weights are drawn in float32 and rounded.

    Each full checkpoint tensor is drawn from its own seed (the run's seed and the tensor's name), on
    the parameter's device, and goes through the parameter's weight loader like a checkpoint tensor:
    every tensor_parallel_size then shards the very same model."""
    for name, param in model.named_parameters():  # tied weights appear once
        shapes = checkpoint_shapes(model, name, param)
        loader = getattr(param, "weight_loader", default_weight_loader)
        for shard_id, shape in shapes.items():
            # randn draws no 1-byte dtype: fp8 weights are drawn in float32, their loader rounds them
            dtype = torch.float32 if param.element_size() == 1 else param.dtype
            if name.endswith(("norm.weight", "weight_scale", "weight_scale_inv", "input_scale")):
                full = torch.ones(shape, dtype=dtype, device=param.device)
            else:
                gen = torch.Generator(device=param.device)
                gen.manual_seed(_tensor_seed(seed, f"{name}/{shard_id}"))
                full = torch.randn(shape, generator=gen, dtype=dtype, device=param.device).mul_(std)
            if shard_id is None:
                loader(param, full)
            else:
                loader(param, full, shard_id)
