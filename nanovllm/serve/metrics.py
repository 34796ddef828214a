"""Prometheus metrics, read from the engine at scrape time into a registry owned by one app (no
process-global registry: two servers in one process keep separate figures). Names follow vLLM's,
under the `nanovllm:` prefix."""

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm.serve.async_engine import AsyncEngine


class EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
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
        # Read without the engine lock: each figure is one len() or int, atomic under the GIL; a
        # scrape between two updates of one step is at most a step out of date.
        scheduler = self.engine.llm.engine.scheduler
        block_manager = scheduler.block_manager
        num_blocks, num_free = len(block_manager.blocks), block_manager.num_free_blocks
        yield self._gauge("num_requests_running", "Requests in the running batch.", len(scheduler.running))
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).",
                          len(scheduler.waiting))
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                          (num_blocks - num_free) / num_blocks)
        yield self._gauge("kv_cache_free_blocks", "KV-cache blocks in the free pool.", num_free)
        yield self._gauge("kv_cache_total_blocks", "KV-cache blocks in all.", num_blocks)
        yield self._counter("prompt_tokens", "Prompt tokens of all admitted requests.",
                            self.engine.num_prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated.", self.engine.num_generation_tokens)
        yield self._counter("num_preemptions", "Times a running request was preempted.",
                            scheduler.num_preemptions)
        finished = CounterMetricFamily("nanovllm:request_success", "Finished requests, by finish reason.",
                                       labels=[*self.labels, "finished_reason"])
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric([*self.labels.values(), reason], self.engine.finish_reasons[reason])
        yield finished


def make_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry
