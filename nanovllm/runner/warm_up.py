"""What the model runner runs once at start-up on CUDA so that no step of a run stops for it later:
each costs little here and, met first mid-run, stalled the whole batch (docs/performance-notes.md,
section "Compilation and start-up").

- gemm_shapes: every linear layer's matmul at every row count an eager step can have (the padded
  token counts of runner/inputs.py; the LM head at every sampling-row count), so cuBLAS has chosen and
  cached a kernel for each shape (a shape met first cost ~130 us of host time per call against ~15;
  commit 1c7909b), and the few-token Triton kernels of each layer's linear method
  (layers/linear_methods.py) have built their variants with the RMSNorm or SiLU-mul folded in (the
  SiLU-mul after gate/up too), which decode at 1-16 rows launches (commit adbf98d).
- the attention backend's kernel variants that eager steps pick by their shape
  (AttentionBackend.warm_up; the model runner calls it): a mixed step's decoding rows built the Triton
  decode kernel's small-batch launch mid-run (0.8 s; commit 7e7ae08).
- sampler: the compiled sampler's variants (torch.compile specializes one row, and few rows take
  another argmax) and the fused race's Triton kernels, each seconds of compiling on a cold cache."""

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from nanovllm.layers.norm_act import RMSNorm
from nanovllm.runner.inputs import token_buckets
from nanovllm.runner.sampling import WARM_ROWS, StepSampler


@torch.inference_mode()
def gemm_shapes(model: nn.Module, config: Config, dtype: torch.dtype, device: torch.device) -> None:
    layers = {}  # one layer per distinct matmul: its kind, method, weight shape and bias
    for module in model.modules():
        if isinstance(module, LinearBase):
            kind = (type(module).local_matmul, type(module.quant_method))
            layers.setdefault((*kind, module.weight.shape, module.bias is None), module)
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    width = max([m.weight.shape[1] for m in (*layers.values(), *heads)], default=0)
    x = torch.zeros(config.max_num_batched_tokens, width, dtype=dtype, device=device)
    for rows in token_buckets(config.max_num_batched_tokens):
        for module in layers.values():
            module.local_matmul(x[:rows, :module.weight.shape[1]])
    for head in heads:
        for rows in range(1, min(config.max_num_seqs, config.max_num_batched_tokens) + 1):
            head.quant_method.apply(head, x[:rows, :head.weight.shape[1]], None)
    for module in layers.values():
        _fused_variants(module, dtype)
    torch.cuda.synchronize(device)


def _fused_variants(module: LinearBase, dtype: torch.dtype) -> None:
    """The method's kernels with the norm (after a residual add or not) or the SiLU-mul folded in, at the
    first row count of each bucket that has them (the kernels build one variant for the rows after it).
    Activations in the model's dtype, which a quantized weight's (fp8) is not."""
    method, weight = module.quant_method, module.weight
    k = weight.shape[1]
    norm = RMSNorm(k).to(weight.device, dtype)
    rows = 1
    for bucket in method.BUCKETS:
        first = torch.zeros(rows, 2 * k, dtype=dtype, device=weight.device)
        if isinstance(module, ColumnParallelLinear) and bucket.normed is not None:
            for residual in (None, first[:, k:].contiguous()):
                module(first[:, :k].contiguous(), norm=norm, residual=residual)
        if isinstance(module, MergedColumnParallelLinear) and bucket.normed_gated is not None:
            for residual in (None, first[:, k:].contiguous()):
                module.gated(first[:, :k].contiguous(), norm, residual)
        if isinstance(module, MergedColumnParallelLinear) and bucket.gated is not None:
            module.gated(first[:, :k].contiguous())
        if isinstance(module, RowParallelLinear) and bucket.silu is not None:
            method.apply_silu(module, first, None)  # no all-reduce: this rank's kernel alone
        if bucket.max_rows is None:  # the last bucket (per-channel fp8's folds quantize past its rows bucket)
            return
        rows = bucket.max_rows + 1


@torch.inference_mode()
def sampler(model: nn.Module, step_sampler: StepSampler, hidden_size: int, dtype: torch.dtype,
            device: torch.device) -> None:
    hidden = torch.zeros(max(WARM_ROWS), hidden_size, dtype=dtype, device=device)
    logits = model.compute_logits(hidden)
    if logits is not None:  # rank 0 samples
        step_sampler.warm_up(logits)
    torch.cuda.synchronize(device)
