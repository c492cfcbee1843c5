"""Engine metrics in Prometheus form, on a registry owned by the engine (no global state)."""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "hybrid_jax_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LAT, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens", buckets=_LAT,
                             registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Device time of one engine step", buckets=_LAT,
                                      registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(p + "requests_finished", "Requests finished", registry=r)
        self.aborted = Counter(p + "requests_aborted", "Requests aborted (client gone or cancelled)", registry=r)
        self.preemptions = Counter(p + "preemptions", "Requests preempted for recompute", registry=r)
        self.queue_length = Gauge(p + "queue_length", "Requests waiting", registry=r)
        self.running = Gauge(p + "running_requests", "Requests holding a cache slot", registry=r)
        self.throughput = Gauge(p + "generation_throughput_tokens_per_second",
                                "Output tokens per second over the last 10 s", registry=r)
        self._recent: collections.deque = collections.deque()
        self.compilations = Gauge(p + "compiled_programs", "Step programs compiled so far", registry=r)
        self.cache_usage = Gauge(p + "kv_cache_usage_ratio", "Share of the paged pools' pages in use (fullest group)",
                                 registry=r)
        # Cache and speculation figures: set by the components that own them; NaN until they exist.
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "Prefix cache hit rate", registry=r)
        self.validation_pass_rate = Gauge(p + "prefix_cache_validation_pass_rate",
                                          "Share of prefix hits that passed every validation", registry=r)
        self.effective_reuse = Gauge(p + "prefix_cache_effective_reuse", "hit rate x validation pass rate",
                                     registry=r)
        self.sparse_hit_rate = Gauge(p + "sparse_attention_hit_rate",
                                     "Share of Top-K selected positions resident on device", registry=r)
        self.spec_acceptance = Gauge(p + "spec_decode_acceptance_rate", "Speculative acceptance rate",
                                     registry=r)
        self.spec_accepted_length = Gauge(p + "spec_decode_mean_accepted_length",
                                          "Tokens emitted per row-verify (accepted drafts + 1)", registry=r)
        self.spec_draft_seconds = Counter(p + "spec_decode_draft_seconds", "Host time spent drafting", registry=r)
        self.spec_verify_seconds = Counter(p + "spec_decode_verify_seconds", "Time of verify steps", registry=r)
        for g in (self.spec_accepted_length, self.prefix_hit_rate, self.validation_pass_rate, self.effective_reuse, self.sparse_hit_rate,
                  self.spec_acceptance):
            g.set(float("nan"))

    def note_tokens(self, n: int, window: float = 10.0):
        now = time.monotonic()
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else window
        self.throughput.set(sum(k for _, k in self._recent) / span)

    def render(self) -> bytes:
        return generate_latest(self.registry)
