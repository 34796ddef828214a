"""Calibrated KV-cache scales a checkpoint may carry (fp8 and compressed-tensors checkpoints with an fp8 KV
cache in mind): one float per attention layer for its keys and one for its values, such that
|k| / k_scale and |v| / v_scale stay within e4m3's range (448). `KvScales` collects them while the
weights load; the model runner hands them to the attention layers when the cache is fp8
(kv_cache_dtype="fp8"), whose kernels then store k / k_scale and read back cache x k_scale. Other caches
ignore them: a model-dtype cache is exact, an int8 cache scales every token itself.

Read under every name vLLM reads (the layer prefix `model.layers.N.self_attn` then):
  `.k_scale` / `.v_scale`                     llm-compressor's current layout, Quark's, ModelOpt's
  `.k_proj.output_scale` / `.v_proj....`      compressed-tensors' earlier layout, AutoFP8's
  `.k_proj.k_scale` / `.v_proj.v_scale`       ModelOpt's per-projection layout
  `.kv_scale`                                 a deprecated single scale for both
A layer given only one of the two uses it for both (as vLLM does); a layer given none keeps 1.0.
A scale per KV head (compressed-tensors' "attn_head" strategy) is read as its largest: the cache keeps
one scale a layer, and a larger scale than needed costs nothing in e4m3 but the smallest values'
precision (relative precision does not depend on the scale until values fall below 2**-6 x scale).

Scales for fp8 attention (`q_scale`, `prob_scale`, `q_proj.output_scale`) are not read: nanovllm keeps
queries and probabilities in the model dtype, closer to the unquantized model."""

import math
import re

import torch

# attn: the layer's attention block (the prefix); own ("k", "v" or "kv") or proj ("k" or "v"): what it scales.
KV_SCALE_NAME = re.compile(r"(?P<attn>.+\.self_attn)\."
                           r"(?:(?P<own>k|v|kv)_scale|(?P<proj>k|v)_proj\.(?:output_scale|(?P=proj)_scale))")


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(the checkpoint's attention block, "k" / "v" / "kv") for a KV-cache scale's name, else None."""
    match = KV_SCALE_NAME.fullmatch(name)
    if match is None:
        return None
    return match["attn"], match["own"] or match["proj"]


class KvScales:
    """The checkpoint's KV-cache scales by attention block (`model.layers.N.self_attn`)."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.found)

    def take(self, name: str, tensor: torch.Tensor, file: str) -> bool:
        """Record `tensor` if `name` is a KV-cache scale (True), else leave it to the weights (False)."""
        target = kv_scale_target(name)
        if target is None:
            return False
        if not tensor.is_floating_point() or tensor.numel() == 0:
            raise ValueError(f"{file!r}: KV-cache scale {name!r} is a {tensor.dtype} tensor of shape "
                             f"{tuple(tensor.shape)}, not floating-point scales")
        scale = tensor.float().max().item()  # a scale per head: the largest (see the module's docstring)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{file!r}: KV-cache scale {name!r} is {scale}; a scale must be positive and "
                             "finite (was the checkpoint's calibration run?)")
        attn, which = target
        for part in ("k", "v") if which == "kv" else (which,):
            self.found.setdefault(attn, {})[part] = scale
        return True

    def layer(self, attn: str) -> tuple[float, float] | None:
        """(k_scale, v_scale) of one attention block, or None where the checkpoint gives neither."""
        scales = self.found.get(attn)
        if not scales:
            return None
        k, v = scales.get("k"), scales.get("v")
        return (k if k is not None else v), (v if v is not None else k)
