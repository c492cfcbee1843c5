"""Engine metrics in Prometheus form, on a registry owned by the engine (no global state).

Latencies count from the request's arrival (for the server: when its HTTP request came in), not
from when the engine thread picked it up. Names follow Prometheus conventions (base units,
`_total` counters, `_seconds` histograms) and vLLM's names where vLLM has the figure, with this
project's `hybrid_jax_` prefix instead of `vllm:`. Everything that describes the present (queue,
running requests, cache usage, throughput over the last 10 s, cache misses by reason) is computed
when /metrics is scraped, so an idle server shows 0 and never a stale value.

Routers read a few of those figures under the names the Gateway API Inference Extension's model-server
protocol gives for vLLM (`ROUTER_GAUGES`: queue length, running requests, KV-cache utilisation, the
cache's block size and block count); they are served beside this project's own, with the same values.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQ = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
P = "hybrid_jax_"
THROUGHPUT_WINDOW_S = 10.0


class _Live:
    """A collector whose values are read at scrape time from a callback (the engine binds it)."""

    def __init__(self, read):
        self.read = read

    def collect(self):
        return self.read()


class EngineMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = P
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LAT, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens", buckets=_LAT,
                             registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to the last token of a finished request",
                             buckets=_REQ, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to the first step that ran the "
                                    "request", buckets=_REQ, registry=r)
        self.tpot = Histogram(p + "request_time_per_output_token_seconds", "A finished request's (last token - first"
                              " token) / (output tokens - 1)", buckets=_LAT, registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Device time of one engine step", buckets=_LAT,
                                      registry=r)
        self.step_host_seconds = Histogram(p + "step_host_seconds", "Host time of one engine step: scheduling, "
                                           "building its inputs, reading and appending its tokens (its wall time less "
                                           "the wait for the device)", buckets=_LAT, registry=r)
        self.device_busy_seconds = Counter(p + "device_busy_seconds", "Time the device spent running engine steps, "
                                           "from when each could start (its dispatch, or the previous step's end) to "
                                           "its end as the host saw it", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(p + "requests_finished", "Requests finished (stop or length)", registry=r)
        self.success = Counter(p + "request_success", "Requests ended, by finish reason (stop, length, abort, error)",
                               ["finished_reason"],
                               registry=r)
        self.aborted = Counter(p + "requests_aborted", "Requests aborted (client gone or cancelled)", registry=r)
        self.step_failures = Counter(p + "engine_step_failures", "Engine step failures: attributable ones failed "
                                     "one request, the others reset the step state", ["attributable"], registry=r)
        self.errors = Counter(p + "request_errors", "Requests answered with an error, by OpenAI error type",
                              ["type"], registry=r)
        self.preemptions = Counter(p + "preemptions", "Requests preempted for recompute", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Looked-up tokens served from the prefix cache",
                                   registry=r)
        # Rates kept by the components that own them; NaN until they exist.
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
        for g in (self.spec_accepted_length, self.prefix_hit_rate, self.validation_pass_rate, self.effective_reuse,
                  self.sparse_hit_rate, self.spec_acceptance):
            g.set(float("nan"))
        self._recent: collections.deque = collections.deque()
        self._busy: collections.deque = collections.deque()      # (time, device seconds) of recent steps
        self.steps, self.host_seconds, self.device_seconds = 0, 0.0, 0.0   # totals of `note_step`
        self._lock = threading.Lock()
        self._live = None            # () -> dict of present figures (bound by the engine / server)
        r.register(_Live(self._collect_live))

    # --- recorded by the engine --------------------------------------------------------------------
    def note_tokens(self, n: int):
        if n:
            with self._lock:
                self._recent.append((time.monotonic(), n))

    def note_finished(self, req, now: float):
        self.finished.inc()
        self.success.labels(finished_reason=req.finish_reason).inc()
        self.e2e.observe(now - req.arrival)
        n = len(req.output_ids)
        if n > 1 and req.first_token_time is not None:
            self.tpot.observe((now - req.first_token_time) / (n - 1))

    def note_step(self, wall: float, waited: float, device: float):
        """One engine step: `wall` seconds in all, `waited` of them blocked on the device's results;
        `device`: the device time of the steps read back in it (with overlap, mostly while the host
        worked)."""
        self.step_host_seconds.observe(max(wall - waited, 0.0))
        self.device_busy_seconds.inc(device)
        with self._lock:             # data-parallel replicas step on their own threads
            self.steps += 1
            self.host_seconds += max(wall - waited, 0.0)
            self.device_seconds += device
            self._busy.append((time.monotonic(), device))

    def device_busy(self, window: float = THROUGHPUT_WINDOW_S) -> float:
        """Share of the last `window` seconds the device spent running steps (0 when idle)."""
        now = time.monotonic()
        with self._lock:
            while self._busy and self._busy[0][0] < now - window:
                self._busy.popleft()
            return min(sum(d for _, d in self._busy) / window, 1.0)

    def throughput(self, window: float = THROUGHPUT_WINDOW_S) -> float:
        """Output tokens per second over the last `window` seconds (0 when idle)."""
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - window:
                self._recent.popleft()
            return sum(k for _, k in self._recent) / window

    # --- read at scrape time -----------------------------------------------------------------------
    def bind(self, live):
        """live() -> {"waiting": int, "running": int, "cache_usage": {group: ratio},
        "prefix_misses": {reason: count}, "disk_tier": the disk tier's health or None} read at every
        scrape."""
        self._live = live

    def _collect_live(self):
        v = self._live() if self._live is not None else {}
        out = [
            GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting for a row (queued or preempted), "
                              "including those not yet handed to the engine thread", value=v.get("waiting", 0)),
            GaugeMetricFamily(P + "num_requests_running", "Requests holding a cache row",
                              value=v.get("running", 0)),
            GaugeMetricFamily(P + "generation_throughput_tokens_per_second",
                              f"Output tokens per second over the last {THROUGHPUT_WINDOW_S:g} s",
                              value=self.throughput()),
        ]
        out.append(GaugeMetricFamily(P + "device_busy_ratio", f"Share of the last {THROUGHPUT_WINDOW_S:g} s the "
                                     "device spent running engine steps", value=self.device_busy()))
        out.append(GaugeMetricFamily(P + "compiled_programs", "Programs compiled so far (steps, copies, prefix "
                                     "store)", value=v.get("compiled", 0)))
        out += _compile_figures(v)
        out += _router_gauges(v)
        usage = v.get("cache_usage", {})
        out.append(GaugeMetricFamily(P + "kv_cache_usage_ratio", "Share of the paged pools' pages in use (fullest "
                                     "group)", value=_kv_usage(v)))
        per = GaugeMetricFamily(P + "cache_usage_ratio", "Share of each cache group's pages or checkpoint units in "
                                "use", labels=["group"])
        for g, u in sorted(usage.items()):
            per.add_metric([g], u)
        out.append(per)
        miss = CounterMetricFamily(P + "prefix_cache_misses", "Prefix-cache lookups that were refused or missed, "
                                   "by reason (disk-tier refusals included)", labels=["reason"])
        for reason, n in sorted(v.get("prefix_misses", {}).items()):
            miss.add_metric([reason], n)
        out.append(miss)
        disk = v.get("disk_tier")
        if disk is not None:          # the prefix cache's disk tier (--kv-cache-dir): does it take writes?
            out.append(GaugeMetricFamily(P + "kv_cache_dir_writable", "1 while the disk tier's directory takes "
                                         "writes, 0 after a write failed (read-only, full, ...; retried later)",
                                         value=1.0 if disk["writable"] else 0.0))
            out.append(CounterMetricFamily(P + "kv_cache_dir_write_faults", "Writes to the disk tier's directory "
                                           "that failed and turned its writes off", value=disk["write_faults"]))
            out.append(CounterMetricFamily(P + "kv_cache_dir_skipped_writes", "Spans not written to the disk "
                                           "tier because its writes were off", value=disk["skipped_writes"]))
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _kv_usage(v: dict) -> float:
    """Share of the paged pools' pages in use, the fullest paged group's (0 with none)."""
    paged = v.get("paged_groups", set())
    return max([u for g, u in v.get("cache_usage", {}).items() if g in paged] or [0.0])


# The names the Gateway API Inference Extension (and llm-d's scorers) read from a vLLM backend, for
# the same figures as this project's hybrid_jax_num_requests_waiting / _running / _kv_cache_usage_ratio.
ROUTER_GAUGES = {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
                 "kv_usage": "vllm:kv_cache_usage_perc", "cache_config": "vllm:cache_config_info"}


def _router_gauges(v: dict) -> list:
    """`ROUTER_GAUGES` from the live figures. vllm:kv_cache_usage_perc is a ratio in [0, 1] as vLLM's
    is (the name is vLLM's); vllm:cache_config_info's labels are the prefix cache's block size in tokens
    and the number of such blocks the attention pool holds (what a prefix-aware scorer sizes its model
    of this server's cache with); its value is 1."""
    out = [GaugeMetricFamily(ROUTER_GAUGES["waiting"], "Requests waiting (hybrid_jax_num_requests_waiting)",
                             value=v.get("waiting", 0)),
           GaugeMetricFamily(ROUTER_GAUGES["running"], "Requests holding a cache row (hybrid_jax_num_requests_running)",
                             value=v.get("running", 0)),
           GaugeMetricFamily(ROUTER_GAUGES["kv_usage"], "KV-cache usage, 1 = full (hybrid_jax_kv_cache_usage_ratio)",
                             value=_kv_usage(v))]
    cc = v.get("cache_config")
    if cc is not None:
        info = GaugeMetricFamily(ROUTER_GAUGES["cache_config"], "The KV cache's block size (tokens) and blocks",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(cc[0]), str(cc[1])], 1.0)
        out.append(info)
    return out


SOURCES = ("store", "compiled", "on_demand")      # engine/program_table.CompiledProgram.source


def _compile_figures(v: dict) -> list:
    """The compiler's and the start-up's series (engine/startup_status.py) from the live figures."""
    out = [CounterMetricFamily(P + "compile_stalls", "Engine steps that waited on a compile while serving (no "
                               "compiled program covered them; 0 unless the start-up plan missed a shape)",
                               value=v.get("stalls", 0))]
    by = GaugeMetricFamily(P + "compiled_programs_by_source", "Step programs in the engine's table, by where each "
                           "came from: the program store, compiled at start-up or in the background, or compiled "
                           "on first use (compiled_programs also counts the prefix store's)", labels=["source"])
    have = v.get("by_source", {})
    for src in SOURCES + tuple(sorted(set(have) - set(SOURCES))):
        by.add_metric([src], have.get(src, 0))
    out.append(by)
    st = v.get("startup")
    if st is None:                 # an engine that llm.build_engine did not build: no load was timed
        return out
    sec = GaugeMetricFamily(P + "startup_phase_seconds", "Seconds of each start-up phase begun: loading_weights "
                            "(and building the engine), compiling (the programs needed before ready), background "
                            "(the rest, while serving: so far, or in all once complete)", labels=["phase"])
    for phase, s in st.phase_seconds().items():
        sec.add_metric([phase], s)
    out.append(sec)
    progs = GaugeMetricFamily(P + "startup_programs", "Start-up programs: planned before ready (ready) and in all "
                              "(planned), built so far (built), of those read from the program store (from_store)",
                              labels=["state"])
    for state, n in (("ready", st.ready_total), ("planned", st.total), ("built", st.done),
                     ("from_store", st.from_store)):
        progs.add_metric([state], n)
    out.append(progs)
    out.append(GaugeMetricFamily(P + "startup_complete", "1 once every planned program is built (0 while the "
                                 "background compiles run)", value=1.0 if st.phase == "complete" else 0.0))
    return out
