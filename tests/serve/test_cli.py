"""`nanovllm serve`'s flags: every LLM option in vLLM's spelling (and vLLM's aliases), loopback by
default, and the console script's usage line."""

from dataclasses import fields

from nanovllm.config import Config
from nanovllm.serve.cli import build_parser, main


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


def test_console_script_wants_the_serve_command(capsys):
    assert main([]) == 2
    assert "nanovllm serve MODEL" in capsys.readouterr().err
