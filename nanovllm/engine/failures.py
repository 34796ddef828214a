"""Per-request failure isolation: a step in which one request fails (say, its sampling parameters were
changed after it was added) must not take the other requests of the batch down with it. Pure Python:
the model and the executor's checks are passed in as callables. The engine calls in here only when
something failed, or, under tensor parallelism, to check a step before it is sent.

- Single rank: a failed step is re-run one sequence at a time to find the one(s) at fault. Re-running
  is safe: a step changes no sequence (the scheduler's postprocess has not run), and rewrites the
  same KV slots.
- Tensor parallelism: a failed step shuts the worker group down (ranks may be stuck in a collective),
  so what can fail on rank 0 alone, turning sampling parameters into tensors, is tried on the host
  before the step is sent; a failure inside the forward still raises."""

import logging
from collections.abc import Callable

from nanovllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

RunModel = Callable[[list[Sequence], bool], list[int | None]]
CheckSampling = Callable[[list[Sequence]], None]


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def sampling_failures(seqs: list[Sequence], check: CheckSampling) -> dict[int, str]:
    """{seq_id: error} of the sequences whose sampling inputs cannot be built (one check when all can)."""
    try:
        check(seqs)
        return {}
    except Exception:
        pass
    failures = {}
    for seq in seqs:
        try:
            check([seq])
        except Exception as e:
            failures[seq.seq_id] = _error_text(e)
    return failures


def rerun_one_by_one(run_model: RunModel, seqs: list[Sequence], is_prefill: bool
                     ) -> tuple[list[int | None], dict[int, str]]:
    """After a failed step: run each sequence alone. Returns the sampled token per sequence (None for
    the failed and for those that only computed part of their prompt) and {seq_id: error text}."""
    logger.exception("a step of %d sequences failed; retrying each alone", len(seqs))
    token_ids: list[int | None] = []
    failures: dict[int, str] = {}
    for seq in seqs:
        try:
            token_ids += run_model([seq], is_prefill)
        except Exception as e:
            token_ids.append(None)
            failures[seq.seq_id] = _error_text(e)
    return token_ids, failures
