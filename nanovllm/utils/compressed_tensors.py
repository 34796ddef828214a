"""compressed-tensors checkpoints (llm-compressor's format; vLLM's quant_method "compressed-tensors"): the
quantization_configs nanovllm reads, each as the Fp8Scheme of the fp8 checkpoint it equals, and a clear
refusal of every other.

Read: one config group targeting every `Linear`, its weights fp8 (type "float", 8 bits, symmetric,
static) per tensor, per channel or per block (strategy "block", block_structure [rows, columns]), stored
compressed (e4m3 `weight`, float `weight_scale` [1] / [N, 1] / [N / rows, K / columns]); its input
activations fp8, dynamic, per token (tensor or channel weights) or per group of the block's columns
(block weights), or static per tensor (tensor or channel weights: a calibrated `input_scale` a layer).
That is layers/fp8.py's W8A8 with dynamic activation scales (layers/fp8_static.py's with static ones),
which vLLM runs for them too. `ignore` may name only modules nanovllm keeps in the model dtype anyway
(the LM head, the embedding, an MoE router), by name or by "re:" pattern.

A kv_cache_scheme (calibrated fp8 KV-cache scales a layer or a KV head, `self_attn.k_scale` and
`v_scale`) is read too, with or without fp8 weights: the fp8 cache (kv_cache_dtype="fp8") takes the
scales, other caches do not need them (utils/kv_scales.py).

Refused, naming what to change: integer or 4-bit weights, weights without activation quantization
(W8A16), static activation scales other than per tensor, output activations, a KV cache scaled
dynamically or per anything but a layer or a head, sparsity or transforms, several config groups or
other targets, and an `ignore` that leaves a projection nanovllm would run in fp8 unquantized."""

import re

from transformers import PretrainedConfig

from nanovllm.utils.unquantized import check_excluded

METHOD = "compressed-tensors"
FIELDS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
          "global_compression_ratio", "sparsity_config", "transform_config", "version"}
GROUP_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}
# QuantizationArgs' fields; observers and the scales' storage dtype describe calibration, not the math.
ARGS_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
               "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
# Formats whose fp8 weights are stored as e4m3 tensors (the loader checks each tensor's dtype).
FORMATS = ("float-quantized", "naive-quantized")


def _refuse(what: str) -> ValueError:
    return ValueError(f"this compressed-tensors checkpoint {what}; nanovllm reads fp8 W8A8 ones (fp8 weights "
                      "per tensor, channel or block, activations quantized dynamically per token or group, "
                      "or with a static scale per tensor), and refuses others rather than load them wrong")


def _args(args: dict, role: str) -> dict:
    if not isinstance(args, dict):
        raise _refuse(f"has {role} {args!r}, not a mapping of quantization arguments")
    unknown = sorted(args.keys() - ARGS_FIELDS)
    if unknown:
        raise _refuse(f"gives its {role} fields {unknown} that nanovllm does not know")
    kind, bits = args.get("type", "int"), args.get("num_bits", 8)
    if kind != "float" or bits != 8:
        raise _refuse(f"quantizes its {role} to {bits}-bit {kind}")
    if not args.get("symmetric", True):
        raise _refuse(f"quantizes its {role} asymmetrically")
    if args.get("actorder"):
        raise _refuse(f"reorders its {role} (actorder {args['actorder']!r})")
    return args


def _block(weights: dict) -> tuple[int, int]:
    structure = weights.get("block_structure")
    if isinstance(structure, str) and re.fullmatch(r"\d+x\d+", structure):
        structure = [int(s) for s in structure.split("x")]
    if (not isinstance(structure, (list, tuple)) or len(structure) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in structure)):
        raise _refuse(f"has block weights with block_structure {structure!r}, not two positive integers")
    return structure[0], structure[1]


def _scheme(group: dict) -> tuple[tuple[int, int] | None, bool]:
    """(the weight block (rows, columns) of one config group, or None for per-tensor or per-channel;
    whether its input activations take static scales)."""
    unknown = sorted(group.keys() - GROUP_FIELDS)
    if unknown:
        raise _refuse(f"has config group fields {unknown} that nanovllm does not know")
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"targets {group.get('targets')!r}; nanovllm reads one group targeting ['Linear']")
    if group.get("format") not in (None, *FORMATS):
        raise _refuse(f"stores a group in format {group['format']!r}")
    if group.get("output_activations") is not None:
        raise _refuse("quantizes output activations")
    weights = _args(group.get("weights"), "weights")
    if weights.get("dynamic", False):
        raise _refuse("quantizes its weights dynamically")
    strategy = weights.get("strategy") or "tensor"
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(f"scales its weights per {strategy!r}")
    block = _block(weights) if strategy == "block" else None
    if group.get("input_activations") is None:
        raise _refuse("quantizes the weights only (W8A16)")
    inputs = _args(group["input_activations"], "input activations")
    dynamic = inputs.get("dynamic", False)
    if dynamic not in (True, False):
        raise _refuse(f"quantizes its input activations with dynamic={dynamic!r}")
    if not dynamic:  # calibrated: one input_scale a layer (no strategy and no group_size: per tensor)
        if block or (inputs.get("strategy") or "tensor") != "tensor":
            raise _refuse(f"has static input activation scales per {inputs.get('strategy')!r} with "
                          f"{strategy} weights; nanovllm reads static ones per tensor, with tensor or "
                          "channel weights")
        return block, True
    wanted = ("group", block[1]) if block else ("token", None)
    if (inputs.get("strategy"), inputs.get("group_size") if block else None) != wanted:
        raise _refuse(f"scales its input activations per {inputs.get('strategy')!r} (group_size "
                      f"{inputs.get('group_size')!r}) where its {strategy} weights want per "
                      f"{'group of ' + str(block[1]) if block else 'token'}")
    return block, False


def _ignored(name: str, ignore: list[str]) -> bool:
    return any(re.match(entry[3:], name) if entry.startswith("re:") else name.endswith(entry)
               for entry in ignore)


def _check_ignore(ignore, hf_config: PretrainedConfig) -> None:
    if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
        raise _refuse(f"has ignore {ignore!r}, not a list of module names")
    check_excluded(hf_config, lambda name: _ignored(name, ignore), f"ignore {ignore}", _refuse)


def _kv_cache_scheme(args) -> None:
    """A kv_cache_scheme nanovllm reads: calibrated fp8 scales a layer or a KV head, which the fp8 cache
    takes from the checkpoint's tensors (utils/kv_scales.py)."""
    args = _args(args, "KV cache")
    if args.get("dynamic", False) is not False:
        raise _refuse(f"scales its KV cache dynamically (dynamic={args['dynamic']!r}); nanovllm reads "
                      "calibrated scales (kv_cache_dtype='int8' scales each token itself)")
    strategy = args.get("strategy") or "tensor"
    if strategy not in ("tensor", "attn_head"):
        raise _refuse(f"scales its KV cache per {strategy!r}; nanovllm reads a scale a layer or a KV head")


def compressed_tensors_scheme(quant: dict, hf_config: PretrainedConfig
                              ) -> tuple[tuple[int, int] | None, bool] | None:
    """(the weight block, None per tensor or per channel; whether activation scales are static) of a
    compressed-tensors quantization_config nanovllm reads, or None for one that quantizes only the KV
    cache (no config groups, a kv_cache_scheme); ValueError, naming what to change, for any other."""
    unknown = sorted(quant.keys() - FIELDS)
    if unknown:
        raise _refuse(f"has quantization_config fields {unknown} that nanovllm does not know")
    if quant.get("format", FORMATS[0]) not in FORMATS:
        raise _refuse(f"is stored in format {quant['format']!r}")
    if quant.get("quantization_status", "compressed") != "compressed":
        raise _refuse(f"has quantization_status {quant['quantization_status']!r}; nanovllm reads compressed "
                      "(fp8) weights")
    for name in ("sparsity_config", "transform_config"):
        if quant.get(name):
            raise _refuse(f"has a {name}")
    kv_scales = quant.get("kv_cache_scheme") is not None
    if kv_scales:
        _kv_cache_scheme(quant["kv_cache_scheme"])
    groups = quant.get("config_groups")
    if kv_scales and groups in (None, {}):
        return None  # KV-cache scales only: the weights are the model dtype's
    if not isinstance(groups, dict) or len(groups) != 1:
        count = len(groups) if isinstance(groups, dict) else "no"
        raise _refuse(f"has {count} config groups; nanovllm reads one")
    scheme = _scheme(next(iter(groups.values())))
    _check_ignore(quant.get("ignore") or [], hf_config)
    return scheme
