"""Prometheus metrics, read at scrape time from the figures that the engine processes send with each
step and the request histograms the engine client keeps (request_metrics.py), into a registry owned by
one app (no process-global registry: two servers in one process keep separate figures); and the log's
throughput line.

Names and types are vLLM's (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...), so
that a vLLM Grafana dashboard works unchanged; each figure is exported once, under vLLM's name (no
`nanovllm:` alias: two names for one series make every sum in a dashboard count it twice). The two
where vLLM renamed a metric are exported under both of its names (`kv_cache_usage_perc` and the older
`gpu_cache_usage_perc`, `inter_token_latency_seconds` and the older `time_per_output_token_seconds`),
since dashboards of both generations are in use. Figures vLLM has no name for keep `nanovllm:`."""

import asyncio
import logging

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from nanovllm.dp.engine_core import FINISH_REASONS, EngineStats
from nanovllm.serve.engine_client import EngineClient
from nanovllm.serve.request_metrics import Histogram

logger = logging.getLogger(__name__)


class EngineCollector:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _family(self, kind, name: str, doc: str, value: float | Histogram, extra_labels=()):
        family = kind(name, doc, labels=[*self.labels, *extra_labels])
        if isinstance(value, Histogram):
            family.add_metric(list(self.labels.values()), value.cumulative(), value.sum)
        else:
            family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        # The figures of the engines' latest step messages: a scrape is at most a step out of date.
        stats = self.engine.stats()
        num_blocks, num_free = self.engine.num_total_blocks, stats.num_free_blocks
        usage = (num_blocks - num_free) / num_blocks
        gauge, counter, histogram = GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily
        yield self._family(gauge, "vllm:num_requests_running", "Requests in the running batch.",
                           stats.num_running)
        yield self._family(gauge, "vllm:num_requests_waiting",
                           "Requests waiting to be scheduled (new or preempted).", stats.num_waiting)
        yield self._family(gauge, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                           usage)
        yield self._family(gauge, "vllm:gpu_cache_usage_perc",
                           "Fraction of KV-cache blocks in use (0 to 1); vLLM's older name.", usage)
        yield self._family(gauge, "nanovllm:kv_cache_free_blocks", "KV-cache blocks in the free pool.",
                           num_free)
        yield self._family(gauge, "nanovllm:kv_cache_total_blocks", "KV-cache blocks in all.", num_blocks)
        yield self._family(counter, "vllm:prompt_tokens", "Prompt tokens of all admitted requests.",
                           stats.num_prompt_tokens)
        yield self._family(counter, "vllm:generation_tokens", "Tokens generated.",
                           stats.num_generation_tokens)
        yield self._family(counter, "vllm:num_preemptions", "Times a running request was preempted.",
                           stats.num_preemptions)
        yield self._family(counter, "vllm:prefix_cache_queries",
                           "Prompt tokens looked up in the prefix cache.", stats.num_prefix_cache_queries)
        yield self._family(counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           stats.num_prefix_cache_hits)
        yield from self._spec_decode(stats)
        finished = CounterMetricFamily("vllm:request_success", "Finished requests, by finish reason.",
                                       labels=[*self.labels, "finished_reason"])
        for reason, count in zip(FINISH_REASONS, stats.finish_reasons, strict=True):
            finished.add_metric([*self.labels.values(), reason], count)
        yield finished
        m = self.engine.request_metrics
        for name, doc, value in (
                ("time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                 m.time_to_first_token),
                ("inter_token_latency_seconds", "Time between a request's successive outputs.",
                 m.inter_token_latency),
                ("time_per_output_token_seconds", "Time between a request's successive outputs; vLLM's "
                 "older name.", m.inter_token_latency),
                ("e2e_request_latency_seconds", "Time from a request's arrival to its end.",
                 m.e2e_request_latency),
                ("request_queue_time_seconds", "Time a request waited for its first step.",
                 m.request_queue_time),
                ("request_prompt_tokens", "Prompt tokens per finished request.", m.request_prompt_tokens),
                ("request_generation_tokens", "Generated tokens per finished request (all completions).",
                 m.request_generation_tokens)):
            yield self._family(histogram, f"vllm:{name}", doc, value)


    def _spec_decode(self, stats: EngineStats):
        """Speculative decoding's counters, under vLLM's names, when the engine speculates."""
        spec = getattr(getattr(self.engine, "config", None), "speculative_config", None)
        if spec is None:
            return
        counter = CounterMetricFamily
        yield self._family(counter, "vllm:spec_decode_num_drafts",
                           "Steps that verified a request's drafts.", stats.num_spec_drafts)
        yield self._family(counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                           stats.num_spec_draft_tokens)
        yield self._family(counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                           stats.num_spec_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position among a step's drafts.",
                                      labels=[*self.labels, "position"])
        counts = stats.num_spec_accepted_tokens_per_pos
        for position in range(spec.num_speculative_tokens):
            count = counts[position] if position < len(counts) else 0
            per_pos.add_metric([*self.labels.values(), str(position)], count)
        yield per_pos


def make_registry(engine: EngineClient, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def stats_line(engine: EngineClient, before: EngineStats, after: EngineStats, seconds: float) -> str:
    usage = 1 - after.num_free_blocks / engine.num_total_blocks
    queries = after.num_prefix_cache_queries - before.num_prefix_cache_queries
    hits = after.num_prefix_cache_hits - before.num_prefix_cache_hits
    return (f"Avg prompt throughput: {(after.num_prompt_tokens - before.num_prompt_tokens) / seconds:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(after.num_generation_tokens - before.num_generation_tokens) / seconds:.1f} tokens/s, "
            f"Running: {after.num_running} reqs, Waiting: {after.num_waiting} reqs, "
            f"KV cache usage: {100 * usage:.1f}%, Prefix cache hit rate: "
            f"{100 * hits / queries if queries else 0:.1f}%")


async def log_stats_forever(engine: EngineClient, interval: float) -> None:
    """Log the throughput line every `interval` seconds while there is (or was, since the last line)
    work, as vLLM's engine does; an idle server stays quiet."""
    loop = asyncio.get_running_loop()
    before, since = engine.stats(), loop.time()
    while True:
        await asyncio.sleep(interval)
        after, now = engine.stats(), loop.time()
        if after != before or after.num_running or after.num_waiting:
            logger.info(stats_line(engine, before, after, now - since))
        before, since = after, now
