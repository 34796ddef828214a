"""OpenAI API request bodies (pydantic, strict: a wrong type or an unknown field is a 400, not a
silent coercion) and the error object. Fields are OpenAI's, plus vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `allowed_token_ids`, `bad_words`, `prompt_logprobs`, `return_token_ids`); each
maps onto the SamplingParams field of the same meaning. A constraint on the output comes as OpenAI's
`response_format` (json_object, json_schema), vLLM's `structured_outputs` object or its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: at most one of them, turned into
one StructuredOutputsParams. Chat's `tools` and `tool_choice` are checked here and acted on in
tool_calls.py. Fields that clients send by default are accepted: at values that ask for nothing
(`best_of` equal to n, `suffix: null`) or that do not change the answer (`store`, `metadata`,
`service_tier`, `user`, `parallel_tool_calls`); a value that asks for something the engine cannot do
is a 400 that says so, never an answer to another question."""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nanovllm.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputsParams
from nanovllm.serve.constraints import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    arguments_as_object,
)


class RequestError(ValueError):
    """A bad request: answered with HTTP `status` and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def __reduce__(self):  # raised in the tokenizer process, answered in the HTTP one
        return RequestError, (str(self), self.param, self.status, self.kind, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe_validation_error(error: ValidationError) -> RequestError:
    """The first problem pydantic found, with the field it is about."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first['msg']}")
    if first["type"] == "extra_forbidden":
        return RequestError(f"unknown field {param!r}", param)
    message = first["msg"].removeprefix("Value error, ")
    return RequestError(f"{param}: {message}" if param else message, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, not only after the last


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: they do not change the answer.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token (SamplingParams.logprobs); None for none."""
        raise NotImplementedError

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever of its fields gives one (a 400 for two)."""
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format.constraint
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.constraint
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given[f"guided_{kind}"] = lambda kind=kind, value=value: StructuredOutputsParams(
                    **{kind: value})
        if len(given) > 1:
            raise RequestError(f"give one output constraint, got {sorted(given)}", sorted(given)[1])
        if not given:
            return None
        ((field, make),) = given.items()
        try:
            return make()
        except (TypeError, ValueError) as e:
            raise RequestError(f"{field}: {e}", field) from e

    def sampling_params(self, max_tokens: int, constraint: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """SamplingParams for this request (with `constraint` on its output); its own checks become
        a 400."""
        try:
            bias = None if not self.logit_bias else {_token_id(k): v for k, v in self.logit_bias.items()}
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, max_tokens=max_tokens,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop,
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output, seed=self.seed,
                logprobs=self.num_logprobs, prompt_logprobs=self.prompt_logprobs, logit_bias=bias,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                structured_outputs=constraint)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from e


def _token_id(key: str) -> int:
    if not key.isdigit():
        raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
    return int(key)


class CompletionRequest(_GenerationRequest):
    # A string or a list of token ids, or a batch of either: one choice (n per prompt) each.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} with n={self.n}: only best_of equal to n (or unset) "
                             "is supported; ask for n completions and rank them yourself")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)
        return [prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    # What clients replay from an earlier turn; the templates here render text only.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                   "messages")
            texts.append(part["text"])
        return "".join(texts)

    def as_dict(self) -> dict:
        message = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:  # templates (Qwen's) write arguments with `tojson`: give them the object
            message["tool_calls"] = [arguments_as_object(call) for call in self.tool_calls]
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # a model here has no reasoning switch: nothing to do

    @model_validator(mode="after")
    def _check_options(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in [tool.function.name for tool in self.tools]:
                raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none": the tools are ignored), "auto", "required", or
        the name of the function tool_choice names. OpenAI's default with tools is "auto"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or a conversation formatted with the chat template."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]
