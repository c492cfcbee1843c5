"""Data parallelism: `data_parallel_size` engine cores behind one engine interface.

Each replica is a whole `LLMEngine` on its own group of `tensor_parallel_size` devices (a row of the
[data, model] mesh), with its own copy of the weights (split over its group like any tensor-parallel
engine), its own pools, scheduler and prefix cache. A request lives on one replica from admission to
its end; nothing crosses replicas inside a step, so no step needs a collective over the data axis.
vLLM runs data-parallel engine cores behind one front end the same way; the engine, `LLM` and the
server use a `DataParallelEngine` exactly as they use an `LLMEngine`.

Routing (`add_request`): the replica with the fewest unfinished requests (ties: the lowest index).
With prefix caching on, the replica whose cache holds the longest validated prefix of the prompt
(`PrefixCache.lookup`, no side effects) takes it instead, unless it holds more than `max_imbalance`
unfinished requests above the least busy one (SGLang's cache-aware router makes the same trade).
A member of an n > 1 group (engine/fork.py; its id names the group) goes where its leader went, so
that it can fork from it.

Stepping: `step()` runs every replica that has work, each on its own thread (JAX releases the
interpreter while a device computes, so replicas on different devices run side by side), and returns
their outputs together. The replicas share one `EngineMetrics`: counters and histograms add up over
them, the live gauges (waiting, running, cache usage) are their sums (usage: the fullest replica).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Sequence

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.contracts import LoadedModel, Loads
from hybrid_jax.engine.engine import LLMEngine
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.request import ForkGroup
from hybrid_jax.engine.startup_status import StartupClock, StartupStatus, status
from hybrid_jax.errors import ConfigError, InputError
from hybrid_jax.sampling import SamplingParams

MAX_IMBALANCE = 4     # unfinished requests a prefix hit may add to a replica above the least busy one


class DataParallelEngine:
    def __init__(self, llms: Sequence[LoadedModel | Loads], config: EngineConfig, max_imbalance: int = MAX_IMBALANCE):
        """llms: one model per replica (`LLM.replicas()`: the same model placed on each device group; a
        LoadedModel, or an LLM that hands one over)."""
        if len(llms) < 2:
            raise ValueError("a data-parallel engine needs two or more replicas")
        if config.kv_cache_dir is not None:
            raise ConfigError("kv_cache_dir is not supported with data_parallel_size > 1 yet (the replicas' disk "
                              "tiers would write one directory); use the device prefix cache or one replica")
        self.config = config
        self.metrics = EngineMetrics()
        self.replicas = [LLMEngine(llm, config, metrics=self.metrics, data_parallel_rank=r)
                         for r, llm in enumerate(llms)]
        self.metrics.bind(self.live_figures)
        self.loaded = self.replicas[0].loaded
        self.max_imbalance = max_imbalance
        self._owner: dict[str, LLMEngine] = {}
        self.routed = [0] * len(llms)         # requests given to each replica
        self._threads = concurrent.futures.ThreadPoolExecutor(len(llms), thread_name_prefix="hybrid-jax-replica")
        self.warmup_seconds = 0.0
        self.clock = StartupClock()           # the load's (llm.build_engine); the replicas' own stay unset

    # --- requests ----------------------------------------------------------------------------------
    @property
    def requests(self) -> dict:
        """Every replica's requests, by id."""
        return {rid: q for r in self.replicas for rid, q in r.requests.items()}

    def check(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int]]:
        return self.replicas[0].check(prompt, params)

    def route(self, ids: Sequence[int]) -> int:
        """The replica a prompt of token ids `ids` goes to (see the module docstring)."""
        load = [len(r.requests) for r in self.replicas]
        least = min(range(len(load)), key=lambda i: (load[i], i))
        if self.replicas[0].prefix is None:
            return least
        hits = [r.prefix.lookup(ids).boundary for r in self.replicas]
        best = max(range(len(hits)), key=lambda i: (hits[i], -load[i], -i))
        return best if hits[best] > hits[least] and load[best] - load[least] <= self.max_imbalance else least

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival: float | None = None):
        params = params or SamplingParams()
        if request_id in self._owner:
            raise InputError(f"request id {request_id!r} is already in use")
        text, ids = self.check(prompt, params)
        g = ForkGroup.from_request_id(request_id)
        leader = self._owner.get(dataclasses.replace(g, index=0).request_id) if g is not None and not g.leader else None
        i = self.replicas.index(leader) if leader is not None else self.route(ids)
        req = self.replicas[i].add_request(request_id, {"prompt_token_ids": ids, "prompt": text}, params, arrival)
        self._owner[request_id] = self.replicas[i]
        self.routed[i] += 1
        return req

    def abort_request(self, request_id: str):
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abort_request(request_id)

    def abort_all(self) -> list[str]:
        self._owner.clear()
        return [rid for r in self.replicas for rid in r.abort_all()]

    # --- steps -------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def num_running(self) -> int:
        return sum(r.num_running() for r in self.replicas)

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    def step(self) -> list:
        """One step of every replica that has work, side by side; their outputs, replica by replica."""
        busy = [r for r in self.replicas if r.has_unfinished()]
        if len(busy) == 1:
            outs = busy[0].step()
        else:
            outs = [o for f in [self._threads.submit(r.step) for r in busy] for o in f.result()]
        for o in outs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outs

    def flush_publishes(self):
        for r in self.replicas:
            r.flush_publishes()

    generate = LLMEngine.generate       # the same loop over add_request / step / flush_publishes

    # --- warm-up, figures, shutdown ----------------------------------------------------------------
    def warmup(self, mode: str | None = None, on_progress=None, background: bool = True):
        """Each replica builds its own programs (its devices' shardings), side by side (LLMEngine.warmup);
        on_progress: after each program of any replica (`startup_status` sums them)."""
        for f in [self._threads.submit(r.warmup, mode, on_progress, background) for r in self.replicas]:
            f.result()
        self.warmup_seconds = max(r.warmup_seconds for r in self.replicas)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        return all([r.wait_compiled(timeout) for r in self.replicas])

    def num_compiled(self) -> int:
        return sum(r.num_compiled() for r in self.replicas)

    def startup_status(self) -> StartupStatus | None:
        """The replicas' warm-ups summed (engine/startup_status.py); None unless build_engine built it."""
        if self.clock.weights_at is None:
            return None
        progress = [r.startup.progress for r in self.replicas if r.startup is not None]
        return status(progress, [r.runner.compiler.stats for r in self.replicas], self.clock)

    def live_figures(self) -> dict:
        figs = [r.live_figures() for r in self.replicas]
        usage: dict[str, float] = {}
        misses: dict[str, int] = {}
        for f in figs:
            for g, u in f["cache_usage"].items():
                usage[g] = max(usage.get(g, 0.0), u)
            for k, n in f["prefix_misses"].items():
                misses[k] = misses.get(k, 0) + n
        return {"waiting": sum(f["waiting"] for f in figs), "running": sum(f["running"] for f in figs),
                "cache_usage": usage, "compiled": sum(f["compiled"] for f in figs),
                "stalls": sum(f["stalls"] for f in figs), "by_source": _summed([f["by_source"] for f in figs]),
                "startup": self.startup_status(),
                "paged_groups": figs[0]["paged_groups"], "prefix_misses": misses,
                "cache_config": self.cache_config()}

    def cache_config(self) -> tuple[int, int]:
        """`LLMEngine.cache_config` over the replicas: their block size and their blocks together."""
        per = [r.cache_config() for r in self.replicas]
        return per[0][0], sum(n for _, n in per)

    def cache_stats(self) -> dict:
        """The replicas' prefix-cache figures (`replicas`), with their counts summed at the top level and
        the rates of those sums."""
        per = [r.cache_stats() for r in self.replicas]
        if not per[0]["enabled"]:
            return {"enabled": False}
        out = {"enabled": True, "replicas": per}
        for k in ("lookups", "hits", "passes", "tokens_reused", "segments", "evictions", "decode_publishes"):
            out[k] = sum(p[k] for p in per)
        out["misses_by_reason"] = {}
        for p in per:
            for k, n in p["misses_by_reason"].items():
                out["misses_by_reason"][k] = out["misses_by_reason"].get(k, 0) + n
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        out["validation_pass_rate"] = out["passes"] / out["hits"] if out["hits"] else 0.0
        out["effective_reuse"] = out["hit_rate"] * out["validation_pass_rate"]
        return out

    def spec_stats(self) -> dict:
        per = [r.spec_stats() for r in self.replicas]
        return {"enabled": per[0]["enabled"], "replicas": per} if per[0]["enabled"] else {"enabled": False}

    def reset_prefix_cache(self, prefix_cache_bytes: int | None = None):
        for r in self.replicas:
            r.reset_prefix_cache(prefix_cache_bytes)

    def close(self):
        """Closes every replica's prefix store and the stepping threads."""
        for r in self.replicas:
            r.close()
        self._threads.shutdown(wait=True)


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out
