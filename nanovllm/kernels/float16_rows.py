"""Rows of a bf16 (or float32) matrix as float16 times a power of two a row, exactly: x[m, :] = x16[m, :] *
scale[m], scale[m] = 2^e with the row's largest magnitude scaled into [2^14, 2^15). bf16's 8-bit
significand fits float16's 11 bits and the power of two moves only the exponent, so every value whose
scaled magnitude stays a float16 normal (all but those 2^-29 of the row's largest and smaller) comes
back bit for bit. A float16 dot over such rows then sums exactly the products a bf16 dot would, each a
power of two apart: why an e4m3 weight can widen to float16, one instruction a pair on sm_90 (to bf16
it takes three and a byte permute), with the activations kept as they are (W8A16; kernels/fused_moe.py)."""

import torch
import triton
import triton.language as tl

# The largest scaled magnitude stays below 2^15 (float16's largest finite value is 65,504): a row's scale
# is 2^(E - 15) for the smallest E with amax < 2^E, i.e. its biased float32 exponent + 1 - 127 - 15.
SCALE_EXP_OFFSET = tl.constexpr(1 - 15)
ROW_BLOCK = 1024


@triton.jit
def float16_row_scale(amax):
    """(2^e, 2^-e) for a row whose largest magnitude is amax (float32 scalar): amax * 2^-e in [2^14, 2^15)."""
    # amax's unbiased exponent + 1 (amax < 2^that), from its bits; an all-zero row takes scale 1
    exp = ((amax.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127 + SCALE_EXP_OFFSET
    exp = tl.where(amax > 0, tl.maximum(exp, -126), 0)  # a float32-subnormal amax: the smallest normal scale
    return ((exp + 127) << 23).to(tl.float32, bitcast=True), ((127 - exp) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _float16_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr):
    """One program a row: its amax, then the row times 2^-e as float16, and 2^e as its scale."""
    m = tl.program_id(0)
    row = x_ptr + m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    scale, inverse = float16_row_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + m, scale)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * K + offs, (x * inverse).to(tl.float16), mask=offs < K)


def float16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (float16 [M, K] contiguous, float32 scales [M, 1]), x = the first
    times the second (see the module docstring)."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.float16, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(ROW_BLOCK, triton.next_power_of_2(k))
        _float16_rows_kernel[(m,)](x, out, scale, k, x.stride(0), BLOCK=block)
    return out, scale
