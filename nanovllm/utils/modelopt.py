"""ModelOpt checkpoints (NVIDIA's TensorRT Model Optimizer, as in the nvidia/*-FP8 models; vLLM's quant_method
"modelopt"): the fp8 ones nanovllm reads, each as the Fp8Scheme of the "fp8" checkpoint it equals, and a
clear refusal of every other.

Two layouts of the same description: config.json's quantization_config {"quant_method": "modelopt",
"quant_algo": ..., "ignore": [...], "kv_cache_scheme": ..., "config_groups": ..., "producer": ...}, or,
in older exports, hf_quant_config.json beside it ({"producer": ..., "quantization": {"quant_algo": ...,
"kv_cache_quant_algo": ..., "exclude_modules": [...]}}), read when config.json has none (and taken in
that nested form as a quantization_config too).

Read:
  quant_algo "FP8"                         an e4m3 `weight` with a `weight_scale` per tensor and a
                                           calibrated `input_scale` per tensor: the "fp8" method's static
                                           scheme (layers/fp8_static.py; MoE experts too, one scale
                                           an expert: layers/fp8_experts.py)
  quant_algo "FP8_PER_CHANNEL_PER_TOKEN"   `weight_scale` per output channel, activations scaled per token
                                           as they arrive: the dynamic per-channel scheme (layers/fp8.py)
  kv_cache_quant_algo "FP8"                calibrated KV-cache scales (`k_proj.k_scale`, `v_proj.v_scale`),
                                           which the fp8 cache takes (utils/kv_scales.py)
The exclusion list holds fnmatch patterns (`lm_head`, `model.layers.*.mlp.gate`) and must leave out
exactly what nanovllm keeps in the model dtype (utils/unquantized.py). Refused, naming what to change:
other algorithms (NVFP4, INT4 AWQ, W4A8, mixed precision; FP8_PB_WO, whose weight-only blocks nanovllm has
no GEMM for past 16 rows), other KV-cache algorithms, and fields nanovllm does not know."""

import json
import os
from fnmatch import fnmatchcase

from transformers import PretrainedConfig

from nanovllm.utils.unquantized import check_excluded

METHOD = "modelopt"
LEGACY_FILE = "hf_quant_config.json"
# quant_algo -> (the weight block, None; whether activations take static scales)
ALGORITHMS = {"FP8": (None, True), "FP8_PER_CHANNEL_PER_TOKEN": (None, False)}
FIELDS = {"quant_method", "quant_algo", "kv_cache_quant_algo", "kv_cache_scheme", "ignore", "exclude_modules",
          "config_groups", "producer", "quant_library", "group_size"}
LEGACY_FIELDS = {"quant_algo", "kv_cache_quant_algo", "exclude_modules", "group_size"}


def _refuse(what: str) -> ValueError:
    return ValueError(f"this ModelOpt checkpoint {what}; nanovllm reads ModelOpt's fp8 ones (quant_algo "
                      "'FP8': per-tensor weight and static input scales, or 'FP8_PER_CHANNEL_PER_TOKEN'), "
                      "with or without FP8 KV-cache scales, and refuses others rather than load them wrong")


def read_legacy_config(folder: str) -> dict | None:
    """The quantization_config an hf_quant_config.json in `folder` stands for, or None without one."""
    path = os.path.join(folder, LEGACY_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            legacy = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path!r}: {e}") from e
    if not isinstance(legacy, dict) or not isinstance(legacy.get("quantization"), dict):
        raise ValueError(f"{path!r} has no 'quantization' mapping; is it a ModelOpt export?")
    return _flattened(legacy, LEGACY_FILE)


def _flattened(nested: dict, source: str) -> dict:
    """The config.json form of the older, nested description ({"producer": ..., "quantization": {...}},
    also found as a quantization_config)."""
    unknown = sorted(nested["quantization"].keys() - LEGACY_FIELDS)
    if unknown:
        raise _refuse(f"gives its {source} fields {unknown} that nanovllm does not know")
    quant = dict(nested["quantization"])
    quant["ignore"] = quant.pop("exclude_modules", None) or []
    return {"quant_method": METHOD, "producer": nested.get("producer"), **quant}


def _kv_cache(quant: dict) -> None:
    """A KV-cache description nanovllm reads: none, or FP8 (calibrated scales)."""
    algo, scheme = quant.get("kv_cache_quant_algo"), quant.get("kv_cache_scheme")
    if isinstance(scheme, dict):  # newer exports: compressed-tensors' form
        if scheme.get("type", "float") != "float" or scheme.get("num_bits", 8) != 8 or scheme.get("dynamic"):
            raise _refuse(f"quantizes its KV cache as {scheme!r}; nanovllm reads fp8 with calibrated scales")
    elif scheme is not None and str(scheme).upper() != "FP8":
        raise _refuse(f"quantizes its KV cache as {scheme!r}; nanovllm reads 'FP8'")
    if algo is not None and str(algo).upper() != "FP8":
        raise _refuse(f"quantizes its KV cache as {algo!r}; nanovllm reads 'FP8'")


def modelopt_scheme(quant: dict, hf_config: PretrainedConfig) -> tuple[tuple[int, int] | None, bool]:
    """(the weight block, None; whether activation scales are static) of a ModelOpt quantization_config
    nanovllm reads; ValueError, naming what to change, for any other."""
    if isinstance(quant.get("quantization"), dict):  # the nested form, as a quantization_config
        if quant.keys() - {"quant_method", "producer", "quantization"}:
            raise _refuse(f"mixes the nested and flat forms (fields {sorted(quant)})")
        quant = _flattened(quant, "quantization_config")
    unknown = sorted(quant.keys() - FIELDS)
    if unknown:
        raise _refuse(f"has quantization_config fields {unknown} that nanovllm does not know")
    algo = str(quant.get("quant_algo") or "").upper()
    if algo not in ALGORITHMS:
        raise _refuse(f"quantizes with quant_algo {quant.get('quant_algo')!r}")
    _kv_cache(quant)
    excluded = quant.get("ignore", quant.get("exclude_modules")) or []
    if not isinstance(excluded, list) or not all(isinstance(entry, str) for entry in excluded):
        raise _refuse(f"has exclusions {excluded!r}, not a list of module name patterns")
    check_excluded(hf_config, lambda name: any(fnmatchcase(name, p) for p in excluded),
                   f"exclusions {excluded}", _refuse)
    return ALGORITHMS[algo]
