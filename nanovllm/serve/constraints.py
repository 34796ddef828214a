"""The request fields that constrain what the model writes, as pydantic models (strict, like the rest
of protocol.py): OpenAI's `response_format` (json_object, json_schema) and vLLM's `structured_outputs`
object, each turned into one StructuredOutputsParams; and chat's `tools` and `tool_choice`, acted on
in tool_calls.py."""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nanovllm.sampling_params import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # xgrammar always holds the output to the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format json_schema needs json_schema: {'name': ..., 'schema': {...}}")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: StructuredOutputsParams as JSON."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionName


def arguments_as_object(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
