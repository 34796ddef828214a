"""Which checkpoint tensors are KV-cache scales and what each layer takes from them (utils/kv_scales.py):
every name layout vLLM reads, one scale for both where the checkpoint gives one, a scale per head read as
its largest, and bad scales refused naming the tensor. Nothing loads a model."""

import pytest
import torch

from nanovllm.utils.kv_scales import KvScales, kv_scale_target

LAYER = "model.layers.3.self_attn"


@pytest.mark.parametrize("suffix, which", [("k_scale", "k"), ("v_scale", "v"), ("k_proj.output_scale", "k"),
                                           ("v_proj.output_scale", "v"), ("k_proj.k_scale", "k"),
                                           ("v_proj.v_scale", "v"), ("kv_scale", "kv")])
def test_every_layout_names_its_layer_and_part(suffix, which):
    assert kv_scale_target(f"{LAYER}.{suffix}") == (LAYER, which)


@pytest.mark.parametrize("suffix", ["q_scale", "prob_scale", "q_proj.output_scale", "k_proj.weight_scale",
                                    "k_proj.input_scale", "k_proj.weight", "k_norm.weight", "k_proj.v_scale"])
def test_weights_and_fp8_attention_scales_are_not_kv_cache_scales(suffix):
    assert kv_scale_target(f"{LAYER}.{suffix}") is None


def test_each_layer_takes_its_own_and_a_lone_scale_serves_both():
    scales = KvScales()
    assert not scales
    assert scales.take(f"{LAYER}.k_scale", torch.tensor(0.5), "f") and scales.take(
        f"{LAYER}.v_scale", torch.tensor([2.0]), "f")
    assert scales.take("model.layers.4.self_attn.kv_scale", torch.tensor(3.0), "f")
    assert scales.take("model.layers.5.self_attn.v_proj.output_scale", torch.tensor([0.25]), "f")
    assert not scales.take(f"{LAYER}.k_proj.weight", torch.ones(2, 2), "f")
    assert scales.layer(LAYER) == (0.5, 2.0)
    assert scales.layer("model.layers.4.self_attn") == (3.0, 3.0)
    assert scales.layer("model.layers.5.self_attn") == (0.25, 0.25)
    assert scales.layer("model.layers.6.self_attn") is None


def test_a_scale_per_head_reads_as_its_largest():
    scales = KvScales()
    scales.take(f"{LAYER}.k_scale", torch.tensor([0.5, 1.5, 0.75], dtype=torch.bfloat16), "f")
    scales.take(f"{LAYER}.v_scale", torch.tensor([[0.125], [0.25]]), "f")
    assert scales.layer(LAYER) == (1.5, 0.25)


@pytest.mark.parametrize("tensor, match", [
    (torch.tensor(0.0), r"is 0.0; a scale must be positive and finite"),
    (torch.tensor(-1.0), r"is -1.0; a scale must be positive"),
    (torch.tensor(float("nan")), r"is nan"),
    (torch.tensor(float("inf")), r"is inf"),
    (torch.tensor([1], dtype=torch.int32), r"is a torch.int32 tensor of shape \(1,\), not floating-point"),
    (torch.empty(0), r"shape \(0,\)"),
])
def test_a_bad_scale_is_refused_naming_the_file_and_tensor(tensor, match):
    with pytest.raises(ValueError, match=match) as refused:
        KvScales().take(f"{LAYER}.k_scale", tensor, "model-00001.safetensors")
    assert str(refused.value).startswith(f"'model-00001.safetensors': KV-cache scale '{LAYER}.k_scale'")
