"""Per-request logits processors, applied on the device to the logits of the rows being sampled, in
vLLM's order: allowed_token_ids, bad_words, min_tokens (EOS and stop ids masked), logit_bias, then the
penalties (repetition, frequency, presence). Nothing is built or run unless some row of the batch asks
for it; the penalties' token counts are scattered into a [batch, vocab] tensor on the device from the
rows' token ids, copied once per step (no per-token host round trip).

vLLM's penalty semantics, per row, with `seen` = tokens of the prompt or of the output so far and
`count` = occurrences in the output so far:
    logit = logit / repetition_penalty if logit > 0 else logit * repetition_penalty   (where seen)
    logit -= frequency_penalty * count + presence_penalty * (count > 0)
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogitsProcessorTensors:
    """What one batch's processors need; each part is None when no row uses it."""

    allowed: torch.Tensor | None = None  # [B, V] bool, True = may be sampled
    masked: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, bias)
    # Penalties: [B] factors, the prompt's token ids and the output's, both [B, L] padded with V.
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """New float32 logits [B, V] with every processor applied (the input is left untouched)."""
        logits = logits.float().clone()
        if self.allowed is not None:
            logits.masked_fill_(~self.allowed, float("-inf"))
        if self.masked is not None:
            logits[self.masked] = float("-inf")
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.repetition is not None:
            logits = _apply_penalties(logits, self)
        return logits


def _scatter_ids(ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] token ids padded with vocab_size -> [B, V] counts (or presence for torch.bool)."""
    out = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    out.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return out[:, :vocab_size].to(dtype)


def _apply_penalties(logits: torch.Tensor, t: LogitsProcessorTensors) -> torch.Tensor:
    vocab = logits.shape[1]
    counts = _scatter_ids(t.output_ids, vocab, torch.float32)  # [B, V]
    seen = (_scatter_ids(t.prompt_ids, vocab, torch.int32) > 0) | (counts > 0)
    rep = t.repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency.unsqueeze(1) * counts - t.presence.unsqueeze(1) * (counts > 0).float()


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64).to(device)


def _banned_tokens(seq) -> list[int]:
    """Tokens a row may not sample now: min_tokens' stop ids, and bad words whose other tokens end
    the output so far (a one-token bad word is always banned)."""
    banned = []
    params = seq.sampling_params
    if seq.num_completion_tokens < params.min_tokens:
        banned.extend(seq.min_tokens_stop_ids)
    output = seq.completion_token_ids if seq.bad_words_token_ids else []
    for word in seq.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def prepare_logits_processors(seqs: list, vocab_size: int,
                              device: torch.device) -> LogitsProcessorTensors | None:
    """Build the batch's processor tensors from the sampled rows' Sequences; None when no row needs any."""
    if not any(seq.uses_logits_processors for seq in seqs):
        return None
    params = [seq.sampling_params for seq in seqs]
    t, used = LogitsProcessorTensors(), False
    if any(p.allowed_token_ids is not None for p in params):
        ids = [p.allowed_token_ids or [] for p in params]
        allowed = _scatter_ids(_padded(ids, vocab_size, device), vocab_size, torch.bool)
        unrestricted = torch.tensor([p.allowed_token_ids is None for p in params], device=device)
        t.allowed, used = allowed | unrestricted.unsqueeze(1), True
    pairs = [(row, tok) for row, seq in enumerate(seqs) for tok in _banned_tokens(seq)]
    if pairs:
        rows, ids = zip(*pairs)
        t.masked = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
        used = True
    triples = [(row, tok, b) for row, p in enumerate(params) for tok, b in (p.logit_bias or {}).items()]
    if triples:
        rows, ids, values = zip(*triples)
        t.bias = (torch.tensor(rows, device=device), torch.tensor(ids, device=device),
                  torch.tensor(values, dtype=torch.float32, device=device))
        used = True
    if any(p.uses_penalties for p in params):
        def factors(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
        t.repetition, t.frequency, t.presence = (factors("repetition_penalty"), factors("frequency_penalty"),
                                                 factors("presence_penalty"))
        # Only rows with penalties contribute ids: the others' factors are neutral anyway.
        t.prompt_ids = _padded([seq.token_ids[:seq.num_prompt_tokens] if p.uses_penalties else []
                                for seq, p in zip(seqs, params)], vocab_size, device)
        t.output_ids = _padded([seq.completion_token_ids if p.uses_penalties else []
                                for seq, p in zip(seqs, params)], vocab_size, device)
        used = True
    return t if used else None
