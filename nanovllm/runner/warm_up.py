"""What the model runner runs once at start-up on CUDA so that no step of a run stops for it later:
each costs little here and, met first mid-run, stalled the whole batch (BENCHMARKS.md, fifth session).

- gemm_shapes: every linear layer's matmul at every row count an eager step can have (the padded
  token counts of runner/inputs.py; the LM head at every sampling-row count), so cuBLAS has chosen and
  cached a kernel for each shape (a shape met first cost ~130 us of host time per call against ~15), and
  the few-token Triton kernels (layers/linear.py's SkinnyKernels) have built the variants with the
  RMSNorm or SiLU-mul folded in, which decode at 1-16 rows launches.
- the attention backend's kernel variants that eager steps pick by their shape
  (AttentionBackend.warm_up; the model runner calls it): a mixed step's decoding rows built the Triton
  decode kernel's small-batch launch mid-run (0.8 s, BENCHMARKS.md, tenth session, N1).
- sampler: the compiled sampler's variants (torch.compile specializes one row, and few rows take
  another argmax) and the fused race's Triton kernels, each seconds of compiling on a cold cache."""

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear, linear
from nanovllm.runner.inputs import token_buckets
from nanovllm.runner.sampling import WARM_ROWS, StepSampler


@torch.inference_mode()
def gemm_shapes(model: nn.Module, config: Config, dtype: torch.dtype, device: torch.device) -> None:
    layers = {}  # one layer per distinct matmul: its kind, weight shape and bias
    for module in model.modules():
        if isinstance(module, LinearBase):
            layers.setdefault((type(module).local_matmul, module.weight.shape, module.bias is None), module)
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    width = max([m.weight.shape[1] for m in (*layers.values(), *heads)], default=0)
    x = torch.zeros(config.max_num_batched_tokens, width, dtype=dtype, device=device)
    for rows in token_buckets(config.max_num_batched_tokens):
        for module in layers.values():
            module.local_matmul(x[:rows, :module.weight.shape[1]])
    for head in heads:
        for rows in range(1, min(config.max_num_seqs, config.max_num_batched_tokens) + 1):
            linear(x[:rows, :head.weight.shape[1]], head.weight, skinny=head.skinny)
    for module in layers.values():
        _fused_variants(module)
    torch.cuda.synchronize(device)


def _fused_variants(module: LinearBase) -> None:
    """The few-token kernels' variants with the norm (after a residual add or not) or the SiLU-mul folded
    in, at one row and at two (every row count up to SKINNY_MAX_TOKENS shares the two-row build)."""
    skinny, weight = module.skinny, module.weight
    if skinny is None:
        return
    k = weight.shape[1]
    x = torch.zeros(2, 2 * k, dtype=weight.dtype, device=weight.device)
    for rows in sorted({1, min(2, skinny.max_tokens)}):
        rows_x = x[:rows, :k].contiguous()
        if isinstance(module, ColumnParallelLinear) and skinny.fuses(rows_x):
            norm_weight = torch.ones(k, dtype=weight.dtype, device=weight.device)
            for residual in (None, x[:rows, k:]):
                skinny.norm_linear(rows_x, norm_weight, 1e-6, weight, module.bias, residual)
        if isinstance(module, RowParallelLinear) and rows == 1 and skinny.fuses(x[:1]):
            skinny.silu_linear(x[:1], weight)


@torch.inference_mode()
def sampler(model: nn.Module, step_sampler: StepSampler, hidden_size: int, dtype: torch.dtype,
            device: torch.device) -> None:
    hidden = torch.zeros(max(WARM_ROWS), hidden_size, dtype=dtype, device=device)
    logits = model.compute_logits(hidden)
    if logits is not None:  # rank 0 samples
        step_sampler.warm_up(logits)
    torch.cuda.synchronize(device)
