"""SpeculativeConfig: the `speculative_config` option (vLLM's keys), parsed and checked once, when the
Config is built; a bad key or value raises ValueError naming what to change. Pure Python.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"model": "path/to/draft", "num_speculative_tokens": 3}           # method "draft_model"
"""

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM's defaults for prompt lookup when neither bound is given (it notes they are not tuned); given one,
# the other takes its value.
DEFAULT_PROMPT_LOOKUP = 5
# Above this many running sequences no proposals are made (vLLM's disable_by_batch_size; its default is
# never). A verification step runs eagerly or piecewise where a decode step replays one CUDA graph, and a
# large decode batch is compute-bound already, so there speculation costs more than it saves; below it a
# step is bound by reading the weights, and the extra tokens ride along. None: never switch off.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
# vLLM's spellings of the n-gram method as a "model".
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: drafts proposed per sequence and step (at most)
    prompt_lookup_max: int | None = None  # ngram: the longest tail n-gram looked up
    prompt_lookup_min: int | None = None  # ngram: the shortest
    model: str | None = None  # draft_model: its folder or .gguf file
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE


KEYS = tuple(f.name for f in fields(SpeculativeConfig))


def _positive_int(name: str, value: Any, hint: str = "") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config[{name!r}] must be an integer >= 1, got {value!r}{hint}")
    return value


def parse_speculative_config(options: "dict | SpeculativeConfig | None") -> SpeculativeConfig | None:
    """The checked SpeculativeConfig of LLM(speculative_config=...); None stays None."""
    if options is None or isinstance(options, SpeculativeConfig):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"speculative_config must be a dict (vLLM's keys), got {type(options).__name__}")
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config has keys nanovllm does not know or implement: {unknown}; "
                         f"valid keys are {list(KEYS)}")
    opts = dict(options)
    method, model = opts.get("method"), opts.get("model")
    if method is None:
        if model is None:
            raise ValueError("speculative_config needs a 'method' ('ngram') or a draft 'model' path")
        method = "ngram" if model in NGRAM_MODEL_NAMES else "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in opts:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (drafts per step, e.g. 3)")
    k = _positive_int("num_speculative_tokens", opts["num_speculative_tokens"])
    disable = opts.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if disable is not None:
        disable = _positive_int("disable_by_batch_size", disable, " (or None: never switch speculation off)")
    if method == "ngram":
        if model not in (None, *NGRAM_MODEL_NAMES):
            raise ValueError(f"speculative_config: method 'ngram' takes no draft model, got model={model!r}; "
                             "drop 'model', or drop 'method' to use the draft model")
        hi, lo = opts.get("prompt_lookup_max"), opts.get("prompt_lookup_min")
        hi = _positive_int("prompt_lookup_max", hi) if hi is not None else None
        lo = _positive_int("prompt_lookup_min", lo) if lo is not None else None
        if hi is None and lo is None:
            hi = lo = DEFAULT_PROMPT_LOOKUP
        hi, lo = hi or lo, lo or hi
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                             f"({hi})")
        return SpeculativeConfig("ngram", k, hi, lo, None, disable)
    for name in ("prompt_lookup_max", "prompt_lookup_min"):
        if opts.get(name) is not None:
            raise ValueError(f"speculative_config[{name!r}] applies to method 'ngram' only; drop it")
    if not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config: method 'draft_model' needs 'model', the draft model's folder "
                         f"or .gguf file, got {model!r}")
    return SpeculativeConfig("draft_model", k, None, None, model, disable)


def draft_options(target: Any) -> dict[str, Any]:
    """The options of the draft model's Config (nanovllm.config.Config.draft_config): the target's where
    the two must agree. The draft runs on rank 0's device alone, in the target's dtype, with a paged KV
    cache of the target's block size that the target's block tables address, and computes up to k - 1
    positions beyond a sequence's length (the drafts it feeds itself); its block count is the target's,
    known once the target's cache is sized (nanovllm.speculative.draft). No torch.compile: it would
    compile the sampler alone, which the draft runs greedy only (the fused race's argmax)."""
    spec = target.speculative_config
    names = ("max_num_batched_tokens", "max_num_seqs", "enforce_eager", "kvcache_block_size", "seed",
             "skip_tokenizer_init", "attention_backend", "skinny_gemm",
             "kv_cache_dtype", "cpu_threads")
    options = {name: getattr(target, name) for name in names}
    options.update(max_model_len=target.max_model_len + spec.num_speculative_tokens, dtype=target.model_dtype,
                   device=target.device_type, async_scheduling=False, torch_compile=False,
                   load_format="dummy" if target.load_format == "dummy" else "auto")
    return options


def check_draft_vocab_size(target: Any, draft: Any) -> None:
    """A draft proposes token ids of the target's vocabulary, or none of its proposals mean anything
    (the tokenizers themselves are compared when the draft loads: nanovllm.speculative.draft)."""
    target_vocab, draft_vocab = target.hf_config.vocab_size, draft.hf_config.vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(f"the draft model {draft.model!r} has vocab_size {draft_vocab} but the target "
                         f"{target.model!r} has {target_vocab}; speculative decoding needs a draft with the "
                         "target's tokenizer (e.g. Qwen3-0.6B as the draft of Qwen3-8B)")
