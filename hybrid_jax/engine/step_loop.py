"""The engine's step loop: schedule -> execute -> update, the overlap of steps, and recovery.

`StepLoop.step()` is one engine step as in vLLM v1's engine core: the scheduler (engine/scheduler.py,
the one owner of request state, pages and the prefix glue) gives the step's whole input, the runner
(engine/runner.py) runs it as one compiled call, and the scheduler takes the tokens back
(`update_from_output`). `LLMEngine` (engine/engine.py) owns the loop beside admission, warm-up and
the figures; the loop owns what lives between steps:

- Overlap (`EngineConfig.async_scheduling`): a step is enqueued before the tokens of the step before
  it are read back (a `Flight`), so the device never waits for the host's work between steps. A row
  whose last token is still in flight is fed it on the device (the runner's `slot_last`); the
  scheduler counts a request's in-flight tokens when its step is enqueued (`Scheduler.commit`) and
  applies what only the host can check (stop strings, finishing, aborts) one step late: tokens a
  finished request's next step sampled are discarded, never emitted. A step at whose end a request
  publishes its prefix is read back before anything else is enqueued. Speculative decoding reads
  every step's tokens before drafting the next, so it does not overlap.
- Failure: a step that fails because of one request fails that request only; any other failure
  rebuilds the pools empty and requeues every running request to be recomputed (`recover`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from cache.block_manager import BlockManager
from hybrid_jax.engine.fork import run_forks
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.prompt_logprobs import landed
from hybrid_jax.engine.request import EngineOutput, Request, RequestFailed
from hybrid_jax.engine.runner import Dispatched, ModelRunner
from hybrid_jax.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from hybrid_jax.engine.speculate import EngineSpeculator
from hybrid_jax.engine.speculative_step import SpeculativeStep

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


class StepLoop:
    """scheduler / runner / metrics: the engine's; spec: its EngineSpeculator (None without
    speculation), speculative: the SpeculativeStep that runs it; overlap: whether a step may be
    enqueued before the one before it is read back; max_num_seqs: the rows of a rebuilt block manager."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, metrics: EngineMetrics,
                 spec: EngineSpeculator | None, speculative: SpeculativeStep | None, overlap: bool,
                 max_num_seqs: int):
        self.scheduler, self.runner, self.metrics = scheduler, runner, metrics
        self.spec, self.speculative, self.overlap, self.max_num_seqs = spec, speculative, overlap, max_num_seqs
        self.flight: Flight | None = None      # the step enqueued last, not read back yet
        self.landing: Flight | None = None     # the one before it, while a step is being enqueued
        self.overlapped = 0                    # steps enqueued while the one before was still in flight
        self.planned: list[Request] = []       # the requests of the step under way (recovery's suspects)

    # --- what the engine asks ----------------------------------------------------------------------
    def in_flight(self) -> bool:
        """Whether tokens are in flight for a request that has not finished."""
        return self.flight is not None and not all(q.finished for q in self.flight.reqs)

    def forget(self, request_id: str):
        """A request ended: the drafter's state of it goes too."""
        if self.spec is not None:
            self.spec.forget(request_id)

    def forget_finished(self, outs: list[EngineOutput]) -> list[EngineOutput]:
        for o in outs:
            if o.finished:
                self.forget(o.request_id)
        return outs

    def land_if_finished(self):
        """Reads back now a step in flight whose requests have all finished (stopped, aborted): nothing
        will step behind it, and read later (at the next request, after an idle gap) the device time it
        took could no longer be told from the gap. Its tokens are dropped."""
        f = self.flight
        if f is not None and all(q.finished for q in f.reqs):
            self.flight = None
            self._land(f)

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One scheduler step. A failure attributable to one request fails only that request (an
        output with finish_reason "error"); any other failure resets the step state (`recover`)
        and the requests go on. Nothing a request sends makes this raise."""
        self.planned = []
        t0, w0, d0 = time.perf_counter(), self.runner.wait_seconds, self.runner.device_seconds
        try:
            return self._step()
        except RequestFailed as e:
            log.error("request %s failed in an engine step; the other requests go on", e.request_id,
                      exc_info=e.cause)
            try:
                outs = self._land_late()    # the step before this one is still in flight: its tokens stand
            except Exception as e2:  # noqa: BLE001
                return self.recover(e2)
            req = self.scheduler.requests.get(e.request_id)
            return outs + (self.forget_finished([self.scheduler.fail(req, str(e))]) if req is not None else [])
        except Exception as e:  # noqa: BLE001  (no client input reaches here unchecked: recover, keep serving)
            return self.recover(e)
        finally:
            if self.planned:           # a step ran: its host time is its wall time less the device wait
                self.metrics.note_step(time.perf_counter() - t0, self.runner.wait_seconds - w0,
                                       self.runner.device_seconds - d0)

    def recover(self, exc: BaseException) -> list[EngineOutput]:
        """A step failed and no single request can be blamed: the pools may have been consumed by
        the failed call, so they are rebuilt empty (with the block manager and the prefix store),
        and every running request goes back to the queue to be recomputed from its tokens
        (`Scheduler.recover`: its output so far is kept, and sampling resumes at the same step, so
        the outputs do not change). The requests of the failed step become suspects: each then runs
        alone to its end, and a suspect whose step fails again fails. So a request that always breaks
        a step fails by itself and cannot wedge the engine, while the innocents of its step go on,
        with unchanged outputs."""
        self.metrics.step_failures.labels(attributable="false").inc()
        self.flight = self.landing = None     # what was in flight is lost with the pools: it is sampled again
        doomed = self.scheduler.recover(list(self.planned))
        self._reset_pools()
        outs = self.forget_finished([self.scheduler.fail(q, f"request {q.request_id!r}: its step failed again when "
                                                            f"it ran alone ({type(exc).__name__}: {exc})")
                                     for q in doomed])
        log.error("engine step failed (%s: %s), not attributable to one request: step state reset (pools, "
                  "block manager%s rebuilt); %d requests requeued for recompute, %d failed",
                  type(exc).__name__, exc, ", prefix store" if self.scheduler.prefix is not None else "",
                  len(self.scheduler.waiting), len(outs), exc_info=exc)
        return outs

    def _reset_pools(self):
        self.runner.reset_pools()
        blocks = BlockManager(self.runner.geometry(), num_rows=self.max_num_seqs)
        self.runner.blocks = blocks
        self.scheduler.reset_blocks(blocks)

    def _step(self) -> list[EngineOutput]:
        outs = self._failed_grammars()
        out = self.scheduler.schedule()
        self.landing, self.flight = self.flight, None   # read back once this step is enqueued
        if out.forks:        # the members forked from their leaders get its row state (engine/fork.py)
            run_forks(self.runner, out.forks)
        if out.placed:           # their rows' logits processors' state (prompt and outputs so far)
            self.runner.seed_rows(out.placed)
        if out.rows:
            self.planned.extend(out.requests)
            if out.copies:       # the private copies its rows write (reserved with their pages)
                self.runner.copy_on_write(out.copies)
            if out.mode == "speculative":
                outs += self._step_speculative(out)
            else:
                self.flight = self._dispatch(out)
                self.overlapped += self.landing is not None
        outs = self._land_late() + outs
        if self.flight is not None and (self.flight.out.sync or not self.overlap):
            f, self.flight = self.flight, None
            outs += self._land(f)
        self.land_if_finished()
        return outs

    def _failed_grammars(self) -> list[EngineOutput]:
        """Waiting requests whose structured output's grammar failed to compile fail, with its message."""
        bad = [q for q in self.scheduler.waiting if q.grammar is not None and q.grammar.error is not None]
        return self.forget_finished([self.scheduler.fail(q, q.grammar.error) for q in bad])

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
        f, self.landing = self.landing, None
        return self._land(f) if f is not None else []

    def _read(self, d: Dispatched) -> StepResult:
        toks, lps = self.runner.land(d)
        self.metrics.step_seconds.observe(time.perf_counter() - d.dispatched)
        return StepResult(toks, lps, landed(d.prompt))

    def _land(self, f: Flight) -> list[EngineOutput]:
        outs = self.scheduler.update_from_output(f.out, self._read(f.dispatched))
        self._sparse_hit_rate(f.rates)
        return self.forget_finished(outs)

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
        return self.forget_finished(outs)

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
