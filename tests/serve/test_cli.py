"""`nanovllm serve`'s flags: every LLM option in vLLM's spelling (and vLLM's aliases), loopback by
default, --stream-interval, and the console script's usage line."""

from dataclasses import fields

import pytest

from nanovllm.config import Config
from nanovllm.serve.app import build_app
from nanovllm.serve.cli import build_parser, main, serve_main
from nanovllm.serve.engine_client import STEP_TIMEOUT_S, EngineClient


def test_every_config_option_is_a_flag():
    parser, names = build_parser()
    assert sorted(names) == sorted(f.name for f in fields(Config) if f.init and f.name != "model")
    args = parser.parse_args(["m", "--max-model-len", "128", "-tp", "2", "--block-size", "16",
                              "--no-enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization",
                              "0.5", "--num-gpu-blocks-override", "7", "--load-format", "dummy",
                              "--skip-tokenizer-init"])
    assert (args.max_model_len, args.tensor_parallel_size, args.kvcache_block_size) == (128, 2, 16)
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert (args.gpu_memory_utilization, args.num_kvcache_blocks) == (0.5, 7)
    assert args.load_format == "dummy" and args.skip_tokenizer_init is True
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)


def test_quantization_takes_the_methods_nanovllm_implements(capsys):
    parser, _ = build_parser()
    assert parser.parse_args(["m"]).quantization is None  # the checkpoint's own, if any
    method = "compressed-tensors"
    assert parser.parse_args(["m", "--quantization", method]).quantization == method
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--quantization", "awq"])
    err = capsys.readouterr().err  # Python versions quote the choices or not
    assert "--quantization: invalid choice: 'awq'" in err and "fp8" in err and "compressed-tensors" in err


def test_help_says_what_an_engine_chosen_default_is():
    parser, _ = build_parser()
    text = " ".join(parser.format_help().split())
    assert "--max-num-seqs MAX_NUM_SEQS default: 1024 on a GPU of 70 GiB or more, else 512" in text
    assert "default: sized from free memory" in text
    assert parser.parse_args(["m"]).max_num_seqs is None  # left to the engine (Config)


def test_console_script_wants_the_serve_command(capsys):
    assert main([]) == 2
    assert "nanovllm serve MODEL" in capsys.readouterr().err


def test_stream_interval_defaults_to_each_token_and_must_be_positive(capsys):
    parser, _ = build_parser()
    assert parser.parse_args(["m"]).stream_interval == 1
    assert parser.parse_args(["m", "--stream-interval", "4"]).stream_interval == 4
    with pytest.raises(SystemExit):
        serve_main(["m", "--stream-interval", "0"])  # refused before any model loads
    assert "--stream-interval must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stream_interval must be a positive integer"):
        build_app(None, "m", stream_interval=0)


def test_engine_step_timeout_defaults_to_ten_minutes_and_must_not_be_negative(capsys):
    parser, _ = build_parser()
    assert parser.parse_args(["m"]).engine_step_timeout == STEP_TIMEOUT_S == 600
    assert parser.parse_args(["m", "--engine-step-timeout", "0"]).engine_step_timeout == 0  # off
    with pytest.raises(SystemExit):
        serve_main(["m", "--engine-step-timeout", "-1"])  # refused before any model loads
    assert "--engine-step-timeout must be >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="step_timeout must be a number of seconds"):
        EngineClient("m", {}, step_timeout=-1)
