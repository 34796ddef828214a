"""Tool calls in chat: the constraint that `tool_choice` "required" or a named function puts on the
output, and the parsers that turn a model's output into OpenAI's `tool_calls`, streamed or not.

tool_choice "none" ignores the tools (the template does not see them); "auto" leaves generation free
and the server's parser (`--tool-call-parser`, with `--enable-auto-tool-choice`, as vLLM's flags) finds
the calls the model wrote in its chat family's format; "required" and a named function constrain the
output to JSON built from the tools' parameters, with no tags around it (a JSON schema compiles to a
smaller grammar than tags plus JSON, and the server knows it asked for a call):

    named function f   the arguments object itself, valid against f's parameters
    "required"         [{"name": "f", "arguments": {...}}, ...]: one call or more, each tool's name
                       beside its own parameters

Both come back as tool calls without a parser. A parser is a stream: `push(text)` takes the next
piece of text and returns the content that is final and the calls that closed in it, `finish(text)`
the rest; the full (non-streamed) reply runs the same stream over the whole text, so the two agree."""

import json
import uuid

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve.constraints import Tool

# Arguments of a tool without `parameters`: any JSON object.
ANY_OBJECT = {"type": "object"}


def new_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call; `arguments` is JSON text, as OpenAI sends it."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments_text(arguments: object) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def tool_constraint(tools: list[Tool], mode: str, parallel: bool = True) -> StructuredOutputsParams | None:
    """The output constraint of tool mode `mode` (see ChatCompletionRequest.tool_mode): None for
    "auto", else a compact JSON schema (no free whitespace: a small model would otherwise pad).
    parallel=False (OpenAI's parallel_tool_calls: false): "required" makes exactly one call."""
    if mode == "auto":
        return None
    if mode != "required":
        (tool,) = [tool for tool in tools if tool.function.name == mode]
        return StructuredOutputsParams(json=tool.function.parameters or ANY_OBJECT,
                                       disable_any_whitespace=True)
    calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                               "arguments": tool.function.parameters or ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


class ConstrainedCalls:
    """The calls of a constrained output ("required" or a named function), all at the end: the JSON
    is one value, complete only when the output is."""

    def __init__(self, mode: str) -> None:
        self.mode, self.text = mode, ""

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        return "", []

    def finish(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        if self.mode != "required":  # the arguments as written, also when max_tokens cut them short
            return "", [new_call(self.mode, self.text)]
        try:
            calls = [new_call(call["name"], _arguments_text(call["arguments"]))
                     for call in json.loads(self.text)]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens: the text is all there is
            return self.text, []
        return "", calls


class HermesToolParser:
    """Hermes' and Qwen's format: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    in the text; text outside the tags is content. A call goes out when its closing tag arrives (or at
    the end, when the model stopped right after the JSON); a tag's first characters are held back until
    it is clear whether a tag begins. A body that is not such JSON stays in the content, tags and all."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending, self.in_call = "", False

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = [], []
        while True:
            if not self.in_call:
                start = self.pending.find(self.OPEN)
                if start < 0:
                    keep = self._partial_tag_length()
                    cut = len(self.pending) - keep
                    content.append(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    break
                content.append(self.pending[:start])
                self.pending, self.in_call = self.pending[start + len(self.OPEN):], True
            end = self.pending.find(self.CLOSE)
            if end < 0:
                break
            body, self.pending, self.in_call = self.pending[:end], self.pending[end + len(self.CLOSE):], False
            call = self._parse(body)
            if call is None:
                content.append(self.OPEN + body + self.CLOSE)
            else:
                calls.append(call)
        return "".join(content), calls

    def finish(self, text: str) -> tuple[str, list[dict]]:
        content, calls = self.push(text)
        rest, self.pending = self.pending, ""
        if self.in_call:
            call = self._parse(rest)
            if call is not None:
                return content, calls + [call]
            rest = self.OPEN + rest
        return content + rest, calls

    def _partial_tag_length(self) -> int:
        """How many of pending's last characters could begin the opening tag."""
        for length in range(min(len(self.OPEN) - 1, len(self.pending)), 0, -1):
            if self.OPEN.startswith(self.pending[-length:]):
                return length
        return 0

    @staticmethod
    def _parse(body: str) -> dict | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return new_call(call["name"], _arguments_text(arguments))


# --tool-call-parser's names (vLLM's): the parser of each chat family's format.
TOOL_PARSERS = {"hermes": HermesToolParser}


def tool_call_stream(mode: str, parser: str | None):
    """The stream that finds the calls of one completion in tool mode `mode` ("auto" uses `parser`)."""
    if mode == "auto":
        assert parser in TOOL_PARSERS, f"tool_choice auto admitted without a parser ({parser!r})"
        return TOOL_PARSERS[parser]()
    return ConstrainedCalls(mode)


def extract_tool_calls(stream, text: str) -> tuple[str | None, list[dict]]:
    """A whole reply's content and calls; content None when there are calls and nothing else but
    whitespace, as OpenAI sends it."""
    content, calls = stream.finish(text)
    if calls and not content.strip():
        return None, calls
    return content, calls
