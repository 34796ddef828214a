"""RMSNorm, optionally fused with the residual add that precedes it. Computed in float32 and rounded
as transformers does, so float32 outputs match it exactly on the CPU; one Triton kernel each on CUDA
(nanovllm.kernels.norm_act, imported there only: the CPU path needs no Triton)."""

import torch
from torch import nn

from nanovllm.utils.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from nanovllm.kernels import norm_act
            if residual is None:
                return norm_act.rms_norm(x, self.weight, self.eps)
            return norm_act.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x
