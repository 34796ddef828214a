"""Bad input raises a clear error when the request is added, and the engine keeps working."""

import pytest

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=12, max_num_seqs=4)


def test_unknown_option_is_rejected_with_the_valid_ones(qwen3_dir):
    with pytest.raises(TypeError, match="unknown LLM options \\['max_num_seq'\\].*max_num_seqs"):
        LLM(qwen3_dir, max_num_seq=4)


@pytest.mark.parametrize("path", ["/nonexistent/model", "/tmp"])
def test_missing_model_path_says_how_to_get_qwen3(path):
    with pytest.raises(ValueError, match="hf download Qwen/Qwen3-0.6B"):
        LLM(path)


def test_folder_without_weights_suggests_dummy(tmp_path, qwen3_dir):
    import shutil
    shutil.copy(f"{qwen3_dir}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


@pytest.mark.parametrize("options, match", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(dtype="float8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks"),
])
def test_out_of_range_options(qwen3_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_dir, **options)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, params, error, match", [
    ("", GREEDY, ValueError, "empty"),
    ([], GREEDY, ValueError, "empty"),
    ([1, 2, 10**6], GREEDY, ValueError, "outside the vocabulary"),
    ([1, 2, -1], GREEDY, ValueError, "outside the vocabulary"),
    (3.5, GREEDY, TypeError, "string or a list of token ids"),
    ([1, True], GREEDY, TypeError, "string or a list of token ids"),
    ([1, 2.0], GREEDY, TypeError, "string or a list of token ids"),
    ([1, 2], "greedy", TypeError, "SamplingParams"),
    ([1] * 60, GREEDY, ValueError, "exceeds max_model_len 64"),
    ([1] * 30, SamplingParams(max_tokens=30), ValueError, "KV blocks but the whole cache has 12"),
])
def test_bad_requests_raise_at_add_time_and_engine_survives(llm, prompt, params, error, match):
    ok = llm.add_request([5, 6, 7], GREEDY)  # a good request already in flight
    with pytest.raises(error, match=match):
        llm.add_request(prompt, params)
    outputs = {}
    while not llm.is_finished():
        outputs.update(llm.step()[0])
    assert list(outputs) == [ok] and len(outputs[ok]["token_ids"]) == 8


def test_generate_validates_the_whole_batch_before_queueing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["hello", ""], GREEDY, use_tqdm=False)
    assert llm.is_finished()  # "hello" was not left queued
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hello"], [GREEDY, GREEDY], use_tqdm=False)
    assert len(llm.generate(["hello"], GREEDY, use_tqdm=False)[0]["token_ids"]) == 8


def test_chat_applies_the_template(llm, tokenizer):
    conversation = [{"role": "user", "content": "hello"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    expected = tokenizer.encode(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                              add_generation_prompt=True))
    assert out["prompt_token_ids"] == expected
    both = llm.chat([conversation, conversation], GREEDY, use_tqdm=False)
    assert both[0]["token_ids"] == both[1]["token_ids"] == out["token_ids"]


@pytest.mark.parametrize("path, options, match", [
    ("/nonexistent/model.gguf", {}, "GGUF file '/nonexistent/model.gguf' does not exist"),
    ("/nonexistent", dict(gguf_file="model.gguf"), "GGUF file '/nonexistent/model.gguf' does not exist"),
    ("/nonexistent/model.gguf", dict(gguf_file="other.gguf"), "already a .gguf file; drop gguf_file"),
    ("/tmp", dict(gguf_file="model.bin"), "gguf_file must name a .gguf file"),
])
def test_bad_gguf_paths(path, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(path, **options)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read .*model.gguf.* as a GGUF model"):
        LLM(str(tmp_path / "model.gguf"))


def test_load_format_must_match_the_files(tmp_path, qwen3_dir):
    with pytest.raises(ValueError, match="load_format='gguf' needs a .gguf file"):
        LLM(qwen3_dir, load_format="gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="load_format='safetensors' but the model is the GGUF file"):
        LLM(str(tmp_path / "model.gguf"), load_format="safetensors")


def test_model_path_that_is_a_plain_file(qwen3_dir):
    with pytest.raises(ValueError, match="is a file, not a model folder or a .gguf file"):
        LLM(f"{qwen3_dir}/config.json")
