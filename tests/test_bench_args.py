"""bench.py checks its lengths before loading any model, and its --help is complete."""

import pytest

import bench


def test_classic_defaults_are_unchanged():
    args = bench.parse_args([])
    assert (args.num_seqs, args.max_input_len, args.max_output_len) == (256, 1024, 1024)
    assert (args.min_input_len, args.min_output_len) == (100, 100)


def test_short_maximum_lengths_lower_the_default_minimum():
    args = bench.parse_args(["--max-input-len", "64"])
    assert (args.min_input_len, args.max_input_len) == (64, 64)
    assert (args.min_output_len, args.max_output_len) == (100, 1024)


@pytest.mark.parametrize("argv, message", [
    (["--min-len", "200", "--max-input-len", "64"], "--min-len 200 is above --max-input-len 64"),
    (["--max-output-len", "0"], "--max-output-len must be at least 1"),
    (["--num-seqs", "0"], "--num-seqs must be at least 1"),
    (["--max-input-len", "4000", "--max-output-len", "200"], "exceeds --max-model-len 4096"),
    (["--load-format", "pickle"], "invalid choice"),
])
def test_bad_lengths_exit_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_the_whole_description_and_gguf(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "Throughput: ...tok/s" in help_text and "an explicit --min-len above them is an error" in help_text
    assert "{auto,safetensors,gguf,dummy}" in help_text


@pytest.mark.parametrize("options", [
    ["--quantization", "fp8"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
], ids=["fp8-weights", "ngram"])
def test_bench_runs_as_typed(qwen3_dir, options):
    """`python bench.py ... --quantization fp8` (on a CPU: the dequantizing reference path) and with
    speculative decoding, end to end on a tiny model, printing its one line."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(bench.__file__).parent
    done = subprocess.run([sys.executable, "bench.py", "--model", qwen3_dir, "--num-seqs", "3",
                           "--max-input-len", "12", "--max-output-len", "6", "--max-model-len", "128",
                           "--kvcache-block-size", "16", *options],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Throughput:" in done.stdout and "Total: " in done.stdout
