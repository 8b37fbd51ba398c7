"""Prometheus metrics, named in the style of vLLM's (`kvserve:` prefix), on a registry per server."""
from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvserve.outputs import SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class Metrics:
    def __init__(self, model: str, layout: dict, total_kv_bytes: int):
        """`layout`: the KV layout's KVLayout.to_dict()."""
        self.registry = CollectorRegistry()
        labels, r = {"model_name": model}, self.registry

        def metric(kind, name: str, doc: str, **options):
            return kind(f"kvserve:{name}", doc, ["model_name"], registry=r, **options).labels(**labels)

        histogram = lambda name, doc: metric(Histogram, name, doc, buckets=LATENCY_BUCKETS)  # noqa: E731
        counter = lambda name, doc: metric(Counter, name, doc)  # noqa: E731
        gauge = lambda name, doc: metric(Gauge, name, doc)  # noqa: E731

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first output token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first being scheduled.")
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV blocks held by requests (0-1).")
        self.kv_used_bytes = gauge("kv_cache_used_bytes", "KV bytes held by requests, residual blocks included.")
        self.kv_total_bytes = gauge("kv_cache_total_bytes", "KV bytes of the whole pool, residual blocks included.")
        self.kv_total_bytes.set(total_kv_bytes)
        gauge("kv_cache_bytes_per_token", "KV bytes one more cached token takes (all layers, scales included).").set(
            layout["bytes_per_token"])
        Info("kvserve:kv_cache_layout", "How K and V are stored.", ["model_name"], registry=r).labels(**labels).info(
            {k: str(v) for k, v in layout.items()})
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed and verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.")
        self.evicted_tokens = counter("kv_evicted_tokens", "KV policies: cached tokens evicted.")
        self.tier_loaded = counter("kv_tier_loaded_blocks", "KV tiers: blocks of cached prefixes loaded into the pool.")
        self.tier_saved = counter("kv_tier_saved_blocks", "KV tiers: blocks saved to them.")
        self.finished = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model = model
        self._last_stats = SchedulerStats()

    def record_stats(self, stats: SchedulerStats) -> None:
        """Add what the scheduler counted since the previous call."""
        last = self._last_stats
        self.prefix_queries.inc(stats.prefix_queries - last.prefix_queries)
        self.prefix_hits.inc(stats.prefix_hits - last.prefix_hits)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.draft_tokens.inc(stats.num_draft_tokens - last.num_draft_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        self.evicted_tokens.inc(stats.num_evicted_tokens - last.num_evicted_tokens)
        self.tier_loaded.inc(stats.tier_loaded_blocks - last.tier_loaded_blocks)
        self.tier_saved.inc(stats.tier_saved_blocks - last.tier_saved_blocks)
        self._last_stats = replace(stats)

    def record_finished(self, reason: str) -> None:
        self.finished.labels(model_name=self._model, finished_reason=reason).inc()
