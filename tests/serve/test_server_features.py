"""The server as a vLLM user deploys it, started with the installed `nanovllm` console script as typed
(`nanovllm serve MODEL`): the served model id is the folder's name, every SamplingParams field over
HTTP (n, logprobs, echo, penalties, logit_bias, seed, stop_token_ids, several prompts), the fields
clients send by default, /v1/models/{id}, /tokenize, /detokenize, /version, vLLM's metric names, a
non-streaming client that leaves is aborted, a large prompt never stalls /health or a stream, a body
past --max-request-bytes is a 413, and past --graceful-timeout a stream ends with an error event."""

import json
import os
import shutil
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import PROMPTS
from server_process import API_KEY, Server

pytestmark = pytest.mark.slow
MAX_REQUEST_BYTES = 3_000_000
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def console_script() -> str:
    """The `nanovllm` command that `pip install -e .` put beside this Python."""
    path = shutil.which("nanovllm", path=os.path.dirname(sys.executable)) or shutil.which("nanovllm")
    assert path, "the nanovllm console script is not installed: pip install -e ."
    return path


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = Server(qwen3_dir, "--kvcache-block-size", "4", "--max-model-len", "1024", "--num-kvcache-blocks",
                 "512", "--max-num-seqs", "64", "--max-request-bytes", str(MAX_REQUEST_BYTES),
                 "--graceful-timeout", "0.5", log_level="info", executable=console_script(),
                 launcher=("serve",))
    yield srv
    assert srv.terminate() == 0, srv.output()


@pytest.fixture(scope="module")
def name(qwen3_dir):
    return os.path.basename(qwen3_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60, **kwargs)


def wait_idle(server, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_served_name_is_the_folder_name_and_model_endpoints(server, client, qwen3_dir, name):
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    out = client.completions.create(model=name, prompt="hello", max_tokens=2, **GREEDY)
    assert out.model == name
    assert qwen3_dir not in httpx.get(f"{server.url}/metrics").text
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tokenize_and_detokenize(server, tokenizer, name):
    tokens = post(server, "/tokenize", {"model": name, "prompt": PROMPTS[1]}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPTS[1]) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[1]}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat["tokens"] == list(getattr(expected, "input_ids", expected))
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).status_code == 401


def test_fields_clients_send_by_default_are_accepted(server, client, name):
    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=6, **GREEDY)
    same = client.chat.completions.create(
        model=name, messages=messages, max_tokens=6, response_format={"type": "text"}, tools=[],
        tool_choice="none", parallel_tool_calls=True, store=False, metadata={"team": "a"},
        service_tier="auto", top_logprobs=0, logit_bias={}, user="u", **GREEDY)
    assert same.choices[0].message.content == plain.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=name, messages=messages, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        plain.choices[0].message.content
    assert all(c.usage is not None for c in chunks[1:])  # usage in every chunk after the role's
    assert chunks[-1].usage.completion_tokens == 6
    completion = client.completions.create(model=name, prompt="hello", max_tokens=4, best_of=1, suffix=None,
                                           **GREEDY)
    assert completion.usage.completion_tokens == 4
    for body, match in (({"response_format": {"type": "json_schema"}}, "needs json_schema"),
                        ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                         "--enable-auto-tool-choice"),
                        ({"tool_choice": "required"}, "needs tools"),
                        ({"top_logprobs": 2}, "logprobs: true")):
        response = post(server, "/v1/chat/completions", {"messages": messages, **body})
        assert response.status_code == 400 and match in response.json()["error"]["message"], response.text


def test_n_seed_logit_bias_stop_token_ids_and_penalties(server, client, name):
    sampled = dict(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7,
                   extra_body={"ignore_eos": True, "return_token_ids": True})
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]  # the seed makes it reproducible
    assert len({tuple(i) for i in ids}) > 1  # completion i samples with seed + i
    assert first.usage.completion_tokens == 24
    biased = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=5, logit_bias={"42": 100},
                                       temperature=0.0, extra_body={"ignore_eos": True,
                                                                    "return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"] == [42] * 5
    greedy = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens = greedy.choices[0].model_extra["token_ids"]
    stop_id = tokens[3]
    cut = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "stop_token_ids": [stop_id]})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["token_ids"] == tokens[:tokens.index(stop_id) + 1]
    assert cut.choices[0].model_extra["stop_reason"] == stop_id
    penalized = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                          presence_penalty=2.0, frequency_penalty=2.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.5,
                                                      "min_tokens": 2, "return_token_ids": True})
    assert penalized.usage.completion_tokens == 8
    assert penalized.choices[0].model_extra["token_ids"] != tokens


def test_logprobs_in_both_shapes(server, client, name, tokenizer):
    full = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, logprobs=3, temperature=0.0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = full.choices[0]
    token_ids = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in token_ids]
    assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one (two tokens may decode alike, so compare values)
    assert all(max(top.values()) <= v + 1e-4 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    streamed = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, logprobs=True, top_logprobs=2, stream=True,
                                                   **GREEDY))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [c.token for c in content]


def test_echo_and_several_prompts_streamed_and_not(server, client, name):
    prompts = [PROMPTS[0], PROMPTS[2]]
    full = client.completions.create(model=name, prompt=prompts, max_tokens=5, n=2, echo=True, **GREEDY)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    texts = [c.text for c in full.choices]
    assert texts[0].startswith(prompts[0]) and texts[2].startswith(prompts[1])
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n completions agree
    assert full.usage.completion_tokens == 20
    chunks = list(client.completions.create(model=name, prompt=prompts, max_tokens=5, n=2, echo=True,
                                            stream=True, **GREEDY))
    joined = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert joined == texts
    single = client.completions.create(model=name, prompt=prompts[1], max_tokens=5, **GREEDY)
    assert texts[2] == prompts[1] + single.choices[0].text


def test_too_long_prompt_names_no_max_tokens(server, tokenizer):
    prompt = " ".join(["hello"] * 600)
    response = post(server, "/v1/completions", {"prompt": prompt})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert f"the prompt has {len(tokenizer.encode(prompt))} tokens" in message
    assert "max_tokens" not in message and "max_model_len 1024" in message


def test_leaving_non_streaming_client_is_aborted_within_a_second(server):
    before = wait_idle(server)
    body = {"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=0.5)
    left = time.monotonic()
    after = wait_idle(server, timeout=5)
    assert time.monotonic() - left < 1.5
    aborted = "vllm:request_success_total{finished_reason=\"abort\"}"
    assert after[aborted] == before[aborted] + 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1000
    assert after["nanovllm:kv_cache_free_blocks"] == after["nanovllm:kv_cache_total_blocks"]


def test_large_prompt_beside_a_stream_never_stalls_health(server, client, name):
    stream = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=300, stream=True, **GREEDY)
    next(stream)
    big = {"prompt": "hello world " * 200_000}  # 2.4 MB, a million tokens: seconds to tokenize
    result = {}
    sender = threading.Thread(target=lambda: result.update(response=post(server, "/v1/completions", big)))
    sender.start()
    latencies = []
    with httpx.Client(timeout=5) as probe:  # one connection, as a liveness probe's
        while sender.is_alive():
            start = time.monotonic()
            assert probe.get(f"{server.url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    sender.join()
    assert result["response"].status_code == 400, result["response"].text
    assert "tokens, which leaves no room" in result["response"].json()["error"]["message"]
    assert len(latencies) > 5 and max(latencies) < 0.1, [round(x, 3) for x in latencies if x > 0.02]
    assert sum(len(c.choices[0].text) > 0 for c in stream) > 0  # the stream went on to its end
    too_big = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                         content=json.dumps({"prompt": "x" * MAX_REQUEST_BYTES}).encode())
    assert too_big.status_code == 413 and "--max-request-bytes" in too_big.json()["error"]["message"]


def test_vllm_metrics_and_log_lines(server, client, name):
    before = wait_idle(server)
    prompt = " ".join(PROMPTS)  # the same prompt twice: the second finds its blocks in the cache
    for _ in range(2):
        client.completions.create(model=name, prompt=prompt, max_tokens=4, **GREEDY)
    after = wait_idle(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        if histogram != "inter_token_latency_seconds":
            assert delta(f"vllm:{histogram}_count") == 2, histogram
        assert after[f'vllm:{histogram}_bucket{{le="+Inf"}}'] == after[f"vllm:{histogram}_count"]
    assert delta("vllm:inter_token_latency_seconds_count") == 2 * 3  # between 4 tokens, each request
    assert delta("vllm:request_generation_tokens_sum") == 8
    queries, hits = delta("vllm:prefix_cache_queries_total"), delta("vllm:prefix_cache_hits_total")
    assert queries == delta("vllm:request_prompt_tokens_sum")
    assert 0 < hits < queries  # at least the second request finds its full blocks
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "gpu_cache_usage_perc"):
        assert f"vllm:{gauge}" in after
    post(server, "/v1/completions", {"prompt": "hi", "temperature": -1})
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.output():
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.2)
    log = server.output()
    assert "POST /v1/completions: 400 temperature" in log
    assert "Running: " in log and "KV cache usage: " in log


def test_past_graceful_timeout_a_stream_ends_with_an_error_event(server):
    # Last in the module: it stops the server (--graceful-timeout 0.5).
    body = {"prompt": PROMPTS[0], "max_tokens": 1000, "stream": True, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        server.proc.send_signal(15)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert "--graceful-timeout" in error["message"] and error["type"] == "server_error"
    assert server.terminate() == 0
