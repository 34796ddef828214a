"""The server with --speculative-config (vLLM's flag, JSON): greedy completions are transformers'
tokens, and /metrics exports vLLM's spec_decode counters."""

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


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = Server(qwen3_dir, "--kvcache-block-size", "4", "--max-model-len", "256", "--num-kvcache-blocks",
                 "128", "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC))
    yield srv
    assert srv.terminate() == 0, srv.output()


def test_greedy_tokens_and_spec_decode_metrics(server, reference):
    assert "vllm:spec_decode_num_drafts_total" in server.metrics()  # exported from the start
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    for prompt, expected in zip(PROMPTS, reference):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected
    deadline = time.monotonic() + 10
    while (m := server.metrics())["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    drafts = m["vllm:spec_decode_num_drafts_total"]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert 0 < drafts <= draft_tokens <= 3 * drafts
    assert accepted == sum(per_pos) and per_pos == sorted(per_pos, reverse=True)
