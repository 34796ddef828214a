"""Which ModelOpt quantization_configs nanovllm reads (utils/modelopt.py): quant_algo "FP8" (per-tensor
weights, static inputs) and "FP8_PER_CHANNEL_PER_TOKEN", with or without FP8 KV-cache scales, from
config.json or an older export's hf_quant_config.json; every other is refused at the config check, naming
what to change. Config checks only: nothing loads (tests/models/test_fp8_checkpoints.py loads them)."""

import json

import pytest
from fp8_files import modelopt_config
from transformers import Qwen3Config, Qwen3MoeConfig

from nanovllm.utils.config_checks import Fp8Scheme, check_quantization, quantization_scheme
from nanovllm.utils.modelopt import read_legacy_config

DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def config(quant: dict | None, moe: bool = False):
    cls = Qwen3MoeConfig if moe else Qwen3Config
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    hf = cls(**DENSE, **extra)
    if quant is not None:
        hf.quantization_config = quant
    return hf


def test_fp8_reads_as_per_tensor_weights_with_static_inputs():
    scheme = quantization_scheme(config(modelopt_config(static=True)))
    assert scheme == Fp8Scheme(block=None, serialized=True, static_input=True)
    assert quantization_scheme(config(modelopt_config(static=True)), "modelopt") == scheme


def test_per_channel_per_token_reads_as_the_dynamic_per_channel_scheme():
    scheme = quantization_scheme(config(modelopt_config(static=False)))
    assert scheme == Fp8Scheme(block=None, serialized=True, static_input=False)
    # as vLLM, the algorithm's case does not matter; an MoE model's experts take it (its routers excluded)
    lower = {**modelopt_config(static=False, exclude=("lm_head", "model.layers.*.mlp.gate")),
             "quant_algo": "fp8_per_channel_per_token"}
    assert quantization_scheme(config(lower, moe=True)) == scheme


@pytest.mark.parametrize("kv", [{"kv_cache_scheme": "FP8"}, {"kv_cache_quant_algo": "FP8"},
                                {"kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}])
def test_fp8_kv_cache_scales_are_read(kv):
    """Calibrated KV-cache scales leave the weights' scheme as it is (the fp8 cache takes them:
    tests/attention/test_kv_cache_scales.py)."""
    assert quantization_scheme(config({**modelopt_config(static=True), **kv})).static_input


def with_(**changes) -> dict:
    return {**modelopt_config(static=True), **changes}


REFUSED = [
    (with_(quant_algo="NVFP4"), r"quantizes with quant_algo 'NVFP4'"),
    (with_(quant_algo="FP8_PB_WO"), r"quant_algo 'FP8_PB_WO'"),
    (with_(quant_algo="W4A8_AWQ"), r"quant_algo 'W4A8_AWQ'"),
    (with_(quant_algo=None), r"quant_algo None"),
    (with_(kv_cache_quant_algo="NVFP4"), r"quantizes its KV cache as 'NVFP4'"),
    (with_(kv_cache_scheme={"dynamic": True, "num_bits": 8, "type": "float"}), r"quantizes its KV cache as"),
    (with_(ignore=["lm_head", "model.layers.*.self_attn.*"]), r"leaves 'model.layers.0.self_attn.q_proj'"),
    (with_(ignore=[]), r"quantizes 'lm_head' \(not in exclusions \[\]\), which nanovllm keeps"),
    (with_(ignore="lm_head"), r"exclusions 'lm_head', not a list"),
    (with_(surprise=1), r"fields \['surprise'\]"),
]


@pytest.mark.parametrize("quant, match", REFUSED, ids=[m for _, m in REFUSED])
def test_other_configs_are_refused_naming_what_they_do(quant, match):
    with pytest.raises(ValueError, match=match) as refused:
        quantization_scheme(config(quant))
    assert "refuses others rather than load them wrong" in str(refused.value)


def test_an_moe_model_reads_with_its_routers_excluded():
    """NVIDIA's FP8 MoE checkpoints: static inputs for every expert (layers/fp8_experts.py), routers left
    out by pattern."""
    moe = config(with_(ignore=["lm_head", "model.layers.*.mlp.gate"]), moe=True)
    assert quantization_scheme(moe) == Fp8Scheme(block=None, serialized=True, static_input=True)
    with pytest.raises(ValueError, match=r"quantizes 'model.layers.0.mlp.gate' \(not in exclusions"):
        quantization_scheme(config(with_(ignore=["lm_head"]), moe=True))


def test_the_option_must_fit_the_checkpoint():
    with pytest.raises(ValueError, match=r"quantization='fp8' but the checkpoint is quantized with "
                                         r"'modelopt'"):
        check_quantization(config(modelopt_config(static=True)), "fp8")
    with pytest.raises(ValueError, match=r"quantization='modelopt' reads a checkpoint's own modelopt "
                                         r"quantization, and this checkpoint has none"):
        check_quantization(config(None), "modelopt")


def test_an_older_exports_hf_quant_config_reads_as_the_config_json_form(tmp_path):
    assert read_legacy_config(str(tmp_path)) is None
    legacy = {"producer": {"name": "modelopt", "version": "0.19.0"},
              "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                               "exclude_modules": ["lm_head"]}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(legacy))
    quant = read_legacy_config(str(tmp_path))
    assert quant == {"quant_method": "modelopt", "producer": legacy["producer"], "quant_algo": "FP8",
                     "kv_cache_quant_algo": "FP8", "ignore": ["lm_head"]}
    assert quantization_scheme(config(quant)).static_input
    nested = {"quant_method": "modelopt", **legacy}  # the nested form as config.json's quantization_config
    assert quantization_scheme(config(nested)) == quantization_scheme(config(quant))
    with pytest.raises(ValueError, match="mixes the nested and flat forms"):
        quantization_scheme(config({**nested, "quant_algo": "FP8"}))
    legacy["quantization"]["smoothquant_alpha"] = 0.5
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(legacy))
    with pytest.raises(ValueError, match=r"hf_quant_config.json fields \['smoothquant_alpha'\]"):
        read_legacy_config(str(tmp_path))
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read '.*hf_quant_config.json'"):
        read_legacy_config(str(tmp_path))
