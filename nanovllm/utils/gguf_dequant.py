"""Dequantizing GGUF tensors: Q8_0, Q4_0 and Q4_1 (the types of common small-model files) in one
vectorized pass over the whole tensor, every other type through the gguf package.

Why: gguf's numpy dequantizer splits a tensor into many small row groups; on 2 CPU cores that was
~2 s of SmolLM2's ~3 s load. Block layouts, from ggml's ggml-common.h (32 values a block):
    Q8_0: d (float16) | 32 x int8 q                    x = d * q
    Q4_0: d (float16) | 16 bytes of two 4-bit q each   x = d * (q - 8)
    Q4_1: d (float16) | m (float16) | 16 bytes         x = d * q + m
A byte's low nibble is value j of its block, its high nibble value j + 16."""

import numpy as np
import torch

BLOCK_VALUES = 32
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """One float16 per block at byte `start`, as [num_blocks, 1] float32."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 16] bytes -> [num_blocks, 32] values 0..15 (low nibbles first)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]) + _half(blocks, 2)


FAST_DEQUANT = {GGML_Q8_0: _q8_0, GGML_Q4_0: _q4_0, GGML_Q4_1: _q4_1}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: the tensor's bytes as [rows, bytes per row] uint8 (read-only is fine). Returns a new
    float32 tensor of `shape`."""
    fast = FAST_DEQUANT.get(ggml_type)
    if fast is None:
        from gguf import dequantize as gguf_dequantize

        values = gguf_dequantize(raw, ggml_type)
        if not values.flags.writeable:  # float32 tensors come back as views of the read-only file
            values = values.copy()
        return torch.from_numpy(values).reshape(shape)
    num_blocks = int(np.prod(shape)) // BLOCK_VALUES
    # A copy of the quantized bytes (~1/7 of the float32 result): torch wants a writable buffer.
    blocks = torch.from_numpy(raw.reshape(num_blocks, -1).copy())
    return fast(blocks).reshape(shape)
