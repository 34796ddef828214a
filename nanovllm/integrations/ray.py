"""Ray Data: offline generation over a cluster, one nanovllm engine per Ray actor.

Ray is the distributed engine here; nanovllm schedules nothing across machines. Ray places the
actors (each with `num_gpus=T` GPUs, `T` = tensor_parallel_size), streams batches of rows to them,
and gathers the results; each actor holds one `LLM` and generates a batch at a time, continuously
batched inside the engine. The same code runs on a laptop's local Ray and on a cluster:

    import ray
    from nanovllm import SamplingParams
    from nanovllm.integrations.ray import LLMPredictor

    ds = ray.data.from_items([{"prompt": p} for p in prompts])     # or read_parquet(...), ...
    ds = ds.map_batches(LLMPredictor, batch_size=256, num_gpus=T,
                        compute=ray.data.ActorPoolStrategy(size=N),  # `concurrency=N` on older Ray
                        fn_constructor_kwargs=dict(model="/models/Qwen3-0.6B", tensor_parallel_size=T,
                                                   sampling_params=SamplingParams(max_tokens=128)))
    ds.write_parquet("/shared/out")    # columns: the input's, plus generated_text, generated_token_ids

The model path must exist on every node. `pip install "nanovllm[ray]"` installs Ray with Ray Data;
examples/ray_data.py is a runnable version. This module does not import ray itself: Ray imports it."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

TEXT_COLUMN = "generated_text"
TOKEN_IDS_COLUMN = "generated_token_ids"
FINISH_REASON_COLUMN = "finish_reason"


class LLMPredictor:
    """A callable class for `ray.data.Dataset.map_batches`. The constructor takes the LLM's options
    (as `LLM(model, **options)`), the SamplingParams for every row, the name of the column that
    holds the prompts (strings, or token-id lists), and whether to send each string prompt as a
    user message through the chat template (`LLM.chat`) rather than as raw text. A call takes a
    batch of rows and returns them with generated_text, generated_token_ids and finish_reason
    columns added."""

    def __init__(self, model: str, sampling_params: SamplingParams | None = None,
                 prompt_column: str = "prompt", apply_chat_template: bool = False, **options: Any) -> None:
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.sampling_params = sampling_params
        self.prompt_column = prompt_column
        self.apply_chat_template = apply_chat_template
        self.llm = LLM(model, **options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.prompt_column not in batch:
            raise KeyError(f"the batch has no {self.prompt_column!r} column (it has {sorted(batch)}); "
                           "pass prompt_column= to LLMPredictor")
        prompts = [_prompt(p) for p in batch[self.prompt_column]]
        if not prompts:
            outputs = []
        elif self.apply_chat_template:
            if not all(isinstance(p, str) for p in prompts):
                raise TypeError("apply_chat_template=True needs string prompts; send token ids with "
                                "apply_chat_template=False")
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outputs = self.llm.chat(conversations, self.sampling_params, use_tqdm=False)
        else:
            outputs = self.llm.generate(prompts, self.sampling_params, use_tqdm=False)
        return {
            **batch,
            TEXT_COLUMN: np.array([o["text"] for o in outputs], dtype=object),
            # One int64 array per row, of its own length (Ray stores ragged columns as such).
            TOKEN_IDS_COLUMN: _ragged([o["token_ids"] for o in outputs]),
            FINISH_REASON_COLUMN: np.array([o["finish_reason"] for o in outputs], dtype=object),
        }


def _prompt(value: Any) -> str | list[int]:
    """A prompt cell as generate takes it: Ray hands strings as str and token ids as numpy arrays."""
    if isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, Sequence)):
        return [int(t) for t in value]
    raise TypeError(f"a prompt must be a string or a list of token ids, got {type(value).__name__}")


def _ragged(rows: list[list[int]]) -> np.ndarray:
    column = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):  # one by one: rows of equal length must not become a 2-D array
        column[i] = np.array(row, dtype=np.int64)
    return column
