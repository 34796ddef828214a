"""The sampler's exponential race in one pass over the logits, with its noise drawn inside the kernel.

Each row samples argmax(logits / T + G), G Gumbel(0, 1) noise (= -log E with E ~ Exp(1), the race of
layers/sampler.py), or argmax(logits) where T == 0. The PyTorch race writes a float32 noise tensor of the
logits' size and reads it back: at 256 rows of a 152k vocabulary that is 155 MB each way, most of the
sampler's ~200 us a step (docs/performance-notes.md, "Sampler"). Here the noise is Philox counter-based
randomness:
row r's noise at column c is a function of (seeds[r], c) alone, so a seeded request draws the same
noise whatever rows share its batch, and nothing is stored. On an H200 (docs/performance-notes.md,
"Sampler") the race took 64 us at 256 rows against the PyTorch race's 197, and 4.2 against 10.9 at one.
The kernel is bound by its arithmetic (Philox, two logarithms a column), not by reading the logits.

    stage 1, grid (rows, chunks): each program scans one chunk of a row and writes its best score and
        where it was (the first on ties);
    stage 2, grid (rows,): the best chunk's index (again the first on ties), so greedy rows give
        exactly torch's argmax.

With min_ps, a sampled row first drops the tokens whose logits / T fall below its floor, max(logits) / T
+ log(min_p) (min-p), the floor formed from the top logit as its own score is, so the top token always
stays. Logits may hold -inf (masked tokens); NaN is not expected.

`greedy` is the same two stages without temperatures, seeds or noise (a constexpr variant of stage 1):
a few rows' argmax in two kernels, where torch's split argmax takes five or six: 3-4.5 us a call against
~20 at 1-8 rows (docs/performance-notes.md, "Sampler")."""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.kernels.common import sm_count

# Columns one loop step of a stage-1 program covers: four sub-blocks of SUB_BLOCK, one per output of a
# Philox call (rand4x makes four numbers for the price of one).
SUB_BLOCK = 256
BLOCK = 4 * SUB_BLOCK
# Programs per SM stage 1 aims for; a row is cut into chunks until the grid has that many.
PROGRAMS_PER_SM = 16
MAX_CHUNKS = 64
NUM_WARPS = 8
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    """log2(x); FAST_LOG: the hardware approximation (lg2.approx, ~2^-22 relative error), which the
    noise tolerates: tl.log2's accurate one is a dozen FMAs, and the kernel made two per column."""
    if FAST_LOG:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _lane_best(logits_row, base, offs, end, u, scale, floor, greedy_row, best_val, best_idx,
               FAST_LOG: tl.constexpr):
    """Each lane's running (best score, its column) after columns base + offs (u: their uniforms). The
    scores are base 2: argmax(x / T + G) = argmax(x * log2(e) / T - log2(-log2(u))), G = -ln(-ln(u))
    Gumbel noise, as scaling by log2(e) > 0 and the constant log2(ln 2) leave the argmax alone; u == 0
    gives -inf, a score that never wins. floor (base 2 too; -inf: none) drops a sampled row's tokens
    below it."""
    cols = base + offs
    mask = cols < end
    x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    scaled = x * scale
    sampled = tl.where(scaled < floor, float("-inf"), scaled - _log2(-_log2(u, FAST_LOG), FAST_LOG))
    score = tl.where(greedy_row, x, sampled)
    # Strictly greater: within a lane, columns only grow, so the first of equal scores stays.
    better = mask & (score > best_val)
    return tl.where(better, score, best_val), tl.where(better, cols, best_idx)


# Triton compiles a variant per integer argument that is 1 or a multiple of 16; chunk counts and lengths
# follow the row count, and a variant first met mid-run would stall the batch while it compiles.
@triton.jit(do_not_specialize=["chunk_len", "num_chunks"])
def _race_chunk_kernel(logits_ptr, temps_ptr, seeds_ptr, row_max_ptr, log_min_p_ptr, best_val_ptr,
                       best_idx_ptr, vocab, stride_row, chunk_len, num_chunks, SUB_BLOCK: tl.constexpr,
                       HAS_FLOOR: tl.constexpr, FAST_LOG: tl.constexpr, ALL_GREEDY: tl.constexpr = False):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, vocab)
    offs = tl.arange(0, SUB_BLOCK)
    # Per lane, not per step: one reduction at the end instead of two per sub-block.
    best_val = tl.full([SUB_BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([SUB_BLOCK], 0, tl.int32) + start
    if ALL_GREEDY:  # no temperatures, seeds or floors: the argmax alone
        for step in range(start, end, SUB_BLOCK):
            cols = step + offs
            mask = cols < end
            x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            better = mask & (x > best_val)  # strictly: a lane's first column of equal ones stays
            best_val, best_idx = tl.where(better, x, best_val), tl.where(better, cols, best_idx)
    else:
        best_val, best_idx = _race_lanes(logits_row, temps_ptr, seeds_ptr, row_max_ptr, log_min_p_ptr, row,
                                         start, end, offs, best_val, best_idx, SUB_BLOCK, HAS_FLOOR, FAST_LOG)
    top = tl.max(best_val, 0)
    # The first column holding the top score (lanes that never saw a finite one keep `start`).
    where = tl.min(tl.where(best_val == top, best_idx, vocab), 0)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, tl.minimum(where, end - 1))


@triton.jit
def _race_lanes(logits_row, temps_ptr, seeds_ptr, row_max_ptr, log_min_p_ptr, row, start, end, offs,
                best_val, best_idx, SUB_BLOCK: tl.constexpr, HAS_FLOOR: tl.constexpr, FAST_LOG: tl.constexpr):
    """Each lane's best race score over columns [start, end) of the row and where it was."""
    temp = tl.load(temps_ptr + row)
    greedy_row = temp == 0.0
    scale = LOG2E / tl.where(greedy_row, 1.0, temp)
    seed = tl.load(seeds_ptr + row)
    floor = tl.full([], float("-inf"), tl.float32)
    if HAS_FLOOR:
        floor = tl.load(row_max_ptr + row) * scale + tl.load(log_min_p_ptr + row) * LOG2E
    # chunk_len is a multiple of 4 * SUB_BLOCK, so the Philox offsets (column // 4 within a step) of
    # different steps and chunks never meet.
    for step in range(start, end, 4 * SUB_BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, step // 4 + offs)
        best_val, best_idx = _lane_best(logits_row, step, offs, end, u0, scale, floor,
                                        greedy_row, best_val, best_idx, FAST_LOG)
        best_val, best_idx = _lane_best(logits_row, step + SUB_BLOCK, offs, end, u1, scale, floor,
                                        greedy_row, best_val, best_idx, FAST_LOG)
        best_val, best_idx = _lane_best(logits_row, step + 2 * SUB_BLOCK, offs, end, u2, scale, floor,
                                        greedy_row, best_val, best_idx, FAST_LOG)
        best_val, best_idx = _lane_best(logits_row, step + 3 * SUB_BLOCK, offs, end, u3, scale, floor,
                                        greedy_row, best_val, best_idx, FAST_LOG)
    return best_val, best_idx


@triton.jit(do_not_specialize=["num_chunks"])
def _race_pick_kernel(best_val_ptr, best_idx_ptr, tokens_ptr, out_rows_ptr, num_chunks, BLOCK_C: tl.constexpr,
                      SCATTER: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    winner = tl.argmax(vals, 0, tie_break_left=True)
    dest = row
    if SCATTER:  # the row's token goes where out_rows says (a decode graph's output slot)
        dest = tl.load(out_rows_ptr + row)
    tl.store(tokens_ptr + dest, tl.load(best_idx_ptr + row * num_chunks + winner).to(tl.int64))


def num_chunks(rows: int, vocab: int, num_sms: int) -> int:
    """Chunks per row: enough programs for PROGRAMS_PER_SM per SM, none shorter than one loop step."""
    wanted = triton.cdiv(num_sms * PROGRAMS_PER_SM, rows)
    return max(1, min(wanted, triton.cdiv(vocab, BLOCK), MAX_CHUNKS))


def race(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
         min_ps: torch.Tensor | None = None, *, num_sms: int | None = None,
         out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sampled token ids [rows] (int64) of logits [rows, vocab] (any float dtype, contiguous rows):
    argmax(logits / T + Gumbel noise of seeds[r]) per row, argmax(logits) where T == 0.
    temperatures: [rows] float32, >= 0; seeds: [rows] int64, one Philox seed per row; min_ps: [rows]
    float32 or None, a sampled row draws no token less likely than min_p times its top one (0: none).
    num_sms: what the grid is sized for (default: the device's SM count; tests force chunkings).
    out, out_rows: row r's token goes to out[out_rows[r]] (out: one dimension of int64, out_rows: [rows]
    int32 indices into it, read on the device), and out is returned: a decode graph's static output,
    whose slot changes from step to step without another capture."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows; got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if (temperatures.shape != (rows,) or seeds.shape != (rows,)
            or (min_ps is not None and min_ps.shape != (rows,))):
        raise ValueError(f"temperatures {tuple(temperatures.shape)}, seeds {tuple(seeds.shape)} and min_ps "
                         f"must have one entry per row ({rows})")
    if (out is None) != (out_rows is None):
        raise ValueError("out and out_rows go together")
    if out is not None and (out.dim() != 1 or out.dtype != torch.int64 or out_rows.shape != (rows,)
                            or out_rows.dtype != torch.int32):
        raise ValueError(f"out must be one dimension of int64 ids (got {out.dtype} {tuple(out.shape)}) and "
                         f"out_rows [{rows}] int32 (got {out_rows.dtype} {tuple(out_rows.shape)})")
    return _launch(logits, temperatures, seeds, min_ps, num_sms, out, out_rows)


def greedy(logits: torch.Tensor, *, num_sms: int | None = None) -> torch.Tensor:
    """argmax(logits) per row [rows] (int64), the first column on ties as torch's: the race's two kernels
    without its noise, where a few rows' torch argmax, reduced in chunks first (layers/sampler.py's
    row_argmax), takes five or six small ones."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows; got {tuple(logits.shape)}")
    return _launch(logits, None, None, None, num_sms)


def _launch(logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None,
            min_ps: torch.Tensor | None, num_sms: int | None, out: torch.Tensor | None = None,
            out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The race's two kernels; no temperatures: every row greedy (its variant draws no noise)."""
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = num_chunks(rows, vocab, num_sms or sm_count(logits.device))
    chunk_len = triton.cdiv(triton.cdiv(vocab, chunks), BLOCK) * BLOCK
    chunks = triton.cdiv(vocab, chunk_len)  # rounding chunk_len up can leave the last ones empty
    best_val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    all_greedy = temperatures is None
    if all_greedy:  # the pointers the greedy variant never reads
        temperatures, seeds = best_val, out
    # min-p's floor needs each row's top logit first (log(0) = -inf: no floor). Without min-p the two
    # pointers are never read.
    row_max, log_min_ps = (logits.amax(-1).float(), min_ps.log()) if min_ps is not None else (None, None)
    _race_chunk_kernel[(rows, chunks)](logits, temperatures, seeds,
                                       temperatures if row_max is None else row_max,
                                       temperatures if log_min_ps is None else log_min_ps,
                                       best_val, best_idx, vocab, logits.stride(0), chunk_len, chunks,
                                       SUB_BLOCK=SUB_BLOCK, HAS_FLOOR=min_ps is not None,
                                       # the interpreter (CPU tensors) has no hardware log
                                       FAST_LOG=logits.is_cuda, ALL_GREEDY=all_greedy, num_warps=NUM_WARPS)
    # BLOCK_C fixed at MAX_CHUNKS: one compiled variant for every row count.
    _race_pick_kernel[(rows,)](best_val, best_idx, out, best_idx if out_rows is None else out_rows, chunks,
                               BLOCK_C=MAX_CHUNKS, SCATTER=out_rows is not None, num_warps=1)
    return out
