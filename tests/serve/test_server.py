"""The real server on a tiny random model, through the official openai client and raw HTTP:
streamed deltas join to the non-streamed text, token ids match transformers, usage counts, 32
concurrent streams equal one-at-a-time runs, a dropped client's blocks return to the pool, bad
requests get 400s with OpenAI's error object (and the server keeps serving), the API key is
enforced, and SIGTERM exits cleanly."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from conftest import MAX_TOKENS, PROMPTS
from server_process import API_KEY, Server

# ignore_eos: a random model's EOS would end some requests early and make lengths uneven.
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = Server(qwen3_dir, "--kvcache-block-size", "4", "--max-model-len", "1024",
                 "--num-kvcache-blocks", "512", "--max-num-seqs", "64", "--served-model-name", "tiny")
    yield srv
    assert srv.terminate() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_tokens_match_transformers_and_stream_joins(server, client, tokenizer, reference):
    for prompt, expected in zip(PROMPTS, reference):
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert full.choices[0].model_extra["token_ids"] == expected
        assert full.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert full.choices[0].finish_reason == "length"
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(tokenizer.encode(prompt)),
                                                                            MAX_TOKENS)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_stream_joins_and_stop(server, client, tokenizer):
    messages = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
    text = full.choices[0].message.content
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert full.usage.prompt_tokens == len(getattr(prompt_ids, "input_ids", prompt_ids))
    assert full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    stop = text[4:6]  # a stop string inside the reply: cut before it, in both forms
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stop=[stop],
                                         **GREEDY)
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stop=[stop],
                                              stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.choices[0].message.content


def test_32_concurrent_streams_equal_one_at_a_time(server, client):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + i % 9) for i in range(32)]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=n, **GREEDY).choices[0].text
             for p, n in jobs]

    async def one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                  stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in jobs))

    assert asyncio.run(all_at_once()) == alone


def wait_idle(server, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_dropped_client_frees_its_blocks_and_others_finish(server, client):
    before = wait_idle(server)
    other_expected = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40,
                                               **GREEDY).choices[0].text
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    other = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, stream=True, **GREEDY)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
    assert "".join(c.choices[0].text for c in other) == other_expected
    after = wait_idle(server)
    assert after["nanovllm:kv_cache_free_blocks"] == after["nanovllm:kv_cache_total_blocks"]
    aborted = "vllm:request_success_total{finished_reason=\"abort\"}"
    assert after[aborted] == before[aborted] + 1, (before, after)
    # The reference and the other (40 each), and far fewer than 1000 for the dropped one.
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 80 + 3 <= generated < 80 + 1000, (before, after)


TOO_LONG = " ".join(["hello"] * 1100)


@pytest.mark.parametrize("path, body, status, param, match", [
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "greater than or equal"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "bogus": 1}, 400, "bogus", "unknown field"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, None, "stop must be a non-empty string"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt", "Field required"),
    ("/v1/completions", {"prompt": ""}, 400, None, "empty"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, None, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, None, "best_of"),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt", "no room for a completion within max_model_len"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2000}, 400, None, "max_model_len"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role", "Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", ""),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "valid array"),
    ("/v1/nothing", {}, 404, None, "Not Found"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, path, body, status,
                                                                      param, match):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers=server.headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and match in error["message"]
    ok = client.completions.create(model="tiny", prompt="hello", max_tokens=4, **GREEDY)
    assert ok.usage.completion_tokens == 4


def test_api_key(server):
    body = {"prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers).status_code == 200


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(server):
    # Last in the module: the fixture's teardown then finds the server gone.
    body = {"prompt": PROMPTS[0], "max_tokens": 60, "stream": True, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        server.proc.send_signal(15)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert server.terminate() == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
