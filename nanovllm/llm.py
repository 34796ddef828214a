"""The user-facing facade: `LLM(model_path, **options)` with `generate` and `chat`, over one LLMEngine
(`llm.engine`), or with data_parallel_size=N > 1 over a DataParallelEngine of N replicas
(nanovllm.dp). The engine loop (`add_request`, `step`, `is_finished`) is reachable here too."""

import time

from tqdm.auto import tqdm

from nanovllm.dp.engine import DataParallelEngine
from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

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
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params, strict=True)]
        if isinstance(self.engine, DataParallelEngine):  # each replica runs its own loop
            return self.engine.generate_sequences(seqs, use_tqdm)
        for seq in seqs:
            self.engine.add_sequence(seq)
        outputs = self._run_until_done({seq.seq_id for seq in seqs}, use_tqdm)
        return [outputs[seq.seq_id] for seq in seqs]

    def _run_until_done(self, wanted: set[int], use_tqdm: bool) -> dict[int, RequestOutput]:
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(wanted), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        while not self.engine.is_finished() and len(outputs) < len(wanted):
            start = time.perf_counter()
            result = self.engine.run_step()
            elapsed = time.perf_counter() - start
            if result.num_prefill_tokens:
                prefill_rate = result.num_prefill_tokens / elapsed
            if result.num_decode_tokens:
                decode_rate = result.num_decode_tokens / elapsed
            if use_tqdm:
                # Redrawn at most every BAR_REFRESH_S: a redraw per step would cost more than a decode step.
                bar.set_postfix({"Prefill": f"{prefill_rate:.0f}tok/s", "Decode": f"{decode_rate:.0f}tok/s"},
                                refresh=time.perf_counter() - bar.last_print_t > BAR_REFRESH_S)
            for seq_id, output in result.outputs:
                if seq_id in wanted:
                    outputs[seq_id] = output
                    bar.update(1)
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
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
            # The template already placed any special tokens (BOS) it wants.
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)
