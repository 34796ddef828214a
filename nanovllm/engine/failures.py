"""Per-request failure isolation: a step in which one request fails (say, its sampling parameters were
changed after it was added) must not take the other requests of the batch down with it. Pure Python:
the model and the runner's checks are passed in as callables.

- Single rank: a failed step is re-run one sequence at a time to find the one(s) at fault. Re-running
  is safe: a step changes no sequence (the scheduler's postprocess has not run), and rewrites the
  same KV slots.
- Tensor parallelism: a failed step shuts the worker group down (ranks may be stuck in a collective),
  so what can fail on rank 0 alone, turning sampling parameters into tensors, is tried on the CPU
  before the step is sent; a failure inside the forward still raises."""

import logging
from collections.abc import Callable

from nanovllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

RunModel = Callable[[list[Sequence], bool], list[int | None]]
CheckSampling = Callable[[list[Sequence]], None]


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _sampling_failures(seqs: list[Sequence], check: CheckSampling) -> dict[int, str]:
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


def run_isolating_failures(run_model: RunModel, seqs: list[Sequence], is_prefill: bool,
                           check_sampling: CheckSampling | None) -> tuple[list[int | None], dict[int, str]]:
    """Run the step; returns the sampled token per sequence (None for the failed and for those that
    only computed part of their prompt) and {seq_id: error text} of the sequences that failed.
    `check_sampling` is given under tensor parallelism: a step that raises is then not retried."""
    failures = _sampling_failures(seqs, check_sampling) if check_sampling is not None else {}
    runnable = [seq for seq in seqs if seq.seq_id not in failures] if failures else seqs
    try:
        token_ids = run_model(runnable, is_prefill) if runnable else []
    except Exception:
        if check_sampling is not None:
            raise
        logger.exception("a step of %d sequences failed; retrying each alone", len(runnable))
        token_ids = []
        for seq in runnable:
            try:
                token_ids += run_model([seq], is_prefill)
            except Exception as e:
                token_ids.append(None)
                failures[seq.seq_id] = _error_text(e)
    if runnable is seqs:
        return token_ids, failures
    by_id = dict(zip((seq.seq_id for seq in runnable), token_ids, strict=True))
    return [by_id.get(seq.seq_id) for seq in seqs], failures
