"""Which compressed-tensors quantization_configs nanovllm reads (utils/compressed_tensors.py):
llm-compressor's fp8 W8A8 ones with dynamic or static activations, as the Fp8Scheme of the "fp8"
checkpoint they equal, with or without calibrated KV-cache scales; every other is refused at the
config check, naming what to change. Config checks only: nothing loads."""

import copy

import pytest
from fp8_files import compressed_tensors_config
from transformers import Qwen3Config, Qwen3MoeConfig

from nanovllm.utils.config_checks import Fp8Scheme, check_quantization, quantization_scheme

DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def config(quant: dict | None, moe: bool = False, tied: bool = False):
    cls = Qwen3MoeConfig if moe else Qwen3Config
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    hf = cls(**DENSE, **extra, tie_word_embeddings=tied)
    if quant is not None:
        hf.quantization_config = quant
    return hf


@pytest.mark.parametrize("strategy, block", [("tensor", None), ("channel", None), ("block", (128, 128))])
def test_fp8_w8a8_configs_read_as_the_fp8_scheme_they_equal(strategy, block):
    scheme = quantization_scheme(config(compressed_tensors_config(strategy)))
    assert scheme == Fp8Scheme(block=block, serialized=True, block_scale_name="weight_scale")
    # the `quantization` option may name the checkpoint's own method, as in vLLM
    assert quantization_scheme(config(compressed_tensors_config(strategy)), "compressed-tensors") == scheme


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_static_per_tensor_activations_read_as_a_static_scheme(strategy):
    scheme = quantization_scheme(config(compressed_tensors_config(strategy, static=True)))
    assert scheme == Fp8Scheme(None, serialized=True, static_input=True, block_scale_name="weight_scale")


def test_a_block_structure_written_as_a_string_reads_too():
    quant = compressed_tensors_config("block", block=(64, 32))
    quant["config_groups"]["group_0"]["weights"]["block_structure"] = "64x32"
    assert quantization_scheme(config(quant)).block == (64, 32)


def test_an_moe_model_reads_with_its_routers_ignored():
    assert quantization_scheme(config(compressed_tensors_config("channel"), moe=True)).block is None
    with pytest.raises(ValueError, match=r"quantizes 'model.layers.0.mlp.gate' \(not in ignore"):
        quantization_scheme(config(compressed_tensors_config("channel", ignore=("lm_head",)), moe=True))


def test_only_the_sparse_layers_routers_need_ignoring():
    """llm-compressor lists the routers it leaves alone by name: a dense layer (mlp_only_layers) has none."""
    hf = config(compressed_tensors_config("channel", ignore=("lm_head", "model.layers.1.mlp.gate")), moe=True)
    hf.mlp_only_layers = [0]
    assert quantization_scheme(hf).block is None
    hf.mlp_only_layers = []
    with pytest.raises(ValueError, match=r"quantizes 'model.layers.0.mlp.gate'"):
        quantization_scheme(hf)


def group_with(**changes) -> dict:
    """A per-channel config with its group's weights / input_activations (or the group) changed."""
    quant = compressed_tensors_config("channel")
    group = quant["config_groups"]["group_0"]
    for key, value in changes.items():
        role, _, field = key.partition("__")
        if field:
            group[role][field] = value
        else:
            group[role] = value
    return quant


def top_with(**changes) -> dict:
    return {**compressed_tensors_config("channel"), **changes}


def block_with(**inputs) -> dict:
    quant = compressed_tensors_config("block")
    quant["config_groups"]["group_0"]["input_activations"].update(inputs)
    return quant


def kv_with(**changes) -> dict:
    quant = compressed_tensors_config("channel", kv_cache=True)
    quant["kv_cache_scheme"].update(changes)
    return quant


REFUSED = [
    (group_with(weights__type="int"), r"quantizes its weights to 8-bit int"),
    (group_with(weights__num_bits=4), r"quantizes its weights to 4-bit float"),
    (group_with(input_activations=None), r"quantizes the weights only \(W8A16\)"),
    (group_with(input_activations__dynamic=False), r"static input activation scales per 'token'"),
    (group_with(weights__symmetric=False), r"quantizes its weights asymmetrically"),
    (group_with(weights__strategy="group", weights__group_size=128), r"scales its weights per 'group'"),
    (group_with(weights__unknown=1), r"weights fields \['unknown'\]"),
    (group_with(output_activations={"num_bits": 8, "type": "float"}), r"quantizes output activations"),
    (group_with(targets=["re:.*self_attn.*"]), r"targets \['re:\.\*self_attn\.\*'\]"),
    (block_with(strategy="token", group_size=None), r"per 'token' .* want per group of 128"),
    (kv_with(dynamic=True), r"scales its KV cache dynamically"),
    (kv_with(strategy="channel"), r"scales its KV cache per 'channel'"),
    (kv_with(type="int"), r"quantizes its KV cache to 8-bit int"),
    (kv_with(symmetric=False), r"quantizes its KV cache asymmetrically"),
    (top_with(sparsity_config={"format": "sparse-24-bitmask"}), r"has a sparsity_config"),
    (top_with(format="pack-quantized"), r"stored in format 'pack-quantized'"),
    (top_with(quantization_status="frozen"), r"quantization_status 'frozen'"),
    (top_with(surprise=True), r"fields \['surprise'\]"),
    (top_with(ignore=["lm_head", "re:.*self_attn.*"]), r"leaves 'model.layers.0.self_attn.q_proj'"),
    (top_with(ignore=["lm_head", "model.layers.1.mlp.down_proj"]), r"leaves 'model.layers.1.mlp.down_proj'"),
    (top_with(ignore=[]), r"quantizes 'lm_head' \(not in ignore \[\]\), which nanovllm keeps"),
]


@pytest.mark.parametrize("quant, match", REFUSED, ids=[m for _, m in REFUSED])
def test_other_configs_are_refused_naming_what_they_do(quant, match):
    with pytest.raises(ValueError, match=match) as refused:
        quantization_scheme(config(copy.deepcopy(quant)))
    assert "refuses others rather than load them wrong" in str(refused.value)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_calibrated_kv_cache_scales_read_with_the_weights_scheme(strategy):
    """A kv_cache_scheme changes nothing of the weights' scheme: its scales go to an fp8 cache
    (utils/kv_scales.py, tests/models/test_kv_scales.py)."""
    quant = compressed_tensors_config("block", kv_cache=True)
    quant["kv_cache_scheme"]["strategy"] = strategy
    weights_only = compressed_tensors_config("block")
    assert quantization_scheme(config(quant)) == quantization_scheme(config(weights_only))


def test_kv_cache_scales_alone_leave_the_weights_unquantized():
    """llm-compressor's KV-cache-only recipe: no config groups, a kv_cache_scheme."""
    quant = compressed_tensors_config(None, kv_cache=True)
    assert quantization_scheme(config(quant)) is None
    assert quantization_scheme(config(quant), "compressed-tensors") is None
    with pytest.raises(ValueError, match="has 0 config groups; nanovllm reads one"):
        quantization_scheme(config(compressed_tensors_config(None)))


def test_two_config_groups_are_refused():
    quant = compressed_tensors_config("channel")
    quant["config_groups"]["group_1"] = copy.deepcopy(quant["config_groups"]["group_0"])
    with pytest.raises(ValueError, match="has 2 config groups; nanovllm reads one"):
        quantization_scheme(config(quant))


def test_a_tied_lm_head_need_not_be_ignored():
    assert quantization_scheme(config(compressed_tensors_config("channel", ignore=()), tied=True)) is not None


def test_the_option_must_fit_the_checkpoint():
    with pytest.raises(ValueError, match=r"quantization='fp8' but the checkpoint is quantized with "
                                         r"'compressed-tensors'"):
        check_quantization(config(compressed_tensors_config("channel")), "fp8")
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors' reads a checkpoint's own .* has "
                                         r"none; use quantization='fp8'"):
        check_quantization(config(None), "compressed-tensors")
