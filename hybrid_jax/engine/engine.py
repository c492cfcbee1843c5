"""LLMEngine: requests in, streamed outputs out, one scheduler step at a time.

`step()` asks the scheduler for a plan, runs it as one compiled call (a mixed prefill/decode step,
or `decode_steps` decode iterations when nothing is prefilling), then does the host-side work:
append tokens, detokenize, check stop strings, finish and free rows and pages, record metrics.

Overlap (`EngineConfig.async_scheduling`): a step is enqueued on the device before the tokens of the
step before it are read back (a `Flight`), so the device never waits for the host's work between
steps. Sampling stays on the device, and a row whose last token is still in flight is fed it from
there (the runner's `slot_last`). The host counts a request's in-flight tokens ahead of time
(`Request.num_inflight`: the step's iterations, its max_tokens and its publish cap are known; only a
stop token id can end it sooner, on the device) and applies what only it can check (stop strings,
finishing, aborts) when it reads them back, one step late: the tokens a finished request's next step
sampled are discarded, never emitted. A step at whose end a request publishes its prefix is read back
before anything else is enqueued (its rows are copied as they stand then). Speculative decoding reads
every step's tokens before drafting the next, so it does not overlap.

Memory: the runner's pools (cache.pools) and one block manager (cache.block_manager) that hands out
their rows, pages and checkpoint units to the requests and to the prefix cache, which shares its
stored pages with the requests that hit them.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from cache.block_manager import BlockManager
from cache.prefix_cache import PrefixCache, PrefixCacheConfig
from cache.prefix_disk import DiskConfig
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.detokenize import IncrementalDetokenizer, detokenize_with_stops
from hybrid_jax.engine.limits import admit
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.publish_points import Publish, PublishPoints
from hybrid_jax.engine.request import Request, RequestFailed, RequestOutput, RequestStatus, attributed
from hybrid_jax.engine.runner import Dispatched, ModelRunner, enable_persistent_compilation_cache
from hybrid_jax.engine.scheduler import Scheduler
from hybrid_jax.engine.speculate import EngineSpeculator
from hybrid_jax.engine.speculative_step import SpeculativeStep
from hybrid_jax.errors import InputError
from hybrid_jax.generate import bucket
from hybrid_jax.sampling import SamplingParams

log = logging.getLogger("hybrid_jax.engine")


@dataclasses.dataclass
class Flight:
    """A step enqueued on the device whose tokens the host has not read yet: its requests, the tokens
    counted for each ahead of time (`Request.num_inflight`), and whether it must be read back before
    the next step is enqueued (a request publishes its prefix at its end)."""
    reqs: list[Request]
    dispatched: Dispatched
    counted: list[int]
    sync: bool
    rates: Any = None          # its rows' sparse hit rates, on the device (`LLMEngine._hit_rates`)


class LLMEngine:
    def __init__(self, llm, config: EngineConfig | None = None, metrics: EngineMetrics | None = None):
        """metrics: a registry shared with other engines (data-parallel replicas: the owner binds its
        live figures); by default the engine's own."""
        self.llm = llm
        self.config = config or EngineConfig()
        if self.config.max_model_len > llm.max_model_len:
            raise InputError(f"engine max_model_len {self.config.max_model_len} exceeds the model's "
                             f"{llm.max_model_len}")
        enable_persistent_compilation_cache(self.config.compilation_cache_dir)
        self.runner = ModelRunner(llm.config, llm.params, llm.dtype, self.config, impl=llm.generator.impl,
                                  layout=llm.layout, eos_ids=llm.eos_token_ids())
        self.blocks = BlockManager(self.runner.geometry(), num_rows=self.config.max_num_seqs)
        self.runner.blocks = self.blocks
        self.prefix: PrefixCache | None = None
        if self.config.enable_prefix_caching:
            self.prefix = self._new_prefix_cache(self.config.prefix_cache_bytes or self.runner.budget_bytes)
        self.points = PublishPoints()                   # where each request publishes its prefix
        self.spec = None
        if self.config.speculative_config:
            self.spec = EngineSpeculator(self.config.speculative_config, llm.config.vocab_size,
                                         self.runner.abstract.groups)
            if self.spec.draft is not None:
                dcfg, dparams, ddtype = self.spec.draft
                self.runner.set_draft(dcfg, dparams, ddtype, extra=self.spec.spec.num_speculative_tokens + 1)
            elif self.spec.spec.method == "mtp":
                from hybrid_jax.speculative.mtp import check_mtp  # noqa: PLC0415
                check_mtp(self.runner.model, llm.config, llm.params, llm.model_name)
                self.runner.set_mtp(extra=self.spec.spec.num_speculative_tokens + 1)
        self._pending: list[Publish] = []       # publishes queued by the last step
        self._flight: Flight | None = None      # the step enqueued last, not read back yet
        self._landing: Flight | None = None     # the one before it, while a step is being enqueued
        self._overlap = (self.config.async_scheduling and self.spec is None
                         and not self.config.run_to_completion)
        self.overlapped = 0                     # steps enqueued while the one before was still in flight
        self._releasing: list[Request] = []     # finished, row and pages given back after _pending's publishes
        k_max = self.spec.spec.num_speculative_tokens + 1 if self.spec is not None else 1
        # pages a decoding request gets ahead of its writes: a decode call's tokens or a verify's
        # K + 1, or (run_to_completion) everything up to its max_tokens
        lookahead = None if self.config.run_to_completion else max(self.config.decode_steps, k_max)
        self.scheduler = Scheduler(max_num_seqs=self.config.max_num_seqs,
                                   max_num_batched_tokens=self.config.max_num_batched_tokens,
                                   blocks=self.blocks, lookahead=lookahead,
                                   chunk_cap=self.runner.chunk_cap,
                                   on_admit=self._reuse_prefix if self.prefix else None,
                                   next_stop=self._next_publish if self.prefix else None,
                                   on_release=self._before_release if self.prefix else None,
                                   isolate=lambda q: q.strikes > 0)
        self.metrics = metrics or EngineMetrics()
        if metrics is None:
            self.metrics.bind(self.live_figures)
        self.speculative = (SpeculativeStep(self.runner, self.spec, self.metrics, self.config.run_to_completion)
                            if self.spec is not None else None)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._eos = llm.eos_token_ids()
        self._rng = np.random.default_rng(self.config.seed)   # seeds of requests that bring none

    # --- requests ----------------------------------------------------------------------------------
    def check(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Admission: raises InputError for a prompt or parameters this model and engine cannot
        serve (see engine/limits.py); returns the prompt's text and token ids."""
        return admit(prompt, params, self.llm.tokenizer, self.llm.config.vocab_size, self.config.max_model_len)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival: float | None = None) -> Request:
        """Queues a request. `arrival` (time.monotonic()) is when its client sent it: latency figures
        count from there (default: now)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InputError(f"request id {request_id!r} is already in use")
        text, ids = self.check(prompt, params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        req = Request(request_id=request_id, prompt_ids=ids, params=params, seed=seed, prompt_text=text,
                      arrival=time.monotonic() if arrival is None else arrival)
        self.requests[request_id] = req
        if self.llm.tokenizer is not None and (self.config.detokenize or params.stop):
            self._detok[request_id] = IncrementalDetokenizer(self.llm.tokenizer)
        if self.prefix is not None:
            self.prefix.prefetch(request_id, ids)    # a disk hit starts loading now, overlapping other work
        self.scheduler.add(req)
        return req

    def _drop(self, req: Request, reason: str):
        """Ends a request that did not finish by itself (aborted, failed): row, pages and state back."""
        self.requests.pop(req.request_id, None)
        self.scheduler.release(req)
        req.status, req.finish_reason = RequestStatus.ABORTED, reason
        self.metrics.success.labels(finished_reason=reason).inc()
        self._detok.pop(req.request_id, None)
        self.points.forget(req.request_id)
        self._pending = [x for x in self._pending if x.request_id != req.request_id]
        if self.spec is not None:
            self.spec.forget(req.request_id)
        if self.prefix is not None and self.prefix.disk is not None:
            self.prefix.disk.forget(req.request_id)

    def abort_request(self, request_id: str):
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._drop(req, "abort")
            self.metrics.aborted.inc()
            self._land_if_finished()

    def _land_if_finished(self):
        """Reads back now a step in flight whose requests have all finished (stopped, aborted): nothing
        will step behind it, and read later (at the next request, after an idle gap) the device time it
        took could no longer be told from the gap. Its tokens are dropped."""
        f = self._flight
        if f is not None and all(q.finished for q in f.reqs):
            self._flight = None
            self._land(f)

    def abort_all(self) -> list[str]:
        """Aborts every request the engine holds (after a step raised past its own isolation: nothing
        is known about the state it left); returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """Fails one request (finish_reason "error"); the engine and every other request go on."""
        if not req.finished:
            self._drop(req, "error")
            self.metrics.step_failures.labels(attributable="true").inc()
        return RequestOutput(req.request_id, [], "", list(req.output_ids), req.text, True, "error", req.prompt_ids,
                             [], error=message)

    def live_figures(self) -> dict:
        """What /metrics shows of the present (read from another thread: plain reads, retried if a
        dict changed size under us)."""
        misses: dict[str, int] = {}
        for _ in range(3):
            try:
                if self.prefix is not None:
                    misses = {**dict(self.prefix.stats.misses_by_reason),
                              **(dict(self.prefix.disk.reasons) if self.prefix.disk else {})}
                usage = self.cache_usage()
                break
            except RuntimeError:
                usage = {}
        disk = self.prefix.disk if self.prefix is not None else None
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running), "cache_usage": usage,
                "compiled": self.num_compiled(),
                "paged_groups": {n for n, g in self.blocks.groups.items() if g.paged}, "prefix_misses": misses,
                "disk_tier": disk.health() if disk is not None else None}

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests to run, or tokens in flight for one that has not finished
        (a step in flight for finished requests only is read back at once: `_land_if_finished`)."""
        return (bool(self.scheduler.waiting) or len(self.scheduler.running) > len(self._releasing)
                or (self._flight is not None and not all(q.finished for q in self._flight.reqs)))

    def warmup(self, mode: str | None = None):
        t0 = time.perf_counter()
        mode = mode or self.config.warmup
        self.runner.warmup(mode)
        if self.spec is not None and mode != "none":
            self.runner.warmup_verify(self.spec.spec.k_buckets(), replay=self.spec.spec.rollback == "replay")
        if self.prefix is not None and mode != "none":
            self.runner.cache = self.prefix.warmup(self.runner.cache, self.runner.null_slot)
        self.warmup_seconds = time.perf_counter() - t0

    def num_compiled(self) -> int:
        """Programs compiled so far: the step buckets plus the prefix cache's save and load."""
        return self.runner.num_compiled() + (self.prefix.num_compiled() if self.prefix else 0)

    # --- prefix cache ------------------------------------------------------------------------------
    def _new_prefix_cache(self, cap_bytes: int) -> PrefixCache:
        llm, c = self.llm, self.config
        return PrefixCache(self.runner.cache, PrefixCacheConfig(
            cap_bytes=cap_bytes, fingerprint=llm.fingerprint(), dtype=jnp.dtype(llm.dtype).name,
            block_size=c.prefix_block_size, checkpoint_interval=c.prefix_checkpoint_interval,
            checkpoint_grid=c.checkpoint_grid, sharding=llm.layout.key if llm.layout else "replicated",
            copies=self.runner.copies),
            self.blocks, disk=self._disk_config())

    def _disk_config(self) -> DiskConfig | None:
        c = self.config
        if c.kv_cache_dir is None:
            return None
        return DiskConfig(directory=c.kv_cache_dir, cap_bytes=c.kv_cache_dir_bytes, policy=c.prefetch_policy,
                          timeout_s=c.prefetch_timeout_s)

    def _next_publish(self, q: Request) -> int | None:
        return self.points.next_point(self.prefix, q)

    def _reuse_prefix(self, q: Request) -> int:
        """Scheduler hook on admission: the new request gets its cached prefix when a hit validates
        (the stored pages in its block tables, the checkpoints in its row). When its prompt runs along
        cached blocks further than any checkpoint, the point where it branches off becomes one of its
        publish points, so the next request sharing that prefix resumes there."""
        self.runner.cache, got = self.prefix.reuse(self.runner.cache, q.slot, q.request_id, q.all_ids)
        n = got.boundary
        q.num_cached_tokens = n
        self.points.admitted(self.prefix, q, got.branch)
        self.metrics.prefix_queries.inc(len(q.all_ids))
        self.metrics.prefix_hits.inc(n)
        st = self.prefix.stats
        self.metrics.prefix_hit_rate.set(st.hit_rate)
        self.metrics.validation_pass_rate.set(st.validation_pass_rate)
        self.metrics.effective_reuse.set(st.effective_reuse)
        return n

    def _decode_caps(self, reqs) -> list[int] | None:
        """Plain decode calls stop each row on its next publish point (`PublishPoints.decode_caps`)."""
        if self.prefix is None:
            return None
        return self.points.decode_caps(self.prefix, reqs, self.config.run_to_completion)

    def flush_publishes(self):
        """Runs the publishes queued by the last step, then gives back the rows and pages of the
        requests that finished in it with a publish pending. Callers do it once the step's tokens are
        out (the async loop, generate()), so a request that ends in the step that reaches its publish
        boundary (max_tokens 1) gets its token before the copy; the next step does it anyway before
        scheduling, and a request does it before giving its row and pages back."""
        pending, self._pending = self._pending, []
        for x in pending:            # (only with prefix caching on: nothing is queued without it)
            span = self.prefix.geometry.lcm * self.prefix.config.checkpoint_interval
            self.runner.cache = self.prefix.publish(self.runner.cache, x.row, x.request_id, x.tokens, x.boundary,
                                                    branch=x.branch, durable=not x.decoded or x.boundary % span == 0,
                                                    spare=x.spare, keep=x.keep)
        releasing, self._releasing = self._releasing, []
        for q in releasing:                  # finished requests whose rows waited for those publishes
            self.scheduler.release(q)

    def _before_release(self, q: Request):
        if any(x.request_id == q.request_id for x in self._pending):
            self.flush_publishes()

    def reset_prefix_cache(self, prefix_cache_bytes: int | None = None):
        """Drops every cached prefix and the counters (optionally with a new store cap); running
        requests keep their rows. The store's programs compile again on next use."""
        if self.prefix is None:
            raise InputError("prefix caching is off: EngineConfig(enable_prefix_caching=True)")
        self.flush_publishes()
        cap = self.prefix.config.cap_bytes if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix.close()
        self.prefix = self._new_prefix_cache(cap)

    def close(self):
        """Closes the prefix store (waits for the disk tier's pending writes)."""
        if self.prefix is not None:
            self.prefix.close()

    def cache_stats(self) -> dict:
        """Prefix-cache figures (hit rate, validation pass rate, effective reuse, misses by reason,
        bytes per kind and per group); {"enabled": False} when prefix caching is off."""
        if self.prefix is None:
            return {"enabled": False}
        self.flush_publishes()
        return {"enabled": True, **self.prefix.cache_stats(), "decode_publishes": self.points.decode_publishes,
                "pools": self.pool_usage()}

    def pool_usage(self) -> dict:
        """Per cache group: pages (or checkpoint units) in use and in the pool."""
        b = self.blocks
        return {n: {"used": b.used_units(n), "total": g.num_units} for n, g in b.groups.items()}

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. A failure attributable to one request fails only that request (an
        output with finish_reason "error"); any other failure resets the step state (`_recover`)
        and the requests go on. Nothing a request sends makes this raise."""
        self._planned: list[Request] = []
        t0, w0, d0 = time.perf_counter(), self.runner.wait_seconds, self.runner.device_seconds
        try:
            return self._step()
        except RequestFailed as e:
            log.error("request %s failed in an engine step; the other requests go on", e.request_id,
                      exc_info=e.cause)
            try:
                outs = self._land_late()    # the step before this one is still in flight: its tokens stand
            except Exception as e2:  # noqa: BLE001
                return self._recover(e2)
            req = self.requests.get(e.request_id)
            return outs + ([self._fail(req, str(e))] if req is not None else [])
        except Exception as e:  # noqa: BLE001  (no client input reaches here unchecked: recover, keep serving)
            return self._recover(e)
        finally:
            if self._planned:           # a step ran: its host time is its wall time less the device wait
                self.metrics.note_step(time.perf_counter() - t0, self.runner.wait_seconds - w0,
                                       self.runner.device_seconds - d0)

    def _recover(self, exc: BaseException) -> list[RequestOutput]:
        """A step failed and no single request can be blamed: the pools may have been consumed by
        the failed call, so they are rebuilt empty (with the block manager and the prefix store),
        and every running request goes back to the queue to be recomputed from its tokens (its
        output so far is kept; sampling resumes at the same step, so the outputs do not change).
        The requests of the failed step become suspects: each then runs alone to its end (the
        scheduler's `isolate`; slower, and only after such a failure), and a suspect whose step
        fails again fails. So a request that always breaks a step fails by itself and cannot wedge
        the engine, while the innocents of its step go on, with unchanged outputs."""
        self.metrics.step_failures.labels(attributable="false").inc()
        self._flight = self._landing = None     # what was in flight is lost with the pools: it is sampled again
        for q in self.requests.values():        # (at the same sampling steps, so the outputs do not change)
            q.num_inflight = 0
        planned = list(self._planned)
        for q in planned:
            q.strikes += 1
        self._pending = []
        releasing, self._releasing = self._releasing, []
        for q in releasing:                  # finished: their rows go back, unpublished (the pools are reset)
            self.scheduler.release(q)
        for q in list(self.scheduler.running):
            self.scheduler._preempt(q)
        self._reset_pools()
        outs = [self._fail(q, f"request {q.request_id!r}: its step failed again when it ran alone "
                              f"({type(exc).__name__}: {exc})")
                for q in planned if q.strikes >= 2 and not q.finished]
        log.error("engine step failed (%s: %s), not attributable to one request: step state reset (pools, "
                  "block manager%s rebuilt); %d requests requeued for recompute, %d failed",
                  type(exc).__name__, exc, ", prefix store" if self.prefix is not None else "",
                  len(self.scheduler.waiting), len(outs), exc_info=exc)
        return outs

    def _reset_pools(self):
        self.runner.reset_pools()
        self.blocks = BlockManager(self.runner.geometry(), num_rows=self.config.max_num_seqs)
        self.runner.blocks = self.scheduler.blocks = self.blocks
        if self.prefix is not None:
            try:
                self.prefix.close()
            except Exception:  # noqa: BLE001  (the old store's pools are gone; only the disk flush matters)
                log.exception("closing the prefix store after a failed step")
            self.prefix = self._new_prefix_cache(self.prefix.config.cap_bytes)
        self.points.clear()

    def _step(self) -> list[RequestOutput]:
        if self._pending or self._releasing:
            self.flush_publishes()
        plan = self.scheduler.schedule()
        for r in plan.preempted:
            self.metrics.preemptions.inc()
        self._landing, self._flight = self._flight, None   # read back once this step is enqueued
        outs = []
        if plan.rows:
            now = time.monotonic()
            for p in plan.rows:
                q = p.request
                self._planned.append(q)
                if q.scheduled_time is None:
                    q.scheduled_time = now
                    self.metrics.queue_time.observe(now - q.arrival)
            self._copy_on_write(plan)
            reqs = [p.request for p in plan.rows]
            if plan.is_decode_only and self.spec is not None:
                outs = self._step_speculative(reqs)
            else:
                self._flight = self._dispatch_decode(reqs) if plan.is_decode_only else self._dispatch_mixed(plan.rows)
                self.overlapped += self._landing is not None
        outs = self._land_late() + outs
        if self._flight is not None and (self._flight.sync or not self._overlap):
            f, self._flight = self._flight, None
            outs += self._land(f)
        self._land_if_finished()
        return outs

    def _dispatch_mixed(self, rows) -> Flight:
        """Enqueues a mixed step (prefill chunks beside decodes); a row that samples counts one token."""
        d = self.runner.dispatch_mixed(rows)
        for p in rows:
            q = p.request
            if not q.num_output:            # (a decode row's token may be in flight: it is no prompt token)
                self.metrics.prompt_tokens.inc(p.num_tokens)
            q.num_computed += p.num_tokens
            q.num_inflight += int(p.sample)
        return self._in_flight([p.request for p in rows], d, [int(p.sample) for p in rows])

    def _dispatch_decode(self, reqs) -> Flight:
        """Enqueues plain decode iterations: `decode_steps` of them, or offline every row to its end in
        one call. Each row counts min(steps, its remaining tokens, its publish cap) tokens: it samples
        that many unless a stop token id ends it sooner."""
        steps = self.config.decode_steps
        if self.config.run_to_completion:
            steps = (self.spec.fallback_steps(reqs) if self.spec is not None
                     else bucket(max(q.remaining_tokens for q in reqs), 16))
        caps = self._decode_caps(reqs)
        d = self.runner.dispatch_decode(reqs, steps, caps=caps)
        counted = [min(steps, q.remaining_tokens, caps[i] if caps is not None else steps) for i, q in enumerate(reqs)]
        for q, n in zip(reqs, counted):
            q.num_computed += n       # each iteration fed one token, then sampled one
            q.num_inflight += n
        return self._in_flight(reqs, d, counted)

    def _in_flight(self, reqs, d: Dispatched, counted: list[int]) -> Flight:
        sync = self.prefix is not None and any(self.points.due(self.prefix, q) for q in reqs)
        return Flight(reqs, d, counted, sync, self._hit_rates(reqs))

    def _land_late(self) -> list[RequestOutput]:
        """Reads back the step that was in flight while this one was enqueued."""
        f, self._landing = self._landing, None
        return self._land(f) if f is not None else []

    def _read(self, f: Flight):
        """A flight's tokens and logprobs, its requests' counts made exact: a row that stopped on a stop
        token id sampled fewer than counted (it is finished; any later step's tokens for it are dropped)."""
        toks, lps = self.runner.land(f.dispatched)
        self.metrics.step_seconds.observe(time.perf_counter() - f.dispatched.dispatched)
        for q, n, row in zip(f.reqs, f.counted, toks):
            got = int(np.sum(row >= 0))
            q.num_inflight -= n
            if got != n:
                if got > n or not (got and int(row[got - 1]) in self._stop_set(q)):
                    raise RuntimeError(f"request {q.request_id!r}: a step sampled {got} tokens where {n} were "
                                       f"counted")
                if q.status is RequestStatus.RUNNING:
                    q.num_computed -= n - got
        return toks, lps

    def _stop_set(self, q: Request) -> set[int]:
        """The token ids that end the request: its stop_token_ids and, unless ignore_eos, the model's EOS."""
        return set(q.params.stop_token_ids) | (set() if q.params.ignore_eos else set(self._eos))

    def _land(self, f: Flight) -> list[RequestOutput]:
        toks, lps = self._read(f)
        return self._emit(f.reqs, toks, lps, publish=f.sync, rates=f.rates)

    def _step_speculative(self, reqs) -> list[RequestOutput]:
        """A decode-only step with speculation (engine/speculative_step.py)."""
        def decode(rs):
            f = self._dispatch_decode(rs)
            return (*self._read(f), f.rates)
        toks, lps, rates = self.speculative.run(reqs, decode, self._hit_rates)
        return self._emit(reqs, toks, lps, rates=rates)

    def _emit(self, reqs, toks, lps, publish: bool = True, rates=None) -> list[RequestOutput]:
        """The host's work on a step's tokens: the publishes it reached (`publish`: only a step read back
        before the next was enqueued can reach one), then per request append, stop checks, finishing.
        A request that finished or was dropped while the step was in flight gets nothing. rates: the
        step's sparse hit rates (`_hit_rates`)."""
        if self.prefix is not None and publish:
            self._pending += self.points.reached(self.prefix, reqs, toks)
        now = time.monotonic()
        outs = []
        for i, q in enumerate(reqs):
            new = [int(t) for t in toks[i] if t >= 0]
            if not new or q.finished or self.requests.get(q.request_id) is not q:
                continue
            try:
                with attributed(q):
                    out = self._append(q, new, tuple(a[i] for a in lps), now)
            except RequestFailed as e:
                log.error("request %s failed after a step; the other requests go on", q.request_id,
                          exc_info=e.cause)
                out = self._fail(q, str(e))
            if out is not None:
                outs.append(out)
        self._sparse_hit_rate(rates)
        self.metrics.note_tokens(sum(len(o.new_token_ids) for o in outs))
        return outs

    def cache_usage(self) -> dict[str, float]:
        """Share of each cache group's pages (or checkpoint units) in use."""
        b = self.blocks
        return {n: b.used_units(n) / g.num_units for n, g in b.groups.items() if g.num_units}

    def _copy_on_write(self, plan):
        """The private copies of shared pages the step's rows write (reserved by the scheduler with the
        rest of their pages: `BlockManager.reserve`) are made on the device before the step runs; the
        step then writes only pages nobody else reads."""
        if plan.copies:
            self.runner.copy_on_write(plan.copies)

    def spec_stats(self) -> dict:
        """Speculative decoding figures; {"enabled": False} without a speculative config."""
        return {"enabled": True, **self.spec.stats()} if self.spec is not None else {"enabled": False}

    def _hit_rates(self, reqs):
        """Models with Top-K sparse attention record, per row, the resident share of the positions
        their last step selected: right after a step is enqueued, its rows' figures (a device array,
        read with the step's tokens; the pools themselves move on to the next step), else None."""
        g = next((g for g in self.runner.cache.groups.values() if g.kind == "mla_latent"), None)
        slots = [q.slot for q in reqs if q.slot is not None]
        return jnp.take(g.hit_rate, jnp.asarray(slots, jnp.int32)) if g is not None and slots else None

    def _sparse_hit_rate(self, rates):
        """The gauge: the mean over a step's rows (`_hit_rates`)."""
        if rates is not None:
            self.metrics.sparse_hit_rate.set(float(np.mean(np.asarray(rates))))

    def _append(self, q: Request, new: list[int], lps, now: float) -> RequestOutput | None:
        """Adds sampled tokens to a request; applies stop ids, max tokens and stop strings. A stop string
        ends the output at the token that completes it, however the steps cut the tokens (text cut
        before it), so the outputs do not depend on batching."""
        stops = self._stop_set(q)
        accepted = []
        for t in new:
            accepted.append(t)
            if t in stops:
                q.finish_reason = "stop"
                break
            if len(q.output_ids) + len(accepted) >= q.params.max_tokens:
                q.finish_reason = "length"
                break
        old_text = q.text
        detok = self._detok.get(q.request_id)
        if detok is not None:
            accepted = detokenize_with_stops(q, detok, accepted, old_text)
        if q.first_token_time is None:
            self.metrics.ttft.observe(now - q.arrival)
        elif accepted:
            self.metrics.itl.observe((now - q.last_token_time) / len(accepted))
        q.first_token_time = q.first_token_time or now
        q.last_token_time = now
        new_lps = []
        if q.params.logprobs is not None:
            c, v, ids = lps
            n = q.params.logprobs if q.params.logprobs >= 0 else ids.shape[1]    # -1: the whole vocabulary
            new_lps = [{"token_id": t, "logprob": float(c[j]),
                        "top": list(zip(ids[j, :n].tolist(), v[j, :n].tolist()))}
                       for j, t in enumerate(accepted)]
            q.logprobs += new_lps
        q.output_ids += accepted
        self.metrics.generation_tokens.inc(len(accepted))
        if q.finish_reason is not None:
            self._detok.pop(q.request_id, None)
            self.points.forget(q.request_id)
            if self.spec is not None:
                self.spec.forget(q.request_id)
            q.status = RequestStatus.FINISHED
            if any(x.request_id == q.request_id for x in self._pending):
                self._releasing.append(q)     # its row is published first, once its tokens are out
            else:
                self.scheduler.release(q)
            self.requests.pop(q.request_id, None)
            self.metrics.note_finished(q, now)
        new_text = q.text[len(old_text):] if q.text.startswith(old_text) else q.text
        return RequestOutput(q.request_id, accepted, new_text, list(q.output_ids), q.text, q.finished,
                             q.finish_reason, q.prompt_ids, new_lps, list(q.logprobs) if q.finished else [])

    # --- offline convenience -----------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Runs prompts to completion through the continuous-batching loop; outputs in prompt order."""
        sps = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, sps):
            self.add_request(rid, p, sp)
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        self.flush_publishes()
        return [final[rid] for rid in ids]
