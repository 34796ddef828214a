"""speculative_config: vLLM's keys and defaults, and every bad key or value refused with a ValueError when
the LLM is built (before any weight is loaded); the server's --speculative-config flag takes JSON."""

import pytest

from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.serve.cli import build_parser
from nanovllm.speculative.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    parse_speculative_config,
)


def test_ngram_defaults_follow_vllm():
    # Neither bound: both 5; one bound: the other takes its value.
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "ngram", 3, 5, 5, None, DEFAULT_DISABLE_BY_BATCH_SIZE)
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 1}).method == "ngram"


def test_a_model_without_method_is_a_draft_model():
    spec = parse_speculative_config({"model": "/some/draft", "num_speculative_tokens": 4,
                                     "disable_by_batch_size": None})
    assert spec == SpeculativeConfig("draft_model", 4, None, None, "/some/draft", None)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(spec) is spec


@pytest.mark.parametrize("options, match", [
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
     r"keys nanovllm does not know or implement: \['draft_tensor_parallel_size'\]"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ({"method": "eagle", "num_speculative_tokens": 3},
     r"method'\] must be one of \['ngram', 'draft_model'\]"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "/draft"}, "takes no draft model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"model": "/draft", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, "applies to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_configs_raise_at_construction(qwen3_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_dir, speculative_config=options)


def test_not_a_dict_is_refused(qwen3_dir):
    with pytest.raises(TypeError, match="speculative_config"):
        LLM(qwen3_dir, speculative_config="ngram")


def test_the_option_is_parsed_into_the_config(qwen3_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    config = Config.from_options(qwen3_dir, async_scheduling=True, speculative_config=spec)
    assert config.speculative_config == parse_speculative_config(spec)
    assert config.async_scheduling is True  # it applies while no drafts are proposed


def test_server_flag_takes_json():
    parser, names = build_parser()
    assert "speculative_config" in names
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = parser.parse_args(["m", "--speculative-config", flag])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert parser.parse_args(["m"]).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--speculative-config", "{not json"])
