"""Logprobs on the device: the sampled token's logprob plus the top-k of each sampled row, and the
prompt logprobs of a prefill chunk, computed a bounded number of positions at a time.

Like vLLM v1's default (logprobs_mode="raw_logprobs"), they are log_softmax of the model's raw logits,
before logits processors, penalties, temperature and top-k/top-p. Only rows that asked are computed,
and the results reach the host in one copy per step."""

from collections.abc import Callable

import torch

# Prompt logprobs turn hidden states into full-vocabulary logits this many positions at a time, so a
# long prompt never holds a [prompt_len, vocab] float32 tensor (256 x 152k vocab x 4 B = 156 MB).
PROMPT_LOGPROBS_CHUNK = 256

TokenLogprobs = dict[int, float]  # token id -> logprob: the top-k, and the chosen token's own


def _top_k_dicts(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """logprobs [N, V] float32, chosen [N]: for each row, {top-k token: logprob} plus the chosen one."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    max_k = max(ks)
    if max_k:
        top_lp, top_ids = logprobs.topk(max_k, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp = top_ids = [[] for _ in ks]
    out = []
    for k, tok, lp, ids, lps in zip(ks, chosen.tolist(), chosen_lp.tolist(), top_ids, top_lp, strict=True):
        entry = {tok: lp}  # the chosen token first, as vLLM lists it
        entry.update((i, v) for i, v in zip(ids[:k], lps[:k]) if i != tok)
        out.append(entry)
    return out


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     ks: list[int | None]) -> list[TokenLogprobs | None]:
    """Per sampled row: {token: logprob} of its sampled token and top-k, or None where k is None."""
    rows = [row for row, k in enumerate(ks) if k is not None]
    if not rows:
        return [None] * len(ks)
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    dicts = _top_k_dicts(logprobs, tokens.index_select(0, index), [ks[row] for row in rows])
    out: list[TokenLogprobs | None] = [None] * len(ks)
    for row, entry in zip(rows, dicts, strict=True):
        out[row] = entry
    return out


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
