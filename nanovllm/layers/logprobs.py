"""Logprobs on the device: the sampled token's logprob plus the top-k of each sampled row, and the
prompt logprobs of a prefill chunk, computed a bounded number of positions at a time.

Like vLLM v1's default (logprobs_mode="raw_logprobs"), they are log_softmax of the model's raw logits,
before logits processors, penalties, temperature and top-k/top-p. Only rows that asked are computed,
and the results reach the host in one copy per step."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.outputs import Logprob

# Prompt logprobs turn hidden states into full-vocabulary logits this many positions at a time, so a
# long prompt never holds a [prompt_len, vocab] float32 tensor (256 x 152k vocab x 4 B = 156 MB).
PROMPT_LOGPROBS_CHUNK = 256

TokenLogprobs = dict[int, float]  # token id -> logprob: the top-k, and the chosen token's own


@dataclass(slots=True)
class SampledLogprobs:
    """The logprobs of the sampled rows that asked for them, as tensors: on the device when computed,
    and read on the host by `dicts` once copied there (one copy per step, which overlap scheduling
    makes non-blocking)."""

    rows: list[int]  # the sampled rows that asked, ascending
    ks: list[int]  # their top-k
    token_ids: torch.Tensor  # [R] the sampled token of each
    token_logprobs: torch.Tensor  # [R] float32
    token_ranks: torch.Tensor  # [R] its rank in the whole distribution (1 = most likely)
    top_ids: torch.Tensor | None  # [R, max k]; None when every k is 0
    top_logprobs: torch.Tensor | None  # [R, max k] float32

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "SampledLogprobs":
        """The same logprobs with fn (e.g. a copy to the host) applied to each tensor."""
        top = (None, None) if self.top_ids is None else (fn(self.top_ids), fn(self.top_logprobs))
        return SampledLogprobs(self.rows, self.ks, fn(self.token_ids), fn(self.token_logprobs),
                               fn(self.token_ranks), *top)

    def dicts(self, num_rows: int) -> list[TokenLogprobs | None]:
        """Per sampled row of the step: {token: logprob} of its token and top-k, or None where it did
        not ask. Reads the tensors with .tolist(): call it on host copies, or it syncs."""
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in self.rows]
        top_lp = self.top_logprobs.tolist() if self.top_logprobs is not None else top_ids
        entries = _dicts(self.token_ids.tolist(), self.token_logprobs.tolist(), self.token_ranks.tolist(),
                         top_ids, top_lp, self.ks)
        out: list[TokenLogprobs | None] = [None] * num_rows
        for row, entry in zip(self.rows, entries, strict=True):
            out[row] = entry
        return out


def _top_k(logprobs: torch.Tensor, chosen: torch.Tensor, max_k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logprobs [N, V] float32, chosen [N]: the chosen tokens' logprobs [N] and ranks [N] (vLLM's: how
    many tokens are at least as likely), and the top max_k ids and logprobs [N, max_k] (None when max_k
    is 0). On the device, no sync; the rank is one more pass over rows that asked for logprobs."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    chosen_rank = (logprobs >= chosen_lp.unsqueeze(1)).sum(-1)
    if not max_k:
        return chosen_lp, chosen_rank, None, None
    top_lp, top_ids = logprobs.topk(max_k, dim=-1)
    return chosen_lp, chosen_rank, top_ids, top_lp


def _dicts(chosen: list[int], chosen_lp: list[float], chosen_rank: list[int], top_ids: list[list[int]],
           top_lp: list[list[float]], ks: list[int]) -> list[TokenLogprobs]:
    out = []
    for k, tok, lp, rank, ids, lps in zip(ks, chosen, chosen_lp, chosen_rank, top_ids, top_lp, strict=True):
        entry = {tok: Logprob(lp, rank)}  # the chosen token first, as vLLM lists it, with its rank
        entry.update((i, v) for i, v in zip(ids[:k], lps[:k]) if i != tok)
        out.append(entry)
    return out


def _top_k_dicts(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """logprobs [N, V] float32, chosen [N]: for each row, {top-k token: logprob} plus the chosen one."""
    chosen_lp, chosen_rank, top_ids, top_lp = _top_k(logprobs, chosen, max(ks))
    ids = top_ids.tolist() if top_ids is not None else [[] for _ in ks]
    lps = top_lp.tolist() if top_lp is not None else ids
    return _dicts(chosen.tolist(), chosen_lp.tolist(), chosen_rank.tolist(), ids, lps, ks)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     ks: list[int | None]) -> SampledLogprobs | None:
    """The logprobs of the sampled tokens `tokens` [N] and the top-k of each row of logits [N, V] whose
    k is not None, on the device; None when no row asked."""
    rows = [row for row, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    # Pinned and non-blocking: a plain host-to-GPU copy would wait for the step in flight (overlap).
    on_gpu = logits.device.type == "cuda"
    index = torch.tensor(rows, pin_memory=on_gpu).to(logits.device, non_blocking=on_gpu)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = tokens.index_select(0, index)
    row_ks = [ks[row] for row in rows]
    return SampledLogprobs(rows, row_ks, chosen, *_top_k(logprobs, chosen, max(row_ks)))


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
                    indices: list[int], target_ids: list[int], ks: list[int]) -> list[TokenLogprobs] | None:
    """Per position: `indices` into hidden [num_tokens, H], the token it predicts (`target_ids`, the
    next prompt token) and its top-k. Returns, on rank 0, {target: logprob} plus the top-k of each
    position; None on the other ranks. Every rank must call it (compute_logits gathers). The
    positions are taken PROMPT_LOGPROBS_CHUNK at a time, across sequences: one LM-head matmul and one
    copy to the host per chunk, however many short prompts the step holds."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(indices), PROMPT_LOGPROBS_CHUNK):
        end = start + PROMPT_LOGPROBS_CHUNK
        index = torch.tensor(indices[start:end], device=hidden.device)
        logits = compute_logits(hidden.index_select(0, index))
        if logits is None:  # not rank 0
            continue
        targets = torch.tensor(target_ids[start:end], device=logits.device)
        out.extend(_top_k_dicts(torch.log_softmax(logits.float(), dim=-1), targets, ks[start:end]))
    return out if out or not indices else None
