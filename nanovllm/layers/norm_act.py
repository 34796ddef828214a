"""The decoder's elementwise layers, mirroring nanovllm.kernels.norm_act: RMSNorm (optionally after the
residual add that precedes it) and SiluAndMul ([gate | up] -> silu(gate) * up). One Triton kernel each
on CUDA (imported there only: the CPU path needs no Triton); plain PyTorch elsewhere, computed in float32
and rounded as transformers does, so float32 outputs match it exactly on the CPU."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention.layer import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if x.is_cuda:
        from nanovllm.kernels import norm_act
        return norm_act.silu_and_mul(x)
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
