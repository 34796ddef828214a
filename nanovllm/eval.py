"""`python -m nanovllm.eval ...`: lm-evaluation-harness's CLI with the "nanovllm" model registered
(lm-eval's own `lm_eval` command cannot discover models from other packages). Takes exactly lm-eval's
arguments; `--help` prints nanovllm's usage (USAGE) before lm-eval's."""

import sys

USAGE = """\
nanovllm's model for lm-evaluation-harness:

    python -m nanovllm.eval --model nanovllm --model_args pretrained=MODEL[,OPTION=VALUE...] \\
        --tasks TASK[,TASK...] [lm-eval's options, e.g. --limit 100 --output_path results/]

MODEL is a Hugging Face model folder, a .gguf file, or smollm2. model_args:
  max_length=N     the tokens a scored sequence conditions on, as lm-eval's hf model
                   (default: max_model_len - 2, the most that fits)
  max_gen_toks=N   generated tokens when a task sets none (256)
  add_bos_token=B  prepend BOS when tokenizing (False)
  any LLM option   max_model_len=4096, dtype=float32, tensor_parallel_size=2, ...
--device cuda or cpu; without it, the GPU where there is one, else the CPU. --batch_size is ignored
(continuous batching). Example, on a CPU:

    python -m nanovllm.eval --model nanovllm --model_args pretrained=smollm2,max_model_len=2048 \\
        --tasks lambada_openai --limit 20

lm-eval's usage follows; `python -m nanovllm.eval run --help` lists every option of a run.
"""


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(USAGE)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit("lm-eval is not installed: pip install 'nanovllm[lm_eval]'") from e
    import nanovllm.integrations.lm_eval  # noqa: F401  (registers the "nanovllm" model)
    cli_evaluate()


if __name__ == "__main__":
    main()
