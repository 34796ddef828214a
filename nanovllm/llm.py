"""The user-facing facade: `LLM(model_path, **options)` with `generate`, `chat` and `stream`, over one
LLMEngine (`llm.engine`), or with data_parallel_size=N > 1 over a DataParallelEngine of N replicas
(nanovllm.dp; generate and chat only). The engine loop (`add_request`, `step`, `is_finished`,
`abort_request`) is reachable here too.

Threads: one LLM may be driven from several threads at once; each generate or stream call steps the
engine (under its lock) until its own requests are done, and collects exactly its own outputs. A call
left by an exception, Ctrl-C or (stream) an early close aborts its unfinished requests."""

import time
from collections.abc import Iterator

from tqdm.auto import tqdm

from nanovllm.dp.engine import DataParallelEngine
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import chat_token_ids

Message = dict[str, str]
# Seconds between redraws of the progress bar's live prefill/decode throughput.
BAR_REFRESH_S = 0.5


def check_conversation(conversation: object) -> None:
    """A conversation is a non-empty list of {"role": str, "content": str} dicts; anything else would
    reach the chat template and fail there with an error that names neither the message nor the key."""
    if not isinstance(conversation, list) or not conversation:
        raise TypeError(f"a conversation must be a non-empty list of messages, got {conversation!r:.80}")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got "
                            f"{type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"message {i} has no {key!r}; every message needs 'role' and 'content', "
                                 f"e.g. {{'role': 'user', 'content': 'Hello'}}")
            if not isinstance(message[key], str):
                raise TypeError(f"message {i}'s {key!r} must be a string, got {type(message[key]).__name__}")


class LLM:
    def __init__(self, model: str, **options) -> None:
        data_parallel = options.get("data_parallel_size", 1) != 1  # Config validates the value
        self.engine = (DataParallelEngine if data_parallel else LLMEngine)(model, **options)

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        return self.engine.add_request(prompt, sampling_params)

    def step(self) -> tuple[list[tuple[int, RequestOutput]], int]:
        return self.engine.step()

    def is_finished(self) -> bool:
        return self.engine.is_finished()

    def abort_request(self, request_id: int) -> bool:
        return self.engine.abort_request(request_id)

    # ---- lifetime ----
    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the model; it also happens when the LLM is
        garbage-collected and at interpreter exit. Idempotent."""
        self.engine.shutdown()

    exit = shutdown  # nano-vllm's name for it

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ---- generation ----
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
        if isinstance(self.engine, DataParallelEngine):  # each replica runs its own loop
            requests = [self.engine.make_request(p, sp)
                        for p, sp in zip(prompts, sampling_params, strict=True)]
            return self.engine.generate_requests(requests, use_tqdm)
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        with self.engine.lock:
            request_ids = [self.engine.start_request(seqs) for seqs in requests]
        outputs = self._run_until_done(request_ids, use_tqdm)
        return [outputs[request_id] for request_id in request_ids]

    def _run_until_done(self, request_ids: list[int], use_tqdm: bool) -> dict[int, RequestOutput]:
        """Step until every one of request_ids (tracked requests) is finished; other callers' requests
        run in the same batches. If this is left by an exception or Ctrl-C, they are aborted."""
        engine = self.engine
        outputs: dict[int, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while pending:
                with engine.lock:  # one step at a time; other threads' calls step in between
                    # Only what finished: asking each pending request (~0.75 us each on the CI machine)
                    # took 190 us a step at 256, and ~8% of a 4,000-request generate under cProfile.
                    for request_id, output in engine.take_outputs(pending):
                        outputs[request_id] = output
                        pending.discard(request_id)
                        bar.update(1)
                    if not pending:
                        break
                    start = time.perf_counter()
                    result = engine.advance()
                    elapsed = time.perf_counter() - start
                if result.num_prefill_tokens:
                    prefill_rate = result.num_prefill_tokens / elapsed
                if result.num_decode_tokens:
                    decode_rate = result.num_decode_tokens / elapsed
                if use_tqdm:
                    # Redrawn at most every BAR_REFRESH_S: a redraw per step costs more than a decode step.
                    bar.set_postfix({"Prefill": f"{prefill_rate:.0f}tok/s",
                                     "Decode": f"{decode_rate:.0f}tok/s"},
                                    refresh=time.perf_counter() - bar.last_print_t > BAR_REFRESH_S)
        except BaseException:
            engine.abandon([request_id for request_id in request_ids if request_id in pending])
            raise
        finally:
            bar.close()
        return outputs

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list
        of conversations, formatted with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but skip_tokenizer_init=True")
        if not isinstance(messages, list) or not messages:
            raise TypeError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conversation in conversations:
            check_conversation(conversation)
        prompts = [self.chat_token_ids(conversation, add_generation_prompt, chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_token_ids(self, conversation: list[Message], add_generation_prompt: bool = True,
                       chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt token ids of one conversation, formatted with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but skip_tokenizer_init=True")
        return chat_token_ids(self.tokenizer, conversation, add_generation_prompt, chat_template_kwargs)

    # ---- streaming ----
    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as tokens are produced; they join to
        exactly the text `generate` returns (a delta never splits a multi-byte character). Bad
        input raises here. The request is queued when iteration starts, runs in the same batches
        as other callers' requests, and is aborted (its KV blocks freed) if the iterator is closed
        or garbage-collected early, or an exception or Ctrl-C interrupts it. If the request fails
        inside a step (the others keep running), the iterator raises RuntimeError."""
        if self.tokenizer is None:
            raise ValueError("stream yields text and needs a tokenizer, but skip_tokenizer_init=True; "
                             "use add_request/step for token ids")
        seqs = self.engine.make_request(prompt, sampling_params)  # validated: bad input raises here
        if len(seqs) != 1:
            raise ValueError(f"stream yields one completion's text, but n={len(seqs)}; use n=1 (one "
                             "stream per completion, each with its own seed), or generate for n > 1")
        if not seqs[0].sampling_params.detokenize:
            raise ValueError("stream yields text, but detokenize=False; use add_request/step for token ids")
        return self._stream(seqs[0])

    def _stream(self, seq: Sequence) -> Iterator[str]:
        engine = self.engine
        params = seq.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        request_id = engine.start_request([seq])
        output = None
        try:
            while output is None:
                with engine.lock:
                    if (output := engine.take_output(request_id)) is None:
                        engine.advance()
                        output = engine.take_output(request_id)
                    # Read after the step: the tokens of the step that finished it go to finish().
                    new_token_ids = seq.completion_token_ids[detokenizer.num_tokens:]
                delta = (detokenizer.push(new_token_ids) if output is None
                         else detokenizer.finish(output["text"], new_token_ids))
                if delta:
                    yield delta
            if "error" in output:
                raise RuntimeError(f"request {request_id} failed: {output['error']}")
        finally:
            if output is None:
                engine.abandon([request_id])
