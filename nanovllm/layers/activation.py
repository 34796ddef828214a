"""Gated activation: the input holds [gate | up] halves; returns silu(gate) * up (one kernel on GPU)."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import gpu_compiled


@gpu_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
