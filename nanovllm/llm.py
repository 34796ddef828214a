"""The user-facing facade: `LLM(model_path, **options)` with `generate` and `chat`. With
data_parallel_size > 1 it is a DataParallelLLM (a subclass, same API) over N replicas (nanovllm.dp)."""

from nanovllm.dp.engine import DataParallelEngine
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

Message = dict[str, str]


class LLM(LLMEngine):
    def __new__(cls, model: str, **options) -> "LLM":
        if cls is LLM and options.get("data_parallel_size", 1) != 1:
            cls = DataParallelLLM  # Python then runs DataParallelEngine.__init__, not LLMEngine's
        return super().__new__(cls)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[dict]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list
        of conversations, formatted with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but skip_tokenizer_init=True")
        if not isinstance(messages, list) or not messages:
            raise TypeError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
            # The template already placed any special tokens (BOS) it wants.
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)


class DataParallelLLM(DataParallelEngine, LLM):
    """What `LLM(..., data_parallel_size=N)` returns for N > 1: DataParallelEngine's generate, shutdown
    and loop methods (first in the MRO), LLM's chat over them."""
