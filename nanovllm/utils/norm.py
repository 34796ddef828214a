"""RMSNorm as plain PyTorch: computed in float32 and rounded once, as transformers does, so float32
outputs match it exactly. Shared by the model's RMSNorm layers and the reference attention backend's
per-head q/k norm."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)
