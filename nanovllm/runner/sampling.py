"""The end of a step on rank 0: the logits processors, the sampler and the logprobs the sequences
asked for, from the step's SamplingBatch; and the prompt logprobs, which every rank computes (the LM
head gathers across ranks)."""

from collections.abc import Callable

import torch

from nanovllm.engine.step import SEED_MASK, ProcessorRow, PromptLogprobSpan, SamplingBatch, StepOutput
from nanovllm.layers.logprobs import SampledLogprobs, prompt_logprobs, sampled_logprobs
from nanovllm.layers.sampler import SPLIT_ARGMAX_ROWS, Sampler, SamplingTensors
from nanovllm.outputs import TokenLogprobs
from nanovllm.runner.grammar_bitmask import GrammarBitmask
from nanovllm.runner.inputs import Put, logits_processor_tensors, race_seeds, sampling_tensors
from nanovllm.runner.transfers import PendingOutput
from nanovllm.sampling_params import MAX_LOGPROBS

# Row counts that each select another compiled variant of the sampler: one row (torch.compile
# specializes it), a few rows (whose argmax reduces chunks first), SPLIT_ARGMAX_ROWS or more.
WARM_ROWS = (1, 2, SPLIT_ARGMAX_ROWS)


def worst_case_sampling(num_rows: int) -> SamplingBatch:
    """Sampling rows that use every option that costs memory, for the warm-up's peak."""
    processors = ProcessorRow(allowed_token_ids=[0, 1], banned_token_ids=[2], logit_bias={0: 1.0},
                              penalties=(1.1, 0.1, 0.0), prompt_token_ids=[0, 1], output_token_ids=[1])
    return SamplingBatch([1.0] * num_rows, [50] * num_rows, [0.9] * num_rows, [0.01] * num_rows,
                         [None] * num_rows, [MAX_LOGPROBS] * num_rows, [processors] * num_rows)


class StepSampler:
    def __init__(self, vocab_size: int, device: torch.device, compiled: bool) -> None:
        """On CUDA the race is the fused Triton kernel (layers/sampler.py), whose noise seeds each step
        draws from torch's CPU generator (step_noise_seed)."""
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(compiled=compiled, fused_race=device.type == "cuda")
        self.grammar_bitmask = GrammarBitmask(vocab_size, device)

    def tensors(self, sampling: SamplingBatch, put: Put | None = None) -> SamplingTensors:
        """The rows' parameters on the device, each list through put (runner/transfers.Uploads.put: one
        copy for the step) or, without one, a copy of its own."""
        noise_seed = step_noise_seed() if self.sampler.fused_race else None
        return sampling_tensors(sampling, self.vocab_size, self.device, noise_seed, put)

    def graph_race(self) -> Callable[..., torch.Tensor] | None:
        """The race a decode graph may capture (kernels/sample_race.race): the fused one, where it is used."""
        if not self.sampler.fused_race:
            return None
        from nanovllm.kernels.sample_race import race  # Triton: imported only where it runs
        return race

    def race_rows(self, sampling: SamplingBatch) -> tuple[list[float], list[int]] | None:
        """(temperatures, Philox seeds) of the rows for a decode graph's own race, where the rows ask for
        nothing else (no top-k, top-p, min-p, logprobs or processors) and the race is the fused one: the
        tokens `sample` would give. None otherwise, drawing nothing from torch's generator then."""
        if not self.sampler.fused_race or sampling.processors is not None:
            return None
        vocab = self.vocab_size
        if (any(k is not None for k in sampling.num_logprobs) or any(0 < k < vocab for k in sampling.top_ks)
                or any(p < 1.0 for p in sampling.top_ps) or any(p > 0.0 for p in sampling.min_ps)):
            return None
        # Drawn for every step, greedy ones too, as `tensors` does: the same seeds either way.
        return sampling.temperatures, race_seeds(sampling.seeds, step_noise_seed())

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch, params: SamplingTensors | None = None
               ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """Sample each row of logits [rows, vocab] with its parameters (params: `tensors(sampling)`, made
        here when not given), processors and logprobs; the tokens [rows] and logprobs stay on the device
        (no sync)."""
        raw = logits
        processors = logits_processor_tensors(sampling.processors, self.vocab_size, self.device,
                                              self.grammar_bitmask)
        if processors is not None:
            logits = processors.apply(logits)
        tokens = self.sampler(logits, params if params is not None else self.tensors(sampling))
        ks = sampling.num_logprobs
        # Raw-model logprobs (vLLM's default logprobs_mode), only when some row asked.
        asked = any(k is not None for k in ks)
        return tokens, sampled_logprobs(raw, tokens, ks) if asked else None

    def __call__(self, logits: torch.Tensor, sampling: SamplingBatch) -> StepOutput:
        """`sample`, read on the host."""
        return PendingOutput(*self.sample(logits, sampling), prompt_logprobs=None).wait()

    def warm_up(self, logits: torch.Tensor) -> None:
        """Compile the plain-temperature sampler (torch.compile's or the fused race's) for every row
        count of WARM_ROWS now, and the fused race's other variants (min-p, top-k's float32 logits),
        from logits of at least max(WARM_ROWS) rows, so no step of a run stops to compile it (seconds
        on a cold cache, while the whole batch waits)."""
        for rows in WARM_ROWS:
            plain = SamplingBatch([0.5] * rows, [-1] * rows, [1.0] * rows, [0.0] * rows, [None] * rows,
                                  [None] * rows)
            self.sample(logits[:rows], plain)
        if self.sampler.fused_race:
            # Its variants by logits dtype (top-k and top-p hand it float32) and min-p floor, which no
            # row count specializes, and its greedy one: one row each.
            for top_k, min_p in ((-1, 0.05), (40, 0.0), (40, 0.05)):
                self.sample(logits[:1], SamplingBatch([0.5], [top_k], [1.0], [min_p], [None], [None]))
            self.sample(logits[:1], SamplingBatch([0.0], [-1], [1.0], [0.0], [None], [None]))

    def check(self, sampling: SamplingBatch) -> None:
        """Build the sampler's and the processors' inputs on the CPU, raising what a step would raise
        for them: under tensor parallelism the engine checks them before a step is sent."""
        cpu = torch.device("cpu")
        sampling_tensors(sampling, self.vocab_size, cpu)
        logits_processor_tensors(sampling.processors, self.vocab_size, cpu)


def step_noise_seed() -> int:
    """A fresh seed for one step's unseeded rows, from torch's CPU generator (no device sync): like the
    PyTorch race's noise, it follows torch.manual_seed, which LLM(seed=...) and each data-parallel
    replica (its own seed + index, after the engine is built) set."""
    return int(torch.randint(SEED_MASK, (), dtype=torch.int64))


def prompt_logprobs_by_row(compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                           hidden: torch.Tensor, spans: list[PromptLogprobSpan]
                           ) -> dict[int, list[TokenLogprobs]] | None:
    """Batch row -> the logprobs of the prompt tokens its span covers, on rank 0 (None on the others).
    hidden: [num_tokens, hidden] of the whole step."""
    indices = [span.start + i for span in spans for i in range(len(span.target_ids))]
    targets = [t for span in spans for t in span.target_ids]
    ks = [span.num_logprobs for span in spans for _ in span.target_ids]
    flat = prompt_logprobs(compute_logits, hidden, indices, targets, ks)
    if flat is None:
        return None
    out, start = {}, 0
    for span in spans:
        out[span.row] = flat[start:start + len(span.target_ids)]
        start += len(span.target_ids)
    return out
