"""The engine: validates and tokenizes requests, schedules steps, runs each on the model runner (and
the tensor-parallel workers) and turns finished sequences into outputs. `add_request`, `step` and
`is_finished` are the loop; nanovllm.llm.LLM drives it for `generate`.

With tensor_parallel_size=N > 1, the engine's own ModelRunner is rank 0 and ranks 1..N-1 run in
worker processes (nanovllm.distributed.worker). `shutdown()` stops them and frees the model; it also
happens when a step fails under tensor parallelism (a dead worker, Ctrl-C), after which every call
raises RuntimeError."""

from collections.abc import Sequence as SequenceLike
from contextlib import nullcontext
from dataclasses import dataclass

from transformers import GenerationConfig

from nanovllm.config import Config
from nanovllm.distributed.worker import TPWorkers
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.outputs import RequestOutput
from nanovllm.runner.batch import build_batch
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.hf_options import HF_LOCAL_ONLY
from nanovllm.utils.log import ensure_default_handler, logger, startup_line
from nanovllm.utils.tokenizer import load_engine_tokenizer

Prompt = str | list[int]


@dataclass(slots=True)
class StepResult:
    outputs: list[tuple[int, RequestOutput]]  # (request id, output) of the requests that finished
    num_prefill_tokens: int  # prompt tokens computed in the step
    num_decode_tokens: int  # tokens decoded in the step


class LLMEngine:
    def __init__(self, model: str, **options) -> None:
        self.config = config = Config.from_options(model, **options)
        if config.data_parallel_size != 1:
            raise ValueError(f"an LLMEngine is one engine, but data_parallel_size="
                             f"{config.data_parallel_size}; create LLM(..., data_parallel_size=N) for N "
                             "replicas (nanovllm.dp)")
        self.tokenizer = load_engine_tokenizer(config)
        # Ranks 1..N-1 start loading in their own processes while rank 0 loads here.
        self.workers = TPWorkers(config) if config.tensor_parallel_size > 1 else None
        self.model_runner: ModelRunner | None = None
        try:
            with self.workers.scope() if self.workers else nullcontext():
                self.model_runner = ModelRunner(config)
            # What the memory allowed; the option (config.num_kvcache_blocks) stays what the user asked.
            self.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
            stop_checker = StopChecker(self._eos_token_ids(), config.max_model_len, self.tokenizer)
            self.scheduler = Scheduler(config, self.num_kvcache_blocks, stop_checker)
        except BaseException:
            self.shutdown()  # no worker outlives a failed constructor
            raise
        ensure_default_handler()
        runner = self.model_runner
        threads = runner.cpu_threads.num_threads if runner.cpu_threads is not None else None
        logger.info(startup_line(config, runner.device, runner.dtype, runner.backend.name, threads,
                                 self.num_kvcache_blocks))

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        # generation_config.json often lists extra end tokens (e.g. a chat model's end-of-turn). A GGUF
        # file carries its end tokens in its own metadata, already in the config; the folder around it
        # may hold another model's generation_config.json, so it is not read.
        if self.config.gguf_path is None:
            try:
                eos = GenerationConfig.from_pretrained(self.config.model, **HF_LOCAL_ONLY).eos_token_id
                ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
            except OSError:
                pass
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- requests ----
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer, but skip_tokenizer_init=True; "
                                 "pass token ids instead")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, SequenceLike) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return token_ids

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        config = self.config
        total = len(token_ids) + params.max_tokens
        if total > config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: "
                             f"{total} exceeds max_model_len {config.max_model_len}; shorten the prompt, "
                             "lower max_tokens or raise max_model_len")
        blocks = -(-total // config.kvcache_block_size)
        if blocks > self.num_kvcache_blocks:
            raise ValueError(f"the request needs up to {blocks} KV blocks but the whole cache has "
                             f"{self.num_kvcache_blocks}; lower max_tokens, or give the cache more memory "
                             "(gpu_memory_utilization, num_kvcache_blocks, cpu_kvcache_space_gib)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True; "
                             "use stop_token_ids")

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None) -> Sequence:
        """Validate and tokenize one request without queueing it; bad input raises here."""
        self._check_running()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        return Sequence(token_ids, params, self.config.kvcache_block_size)

    def add_sequence(self, seq: Sequence) -> int:
        self.scheduler.add(seq)
        return seq.seq_id

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Bad input raises here and leaves the engine untouched."""
        return self.add_sequence(self.make_sequence(prompt, sampling_params))

    # ---- lifetime ----
    def _check_running(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this LLM is shut down (exit() was called, or a tensor-parallel worker "
                               "failed); create a new one")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the model and its KV cache; any later call raises
        RuntimeError. Idempotent."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.model_runner is not None:
            runner, self.model_runner = self.model_runner, None
            runner.release()

    # ---- the loop ----
    def _run_model(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        """The sampled token of each sequence (None for those that only computed part of their prompt)."""
        self._check_running()
        batch = build_batch(seqs, is_prefill)
        if self.workers is None:
            tokens = self.model_runner.run(batch)
        else:
            try:
                tokens = self.workers.run(self.model_runner, batch)
            except BaseException:
                self.shutdown()  # the workers are gone already; free rank 0's share as well
                raise
        token_ids: list[int | None] = [None] * len(seqs)
        for row, token in zip(batch.sample_rows, tokens, strict=True):
            token_ids[row] = token
        return token_ids

    def run_step(self) -> StepResult:
        """Schedule and run one step; returns what finished and how many tokens were computed."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        finished = self.scheduler.postprocess(seqs, self._run_model(seqs, is_prefill))
        outputs = [(seq.seq_id, self._output(seq)) for seq in finished]
        return StepResult(outputs, num_tokens if is_prefill else 0, 0 if is_prefill else num_tokens)

    def step(self) -> tuple[list[tuple[int, RequestOutput]], int]:
        """Run one step (nano-vllm's shape). Returns the (request id, output) of requests that finished,
        and the number of tokens computed: positive for a prefill step, negative for a decode step."""
        result = self.run_step()
        return result.outputs, result.num_prefill_tokens or -result.num_decode_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def prompt_logits(self, token_ids: list[int]):
        """The model's next-token logits after a whole prompt ([vocab] tensor), from one prefill through
        this engine's own runner (prefix cache included) on blocks lent by the block manager and given
        back: for checks against a reference implementation. Single-rank engines only."""
        self._check_running()
        if self.workers is not None:
            raise ValueError("prompt_logits runs on single-rank engines only (tensor_parallel_size=1)")
        seq = Sequence(self._tokenize(token_ids), block_size=self.config.kvcache_block_size)
        block_manager = self.scheduler.block_manager
        block_manager.allocate(seq)
        try:
            seq.num_scheduled_tokens = seq.num_uncomputed_tokens
            return self.model_runner.logits(build_batch([seq], is_prefill=True))[0]
        finally:
            block_manager.deallocate(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.stop_text
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode(seq.completion_token_ids,
                                                                          skip_special_tokens=True)
        return RequestOutput(text=text, token_ids=seq.completion_token_ids, finish_reason=seq.finish_reason,
                             prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                             num_cached_tokens=seq.num_cached_tokens)
