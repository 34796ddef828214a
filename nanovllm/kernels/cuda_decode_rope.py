"""decode_rope for one decode row as a CUDA kernel (decode_rope_one_row.cu, compiled by NVRTC at first
use): the same arguments and results as kernels/decode_rope.paged_decode_rope_attention, for the
single-stream step, where a layer is a chain of dependent latencies rather than bytes.

Why CUDA here: on an H200 the Triton kernel costs a one-row layer ~6 us more than a kernel that only
waits and copies q, while its 4 MB of K/V are ~1 us of bandwidth. Issuing
every load at the wait, dots on CUDA cores and no tile through shared memory, which Triton compiled
to 234-254 registers and ~98 barriers, is 128 registers and a few barriers here: single stream
0.769 against 0.817 ms/token (docs/performance-notes.md, section "Decode attention at one row"; commit
5663d48).

Taken only where measured: one row, GQA groups of 2 (Qwen3-0.6B's), head_dim 128, a 16-bit cache of q's
dtype, blocks of a multiple of 64 tokens (`supports`), with q/k norms and unit cache scales (the
backend's check), sm_90+ (launched as a programmatic dependent, as the Triton kernel is); anything else,
or a failed compile, stays on the Triton kernel."""

import ctypes
import functools
import math
import os

import torch

from nanovllm.kernels.decode_launch import DecodeCall
from nanovllm.kernels.nvrtc import CompileError, CudaFunction, compile_cubin

__all__ = ["CompileError", "OneRowDecodeRope", "supports"]

SOURCE_PATH = os.path.join(os.path.dirname(__file__), "decode_rope_one_row.cu")
KERNEL_NAME = "decode_rope_cuda"
THREADS = 128
HEAD_DIM = 128
# The GQA group sizes the kernel is taken for: the one measured and tested on the GPU (its source also
# compiles for 1 and 4 heads a group, with spills at 4).
GROUP_SIZES = (2,)
# Keys a tile: a chunk's tile must sit inside one KV block.
TILE_KEYS = 64
# Blocks an SM the compiler sizes registers for: 4 keep the kernel at 128 registers without spills, so
# the one-row grid (KV heads x 64 chunks) is resident at once.
MIN_BLOCKS_PER_SM = 4

# The kernel's parameters in order: (name, kind), kind "ptr", "i64", "i32" or "f32". A CPU test checks
# this against the .cu signature.
PARAMETERS = (
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("k_cache", "ptr"), ("v_cache", "ptr"),
    ("partial_out", "ptr"), ("partial_lse", "ptr"), ("out", "ptr"), ("counters", "ptr"),
    ("seqlens", "ptr"), ("block_tables", "ptr"), ("positions", "ptr"), ("slots", "ptr"),
    ("cos_t", "ptr"), ("sin_t", "ptr"), ("q_w", "ptr"), ("k_w", "ptr"), ("q_eps", "f32"), ("k_eps", "f32"),
    ("q_sb", "i64"), ("q_sh", "i64"), ("k_sb", "i64"), ("k_sh", "i64"), ("v_sb", "i64"), ("v_sh", "i64"),
    ("o_sb", "i64"), ("o_sh", "i64"), ("bt_stride", "i32"), ("nsplit", "i32"), ("scale_log2", "f32"),
    ("nkv_arg", "i32"), ("bs", "i32"), ("has_norm", "i32"),
)
_CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_longlong, "i32": ctypes.c_int, "f32": ctypes.c_float}


def variant_defines(group: int, num_kv_heads: int, dtype: torch.dtype, positions_int64: bool,
                    slots_int64: bool, pdl: bool) -> dict[str, int]:
    """The macros one compiled variant is built with."""
    return dict(G=group, NKV=num_kv_heads, BF16=dtype == torch.bfloat16, POS64=positions_int64,
                SLOT64=slots_int64, PDL=pdl, MINB=MIN_BLOCKS_PER_SM)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a call with these tensors is one the kernel is taken for (see the module docstring)."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    return (rows == 1 and head_dim == HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads in GROUP_SIZES and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == q.dtype and k_cache.shape[1] % TILE_KEYS == 0
            and q.stride(2) == k.stride(2) == v.stride(2) == 1)


class OneRowDecodeRope:
    """One engine's compiled variants of the kernel on one device, each built at first use (NVRTC: both
    of an engine's in 57 ms on the H200's host) and kept for the engine's life (CUDA
    graphs hold its launches). `prepared` gives the call for one variant: the same signature as
    paged_decode_rope_attention."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        self.arch = f"sm_{major}{minor}"
        with open(SOURCE_PATH) as f:
            self.source = f.read()
        self.functions: dict[tuple, CudaFunction] = {}

    def prepared(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 pdl: bool):
        """The call for these tensors' variant (after `supports` said yes), compiled and loaded if it is
        the first; raises CompileError, or OSError without an NVRTC library."""
        num_kv_heads = k.shape[1]
        defines = variant_defines(q.shape[1] // num_kv_heads, num_kv_heads, q.dtype,
                                  positions.dtype == torch.int64, slot_mapping.dtype == torch.int64, pdl)
        key = tuple(sorted(defines.items()))
        if key not in self.functions:
            cubin, _ = compile_cubin(self.source, defines, self.arch)
            with torch.cuda.device(self.device):
                self.functions[key] = CudaFunction(cubin, KERNEL_NAME)
        return functools.partial(_launch, self.functions[key])


def _launch(function: CudaFunction, q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, seqlens_k,
            block_tables, softmax_scale: float, *, q_norm=None, k_norm=None, out=None, workspace=None,
            counters=None, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False) -> torch.Tensor:
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    if k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"a 16-bit cache has no scales; got k_scale={k_scale}, v_scale={v_scale}")
    call = DecodeCall.prepare(q, k_cache, v_cache, seqlens_k, block_tables, None, out, workspace, counters)
    has_norm = q_norm is not None
    q_weight, q_eps = q_norm if has_norm else (q, 0.0)  # unread without the norm
    k_weight, k_eps = k_norm if has_norm else (q, 0.0)
    o = call.out
    values = (q, k, v, k_cache, v_cache, call.partial_out, call.partial_lse, o, call.counters, seqlens_k,
              block_tables, positions, slot_mapping, cos, sin, q_weight, k_weight, q_eps, k_eps,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              o.stride(0), o.stride(1), block_tables.stride(0), call.num_splits,
              softmax_scale * math.log2(math.e), k.shape[1], k_cache.shape[1], int(has_norm))
    args = [_CTYPES[kind](value.data_ptr() if kind == "ptr" else value)
            for (_, kind), value in zip(PARAMETERS, values, strict=True)]
    function.launch(call.grid, THREADS, args, pdl=pdl)
    return o
