"""The scheduler's side of prefix caching: a request's cached prefix at admission, and its own prefix
published as it goes.

`PrefixManager` owns the prefix store (cache.prefix_cache.PrefixCache), where each request publishes
(engine/publish_points.PublishPoints), the publishes a step queued and the finished requests whose
rows wait for them. The scheduler calls it at admission (`reuse`: the stored pages into the request's
block tables, the checkpoints into its row), while planning a chunk (`next_stop`) or a decode call
(`decode_caps`: a row stops on its next publish point), after a step's tokens are read (`reached`) and
before a request gives its row back (`before_release`). Publishes run (`flush`) once the step's tokens
are out, so publishing never delays a token; the next schedule runs them anyway.

The store reads and writes the device pools (`runner.cache`: loads at admission, saves at a publish);
the pools stay the runner's, and this object only swaps in the pytree the store returns.
"""
from __future__ import annotations

import dataclasses
import logging

from cache.handoff import KVTransfer
from cache.kv_events import KVEventLog
from cache.block_manager import BlockManager
from cache.prefix_cache import PrefixCache, PrefixCacheConfig
from cache.prefix_disk import DiskConfig
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.publish_points import Publish, PublishPoints, handoff_point
from hybrid_jax.engine.request import Request

log = logging.getLogger("hybrid_jax.engine")


class PrefixManager:
    """runner: the engine's ModelRunner (its `cache` pools); settings: the store's configuration (its
    cap included); disk: the disk tier's, or None; blocks: the scheduler's block manager."""

    def __init__(self, runner, settings: PrefixCacheConfig, disk: DiskConfig | None, blocks: BlockManager,
                 metrics: EngineMetrics, run_to_completion: bool, publish_chunk_ends: bool = False,
                 events: KVEventLog | None = None):
        self.runner, self.settings, self.disk_config, self.metrics = runner, settings, disk, metrics
        self.run_to_completion = run_to_completion
        self.points = PublishPoints(publish_chunk_ends)   # where each request publishes its prefix
        self.pending: list[Publish] = []               # publishes queued by the last step read back
        self.releasing: list[Request] = []             # finished, row and pages given back after `pending`
        self.events = events                           # the routers' KV events (cache/kv_events.py), or None
        self.rooms_sent: set[int] = set()              # rooms of sending requests whose handoff was written
        self.store = PrefixCache(runner.cache, settings, blocks, disk=disk, events=events)

    # --- admission and planning --------------------------------------------------------------------
    def reuse(self, q: Request) -> int:
        """A newly admitted request (row and empty block tables) gets its cached prefix when a hit
        validates; returns the tokens it now holds. When its prompt runs along cached blocks further
        than any checkpoint, the point where it branches off becomes one of its publish points, so the
        next request sharing that prefix resumes there. A request that asks for prompt_logprobs takes
        nothing (a reused token would go unscored; vLLM does the same) and still publishes."""
        if q.params.prompt_logprobs is not None:
            q.num_cached_tokens = 0
            self.points.admitted(self.store, q, 0)
            return 0
        self.runner.cache, got = self.store.reuse(self.runner.cache, q.slot, q.request_id, q.all_ids,
                                                  q.params.kv_transfer)
        n = got.boundary
        q.num_cached_tokens = n
        self.points.admitted(self.store, q, got.branch)
        h = handoff_point(self.store, q)
        if h and n >= h:          # a sending request whose hit covers its handoff point: no publish stops there
            self.store.hand_off(self.runner.cache, q.prompt_ids, h, q.params.kv_transfer.room)
            self.rooms_sent.add(q.params.kv_transfer.room)
        self.metrics.prefix_queries.inc(len(q.all_ids))
        self.metrics.prefix_hits.inc(n)
        st = self.store.stats
        self.metrics.prefix_hit_rate.set(st.hit_rate)
        self.metrics.validation_pass_rate.set(st.validation_pass_rate)
        self.metrics.effective_reuse.set(st.effective_reuse)
        return n

    def next_stop(self, q: Request) -> int | None:
        """The token count a prefill chunk of `q` must end at (a publish point), or None."""
        return self.points.next_point(self.store, q)

    def decode_caps(self, reqs) -> list[int]:
        """Per request, the most tokens a plain decode call may sample (it stops on its next point)."""
        return self.points.decode_caps(self.store, reqs, self.run_to_completion)

    def due(self, reqs) -> bool:
        """Whether a step ending as counted reaches a request's publish point: it must then be read
        back before the next step is enqueued (its rows are copied as they stand then)."""
        return any(self.points.due(self.store, q) for q in reqs)

    # --- after a step ------------------------------------------------------------------------------
    def reached(self, reqs, toks):
        """Queues the publishes of the rows a step brought to one of their points."""
        self.pending += self.points.reached(self.store, reqs, toks)

    def has_pending(self, request_id: str) -> bool:
        return any(x.request_id == request_id for x in self.pending)

    def flush(self) -> list[Request]:
        """Runs the queued publishes; returns the finished requests whose rows waited for them (the
        scheduler gives them back)."""
        pending, self.pending = self.pending, []
        span = self.store.geometry.lcm * self.store.config.checkpoint_interval
        for x in pending:
            self.runner.cache = self.store.publish(self.runner.cache, x.row, x.request_id, x.tokens, x.boundary,
                                                   branch=x.branch, durable=not x.decoded or x.boundary % span == 0,
                                                   spare=x.spare, keep=x.keep)
            if x.room is not None:
                self.store.hand_off(self.runner.cache, x.tokens, x.boundary, x.room)
                self.rooms_sent.add(x.room)
        releasing, self.releasing = self.releasing, []
        return releasing

    def forget(self, request_id: str, dropped: bool = False, transfer: KVTransfer | None = None):
        """A request ended: its points go; a dropped one (aborted, failed) also its queued publishes
        and its disk prefetch. A sending request (`transfer`) that has not handed its cache over and
        will not (dropped, or no handoff publish queued) tells its room so: the receiver recomputes
        at once rather than waiting out its timeout."""
        self.points.forget(request_id)
        if dropped:
            self.pending = [x for x in self.pending if x.request_id != request_id]
            if self.store.disk is not None:
                self.store.disk.forget(request_id)
        if transfer is not None and transfer.role == "send":
            queued = any(x.request_id == request_id and x.room is not None for x in self.pending)
            if transfer.room in self.rooms_sent:
                self.rooms_sent.discard(transfer.room)
            elif not queued:
                self.store.abandon_handoff(transfer.room, "the prefill request was aborted or failed" if dropped else
                                           "short prompt: no resume point before its last token, or its publish"
                                           " was refused")

    # --- the store's life --------------------------------------------------------------------------
    def prefetch(self, q: Request):
        """On arrival: a disk hit (or a handoff) starts loading now, unless the request will take no
        cached prefix (it asks for prompt_logprobs: `reuse`)."""
        if q.params.prompt_logprobs is None:
            self.store.prefetch(q.request_id, q.prompt_ids, q.params.kv_transfer)

    def reset(self, blocks: BlockManager, cap_bytes: int | None = None, clear_points: bool = True,
              disk: DiskConfig | None | bool = True):
        """Drops every cached prefix and the counters: a new store (optionally with a new cap) over
        `blocks`. After a failed step the old store's pools are gone; only its disk flush matters, and
        the requests' publish points go with the requests' rows (clear_points); a reset between steps
        keeps them. disk: the new store's disk tier (None: none); True keeps the present one's."""
        try:
            self.store.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the prefix store")
        if cap_bytes is not None:
            self.settings = dataclasses.replace(self.settings, cap_bytes=cap_bytes)
        if disk is not True:
            self.disk_config = disk
        self.store = PrefixCache(self.runner.cache, self.settings, blocks, disk=self.disk_config, events=self.events)
        if clear_points:
            self.points.clear()
            self.pending, self.releasing = [], []

    def close(self):
        self.store.close()

    def warmup(self):
        self.runner.cache = self.store.warmup(self.runner.cache, self.runner.null_slot)

    def misses(self) -> dict[str, int]:
        """Misses by reason, the disk tier's included (read from another thread: plain reads)."""
        st = self.store
        return {**dict(st.stats.misses_by_reason), **(dict(st.disk.reasons) if st.disk else {})}

    def disk_health(self) -> dict | None:
        return self.store.disk.health() if self.store.disk is not None else None
