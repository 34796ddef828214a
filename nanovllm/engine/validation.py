"""Checks a request where it arrives, before anything is queued: its SamplingParams against the
vocabulary, the prompt (a string to tokenize, or token ids inside the vocabulary), whether prompt +
max_tokens fit the context and the KV cache, and that the options needing a tokenizer have one.
A prompt comes in any of vLLM's forms (`Prompt`), read here only, so every engine takes them all.
Each error says what to change. Pure Python: the engine and the server's HTTP process (which holds
no model) run the same checks."""

from collections.abc import Sequence as SequenceLike
from typing import NotRequired, TypedDict

from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's TextPrompt: `TextPrompt(prompt="...")` is the dict {"prompt": "..."}."""
    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's TokensPrompt: token ids, and optionally their text (the ids are what runs)."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


# vLLM's prompt forms: text, token ids, a TextPrompt or a TokensPrompt.
Prompt = str | list[int] | TextPrompt | TokensPrompt
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _unwrap(prompt: dict) -> str | list[int]:
    """A prompt dict's token ids, else its text."""
    unknown = prompt.keys() - set(PROMPT_KEYS)
    if unknown:
        raise TypeError(f"prompt keys {sorted(unknown)} are not supported by nanovllm; a prompt dict holds "
                        "'prompt' (text) or 'prompt_token_ids' (vLLM's TextPrompt or TokensPrompt)")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" not in prompt:
        raise TypeError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    if not isinstance(prompt["prompt"], str):
        raise TypeError(f"a prompt dict's 'prompt' must be text, got {type(prompt['prompt']).__name__}; "
                        "give token ids as {'prompt_token_ids': [...]}")
    return prompt["prompt"]


def prompt_text(prompt: Prompt) -> str | None:
    """The prompt's text, as vLLM's RequestOutput.prompt: None for token ids."""
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return prompt if isinstance(prompt, str) else None


def as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """generate's `prompts`: one prompt in any form, or a non-empty list of them."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and _all_ints(prompts)):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise TypeError("prompts must be a prompt (a string, a list of token ids, {'prompt': text} or "
                        "{'prompt_token_ids': ids}) or a non-empty list of them")
    return prompts


def refuse_options(method: str, options: dict) -> None:
    """Keyword arguments of vLLM's that nanovllm lacks (lora_request, priority, tools, ...) are named."""
    if options:
        raise TypeError(f"LLM.{method}() options {sorted(options)} are not supported by nanovllm")


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, dict):
        prompt = _unwrap(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer, but skip_tokenizer_init=True; "
                             "pass token ids instead")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, SequenceLike) and _all_ints(prompt):
        token_ids = list(prompt)
    else:
        raise TypeError(f"a prompt must be a string or a list of token ids (or {{'prompt': text}}, "
                        f"{{'prompt_token_ids': ids}}), got {type(prompt).__name__}")
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
