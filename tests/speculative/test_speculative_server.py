"""The server with --speculative-config (vLLM's flag, JSON), in the synchronous loop (the CPU's default)
and with --async-scheduling (a GPU's default: verification in the overlap loop), with n-gram drafts and
a draft model's: greedy completions are transformers' tokens, streamed ones carry every token a
verification emits, and /metrics exports vLLM's spec_decode counters."""

import json
import sys
import time
from pathlib import Path

import openai
import pytest
from conftest import MAX_TOKENS, PROMPTS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serve"))
from server_process import API_KEY, Server  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# The tiny model's greedy output repeats these prompts: most drafts are kept.
REPEATING = ["hello world hello world hello world hello", "Paris is the capital of France. Paris is the"]


@pytest.fixture(scope="module", params=[("ngram", []), ("ngram", ["--async-scheduling"]),
                                        ("draft", ["--async-scheduling"])],
                ids=["sync", "overlapped", "draft-model-overlapped"])
def server(qwen3_dir, request):
    method, flags = request.param
    # The draft model: the target itself (its drafts are all kept), proposing in the overlap loop.
    spec = SPEC if method == "ngram" else {"model": qwen3_dir, "num_speculative_tokens": 3}
    srv = Server(qwen3_dir, "--kvcache-block-size", "4", "--max-model-len", "256", "--num-kvcache-blocks",
                 "128", "--served-model-name", "tiny", "--speculative-config", json.dumps(spec), *flags)
    yield srv
    assert srv.terminate() == 0, srv.output()


def test_greedy_tokens_and_spec_decode_metrics(server, reference):
    assert "vllm:spec_decode_num_drafts_total" in server.metrics()  # exported from the start
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    for prompt, expected in zip(PROMPTS, reference):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected
    m = idle_metrics(server)
    drafts = m["vllm:spec_decode_num_drafts_total"]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert 0 < drafts <= draft_tokens <= 3 * drafts
    assert accepted == sum(per_pos) and per_pos == sorted(per_pos, reverse=True)


def test_streamed_completions_carry_every_accepted_token(server):
    """A verification emits up to k + 1 tokens in one step: the streamed deltas add up to the whole
    completion, text and token ids, with drafts kept along the way."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    accepted = idle_metrics(server)["vllm:spec_decode_num_accepted_tokens_total"]
    params = dict(model="tiny", max_tokens=24, temperature=0.0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    for prompt in REPEATING:
        whole = client.completions.create(prompt=prompt, **params).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(prompt=prompt, stream=True, **params)
                  if c.choices]
        assert "".join(c.text for c in chunks) == whole.text
        streamed_ids = [t for c in chunks for t in c.model_extra.get("token_ids") or []]
        assert streamed_ids == whole.model_extra["token_ids"]
        assert len(whole.model_extra["token_ids"]) == 24
    assert idle_metrics(server)["vllm:spec_decode_num_accepted_tokens_total"] > accepted


def idle_metrics(server) -> dict:
    """/metrics once no request runs (the counters settle after the last response)."""
    deadline = time.monotonic() + 10
    while (m := server.metrics())["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return m
