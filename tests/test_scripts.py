"""The scripts under scripts/ (benchmarks and checks) still import against the package: most
run only on a GPU, so nothing else in CPU CI would notice a name they use moving (startup_bench.py
imported the model runner from engine/ for a whole round after the restructure moved it to runner/)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
# A child that sees no GPU: the scripts' CPU paths (float32, the fp8 references), whatever the machine has.
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run_on_cpu(command: list[str]) -> subprocess.CompletedProcess:
    """command from the checkout's root, as typed there, with the GPU hidden."""
    return subprocess.run(command, cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=300,
                          env=CPU_ONLY)


# One child process imports every script as `python scripts/NAME.py` would (scripts/ first on sys.path,
# main() not run), so that what they put on sys.path and in sys.modules stays out of the test session.
IMPORT_ALL = """
import importlib.util, pathlib, sys, traceback
scripts = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(scripts))
for path in sorted(scripts.glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException:
        print(f"{path.name}: {traceback.format_exc(limit=-1).strip()}")
"""


def test_every_script_imports_on_cpu() -> None:
    assert len(list(SCRIPTS.glob("*.py"))) > 10
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(SCRIPTS)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", f"scripts that fail to import:\n{done.stdout}"


def test_every_script_has_a_line_in_the_readme() -> None:
    """scripts/ holds what users and maintainers run, and README's "Scripts" list says what each is for;
    a one-off probe belongs in docs/performance-notes.md (its result, with the commit), not here."""
    readme = (SCRIPTS.parent / "README.md").read_text()
    listed = readme.split("\n## Scripts\n", 1)[1].split("\n## ", 1)[0]
    missing = sorted(path.name for path in SCRIPTS.glob("*.py") if f"scripts/{path.name}" not in listed)
    assert not missing, f"scripts without a line in README's Scripts list: {missing}"


def test_stream_latency_runs_as_typed_with_speculation(qwen3_dir):
    """`python scripts/stream_latency.py` on a tiny model (CPU), n-gram drafts on its copy workload."""
    done = subprocess.run([sys.executable, "scripts/stream_latency.py", "--model", qwen3_dir,
                           "--prompt-len", "32", "--output-len", "16", "--workload", "copy",
                           "--label", "tiny", "--no-async-scheduling", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 2}'],
                          cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tiny single stream (copy): 16 tok in" in done.stdout and "ms/token" in done.stdout


def test_stream_latency_runs_on_random_weights_from_a_config(tmp_path):
    """`--load-format dummy`: a config.json alone (no tokenizer, no weights), as benchmarks size 8B; one
    stream, and `--streams N` (N random prompts at once, ms a decode step)."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, architectures=["Qwen3ForCausalLM"]
                ).save_pretrained(tmp_path)
    command = [sys.executable, "scripts/stream_latency.py", "--model", str(tmp_path),
               "--load-format", "dummy", "--prompt-len", "32", "--output-len", "16", "--label", "dummy"]
    done = subprocess.run(command, cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dummy single stream (random): 16 tok in" in done.stdout
    streams = subprocess.run(command + ["--streams", "3"], cwd=SCRIPTS.parent, capture_output=True, text=True,
                             timeout=300)  # BENCHMARKS.md's "16 streams" workload, smaller
    assert streams.returncode == 0, streams.stderr[-2000:]
    assert "dummy 3 streams (random): 48 tok in" in streams.stdout and "ms/step" in streams.stdout
    copying = subprocess.run(command + ["--streams", "2", "--workload", "copy"], cwd=SCRIPTS.parent,
                             capture_output=True, text=True, timeout=300)
    assert copying.returncode == 2 and "runs the random workload" in copying.stderr
    chat = subprocess.run(command + ["--workload", "summarize"], cwd=SCRIPTS.parent, capture_output=True,
                          text=True, timeout=300)
    assert chat.returncode == 2 and "needs the model's tokenizer" in chat.stderr


def test_stream_latency_repeating_weights_accept_every_ngram_draft(tmp_path):
    """`--repeating --load-format dummy --workload copy`: greedy output repeats its last token, so every
    n-gram draft is accepted (the measurement of speculation with every proposal right), and a draft model
    given in --speculative-config is drawn the same way, so its proposals are accepted too."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, architectures=["Qwen3ForCausalLM"]
                ).save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "scripts/stream_latency.py", "--model", str(tmp_path),
                           "--load-format", "dummy", "--repeating", "--workload", "copy", "--prompt-len",
                           "32", "--output-len", "24", "--no-async-scheduling", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'],
                          cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    accepted, drafted = re.search(r"drafts accepted (\d+) / (\d+)", done.stdout).groups()
    assert int(drafted) > 0 and accepted == drafted
    # The synchronous loop above (the default on a CPU only); now the overlap loop, CUDA's default.
    overlap_args = [("--async-scheduling" if arg == "--no-async-scheduling" else arg) for arg in done.args]
    overlapped = subprocess.run(overlap_args, cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=300)
    assert overlapped.returncode == 0, overlapped.stderr[-2000:]
    # Proposed past a pending token (a guess at the prompt's end), its drafts differ; most are kept.
    accepted, drafted = map(int, re.search(r"drafts accepted (\d+) / (\d+)", overlapped.stdout).groups())
    assert "single stream (copy): 24 tok in" in overlapped.stdout and accepted > drafted / 2
    draft_model = json.dumps({"model": str(tmp_path), "num_speculative_tokens": 3})  # draft = target
    with_draft = subprocess.run(done.args[:-1] + [draft_model], cwd=SCRIPTS.parent, capture_output=True,
                                text=True, timeout=300)
    assert with_draft.returncode == 0, with_draft.stderr[-2000:]
    # The draft is drawn repeating too (plain random weights would propose other tokens).
    accepted, drafted = re.search(r"drafts accepted (\d+) / (\d+)", with_draft.stdout).groups()
    assert int(drafted) > 0 and accepted == drafted
    refused = subprocess.run([sys.executable, "scripts/stream_latency.py", "--model", str(tmp_path),
                              "--repeating"], cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "add --load-format dummy" in refused.stderr


def test_fp8_quality_runs_as_typed(tmp_path):
    """`python scripts/fp8_quality.py` on a tiny config (CPU: float32, the fp8 reference paths)."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256).save_pretrained(tmp_path)
    done = run_on_cpu([sys.executable, "scripts/fp8_quality.py", "--config", str(tmp_path), "--prompts", "2",
                       "--prompt-len", "24", "--greedy-tokens", "4"])
    assert done.returncode == 0, done.stderr[-2000:]
    header, *rows = done.stdout.strip().splitlines()[-9:]
    assert header.startswith("path") and "greedy equal of 4" in header
    names = [row[:18].strip() for row in rows]
    assert names == ["bf16", "fp8 weights", "fp8 KV cache", "fp8 weights + KV", "int8 KV cache",
                     "fp8 blocks ckpt", "fp8 static ckpt", "fp8 KV calibrated"]
    # The reference path against itself: no error, every greedy token equal; fp8 weights (per channel, and
    # the block-scaled and static-scale checkpoints the script writes) err above zero.
    assert rows[0].split()[4:] == ["0.0000", "/", "0.0000", "4.0"]
    assert float(rows[1].split()[2]) > 0 and float(rows[5].split()[3]) > 0 and float(rows[6].split()[3]) > 0
    # Prefill attends over what a quantized cache holds on the CPU too: its error shows, int8's below fp8's.
    fp8_kv, int8_kv = (float(row[18:].split()[0]) for row in rows[2:5:2])
    assert 0 < int8_kv < fp8_kv
    assert float(rows[7][18:].split()[0]) > 0  # the fp8 cache with the checkpoint's calibrated scales


def test_fp8_quality_shrinks_a_config_with_overrides_as_typed():
    """`--override` makes a small model of a family: Qwen3-30B-A3B's config cut to two layers of eight
    experts, its fp8 experts through the CPU's reference (with static scales too); a field the config
    lacks is refused."""
    tiny = ["vocab_size=256", "hidden_size=64", "num_hidden_layers=2", "num_attention_heads=4",
            "num_key_value_heads=2", "head_dim=16", "moe_intermediate_size=32", "num_experts=8",
            "num_experts_per_tok=2", "max_position_embeddings=256"]
    command = [sys.executable, "scripts/fp8_quality.py", "--config", "configs/Qwen3-30B-A3B", "--prompts",
               "2", "--prompt-len", "24", "--greedy-tokens", "4", "--paths", "fp8 weights", "--override"]
    done = run_on_cpu(command + tiny)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = done.stdout.strip().splitlines()[-2:]
    assert [row[:18].strip() for row in rows] == ["bf16", "fp8 weights"]
    assert float(rows[1].split()[2]) > 0  # fp8 experts and projections err above the exact path
    refused = run_on_cpu(command + ["num_expertz=8"])
    assert refused.returncode != 0 and "no field 'num_expertz'" in refused.stderr
    static = [*command[:-2], "fp8 static ckpt", "--override", *tiny]  # each expert calibrated on its rows
    done = run_on_cpu(static)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1].split()[3]) > 0


def test_fp8_quality_on_a_trained_model_as_typed():
    """`--model smollm2`: SmolLM2-135M's weights (its GGUF file dequantized, then rounded to bf16 once) and
    prompts cut from the checkout's text; fp8 weights and the fp8 cache err above the exact path, int8's
    cache below fp8's. Random weights' options are refused beside it."""
    from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, embedded_model_path

    if embedded_model_path() is None:
        pytest.skip(f"SmolLM2 is not installed: {EMBEDDED_INSTALL}")
    command = [sys.executable, "scripts/fp8_quality.py", "--model", "smollm2", "--prompts", "1",
               "--prompt-len", "32", "--greedy-tokens", "2", "--paths", "fp8 weights", "fp8 KV cache",
               "int8 KV cache"]
    done = run_on_cpu(command)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row[:18].strip(): float(row[18:].split()[0]) for row in done.stdout.strip().splitlines()[-4:]}
    assert rows["bf16"] == 0 and rows["fp8 weights"] > 0 and 0 < rows["int8 KV cache"] < rows["fp8 KV cache"]
    refused = run_on_cpu(command + ["--override", "num_hidden_layers=2"])
    assert refused.returncode != 0 and "--model brings its own" in refused.stderr


@pytest.mark.parametrize("extra", [[], ["--speculate", "--structured", "--kv-cache-dtype", "int8"]],
                         ids=["plain", "speculate-structured-int8"])
def test_soak_runs_as_typed(extra):
    """`python scripts/soak.py` for a few seconds: requests, aborts, bad inputs and the invariants after
    every step; with --speculate, n-gram drafts verified in the overlap loop, beside constrained requests
    (--structured: those that complete pass their constraint) over an int8 KV cache."""
    done = subprocess.run([sys.executable, "scripts/soak.py", "--minutes", "0.1", *extra], cwd=SCRIPTS.parent,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.rstrip().endswith("OK")
    counts = dict(re.findall(r"^(added|finished|aborted)\s+(\d+)$", done.stdout, re.MULTILINE))
    assert int(counts["added"]) == int(counts["finished"]) + int(counts["aborted"]) > 0
    if extra:
        accepted, drafted = map(int, re.search(r"drafts accepted\s+(\d+) of (\d+)", done.stdout).groups())
        assert drafted > 0 and accepted > 0
        assert int(re.search(r"^constrained, complete\s+(\d+)$", done.stdout, re.MULTILINE).group(1)) > 0
        assert "KV cache 256 tokens (int8)" in done.stderr + done.stdout


# README's commands for scripts that run on the CPU, as typed there, and a line their output ends with.
CPU_AS_TYPED = {"sched_overhead.py": "ms per decode step at 256 requests",
                "listen_check.py": "0 beyond loopback",
                "decode_sass.py": "int8-words-n64"}


@pytest.mark.parametrize("script", CPU_AS_TYPED)
def test_cpu_scripts_run_as_typed(script):
    done = subprocess.run([sys.executable, f"scripts/{script}"], cwd=SCRIPTS.parent, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert CPU_AS_TYPED[script] in done.stdout.strip().splitlines()[-1]


# README's commands for the scripts that time or check GPU work, as typed there.
GPU_ONLY = ["fp8_gemm_bench.py", "kernel_profile.py --batch 1 --batch 256", "race_bench.py",
            "prefill_sweep.py", "overlap_check.py check speed", "host_bound.py", "sampling_bench.py",
            "step_profile.py", "compile_watch.py", "tp_check.py --model configs/Qwen3-8B", "dp_check.py",
            "rows_sweep.py", "w8a8_sweep.py"]


def test_gpu_scripts_say_they_need_a_gpu_as_typed():
    """On a machine without a CUDA GPU each says so and exits, before it loads a model (tp_check's 8B in
    float32 would not fit this machine's memory): no traceback. Run side by side: each only starts up."""
    running = {command: subprocess.Popen([sys.executable, *("scripts/" + command).split()],
                                         cwd=SCRIPTS.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=CPU_ONLY)
               for command in GPU_ONLY}
    for command, process in running.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode in (1, 2) and "CUDA GPU" in stderr, (command, stderr[-2000:])
        assert "Traceback" not in stderr, command


def test_gpu_only_benchmarks_refuse_the_cpu_and_bad_options_as_typed():
    """`python scripts/moe_bench.py --fp8 block` and `scripts/spec_cycle.py` (with a draft, and plain decode
    steps of five streams) say they need a GPU; an unknown --fp8 is refused."""
    cycle = subprocess.run([sys.executable, "scripts/spec_cycle.py", "--model", "configs/Qwen3-8B", "--draft",
                            "configs/Qwen3-0.6B", "--load-format", "dummy", "--repeating", "--k", "4"],
                           cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=120,
                           env=CPU_ONLY)
    assert cycle.returncode == 2 and "run it on a CUDA GPU" in cycle.stderr
    plain = subprocess.run([sys.executable, "scripts/spec_cycle.py", "--model", "configs/Qwen3-8B",
                            "--load-format", "dummy", "--streams", "5"], cwd=SCRIPTS.parent,
                           capture_output=True, text=True, timeout=120,
                           env=CPU_ONLY)
    assert plain.returncode == 2 and "run it on a CUDA GPU" in plain.stderr
    run = [sys.executable, "scripts/moe_bench.py"]
    done = subprocess.run(run + ["--fp8", "block"], cwd=SCRIPTS.parent, capture_output=True, text=True,
                          timeout=120, env=CPU_ONLY)
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr
    bad = subprocess.run(run + ["--fp8", "tensor"], cwd=SCRIPTS.parent, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'tensor'" in bad.stderr
