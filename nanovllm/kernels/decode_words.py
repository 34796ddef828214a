"""The tile loop of a split-KV decode chunk over an 8-bit cache (fp8 e4m3, or int8 scaled per token) read
as 16-bit words ("words"), which such a cache read by 16-bit queries takes instead of widening each tile
with `.to()` ("cast", decode_attention.attend_chunk's loop, which every other cache takes).

Why: with "cast" Triton feeds both dots from 8-bit tiles, so it picks 4-element (32-bit) mma operand
groups (kWidth 4). V's groups then run along keys, across cache rows, and sm_90 has no 8-bit ldmatrix:
the Triton 3.6 build for sm_90 (BLOCK_N 128, 4 warps, 2 stages) reads V with 128 LDS.U8 per thread
per tile, and q, whose operand layout follows K's, with 32 LDS.64 and ~130 register moves: 1,054
instructions per tile where the bf16 kernel takes 659 for twice the bytes (scripts/decode_sass.py).
An int8 cache's "cast" tiles are worse still: 972 instructions a 64-key tile at its large-batch launch,
against 381 for fp8's words (tests/kernels/sm90_build.py).

"words" reads each cached row as HEAD_DIM / 2 16-bit words, word j holding the bytes of dims 2j (low
byte) and 2j + 1 (high byte), and splits the dots by parity:

    scores  = q[:, 0::2] @ k_even^T + q[:, 1::2] @ k_odd^T        k_even[n, j] = k[n, 2j]
    acc_par = p @ v_par  (par = even, odd)                         acc[:, 2j + par] = acc_par[:, j]

The dots' operands are 16-bit words widened by one opaque-to-layout elementwise step (widen_fp8_pairs,
widen_int8_pairs), so Triton picks 16-bit operand layouts (kWidth 2): words reach registers by ldmatrix
(.trans for V), and each register of two words becomes the two float16 pairs the mma wants with a few
byte permutes and conversions. q and p get the 16-bit layouts of the bf16 kernel (ldmatrix, no register
shuffles). Triton 3.6, sm_90, the same launch: 635 instructions per tile instead of 1,054, the same 168
registers and 40 KB of shared memory (3 programs per SM). e4m3 values and int8 ones are exact in float16,
so the result equals "cast"'s up to float32 summation order (an int8 cache's per-token scales multiply a
key's scores and a value's weights, as in common.online_softmax_step). Measured on an H200 (fp8): one
layer's decode at 256 and 512 rows 1.12-1.13x "cast" (1.16x with decode_launch.WORDS_MAXNREG), batch
1 and 8 1.08-1.11x; bench.py with an fp8 cache 34.9k tok/s against 32.4k (docs/performance-notes.md,
section "fp8 KV cache"; commit df71aea, 2026-11-30). An int8 cache's words (INT8_WORDS): bench.py on
Qwen3-8B on an H100 9,639 tok/s against "cast"'s 8,961 (2026-12-05).
"""

import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import FP8_DTYPE, paged_slots, slot_offsets

# The Triton interpreter runs no inline PTX: there the widen_* functions convert with plain Triton ops.
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# Whether an int8 cache read by 16-bit queries takes "words" tiles: their sm_90 build (Triton 3.6,
# FP8_LARGE_BATCH at one chunk a context) issues 566 instructions a 64-key tile against "cast"'s 972 (fp8's
# words: 381), in 126 registers against 153. bench.py on Qwen3-8B (bf16 weights, H100, 2026-12-05): int8
# cache "cast" 8,961 tok/s, words 9,639, an fp8 cache 9,724 (docs/performance-notes.md, "fp8 KV cache").
INT8_WORDS = True


def tile_form(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> str:
    """The TILES constexpr of a decode launch: "words" for an 8-bit cache (fp8; int8 where INT8_WORDS
    says so) read by 16-bit queries, whose tiles widen to float16 (common.float16_dot_operands); else "cast"
    (a float32 q widens the tiles to float32, and keeps its exact products)."""
    eight_bit = cache_dtype == FP8_DTYPE or (cache_dtype == torch.int8 and INT8_WORDS)
    return "words" if eight_bit and q_dtype != torch.float32 else "cast"


@triton.jit
def widen_pairs(words, INT8: tl.constexpr):
    """(low bytes, high bytes) of int16 `words` widened to float16 (exactly): e4m3 values, or with INT8
    signed integers."""
    if INT8:
        return widen_int8_pairs(words)
    return widen_fp8_pairs(words)


@triton.jit
def widen_fp8_pairs(words):
    """(low bytes, high bytes) of int16 `words`, each an e4m3 value, widened to float16 (exactly).
    Two words per 32-bit register: one byte permute gathers the two low and the two high bytes, and
    each pair converts in one instruction (sm_89+)."""
    if INTERPRETING:
        return _widen_e4m3_bytes(words & 0xFF), _widen_e4m3_bytes((words >> 8) & 0xFF)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _widen_e4m3_bytes(byte):
    """widen_fp8_pairs' conversion of e4m3 codes 0-255 with plain Triton ops (the interpreter's): the
    interpreter converts the NaN codes 0x7f and 0xff to +-480, where the GPU gives NaN, which would hide
    a read of a cache slot that holds NaN and should have been masked."""
    value = byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def widen_int8_pairs(words):
    """(low bytes, high bytes) of int16 `words`, each a signed int8, widened to float16 (exactly).
    Two words per 32-bit register: a sign flip, then a byte permute a pair puts the two low (and the two
    high) bytes under float16's exponent of 1024, and one float16x2 subtraction removes the offset: the
    byte b ^ 0x80 as the low mantissa bits of 0x6400 (1024) reads 1024 + b + 128, less 0x6480 (1152)
    leaves b."""
    if INTERPRETING:
        return _signed_byte(words & 0xFF).to(tl.float16), _signed_byte((words >> 8) & 0xFF).to(tl.float16)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, lo, hi, bias; xor.b32 t, $2, 0x80808080; "
        "prmt.b32 lo, t, 0x64646464, 0x4240; prmt.b32 hi, t, 0x64646464, 0x4341; "
        "mov.b32 bias, 0x64806480; sub.f16x2 $0, lo, bias; sub.f16x2 $1, hi, bias; }",
        "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _signed_byte(byte):
    """Codes 0-255 as the int8 values they hold (widen_int8_pairs' plain form, the interpreter's)."""
    return tl.where(byte >= 128, byte - 256, byte)


@triton.jit
def attend_words(q, qk_scale, first_kv_head, split_start, split_end, block_table_row, k_cache_ptr,
                 v_cache_ptr, k_scales_ptr, v_scales_ptr, NUM_HEADS_PER_KV: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, KV_PER_PROG: tl.constexpr):
    """(m_i, l_i, acc [BLOCK_G, HEAD_DIM]) of float16 q (scores times qk_scale, base 2) over positions
    [split_start, split_end) of one sequence (its block-table row) and KV heads first_kv_head ..
    first_kv_head + KV_PER_PROG - 1, the 8-bit caches read as words (see the module docstring); an int8
    cache's per-token scales (k_scales_ptr, v_scales_ptr: common's layout) multiply each key's scores and
    each value's weights. q's rows are the query heads of those KV heads in order, NUM_HEADS_PER_KV each
    ("packed": see below). An empty range reads nothing: m_i = -inf, l_i = 0, acc = 0.

    Packed KV heads: a GQA group of two fills 2 of the 16 rows a dot needs, and the online softmax works
    on all 16. With KV_PER_PROG heads a program, each head's dots take q (then p) with the other heads'
    rows zeroed, chained into one score tile (one accumulator): the tensor-core work per key and head is
    unchanged, the softmax's is shared by KV_PER_PROG heads. The zeroed rows add exact zeros, and an int8
    cache's scales reach each row from its own head, so each row gets the bits it gets with one head a
    program."""
    INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8
    WORDS: tl.constexpr = HEAD_DIM // 2
    q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_G, WORDS, 2]))
    row_head = tl.arange(0, BLOCK_G) // NUM_HEADS_PER_KV  # the program's KV head each row attends with
    k_words_ptr = k_cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    v_words_ptr = v_cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_even = tl.zeros([BLOCK_G, WORDS], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_G, WORDS], dtype=tl.float32)
    for tile_start in range(split_start, split_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        slots = paged_slots(block_table_row, tile_start, n_mask, BLOCK_SIZE, BLOCK_N)
        qk = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(KV_PER_PROG):
            # A row of HEAD_DIM bytes is WORDS words: the cache's word offsets are its byte offsets / 2.
            word_offs = slot_offsets(slots, first_kv_head + i, NUM_KV_HEADS, WORDS)
            k_even, k_odd = widen_pairs(tl.load(k_words_ptr + word_offs, mask=n_mask[:, None], other=0), INT8)
            qk = tl.dot(_rows_of(q_odd, row_head, i, KV_PER_PROG), tl.trans(k_odd),
                        tl.dot(_rows_of(q_even, row_head, i, KV_PER_PROG), tl.trans(k_even), qk))
        if INT8:
            qk = qk * _token_scales(k_scales_ptr, slots, first_kv_head, n_mask, row_head, NUM_KV_HEADS,
                                    KV_PER_PROG)
        qk = qk * qk_scale
        # Position tile_start is always valid (the chunk is not empty), so every row sees a key.
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT8:
            p = p * _token_scales(v_scales_ptr, slots, first_kv_head, n_mask, row_head, NUM_KV_HEADS,
                                  KV_PER_PROG)
        p = p.to(tl.float16)
        # The rescaled output is the dots' accumulator (as Triton makes of `acc * alpha + dot(p, v)`, the
        # one-head form: the same sums in the same order for every row).
        acc_even = acc_even * alpha[:, None]
        acc_odd = acc_odd * alpha[:, None]
        for i in tl.static_range(KV_PER_PROG):
            word_offs = slot_offsets(slots, first_kv_head + i, NUM_KV_HEADS, WORDS)
            v_even, v_odd = widen_pairs(tl.load(v_words_ptr + word_offs, mask=n_mask[:, None], other=0), INT8)
            p_i = _rows_of(p, row_head, i, KV_PER_PROG)
            acc_even = tl.dot(p_i, v_even, acc_even)
            acc_odd = tl.dot(p_i, v_odd, acc_odd)
        m_i = m_new
    # [BLOCK_G, WORDS, 2] -> [BLOCK_G, HEAD_DIM]: dims 2j and 2j + 1 side by side, once per chunk.
    return m_i, l_i, tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_G, HEAD_DIM])


@triton.jit
def _token_scales(scales_ptr, slots, first_kv_head, n_mask, row_head, NUM_KV_HEADS: tl.constexpr,
                  KV_PER_PROG: tl.constexpr):
    """An int8 cache's scales of the tile's keys for each row's KV head ([1, BLOCK_N] with one head a
    program, else [BLOCK_G, BLOCK_N]); 0 for keys outside n_mask."""
    scales = tl.load(scales_ptr + slots * NUM_KV_HEADS + first_kv_head, mask=n_mask, other=0.0)[None, :]
    for i in tl.static_range(1, KV_PER_PROG):
        head_scales = tl.load(scales_ptr + slots * NUM_KV_HEADS + first_kv_head + i, mask=n_mask, other=0.0)
        scales = tl.where((row_head == i)[:, None], head_scales[None, :], scales)
    return scales


@triton.jit
def _rows_of(x, row_head, i, KV_PER_PROG: tl.constexpr):
    """x with the rows of KV heads other than the program's i-th zeroed (x itself with one head)."""
    if KV_PER_PROG == 1:
        return x
    return tl.where((row_head == i)[:, None], x, 0.0)
