"""The user-facing facade: `LLM(model_path, **options)` with `generate`, `chat` and `stream`."""

from collections.abc import Iterator

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

Message = dict[str, str]


class LLM(LLMEngine):
    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[dict]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list
        of conversations, formatted with the tokenizer's chat template."""
        if not isinstance(messages, list) or not messages:
            raise TypeError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.chat_token_ids(conversation, add_generation_prompt, chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_token_ids(self, conversation: list[Message], add_generation_prompt: bool = True,
                       chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt token ids of one conversation, formatted with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but skip_tokenizer_init=True")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(chat_template_kwargs or {}))
        # The template already placed any special tokens (BOS) it wants.
        return self.tokenizer.encode(text, add_special_tokens=False)

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
        seq = self._make_sequence(prompt, sampling_params)
        return self._stream(seq)

    def _stream(self, seq: Sequence) -> Iterator[str]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.sampling_params.stop)
        self.start_request(seq)
        output = None
        try:
            while output is None:
                with self._lock:
                    if seq.seq_id not in self.requests.done:
                        self._step()
                    # Taken after the step: the tokens of the step that finished it go to finish().
                    output = self.requests.take(seq.seq_id)
                    new_token_ids = seq.completion_token_ids[detokenizer.num_tokens:]
                delta = (detokenizer.push(new_token_ids) if output is None
                         else detokenizer.finish(output["text"], new_token_ids))
                if delta:
                    yield delta
            if output["finish_reason"] == "error":
                raise RuntimeError(f"request {seq.seq_id} failed: {output['error']}")
        finally:
            if output is None:
                self._abandon([seq])
