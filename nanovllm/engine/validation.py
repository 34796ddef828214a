"""Checks a request where it arrives, before anything is queued: its SamplingParams against the
vocabulary, the prompt (a string to tokenize, or token ids inside the vocabulary), whether prompt +
max_tokens fit the context and the KV cache, and that the options needing a tokenizer have one.
Each error says what to change. Pure Python: the engine and the server's HTTP process (which holds
no model) run the same checks."""

from collections.abc import Sequence as SequenceLike

from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer, but skip_tokenizer_init=True; "
                             "pass token ids instead")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, SequenceLike) and _all_ints(prompt):
        token_ids = list(prompt)
    else:
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    # min and max run in C: a check per id took most of the ~30 ms that adding bench.py's 256 prompts
    # (143k ids) cost on the CI machine.
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return token_ids


def _all_ints(values: SequenceLike) -> bool:
    """Whether every value is an int and none a bool (which would pass for 0 or 1)."""
    if set(map(type, values)) <= {int}:  # the common case, in one pass in C
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def check_fits(config: Config, num_kvcache_blocks: int, token_ids: list[int], params: SamplingParams,
               has_tokenizer: bool) -> None:
    total = len(token_ids) + params.max_tokens
    if total > config.max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: "
                         f"{total} exceeds max_model_len {config.max_model_len}; shorten the prompt, "
                         "lower max_tokens or raise max_model_len")
    blocks = -(-total // config.kvcache_block_size)
    if blocks > num_kvcache_blocks:
        raise ValueError(f"the request needs up to {blocks} KV blocks but the whole cache has "
                         f"{num_kvcache_blocks}; lower max_tokens, or give the cache more memory "
                         "(gpu_memory_utilization, num_kvcache_blocks, cpu_kvcache_space_gib)")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True; "
                         "use stop_token_ids")
    if params.bad_words and not has_tokenizer:
        raise ValueError("bad_words need a tokenizer, but skip_tokenizer_init=True; use logit_bias "
                         "with -100 for single tokens")


def check_request(config: Config, num_kvcache_blocks: int, tokenizer, prompt: Prompt,
                  params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
    """Every check of one request; returns its prompt token ids and its params (the defaults for None)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    # Again, now: fields may have been changed since construction, and token ids need the vocabulary.
    params.validate(config.hf_config.vocab_size)
    token_ids = tokenize_prompt(prompt, tokenizer, config.hf_config.vocab_size)
    check_fits(config, num_kvcache_blocks, token_ids, params, tokenizer is not None)
    return token_ids, params
