"""Per-request sampling parameters (vLLM's names and meanings), validated at construction AND again by
the engine when the request is added (`validate(vocab_size)`), so a field changed after construction
cannot reach a step unchecked. Every numeric range is chosen so the value stays finite and meaningful
once it is a float32 on the device; bools and ints are type-checked strictly (a bool is not an int,
a string is not a bool)."""

import copy
import json
import logging
import math
from dataclasses import dataclass, field, fields

logger = logging.getLogger("nanovllm")

# Temperatures in (0, MIN_TEMPERATURE) are raised to it, as vLLM does: dividing float32 logits by a
# smaller one overflows to inf (temperature=1e-45 is 0 in float32 and acted like "always token 0").
MIN_TEMPERATURE = 1e-2
# Largest finite float32: a temperature or penalty beyond it becomes inf on the device.
FLOAT32_MAX = 3.4028234663852886e38
# Completions per request: each is a queued sequence, so a runaway n would exhaust host memory at add time.
MAX_N = 1024
# vLLM's default max_logprobs: top-k logprobs per position are capped at this many.
MAX_LOGPROBS = 20
# OpenAI's (and vLLM's) logit_bias range; larger biases are clamped to it.
MAX_LOGIT_BIAS = 100.0
# presence/frequency penalties: OpenAI's and vLLM's range.
MAX_ADDITIVE_PENALTY = 2.0
# repetition_penalty multiplies or divides logits: both it and its reciprocal stay well inside float32.
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _check_int(name: str, value, low: int | None = None, high: int | None = None, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}{hint}, got {value}")


def _check_float(name: str, value, low: float, high: float, hint: str = "") -> float:
    """A finite real number in [low, high], returned as a Python float (an int like 10**400 that has
    no float is refused here rather than overflowing in a step)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name}={value} is too large; it must be in [{low}, {high}]{hint}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{name} must be a finite number in [{low}, {high}]{hint}, got {value}")
    return number


def _check_token_ids(name: str, ids, vocab_size: int | None) -> list[int]:
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    ids = list(ids)
    for t in ids:
        _check_int(f"every token id in {name}", t, 0, None if vocab_size is None else vocab_size - 1,
                   "" if vocab_size is None else " (the model's vocabulary)")
    return ids


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of json (a JSON schema,
    as a dict or its JSON text), regex (the whole output full-matches it), choice (the output is one of
    these strings), grammar (EBNF / GBNF text, rule `root`) or json_object=True (any JSON object).
    xgrammar compiles it when the request is added (pip install 'nanovllm[structured]')."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens (compact output)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(CONSTRAINTS)}, got "
                             f"{given or 'none'}")
        _check_bool("disable_any_whitespace", self.disable_any_whitespace)
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            elif isinstance(self.json, dict):
                schema = self.json
            else:
                raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                                f"got {type(self.json).__name__}")
            if not isinstance(schema, dict | bool):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple):
                raise TypeError("structured_outputs.choice must be a list of strings")
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be non-empty strings, got "
                                 f"{self.choice!r:.80}")
        if self.json_object is not None:
            _check_bool("json_object", self.json_object)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))


# The constraint kinds of StructuredOutputsParams, one of which a request sets.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt, returned together
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 64
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are ignored before this many tokens
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one's)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the prompt token's)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __new__(cls, *args, **kwargs) -> "SamplingParams":
        # Name a field nanovllm lacks (vLLM's best_of, guided_decoding, ...) as not supported, rather
        # than with Python's bare "unexpected keyword argument".
        unknown = kwargs.keys() - FIELD_NAMES
        if unknown:
            raise TypeError(f"SamplingParams fields {sorted(unknown)} are not supported by nanovllm; "
                            f"supported: {sorted(FIELD_NAMES)}")
        return object.__new__(cls)  # not super(): slots=True rebuilds the class, super()'s cell has the old

    def __post_init__(self) -> None:
        self.validate()

    def clone(self) -> "SamplingParams":
        """A deep copy, as vLLM's SamplingParams.clone (to change a field for one request)."""
        return copy.deepcopy(self)

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field (and normalize a few, idempotently: stop str -> list, top_k 0 -> -1,
        tiny temperatures -> MIN_TEMPERATURE, logit_bias clamped). Raises TypeError / ValueError
        saying what to change. The engine calls it again, with the model's vocab_size, on every
        request it adds."""
        _check_int("n", self.n, 1, MAX_N)
        t = _check_float("temperature", self.temperature, 0.0, FLOAT32_MAX, " (0 = greedy)")
        if 0.0 < t < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which overflows float32 logits; using %s",
                           t, MIN_TEMPERATURE, MIN_TEMPERATURE)
            t = MIN_TEMPERATURE
        self.temperature = t
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0; use temperature=0 for greedy decoding")
        _check_int("top_k", self.top_k, -1, hint=" (-1 or 0 disable it)")
        if self.top_k == 0:
            self.top_k = -1
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name), -MAX_ADDITIVE_PENALTY,
                                             MAX_ADDITIVE_PENALTY))
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty,
                                               *REPETITION_PENALTY_RANGE, " (1 = no penalty)")
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            _check_bool(name, getattr(self, name))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, list | tuple):
            raise TypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; use stop_token_ids instead")
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.seed is not None:
            _check_int("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS,
                           " (the number of top tokens returned per position; None for none)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict {{token_id: bias}}, got "
                                f"{type(self.logit_bias).__name__}")
            _check_token_ids("logit_bias", self.logit_bias.keys(), vocab_size)
            self.logit_bias = {t: max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, _check_float(
                "a logit_bias value", b, -FLOAT32_MAX, FLOAT32_MAX))) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty; give at least one token id, or None for all")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, list | tuple):
                raise TypeError("bad_words must be a list of strings")
            self.bad_words = list(self.bad_words)
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_output_tokens(self) -> bool:
        """Whether this row's logits processors are built from the values of the tokens generated so far
        (penalties, bad words): overlap scheduling then waits for a step's tokens before it builds the
        next step. A structured output's grammar reads them only when it samples (engine/overlap.py)."""
        return self.uses_penalties or bool(self.bad_words)

    @property
    def uses_logits_processors(self) -> bool:
        # Structured outputs count: their rows fill a token bitmask on the host each step, from the
        # tokens so far, as the processors' rows build their tensors.
        return (self.uses_penalties or self.min_tokens > 0 or bool(self.bad_words)
                or self.logit_bias is not None or self.allowed_token_ids is not None
                or self.structured_outputs is not None)


FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
