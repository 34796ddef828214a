"""Per-request logits processors, applied on the device to the logits of the rows being sampled, in
vLLM's order: the structured output's grammar bitmask (xgrammar's kernel, on the rows with a grammar
only), allowed_token_ids, bad_words, min_tokens (EOS and stop ids masked), logit_bias, then the
penalties (repetition, frequency, presence). Nothing is built or run unless some row of the batch asks
for it (nanovllm.runner.inputs builds the tensors from the step's SamplingBatch); the penalties' token
counts are scattered into a [batch, vocab] tensor on the device from the rows' token ids, copied once
per step (no per-token host round trip).

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

    # Structured outputs: int32 [G, ceil(V / 32)] bits, 1 = allowed, for the G rows bitmask_rows [G]
    # (None: every row has a grammar).
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
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
        if self.bitmask is not None:
            from xgrammar import apply_token_bitmask_inplace  # only structured output rows get here

            if self.bitmask_rows is None:
                apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[1])
            else:  # the grammar rows apart, masked, and back (the other rows stay bit for bit)
                rows = logits[self.bitmask_rows]
                apply_token_bitmask_inplace(rows, self.bitmask, vocab_size=logits.shape[1])
                logits[self.bitmask_rows] = rows
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


def padded_ids(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Token id lists -> [B, L] int64, padded with `pad` (the vocabulary size: scatter_ids drops it)."""
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64).to(device)


def scatter_ids(ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] token ids padded with vocab_size -> [B, V] counts (or presence for torch.bool)."""
    out = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    out.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return out[:, :vocab_size].to(dtype)


def _apply_penalties(logits: torch.Tensor, t: LogitsProcessorTensors) -> torch.Tensor:
    vocab = logits.shape[1]
    counts = scatter_ids(t.output_ids, vocab, torch.float32)  # [B, V]
    seen = (scatter_ids(t.prompt_ids, vocab, torch.int32) > 0) | (counts > 0)
    rep = t.repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency.unsqueeze(1) * counts - t.presence.unsqueeze(1) * (counts > 0).float()
