"""`python -m nanovllm.eval ...`: lm-evaluation-harness's CLI with the "nanovllm" model registered
(lm-eval's own `lm_eval` command cannot discover models from other packages). Takes exactly lm-eval's
arguments, e.g.

    python -m nanovllm.eval --model nanovllm --model_args pretrained=PATH,max_model_len=4096 \\
        --tasks hellaswag --device cuda
"""


def main() -> None:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit("lm-eval is not installed: pip install 'nanovllm[lm_eval]'") from e
    import nanovllm.integrations.lm_eval  # noqa: F401  (registers the "nanovllm" model)
    cli_evaluate()


if __name__ == "__main__":
    main()
