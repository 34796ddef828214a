"""`DataParallelEngine`: the engine behind `LLM(model, data_parallel_size=N, ...)` when N > 1. The
same API as one LLMEngine (generate, shutdown/exit, `with`, tokenizer, config), over N replicas;
nanovllm.llm.DataParallelLLM adds LLM's chat on top.

Everything is checked here, in the caller's process, before any work leaves it: the options once
(Config) before a replica is spawned, and every prompt of a `generate` call (tokenized here, checked
against the smallest replica's KV cache) before any replica gets a request, so a bad prompt raises
ValueError/TypeError and leaves the replicas untouched.

The engine loop (`add_request`, `step`, `is_finished`) drives one engine in the caller's process; a
DataParallelEngine has N engines running their own loops in their own processes, so those methods
raise NotImplementedError pointing to `generate`."""

from nanovllm.config import Config
from nanovllm.dp.coordinator import DPCoordinator
from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import eos_token_ids
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import load_engine_tokenizer


class DataParallelEngine(LLMEngine):
    def __init__(self, model: str, **options) -> None:  # LLMEngine's builds one engine here: not called
        self.config = config = Config.from_options(model, **options)
        self.tokenizer = load_engine_tokenizer(config)
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)  # make_request stops sequences on them
        self.coordinator = DPCoordinator(config.model, options, config)
        # Requests are checked against the smallest replica's cache.
        self.num_kvcache_blocks = self.coordinator.num_kvcache_blocks

    def _check_running(self) -> None:
        self.coordinator.check_running()

    def generate_requests(self, requests: list[list[Sequence]], use_tqdm: bool) -> list[RequestOutput]:
        """Generate for validated requests (make_request's sequences) on the replicas; returns one
        output dict each, in order. The requests are split between the replicas by tokens (prompt +
        max_tokens); a replica runs a request's n completions itself."""
        prompts = [(first.token_ids[:first.num_prompt_tokens], first.sampling_params)
                   for first, *_ in requests]
        return self.coordinator.generate(prompts, use_tqdm)

    def shutdown(self) -> None:
        """Stop every replica (each shuts its own engine down); any later call raises RuntimeError.
        Idempotent."""
        self.coordinator.shutdown()

    exit = shutdown

    def _single_engine_only(self, name: str) -> NotImplementedError:
        return NotImplementedError(
            f"{name}() drives one engine in this process, but with data_parallel_size="
            f"{self.config.data_parallel_size} each replica runs its own loop in its own process; use "
            "generate() or chat(), or an LLM with data_parallel_size=1")

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        raise self._single_engine_only("add_request")

    def step(self) -> tuple[list[tuple[int, dict]], int]:
        raise self._single_engine_only("step")

    def is_finished(self) -> bool:
        raise self._single_engine_only("is_finished")
