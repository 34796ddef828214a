"""The kernel plan: which linear method (layers/linear_methods.py) a model's layers take, decided once
when the engine builds the model, from its device, the GPU's compute capability, the model's dtype, the
skinny_gemm option and its quantization (an fp8 checkpoint's quantization_config, or the quantization
option: layers/fp8.py); the model constructors hand each layer its method. And `kernel_table`, the
kernels a built model and its attention backend run at a few row counts, in one table."""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fp8_methods import fp8_linear_method
from nanovllm.layers.fp8_static import static_linear_method
from nanovllm.layers.linear_methods import (
    Bucket,
    LinearMethod,
    SkinnyLinearMethod,
    SkinnyLMHeadMethod,
    UnquantizedLinearMethod,
)
from nanovllm.utils.config_checks import Fp8Scheme, quantization_scheme

# Where and for which dtypes the decode-sized Triton kernels run (tests add the CPU and float32, where
# Triton's interpreter runs them).
SKINNY_DEVICE_TYPES = ("cuda",)
SKINNY_DTYPES = (torch.bfloat16, torch.float16)
# Programmatic dependent launches need Hopper (sm_90) or later.
PDL_MIN_CAPABILITY = (9, 0)


@dataclass(frozen=True, slots=True)
class KernelPlan:
    linear: LinearMethod  # the decoder layers' projections
    lm_head: LinearMethod
    router: LinearMethod | None = None  # an MoE router's, never quantized (None: linear's)
    quantization: Fp8Scheme | None = None  # the MoE experts' (layers/fused_moe.py)

    def __post_init__(self) -> None:
        if self.router is None:
            object.__setattr__(self, "router", self.linear)

    @classmethod
    def torch_only(cls) -> "KernelPlan":
        """Every matmul through torch: the CPU's plan, and what a model built without one takes."""
        return cls(UnquantizedLinearMethod(), UnquantizedLinearMethod())

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype, skinny_gemm: bool,
                   capability: tuple[int, int] | None = None, quantization: str | None = None,
                   hf_config: PretrainedConfig | None = None) -> "KernelPlan":
        """The plan for a model of `dtype` on `device`. capability: the GPU's (major, minor), read from
        the device when None (a test passes a fake one to see a GPU's plan on the CPU). quantization (the
        option) and hf_config (the model's, for its quantization_config): fp8 decoder projections and
        experts; the LM head and the routers keep the unquantized plan's methods."""
        plan = cls._unquantized(device, dtype, skinny_gemm, capability)
        scheme = quantization_scheme(hf_config, quantization) if hf_config is not None else None
        if scheme is None and quantization is not None:
            scheme = Fp8Scheme(block=None, serialized=False)
        if scheme is None:
            return plan
        choose = static_linear_method if scheme.static_input else fp8_linear_method
        return cls(choose(scheme, device, plan.linear.pdl, capability), plan.lm_head, plan.linear, scheme)

    @classmethod
    def _unquantized(cls, device: torch.device, dtype: torch.dtype, skinny_gemm: bool,
                     capability: tuple[int, int] | None) -> "KernelPlan":
        if not skinny_gemm or device.type not in SKINNY_DEVICE_TYPES or dtype not in SKINNY_DTYPES:
            return cls.torch_only()
        if capability is None:
            from nanovllm.kernels.common import supports_pdl  # imports Triton, which the kernels need anyway
            pdl = supports_pdl(device)
        else:
            pdl = capability >= PDL_MIN_CAPABILITY
        return cls(SkinnyLinearMethod(pdl), SkinnyLMHeadMethod(pdl))


def process_weights_after_loading(model: nn.Module) -> None:
    """Each linear method's pass over its layers' loaded weights (after the checkpoint is in), and the
    MoE experts' own."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod):
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


# What the decoder hands each projection to fold in (models/decoder.py): the RMSNorm before q/k/v and
# gate/up, the SiLU-mul before down_proj.
FOLDS = {"qkv_proj": "normed", "gate_up_proj": "normed", "down_proj": "silu"}
UNFOLDED = {"normed": "rms_norm", "silu": "silu_and_mul"}


def _kernels(bucket: Bucket, fold: str | None, gated: Bucket | None = None) -> str:
    """The kernels of a projection's bucket with the fold it is handed. gated: for gate/up, its own bucket;
    for down_proj, gate/up's at the same rows (when that bucket folds the SiLU-mul, down runs plain)."""
    if gated is not None and gated.normed_gated is not None:
        return bucket.normed_gated.__name__ if fold == "normed" else bucket.plain.__name__
    folded = getattr(bucket, fold) if fold else None
    if folded is not None:
        return folded.__name__
    before = f"{UNFOLDED[fold]}, " if fold else ""
    return before + bucket.plain.__name__


def kernel_table(model: nn.Module, attention_backend, rows: tuple[int, ...] = (1, 2, 16, 256)) -> str:
    """The kernels a decode step of each row count runs, one line per linear layer of the first
    decoder layer (by its name there), the LM head and the attention backend (an AttentionBackend)."""
    first: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), LinearMethod):
            parts = name.split(".")
            if "layers" in parts:  # model.layers.<i>.self_attn.qkv_proj -> self_attn.qkv_proj
                at = parts.index("layers")
                if parts[at + 1] != "0":
                    continue
                parts = parts[at + 2:]
            first.setdefault(".".join(parts), module)
    lines = [("rows", *(str(r) for r in rows))]
    for name, module in first.items():
        parent, _, leaf = name.rpartition(".")
        fold = FOLDS.get(leaf)
        # Where the SiLU-mul goes is gate/up's to say: the MLP's two projections read its bucket
        gate_up = first.get(f"{parent}.gate_up_proj") if leaf in ("gate_up_proj", "down_proj") else None
        label = f"{name} ({type(module.quant_method).__name__})"
        lines.append((label, *(_kernels(module.quant_method.bucket(r), fold,
                                        gate_up.quant_method.bucket(r) if gate_up is not None else None)
                               for r in rows)))
    attention = (attention_backend.decode_kernels(r) for r in rows)
    lines.append((f"attention ({attention_backend.name})", *attention))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)
