"""The host-side scheduler: FCFS admission into cache slots, chunked prefill mixed with decode under
a per-step token budget, and preemption (recompute) when live cache bytes would pass the cap.

Each step every running request asks for its uncomputed tokens: one for a decoding request (its
last sample), up to the rest of the prompt for a prefilling one. Decodes are served first, then
prefills in arrival order take chunks from what is left of the token budget; a request whose chunk
completes its known tokens samples at the end of the step.
"""
from __future__ import annotations

import collections
import dataclasses

from hybrid_jax.engine.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    num_tokens: int          # tokens written to the cache this step
    sample: bool             # the step ends on this request's last known token: sample the next
    reset: bool              # the slot was just handed over: start from an empty cache row


@dataclasses.dataclass
class StepPlan:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_tokens == 1 and r.sample and not r.reset and r.request.output_ids for r in self.rows)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, bytes_per_token: int,
                 bytes_per_seq: int, byte_cap: int, chunk_cap=None, on_admit=None, next_stop=None):
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.bytes_per_token = bytes_per_token
        self.bytes_per_seq = bytes_per_seq
        self.byte_cap = byte_cap
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []           # in admission order
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._fresh: set[str] = set()              # admitted, cache row not yet reset
        # chunk_cap(rows) -> the largest prefill chunk worth scheduling beside `rows` rows: a step
        # pads every row to its longest, so long chunks beside many decodes would waste the step.
        self.chunk_cap = chunk_cap or (lambda rows: max_num_batched_tokens)
        # on_admit(req) -> tokens of the request its new slot already holds (a reused prefix), and
        # next_stop(req) -> the next token count a prefill chunk must end at (a publish boundary) or None.
        self.on_admit = on_admit
        self.next_stop = next_stop

    # --- bookkeeping --------------------------------------------------------------------------------
    def add(self, req: Request):
        self.waiting.append(req)

    def live_bytes(self, extra_tokens: int = 0, extra_seqs: int = 0) -> int:
        toks = sum(r.num_computed for r in self.running) + extra_tokens
        return toks * self.bytes_per_token + (len(self.running) + extra_seqs) * self.bytes_per_seq

    def release(self, req: Request):
        """Frees a finished or aborted request's slot."""
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.slot = None
        self._fresh.discard(req.request_id)

    def _preempt(self, req: Request):
        self.running.remove(req)
        self.free_slots.append(req.slot)
        req.slot, req.num_computed, req.status = None, 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self._fresh.discard(req.request_id)
        self.waiting.appendleft(req)      # recompute first: it was admitted before anyone waiting

    def _decoding(self, r: Request) -> bool:
        """Only its last sample is missing from the cache (a prompt's last chunk of 1 is not that)."""
        return r.num_uncomputed == 1 and bool(r.output_ids) and r.request_id not in self._fresh

    # --- one step ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        preempted: list[Request] = []
        # Decodes need one token each; preempt the newest until the running set fits the cap.
        while self.running:
            need = sum(min(r.num_uncomputed, self.token_budget) for r in self.running)
            if self.live_bytes(extra_tokens=need) <= self.byte_cap or len(self.running) == 1:
                break
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
        # Admit waiting requests (FCFS) while a slot and the byte cap allow their first chunk.
        budget = self.token_budget
        reserved = sum(1 for r in self.running if self._decoding(r))
        while self.waiting and self.free_slots and budget - reserved > 0:
            req = self.waiting[0]
            if req in preempted:
                break
            chunk = min(req.num_uncomputed, budget - reserved)
            need = sum(min(r.num_uncomputed, self.token_budget) for r in self.running)
            if self.running and self.live_bytes(extra_tokens=need + chunk, extra_seqs=1) > self.byte_cap:
                break
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            cached = self.on_admit(req) if self.on_admit is not None else 0
            if cached > 0:
                req.num_computed = cached          # the row was filled from the prefix cache
            else:
                self._fresh.add(req.request_id)
            reserved += 1
        rows = []
        for r in self.running:                      # decodes first
            if self._decoding(r):
                rows.append(ScheduledRow(r, 1, True, False))
                budget -= 1
        prefilling = [r for r in self.running if not self._decoding(r)]
        cap = self.chunk_cap(len(rows) + len(prefilling)) if prefilling else 0
        for r in prefilling:                        # then prefill chunks, oldest first
            n = min(r.num_uncomputed, budget, cap)
            stop = self.next_stop(r) if self.next_stop is not None else None
            if stop is not None and r.num_computed < stop < r.num_computed + n:
                n = stop - r.num_computed
            if n <= 0:
                continue
            rows.append(ScheduledRow(r, n, n == r.num_uncomputed, r.request_id in self._fresh))
            self._fresh.discard(r.request_id)
            budget -= n
        return StepPlan(rows=rows, preempted=preempted)
