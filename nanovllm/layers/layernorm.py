"""RMSNorm, optionally fused with the residual add that precedes it. Computed in float32 and rounded
once, as transformers does, so float32 outputs match it exactly; one fused kernel each on GPU."""

import torch
from torch import nn

from nanovllm.layers.options import kernel_options
from nanovllm.utils.compile import GPUCompiled
from nanovllm.utils.norm import rms_norm

_rms_norm = GPUCompiled(rms_norm)


@GPUCompiled
def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.compiled = kernel_options().torch_compile

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return _rms_norm(self.compiled, x, self.weight, self.eps)
        return _add_rms_norm(self.compiled, x, residual, self.weight, self.eps)
