"""The structured-output rows' token bitmask, one per runner: each step the rows' matchers (xgrammar,
nanovllm.engine.structured_outputs) fill their allowed tokens on the host, and the bits go to the
device for the sampler to apply (layers/logits_processors.py). Only the grammar rows are filled and
copied: int32 [grammar rows, ceil(vocab / 32)], 1 = allowed.

On CUDA the host side is a pinned buffer kept across steps (pinning 5 MB afresh each step cost ~3 ms of
host time at 256 rows on an H200 host), copied without blocking the host; before the next fill writes
over it, the previous copy is waited for (it is long done by then). Many rows are filled on xgrammar's
threads. Measured with scripts/bench_structured.py (BENCHMARKS.md, "Structured outputs")."""

import torch

# From this many grammar rows on, xgrammar's batch fill (its own threads) beats a Python loop over the
# matchers: 128 rows filled in 0.85 ms instead of 2.4 ms on the H200's host.
BATCH_FILL_MIN_ROWS = 16


class GrammarBitmask:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._host: torch.Tensor | None = None  # pinned, CUDA only
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host
        self._batch = None  # xgrammar.BatchGrammarMatcher, made at the first batch fill

    def fill(self, matchers: list) -> torch.Tensor:
        """The allowed tokens of each matcher's next position, row i for matchers[i], on the device."""
        import xgrammar  # only a structured output request gets here, and its compile checked it is there

        rows = len(matchers)
        if self.device.type != "cuda":
            host = xgrammar.allocate_token_bitmask(rows, self.vocab_size)
        else:
            if self._host is None or self._host.shape[0] < rows:
                words = (self.vocab_size + 31) // 32
                self._host = torch.empty(max(rows, 64), words, dtype=torch.int32, pin_memory=True)
            elif self._copied is not None:
                self._copied.synchronize()
            host = self._host[:rows]
        # A terminated matcher has no next token: its sequence finished on the previous step's token,
        # after this step was launched (overlap scheduling), and this step's token for it is dropped.
        # Other rows than matchers (a verified position's DraftedGrammar) fill theirs themselves.
        live = [i for i, matcher in enumerate(matchers)
                if isinstance(matcher, xgrammar.GrammarMatcher) and not matcher.is_terminated()]
        drafted = [i for i, matcher in enumerate(matchers)
                   if not isinstance(matcher, xgrammar.GrammarMatcher)]
        if len(live) + len(drafted) < rows:
            host.fill_(-1)
        if len(live) >= BATCH_FILL_MIN_ROWS and self.device.type == "cuda":
            if self._batch is None:
                self._batch = xgrammar.BatchGrammarMatcher(max_threads="auto")
            self._batch.batch_fill_next_token_bitmask([matchers[i] for i in live], host, live)
        else:
            for i in live:
                matchers[i].fill_next_token_bitmask(host, i)
        for i in drafted:  # after the plain rows: each takes its sequence's matcher through drafts and back
            matchers[i].fill_next_token_bitmask(host, i)
        if self.device.type != "cuda":
            return host.to(self.device)
        out = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out
