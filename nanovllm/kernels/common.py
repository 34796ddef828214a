"""What the Triton kernels share: the paged KV-cache layout (where a token's key/value lives), the online
softmax step of the attention kernels, argument checks, the tl.dot precision and the SM count.

Per layer, `k_cache` and `v_cache` are contiguous `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token at flat slot `s` lives in block `s // block_size` at offset `s % block_size`:

    slot = block_table[pos // block_size] * block_size + pos % block_size
    element offset of (slot, kv_head, d) = slot * num_kv_heads * head_dim + kv_head * head_dim + d

`paged_kv_offsets` is that address computation for the attention kernels (any block_size works); the
KV store itself is fused into nanovllm.kernels.rope_store. The prefill and decode modules depend on this
one and not on each other.

An int8 cache (kv_cache_dtype="int8") has, per layer, float32 scales `k_scales`/`v_scales`
`[num_blocks, block_size, num_kv_heads]`, one per cached token and KV head, at element
`slot * num_kv_heads + kv_head`; it holds round(x / scale), scale = max(amax(|x|), INT8_MIN_AMAX) / 127
(`quantize_int8_rows`, as attention/torch_backend.quantize_int8). Scores are (q . k_int8) * k_scale[n],
outputs sum_n p[n] * v_scale[n] * v_int8[n] (`attend_kv_tile`, `online_softmax_step`).
"""

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def paged_kv_offsets(
    block_table_row_ptr,
    tile_start,
    kv_head,
    n_mask,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Element offsets [BLOCK_N, HEAD_DIM] into a K or V cache of positions tile_start + arange(BLOCK_N)
    of one sequence (its block-table row) and one KV head. tile_start must be a multiple of BLOCK_N;
    n_mask marks the positions that exist (the others are not looked up and must be masked by the caller);
    None: all of them do."""
    slots = paged_slots(block_table_row_ptr, tile_start, n_mask, BLOCK_SIZE, BLOCK_N)
    return slot_offsets(slots, kv_head, NUM_KV_HEADS, HEAD_DIM)


@triton.jit
def slot_offsets(slots, kv_head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offsets [len(slots), HEAD_DIM] of one KV head's rows at int64 `slots`."""
    offs_d = tl.arange(0, HEAD_DIM)
    # int64 slots: num_blocks * block_size * num_kv_heads * head_dim can pass 2**31 elements per layer.
    return slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]


@triton.jit
def paged_slots(block_table_row_ptr, tile_start, n_mask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The flat slots (int64) [BLOCK_N] of positions tile_start + arange(BLOCK_N), as paged_kv_offsets."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:
        # The whole tile sits in one block: one block-table lookup, and the slots are consecutive.
        block_id = tl.load(block_table_row_ptr + tile_start // BLOCK_SIZE).to(tl.int64)
        slots = block_id * BLOCK_SIZE + (tile_start % BLOCK_SIZE) + tl.arange(0, BLOCK_N)
    else:
        # The tile straddles blocks (or blocks are smaller than a tile): look up each token's block.
        if n_mask is None:
            block_ids = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
        else:
            block_ids = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = block_ids * BLOCK_SIZE + offs_n % BLOCK_SIZE
    return slots


@triton.jit
def attend_kv_tile(q, m_i, l_i, acc, qk_scale, visible, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                   block_table_row_ptr, tile_start, kv_head, n_mask, BLOCK_SIZE: tl.constexpr,
                   NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """online_softmax_step over the K/V tile [BLOCK_N, HEAD_DIM] of paged_kv_offsets' positions (those
    outside n_mask read as 0; None: all exist), widened to q's dtype, and with an int8 cache scaled per key
    by its scales (int8 values are exact in every float dtype). Returns (m_i, l_i, acc)."""
    slots = paged_slots(block_table_row_ptr, tile_start, n_mask, BLOCK_SIZE, BLOCK_N)
    kv_offs = slot_offsets(slots, kv_head, NUM_KV_HEADS, HEAD_DIM)
    if n_mask is None:
        k = tl.load(k_cache_ptr + kv_offs).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs).to(q.dtype)
    else:
        k = tl.load(k_cache_ptr + kv_offs, mask=n_mask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs, mask=n_mask[:, None], other=0.0).to(q.dtype)
    if k_cache_ptr.dtype.element_ty == tl.int8:
        scale_offs = slots * NUM_KV_HEADS + kv_head
        if n_mask is None:
            k_scales = tl.load(k_scales_ptr + scale_offs)
            v_scales = tl.load(v_scales_ptr + scale_offs)
        else:
            k_scales = tl.load(k_scales_ptr + scale_offs, mask=n_mask, other=0.0)
            v_scales = tl.load(v_scales_ptr + scale_offs, mask=n_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                            k_scales, v_scales)
    else:
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                            None, None)
    return m_i, l_i, acc


# The largest finite float8_e4m3fn value: fp8 cache entries are clamped to it.
FP8_MAX = tl.constexpr(448.0)
FP8_DTYPE = torch.float8_e4m3fn


# An int8 cache's values span -127..127; INT8_MIN_AMAX gives an all-zero row a nonzero (normal) scale.
# Both as attention/torch_backend's INT8_MAX and INT8_MIN_AMAX (its tests compare the kernels with it).
INT8_MAX = tl.constexpr(127.0)
INT8_MIN_AMAX = tl.constexpr(1e-30)
# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude below 2**22 to an integer, half to
# even (IEEE round to nearest), as torch.round does, in one form for the GPU and the interpreter alike.
ROUND_TO_INT = tl.constexpr(12582912.0)


@triton.jit
def quantize_int8_rows(x):
    """(int8 values, float32 scales [rows]) an int8 cache holds for the float32 rows x [rows, cols]:
    scale = max(amax(|row|), INT8_MIN_AMAX) / 127, value = round(x / scale), divisions IEEE-exact (div_rn)
    so that the GPU gets torch's bits. Columns past a row's length must be 0 (they add nothing to amax)."""
    scales = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), INT8_MIN_AMAX), INT8_MAX)
    scaled = tl.math.div_rn(x, tl.broadcast_to(scales[:, None], x.shape))
    rounded = (scaled + ROUND_TO_INT) - ROUND_TO_INT
    return tl.clamp(rounded, -INT8_MAX, INT8_MAX).to(tl.int8), scales


def check_cache_dtype(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The caches hold `dtype` (the model's), fp8 e4m3 scaled per layer, or int8 scaled per token."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (dtype, FP8_DTYPE, torch.int8):
        raise ValueError(f"the caches ({k_cache.dtype}, {v_cache.dtype}) must both hold {dtype}, "
                         f"{FP8_DTYPE} or torch.int8")


def check_cache_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None,
                       v_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's scales, checked: contiguous float32 [num_blocks, block_size, num_kv_heads] each; none
    for other caches. Returns the pointers a kernel takes (the cache itself, unread, where none)."""
    if k_cache.dtype != torch.int8:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"a {k_cache.dtype} cache has no per-token scales; pass k_scales=v_scales=None")
        return k_cache, k_cache
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is None or scales.dtype != torch.float32 or scales.shape != k_cache.shape[:3] \
                or not scales.is_contiguous():
            got = "None" if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
            raise ValueError(f"an int8 cache needs {name}: contiguous float32 {tuple(k_cache.shape[:3])} "
                             f"(one per cached token and KV head); got {got}")
    return k_scales, v_scales


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An attention kernel's output: `out` checked to be like q (a contiguous last dim), or a new one."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    return out


def check_paged_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Validate q [tokens, H, D] against the paged caches; return (num_heads, num_kv_heads, head_dim,
    block_size). Shape checks only (no host sync), so callers stay CUDA-graph capturable."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [tokens, num_heads, head_dim] with a contiguous last dim; got {tuple(q.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous; the kernels address them by slot")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} differs from the cache head_dim {cache_head_dim}")
    # tl.arange needs a power of two and tl.dot a reduction dim of at least 16.
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernels; got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)")
    check_cache_dtype(q.dtype, k_cache, v_cache)
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be [batch, max_blocks] with contiguous rows; got {tuple(block_tables.shape)}"
        )
    return num_heads, num_kv_heads, head_dim, block_size


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr,
                        k_scales, v_scales):
    """One K/V tile of flash attention in base 2: scores q @ k^T (masked where not `visible`; None: every
    key is visible), then the running max m_i, softmax sum l_i and output acc updated for it. The caller
    guarantees that some key of the first tile is visible to every row, so m_i is finite afterwards and
    exp2 never sees -inf - -inf. An int8 cache's per-key scales [BLOCK_N] (attend_kv_tile's; None for other
    caches) scale key n's scores and its value's weights."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if k_scales is not None:
        qk = qk * k_scales[None, :]
    qk = qk * scale_log2
    if visible is not None:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if v_scales is not None:
        p = p * v_scales[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: float32 caches get exact IEEE products (the default, tf32, keeps only
    10 mantissa bits); 16-bit inputs are exact either way, so they keep the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


# SM count and shared memory per block assumed off-GPU (the Triton interpreter, ahead-of-time
# compiles): an H100/H200's.
DEFAULT_NUM_SMS = 132
DEFAULT_SHARED_MEMORY = 232448


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`, which the kernels size their grids by."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependents (PDL: Hopper, sm_90, and
    later): the next kernel starts before the one before it ends, and waits (griddepcontrol.wait) where
    it needs that kernel's results. The interpreter (CPU tensors) runs no PTX, so never there."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program of a kernel on `device` may use."""
    if device.type != "cuda":
        return DEFAULT_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


@triton.jit
def float16_dot_operands(q, scale_log2, TILES_FLOAT16: tl.constexpr):
    """(q, the scale its scores take) for dots against K/V tiles widened from the cache. Where the tiles
    widen to float16 (an fp8 cache's, which sm_89+ converts e4m3 to in one instruction per pair, and
    decode_words' "words" of an 8-bit cache) a 16-bit q joins them as float16, pre-scaled so that
    float16's range holds it: widened to bfloat16, the fp8 decode kernel was no faster than a bf16 cache's,
    and float16 made it 1.35-1.46x faster (docs/performance-notes.md, "fp8 KV cache"). Otherwise (a 16-bit
    cache, an int8 one's "cast" tiles, a float32 q, which keeps its exact products) q and the scale as
    given."""
    if TILES_FLOAT16 and q.dtype != tl.float32:
        q, scale_log2 = (q.to(tl.float32) * scale_log2).to(tl.float16), 1.0
    return q, scale_log2
