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


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]],
                   add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[int]:
    """The prompt token ids of one conversation, formatted with the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))
    # The template already placed any special tokens (BOS) it wants.
    return tokenizer.encode(text, add_special_tokens=False)
