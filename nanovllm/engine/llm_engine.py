"""The engine loop: validates and tokenizes requests, schedules steps, runs them on the model
runner and turns finished sequences into outputs. `add_request`, `step`, `is_finished` and
`generate` are the public loop; `abort_request` retires a request early.

Threads: one engine may be driven from several threads at once (generate, stream, add_request, step,
abort_request): an engine lock serializes the steps, and each caller gets exactly its own requests'
outputs, whichever thread ran the step that finished them (see request_tracker.py). A generate or
stream call that is left by an exception or Ctrl-C aborts its unfinished requests and frees their
KV blocks. A request whose step fails (say, sampling parameters changed after it was added) is
finished alone with finish_reason "error" and the exception's text in its output's "error"; the
others keep running (under tensor parallelism: failures of rank 0's sampling inputs; a failure
inside the forward shuts the worker group down, see _run_isolating_failures).

With tensor_parallel_size=N > 1, the engine's own ModelRunner is rank 0 and ranks 1..N-1 run in
worker processes (nanovllm.engine.tp_worker). `shutdown()` (alias `exit()`, or leaving a `with` block)
stops them and frees the model; it also happens when the engine is garbage-collected, at interpreter
exit, and when a step fails under tensor parallelism (a dead worker, Ctrl-C), after which every call
raises RuntimeError."""

import gc
import logging
import threading
import time
from collections.abc import Sequence as SequenceLike
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.model_inputs import prepare_sampling
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.request_tracker import RequestTracker
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.engine.tp_worker import TPWorkers
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.gguf_loader import load_gguf_tokenizer

Prompt = str | list[int]
logger = logging.getLogger(__name__)

# Seconds between redraws of the progress bar's live prefill/decode throughput.
BAR_REFRESH_S = 0.5


class LLMEngine:
    def __init__(self, model: str, **options) -> None:
        self.config = config = Config.from_options(model, **options)
        # Re-entrant: generate's loop calls step-level helpers that take it again.
        self._lock = threading.RLock()
        self.requests = RequestTracker()
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
            self.scheduler = Scheduler(config, StopChecker(self._eos_token_ids(), config.max_model_len,
                                                           self.tokenizer))
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

    def _make_sequence(self, prompt: Prompt, params: SamplingParams | None) -> Sequence:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        return Sequence(token_ids, params, self.config.kvcache_block_size)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Bad input raises here and leaves the engine untouched.
        Its output comes back from the `step()` call that finishes it, or a later one."""
        seq = self._make_sequence(prompt, sampling_params)
        with self._lock:
            self._queue(seq, tracked=False)
        return seq.seq_id

    def make_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Sequence:
        """Validate and tokenize a request without queueing it (bad input raises here)."""
        return self._make_sequence(prompt, sampling_params)

    def start_request(self, seq: Sequence) -> None:
        """Queue a request from `make_request` whose progress the caller follows itself: its tokens
        appear in `seq.completion_token_ids` as steps run, and its output is collected once with
        `take_output(seq.seq_id)`; `step()` never returns it."""
        with self._lock:
            self._queue(seq, tracked=True)

    def take_output(self, request_id: int) -> dict | None:
        """The output of a finished `start_request` request (once), or None while it runs."""
        with self._lock:
            return self.requests.take(request_id)

    def _queue(self, seq: Sequence, tracked: bool) -> None:
        self.requests.add(seq, tracked)
        self.scheduler.add(seq)

    def abort_request(self, request_id: int) -> bool:
        """Stop a request and free its KV blocks at once, whatever its state (waiting, prefilling,
        decoding, preempted). Returns True if it was live; an unknown or already finished id is
        a no-op that returns False, since a request may finish just before its abort arrives. An
        aborted `add_request` request is not returned by `step()`; a tracked one ends with
        finish_reason "abort"."""
        with self._lock:
            seq = self.requests.live.get(request_id)
            if seq is None:
                return False
            self._finish_early(seq, "abort")
            return True

    def _finish_early(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.finish_early(seq, reason)
        output = self._output(seq)
        if error is not None:
            output["error"] = error
        self.requests.finish(seq.seq_id, output, report=reason != "abort")

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
    def _run_model(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
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

    def step(self) -> tuple[list[tuple[int, dict]], int]:
        """Run one step. Returns the (request id, output) of `add_request` requests that finished
        (in this step, or in steps that generate/stream calls ran since the last `step()`), and the
        number of tokens computed: positive for a prefill step, negative for a decode step, 0 when
        nothing was left to run."""
        with self._lock:
            num_tokens = self._step()
            return self.requests.drain_unreturned(), num_tokens

    def is_finished(self) -> bool:
        """True when nothing is queued and `step()` has returned every `add_request` output."""
        with self._lock:
            return self.scheduler.is_finished() and not self.requests.unreturned

    def _step(self) -> int:
        """One step under the lock; each finished output goes to the request tracker."""
        if self.scheduler.is_finished():
            return 0
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        token_ids, failures = self._run_isolating_failures(seqs, is_prefill)
        if failures:
            failed = [seq for seq in seqs if seq.seq_id in failures]
            ok = [i for i, seq in enumerate(seqs) if seq.seq_id not in failures]
            seqs, token_ids = [seqs[i] for i in ok], [token_ids[i] for i in ok]
            for seq in failed:
                self._finish_early(seq, "error", failures[seq.seq_id])
        finished = self.scheduler.postprocess(seqs, token_ids)
        for seq in finished:
            self.requests.finish(seq.seq_id, self._output(seq))
        return num_tokens if is_prefill else -num_tokens

    def _run_isolating_failures(self, seqs: list[Sequence], is_prefill: bool
                                ) -> tuple[list[int | None], dict[int, str]]:
        """Run the step so that a request that fails is failed alone. Returns the sampled tokens
        (None for the failed) and {seq_id: error text} of the sequences that failed.
        At TP=1, a failed step is re-run one sequence at a time to find the one(s) at fault;
        re-running is safe: a step changes no sequence, and rewrites the same KV slots.
        Under tensor parallelism a failed step shuts the worker group down (ranks may be stuck in
        a collective), so what can fail on rank 0 alone, turning sampling parameters into tensors,
        is tried on the CPU before the step is sent; a failure inside the forward still raises."""
        failures = self._check_sampling_inputs(seqs) if self.workers is not None else {}
        runnable = [seq for seq in seqs if seq.seq_id not in failures] if failures else seqs
        try:
            token_ids = self._run_model(runnable, is_prefill) if runnable else []
        except Exception:
            if self.workers is not None or self.model_runner is None:
                raise
            logger.exception("a step of %d sequences failed; retrying each alone", len(runnable))
            token_ids = []
            for seq in runnable:
                try:
                    token_ids += self._run_model([seq], is_prefill)
                except Exception as e:
                    token_ids.append(None)
                    failures[seq.seq_id] = f"{type(e).__name__}: {e}"
        if runnable is seqs:
            return token_ids, failures
        by_id = dict(zip((seq.seq_id for seq in runnable), token_ids))
        return [by_id.get(seq.seq_id) for seq in seqs], failures

    def _check_sampling_inputs(self, seqs: list[Sequence]) -> dict[int, str]:
        vocab, cpu = self.config.hf_config.vocab_size, torch.device("cpu")
        try:
            prepare_sampling(seqs, vocab, cpu)
            return {}
        except Exception:
            pass
        failures = {}
        for seq in seqs:
            try:
                prepare_sampling([seq], vocab, cpu)
            except Exception as e:
                failures[seq.seq_id] = f"{type(e).__name__}: {e}"
        return failures

    def _output(self, seq: Sequence) -> dict:
        text = seq.stop_text
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode(seq.completion_token_ids,
                                                                          skip_special_tokens=True)
        return {"text": text, "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason,
                "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
                "num_cached_tokens": seq.num_cached_tokens}

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for each prompt; returns one output dict per prompt, in input order."""
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
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        with self._lock:
            for seq in seqs:
                self._queue(seq, tracked=True)
        outputs = self._run_until_done(seqs, use_tqdm)
        return [outputs[seq.seq_id] for seq in seqs]

    def _run_until_done(self, seqs: list[Sequence], use_tqdm: bool) -> dict[int, dict]:
        """Step until every one of seqs (tracked requests) is finished; other callers' requests run
        in the same batches. If this is left by an exception or Ctrl-C, seqs are aborted."""
        outputs: dict[int, dict] = {}
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while len(outputs) < len(seqs):
                with self._lock:  # one step at a time; other threads' calls step in between
                    for seq in seqs:
                        if seq.seq_id not in outputs and (output := self.requests.take(seq.seq_id)):
                            outputs[seq.seq_id] = output
                            bar.update(1)
                    if len(outputs) == len(seqs):
                        break
                    start = time.perf_counter()
                    num_tokens = self._step()
                    elapsed = time.perf_counter() - start
                if num_tokens > 0:
                    prefill_rate = num_tokens / elapsed
                elif num_tokens < 0:
                    decode_rate = -num_tokens / elapsed
                if use_tqdm:
                    # Redrawn at most every BAR_REFRESH_S: a redraw per step costs more than a decode step.
                    bar.set_postfix({"Prefill": f"{prefill_rate:.0f}tok/s",
                                     "Decode": f"{decode_rate:.0f}tok/s"},
                                    refresh=time.perf_counter() - bar.last_print_t > BAR_REFRESH_S)
        except BaseException:
            self._abandon([seq for seq in seqs if seq.seq_id not in outputs])
            raise
        finally:
            bar.close()
        return outputs

    def _abandon(self, seqs: list[Sequence]) -> None:
        """The caller of these tracked requests is gone: abort them and drop their outputs."""
        with self._lock:
            for seq in seqs:
                self.abort_request(seq.seq_id)
                self.requests.forget(seq.seq_id)
