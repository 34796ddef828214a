"""Every path that can change numerics gives the torch backend's greedy output: the Triton backend
(in Triton's interpreter on CPU, or on a GPU with TRITON_INTERPRET=0) with prefix caching and chunked
prefill, and decode through the padded static buffers that CUDA graphs replay. float32 throughout, so
that the comparison is token-exact on either device."""

import logging

import pytest
import torch
from conftest import PROMPTS, triton_test_device

from nanovllm import LLM, SamplingParams
from nanovllm.runner.cuda_graph import DecodeGraphs, graph_batch_sizes

pytest.importorskip("triton")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# A fixed KV cache (8 sequences x 32 blocks) rather than a share of free GPU memory: on a GPU, test
# workers running side by side would each see the others' allocations and size theirs from what is left.
OPTIONS = dict(kvcache_block_size=4, max_model_len=128, max_num_seqs=8, dtype="float32", enforce_eager=True,
               num_kvcache_blocks=256)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    llm = LLM(qwen3_dir, attention_backend="torch", **OPTIONS)
    return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("extra,fused", [({}, True), ({"max_num_batched_tokens": 7}, True), ({}, False)],
                         ids=["plain", "chunked", "decode-unfused"])
def test_triton_backend_matches_torch(qwen3_dir, reference, extra, fused, monkeypatch):
    triton_test_device()  # skips where Triton can run neither interpreted nor on a GPU
    if not fused:  # these decode batches are small: take them past the fused kernel too
        from nanovllm.attention.triton_backend import DecodeBucket, TritonBackend
        monkeypatch.setattr(TritonBackend, "DECODE_BUCKETS", (DecodeBucket(None, fused=False),))
    llm = LLM(qwen3_dir, attention_backend="triton", **{**OPTIONS, **extra})
    assert llm.engine.executor.backend.name == "triton"
    first = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert first == reference
    hits = llm.engine.scheduler.block_manager.num_cache_hit_tokens
    second = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.scheduler.block_manager.num_cache_hit_tokens > hits  # prefill over a cached prefix
    assert second == reference


def test_backend_env_var_applies_when_option_is_auto(qwen3_dir, monkeypatch):
    monkeypatch.setenv("NANOVLLM_ATTENTION_BACKEND", "torch")
    assert LLM(qwen3_dir, **OPTIONS).engine.executor.backend.name == "torch"
    monkeypatch.setenv("NANOVLLM_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="attention_backend must be one of .* got 'bogus'"):
        LLM(qwen3_dir, **OPTIONS)


def test_gpu_only_backends_are_refused_on_cpu(qwen3_dir):
    for name in ("fa3", "flash-attn"):
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            LLM(qwen3_dir, attention_backend=name, device="cpu", **OPTIONS)


def test_graph_batch_ladder_covers_the_scheduler_limit():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(512)[-1] == 512 and len(graph_batch_sizes(512)) == 4 + 32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_static_buffer_decode_matches(qwen3_dir, reference, backend, caplog):
    """The CUDA-graph decode path (batch padded to a captured size, static buffers), run eagerly.
    No step may fail: a failed step is retried one sequence at a time, which would hide a bug that
    only batches of several rows hit behind correct output."""
    if backend == "triton":
        triton_test_device()
    llm = LLM(qwen3_dir, attention_backend=backend, **OPTIONS)
    runner = llm.engine.executor
    # Captured sizes [1, 4]: batches of 2 and 3 rows run padded to 4 (3 prompts, then one that
    # arrives with them: the 4-row batch fits exactly). The one-row graph holds the LM head, the other not.
    runner.decode_graphs = DecodeGraphs(runner.model, 4, 128 // 4, runner.config.hf_config.hidden_size,
                                        runner.dtype, runner.device, use_cuda_graph=False, batch_sizes=[1, 4],
                                        head_rows=1)
    graphs, padded_batches = runner.decode_graphs, []
    plain_stage = graphs.stage
    graphs.stage = lambda batch, *rest: padded_batches.append(batch.num_seqs) or plain_stage(batch, *rest)
    # The logits each replay returned (None from the 4-row graph) and those the sampler was given.
    replayed, sampled_from = [], []
    plain_replay, plain_sample = graphs.replay, runner.sampler.sample

    def replay(*args):
        out = plain_replay(*args)
        replayed.append(out.logits)
        return out

    graphs.replay = replay
    runner.sampler.sample = lambda logits, *rest: sampled_from.append(logits) or plain_sample(logits, *rest)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 6, 9)]
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)  # 3 rows, then 2, then 1
    assert {3, 2, 1} <= set(padded_batches)
    assert set(graphs.logits) == {1} and any(r is not None for r in replayed)
    # Every one-row step sampled from the very logits its graph wrote; the larger ones from the runner's.
    for logits in replayed:
        if logits is not None:
            assert any(s is logits for s in sampled_from)
    expected = [ref[:n] for ref, n in zip(reference, (12, 6, 9), strict=False)]
    assert [o["token_ids"] for o in outputs] == expected
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a step failed and was retried"


def test_float32_picks_triton_and_flash_attention_refuses_it():
    from nanovllm.attention.registry import auto_backend, select_backend

    cuda = torch.device("cuda")  # only its type is read before the dtype check: no GPU needed
    assert auto_backend(cuda) == "triton" and auto_backend(torch.device("cpu")) == "torch"
    for name in ("fa3", "flash-attn"):
        with pytest.raises(ValueError, match="bfloat16/float16 only"):
            select_backend(name, cuda, 256, torch.float32, max_num_seqs=8, num_kv_heads=2)


def test_auto_takes_fa3_prefill_only_where_fa3_reads_the_cache(monkeypatch):
    from nanovllm.attention import registry

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(registry, "_has_module", lambda name: name == "flash_attn_interface")
    assert registry.auto_backend(cuda, bf16, bf16) == "triton-fa3"
    assert registry.auto_backend(cuda, bf16, torch.float8_e4m3fn) == "triton"  # FA3 reads no fp8 cache here
    assert registry.auto_backend(cuda, torch.float32, torch.float32) == "triton"
    assert registry.auto_backend(torch.device("cpu"), bf16, bf16) == "torch"
    monkeypatch.setattr(registry, "_has_module", lambda name: False)
    assert registry.auto_backend(cuda, bf16, bf16) == "triton"
    with pytest.raises(ValueError, match="'triton-fa3' needs FlashAttention-3"):
        registry.select_backend("triton-fa3", cuda, 256, bf16, max_num_seqs=8, num_kv_heads=2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_eager_steps_match(qwen3_dir, reference, backend, monkeypatch):
    """Prefill and mixed steps padded to the bucketed token counts (what the runner does on CUDA so
    that cuBLAS meets only shapes it has seen) give the unpadded output: padding rows store no KV and
    no attention kernel reads them. Chunked prefill (7 tokens a step) makes mixed steps of many sizes."""
    import nanovllm.runner.model_runner as model_runner

    if backend == "triton":
        triton_test_device()
    llm = LLM(qwen3_dir, attention_backend=backend, max_num_batched_tokens=7, **OPTIONS)
    llm.engine.executor.pad_eager = True
    padded, plain_inputs = [], model_runner.model_inputs

    def spy(batch, device, num_padded=None):
        inputs = plain_inputs(batch, device, num_padded)
        padded.append(inputs.input_ids.shape[0] - len(batch.input_ids))
        return inputs

    monkeypatch.setattr(model_runner, "model_inputs", spy)
    padding_outputs = []  # each attention layer's output rows for the padding: zeros, not stale memory

    def record(module, args, out):
        meta = args[2]  # Attention.forward(qkv, positions, meta)
        num_real = meta.cu_seqlens_q_host[-1] if meta.is_prefill else out.shape[0]
        padding_outputs.append(out[num_real:].abs().sum().item())

    hooks = [m.register_forward_hook(record) for m in llm.engine.executor.attention_layers]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for hook in hooks:
        hook.remove()
    assert any(padded), "no step was padded"
    assert padding_outputs and not any(padding_outputs)
    assert [o["token_ids"] for o in outputs] == reference


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_piecewise_graph_steps_match(qwen3_dir, reference, backend):
    """Prefill and mixed steps through the piecewise graphs' path (runner/piecewise.py: the layers'
    halves around attention, through static buffers, padded to a captured size), run eagerly: the plain
    path's tokens, also over a cached prefix. Chunked prefill (7 tokens a step) makes mixed steps of
    sizes that pad to both captured sizes."""
    from nanovllm.runner.piecewise import PiecewiseGraphs

    if backend == "triton":
        triton_test_device()
    llm = LLM(qwen3_dir, attention_backend=backend, max_num_batched_tokens=7, **OPTIONS)
    runner = llm.engine.executor
    runner.piecewise = graphs = PiecewiseGraphs(runner.model, 7, runner.dtype, runner.device,
                                                use_cuda_graph=False, sizes=[4, 8])
    sizes, plain_run = [], graphs.run
    graphs.run = lambda inputs: sizes.append(inputs.input_ids.shape[0]) or plain_run(inputs)
    for _ in range(2):  # the second pass prefills over the first one's cached prompts
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert set(sizes) == {4, 8}
    assert llm.engine.scheduler.block_manager.num_cache_hit_tokens > 0


def test_captured_piecewise_graphs_match_on_gpu(qwen3_dir, reference):
    """On a GPU (TRITON_INTERPRET=0), the captured graphs themselves: prefill and mixed steps replayed
    piecewise give the torch backend's float32 tokens."""
    if triton_test_device() != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    llm = LLM(qwen3_dir, attention_backend="triton", max_num_batched_tokens=7,
              **{**OPTIONS, "enforce_eager": False})
    graphs = llm.engine.executor.piecewise
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_engine_defaults_on_gpu_keep_tokens_over_a_warm_prefix_cache(qwen3_dir):
    """On a GPU (TRITON_INTERPRET=0), the engine as users start it (backend chosen, decode and piecewise
    graphs captured) gives the eager torch backend's float32 tokens, on a cold cache and again over the
    cached prompts (a prompt that is all full blocks recomputes only its last token)."""
    if triton_test_device() != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2 + "The", "hello world " * 3 + "hello",
               "Paris is the capital of France. Paris is the", *PROMPTS]
    options = dict(kvcache_block_size=4, max_model_len=256, max_num_seqs=8, dtype="float32")
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)  # the prefill's own distribution
    with LLM(qwen3_dir, attention_backend="torch", enforce_eager=True, enable_prefix_caching=False,
             **options) as llm:  # every prompt computed whole
        expected = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        expected_first = [o["logprobs"][0] for o in llm.generate(prompts, first, use_tqdm=False)]
    with LLM(qwen3_dir, num_kvcache_blocks=256, **options) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        # Over the cached prompts: first the prefill's top logprobs (float32: equal to ~1e-5; a wrong K/V
        # read moves them by far more), then the tokens.
        for out, ref in zip(llm.generate(prompts, first, use_tqdm=False), expected_first, strict=True):
            got = {token: lp.logprob for token, lp in out["logprobs"][0].items()}
            want = {token: lp.logprob for token, lp in ref.items() if token in got}
            assert next(iter(ref)) in got and {t: got[t] for t in want} == pytest.approx(want, abs=1e-4)
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
