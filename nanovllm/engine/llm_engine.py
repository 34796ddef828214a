"""The engine loop: validates and tokenizes requests, schedules steps, runs them on the model
runner and turns finished sequences into outputs. `add_request`, `step`, `is_finished` and
`generate` are the public loop.

With tensor_parallel_size=N > 1, the engine's own ModelRunner is rank 0 and ranks 1..N-1 run in
worker processes (nanovllm.engine.tp_worker). `shutdown()` (alias `exit()`, or leaving a `with` block)
stops them and frees the model; it also happens when the engine is garbage-collected, at interpreter
exit, and when a step fails under tensor parallelism (a dead worker, Ctrl-C), after which every call
raises RuntimeError."""

import gc
import time
from collections.abc import Sequence as SequenceLike
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.request import make_sequences, request_output
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.engine.tp_worker import TPWorkers
from nanovllm.outputs import RequestOutput, StepOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.gguf_loader import load_gguf_tokenizer

Prompt = str | list[int]
# Seconds between redraws of the progress bar's live prefill/decode throughput.
BAR_REFRESH_S = 0.5


class LLMEngine:
    def __init__(self, model: str, **options) -> None:
        self.config = config = Config.from_options(model, **options)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            if config.tokenizer is None and config.gguf_path is not None:
                self.tokenizer = load_gguf_tokenizer(config.gguf_path)
            else:
                self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        # Ranks 1..N-1 start loading in their own processes while rank 0 loads here.
        self.workers = TPWorkers(config) if config.tensor_parallel_size > 1 else None
        self.model_runner: ModelRunner | None = None
        try:
            with self.workers.scope() if self.workers else nullcontext():
                self.model_runner = ModelRunner(config)
            config.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
            self.eos_token_ids = self._eos_token_ids()
            self.scheduler = Scheduler(config, StopChecker(self.eos_token_ids, config.max_model_len,
                                                           self.tokenizer))
            self.requests: dict[int, list[Sequence]] = {}  # request id -> its n sequences, until done
        except BaseException:
            self.shutdown()  # no worker outlives a failed constructor
            raise

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        # generation_config.json often lists extra end tokens (e.g. a chat model's end-of-turn). A GGUF
        # file carries its end tokens in its own metadata, already in the config; the folder around it
        # may hold another model's generation_config.json, so it is not read.
        if self.config.gguf_path is None:
            try:
                eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
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
        if blocks > config.num_kvcache_blocks:
            raise ValueError(f"the request needs up to {blocks} KV blocks but the whole cache has "
                             f"{config.num_kvcache_blocks}; lower max_tokens, or give the cache more memory "
                             "(gpu_memory_utilization, num_kvcache_blocks, cpu_kvcache_space_gib)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True; "
                             "use stop_token_ids")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, but skip_tokenizer_init=True; use logit_bias "
                             "with -100 for single tokens")

    def _make_request(self, prompt: Prompt, params: SamplingParams | None) -> list[Sequence]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        # Again, now: fields may have been changed since construction, and token ids need the vocabulary.
        params.validate(self.config.hf_config.vocab_size)
        token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        return make_sequences(token_ids, params, self.config.kvcache_block_size, self.eos_token_ids,
                              self.tokenizer)

    def _queue(self, seqs: list[Sequence]) -> int:
        self.requests[seqs[0].seq_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs[0].seq_id

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Bad input raises here and leaves the engine untouched."""
        return self._queue(self._make_request(prompt, sampling_params))

    # ---- lifetime ----
    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the model and its KV cache; any later call raises
        RuntimeError. Idempotent."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.model_runner is not None:
            self.model_runner = None
            gc.collect()  # the layers' weight loaders form reference cycles: free the weights now
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the memory back, e.g. to the next engine in this process

    exit = shutdown  # nano-vllm's name for it

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ---- the loop ----
    def _run_model(self, seqs: list[Sequence], is_prefill: bool) -> StepOutput:
        if self.model_runner is None:
            raise RuntimeError("this LLM is shut down (exit() was called, or a tensor-parallel worker "
                               "failed); create a new one")
        if self.workers is None:
            return self.model_runner.run(seqs, is_prefill)
        try:
            return self.workers.run(self.model_runner, seqs, is_prefill)
        except BaseException:
            self.shutdown()  # the workers are gone already; free rank 0's share as well
            raise

    def step(self) -> tuple[list[tuple[int, RequestOutput]], int]:
        """Run one step. Returns the (request id, output) of requests whose every completion finished,
        and the number of tokens computed: positive for a prefill step, negative for a decode step."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        out = self._run_model(seqs, is_prefill)
        self._record_logprobs(seqs, out)
        finished = self.scheduler.postprocess(seqs, out.token_ids)
        outputs = []
        for seq in finished:
            request_id = (seq.leader or seq).seq_id
            group = self.requests.get(request_id)  # None: a sibling finishing in this step emitted it
            if group is not None and all(s.is_finished for s in group):
                del self.requests[request_id]
                outputs.append((request_id, request_output(group, self.tokenizer)))
        return outputs, num_tokens if is_prefill else -num_tokens

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], out: StepOutput) -> None:
        for row, lps in (out.prompt_logprobs or {}).items():
            seqs[row].prompt_logprobs.extend(lps)
        for seq, token, lps in zip(seqs, out.token_ids, out.logprobs or (), strict=False):
            if token is not None and lps is not None:
                seq.logprobs.append(lps)
                seq.cumulative_logprob += lps[token]

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt; returns one output dict per prompt, in input order (its n
        completions in out["outputs"], the first also at the top level)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise TypeError("prompts must be a string, a list of token ids, or a non-empty list of them")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                                 "pass one for all or one per prompt")
        else:
            sampling_params = [sampling_params] * len(prompts)
        # Validate everything before queueing anything, so a bad prompt leaves no half-added batch.
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        ids = [self._queue(seqs) for seqs in requests]
        outputs = self._run_until_done(set(ids), use_tqdm)
        return [outputs[request_id] for request_id in ids]

    def _run_until_done(self, wanted: set[int], use_tqdm: bool) -> dict[int, RequestOutput]:
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(wanted), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        while not self.is_finished() and len(outputs) < len(wanted):
            start = time.perf_counter()
            finished, num_tokens = self.step()
            elapsed = time.perf_counter() - start
            if num_tokens > 0:
                prefill_rate = num_tokens / elapsed
            else:
                decode_rate = -num_tokens / elapsed
            if use_tqdm:
                # Redrawn at most every BAR_REFRESH_S: a redraw per step would cost more than a decode step.
                bar.set_postfix({"Prefill": f"{prefill_rate:.0f}tok/s", "Decode": f"{decode_rate:.0f}tok/s"},
                                refresh=time.perf_counter() - bar.last_print_t > BAR_REFRESH_S)
            for seq_id, output in finished:
                if seq_id in wanted:
                    outputs[seq_id] = output
                    bar.update(1)
        bar.close()
        return outputs
