"""How the decode kernels are launched (nanovllm.kernels.decode_launch): chunk counts, launch settings,
the tile form and register cap of an fp8 cache, and the shapes a warm-up builds every variant at. Host
code only: no kernel runs here."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.kernels import decode_launch, decode_words  # noqa: E402
from nanovllm.kernels.decode_launch import MAX_NUM_SPLITS, choose_launch, decode_num_splits  # noqa: E402


@pytest.mark.parametrize("element_size", [2, 1], ids=["bf16", "fp8"])
def test_variant_shapes_cover_every_variant_any_call_can_take(element_size: int) -> None:
    """The warm-up's shapes against every (rows, width) of Qwen3-0.6B's decode (8 KV heads, 256-token
    blocks, up to 512 rows and 4,096 tokens): each variant a call can take (its launch, one chunk or
    more) has a shape, and the fused kernel's PDL trigger (from 2 rows) counts apart where asked."""
    device = torch.device("cpu")  # off-GPU, the shared memory of an H100/H200 is assumed
    shape_args = (8, 128, 256, 16, element_size, device, 132)

    def variant(rows: int, width: int) -> tuple:
        launch, splits = choose_launch(rows, 8, 128, width * 256, element_size, device, 132)
        return launch, splits == 1, rows >= 2

    plain = decode_launch.variant_shapes(512, *shape_args, lambda rows, launch, splits: (launch, splits == 1))
    every = {variant(rows, width)[:2] for rows in range(1, 513) for width in range(1, 17)}
    assert {variant(rows, width)[:2] for rows, width in plain} == every
    # small-batch launch; large-batch with several chunks, and with one; fp8: packed KV heads too
    assert len(every) == (3 if element_size == 2 else 4)
    fused = decode_launch.variant_shapes(32, *shape_args,
                                         lambda rows, launch, splits: (launch, splits == 1, rows >= 2),
                                         row_thresholds=(2,))
    every = {variant(rows, width) for rows in range(1, 33) for width in range(1, 17)}
    assert {variant(rows, width) for rows, width in fused} == every


def test_decode_num_splits_fills_the_gpu_from_static_shapes_only() -> None:
    # Batch 1, long context: as many splits as allowed.
    assert decode_num_splits(1, 8, 40960, 64, num_sms=132) == MAX_NUM_SPLITS
    # Large batches already fill the GPU: no split.
    assert decode_num_splits(256, 8, 40960, 64, num_sms=132) == 1
    # Never more chunks than key tiles in the longest possible context.
    assert decode_num_splits(1, 8, 100, 64, num_sms=132) == 2
    assert decode_num_splits(2, 8, 40960, 64, num_sms=132) == 33  # cdiv(132 * 4, 16)


def test_launch_settings_follow_batch_size_cache_dtype_and_shared_memory(monkeypatch) -> None:
    gpu = torch.device("cpu")  # off-GPU, the shared memory of an H100/H200 is assumed
    # Large batches: 128-key tiles where two stages of K and V fit; float32 tiles are twice the bytes.
    launch, splits = choose_launch(256, 8, 128, 4096, 2, gpu, num_sms=132)
    assert launch == decode_launch.WIDE and splits == 1
    assert choose_launch(256, 8, 128, 4096, 4, gpu, num_sms=132)[0] == decode_launch.NARROW
    assert choose_launch(256, 8, 256, 4096, 2, gpu, num_sms=132)[0] == decode_launch.HEAD_DIM_256
    # An fp8 cache: five stages of 64-key tiles (two K/V buffers); two KV heads a program where that still
    # leaves PROGRAMS_PER_SM programs an SM at one chunk a context.
    assert choose_launch(128, 8, 128, 4096, 1, gpu, num_sms=132) == (decode_launch.FP8_LARGE_BATCH, 1)
    assert choose_launch(132, 8, 128, 4096, 1, gpu, num_sms=132) == (decode_launch.FP8_PACKED, 1)
    assert choose_launch(256, 7, 128, 4096, 1, gpu, num_sms=132)[0] == decode_launch.FP8_LARGE_BATCH
    # A small batch with many chunks per context: the latency-bound settings of its cache dtype, and
    # the chunk count of their tile.
    for element_size in (2, 1):
        launch, splits = choose_launch(1, 8, 128, 4096, element_size, gpu, num_sms=132)
        assert launch == decode_launch.SMALL_BATCH[element_size]
        assert splits == decode_num_splits(1, 8, 4096, launch.block_n, num_sms=132)
    # A short context leaves few chunks even at batch 1: the large-batch settings.
    assert choose_launch(1, 8, 128, 256, 2, gpu, num_sms=132)[0] == decode_launch.WIDE
    # A GPU with less shared memory gets tiles that fit.
    monkeypatch.setattr(decode_launch, "max_shared_memory", lambda device: 100 * 1024)
    decode_launch._large_batch_launch.cache_clear()
    try:
        assert choose_launch(256, 8, 128, 4096, 2, gpu, num_sms=132)[0] == decode_launch.NARROW
        assert choose_launch(256, 8, 128, 4096, 1, gpu, num_sms=132)[0] == decode_launch.WIDE
    finally:
        decode_launch._large_batch_launch.cache_clear()


def test_tile_form_per_cache_and_query(monkeypatch) -> None:
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert decode_words.tile_form(fp8, bf16) == decode_words.tile_form(fp8, torch.float16) == "words"
    assert decode_words.tile_form(fp8, torch.float32) == "cast"  # a float32 q widens the tiles to float32
    assert decode_words.tile_form(bf16, bf16) == "cast"
    monkeypatch.setattr(decode_words, "INT8_WORDS", False)
    assert decode_words.tile_form(torch.int8, bf16) == "cast"
    monkeypatch.setattr(decode_words, "INT8_WORDS", True)
    assert decode_words.tile_form(torch.int8, bf16) == "words"
    assert decode_words.tile_form(torch.int8, torch.float32) == "cast"


def test_register_cap_only_for_fp8_words_at_the_wide_launch() -> None:
    cap = decode_launch.WORDS_MAXNREG
    assert decode_launch.WIDE.options(words=True) == dict(num_warps=4, num_stages=2, maxnreg=cap)
    assert "maxnreg" not in decode_launch.WIDE.options(words=False)
    assert "maxnreg" not in decode_launch.SMALL_BATCH[1].options(words=True)  # latency-bound: no cap


def test_decode_sweep_forces_the_launch_a_decode_call_takes(monkeypatch) -> None:
    """scripts/decode_sweep.py times a setting by standing in for decode_launch.choose_launch, so a decode
    call must take its launch from there: when the choice moved (a57bf84), a stand-in put elsewhere
    timed the engine's own setting under every name (docs/performance-notes.md, "Decode attention at large
    batches")."""
    path = Path(__file__).parents[2] / "scripts" / "decode_sweep.py"
    spec = importlib.util.spec_from_file_location("decode_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    asked = []
    setting = dict(BLOCK_N=32, NUM_WARPS=2, NUM_STAGES=3, PROGRAMS_PER_SM=decode_launch.PROGRAMS_PER_SM)
    monkeypatch.setattr(decode_launch, "choose_launch", sweep.forced(setting, asked))
    q = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 256, 8, 128, dtype=torch.bfloat16)
    call = decode_launch.DecodeCall.prepare(q, cache, cache, torch.ones(2, dtype=torch.int32),
                                            torch.zeros(2, 2, dtype=torch.int32), None, None, None, None)
    assert asked == [setting]
    assert call.launch == decode_launch.DecodeLaunch(32, 2, 3)


def test_decode_sweep_refuses_heads_that_do_not_group() -> None:
    """`--heads Q KV` (another model's GQA group) is checked before the script asks for a GPU."""
    path = Path(__file__).parents[2] / "scripts" / "decode_sweep.py"
    done = subprocess.run([sys.executable, str(path), "--heads", "32", "5"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "do not split into 5 KV heads" in done.stderr
