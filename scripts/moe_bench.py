"""The MoE layer of Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert intermediate 768, bf16) on one
CUDA GPU: the Triton fused path vs the torch path at decode batch 1, 64 and 256, as achieved memory
bandwidth beside a plain device-to-device copy. Needs only torch and triton (no flash-attn):

    python scripts/moe_bench.py          # about 1-2 minutes on an H200, mostly compiling

Bandwidth = bytes of expert weights the batch's routing touches (each expert hit once: its gate, up and
down rows) / time. Triton is timed as decode runs it, replayed from a CUDA graph, each call reading a
different layer's weights so they come from HBM, not L2 ("+routing": the whole block, router matmul and
routing kernel included, as decode runs it); the torch path (a host sync per call, so no
graph) is timed eagerly with CUDA events. Routing: softmax top-8 over random router logits, renormalised.
After the table, a few alternative MoeConfigs per batch are timed, to show where moe_config could be
tuned. Last, an engine check: a tiny random Qwen3-MoE through LLM with CUDA graphs (float32) must give
transformers' greedy tokens. Writes the results as JSON to $OUT/moe_bench.json when $OUT is set.

    python scripts/moe_bench.py --fp8 channel    # e4m3 experts, one scale a row (--quantization fp8)
    python scripts/moe_bench.py --fp8 block      # e4m3 experts, a scale a row and 128 inputs (checkpoints)

--fp8: the same table for fp8 experts (W8A16: read as e4m3, widened in registers), bytes counted at one a
weight plus the scales; max |diff| against the torch path on the dequantized weights. The alternatives
then include K tiles as wide in bytes as bf16's (where the scale group allows) and W8A8 (x and the
intermediate quantized to e4m3 per token and group, e4m3 dots: `MoeConfig(..., w8a8=True)`; per channel
also chained over the whole K: `fast_accum=True`) and W8A16 over float16 rows (`MoeConfig(..., f16=True)`:
the weights widen to float16, cheaper on sm_90 than to bf16, the activations as float16 times a power of
two a row, exactly); every run also tries swap_ab (the weight tile as the tensor cores' 64-row operand).
"""

import argparse
import json
import os
import sys
from dataclasses import astuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.fused_moe import MoeConfig, fused_moe, moe_config  # noqa: E402
from nanovllm.kernels.moe_launch import SOME_SLOTS_PER_EXPERT  # noqa: E402
from nanovllm.layers.fp8 import dequantize, quantize_groups  # noqa: E402
from nanovllm.layers.fused_moe import route, torch_moe  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768
BATCHES = [1, 64, 256]
# Layers' worth of expert weights the graph cycles through: 4 x 1.2 GB, far beyond the 50 MB L2.
NUM_LAYERS = 4
GRAPH_REPLAYS = 10
TORCH_ITERS = 5
COPY_BYTES = 1 << 30
DTYPE = torch.bfloat16
ALTERNATIVES = [MoeConfig(16, 64, 128, 4, 4), MoeConfig(16, 128, 64, 4, 4), MoeConfig(32, 64, 64, 4, 4),
                MoeConfig(32, 128, 64, 4, 3), MoeConfig(64, 128, 64, 8, 3), MoeConfig(16, 32, 256, 4, 3)]
# The weight tile on wgmma's 64-row side (swap_ab): blocks of 16-32 rows take mma.sync otherwise.
SWAP_AB_ALTERNATIVES = [MoeConfig(16, 64, 64, 4, 4, True), MoeConfig(16, 128, 64, 4, 4, True),
                        MoeConfig(32, 64, 64, 4, 4, True), MoeConfig(32, 128, 64, 4, 3, True)]
# fp8 experts: K tiles of bf16's bytes (twice the inputs), where the scale group allows them.
FP8_ALTERNATIVES = [MoeConfig(16, 64, 256, 4, 4), MoeConfig(32, 64, 128, 4, 4), MoeConfig(16, 32, 256, 4, 4),
                    MoeConfig(64, 128, 128, 8, 3), MoeConfig(16, 64, 128, 4, 4, True),
                    MoeConfig(32, 64, 128, 4, 4, True), MoeConfig(16, 128, 128, 4, 4, True)]
# fp8 experts W8A8 (x and the intermediate quantized, e4m3 dots).
W8A8_ALTERNATIVES = [MoeConfig(16, 64, 128, 4, 4, True, True), MoeConfig(32, 64, 128, 4, 4, True, True),
                     MoeConfig(16, 128, 128, 4, 4, True, True), MoeConfig(32, 128, 128, 4, 3, True, True),
                     MoeConfig(32, 64, 128, 4, 4, w8a8=True), MoeConfig(64, 128, 128, 4, 3, w8a8=True),
                     MoeConfig(16, 64, 128, 4, 4, True, True, fast_accum=True),
                     MoeConfig(32, 64, 128, 4, 4, True, True, fast_accum=True)]
# fp8 experts W8A16 over float16 rows (x and the intermediate as float16 times a power of two a row, the
# weight tiles widened to float16: the same products as widening to bf16).
F16_ALTERNATIVES = [MoeConfig(16, 64, 128, 4, 4, True, f16=True), MoeConfig(32, 64, 128, 4, 4, True,
                                                                                  f16=True),
                    MoeConfig(16, 128, 128, 4, 4, True, f16=True), MoeConfig(32, 64, 128, 4, 4, f16=True),
                    MoeConfig(64, 128, 128, 4, 3, f16=True)]
# Prefill-sized batches (as many slots an expert as moe_config's 64-row blocks take): larger tiles.
PREFILL_ALTERNATIVES = [MoeConfig(64, 128, 64, 4, 4), MoeConfig(128, 128, 64, 8, 3),
                        MoeConfig(128, 128, 64, 8, 4), MoeConfig(128, 64, 64, 4, 4),
                        MoeConfig(64, 256, 64, 8, 3)]
PREFILL_W8A8_ALTERNATIVES = [
    MoeConfig(64, 128, 64, 8, 3, w8a8=True), MoeConfig(64, 128, 128, 8, 3, w8a8=True),
    MoeConfig(64, 128, 128, 4, 4, w8a8=True), MoeConfig(128, 128, 128, 8, 3, w8a8=True),
    MoeConfig(128, 128, 128, 8, 4, w8a8=True), MoeConfig(128, 64, 128, 4, 4, w8a8=True),
    MoeConfig(64, 256, 128, 8, 3, w8a8=True), MoeConfig(64, 256, 128, 8, 3, w8a8=True, fast_accum=True),
    MoeConfig(128, 128, 128, 8, 4, w8a8=True, fast_accum=True)]
# --fp8's scale group along K: one a row (the whole K), or 128 inputs (block-scaled checkpoints).
FP8_GROUPS = {"channel": (HIDDEN, INTERMEDIATE), "block": (128, 128)}


def elapsed_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_us(fn, layers) -> float:
    """Microseconds per layer of fn(layer), replayed from a graph that runs it over every layer."""
    fn(layers[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(layer) for layer in layers]
    graph.replay()
    us = elapsed_us(graph.replay, GRAPH_REPLAYS) / len(layers)
    del outs, graph
    return us


def triton_us(x, layers, topk_weights, topk_ids, config: MoeConfig | None) -> float:
    return graph_us(lambda layer: fused_moe(x, *layer, topk_weights, topk_ids, config, **layer.fp8), layers)


def with_routing_us(x, layers, router: torch.Tensor) -> float:
    """The whole MoE block as decode runs it: router matmul, routing kernel, experts."""
    def block(layer):
        topk_weights, topk_ids = route(F.linear(x, router), TOP_K, True)
        return fused_moe(x, *layer, topk_weights, topk_ids, **layer.fp8)

    return graph_us(block, layers)


class Layer(tuple):
    """One layer's (w13, w2) as fused_moe takes them; `fp8` holds an fp8 layer's scales and groups
    (empty for bf16), `dense` its weights as the torch path's reference reads them."""

    fp8: dict
    dense: tuple[torch.Tensor, torch.Tensor]


def make_layer(w13: torch.Tensor, w2: torch.Tensor, fp8: str | None) -> Layer:
    if fp8 is None:
        layer = Layer((w13, w2))
        layer.fp8, layer.dense = {}, (w13, w2)
        return layer
    g13, g2 = FP8_GROUPS[fp8]
    (q13, s13), (q2, s2) = quantize_groups(w13, g13), quantize_groups(w2, g2)
    layer = Layer((q13.contiguous(), q2.contiguous()))
    layer.fp8 = dict(w13_scale=s13, w2_scale=s2, scale_groups=(g13, g2))
    layer.dense = (dequantize(q13, s13, g13).to(w13.dtype), dequantize(q2, s2, g2).to(w2.dtype))
    return layer


def copy_gbps() -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = elapsed_us(lambda: dst.copy_(src), 10)
    return 2 * COPY_BYTES / us / 1e3  # read + write


def engine_check() -> dict:
    """A tiny random Qwen3-MoE (8 experts, top-2, one dense layer) through the whole engine on this GPU
    with CUDA graphs, in float32: greedy tokens must equal transformers' on the same weights."""
    import tempfile

    import transformers

    from nanovllm import LLM, SamplingParams

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=512, initializer_range=0.25)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).float().cuda().eval()
    prompts = [[(7 * i + j) % 512 for j in range(5 + 9 * i)] for i in range(4)]
    max_tokens = 32
    with torch.no_grad():
        reference = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        del hf
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kvcache_block_size=16, max_model_len=256,
                  max_num_seqs=8, gpu_memory_utilization=0.3)
        decode_graphs = llm.engine.executor.decode_graphs
        graphs = decode_graphs is not None and bool(decode_graphs.graphs)
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        llm.exit()
    same = [o["token_ids"] == r for o, r in zip(outputs, reference, strict=True)]
    print(f"\nengine check (tiny Qwen3-MoE, float32, CUDA graphs captured: {graphs}): greedy tokens equal to "
          f"transformers for {sum(same)}/{len(same)} prompts")
    return dict(cuda_graphs=graphs, prompts_equal=sum(same), prompts=len(same))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fp8", choices=sorted(FP8_GROUPS), default=None,
                        help="fp8 experts, scaled per row (channel) or per row and 128 inputs (block)")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                        help="tokens a call (default: 1 64 256); from 32 slots an expert (512 tokens: "
                             "prefill) the alternatives are prefill tiles")
    parser.add_argument("--no-engine-check", action="store_true", help="skip the tiny-model engine check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    gen = dict(device="cuda", dtype=DTYPE)
    layers = [make_layer(torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, **gen) * 0.02,
                         torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, **gen) * 0.02, args.fp8)
              for _ in range(NUM_LAYERS)]
    expert_bytes = 3 * INTERMEDIATE * HIDDEN * torch.finfo(DTYPE).bits // 8
    if args.fp8:  # a byte a weight, and each row's float32 scales
        g13, g2 = FP8_GROUPS[args.fp8]
        scales = 2 * INTERMEDIATE * -(-HIDDEN // g13) + HIDDEN * -(-INTERMEDIATE // g2)
        expert_bytes = 3 * INTERMEDIATE * HIDDEN + 4 * scales
    print(f"experts: {args.fp8 or 'bf16'}")
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy:,.0f} GB/s\n")
    print(f"{'batch':>5} {'experts':>7} {'MB':>6} | {'triton us':>9} {'GB/s':>6} {'of copy':>7} | "
          f"{'torch us':>9} {'GB/s':>6} | {'+routing us':>11} | {'max |diff|':>10}  config")
    router = torch.randn(NUM_EXPERTS, HIDDEN, **gen) * 0.02
    rows, inputs = [], {}
    for batch in args.batches:
        x = torch.randn(batch, HIDDEN, **gen)
        topk_weights, topk_ids = route(torch.randn(batch, NUM_EXPERTS, device="cuda"), TOP_K, True)
        inputs[batch] = x, topk_weights, topk_ids
        touched = torch.unique(topk_ids).numel() * expert_bytes
        config = moe_config(batch * TOP_K, NUM_EXPERTS, DTYPE, fp8_weights=bool(args.fp8))
        t_us = triton_us(x, layers, topk_weights, topk_ids, config)
        block_us = with_routing_us(x, layers, router)
        w13, w2 = layers[0].dense  # the torch path reads bf16 (dequantized fp8) weights
        torch_moe(x, w13, w2, topk_weights, topk_ids)
        torch.cuda.synchronize()
        # One layer's weights only: the torch path sees L2 hits the Triton timing does not (favours torch).
        r_us = elapsed_us(lambda: torch_moe(x, w13, w2, topk_weights, topk_ids), TORCH_ITERS)  # noqa: B023
        diff = (fused_moe(x, *layers[0], topk_weights, topk_ids, **layers[0].fp8).float()
                - torch_moe(x, w13, w2, topk_weights, topk_ids).float()).abs().max().item()
        row = dict(batch=batch, experts=touched // expert_bytes, mb=touched / 1e6, triton_us=t_us,
                   triton_gbps=touched / t_us / 1e3, torch_us=r_us, torch_gbps=touched / r_us / 1e3,
                   block_us=block_us, max_abs_diff=diff, config=astuple(config), copy_gbps=copy)
        rows.append(row)
        print(f"{batch:>5} {row['experts']:>7} {row['mb']:>6.0f} | {t_us:>9.1f} {row['triton_gbps']:>6.0f} "
              f"{row['triton_gbps'] / copy:>7.0%} | {r_us:>9.1f} {row['torch_gbps']:>6.0f} | "
              f"{block_us:>11.1f} | {diff:>10.2e}  {astuple(config)}")
    print("\nalternative configs (block_m, block_n, block_k, num_warps, num_stages, swap_ab, w8a8, f16, "
          "fast_accum): us per layer")
    for row in rows:
        batch = row["batch"]
        x, topk_weights, topk_ids = inputs[batch]
        if batch * TOP_K / NUM_EXPERTS >= SOME_SLOTS_PER_EXPERT:
            candidates = PREFILL_W8A8_ALTERNATIVES if args.fp8 else PREFILL_ALTERNATIVES
        else:
            candidates = ALTERNATIVES + SWAP_AB_ALTERNATIVES + (
                FP8_ALTERNATIVES + W8A8_ALTERNATIVES + F16_ALTERNATIVES if args.fp8 else [])
        group = FP8_GROUPS["block"][0] if args.fp8 == "block" else None  # K tiles must split a group
        row["alternatives"] = {str(astuple(c)): triton_us(x, layers, topk_weights, topk_ids, c)
                               for c in candidates
                               if group is None or (group % c.block_k == 0 and not c.fast_accum)}
        best = min(row["alternatives"].items(), key=lambda kv: kv[1])
        tflops = 2 * batch * TOP_K * 3 * INTERMEDIATE * HIDDEN / 1e6  # TFLOP/s at 1 us
        print(f"batch {batch:>3}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["alternatives"].items())
              + f"  -> best {best[0]} {best[1]:.1f} us, {tflops / best[1]:.0f} TFLOP/s (default "
              f"{row['triton_us']:.1f}, {tflops / row['triton_us']:.0f})")
    del layers
    torch.cuda.empty_cache()
    engine = None if args.no_engine_check else engine_check()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_bench.json"), "w") as f:
            json.dump({"experts": args.fp8 or "bf16", "layer": rows, "engine": engine}, f, indent=1)


if __name__ == "__main__":
    main()
