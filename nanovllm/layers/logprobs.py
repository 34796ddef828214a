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
                    spans: list[tuple[int, int, int, int]], seqs: list) -> dict[int, list[TokenLogprobs]]:
    """spans: (row, flat index of position lo in hidden, lo, hi) per sequence that wants prompt
    logprobs this step; position q's logits give the logprobs of prompt token q + 1. Returns, on rank 0,
    row -> logprobs of prompt tokens lo+1 .. hi; every rank must call it (compute_logits gathers)."""
    out: dict[int, list[TokenLogprobs]] = {}
    for row, flat, lo, hi in spans:
        for start in range(lo, hi, PROMPT_LOGPROBS_CHUNK):
            end = min(start + PROMPT_LOGPROBS_CHUNK, hi)
            logits = compute_logits(hidden[flat + start - lo:flat + end - lo])
            if logits is None:  # not rank 0
                continue
            seq = seqs[row]
            targets = torch.tensor(seq.token_ids[start + 1:end + 1], device=logits.device)
            k = seq.sampling_params.prompt_logprobs
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.setdefault(row, []).extend(_top_k_dicts(logprobs, targets, [k] * (end - start)))
    return out
