"""The user-facing facade: `LLM(model, **options)` with `generate`, `chat` and `stream`, over one engine
(`llm.engine`): an LLMEngine, or with data_parallel_size=N > 1 a DataParallelEngine of N replicas,
which speaks the same protocol. nano-vllm's loop (`add_request`, `step`, `is_finished`) and
`abort_request` are here too. Calls take vLLM's prompt forms and keyword names; a vLLM option nanovllm
does not implement raises TypeError naming it.

Threads: one LLM may be driven from several threads at once; each generate or stream call steps the
engine until its own requests are done and takes exactly their outputs. A call left by an exception,
Ctrl-C or (stream) an early close aborts its unfinished requests."""

import threading
import time
from collections.abc import Iterator

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.distributed.executor import make_executor
from nanovllm.dp.engine import DataParallelEngine
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.step import build_batch
from nanovllm.engine.validation import Prompt, as_prompt_list, prompt_text, refuse_options, tokenize_prompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.text_stream import TextStream
from nanovllm.utils.tokenizer import chat_prompt, check_conversation

Message = dict[str, str]
# Seconds between redraws of the progress bar's live prefill/decode throughput.
BAR_REFRESH_S = 0.5


class LLM:
    def __init__(self, model: str, **options) -> None:
        config = Config.from_options(model, **options)
        if config.data_parallel_size > 1:
            self.engine: LLMEngine | DataParallelEngine = DataParallelEngine(config, options)
        else:
            self.engine = LLMEngine(config, make_executor)
        self._lock = threading.Lock()
        self._returned: dict[int, str | None] = {}  # add_request ids whose output step() returns: text

    @property
    def config(self) -> Config:
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (None with skip_tokenizer_init=True), as vLLM's LLM.get_tokenizer."""
        return self.engine.tokenizer

    # ---- nano-vllm's loop ----
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Bad input raises here. Its output comes back from the
        `step()` call that finishes it, or a later one."""
        request_id = self.engine.add_request(prompt, sampling_params)
        with self._lock:
            self._returned[request_id] = prompt_text(prompt)
        return request_id

    def step(self) -> tuple[list[tuple[int, RequestOutput]], int]:
        """Run one step. Returns the (request id, output) of `add_request` requests that finished, and
        the number of tokens computed: positive for a prefill step, negative for a decode step."""
        result = self.engine.step()
        with self._lock:
            outputs = [(request_id, RequestOutput.of(output, request_id, self._returned.pop(request_id)))
                       for request_id, output in self.engine.take_outputs(self._returned)]
        return outputs, result.num_prefill_tokens or -result.num_decode_tokens

    def is_finished(self) -> bool:
        """True when nothing is queued and `step()` has returned every `add_request` output."""
        return self.engine.is_finished() and not self._returned

    def abort_request(self, request_id: int) -> bool:
        """Stop a request and free its KV blocks at once; an aborted `add_request` request is not
        returned by `step()`. False for an unknown or finished id."""
        aborted = self.engine.abort_request(request_id)
        with self._lock:
            if request_id in self._returned:
                del self._returned[request_id]
                self.engine.take_outputs({request_id})
        return aborted

    # ---- lifetime ----
    def shutdown(self) -> None:
        """Stop the engine's workers or replicas and free the model; it also happens when the LLM is
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
                 use_tqdm: bool = True, **unsupported) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, {"prompt": text} or {"prompt_token_ids": ids}, or a
        list of these); returns one RequestOutput per prompt, in input order (its n completions in
        `outputs`, the first also at the top level of the dict). A bad prompt raises before any
        request of the call runs."""
        refuse_options("generate", unsupported)
        prompts = as_prompt_list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                                 "pass one for all or one per prompt")
        else:
            sampling_params = [sampling_params] * len(prompts)
        request_ids: list[int] = []
        try:  # no step runs in between: a bad prompt's predecessors are aborted before they start
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_ids.append(self.engine.add_request(prompt, params))
        except BaseException:
            self._abandon(request_ids)
            raise
        outputs = self._run_until_done(request_ids, use_tqdm)
        return [RequestOutput.of(outputs[request_id], request_id, prompt_text(prompt))
                for request_id, prompt in zip(request_ids, prompts, strict=True)]

    def _abandon(self, request_ids: list[int]) -> None:
        """Their caller is gone (an exception, Ctrl-C, a closed stream): abort them, drop their outputs."""
        self.engine.abort_request(request_ids)
        self.engine.take_outputs(set(request_ids))

    def _run_until_done(self, request_ids: list[int], use_tqdm: bool) -> dict[int, RequestOutput]:
        """Step until every one of request_ids is finished; other callers' requests run in the same
        batches. If this is left by an exception or Ctrl-C, the unfinished ones are aborted."""
        engine = self.engine
        outputs: dict[int, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while True:
                # Only what finished: asking each pending request (~0.75 us each on a CI machine)
                # took 190 us a step at 256, and ~8% of a 4,000-request generate under cProfile.
                for request_id, output in engine.take_outputs(pending):
                    outputs[request_id] = output
                    pending.discard(request_id)
                    bar.update(1)
                if not pending:
                    break
                start = time.perf_counter()
                result = engine.step()
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
            self._abandon([request_id for request_id in request_ids if request_id in pending])
            raise
        finally:
            bar.close()
        return outputs

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             chat_template_content_format: str = "auto", **unsupported) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list
        of conversations, formatted with the tokenizer's chat template (or `chat_template`); each
        output's `prompt` is the formatted text. Options as vLLM's (chat_template_content_format:
        "auto" or "string" only, since message contents are strings here)."""
        if chat_template_content_format not in ("auto", "string"):
            unsupported["chat_template_content_format"] = chat_template_content_format
        refuse_options("chat", unsupported)
        if not isinstance(messages, list) or not messages:
            raise TypeError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        options = dict(chat_template=chat_template, continue_final_message=continue_final_message)
        prompts = [self.chat_prompt(conversation, add_generation_prompt, chat_template_kwargs, **options)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[Message], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, **options) -> dict:
        """One conversation through the tokenizer's chat template (options: chat_template,
        continue_final_message), as a prompt: {"prompt": text, "prompt_token_ids": ids}."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but skip_tokenizer_init=True")
        check_conversation(conversation)
        text = chat_prompt(self.tokenizer, conversation, add_generation_prompt, chat_template_kwargs,
                           **options)
        # The template already placed any special tokens (BOS) it wants.
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    # ---- streaming ----
    def stream(self, prompt: Prompt | list[Message], sampling_params: SamplingParams | None = None,
               **chat_options) -> Iterator[str]:
        """Generate for one prompt, or reply to one conversation (a list of messages, formatted as
        `chat` does, with its keyword options), yielding text deltas as tokens are produced; they join
        to exactly the text `generate` returns (a delta never splits a multi-byte character). Bad
        input raises here, where the request is queued; it runs in the same batches as other
        callers' requests, and is aborted (its KV blocks freed) if the iterator is closed or
        garbage-collected early, or an exception or Ctrl-C interrupts it. If the request fails
        inside a step (the others keep running), the iterator raises RuntimeError."""
        if self.tokenizer is None:
            raise ValueError("stream yields text and needs a tokenizer, but skip_tokenizer_init=True; "
                             "use add_request/step for token ids")
        if isinstance(sampling_params, SamplingParams):
            if sampling_params.n != 1:
                raise ValueError(f"stream yields one completion's text, but n={sampling_params.n}; use "
                                 "n=1 (one stream per completion, each with its own seed), or generate")
            if not sampling_params.detokenize:
                raise ValueError("stream yields text, but detokenize=False; use add_request/step for "
                                 "token ids")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.chat_prompt(prompt, **chat_options)
        elif chat_options:
            raise TypeError(f"stream options {sorted(chat_options)} format a conversation (a list of "
                            "messages), and this prompt is not one")
        params = sampling_params or SamplingParams()
        return TextStream(self.engine, self.engine.add_request(prompt, sampling_params), self.tokenizer,
                          params.stop, params.skip_special_tokens)


def prompt_logits(llm: LLM, token_ids: list[int] | str):
    """The model's next-token logits after a whole prompt ([vocab] tensor), from one prefill through
    this LLM's own runner (prefix cache included) on KV blocks lent by its block manager and given
    back: for checks against a reference implementation (the tests, scripts/gpu_check.py). One
    engine of one rank only."""
    from nanovllm.engine.sequence import Sequence

    engine = llm.engine
    if not isinstance(engine, LLMEngine) or engine.executor.world_size != 1:
        raise ValueError("prompt_logits runs on one engine of one rank (no tensor or data parallelism)")
    token_ids = tokenize_prompt(token_ids, llm.tokenizer, llm.config.hf_config.vocab_size)
    seq = Sequence(token_ids, block_size=llm.config.kvcache_block_size)
    block_manager = engine.scheduler.block_manager
    block_manager.allocate(seq)
    try:
        seq.num_scheduled_tokens = seq.num_uncomputed_tokens
        return engine.executor.logits(build_batch([seq], is_prefill=True))[0]
    finally:
        block_manager.deallocate(seq)
