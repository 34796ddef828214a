"""What a new user sees when an LLM is built and used on the CPU: one startup line (model, family,
dtype, device, backend, KV capacity, TP), silenced through the "nanovllm" logger; a KV cache sized
to what the options can use; an uninitialised cache that nothing reads unmasked; no progress bar
from a shut-down LLM."""

import logging
import os
import subprocess
import sys

import pytest
from conftest import MAX_TOKENS, PROMPTS

from nanovllm import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(kvcache_block_size=16, max_model_len=64, max_num_seqs=2)


def test_startup_line_says_what_runs(qwen3_dir, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm")
    llm = LLM(qwen3_dir, **SMALL)
    lines = [r.getMessage() for r in caplog.records if r.name == "nanovllm" and r.levelno == logging.INFO]
    assert len(lines) == 1
    num_tokens = llm.engine.num_kvcache_blocks * 16
    assert lines[0] == (f"{os.path.basename(qwen3_dir)} (qwen3, safetensors), float32 on cpu, "
                        f"attention torch, KV cache {num_tokens:,} tokens, TP 1, CPU threads auto "
                        f"({llm.engine.executor.cpu_threads.num_threads} now)")


def test_startup_line_is_silenced_by_the_logger_level(qwen3_dir, caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger("nanovllm").setLevel(logging.WARNING)
    try:
        LLM(qwen3_dir, **SMALL)
    finally:
        logging.getLogger("nanovllm").setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == "nanovllm"]


def test_startup_line_shows_without_any_logging_setup(qwen3_dir):
    """A script that configures no logging prints the line on stderr; setting the level hides it."""
    script = (f"import logging; from nanovllm import LLM; LLM({qwen3_dir!r}, **{SMALL!r}); "
              f"logging.getLogger('nanovllm').setLevel(logging.WARNING); LLM({qwen3_dir!r}, **{SMALL!r})")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            check=True)
    lines = [line for line in result.stderr.splitlines() if line.startswith("nanovllm: ")]
    assert len(lines) == 1 and "(qwen3, safetensors), float32 on cpu" in lines[0]


def test_cpu_kv_cache_holds_what_the_options_can_use(qwen3_dir):
    # 2 sequences of 64 tokens in blocks of 16: 8 blocks, however large cpu_kvcache_space_gib is.
    assert LLM(qwen3_dir, **SMALL).engine.num_kvcache_blocks == 8
    # 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes x 16 tokens = 8 KiB a block: 5 blocks fit in 40 KiB.
    capped = LLM(qwen3_dir, **SMALL, cpu_kvcache_space_gib=5 * 8192 / 2**30)
    assert capped.engine.num_kvcache_blocks == 5


def test_unwritten_kv_is_never_read_unmasked(qwen3_dir, reference):
    """The CPU cache starts uninitialised: fill it with NaN, and greedy output still matches
    transformers (padded decode gathers, partial last blocks, several sequences of different lengths)."""
    llm = LLM(qwen3_dir, kvcache_block_size=4, max_model_len=64, max_num_seqs=4)
    llm.engine.executor.kv_cache.fill_(float("nan"))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference


def test_generate_on_a_shut_down_llm_raises_before_any_bar(qwen3_dir, capfd):
    llm = LLM(qwen3_dir, **SMALL)
    llm.shutdown()
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hello")
    with pytest.raises(RuntimeError, match="shut down"):
        llm.add_request("hello")
    assert capfd.readouterr().err == ""
    assert llm.engine.scheduler.is_finished()  # nothing was queued

