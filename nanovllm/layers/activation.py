"""Gated activation: the input holds [gate | up] halves; returns silu(gate) * up (one kernel on GPU)."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.options import kernel_options
from nanovllm.utils.compile import GPUCompiled


@GPUCompiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.compiled = kernel_options().torch_compile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(self.compiled, x)
