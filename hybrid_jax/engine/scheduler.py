"""The host-side scheduler: FCFS admission into rows and pages, chunked prefill mixed with decode under
a per-step token budget, and preemption (recompute) when the pages run out.

Each step every running request asks for its uncomputed tokens: one for a decoding request (its
last sample), up to the rest of the prompt for a prefilling one. Decodes are served first, then
prefills in arrival order take chunks from what is left of the token budget; a request whose chunk
completes its known tokens samples at the end of the step.

Memory is the block manager's (cache.block_manager): a request holds a row (its fixed-size state)
and, per paged group, the pages its tokens fill. Before a step, every scheduled request gets the
pages its writes need (a decoding one `lookahead` tokens ahead: a decode step writes up to
`decode_steps` tokens, a verify up to K + 1; None: up to its max_tokens, for an engine that decodes
every row to its end in one call). When the pages run out even after the prefix store let
go of what only it held, the newest running request is preempted: it gives back its row and pages
and waits at the head of the queue to be recomputed (its published prefix may well serve it then).

`isolate(req)` marks requests that must run alone (the engine's suspects after a step failure it
could not attribute): such a request is admitted only when no other request runs, and nothing is
admitted beside it while it stays marked.
"""
from __future__ import annotations

import collections
import dataclasses

from cache.block_manager import BlockManager
from hybrid_jax.engine.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    num_tokens: int          # tokens written to the cache this step
    sample: bool             # the step ends on this request's last known token: sample the next
    reset: bool              # the row was just handed over: start from an empty row


@dataclasses.dataclass
class StepPlan:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_tokens == 1 and r.sample and not r.reset and r.request.num_output for r in self.rows)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, blocks: BlockManager,
                 lookahead: int | None = 1,
                 chunk_cap=None, on_admit=None, next_stop=None, on_release=None, isolate=None):
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.blocks = blocks
        self.lookahead = lookahead
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []           # in admission order
        self._fresh: set[str] = set()              # admitted, row not yet reset
        # chunk_cap(rows) -> the largest prefill chunk worth scheduling beside `rows` rows: a step
        # pads every row to its longest, so long chunks beside many decodes would waste the step.
        self.chunk_cap = chunk_cap or (lambda rows: max_num_batched_tokens)
        # on_admit(req) -> tokens of the request its new row and pages already hold (a reused prefix);
        # next_stop(req) -> the next token count a prefill chunk must end at (a publish boundary) or None;
        # on_release(req) runs before a request gives its row and pages back (pending publishes).
        self.on_admit = on_admit
        self.next_stop = next_stop
        self.on_release = on_release
        self.isolate = isolate or (lambda req: False)

    # --- bookkeeping --------------------------------------------------------------------------------
    def add(self, req: Request):
        self.waiting.append(req)

    def _give_back(self, req: Request):
        if self.on_release is not None:
            self.on_release(req)
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

    def _decoding(self, r: Request) -> bool:
        """Only its last sample is missing from the cache (a prompt's last chunk of 1 is not that)."""
        return r.num_uncomputed == 1 and r.num_output > 0 and r.request_id not in self._fresh

    def _limit(self, r: Request) -> int:
        """Most tokens the request can ever hold (prompt + max_tokens)."""
        return len(r.prompt_ids) + r.params.max_tokens

    def _grow_or_preempt(self, r: Request, tokens: int, preempted: list[Request]) -> bool:
        """Pages for `r` to hold `tokens` tokens, preempting the newest other running requests if the
        pools are short. False (r itself preempted) when even that is not enough."""
        while not self.blocks.grow(r.request_id, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is r:
                return False
        return True

    # --- one step ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        preempted: list[Request] = []
        rows = []
        budget = self.token_budget
        # Decodes first: each needs one token of budget and pages `lookahead` tokens ahead.
        for r in list(self.running):
            # (a request whose in-flight step samples its last tokens waits for them to be read back)
            if r in self.running and self._decoding(r) and r.remaining_tokens > 0:
                need = self._limit(r) if self.lookahead is None else min(r.num_computed + self.lookahead, self._limit(r))
                if self._grow_or_preempt(r, need, preempted):
                    rows.append(ScheduledRow(r, 1, True, False))
                    budget -= 1
        # Admit waiting requests (FCFS) while a row, the token budget and the pages allow a first chunk.
        while self.waiting and self.blocks.free_rows() and budget > 0:
            req = self.waiting[0]
            if req in preempted:
                break
            if self.running and (self.isolate(req) or any(self.isolate(r) for r in self.running)):
                break                              # a suspect runs alone
            first = min(req.num_uncomputed, budget)
            row = self.blocks.take_row(req.request_id)
            if not self.blocks.can_grow(req.request_id, first):     # even without a prefix hit
                self.blocks.release_request(req.request_id)
                break
            self.waiting.popleft()
            req.slot = row
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            cached = self.on_admit(req) if self.on_admit is not None else 0
            if cached > 0:
                req.num_computed = cached          # the row and pages were filled from the prefix cache
            else:
                self._fresh.add(req.request_id)
        # Then prefill chunks, oldest first.
        prefilling = [r for r in self.running if not self._decoding(r)]
        cap = self.chunk_cap(len(rows) + len(prefilling)) if prefilling else 0
        for r in prefilling:
            if r not in self.running:
                continue
            n = min(r.num_uncomputed, budget, cap)
            stop = self.next_stop(r) if self.next_stop is not None else None
            if stop is not None and r.num_computed < stop < r.num_computed + n:
                n = stop - r.num_computed
            if n <= 0:
                continue
            if not self._grow_or_preempt(r, r.num_computed + n, preempted):
                continue
            rows.append(ScheduledRow(r, n, n == r.num_uncomputed, r.request_id in self._fresh))
            self._fresh.discard(r.request_id)
            budget -= n
        rows = [p for p in rows if p.request in self.running]   # a later preemption may take a scheduled row
        return StepPlan(rows=rows, preempted=preempted)
