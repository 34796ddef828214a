"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p and per-request seeds.

Greedy and plain-temperature batches never sort the vocabulary; top-k uses torch.topk over the
largest k in the batch, and only top-p sorts. Sampling is an exponential race, argmax of p / E with
E ~ Exp(1), which draws from p exactly and lets seeded rows use their own generator. It is run in log
space, argmax(logits / T - log E), so no softmax is needed (min-p compares log-probabilities), and on
GPU the scaling, masking and both argmaxes compile into a couple of kernels.

With `fused_race` (the engine's choice on CUDA) the race is one Triton pass over the logits that draws
its noise from per-row Philox seeds (kernels/sample_race.py) instead of storing it; the same
distribution, from other random numbers, min-p included; and an all-greedy batch of a few rows takes
the same two kernels without the noise (kernels/sample_race.greedy)."""

from dataclasses import dataclass

import torch

from nanovllm.utils.compile import GPUCompiled

# One GPU block reduces a row of an argmax: over a ~150k vocabulary at batch 1 that is one SM busy
# for ~50 us. Batches below SPLIT_ARGMAX_ROWS rows reduce ARGMAX_CHUNKS chunks of each row first.
SPLIT_ARGMAX_ROWS = 16
ARGMAX_CHUNKS = 64


@dataclass(slots=True)
class SamplingTensors:
    """Per-row parameters for one batch; the optional ones are None when no row uses them."""

    temperatures: torch.Tensor | None  # [B] float32, 0 = greedy; None when all rows are greedy
    all_greedy: bool
    top_ks: torch.Tensor | None = None  # [B] int64, vocab size = disabled
    max_top_k: int = 0  # largest top_k in the batch, known on the host (no device sync)
    top_ps: torch.Tensor | None = None  # [B] float32
    min_ps: torch.Tensor | None = None  # [B] float32
    # (row, seed) for rows with a per-request seed: the seed already mixes in the token's index so
    # that each step draws fresh, reproducible noise.
    seeded_rows: list[tuple[int, int]] | None = None
    # [B] int64, a Philox seed per row for the fused race (the seeded rows' own, fresh ones for the
    # others); None when the caller does not use it.
    seeds: torch.Tensor | None = None


class Sampler:
    def __init__(self, compiled: bool = False, fused_race: bool = False) -> None:
        self.compiled = compiled  # torch.compile the race on CUDA (nanovllm.utils.compile)
        self.fused_race = fused_race  # the Triton race where params.seeds is given
        if fused_race:  # Triton: imported only where it runs
            from nanovllm.kernels.sample_race import greedy, race
            self._fused, self._fused_greedy = race, greedy

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if params.all_greedy:
            if self.fused_race and logits.shape[0] < SPLIT_ARGMAX_ROWS and logits.stride(-1) == 1:
                return self._fused_greedy(logits)  # two kernels where row_argmax's split takes five
            return row_argmax(logits)  # half-precision logits widen to float32 exactly: same argmax
        temps = params.temperatures
        if params.top_ks is not None or params.top_ps is not None:
            logits = logits.float() / _safe(temps).unsqueeze(1)
            if params.top_ks is not None:
                logits = _apply_top_k(logits, params.top_ks, params.max_top_k)
            if params.top_ps is not None:
                logits = _apply_top_p(logits, params.top_ps)
            temps = torch.where(temps > 0, 1.0, 0.0)  # scaled already; keeps greedy rows greedy
        if self.fused_race and params.seeds is not None:
            return self._fused(logits, temps, params.seeds, params.min_ps)
        noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
        for row, seed in params.seeded_rows or ():
            gen = torch.Generator(device=logits.device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
        return _race(self.compiled, logits, temps, noise, params.min_ps)


def _safe(temps: torch.Tensor) -> torch.Tensor:
    return torch.where(temps > 0, temps, 1.0)


@GPUCompiled
def _race(logits: torch.Tensor, temps: torch.Tensor, noise: torch.Tensor,
          min_ps: torch.Tensor | None) -> torch.Tensor:
    """argmax(logits / T - log E) per row (argmax(logits) where T == 0), after dropping the tokens
    whose probability is below min_p times the top one's."""
    logits = logits.float()
    greedy = row_argmax(logits)
    scaled = logits / _safe(temps).unsqueeze(1)
    if min_ps is not None:
        floor = scaled.amax(-1, keepdim=True) + min_ps.unsqueeze(1).log()  # log(0) = -inf: no floor
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    sampled = row_argmax(scaled - noise.log())
    return torch.where(temps > 0, sampled, greedy)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of a [rows, vocab] tensor, the same index on ties (the first), reduced in
    ARGMAX_CHUNKS chunks per row first when there are few rows (see SPLIT_ARGMAX_ROWS)."""
    rows, vocab = x.shape
    if rows >= SPLIT_ARGMAX_ROWS or vocab < 2 * ARGMAX_CHUNKS:
        return x.argmax(-1)
    width = -(-vocab // ARGMAX_CHUNKS)
    padded = torch.nn.functional.pad(x, (0, width * ARGMAX_CHUNKS - vocab), value=float("-inf"))
    best, where = padded.view(rows, ARGMAX_CHUNKS, width).max(-1)  # first max within each chunk
    chunk = best.argmax(-1, keepdim=True)  # first chunk holding the row's max
    return (chunk * width + where.gather(1, chunk)).squeeze(1)


def _apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor, max_k: int) -> torch.Tensor:
    max_k = min(max_k, logits.shape[-1])
    top_ks = top_ks.clamp(max=max_k)
    values = logits.topk(max_k, dim=-1).values  # [B, max_k], descending
    threshold = values.gather(1, (top_ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    # drop a token when the tokens strictly before it already reach top_p (the top one always stays)
    drop = (probs.cumsum(-1) - probs) >= top_ps.unsqueeze(1)
    drop[:, 0] = False  # even when top_p rounds to 0 in float32 (e.g. 1e-50): never an all -inf row
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
