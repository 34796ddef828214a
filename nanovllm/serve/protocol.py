"""OpenAI API request bodies (pydantic, strict: a wrong type or an unknown field is a 400, not a
silent coercion) and the error object. Fields are OpenAI's, plus vLLM's extensions `top_k`,
`min_p`, `ignore_eos`, `stop_token_ids` and `return_token_ids`. Unsupported OpenAI options are
accepted only at their neutral value (n=1, zero penalties, no logprobs), so a client never gets an
answer to a question it did not ask."""

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanovllm.sampling_params import SamplingParams


class RequestError(ValueError):
    """A bad request: answered with HTTP `status` and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


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
    return RequestError(f"{param}: {first['msg']}" if param else first["msg"], param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; its own checks become a 400 naming the field."""
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  min_p=self.min_p, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                  stop=self.stop, stop_token_ids=self.stop_token_ids or [], seed=self.seed)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from e


class CompletionRequest(_GenerationRequest):
    # One prompt: a string or a list of token ids (a one-element batch of either is accepted too).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: None = None
    echo: Literal[False] = False

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(f"got {len(prompt)} prompts; send one prompt per request", "prompt")
            prompt = prompt[0]
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

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


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] | None = None
    add_generation_prompt: bool = True


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
