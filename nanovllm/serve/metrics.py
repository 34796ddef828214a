"""Prometheus metrics, read at scrape time from the figures that the engine processes send with each
step, into a registry owned by one app (no process-global registry: two servers in one process keep
separate figures). Names follow vLLM's, under the `nanovllm:` prefix."""

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm.serve.engine_client import EngineClient
from nanovllm.serve.engine_core import FINISH_REASONS


class EngineCollector:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"nanovllm:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"nanovllm:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        # The figures of the engines' latest step messages: a scrape is at most a step out of date.
        stats = self.engine.stats()
        num_blocks, num_free = self.engine.num_total_blocks, stats.num_free_blocks
        yield self._gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).",
                          stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                          (num_blocks - num_free) / num_blocks)
        yield self._gauge("kv_cache_free_blocks", "KV-cache blocks in the free pool.", num_free)
        yield self._gauge("kv_cache_total_blocks", "KV-cache blocks in all.", num_blocks)
        yield self._counter("prompt_tokens", "Prompt tokens of all admitted requests.",
                            stats.num_prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield self._counter("num_preemptions", "Times a running request was preempted.",
                            stats.num_preemptions)
        finished = CounterMetricFamily("nanovllm:request_success", "Finished requests, by finish reason.",
                                       labels=[*self.labels, "finished_reason"])
        for reason, count in zip(FINISH_REASONS, stats.finish_reasons, strict=True):
            finished.add_metric([*self.labels.values(), reason], count)
        yield finished


def make_registry(engine: EngineClient, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry
