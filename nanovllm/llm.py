"""The user-facing facade: `LLM(model_path, **options)` with `generate` and `chat`."""

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

Message = dict[str, str]


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


class LLM(LLMEngine):
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
