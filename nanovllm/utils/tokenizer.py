"""The engine's tokenizer from a local folder that really holds tokenizer files (a GGUF model's own
tokenizer comes from its one parse, nanovllm.utils.gguf_loader.GGUFCheckpoint). transformers, given a
folder without any, builds a near-empty tokenizer without a word; a model served through that one
would read every prompt as unknown tokens, so it is refused here."""

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.utils.hf_options import HF_LOCAL_ONLY

# Files one of which a Hugging Face tokenizer folder holds (fast tokenizers, BPE and SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json")
# A real vocabulary has more tokens than this; fewer means transformers built a placeholder.
MIN_VOCAB_SIZE = 2


def load_engine_tokenizer(config) -> PreTrainedTokenizerBase | None:
    """The tokenizer an engine with this Config uses: None with skip_tokenizer_init, a GGUF model's
    own (from the parse Config already made) unless a tokenizer folder is given, else the folder's."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is None and config.gguf is not None:
        return config.gguf.tokenizer()
    return load_tokenizer(config.tokenizer or config.model)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """`path` is the tokenizer option or the model folder."""
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{path!r} holds no tokenizer files (one of {list(TOKENIZER_FILES)}); copy the "
                         "model's tokenizer into it, pass tokenizer='FOLDER', or skip_tokenizer_init=True "
                         "and give token ids")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **HF_LOCAL_ONLY)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
    if len(tokenizer) < MIN_VOCAB_SIZE:
        raise ValueError(f"the tokenizer in {path!r} has {len(tokenizer)} token(s); is it the model's "
                         "tokenizer? pass tokenizer='FOLDER' or skip_tokenizer_init=True")
    return tokenizer


def chat_prompt(tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]],
                add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None, *,
                chat_template: str | None = None, continue_final_message: bool = False) -> str:
    """One conversation as text, through the tokenizer's chat template (or `chat_template`, a Jinja
    template). continue_final_message leaves the last message open for the model to go on with it
    (a prefilled assistant reply), as vLLM's and transformers' option of that name."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True: one opens a "
                         "new assistant turn, the other continues the last message; pass "
                         "add_generation_prompt=False")
    options = {**(chat_template_kwargs or {}), "chat_template": chat_template,
               "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message}
    return tokenizer.apply_chat_template(conversation, tokenize=False, **options)


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]],
                   add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None, *,
                   chat_template: str | None = None, continue_final_message: bool = False) -> list[int]:
    """The prompt token ids of one conversation (chat_prompt's text)."""
    text = chat_prompt(tokenizer, conversation, add_generation_prompt, chat_template_kwargs,
                       chat_template=chat_template, continue_final_message=continue_final_message)
    # The template already placed any special tokens (BOS) it wants.
    return tokenizer.encode(text, add_special_tokens=False)


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
