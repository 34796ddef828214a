"""What a finished request returns: nano-vllm's dict (`out["text"]`, `out["token_ids"]`), typed."""

from typing import TypedDict


class RequestOutput(TypedDict):
    text: str  # the completion, detokenized (cut before a stop string that ended it)
    token_ids: list[int]  # the completion's token ids
    finish_reason: str  # "stop" (EOS, a stop string or stop token id) or "length"
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache at the latest admission
