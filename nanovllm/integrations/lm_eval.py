"""lm-evaluation-harness model "nanovllm" (`pip install nanovllm[lm_eval]`).

lm-eval finds models in its own registry and cannot discover outside packages from its CLI, so use
`python -m nanovllm.eval` (which registers this model and then runs lm-eval's CLI):

    python -m nanovllm.eval --model nanovllm --model_args pretrained=PATH,max_model_len=4096 --tasks ...

or from Python, after `import nanovllm.integrations.lm_eval`, `lm_eval.simple_evaluate(model="nanovllm",
...)`. model_args: pretrained, max_length, max_gen_toks, add_bos_token; every other one goes to
`LLM(pretrained, ...)`. --device cuda or cpu; lm-eval's default, cuda:0, falls back to the CPU where there
is no CUDA (as lm-eval's hf model does).

max_length is hf's: a scored sequence (context + continuation) keeps its last max_length + 1 tokens, the
first of which is only context, so every token of a rolling window of max_length + 1 tokens is scored,
and generate_until keeps the context's last max_length - max_gen_toks tokens. The engine holds the whole
scored sequence as the prompt plus one sampled token, so max_length is at most max_model_len - 2, its
default: the scores equal hf's at the same max_length.

- loglikelihood: each (context, continuation) is one greedy request with max_tokens=1 and
  prompt_logprobs=1; the continuation's prompt logprobs are summed, and it is greedy when each of its
  tokens is the top-1. All requests go to the engine at once (continuous batching does the rest).
- loglikelihood_rolling: lm-eval's disjoint rolling windows, scored the same way and summed.
- generate_until: one request per context with its stop strings ("until") and sampling options."""

import logging

import lm_eval.models  # noqa: F401  (lm-eval loads its own models only into an empty registry: first)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

# Generated tokens when a generate_until task sets no max_gen_toks (lm-eval's own default).
DEFAULT_MAX_GEN_TOKS = 256
# lm-eval passes these for every model; continuous batching makes them moot here.
IGNORED_ARGS = ("batch_size", "max_batch_size")
# Positions a scored sequence needs beyond max_length: its first token (context only) and the one token
# each scoring request samples.
EXTRA_POSITIONS = 2

logger = logging.getLogger("nanovllm")


def engine_device(device: str) -> str:
    """lm-eval's device as nanovllm's `device` option. lm-eval passes cuda:0 when --device is not given;
    like lm-eval's hf model, a cuda:N falls back to the CPU where there is no CUDA ("cuda" does not)."""
    if not device.startswith("cuda"):
        return device
    import torch

    if device != "cuda" and not torch.cuda.is_available():
        logger.warning("lm-eval asked for %s, but CUDA is not available; running on the CPU", device)
        return "cpu"
    return "cuda"


@register_model("nanovllm")
class NanoVLLM(TemplateLM):
    def __init__(self, pretrained: str, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool = False,
                 device: str | None = None, **engine_options) -> None:
        super().__init__()
        for name in IGNORED_ARGS:
            engine_options.pop(name, None)
        if device is not None and "device" not in engine_options:
            engine_options["device"] = engine_device(device)
        self.llm = LLM(pretrained, **engine_options)
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise ValueError("lm-eval needs a tokenizer; do not pass skip_tokenizer_init")
        max_model_len = self.llm.config.max_model_len
        self.max_length = max_length or max_model_len - EXTRA_POSITIONS
        if self.max_length + EXTRA_POSITIONS > max_model_len:
            raise ValueError(f"max_length {self.max_length} needs max_model_len >= max_length + "
                             f"{EXTRA_POSITIONS} (a scored sequence is max_length + 1 tokens, and one token "
                             f"is sampled), but max_model_len is {max_model_len}; lower max_length or "
                             "raise max_model_len")
        self.max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token

    # ---- tokens ----
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "nanovllm").replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """For `--apply_chat_template`: the tokenizer's chat template, as text."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ---- scoring ----
    def _score(self, pairs: list[tuple[list[int], list[int]]],
               disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum of the continuation's logprobs, is it greedy)."""
        prompts, starts = [], []
        for context, continuation in pairs:
            # As hf: max_length tokens predict the next, so the last max_length + 1 are kept.
            whole = (context + continuation)[-(self.max_length + 1):]
            prompts.append(whole)
            starts.append(len(whole) - len(continuation))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        results = []
        for prompt, start, out in zip(prompts, starts, outputs, strict=True):
            total, greedy = 0.0, True
            for position in range(max(start, 1), len(prompt)):
                logprobs = out["prompt_logprobs"][position]
                token = prompt[position]
                total += logprobs[token]
                greedy &= max(logprobs, key=logprobs.get) == token
            results.append((total, greedy))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----
    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str], int]:
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        eos = self.tok_decode([self.eot_token_id])
        if eos and eos not in until:
            until.append(eos)
        max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = kwargs.pop("do_sample", False)
        if not do_sample:
            kwargs["temperature"] = 0.0
        max_gen = max(1, min(max_gen, self.llm.config.max_model_len - 1))
        return SamplingParams(max_tokens=max_gen, stop=until, **kwargs), until, max_gen

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            p, until, max_gen = self._sampling_params(gen_kwargs)
            ids = self.tok_encode(context)
            prompts.append(ids[-max(1, self.max_length - max_gen):])  # the context's end, as hf
            params.append(p)
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for req, out, until in zip(requests, outputs, stops, strict=True):
            text = out["text"]
            for stop in until:  # the engine cut at the first stop already; this is lm-eval's contract
                text = text.split(stop)[0]
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts
