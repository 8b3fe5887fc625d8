"""Prometheus metrics (prometheus-client), one registry per server."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"model_name": model_name}
        p = "deepfuse_"

        def g(name, doc):
            return Gauge(p + name, doc, list(lab), registry=r).labels(**lab)

        self.queue_len = g("num_requests_waiting", "requests waiting in the engine's scheduler")
        self.running = g("num_requests_running", "requests running in the engine")
        self.pending = g("num_requests_pending", "requests submitted and not finished (server side)")
        self.cache_usage = g("cache_usage_ratio", "fraction of the KV token capacity in use")
        self.cache_used = g("cache_used_tokens", "KV cache tokens in use")
        self.cache_total = g("cache_total_tokens", "KV cache token capacity")
        self.tokens_per_s = g("generation_tokens_per_second", "generated tokens per second (10 s window)")
        self.preemptions = g("num_preemptions", "preemptions so far")
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", list(lab),
                                     registry=r).labels(**lab)
        self.gen_tokens = Counter(p + "generation_tokens", "generated tokens", list(lab), registry=r).labels(**lab)
        self._finished = Counter(p + "requests_finished", "finished requests by finish reason",
                                 ["model_name", "finish_reason"], registry=r)
        self._model = model_name
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token", list(lab), buckets=_TTFT,
                              registry=r).labels(**lab)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between generated tokens", list(lab),
                             buckets=_LAT, registry=r).labels(**lab)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request latency, submit to finish", list(lab),
                             buckets=_E2E, registry=r).labels(**lab)
        self.rejected = Counter(p + "requests_rejected", "requests rejected (4xx / overload)", ["model_name", "status"],
                                registry=r)

    def update(self, st: dict, new_tokens: int):
        self.queue_len.set(st.get("num_waiting", 0))
        self.running.set(st.get("num_running", 0))
        self.pending.set(st.get("num_pending", 0))
        used, total = st.get("used_tokens", 0), st.get("max_total_tokens", 0) or 1
        self.cache_used.set(used)
        self.cache_total.set(total)
        self.cache_usage.set(used / total)
        self.tokens_per_s.set(st.get("tokens_per_s", 0.0))
        self.preemptions.set(st.get("num_preemptions", 0))
        if new_tokens:
            self.gen_tokens.inc(new_tokens)

    def finished(self, reason: str, n_prompt: int, n_out: int, latency_s: float):
        self._finished.labels(model_name=self._model, finish_reason=reason).inc()
        self.prompt_tokens.inc(n_prompt)
        self.e2e.observe(latency_s)

    def reject(self, status: int):
        self.rejected.labels(model_name=self._model, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
