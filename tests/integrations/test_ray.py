"""Ray Data on a local two-CPU Ray cluster: a Dataset of prompts mapped through two nanovllm actors
gives, row for row, what one LLM gives (greedy)."""

import os

import numpy as np
import pytest
from conftest import PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.integrations.ray import LLMPredictor

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
OPTIONS = dict(kvcache_block_size=4, max_model_len=128, num_kvcache_blocks=64)
# Uneven prompts, as strings and as token ids.
RAY_PROMPTS = [*PROMPTS, " ".join(PROMPTS), "Berlin"]
# The rows are a few kilobytes; Ray's default store would take 30% of the machine's memory.
OBJECT_STORE_BYTES = 200 * 1024**2


@pytest.fixture(scope="module")
def local_cluster():
    # The actors import this tree's nanovllm, not the installed one.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=OBJECT_STORE_BYTES,
             runtime_env={"env_vars": {"PYTHONPATH": root, "CUDA_VISIBLE_DEVICES": ""}})
    yield
    ray.shutdown()


def test_two_actors_give_what_one_llm_gives(local_cluster, qwen3_dir):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        expected = llm.generate(RAY_PROMPTS, GREEDY, use_tqdm=False)
    ids = [llm.tokenizer.encode(p) for p in RAY_PROMPTS]
    ds = ray.data.from_items([{"prompt": p, "row": i} for i, p in enumerate(RAY_PROMPTS)]
                             + [{"prompt": ids[i], "row": 100 + i} for i in range(2)])
    ds = ds.map_batches(LLMPredictor, batch_size=2, num_cpus=1, compute=ray.data.ActorPoolStrategy(size=2),
                        fn_constructor_kwargs=dict(model=qwen3_dir, sampling_params=GREEDY, **OPTIONS))
    rows = {row["row"]: row for row in ds.take_all()}
    assert sorted(rows) == [*range(len(RAY_PROMPTS)), 100, 101]
    for i, output in enumerate(expected):
        assert list(rows[i]["generated_token_ids"]) == output["token_ids"]
        assert rows[i]["generated_text"] == output["text"]
        assert rows[i]["finish_reason"] == "length"
    for i in range(2):  # token-id prompts give what their strings give
        assert list(rows[100 + i]["generated_token_ids"]) == expected[i]["token_ids"]


def test_prompt_column_and_chat_template(qwen3_dir):
    predictor = LLMPredictor(qwen3_dir, sampling_params=GREEDY, prompt_column="text",
                             apply_chat_template=True, **OPTIONS)
    with pytest.raises(KeyError, match="prompt_column="):
        predictor({"prompt": np.array(["hello"], dtype=object)})
    batch = predictor({"text": np.array(["hello", PROMPTS[0]], dtype=object), "id": np.array([7, 8])})
    expected = predictor.llm.chat([[{"role": "user", "content": p}] for p in ["hello", PROMPTS[0]]], GREEDY,
                                  use_tqdm=False)
    assert list(batch["id"]) == [7, 8]  # the input's columns pass through
    assert [list(ids) for ids in batch["generated_token_ids"]] == [o["token_ids"] for o in expected]
    assert list(batch["generated_text"]) == [o["text"] for o in expected]
    predictor.llm.shutdown()
