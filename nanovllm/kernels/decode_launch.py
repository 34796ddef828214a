"""How the split-KV decode kernel (decode_attention.py) is launched: keys per tile, warps, pipeline
stages and chunks per sequence, from static shapes only (so a CUDA graph captured at a batch size keeps
its launch). The settings are measured ones: scripts/decode_sweep.py on an H200, microseconds of one
layer's decode, Qwen3-0.6B heads, 256-token blocks (docs/performance-notes.md, section "Decode attention at
one row";
commit c5a678e, 2026-11-30).

- Large batches read K/V at 0.8-0.99 of copy bandwidth with 128-key tiles, 4 warps and 2 stages,
  where two stages of K and V tiles fit in shared memory (an H100/H200 at head_dim <= 128), else with
  64-key tiles; at head_dim 256, 32-key tiles so they fit.
- A small batch is latency-bound: each context is cut into many chunks of a tile or two (at least
  SMALL_BATCH_SPLITS). There three pipeline stages were twice as fast in that sweep, at batch 1 with 1,024
  and 4,096 keys: a bf16 cache 17.4 and 25.6 us with 64-key tiles (28.2 and 63.0 us with the
  large-batch settings), an fp8 cache 20.3 and 23.4 us with 128-key tiles (38.2 and 32.1 us).

DecodeCall is one call's launch from its arguments: checked shapes, settings and chunk count, output,
scratch for the partials and the combining counters; decode_attention.py and decode_rope.py share it."""

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import triton

from nanovllm.kernels.common import (
    check_paged_attention_args,
    dot_precision,
    max_shared_memory,
    output_for,
    sm_count,
)
from nanovllm.kernels.decode_words import tile_form


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    block_n: int  # key positions per tile
    num_warps: int
    num_stages: int
    kv_per_prog: int = 1  # KV heads a program (FP8_PACKED's)

    def options(self, words: bool) -> dict:
        """The kernel launch's keyword options; `words`: the tiles are decode_words' "words"."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if words and self == WIDE:
            options["maxnreg"] = WORDS_MAXNREG
        return options


WIDE = DecodeLaunch(128, 4, 2)
NARROW = DecodeLaunch(64, 4, 2)
HEAD_DIM_256 = DecodeLaunch(32, 4, 2)
# Per cache element size (2: bf16/fp16, 1: fp8; an int8 cache takes fp8's launches, not yet measured for
# its "cast" tiles), where a small batch leaves the kernel latency-bound.
SMALL_BATCH = {2: DecodeLaunch(64, 4, 3), 1: DecodeLaunch(128, 4, 3)}
SMALL_BATCH_SPLITS = 8
# The "words" tiles at the WIDE launch (an 8-bit cache's where FP8_LARGE_BATCH does not fit) take 168
# registers (3 programs per SM); capped at 128, with a few spills, 4 fit: one layer's decode with an fp8
# cache at 256 and 512 rows 1.16x "cast" against 1.12-1.13x uncapped (commit df71aea, 2026-11-30).
WORDS_MAXNREG = 128
# An fp8 cache's large-batch launch: 64-key tiles, 5 stages. Below 5 stages Triton keeps one K and one V
# buffer (the block-table load the tile addresses depend on takes a stage of its own, as the sm_90 SASS
# shows), so each tile's load waits exposed; 5 give two. One layer's decode at 256 and 512 rows x 1k
# tokens: 157.7 and 288.0 us against WIDE's (capped) 160.8 and 300.3; bench.py with an fp8 cache 35.3k
# tok/s against 34.7-34.8k in the same process. A 16-bit cache gains nothing from it (at 0.93-0.99 of copy
# bandwidth already), nor its small-batch launch (single stream 0.902 ms both ways) (commit 133a11a).
FP8_LARGE_BATCH = DecodeLaunch(64, 4, 5)
# What FP8_LARGE_BATCH becomes at one chunk a context with programs to spare (_packs): two KV heads a
# program, their query heads stacked into the 16 rows a dot takes (decode_words' packed heads), 3
# stages. One layer's decode, contexts uniform in [C/2, C], us a call against FP8_LARGE_BATCH's, the same
# bits: 256 x 1,024 100.0 / 108.9, 512 x 1,024 196.9 / 199.1; bench.py with an fp8 cache 38,357 tok/s
# against 37,822 (+1.4%, six alternating pairs) (commit 02fc5c9, 2026-12-02).
FP8_PACKED = DecodeLaunch(64, 4, 3, kv_per_prog=2)
# Shared memory left for what else the kernel keeps there (q, the dot operands' layouts).
SHARED_MEMORY_HEADROOM = 32 * 1024
# Enough resident programs per SM to hide memory latency in this bandwidth-bound kernel.
PROGRAMS_PER_SM = 4
# Caps the partials one head's reduce has to combine (and the scratch they take).
MAX_NUM_SPLITS = 64


def decode_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int, block_n: int,
                      num_sms: int) -> int:
    """Chunks per sequence: enough programs to give every SM PROGRAMS_PER_SM of them, but no more
    chunks than tiles in the longest possible context."""
    wanted = triton.cdiv(num_sms * PROGRAMS_PER_SM, batch_size * num_kv_heads)
    useful = triton.cdiv(max_context_len, block_n)
    return max(1, min(wanted, useful, MAX_NUM_SPLITS))


def _fits(launch: DecodeLaunch, head_dim: int, element_size: int, device: torch.device) -> bool:
    # K and V of each of the program's KV heads, every stage
    tiles = launch.num_stages * 2 * launch.kv_per_prog * launch.block_n * head_dim * element_size
    return tiles + SHARED_MEMORY_HEADROOM <= max_shared_memory(device)


@functools.cache
def _large_batch_launch(head_dim: int, element_size: int, device: torch.device) -> DecodeLaunch:
    if head_dim > 128:
        return HEAD_DIM_256
    if element_size == 1 and _fits(FP8_LARGE_BATCH, head_dim, element_size, device):
        return FP8_LARGE_BATCH
    return WIDE if _fits(WIDE, head_dim, element_size, device) else NARROW


def choose_launch(batch_size: int, num_kv_heads: int, head_dim: int, max_context_len: int,
                  element_size: int, device: torch.device, num_sms: int) -> tuple[DecodeLaunch, int]:
    """(launch settings, chunks per sequence) for one decode call's static shapes."""
    launch = _large_batch_launch(head_dim, element_size, device)
    num_splits = decode_num_splits(batch_size, num_kv_heads, max_context_len, launch.block_n, num_sms)
    small = SMALL_BATCH.get(element_size)
    if (num_splits >= SMALL_BATCH_SPLITS and small is not None and head_dim <= 128
            and _fits(small, head_dim, element_size, device)):
        launch = small
        num_splits = decode_num_splits(batch_size, num_kv_heads, max_context_len, launch.block_n, num_sms)
    elif launch == FP8_LARGE_BATCH and _packs(batch_size, num_kv_heads, head_dim, max_context_len, device,
                                              num_sms):
        launch = FP8_PACKED
    return launch, num_splits


def _packs(batch_size: int, num_kv_heads: int, head_dim: int, max_context_len: int, device: torch.device,
           num_sms: int) -> bool:
    """Whether FP8_PACKED takes a call of these shapes: whole packs of KV heads, and programs enough for
    one chunk a context still (at 66-72 rows, two programs an SM, it ran 0.78-0.81x the unpacked kernel)."""
    kv_per_prog = FP8_PACKED.kv_per_prog
    if num_kv_heads % kv_per_prog or not _fits(FP8_PACKED, head_dim, 1, device):
        return False
    programs_per_seq = num_kv_heads // kv_per_prog
    return decode_num_splits(batch_size, programs_per_seq, max_context_len, FP8_PACKED.block_n, num_sms) == 1


def variant_shapes(max_rows: int, num_kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                   element_size: int, device: torch.device, num_sms: int,
                   variant: Callable[[int, DecodeLaunch, int], Hashable],
                   row_thresholds: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """One (rows, block-table width) for each compiled variant of a decode kernel that calls of up to
    max_rows rows and max_blocks blocks can take, `variant(rows, launch, num_splits)` naming a call's; it
    may read rows only through those and whether rows >= each of `row_thresholds`. For a warm-up that
    builds every variant before the first real step. choose_launch sees rows only through the chunks
    they want (with one KV head a program, and with FP8_PACKED's) and the width only through the chunks
    it allows, so a shape for each pair of those covers every call, and there are few (a few dozen each)."""
    unbounded = 1 << 30
    rows_for, width_for = {}, {}
    packed_programs = max(1, num_kv_heads // FP8_PACKED.kv_per_prog)
    for rows in range(1, max_rows + 1):
        wanted = (decode_num_splits(rows, num_kv_heads, unbounded, 1, num_sms),
                  decode_num_splits(rows, packed_programs, unbounded, 1, num_sms))
        rows_for.setdefault((wanted, tuple(rows >= t for t in row_thresholds)), rows)
    small = SMALL_BATCH.get(element_size)
    block_ns = sorted({_large_batch_launch(head_dim, element_size, device).block_n,
                       *([small.block_n] if small else [])})
    for width in range(1, max_blocks + 1):
        allowed = tuple(decode_num_splits(1, 1, width * block_size, n, unbounded) for n in block_ns)
        width_for.setdefault(allowed, width)
    shapes = {}
    for rows in rows_for.values():
        for width in width_for.values():
            launch, splits = choose_launch(rows, num_kv_heads, head_dim, width * block_size, element_size,
                                           device, num_sms)
            shapes.setdefault(variant(rows, launch, splits), (rows, width))
    return list(shapes.values())


# tl.dot needs at least 16 rows, so a GQA group (often 1-8 query heads) is padded to 16 masked rows.
# The padding costs tensor-core FLOPs, not memory traffic, and decode is bound by reading K/V.
MIN_GROUP_ROWS = 16
# Partials per head the combining epilogue reads per vectorized load ([heads, rows, head_dim] float32
# in registers).
COMBINE_ROWS = 16


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """What one launch of a decode kernel needs besides its inputs: its output, scratch and counters
    (checked, or allocated), its grid and launch settings. Shared with decode_rope.py."""

    out: torch.Tensor
    partial_out: torch.Tensor  # [B * num_heads * num_splits * head_dim] float32
    partial_lse: torch.Tensor  # [B * num_heads * num_splits] float32
    counters: torch.Tensor
    grid: tuple[int, int, int]  # (num_kv_heads / launch.kv_per_prog, B, num_splits)
    launch: DecodeLaunch
    num_heads_per_kv: int
    head_dim: int
    block_size: int

    @property
    def num_splits(self) -> int:
        return self.grid[2]

    @staticmethod
    def prepare(q, k_cache, v_cache, seqlens_k, block_tables, num_splits, out, workspace, counters,
                packs: bool = False) -> "DecodeCall":
        """`packs`: the kernel can take several KV heads a program (FP8_PACKED): decode_attention's can,
        decode_rope's cannot (its rotary and KV store take one KV head a program)."""
        num_heads, num_kv_heads, head_dim, block_size = check_paged_attention_args(
            q, k_cache, v_cache, block_tables
        )
        batch_size = q.shape[0]
        if seqlens_k.shape != (batch_size,) or block_tables.shape[0] != batch_size:
            raise ValueError(
                f"seqlens_k {tuple(seqlens_k.shape)} and block_tables {tuple(block_tables.shape)} "
                f"must have one row per query ({batch_size})"
            )
        out = output_for(q, out)
        max_context_len = block_tables.shape[1] * block_size
        launch, auto_splits = choose_launch(max(batch_size, 1), num_kv_heads, head_dim, max_context_len,
                                            k_cache.element_size(), q.device, sm_count(q.device))
        if num_splits is None:
            num_splits = auto_splits
        elif num_splits < 1:
            raise ValueError(f"num_splits must be >= 1; got {num_splits}")
        group = num_heads // num_kv_heads
        words = tile_form(k_cache.dtype, q.dtype) == "words"
        # Packed KV heads need the "words" loop at one chunk a context, and query heads that fit the rows a
        # dot takes anyway (MIN_GROUP_ROWS: beyond them packing saves no softmax work).
        if launch.kv_per_prog > 1 and not (packs and words and num_splits == 1
                                           and group * launch.kv_per_prog <= MIN_GROUP_ROWS):
            launch = FP8_LARGE_BATCH

        # Scratch: per (sequence, head, split) a [head_dim] partial output, then one log-sum-exp each.
        num_partials = batch_size * num_heads * num_splits
        workspace_numel = num_partials * (head_dim + 1)
        if workspace is None:
            workspace = torch.empty(workspace_numel, dtype=torch.float32, device=q.device)
        elif not (
            workspace.dtype == torch.float32
            and workspace.is_contiguous()
            and workspace.numel() >= workspace_numel
        ):
            raise ValueError(
                f"workspace must be a contiguous float32 tensor of at least {workspace_numel} elements "
                f"(B * num_heads * num_splits * (head_dim + 1)); got {workspace.dtype} x {workspace.numel()}"
            )
        if counters is None:
            counters = torch.zeros(batch_size * num_kv_heads, dtype=torch.int32, device=q.device)
        elif not (counters.dtype == torch.int32 and counters.is_contiguous()
                  and counters.numel() >= batch_size * num_kv_heads):
            raise ValueError(f"counters must be a contiguous int32 tensor of at least B * num_kv_heads = "
                             f"{batch_size * num_kv_heads} zeros; got {counters.dtype} x {counters.numel()}")
        grid = (num_kv_heads // launch.kv_per_prog, batch_size, num_splits)
        return DecodeCall(out, workspace[: num_partials * head_dim],
                          workspace[num_partials * head_dim : workspace_numel], counters, grid, launch, group,
                          head_dim, block_size)

    def constexprs(self, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> dict:
        """The kernels' shared compile-time arguments and launch settings."""
        group, kv_per_prog = self.num_heads_per_kv, self.launch.kv_per_prog
        tiles = tile_form(cache_dtype, q_dtype)
        return dict(NUM_HEADS_PER_KV=group, NUM_KV_HEADS=self.grid[0] * kv_per_prog, HEAD_DIM=self.head_dim,
                    BLOCK_SIZE=self.block_size, KV_PER_PROG=kv_per_prog,
                    BLOCK_G=max(MIN_GROUP_ROWS, triton.next_power_of_2(group * kv_per_prog)),
                    BLOCK_N=self.launch.block_n, COMBINE_HEADS=triton.next_power_of_2(group),
                    COMBINE_ROWS=COMBINE_ROWS, DOT_PRECISION=dot_precision(q_dtype),
                    TILES=tiles, ONE_SPLIT=self.num_splits == 1, **self.launch.options(tiles == "words"))
