"""The host-side scheduler: it owns every request's state, the block manager and the prefix glue.

Each step is three calls, as in vLLM v1's engine core:

  schedule()                      -> SchedulerOutput: the step's whole input (rows, chunk sizes, the
                                     pages' copy-on-write pairs, the decode plan)
  commit(output)                     the engine enqueued it: its tokens are counted ahead
  update_from_output(output, result) the step's tokens read back: counts made exact, tokens appended,
                                     stops applied, requests finished and their rows and pages freed

`commit` is separate from `schedule` because of overlap: the engine enqueues step t+1 before it reads
step t's tokens, so a request's in-flight tokens (`Request.num_inflight`) are counted when its step is
enqueued, and a step that failed to enqueue counts nothing. Every other change to a request (admission,
preemption, abort, failure, recovery after a failed step) is a method here too; the engine keeps the
loop, the overlap of steps and the recovery of the device pools.

Policy. FCFS admission into rows and pages, chunked prefill mixed with decode under a per-step token
budget. Each step every running request asks for its uncomputed tokens: one for a decoding request
(its last sample), up to the rest of the prompt for a prefilling one. Decodes are served first, then
prefills in arrival order take chunks from what is left of the budget; a request whose chunk
completes its known tokens samples at the end of the step.

Memory is the block manager's (cache.block_manager): a request holds a row (its fixed-size state)
and, per paged group, the pages its tokens fill. Reserve before you schedule: a request is scheduled
only once it holds every page its writes need (a decoding one `lookahead` tokens ahead: a decode step
writes up to `decode_steps` tokens, a verify up to K + 1; None: up to its max_tokens, for an engine
that decodes every row to its end in one call), and a private copy of each page in that range it
shares with the prefix store or another request (copy-on-write; the output lists the copies for the
engine to make before the step). When the pages run out even after the prefix store let go of what
only it held, the newest running request is preempted: it gives back its row and pages and waits at
the head of the queue to be recomputed (its published prefix may well serve it then). So a step never
fails for want of a page.

A request with strikes (it was in a step that failed without a culprit: `recover`) runs alone: it is
admitted only when no other request runs, and nothing is admitted beside it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from cache.block_manager import BlockManager
from hybrid_jax.decode_loop import decode_count, steps_to_end
from hybrid_jax.engine.fork import ForkGroups
from hybrid_jax.engine.metrics import EngineMetrics
from hybrid_jax.engine.outputs import OutputProcessor
from hybrid_jax.engine.prefix_manager import PrefixManager
from hybrid_jax.engine.prompt_logprobs import PromptScores
from hybrid_jax.engine.request import EngineOutput, Request, RequestFailed, RequestStatus, attributed

log = logging.getLogger("hybrid_jax.engine")

# Pages per paged group that admission leaves free for each running request beyond its present step
# (`Scheduler._admission_reserve`): room to cross its next page boundary. On the shipped default model
# with a pool of 33 pages of 64 tokens for 10 concurrent 450-token answers (benchmarks/pressure.py's
# load, in process), 0 / 1 / 2 pages gave 93 / 31 / 12 preemptions and 20.6 / 18.1 / 17.5 s with
# prefix caching, 97 / 20 / 19 preemptions without; 2 pages (128 tokens a request here) serialise
# small pools that hold two requests exactly, so 1.
ADMISSION_HEADROOM_PAGES = 1


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    num_tokens: int          # tokens written to the cache this step
    sample: bool             # the step ends on this request's last known token: sample the next
    reset: bool              # the row was just handed over: start from an empty row


@dataclasses.dataclass
class SchedulerOutput:
    """One step's input. mode: "mixed" (prefill chunks beside decodes, one sample per row at most),
    "decode" (decode_steps plain iterations, each row stopping at its cap) or "speculative" (a
    decode-only step that the speculative path runs: drafts verified, or plain iterations)."""
    rows: list[ScheduledRow]
    preempted: list[Request]
    # per paged group, the (source, copy) pages to copy on the device before the step: the private
    # copies its rows' writes need (copy-on-write), reserved with the rest of their pages
    copies: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    mode: str = "mixed"
    decode_steps: int | None = None        # decode: iterations; speculative: those of a plain fallback
    caps: list[int] | None = None          # decode / speculative: per row, the most tokens before a publish
    counted: list[int] | None = None       # set by commit: per row, the tokens counted ahead
    # requests with logits processors placed in a row by this schedule: their rows' processor state is
    # seeded on the device before the step (ModelRunner.seed_rows)
    placed: list[Request] = dataclasses.field(default_factory=list)
    sync: bool = False                     # set by commit: a row reaches a publish point (read back first)
    # (leader row, member row) pairs whose row state the engine copies before the step (engine/fork.py)
    forks: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_tokens == 1 and r.sample and not r.reset and r.request.num_output for r in self.rows)

    @property
    def requests(self) -> list[Request]:
        return [p.request for p in self.rows]


@dataclasses.dataclass
class StepResult:
    """What a step sampled, read back: tokens [n, T] (-1 past a row's end; T = 1 for a mixed step) and
    the logprob triples (chosen [n, T], top values [n, T, W], top ids [n, T, W]); the prompt scores of
    the rows that ask for prompt_logprobs (a mixed step's)."""
    tokens: np.ndarray
    lps: tuple
    prompt: list[PromptScores] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, blocks: BlockManager,
                 lookahead: int | None = 1, chunk_cap=None, prefix: PrefixManager | None = None,
                 outputs: OutputProcessor | None = None, metrics: EngineMetrics | None = None,
                 decode_steps: int = 4, run_to_completion: bool = False, speculative: bool = False,
                 forking: bool = True):
        """chunk_cap(rows) -> the largest prefill chunk worth scheduling beside `rows` rows (a padded
        step pads every row to its longest, so long chunks beside many decodes would waste it);
        prefix: the prefix glue (prefix caching on); outputs: turns tokens into outputs (an engine's);
        speculative: decode-only steps run the speculative path; forking: the members of a ForkGroup
        are forked from their leader (engine/fork.py), else run as ordinary requests."""
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.blocks = blocks
        self.lookahead = lookahead
        self.chunk_cap = chunk_cap or (lambda rows: max_num_batched_tokens)
        self.prefix, self.outputs = prefix, outputs
        self.metrics = metrics or EngineMetrics()
        self.decode_steps, self.run_to_completion, self.speculative = decode_steps, run_to_completion, speculative
        self.requests: dict[str, Request] = {}           # every request not ended, by id
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []                 # in admission order
        self._fresh: set[str] = set()                    # admitted, row not yet reset
        self.forks = ForkGroups(forking)                 # n > 1 groups whose members wait for the fork

    # --- requests coming and going -------------------------------------------------------------------
    def add(self, req: Request):
        self.forks.add(req)
        self.requests[req.request_id] = req
        if self.outputs is not None:
            self.outputs.add(req)
        if self.prefix is not None:
            self.prefix.prefetch(req)
        self.waiting.append(req)

    def _give_back(self, req: Request):
        if self.prefix is not None and self.prefix.has_pending(req.request_id):
            self.flush_publishes()          # its row is published first
        self.blocks.release_request(req.request_id)
        req.slot = None
        self._fresh.discard(req.request_id)

    def release(self, req: Request):
        """Frees a finished or aborted request's row and pages."""
        if req in self.running:
            self.running.remove(req)
            self._give_back(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _preempt(self, req: Request):
        self.running.remove(req)
        self._give_back(req)
        req.num_computed, req.status = 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)      # recompute first: it was admitted before anyone waiting

    def abort(self, request_id: str) -> bool:
        """Ends a request its client gave up on; False when there is none (or it ended already)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._drop(req, "abort")
        self.metrics.aborted.inc()
        return True

    def _drop(self, req: Request, reason: str):
        """Ends a request that did not finish by itself (aborted, failed): row, pages and state back."""
        self.requests.pop(req.request_id, None)
        self.release(req)
        self.forks.forget(req)
        req.status, req.finish_reason = RequestStatus.ABORTED, reason
        self.metrics.success.labels(finished_reason=reason).inc()
        if self.outputs is not None:
            self.outputs.forget(req.request_id)
        if self.prefix is not None:
            self.prefix.forget(req.request_id, dropped=True, transfer=req.params.kv_transfer)

    def fail(self, req: Request, message: str) -> EngineOutput:
        """Fails one request (finish_reason "error"); the engine and every other request go on."""
        if not req.finished:
            self._drop(req, "error")
            self.metrics.step_failures.labels(attributable="true").inc()
        return OutputProcessor.failed(req, message)

    def _finish(self, q: Request, now: float):
        """A request ended by itself (stop, length): its row and pages go back once its pending
        publishes ran (the next flush), else now."""
        if self.prefix is not None:
            self.prefix.forget(q.request_id, transfer=q.params.kv_transfer)
        q.status = RequestStatus.FINISHED
        if self.prefix is not None and self.prefix.has_pending(q.request_id):
            self.prefix.releasing.append(q)
        else:
            self.release(q)
        self.requests.pop(q.request_id, None)
        self.metrics.note_finished(q, now)

    def flush_publishes(self):
        """Runs the publishes queued by the last step read back, then gives back the rows and pages of
        the requests that finished in it with a publish pending. Callers do it once the step's tokens
        are out (so a request that ends in the step that reaches its publish point gets its token
        before the copy); the next `schedule` does it anyway, and a request before giving its row back."""
        if self.prefix is not None:
            for q in self.prefix.flush():
                self.release(q)

    def releasing(self) -> int:
        """Finished requests whose rows wait for a publish."""
        return len(self.prefix.releasing) if self.prefix is not None else 0

    def recover(self, planned: list[Request]) -> list[Request]:
        """After a step failed without a culprit: nothing is in flight any more, queued publishes are
        void (the pools are lost), every running request goes back to the queue to be recomputed from
        its tokens (its output so far kept; sampling resumes at the same step, so outputs do not
        change), and the requests of the failed step get a strike. Returns those with two strikes (a
        second failure while running alone: they fail). The caller then gives new pools and a new
        block manager (`reset_blocks`)."""
        for q in self.requests.values():
            q.num_inflight = 0
        for q in planned:
            q.strikes += 1
        if self.prefix is not None:
            self.prefix.pending = []
            releasing, self.prefix.releasing = self.prefix.releasing, []
            for q in releasing:              # finished: their rows go back, unpublished (the pools are reset)
                self.release(q)
        for q in list(self.running):
            self._preempt(q)
        return [q for q in planned if q.strikes >= 2 and not q.finished]

    def reset_blocks(self, blocks: BlockManager):
        """New, empty pools: a new block manager, and a new prefix store over it."""
        self.blocks = blocks
        if self.prefix is not None:
            self.prefix.reset(blocks)

    # --- one step ------------------------------------------------------------------------------------
    def _decoding(self, r: Request) -> bool:
        """Only its last sample is missing from the cache (a prompt's last chunk of 1 is not that)."""
        return r.num_uncomputed == 1 and r.num_output > 0 and r.request_id not in self._fresh

    def _limit(self, r: Request) -> int:
        """Most tokens the request can ever hold (prompt + max_tokens)."""
        return len(r.prompt_ids) + r.params.max_tokens

    def _reserve_or_preempt(self, r: Request, end: int, copies: dict, preempted: list[Request]) -> bool:
        """Every page a step writing `r`'s tokens [num_computed, end) needs (its growth and the private
        copies of shared pages in that range: `BlockManager.reserve`), preempting the newest other
        running requests while the pools are short. False (r itself preempted) when even that is not
        enough. The copies go into `copies` (request id -> group -> pairs)."""
        while (got := self.blocks.reserve(r.request_id, r.num_computed, end)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is r:
                return False
        if got:
            copies[r.request_id] = got
        return True

    def _admission_reserve(self, budget: int) -> dict[str, int]:
        """Pages per paged group that admissions must leave to the running requests: what their
        prefills may reserve this step (an upper bound: a chunk of the whole budget each, with the
        copies of shared pages in it), and ADMISSION_HEADROOM_PAGES more for each running request,
        so that a pool filled by admissions does not make the next page boundary of every decoding
        request a preemption (a new request admitted, then pushed out, then admitted again)."""
        out: dict[str, int] = {}
        for r in self.running:
            end = r.num_computed if self._decoding(r) else r.num_computed + min(r.num_uncomputed, budget)
            grow, copy = self.blocks.missing(r.request_id, end), self.blocks.shared_in(r.request_id, r.num_computed, end)
            for g, k in grow.items():
                out[g] = out.get(g, 0) + k + copy[g] + ADMISSION_HEADROOM_PAGES
        return out

    def _decodes(self, rows: list, copies: dict, preempted: list) -> int:
        """Schedules the decoding requests (each one token of budget, pages `lookahead` ahead); returns
        the budget they took."""
        taken = 0
        for r in list(self.running):
            # (a request whose in-flight step samples its last tokens waits for them to be read back)
            if r in self.running and self._decoding(r) and r.remaining_tokens > 0:
                need = self._limit(r) if self.lookahead is None else min(r.num_computed + self.lookahead, self._limit(r))
                if self._reserve_or_preempt(r, need, copies, preempted):
                    rows.append(ScheduledRow(r, 1, True, False))
                    taken += 1
        return taken

    def _admit(self, budget: int, preempted: list, placed: list):
        """Admits waiting requests (FCFS) while a row, the token budget and the pages allow a first
        chunk beside what the running requests may soon take (`_admission_reserve`), so that an
        admitted request neither preempts itself for its first chunk's pages nor pushes a running one
        out at its next page boundary."""
        promised = self._admission_reserve(budget) if self.waiting else {}
        left = budget
        while self.blocks.free_rows() and left > 0:
            # (members wait to fork; a structured output waits for its grammar's compile, off this thread)
            req = next((q for q in self.waiting if not self.forks.held(q) and (q.grammar is None or q.grammar.ready)),
                       None)
            if req is None or req in preempted:
                break
            if self.running and (req.strikes > 0 or any(r.strikes > 0 for r in self.running)):
                break                              # a suspect runs alone
            first = min(req.num_uncomputed, left)
            row = self.blocks.take_row(req.request_id)
            # its first chunk's pages even without a prefix hit, and with one a private copy of the hit's
            # partial last page (the only shared page a first chunk writes)
            need = {g: k + (self.prefix is not None) for g, k in self.blocks.missing(req.request_id, first).items()}
            total = {g: k + promised.get(g, 0) for g, k in need.items()}
            if not self.blocks.can_supply(total):
                self.blocks.release_request(req.request_id)
                break
            promised, left = total, left - first
            self.waiting.remove(req)
            req.slot = row
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            placed.append(req)
            cached = self.prefix.reuse(req) if self.prefix is not None else 0
            if cached > 0:
                req.num_computed = cached          # the row and pages were filled from the prefix cache
            else:
                self._fresh.add(req.request_id)

    def _prefills(self, rows: list, budget: int, copies: dict, preempted: list):
        """Prefill chunks, oldest first, from what is left of the budget."""
        prefilling = [r for r in self.running if not self._decoding(r)]
        cap = self.chunk_cap(len(rows) + len(prefilling)) if prefilling else 0
        for r in prefilling:
            if r not in self.running:
                continue
            n = min(r.num_uncomputed, budget, cap)
            for stop in (self.prefix.next_stop(r) if self.prefix is not None else None, self.forks.stop(r)):
                if stop is not None and r.num_computed < stop < r.num_computed + n:
                    n = stop - r.num_computed
            if n <= 0:
                continue
            if not self._reserve_or_preempt(r, r.num_computed + n, copies, preempted):
                continue
            rows.append(ScheduledRow(r, n, n == r.num_uncomputed, r.request_id in self._fresh))
            self._fresh.discard(r.request_id)
            budget -= n

    def schedule(self) -> SchedulerOutput:
        if self.prefix is not None and (self.prefix.pending or self.prefix.releasing):
            self.flush_publishes()
        preempted: list[Request] = []
        copies: dict[str, dict[str, list[tuple[int, int]]]] = {}
        rows: list[ScheduledRow] = []
        budget = self.token_budget - self._decodes(rows, copies, preempted)
        placed: list[Request] = []
        self._admit(budget, preempted, placed)
        forks = self.forks.admit(self)
        members = {row for _, row in forks}
        placed += [q for q in self.running if q.slot in members]     # forked members are placed too
        self._prefills(rows, budget, copies, preempted)
        rows = [p for p in rows if p.request in self.running]   # a later preemption may take a scheduled row
        forked = {q.slot for q in self.running}
        forks = [f for f in forks if f[1] in forked]            # (nor a forked member's row copy)
        merged: dict[str, list[tuple[int, int]]] = {}
        for p in rows:                     # (a preempted row's copies went back with its pages)
            for g, pairs in copies.get(p.request.request_id, {}).items():
                merged.setdefault(g, []).extend(pairs)
        out = SchedulerOutput(rows=rows, preempted=preempted, copies=merged, forks=forks,
                              placed=[q for q in self.running if q.params.processes_logits and q in placed])
        self.metrics.preemptions.inc(len(preempted))
        if rows and out.is_decode_only:
            self._plan_decode(out)
        now = time.monotonic()
        for q in out.requests:
            if q.scheduled_time is None:
                q.scheduled_time = now
                self.metrics.queue_time.observe(now - q.arrival)
        return out

    def _plan_decode(self, out: SchedulerOutput):
        """A decode-only step: plain iterations (`decode_steps`, or offline every row to its end in one
        call), each row capped at its next publish point; or the speculative path."""
        reqs = out.requests
        out.mode = "speculative" if self.speculative else "decode"
        if self.run_to_completion:
            out.decode_steps = None if self.speculative else steps_to_end(q.remaining_tokens for q in reqs)
        else:
            out.decode_steps = self.decode_steps
        out.caps = self.prefix.decode_caps(reqs) if self.prefix is not None else None
        if any(q.grammar is not None for q in reqs):
            # A grammar's mask needs the token before it, so its row samples one token a step, and so does
            # every row beside it: the call then runs one iteration rather than decode_steps of which the
            # masked rows use the first (benchmarks/structured.py measured both; this one is faster).
            out.caps = [1] * len(reqs)

    def decode_counts(self, reqs: list[Request], steps: int, caps: list[int] | None) -> list[int]:
        """Tokens each row of a plain decode call of `steps` iterations samples unless a stop token id
        ends it sooner: min(steps, its remaining max_tokens, its publish cap) (`decode_loop.decode_count`)."""
        return [int(decode_count(steps, q.remaining_tokens, caps[i] if caps is not None else None))
                for i, q in enumerate(reqs)]

    def commit(self, out: SchedulerOutput):
        """The engine enqueued the step: its tokens are counted ahead (each row's in-flight tokens; a
        mixed row's chunk and a decode row's iterations as computed), and whether it must be read back
        before the next step is enqueued (it reaches a publish point) is decided. Not for the
        speculative path, whose counts are known only when its tokens are read."""
        reqs = out.requests
        if out.mode == "decode":
            out.counted = self.decode_counts(reqs, out.decode_steps, out.caps)
            for q, n in zip(reqs, out.counted):
                q.num_computed += n       # each iteration fed one token, then sampled one
                q.num_inflight += n
        else:
            for p in out.rows:
                q = p.request
                if not q.num_output:            # (a decode row's token may be in flight: it is no prompt token)
                    self.metrics.prompt_tokens.inc(p.num_tokens)
                q.num_computed += p.num_tokens
                q.num_inflight += int(p.sample)
            out.counted = [int(p.sample) for p in out.rows]
        # read back before the next step when a row publishes its prefix, or samples under a grammar (its
        # next mask is made from this step's token)
        out.sync = (self.prefix is not None and self.prefix.due(reqs)) or any(q.grammar is not None for q in reqs)

    def _reconcile(self, out: SchedulerOutput, toks: np.ndarray):
        """A counted step's counts made exact: a row that stopped on a stop token id sampled fewer than
        counted (it is finished; any later step's tokens for it are dropped)."""
        for q, n, row in zip(out.requests, out.counted, toks):
            got = int(np.sum(row >= 0))
            q.num_inflight -= n
            if got != n:
                if got > n or not (got and self.outputs is not None and int(row[got - 1]) in self.outputs.stop_set(q)):
                    raise RuntimeError(f"request {q.request_id!r}: a step sampled {got} tokens where {n} were "
                                       f"counted")
                if q.status is RequestStatus.RUNNING:
                    q.num_computed -= n - got

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[EngineOutput]:
        """The one place a step's tokens become request state: counts made exact (a counted step) or
        applied (the speculative path: every token it emitted but the new pending one was fed), the
        publish points reached queued, then per request its tokens appended, stops applied, and if it
        ended, it is finished and its row and pages freed. A request that finished or was dropped while
        the step was in flight gets nothing; a failure in one request's host work fails it alone."""
        reqs, toks = out.requests, result.tokens
        if out.counted is not None:
            self._reconcile(out, toks)
        else:
            for q, row in zip(reqs, toks):
                q.num_computed += int(np.sum(row >= 0))
        if self.prefix is not None and (out.sync or out.counted is None):
            self.prefix.reached(reqs, toks)
        if result.prompt and self.outputs is not None:
            self.outputs.prompt.note(result.prompt)
        now = time.monotonic()
        outs = []
        for i, q in enumerate(reqs):
            new = [int(t) for t in toks[i] if t >= 0]
            if not new or q.finished or self.requests.get(q.request_id) is not q:
                continue
            try:
                with attributed(q):
                    if q.grammar is not None:     # fail-closed: a token outside the grammar fails the request
                        q.grammar.accept(new)
                    accepted, text, lps = self.outputs.append(q, new, tuple(a[i] for a in result.lps), now)
                    if q.finish_reason is None and q.grammar is not None and q.grammar.stopped:
                        q.finish_reason = "stop"          # the grammar is complete: nothing may follow
                    if q.finish_reason is not None:
                        self._finish(q, now)
                    outs.append(self.outputs.output(q, accepted, text, lps))
            except RequestFailed as e:
                log.error("request %s failed after a step; the other requests go on", q.request_id, exc_info=e.cause)
                outs.append(self.fail(q, str(e)))
        self.metrics.note_tokens(sum(len(o.new_token_ids) for o in outs))
        return outs

    # --- what the engine reports ---------------------------------------------------------------------
    def cache_usage(self) -> dict[str, float]:
        """Share of each cache group's pages (or checkpoint units) in use."""
        b = self.blocks
        return {n: b.used_units(n) / g.num_units for n, g in b.groups.items() if g.num_units}

    def pool_usage(self) -> dict:
        """Per cache group: pages (or checkpoint units) in use and in the pool."""
        b = self.blocks
        return {n: {"used": b.used_units(n), "total": g.num_units} for n, g in b.groups.items()}
