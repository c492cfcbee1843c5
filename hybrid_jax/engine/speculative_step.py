"""The engine's decode step with speculation: the on-device n-gram loop, a verify of drafts, or plain
decode iterations the drafter shadows.

`LLMEngine` runs a decode-only step through `SpeculativeStep.run` when a speculative config is set.
Such a step is never overlapped: drafting reads the tokens of the step before. The drafter and its
bookkeeping (acceptance, the adaptive draft length, shadows) are `engine/speculate.EngineSpeculator`;
the compiled verify and loop programs are the runner's (`ModelRunner.run_verify`, `run_ngram_loop`).
Every path returns the step's tokens [n, T] (-1 past a row's end) with the engine's logprob arrays
(zeros: requests asking for logprobs decode plainly), and changes no request: the scheduler counts
what each row emitted when it takes the tokens (`Scheduler.update_from_output`: every emitted token
but the new pending one was fed).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from hybrid_jax.engine.speculate import EngineSpeculator


def no_logprobs(n: int, T: int) -> tuple:
    """The logprob arrays of a step that computed none: chosen [n, T], top values [n, T, 0], ids [n, T, 0]."""
    return np.zeros((n, T), np.float32), np.zeros((n, T, 0), np.float32), np.zeros((n, T, 0), np.int32)


class SpeculativeStep:
    """runner: the engine's ModelRunner; spec: its EngineSpeculator; metrics: its EngineMetrics;
    run_to_completion: offline mode (every request to its end in one call)."""

    def __init__(self, runner, spec: EngineSpeculator, metrics, run_to_completion: bool):
        self.runner, self.spec, self.metrics, self.run_to_completion = runner, spec, metrics, run_to_completion

    def run(self, reqs, decode: Callable, hit_rates: Callable) -> tuple:
        """One decode-only step of `reqs`: (tokens, logprobs, the rows' sparse hit rates). decode(reqs)
        runs plain decode iterations and reads them back: (tokens, logprobs, hit rates); hit_rates(reqs)
        reads the rows' rates after a verify or loop step."""
        t0 = time.perf_counter()
        if self.loop_mode(reqs):
            toks, lps = self.ngram_loop(reqs)
        else:
            drafts, shadows = self.spec.plan(reqs)
            dt = time.perf_counter() - t0
            self.spec.metrics.draft_time_s += dt
            self.metrics.spec_draft_seconds.inc(dt)
            if drafts is not None and any(len(d) for d in drafts):
                toks, lps = self.verify(reqs, drafts)
            else:
                t1 = time.perf_counter()
                toks, lps, rates = decode(reqs)
                if shadows is not None:
                    self.spec.record_shadow(reqs, shadows, toks, time.perf_counter() - t1)
                return toks, lps, rates
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        return toks, lps, hit_rates(reqs)

    def loop_mode(self, reqs) -> bool:
        """Offline n-gram speculation with rollback by selection runs as the runner's on-device loop
        (every request to its end in one call); a request asking for logprobs, or held to a grammar (its
        masks are made on the host), keeps the host path."""
        return (self.spec.uses_device_loop and self.run_to_completion
                and all(q.params.logprobs is None and q.grammar is None for q in reqs))

    def ngram_loop(self, reqs) -> tuple:
        t0 = time.perf_counter()
        toks, log, branch = self.runner.run_ngram_loop(reqs, self.spec.spec)
        dt = time.perf_counter() - t0
        self.spec.record_loop(reqs, log, branch, dt)
        self.metrics.spec_verify_seconds.inc(dt)
        self._gauges()
        return toks, no_logprobs(*toks.shape)

    def verify(self, reqs, drafts) -> tuple:
        """One verify step: every row emits its accepted drafts plus one token. A drafter on the device
        drafts inside the verify, unless a row is held to a grammar: then it drafts first, the host cuts
        each masked row's draft to what its grammar allows (and fills its masks), and the verify takes
        the drafts as they are with the distributions they were drawn from."""
        K = self.spec.k_bucket(max(len(d) for d in drafts))
        t0 = time.perf_counter()
        given = None
        if self.runner.drafter.on_device and any(q.masked for q in reqs):
            drafts, given = self.runner.draft(reqs, [len(d) for d in drafts], K)
            drafts = [d[:q.grammar.valid_prefix(d)] if q.masked else d for q, d in zip(reqs, drafts)]
        n_acc, out = self.runner.run_verify(reqs, drafts, K, replay=self.spec.spec.rollback == "replay", given=given)
        dt = time.perf_counter() - t0
        self.metrics.spec_verify_seconds.inc(dt)
        toks = np.full(out.shape, -1, np.int32)
        for i, a in enumerate(n_acc):
            toks[i, :a + 1] = out[i, :a + 1]          # the accepted drafts and one more token
        self.spec.record_verify(reqs, drafts, n_acc, dt)
        self._gauges()
        return toks, no_logprobs(*toks.shape)

    def _gauges(self):
        figures = self.spec.metrics.as_dict()
        self.metrics.spec_acceptance.set(figures["acceptance_rate"])
        self.metrics.spec_accepted_length.set(figures["mean_accepted_length"])
