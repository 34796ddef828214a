"""Options of the wrong type, impossible model configs, hub names, remote code, tokenizer-less folders
and malformed chat messages are refused at once, with a message that names the fix."""

import io
import json
import math
import shutil
import sys
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config


@pytest.mark.parametrize("options, match", [
    (dict(skip_tokenizer_init="False"), "skip_tokenizer_init must be bool, got str 'False'"),
    (dict(enforce_eager="no"), "enforce_eager must be bool"),
    (dict(enable_prefix_caching="0"), "enable_prefix_caching must be bool"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be bool, got int"),
    (dict(max_num_seqs=True), "max_num_seqs must be int or None, got bool"),
    (dict(seed=1.5), "seed must be int"),
    (dict(num_kvcache_blocks="8"), "num_kvcache_blocks must be int or None"),
    (dict(dtype=32), "dtype must be str"),
    (dict(tokenizer=3), "tokenizer must be str or None"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be float"),
])
def test_options_of_the_wrong_type_raise_type_error(qwen3_dir, options, match):
    with pytest.raises(TypeError, match=match):
        Config.from_options(qwen3_dir, **options)


@pytest.mark.parametrize("options", [dict(cpu_kvcache_space_gib=math.inf),
                                     dict(cpu_kvcache_space_gib=math.nan),
                                     dict(gpu_memory_utilization=math.nan)])
def test_float_options_must_be_finite(qwen3_dir, options):
    with pytest.raises(ValueError, match="finite|gpu_memory_utilization"):
        Config.from_options(qwen3_dir, **options)


def test_max_num_seqs_defaults_by_the_device(qwen3_dir, monkeypatch):
    import types

    import torch
    assert Config.from_options(qwen3_dir, device="cpu").max_num_seqs == 512
    assert Config.from_options(qwen3_dir, device="cpu", max_num_seqs=3).max_num_seqs == 3
    for name, value in (("is_available", True), ("device_count", 1), ("current_device", 0)):
        monkeypatch.setattr(torch.cuda, name, lambda _v=value: _v)
    for gib, expected in ((141, 1024), (80, 1024), (24, 512)):  # vLLM's: 1024 from 70 GiB on
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index, _g=gib: types.SimpleNamespace(total_memory=_g * 2**30))
        assert Config.from_options(qwen3_dir, device="cuda").max_num_seqs == expected
        assert Config.from_options(qwen3_dir, device="cuda", max_num_seqs=64).max_num_seqs == 64


def test_a_path_object_is_a_valid_model(qwen3_dir):
    from pathlib import Path
    assert Config.from_options(Path(qwen3_dir), tokenizer=Path(qwen3_dir)).model == qwen3_dir


def _copy_with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize("changes, match", [
    (dict(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (dict(hidden_size=-64), "hidden_size must be a positive integer"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(num_key_value_heads=8), "multiple of num_key_value_heads"),
    (dict(intermediate_size=0), "intermediate_size must be a positive integer"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
])
def test_impossible_model_configs_are_refused_before_loading(qwen3_dir, tmp_path, monkeypatch, changes,
                                                             match):
    import nanovllm.runner.model_loading as model_loading
    monkeypatch.setattr(model_loading, "load_model", lambda *a: pytest.fail("weights were loaded"))
    path = _copy_with_config(qwen3_dir, tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(path)


def test_heads_must_divide_the_hidden_size_without_head_dim():
    from transformers import PretrainedConfig

    from nanovllm.utils.config_checks import check_model_config
    hf = PretrainedConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=6)
    with pytest.raises(ValueError, match="hidden_size 64 is not divisible by num_attention_heads 6"):
        check_model_config(hf)
    hf.head_dim = 16  # an explicit head_dim need not divide the hidden size
    check_model_config(hf)


def test_hub_names_fail_at_once(qwen3_dir):
    start = time.monotonic()
    with pytest.raises(ValueError, match="tokenizer 'Qwen/Qwen3-0.6B' is not a local folder"):
        LLM(qwen3_dir, tokenizer="Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="does not exist"):
        LLM("Qwen/Qwen3-0.6B")
    assert time.monotonic() - start < 2.0


REMOTE_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("remote code ran")
from transformers import Qwen3Config
class CustomConfig(Qwen3Config):
    model_type = "qwen3"
"""


@pytest.mark.parametrize("model_type", ["qwen3", "custom-remote"])
def test_remote_code_in_a_model_folder_is_never_run(qwen3_dir, tmp_path, monkeypatch, model_type):
    marker = tmp_path / "remote_code_ran"
    path = _copy_with_config(qwen3_dir, tmp_path / "model", model_type=model_type,
                             auto_map={"AutoConfig": "custom.CustomConfig",
                                       "AutoTokenizer": ["custom.CustomTokenizer", None]})
    (tmp_path / "model" / "custom.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))  # a piped "yes" to any prompt
    try:
        llm = LLM(path, kvcache_block_size=4, num_kvcache_blocks=8, max_model_len=32)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    except ValueError:
        pass  # refusing the folder is as good as ignoring its code
    assert not marker.exists()


def test_folder_without_tokenizer_files_is_refused(qwen3_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(qwen3_dir, path, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*",
                                                                   "special_tokens*", "chat_template*"))
    with pytest.raises(ValueError, match="holds no tokenizer files.*skip_tokenizer_init=True"):
        LLM(str(path))
    llm = LLM(str(path), skip_tokenizer_init=True, kvcache_block_size=4, num_kvcache_blocks=8,
              max_model_len=32)
    assert llm.tokenizer is None


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=12, max_num_seqs=4)


@pytest.mark.parametrize("conversation, error, match", [
    ([{"content": "hi"}], ValueError, "message 0 has no 'role'"),
    ([{"role": "user"}], ValueError, "message 0 has no 'content'"),
    ([{"role": "user", "content": "hi"}, "hello"], TypeError, "message 1 must be a dict"),
    ([{"role": "user", "content": 5}], TypeError, "'content' must be a string"),
    ([{"role": None, "content": "hi"}], TypeError, "'role' must be a string"),
    ([[{"role": "user", "content": "hi"}], [{"role": "user"}]], ValueError, "no 'content'"),
])
def test_malformed_chat_messages(llm, conversation, error, match):
    with pytest.raises(error, match=match):
        llm.chat(conversation, use_tqdm=False)
    assert llm.is_finished()


def test_type_checks_follow_the_declared_field_types():
    """Fields other engineers add (lists, Literals, postponed annotations) are checked or left alone,
    never crash the check."""
    from dataclasses import dataclass, field
    from typing import Literal

    from nanovllm.utils.config_checks import check_option_types

    @dataclass
    class Options:
        model: str
        names: list[str] = field(default_factory=list)
        mode: Literal["a", "b"] = "a"
        later: "int" = 0
        ratio: float = 1.0

    check_option_types(Options("m", ["x"], "b", 3, 2))  # an int is a valid float
    with pytest.raises(TypeError, match="names must be list, got tuple"):
        check_option_types(Options("m", ("x",)))
    with pytest.raises(ValueError, match="ratio must be a finite number"):
        check_option_types(Options("m", ratio=math.inf))
