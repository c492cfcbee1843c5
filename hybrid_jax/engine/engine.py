"""LLMEngine: requests in, streamed outputs out, one scheduler step at a time.

`step()` is schedule -> execute -> update, as in vLLM v1's engine core: the scheduler
(engine/scheduler.py, the one owner of request state, pages and the prefix glue) gives the step's
whole input, the runner (engine/runner.py) runs it as one compiled call (a mixed prefill/decode step,
`decode_steps` decode iterations when nothing is prefilling, or the speculative path), and the
scheduler takes the tokens back (`update_from_output`). This object keeps the loop, the overlap of
steps and the recovery from a failed step.

Overlap (`EngineConfig.async_scheduling`): a step is enqueued on the device before the tokens of the
step before it are read back (a `Flight`), so the device never waits for the host's work between
steps. Sampling stays on the device, and a row whose last token is still in flight is fed it from
there (the runner's `slot_last`). The scheduler counts a request's in-flight tokens when its step is
enqueued (`Scheduler.commit`: the step's iterations, its max_tokens and its publish cap are known; only
a stop token id can end it sooner, on the device) and applies what only the host can check (stop
strings, finishing, aborts) when they are read back, one step late: the tokens a finished request's
next step sampled are discarded, never emitted. A step at whose end a request publishes its prefix
is read back before anything else is enqueued (its rows are copied as they stand then). Speculative
decoding reads every step's tokens before drafting the next, so it does not overlap.

Memory: the runner's pools (cache.pools) and one block manager (cache.block_manager), the
scheduler's, that hands out their rows, pages and checkpoint units to the requests and to the prefix
cache, which shares its stored pages with the requests that hit them.
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
from hybrid_jax.engine.compile import enable_persistent_compilation_cache
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.contracts import LoadedModel, Loads, as_loaded
from hybrid_jax.engine.fork import can_fork, run_forks
from hybrid_jax.engine.limits import admit
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.outputs import OutputProcessor
from hybrid_jax.engine.prefix_manager import PrefixManager
from hybrid_jax.engine.prompt_logprobs import landed
from hybrid_jax.engine.request import EngineOutput, ForkGroup, Request, RequestFailed
from hybrid_jax.engine.runner import Dispatched, ModelRunner
from hybrid_jax.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from hybrid_jax.engine.speculate import EngineSpeculator
from hybrid_jax.engine.speculative_step import SpeculativeStep
from hybrid_jax.engine.startup import Startup, plan
from hybrid_jax.engine.startup_status import StartupClock, StartupStatus, status
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.structured.grammars import GrammarCompiler

log = logging.getLogger("hybrid_jax.engine")


@dataclasses.dataclass
class Flight:
    """A step enqueued on the device whose tokens the host has not read yet: the scheduler's output
    for it (its counts ahead and whether it must be read back before the next step is enqueued are
    set: `Scheduler.commit`) and its rows' sparse hit rates (on the device, or None)."""
    out: SchedulerOutput
    dispatched: Dispatched
    rates: Any = None

    @property
    def reqs(self) -> list[Request]:
        return self.out.requests


class LLMEngine:
    def __init__(self, model: LoadedModel | Loads, config: EngineConfig | None = None,
                 metrics: EngineMetrics | None = None):
        """model: the LoadedModel to serve (an LLM facade hands over its own); metrics: a registry shared
        with other engines (data-parallel replicas: the owner binds its live figures); by default the
        engine's own."""
        self.loaded = m = as_loaded(model)
        self.config = c = config or EngineConfig()
        if c.max_model_len > m.max_model_len:
            raise InputError(f"engine max_model_len {c.max_model_len} exceeds the model's {m.max_model_len}")
        enable_persistent_compilation_cache(c.compilation_cache_dir)
        self.metrics = metrics or EngineMetrics()
        self.runner = ModelRunner(m.config, m.params, m.dtype, c, impl=m.impl, layout=m.layout, eos_ids=m.eos_ids)
        blocks = BlockManager(self.runner.geometry(), num_rows=c.max_num_seqs)
        self.runner.blocks = blocks
        self.spec = self._speculator() if c.speculative_config else None
        prefix = (PrefixManager(self.runner, self._store_settings(), self._disk_config(), blocks, self.metrics,
                                c.run_to_completion, c.prefix_publish_chunk_ends) if c.enable_prefix_caching else None)
        k_max = self.spec.spec.num_speculative_tokens + 1 if self.spec is not None else 1
        # pages a decoding request gets ahead of its writes: a decode call's tokens or a verify's
        # K + 1, or (run_to_completion) everything up to its max_tokens
        lookahead = None if c.run_to_completion else max(c.decode_steps, k_max)
        self.scheduler = Scheduler(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                   blocks=blocks, lookahead=lookahead, chunk_cap=self.runner.chunk_cap,
                                   prefix=prefix, metrics=self.metrics,
                                   outputs=OutputProcessor(m.tokenizer, c.detokenize, m.eos_ids, self.metrics),
                                   decode_steps=c.decode_steps, run_to_completion=c.run_to_completion,
                                   speculative=self.spec is not None, forking=can_fork(self.runner))
        if metrics is None:
            self.metrics.bind(self.live_figures)
        self.speculative = (SpeculativeStep(self.runner, self.spec, self.metrics, c.run_to_completion)
                            if self.spec is not None else None)
        self._flight: Flight | None = None      # the step enqueued last, not read back yet
        self._landing: Flight | None = None     # the one before it, while a step is being enqueued
        self._overlap = c.async_scheduling and self.spec is None and not c.run_to_completion
        self.overlapped = 0                     # steps enqueued while the one before was still in flight
        self._planned: list[Request] = []       # the requests of the step under way (recovery's suspects)
        self._rng = np.random.default_rng(c.seed)   # seeds of requests that bring none
        self._grammars: GrammarCompiler | None = None   # structured outputs' compiles (made on first use)
        self.startup: Startup | None = None     # the warm-up's plan and progress (engine/startup.py)
        self.clock = StartupClock()             # when the load's phases ended (set by llm.build_engine)

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured outputs' grammar compiler (hybrid_jax/structured/grammars.py), made on first use."""
        if self._grammars is None:
            m = self.loaded
            self._grammars = GrammarCompiler(m.tokenizer, m.config.vocab_size, m.eos_ids)
        return self._grammars

    def _speculator(self) -> EngineSpeculator:
        m = self.loaded
        spec = EngineSpeculator(self.config.speculative_config, m.config.vocab_size, self.runner.abstract.groups)
        extra = spec.spec.num_speculative_tokens + 1
        if spec.draft is not None:
            dcfg, dparams, ddtype = spec.draft
            self.runner.set_draft(dcfg, dparams, ddtype, extra=extra)
        elif spec.spec.method == "mtp":
            from hybrid_jax.speculative.mtp import check_mtp  # noqa: PLC0415
            check_mtp(self.runner.model, m.config, m.params, m.name)
            self.runner.set_mtp(extra=extra)
        return spec

    def _store_settings(self) -> PrefixCacheConfig:
        m, c = self.loaded, self.config
        return PrefixCacheConfig(
            cap_bytes=c.prefix_cache_bytes or self.runner.budget_bytes, fingerprint=m.fingerprint(),
            dtype=jnp.dtype(m.dtype).name, block_size=c.prefix_block_size,
            checkpoint_interval=c.prefix_checkpoint_interval, checkpoint_grid=c.checkpoint_grid,
            sharding=m.layout.key if m.layout else "replicated", copies=self.runner.copies)

    def _disk_config(self) -> DiskConfig | None:
        c = self.config
        if c.kv_cache_dir is None:
            return None
        return DiskConfig(directory=c.kv_cache_dir, cap_bytes=c.kv_cache_dir_bytes, policy=c.prefetch_policy,
                          timeout_s=c.prefetch_timeout_s)

    # --- what the scheduler owns, for callers and tests ----------------------------------------------
    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix store (None with prefix caching off)."""
        return self.scheduler.prefix.store if self.scheduler.prefix is not None else None

    @property
    def points(self):
        return self.scheduler.prefix.points

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    # --- requests ----------------------------------------------------------------------------------
    def check(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Admission: raises InputError for a prompt or parameters this model and engine cannot
        serve (see engine/limits.py); returns the prompt's text and token ids."""
        return admit(prompt, params, self.loaded.tokenizer, self.loaded.config.vocab_size, self.config.max_model_len,
                     speculative=self.spec is not None)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival: float | None = None, group: ForkGroup | None = None) -> Request:
        """Queues a request. `arrival` (time.monotonic()) is when its client sent it: latency figures
        count from there (default: now). `group`: the request is one of the k sequences of a request
        with n = k (add the leader, index 0, first): the group prefills its prompt once and forks
        (engine/fork.py). Without it, an id of the server's fan-out, `<group id>#<index>/<k>`, names
        the group (ForkGroup.from_request_id)."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise InputError(f"request id {request_id!r} is already in use")
        text, ids = self.check(prompt, params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        if group is not None and not isinstance(group, ForkGroup):
            raise InputError(f"group must be a ForkGroup or None, got {type(group).__name__}")
        group = ForkGroup.from_request_id(request_id) if group is None else group
        req = Request(request_id=request_id, prompt_ids=ids, params=params, seed=seed, prompt_text=text,
                      arrival=time.monotonic() if arrival is None else arrival, group=group)
        if params.structured_outputs is not None:        # compiled off this thread; admitted once ready
            if self.loaded.tokenizer is None:
                raise InputError("structured outputs need the model's tokenizer; this model has none")
            so = params.structured_outputs
            gate = tuple(self.loaded.tokenizer.encode(so.after, add_bos=False)) if so.after else ()
            req.grammar = self.grammars.request(so, gate)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str):
        if self.scheduler.abort(request_id):
            self._forget(request_id)
            self._land_if_finished()

    def _forget(self, request_id: str):
        """A request ended: the drafter's state of it goes too."""
        if self.spec is not None:
            self.spec.forget(request_id)

    def _forget_finished(self, outs: list[EngineOutput]) -> list[EngineOutput]:
        for o in outs:
            if o.finished:
                self._forget(o.request_id)
        return outs

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
        ids = list(self.scheduler.requests)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def live_figures(self) -> dict:
        """What /metrics shows of the present (read from another thread: plain reads, retried if a
        dict changed size under us)."""
        s = self.scheduler
        misses: dict[str, int] = {}
        for _ in range(3):
            try:
                if s.prefix is not None:
                    misses = s.prefix.misses()
                usage = s.cache_usage()
                break
            except RuntimeError:
                usage = {}
        return {"waiting": len(s.waiting), "running": len(s.running), "cache_usage": usage,
                "compiled": self.num_compiled(), "stalls": self.runner.compiler.stats.stalls,
                "by_source": self.runner.compiler.table.by_source(), "startup": self.startup_status(),
                "paged_groups": {n for n, g in s.blocks.groups.items() if g.paged}, "prefix_misses": misses,
                "disk_tier": s.prefix.disk_health() if s.prefix is not None else None}

    def startup_status(self) -> StartupStatus | None:
        """Where the load and warm-up are (engine/startup_status.py); None for an engine that
        `hybrid_jax.llm.build_engine` did not build (no load was timed)."""
        if self.clock.weights_at is None:
            return None
        progress = [self.startup.progress] if self.startup is not None else []
        return status(progress, [self.runner.compiler.stats], self.clock)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests to run, or tokens in flight for one that has not finished
        (a step in flight for finished requests only is read back at once: `_land_if_finished`)."""
        s = self.scheduler
        return (bool(s.waiting) or len(s.running) > s.releasing()
                or (self._flight is not None and not all(q.finished for q in self._flight.reqs)))

    def warmup(self, mode: str | None = None, on_progress=None, background: bool = True):
        """Builds the step programs the warm-up mode names (engine/startup.py): the ready set now, every
        CPU compiling (or read from the program store); with mode "all" the smaller buckets then on a
        background thread (`wait_compiled`; background=False: now). After a warm-up, a step that finds
        no compiled program to run in is a stall, counted (`compile.Compiler.program`).
        on_progress(StartupProgress) after each program."""
        t0 = time.perf_counter()
        mode = mode or self.config.warmup
        if mode != "none" and self.loaded.tokenizer is not None:
            self.grammars.prepare()     # the grammar library's tokenizer, converted on its worker meanwhile
        spec = self.spec.spec if self.spec is not None else None
        self.startup = Startup(self.runner, plan(self.runner, mode, spec), on_progress)
        self.startup.ready_phase()
        if self.scheduler.prefix is not None and mode != "none":
            self.scheduler.prefix.warmup()
        if mode != "none":
            self.runner.compiler.serving = True
        self.warmup_seconds = time.perf_counter() - t0
        self.startup.start_background()
        if not background:
            self.wait_compiled()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until the warm-up's background compiles are done; whether they are."""
        return self.startup.wait(timeout) if self.startup is not None else True

    def num_compiled(self) -> int:
        """Programs compiled so far: the step buckets plus the prefix cache's save and load."""
        return self.runner.num_compiled() + (self.prefix.num_compiled() if self.prefix else 0)

    # --- prefix cache ------------------------------------------------------------------------------
    def flush_publishes(self):
        """Runs the publishes queued by the last step (`Scheduler.flush_publishes`): callers do it once
        the step's tokens are out (the async loop, generate())."""
        self.scheduler.flush_publishes()

    def reset_prefix_cache(self, prefix_cache_bytes: int | None = None):
        """Drops every cached prefix and the counters (optionally with a new store cap); running
        requests keep their rows. The new store's disk tier is the one `self.config` names now. The
        store's programs compile again on next use."""
        if self.scheduler.prefix is None:
            raise InputError("prefix caching is off: EngineConfig(enable_prefix_caching=True)")
        self.flush_publishes()
        self.scheduler.prefix.reset(self.blocks, prefix_cache_bytes, clear_points=False, disk=self._disk_config())

    def close(self):
        """Closes the prefix store (waits for the disk tier's pending writes)."""
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.close()
        if self._grammars is not None:
            self._grammars.close()

    def cache_stats(self) -> dict:
        """Prefix-cache figures (hit rate, validation pass rate, effective reuse, misses by reason,
        bytes per kind and per group); {"enabled": False} when prefix caching is off."""
        if self.scheduler.prefix is None:
            return {"enabled": False}
        self.flush_publishes()
        return {"enabled": True, **self.prefix.cache_stats(), "decode_publishes": self.points.decode_publishes,
                "pools": self.pool_usage()}

    def pool_usage(self) -> dict:
        """Per cache group: pages (or checkpoint units) in use and in the pool."""
        return self.scheduler.pool_usage()

    def cache_usage(self) -> dict[str, float]:
        """Share of each cache group's pages (or checkpoint units) in use."""
        return self.scheduler.cache_usage()

    def spec_stats(self) -> dict:
        """Speculative decoding figures; {"enabled": False} without a speculative config."""
        return {"enabled": True, **self.spec.stats()} if self.spec is not None else {"enabled": False}

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One scheduler step. A failure attributable to one request fails only that request (an
        output with finish_reason "error"); any other failure resets the step state (`_recover`)
        and the requests go on. Nothing a request sends makes this raise."""
        self._planned = []
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
            req = self.scheduler.requests.get(e.request_id)
            return outs + (self._forget_finished([self.scheduler.fail(req, str(e))]) if req is not None else [])
        except Exception as e:  # noqa: BLE001  (no client input reaches here unchecked: recover, keep serving)
            return self._recover(e)
        finally:
            if self._planned:           # a step ran: its host time is its wall time less the device wait
                self.metrics.note_step(time.perf_counter() - t0, self.runner.wait_seconds - w0,
                                       self.runner.device_seconds - d0)

    def _recover(self, exc: BaseException) -> list[EngineOutput]:
        """A step failed and no single request can be blamed: the pools may have been consumed by
        the failed call, so they are rebuilt empty (with the block manager and the prefix store),
        and every running request goes back to the queue to be recomputed from its tokens
        (`Scheduler.recover`: its output so far is kept, and sampling resumes at the same step, so
        the outputs do not change). The requests of the failed step become suspects: each then runs
        alone to its end, and a suspect whose step fails again fails. So a request that always breaks
        a step fails by itself and cannot wedge the engine, while the innocents of its step go on,
        with unchanged outputs."""
        self.metrics.step_failures.labels(attributable="false").inc()
        self._flight = self._landing = None     # what was in flight is lost with the pools: it is sampled again
        doomed = self.scheduler.recover(list(self._planned))
        self._reset_pools()
        outs = self._forget_finished([self.scheduler.fail(q, f"request {q.request_id!r}: its step failed again when "
                                                             f"it ran alone ({type(exc).__name__}: {exc})")
                                      for q in doomed])
        log.error("engine step failed (%s: %s), not attributable to one request: step state reset (pools, "
                  "block manager%s rebuilt); %d requests requeued for recompute, %d failed",
                  type(exc).__name__, exc, ", prefix store" if self.prefix is not None else "",
                  len(self.scheduler.waiting), len(outs), exc_info=exc)
        return outs

    def _reset_pools(self):
        self.runner.reset_pools()
        blocks = BlockManager(self.runner.geometry(), num_rows=self.config.max_num_seqs)
        self.runner.blocks = blocks
        self.scheduler.reset_blocks(blocks)

    def _step(self) -> list[EngineOutput]:
        outs = self._failed_grammars()
        out = self.scheduler.schedule()
        self._landing, self._flight = self._flight, None   # read back once this step is enqueued
        if out.forks:        # the members forked from their leaders get its row state (engine/fork.py)
            run_forks(self.runner, out.forks)
        if out.placed:           # their rows' logits processors' state (prompt and outputs so far)
            self.runner.seed_rows(out.placed)
        if out.rows:
            self._planned.extend(out.requests)
            if out.copies:       # the private copies its rows write (reserved with their pages)
                self.runner.copy_on_write(out.copies)
            if out.mode == "speculative":
                outs += self._step_speculative(out)
            else:
                self._flight = self._dispatch(out)
                self.overlapped += self._landing is not None
        outs = self._land_late() + outs
        if self._flight is not None and (self._flight.out.sync or not self._overlap):
            f, self._flight = self._flight, None
            outs += self._land(f)
        self._land_if_finished()
        return outs

    def _failed_grammars(self) -> list[EngineOutput]:
        """Waiting requests whose structured output's grammar failed to compile fail, with its message."""
        bad = [q for q in self.scheduler.waiting if q.grammar is not None and q.grammar.error is not None]
        return self._forget_finished([self.scheduler.fail(q, q.grammar.error) for q in bad])

    def _dispatch(self, out: SchedulerOutput) -> Flight:
        """Enqueues a mixed or plain decode step (first the bitmasks of its rows that sample under a
        grammar); the scheduler then counts its tokens ahead."""
        masked = [p.request for p in out.rows if p.sample and p.request.masked]
        if masked:
            self.runner.write_masks(masked)
        if out.mode == "decode":
            d = self.runner.dispatch_decode(out.requests, out.decode_steps, caps=out.caps)
        else:
            d = self.runner.dispatch_mixed(out.rows)
        self.scheduler.commit(out)
        return Flight(out, d, self._hit_rates(out.requests))

    def _land_late(self) -> list[EngineOutput]:
        """Reads back the step that was in flight while this one was enqueued."""
        f, self._landing = self._landing, None
        return self._land(f) if f is not None else []

    def _read(self, d: Dispatched) -> StepResult:
        toks, lps = self.runner.land(d)
        self.metrics.step_seconds.observe(time.perf_counter() - d.dispatched)
        return StepResult(toks, lps, landed(d.prompt))

    def _land(self, f: Flight) -> list[EngineOutput]:
        outs = self.scheduler.update_from_output(f.out, self._read(f.dispatched))
        self._sparse_hit_rate(f.rates)
        return self._forget_finished(outs)

    def _step_speculative(self, out: SchedulerOutput) -> list[EngineOutput]:
        """A decode-only step with speculation (engine/speculative_step.py): drafts verified, or plain
        decode iterations read back at once (no count ahead: the scheduler counts what they emitted)."""
        def decode(rs):
            steps = out.decode_steps if out.decode_steps is not None else self.spec.fallback_steps(rs)
            masked = [q for q in rs if q.masked]
            if masked:                   # (their caps are 1: a mask for one token each)
                self.runner.write_masks(masked)
            d = self.runner.dispatch_decode(rs, steps, caps=out.caps)
            rates = self._hit_rates(rs)
            r = self._read(d)
            return r.tokens, r.lps, rates
        toks, lps, rates = self.speculative.run(out.requests, decode, self._hit_rates)
        outs = self.scheduler.update_from_output(out, StepResult(toks, lps))
        self._sparse_hit_rate(rates)
        return self._forget_finished(outs)

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

    # --- offline convenience -----------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[EngineOutput]:
        """Runs prompts to completion through the continuous-batching loop; outputs in prompt order (each
        the request's last, with the prompt_logprobs its first carried)."""
        sps = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, sps):
            self.add_request(rid, p, sp)
        final: dict[str, EngineOutput] = {}
        prompt_lps: dict[str, list] = {}
        while any(rid not in final for rid in ids):
            for o in self.step():
                if o.prompt_logprobs is not None:
                    prompt_lps[o.request_id] = o.prompt_logprobs
                if o.finished:
                    final[o.request_id] = o
        self.flush_publishes()
        return [dataclasses.replace(final[rid], prompt_logprobs=prompt_lps.get(rid)) for rid in ids]
