"""`n` > 1 by forking: the requests of one `ForkGroup` (engine/request.py) prefill their prompt once.

The front end fans a request with n = k out into k engine requests of one group (the leader, index 0,
first), each with an id `<group id>#<index>/<k>` (server/fanout.py; `ForkGroup.from_request_id`; a
direct caller may pass the ForkGroup to `add_request` instead). The engine then prefills the shared
prompt of P tokens once and forks:

  - the leader prefills up to P - 1 tokens (its chunks stop there, as at a prefix publish point, while
    members wait or may still arrive: `ForkGroups.stop`); the other members wait in the queue, not
    admitted (`ForkGroups.held`);
  - in the first schedule that finds the leader holding exactly P - 1 tokens, each member is admitted
    by forking (`ForkGroups.admit`): a row of its own, the leader's pages listed in its block tables by
    reference (`BlockManager.share`: one more reference each, nothing copied; the partly filled last
    page becomes a private copy when a row writes into it, by the scheduler's copy-on-write), and a copy
    of the leader's row state: the (leader row, member row) pairs go into the step's `SchedulerOutput.
    forks`, and the engine runs them (`run_forks`: every row field of every cache group, one compiled
    program of fixed width, `fork_rows`) before the step, as it runs the page copies;
  - all k rows then feed the last prompt token in the same step, each sampling its own first token
    with its own seed.

Fallbacks: a group whose prompt is 1 token, whose leader is gone (aborted, failed, finished) or has
passed P - 1 (its members could not be forked then: no row or no page free), or a member that asks for
prompt log-probabilities, leaves its members ordinary requests, admitted and prefilled as any other. A
preempted leader recomputes; its members keep waiting until it holds P - 1 again. A member preempted
after the fork recomputes like any request. An engine whose drafter keeps per-row device state (a
draft model, the MTP block) does not fork (`enabled` False): its members run as ordinary requests.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from cache.state import ModelCache
from hybrid_jax.engine.request import ForkGroup, Request, RequestStatus
from hybrid_jax.errors import InputError

if TYPE_CHECKING:       # (the scheduler imports this module)
    from hybrid_jax.engine.scheduler import Scheduler


@dataclasses.dataclass
class _Group:
    """One group's state on the host: its leader (None until it arrives) and the members still waiting
    to be forked from it."""
    leader: Request | None = None
    members: list[Request] = dataclasses.field(default_factory=list)
    seen: int = 0           # members that arrived so far (forkable or not) of the group's size - 1


class ForkGroups:
    """The scheduler's record of the groups whose members wait for their leader's prefill."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._groups: dict[str, _Group] = {}
        self._member_of: dict[str, str] = {}     # waiting member's request id -> its group id
        self.forked = 0                          # members admitted by forking, over the engine's life

    # --- requests in ---------------------------------------------------------------------------------
    def add(self, req: Request):
        """Records a request of a group (before the scheduler queues it). InputError when its group
        already has a leader (a second index 0) or its prompt differs from its group's."""
        g: ForkGroup | None = req.group
        if g is None or g.size < 2 or not self.enabled:
            return
        grp = self._groups.get(g.group_id)
        if grp is not None:
            other = grp.leader or (grp.members[0] if grp.members else None)
            if other is not None and other.prompt_ids != req.prompt_ids:
                raise InputError(f"group: request {req.request_id!r} has another prompt than its group "
                                 f"{g.group_id!r} (request {other.request_id!r})")
            if g.leader and grp.leader is not None:
                raise InputError(f"group: group {g.group_id!r} already has a leader (index 0): request "
                                 f"{grp.leader.request_id!r}")
        grp = self._groups.setdefault(g.group_id, _Group())
        if g.leader:
            grp.leader = req
            return
        grp.seen += 1
        if len(req.prompt_ids) >= 2 and req.params.prompt_logprobs is None:
            grp.members.append(req)
            self._member_of[req.request_id] = g.group_id

    # --- what the scheduler asks ---------------------------------------------------------------------
    @staticmethod
    def _point(leader: Request) -> int:
        return len(leader.prompt_ids) - 1

    def _waits(self, grp: _Group) -> bool:
        """Whether the group's members still wait for their leader: it is there, has not ended, and
        has not passed P - 1 tokens."""
        q = grp.leader
        return q is not None and not q.finished and q.num_output == 0 and q.num_computed <= self._point(q)

    def held(self, req: Request) -> bool:
        """A waiting member the queue must skip: its leader has not reached P - 1 tokens yet (or reached
        it just now: the fork comes in this schedule, `admit`)."""
        gid = self._member_of.get(req.request_id)
        return gid is not None and self._waits(self._groups[gid])

    def stop(self, req: Request) -> int | None:
        """Where a leader's prefill chunk must end (P - 1) while members wait to fork from it, or may
        still arrive (the front end's k requests need not reach one schedule together); None for every
        other request."""
        g = req.group
        if g is None or not g.leader:
            return None
        grp = self._groups.get(g.group_id)
        if grp is None or grp.leader is not req:
            return None
        return self._point(req) if grp.members or grp.seen < g.size - 1 else None

    # --- the fork ------------------------------------------------------------------------------------
    def admit(self, s: "Scheduler") -> list[tuple[int, int]]:
        """Forks the waiting members of every group whose leader holds exactly P - 1 tokens now, while a
        row and a page per paged group are free for each; the members that cannot be forked, and those
        of groups whose leader ended or passed P - 1, become ordinary requests. Returns the (leader row,
        member row) pairs the engine copies before the step."""
        pairs: list[tuple[int, int]] = []
        for gid in list(self._groups):
            grp = self._groups[gid]
            if self._ready(grp.leader):
                pairs += self._fork(s, grp)
                self._close(gid)
            elif not self._waits(grp):       # no leader (send it first), or it ended or passed P - 1
                self._close(gid)
        return pairs

    def _ready(self, q: Request | None) -> bool:
        return (q is not None and q.status is RequestStatus.RUNNING and q.num_output == 0
                and q.num_computed == self._point(q) and q.slot is not None)

    def _fork(self, s: "Scheduler", grp: _Group) -> list[tuple[int, int]]:
        leader, bm, out = grp.leader, s.blocks, []
        P1 = self._point(leader)
        if any(q.strikes > 0 for q in s.running):
            return out                        # a suspect runs alone: its members go on as ordinary requests
        tables = bm.tables[leader.request_id]
        for m in grp.members:
            if m.finished or m not in s.waiting:
                continue
            need = {g: len(out) + 1 for g in tables}        # a page per member and group for its first write
            if not bm.free_rows() or not bm.can_supply(need):
                break
            row = bm.take_row(m.request_id)
            for g, pages in tables.items():
                bm.share(m.request_id, g, pages)
            s.waiting.remove(m)
            m.slot, m.status, m.num_computed = row, RequestStatus.RUNNING, P1
            s.running.append(m)
            if s.prefix is not None:
                s.prefix.forget(m.request_id, dropped=True)    # it never looks the store up: no prefetch kept
            out.append((leader.slot, row))
            self.forked += 1
        return out

    def _close(self, gid: str):
        grp = self._groups.pop(gid)
        for m in grp.members:
            self._member_of.pop(m.request_id, None)

    def forget(self, req: Request):
        """A request ended (or was dropped): a waiting member leaves its group's list."""
        gid = self._member_of.pop(req.request_id, None)
        if gid is not None:
            grp = self._groups[gid]
            grp.members = [m for m in grp.members if m is not req]


# --- the device side ---------------------------------------------------------------------------------
def fork_rows(pools: ModelCache, src: jax.Array, dst: jax.Array) -> ModelCache:
    """Copies rows src [W] -> dst [W] of every row field of every cache group (recurrent state, conv
    windows, rings, tails, per-row counters) where both are >= 0 (padding pairs are -1: dropped)."""
    valid = (src >= 0) & (dst >= 0)
    groups = {n: g.copy(g.row_fields(), src, dst, valid) if g.row_fields() else g for n, g in pools.groups.items()}
    return pools.replace(groups=groups)


def fork_plans(pairs: list[tuple[int, int]], width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pairs as fixed-width (src, dst) int32 plans of `width` entries, -1 padded (one compiled
    program whatever the count)."""
    plans = []
    for start in range(0, len(pairs), width):
        src, dst = np.full((width,), -1, np.int32), np.full((width,), -1, np.int32)
        for i, (a, b) in enumerate(pairs[start:start + width]):
            src[i], dst[i] = a, b
        plans.append((src, dst))
    return plans


def run_forks(runner, pairs: list[tuple[int, int]]):
    """Runs a step's forks on the runner's pools (its compiled `fork_rows`, width `max_num_seqs`)."""
    for src, dst in fork_plans(pairs, runner.ecfg.max_num_seqs):
        runner.cache = runner._fork_rows(runner.cache, src, dst)


def can_fork(runner) -> bool:
    """Whether an engine over this runner forks groups: not where its drafter keeps per-row device
    state (a draft model, the MTP block), which a fork would have to copy too."""
    return runner.dcache is None
