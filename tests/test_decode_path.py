"""A CPU decode step reads top to bottom through a handful of files, as README's Architecture section
says: at most MAX_FILES package files run in one `llm.step()` (seen with sys.setprofile)."""

import os
import sys

import pytest

import nanovllm
from nanovllm import LLM, SamplingParams

MAX_FILES = 18
PACKAGE = os.path.dirname(os.path.abspath(nanovllm.__file__))


@pytest.mark.usefixtures("one_thread")
def test_a_decode_step_runs_through_at_most_18_package_files(qwen3_dir):
    with LLM(qwen3_dir, kvcache_block_size=16, num_kvcache_blocks=16, cpu_threads=1) as llm:
        llm.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=8, temperature=0))
        for _ in range(3):  # the prefill, then decode steps
            llm.step()
        files = set()

        def profile(frame, event, arg):
            if frame.f_code.co_filename.startswith(PACKAGE):
                files.add(os.path.relpath(frame.f_code.co_filename, PACKAGE))

        sys.setprofile(profile)
        try:
            _, num_tokens = llm.step()
        finally:
            sys.setprofile(None)
    assert num_tokens < 0  # a decode step
    assert len(files) <= MAX_FILES, sorted(files)
