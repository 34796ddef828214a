"""The per-request latency and size histograms behind /metrics, with vLLM's names and buckets (so that a
vLLM Grafana dashboard reads them): time to first token, inter-token latency, end-to-end latency, queue
time, prompt and generation tokens per request. The engine client observes them as step messages
arrive, once per request per step, so an observation is a bisect and two additions: no lock (all on
the event loop) and none of prometheus_client's per-call overhead."""

from bisect import bisect_left
from dataclasses import dataclass, field

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(largest: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(map(float, out))
            out.append(mantissa * scale)
        scale *= 10


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf; not cumulative
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) pairs as Prometheus exposes them."""
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out


class RequestMetrics:
    def __init__(self, max_model_len: int) -> None:
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(ITL_BUCKETS)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(buckets_1_2_5(max_model_len))
        self.request_generation_tokens = Histogram(buckets_1_2_5(max_model_len))
