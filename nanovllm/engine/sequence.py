"""A request as the engine tracks it: its tokens, how many of them have KV in the cache, and the
KV blocks that hold them. Pure Python."""

from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 block_size: int = 256) -> None:
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params or SamplingParams()
        # |-- num_cached_tokens --|-- computed since admission --|-- not computed yet --|
        # |<----------- num_computed_tokens ------------------->|
        # num_cached_tokens: KV served by the prefix cache at the latest admission.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0  # tokens the scheduler gave this sequence in the current step
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block whose KV is computed
        self.finish_reason: str | None = None
        self.stop_text: str | None = None  # the completion text, cut before a stop string that hit
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last token lacks KV: the sequence still computes its prompt (or, after a
        preemption, recomputes prompt and completion) in chunks before it decodes again."""
        return self.num_uncomputed_tokens > 1

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
