"""Gated activation: the input holds [gate | up] halves; returns silu(gate) * up (one Triton kernel on
CUDA, nanovllm.kernels.norm_act; plain PyTorch on the CPU)."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from nanovllm.kernels.norm_act import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
