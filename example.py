"""Chat with a model: two prompts through the chat template, greedy-ish sampling, printed replies.

    python example.py [--model PATH]
"""

import argparse
import os

from nanovllm import LLM, SamplingParams

DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B/"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face model folder")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    llm = LLM(os.path.expanduser(args.model), enforce_eager=True, tensor_parallel_size=1)
    sampling_params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    outputs = llm.chat(conversations, sampling_params)
    for prompt, output in zip(prompts, outputs, strict=True):
        print("\n")
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")


if __name__ == "__main__":
    main()
