"""The host-side scheduler: FCFS admission into rows and pages, chunked prefill mixed with decode under
a per-step token budget, and preemption (recompute) when the pages run out.

Each step every running request asks for its uncomputed tokens: one for a decoding request (its
last sample), up to the rest of the prompt for a prefilling one. Decodes are served first, then
prefills in arrival order take chunks from what is left of the token budget; a request whose chunk
completes its known tokens samples at the end of the step.

Memory is the block manager's (cache.block_manager): a request holds a row (its fixed-size state)
and, per paged group, the pages its tokens fill. Reserve before you schedule: a request is scheduled
only once it holds every page its writes need (a decoding one `lookahead` tokens ahead: a decode
step writes up to `decode_steps` tokens, a verify up to K + 1; None: up to its max_tokens, for an
engine that decodes every row to its end in one call), and a private copy of each page in that range
it shares with the prefix store or another request (copy-on-write; the plan lists the copies for the
engine to make before the step). When the pages run out even after the prefix store let go of what
only it held, the newest running request is preempted: it gives back its row and pages and waits at
the head of the queue to be recomputed (its published prefix may well serve it then). So a step
never fails for want of a page.

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
    # per paged group, the (source, copy) pages to copy on the device before the step: the private
    # copies its rows' writes need (copy-on-write), reserved with the rest of their pages
    copies: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_tokens == 1 and r.sample and not r.reset and r.request.num_output for r in self.rows)


# Pages per paged group that admission leaves free for each running request beyond its present step
# (`Scheduler._admission_reserve`): room to cross its next page boundary. On the shipped default model
# with a pool of 33 pages of 64 tokens for 10 concurrent 450-token answers (benchmarks/pressure.py's
# load, in process), 0 / 1 / 2 pages gave 93 / 31 / 12 preemptions and 20.6 / 18.1 / 17.5 s with
# prefix caching, 97 / 20 / 19 preemptions without; 2 pages (128 tokens a request here) serialise
# small pools that hold two requests exactly, so 1.
ADMISSION_HEADROOM_PAGES = 1


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
            if self._decoding(r):
                end = r.num_computed
            else:
                end = r.num_computed + min(r.num_uncomputed, budget)
            grow, copy = self.blocks.missing(r.request_id, end), self.blocks.shared_in(r.request_id, r.num_computed, end)
            for g, k in grow.items():
                out[g] = out.get(g, 0) + k + copy[g] + ADMISSION_HEADROOM_PAGES
        return out

    # --- one step ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        preempted: list[Request] = []
        copies: dict[str, dict[str, list[tuple[int, int]]]] = {}
        rows = []
        budget = self.token_budget
        # Decodes first: each needs one token of budget and pages `lookahead` tokens ahead.
        for r in list(self.running):
            # (a request whose in-flight step samples its last tokens waits for them to be read back)
            if r in self.running and self._decoding(r) and r.remaining_tokens > 0:
                need = self._limit(r) if self.lookahead is None else min(r.num_computed + self.lookahead, self._limit(r))
                if self._reserve_or_preempt(r, need, copies, preempted):
                    rows.append(ScheduledRow(r, 1, True, False))
                    budget -= 1
        # Admit waiting requests (FCFS) while a row, the token budget and the pages allow a first chunk
        # beside what the running requests may soon take (`_admission_reserve`), so that an admitted
        # request neither preempts itself for its first chunk's pages nor pushes a running one out at
        # its next page boundary.
        promised = self._admission_reserve(budget) if self.waiting else {}
        left = budget
        while self.waiting and self.blocks.free_rows() and left > 0:
            req = self.waiting[0]
            if req in preempted:
                break
            if self.running and (self.isolate(req) or any(self.isolate(r) for r in self.running)):
                break                              # a suspect runs alone
            first = min(req.num_uncomputed, left)
            row = self.blocks.take_row(req.request_id)
            # its first chunk's pages even without a prefix hit, and with one a private copy of the hit's
            # partial last page (the only shared page a first chunk writes)
            need = {g: k + (self.on_admit is not None) for g, k in self.blocks.missing(req.request_id, first).items()}
            total = {g: k + promised.get(g, 0) for g, k in need.items()}
            if not self.blocks.can_supply(total):
                self.blocks.release_request(req.request_id)
                break
            promised, left = total, left - first
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
            if not self._reserve_or_preempt(r, r.num_computed + n, copies, preempted):
                continue
            rows.append(ScheduledRow(r, n, n == r.num_uncomputed, r.request_id in self._fresh))
            self._fresh.discard(r.request_id)
            budget -= n
        rows = [p for p in rows if p.request in self.running]   # a later preemption may take a scheduled row
        merged: dict[str, list[tuple[int, int]]] = {}
        for p in rows:                     # (a preempted row's copies went back with its pages)
            for g, pairs in copies.get(p.request.request_id, {}).items():
                merged.setdefault(g, []).extend(pairs)
        return StepPlan(rows=rows, preempted=preempted, copies=merged)
