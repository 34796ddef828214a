"""Checks that make a bad `LLM(...)` option or an impossible model config fail at construction,
before any weight is loaded, with a message that says what to change.

- `check_option_types(config)`: every option has the type its Config field declares. A string is
  never taken for a bool (`enforce_eager="no"` is truthy), a bool never for an int (True == 1), and
  a float option must be a finite number.
- `check_parallel_layout(config)`: tensor_parallel_size splits the model evenly, and the GPUs that
  tensor and data parallelism need are visible.
- `check_model_config(hf_config)`: the sizes the model is built from are positive integers that fit
  together (heads divide the hidden size when the config has no head_dim, query heads are a multiple
  of key/value heads), so that `num_attention_heads=0` is refused here instead of at the first step;
  and its quantization is one nanovllm implements (`quantization_scheme`: fp8, see layers/fp8.py, in the
  "fp8" method's layout, compressed-tensors' (utils/compressed_tensors.py) or ModelOpt's
  (utils/modelopt.py))."""

import math
import types
import typing
from dataclasses import dataclass, fields
from typing import Any

from transformers import PretrainedConfig

from nanovllm.utils.compressed_tensors import METHOD as CT_METHOD
from nanovllm.utils.compressed_tensors import compressed_tensors_scheme
from nanovllm.utils.device import cuda_available, cuda_device_count
from nanovllm.utils.modelopt import METHOD as MODELOPT_METHOD
from nanovllm.utils.modelopt import modelopt_scheme

# Model-config sizes that must be positive integers, and whether a config may leave them out.
REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")


def _type_name(tp: Any) -> str:
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """isinstance with the strictness options need: bool is not an int, an int is a float."""
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp) or tp  # list[int] checks the list, not its items
    if not isinstance(origin, type):  # a postponed (string) annotation, Literal, ...: checked elsewhere
        return True
    return isinstance(value, origin)


def check_option_types(config: Any) -> None:
    """Raise TypeError for an option whose value is not of its field's declared type, ValueError for
    a float option that is NaN or infinite."""
    for f in fields(config):
        if not f.init or f.name == "model":
            continue
        value = getattr(config, f.name)
        tp = f.type
        allowed = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
        if not any(_matches(value, t) for t in allowed):
            expected = " or ".join(_type_name(t) for t in allowed)
            hint = " (a string is not a bool: pass True or False)" if bool in allowed else ""
            raise TypeError(f"option {f.name} must be {expected}, got {type(value).__name__} {value!r}{hint}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"option {f.name} must be a finite number, got {value!r}")


def _size(hf_config: PretrainedConfig, name: str, required: bool) -> int | None:
    value = getattr(hf_config, name, None)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the model config's {name} must be a positive integer, got {value!r}; "
                         "fix config.json (or the GGUF metadata) of this checkpoint")
    return value


# What an fp8 quantization_config may say (the layout Qwen's and DeepSeek's FP8 checkpoints use, and
# vLLM's "fp8" method), and the option values `LLM(quantization=...)` takes (vLLM's name).
FP8_FIELDS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert",
              "ignored_layers"}
VALID_QUANTIZATIONS = (None, "fp8", CT_METHOD, MODELOPT_METHOD)
# Modules a quantization_config may leave unquantized that nanovllm never quantizes anyway: the embedding,
# the LM head and an MoE router (`mlp.gate`).
ALWAYS_UNQUANTIZED = ("lm_head", "embed_tokens", "mlp.gate")


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """fp8 (e4m3) weights with float32 scales; activations quantized on the fly (dynamic), or with the
    checkpoint's calibrated scales (static_input).

    block: weight_block_size (rows, columns): one weight scale per block, activations scaled per group
    of `columns` inputs of a token; None: one scale per output channel (or per tensor) and activations
    scaled per token. serialized: the checkpoint's weights are fp8; False: quantized at load
    (`quantization="fp8"` on a bf16/fp32 checkpoint). static_input: one activation scale per layer, the
    checkpoint's `input_scale` (layers/fp8_static.py; MoE experts one each, layers/fp8_experts.py; no
    blocks)."""

    block: tuple[int, int] | None
    serialized: bool
    static_input: bool = False
    # The checkpoint's name for block scales: "weight_scale_inv" (the "fp8" method's) or "weight_scale"
    # (compressed-tensors'); per-tensor and per-channel scales are "weight_scale" in both.
    block_scale_name: str = "weight_scale_inv"


def _quant_method(quant) -> str:
    if isinstance(quant, dict):
        return str(quant.get("quant_method", "unnamed"))
    return str(getattr(quant, "quant_method", type(quant).__name__))


def quantization_scheme(hf_config: PretrainedConfig, option: str | None = None) -> Fp8Scheme | None:
    """The checkpoint's quantization (config.json's quantization_config) or the `quantization` option's,
    or None for none. What nanovllm does not implement is refused here, never loaded wrong: its weights
    would be cast to the model dtype with their scales dropped, and every output be garbage."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        if option in (CT_METHOD, MODELOPT_METHOD):
            raise ValueError(f"quantization={option!r} reads a checkpoint's own {option} quantization, and "
                             "this checkpoint has none; use quantization='fp8' to quantize its weights at "
                             "load")
        return None if option is None else Fp8Scheme(block=None, serialized=False)
    method = _quant_method(quant)
    if method not in ("fp8", CT_METHOD, MODELOPT_METHOD) or not isinstance(quant, dict):
        raise ValueError(f"this checkpoint is quantized (quantization_config quant_method={method!r}), "
                         f"which nanovllm does not implement (it implements 'fp8' and fp8 {CT_METHOD!r} and "
                         f"{MODELOPT_METHOD!r}); it is refused rather than loaded wrong. Use the model's "
                         "unquantized (bf16/fp16) or FP8 checkpoint")
    if option not in (None, method):
        raise ValueError(f"quantization={option!r} but the checkpoint is quantized with {method!r}; "
                         "leave quantization unset (None) to use the checkpoint's")
    if method == MODELOPT_METHOD:
        block, static = modelopt_scheme(quant, hf_config)
        _check_static(static, block)
        return Fp8Scheme(block=block, serialized=True, static_input=static)
    if method == CT_METHOD:
        weights = compressed_tensors_scheme(quant, hf_config)
        if weights is None:  # KV-cache scales only
            return None
        block, static = weights
        _check_static(static, block)
        return Fp8Scheme(block=block, serialized=True, static_input=static, block_scale_name="weight_scale")
    unknown = sorted(quant.keys() - FP8_FIELDS)
    if unknown:
        raise ValueError(f"the checkpoint's fp8 quantization_config has fields {unknown} that nanovllm does "
                         f"not implement (it knows {sorted(FP8_FIELDS)}); it is refused rather than loaded "
                         "wrong")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not implemented; nanovllm implements "
                         "'dynamic' and 'static' (an input_scale per layer)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 fmt {quant['fmt']!r} is not implemented; nanovllm implements 'e4m3'")
    for name in (*(quant.get("modules_to_not_convert") or []), *(quant.get("ignored_layers") or [])):
        if not str(name).endswith(ALWAYS_UNQUANTIZED):
            raise ValueError(f"the fp8 quantization_config leaves {name!r} unquantized, which nanovllm does "
                             f"not implement (only modules ending in {list(ALWAYS_UNQUANTIZED)} may be)")
    block = quant.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"fp8 weight_block_size must be two positive integers, got {block!r}")
        block = (block[0], block[1])
    _check_static(scheme == "static", block)
    return Fp8Scheme(block=block, serialized=True, static_input=scheme == "static")


def _check_static(static: bool, block: tuple[int, int] | None) -> None:
    """Static activation scales are read for per-tensor and per-channel weights."""
    if static and block is not None:
        raise ValueError("static activation scales with block-scaled fp8 weights are not implemented; "
                         "nanovllm implements them with per-tensor or per-channel weight scales")


def check_quantization(hf_config: PretrainedConfig, option: str | None = None) -> None:
    """Raise ValueError for a quantization nanovllm does not implement (see quantization_scheme)."""
    if option not in VALID_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(VALID_QUANTIZATIONS)}, got {option!r}")
    quantization_scheme(hf_config, option)


def check_model_config(hf_config: PretrainedConfig, quantization: str | None = None) -> None:
    """Raise ValueError if the model this config describes cannot be built or run (with the
    `quantization` option, see check_quantization)."""
    check_quantization(hf_config, quantization)
    sizes = {name: _size(hf_config, name, True) for name in REQUIRED_SIZES}
    sizes.update({name: _size(hf_config, name, False) for name in OPTIONAL_SIZES})
    num_heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    if sizes["head_dim"] is None and hidden % num_heads:
        raise ValueError(f"the model config has no head_dim and hidden_size {hidden} is not divisible by "
                         f"num_attention_heads {num_heads}; fix config.json or give head_dim")
    num_kv_heads = sizes["num_key_value_heads"] or num_heads
    if num_kv_heads > num_heads or num_heads % num_kv_heads:
        raise ValueError(f"the model config's num_attention_heads ({num_heads}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads}); fix config.json")
    eps = getattr(hf_config, "rms_norm_eps", None)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))
                            or not math.isfinite(eps) or eps <= 0):
        raise ValueError(f"the model config's rms_norm_eps must be a positive finite number, got {eps!r}")


def check_parallel_layout(config) -> None:
    """Before anything is spawned: tensor_parallel_size fits the model's heads and MLP, and the GPUs
    that tensor and data parallelism ask for are visible. `config` is a nanovllm Config (device and
    hf_config resolved)."""
    _check_tensor_parallel(config)
    _check_data_parallel(config)


def _check_tensor_parallel(config) -> None:
    """Before anything is spawned: the sizes the model's layers must split evenly across ranks."""
    n, hf = config.tensor_parallel_size, config.hf_config
    if n == 1:
        return
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    intermediate = getattr(hf, "intermediate_size", None)
    moe_intermediate = getattr(hf, "moe_intermediate_size", None)  # each expert's (MoE families)

    def fits(size: int) -> bool:
        # Query heads and MLP columns split evenly; K/V heads split evenly, or are replicated
        # when there are fewer of them than ranks (each rank then keeps the one it needs).
        kv_ok = num_kv_heads % size == 0 or size % num_kv_heads == 0
        mlp_ok = all(i is None or i % size == 0 for i in (intermediate, moe_intermediate))
        return num_heads % size == 0 and kv_ok and mlp_ok

    if not fits(n):
        valid = [size for size in range(1, num_heads + 1) if fits(size)]
        raise ValueError(
            f"tensor_parallel_size={n} does not fit this model ({num_heads} attention heads, "
            f"{num_kv_heads} key/value heads, intermediate_size {intermediate}"
            + (f", moe_intermediate_size {moe_intermediate}" if moe_intermediate else "")
            + "): it must divide the "
            "attention heads and the intermediate size, and divide or be a multiple of the key/value "
            f"heads; valid sizes: {valid}")
    if config.device_type == "cuda":
        num_gpus = cuda_device_count()
        if n > num_gpus:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs but {num_gpus} are visible; "
                             "lower it, or expose more GPUs (CUDA_VISIBLE_DEVICES)")


def _check_data_parallel(config) -> None:
    """Before any replica is spawned: every replica gets tensor_parallel_size GPUs of its own."""
    if config.data_parallel_size == 1:
        return
    if config.device == "cuda" or (config.device == "auto" and cuda_available()):
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        num_gpus = cuda_device_count()
        if dp * tp > num_gpus:
            raise ValueError(f"data_parallel_size={dp} replicas of tensor_parallel_size={tp} need "
                             f"{dp * tp} GPUs but {num_gpus} are visible; lower one of them, or expose "
                             "more GPUs (CUDA_VISIBLE_DEVICES)")
