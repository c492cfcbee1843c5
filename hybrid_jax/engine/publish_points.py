"""The engine's side of prefix caching: where each request's prefix is published.

A request publishes its cache (`PrefixCache.publish`) at the retention policy's boundaries of its
prompt, at its branch point (where its prompt ran off the cached blocks: the next request sharing that
prefix resumes there), and while decoding at every point of the resume grid, so the next turn of a
conversation resumes after this answer. `PublishPoints` keeps those points per request, turns a
step's progress into the `Publish`es to run after it, and caps plain decode calls so a row stops on
its next grid point. The engine runs the publishes (`LLMEngine.flush_publishes`) once the step's
tokens are out.
"""
from __future__ import annotations

import dataclasses

from cache.prefix_cache import PrefixCache
from hybrid_jax.engine.request import Request


@dataclasses.dataclass(frozen=True)
class Publish:
    """A publish a step queued: request `request_id` (row `row`) holds tokens[:boundary] exactly;
    branch: `boundary` is its branch point (PrefixCache.publish)."""
    row: int
    request_id: str
    tokens: list[int]
    boundary: int
    branch: bool = False
    decoded: bool = False       # a point reached while decoding (PrefixCache.publish's `durable`)
    spare: bool = False         # the prompt's spare point (PrefixCache.spare_point)
    keep: int = 0               # a decoded point's: the prompt's end, kept as a spare (PrefixCache.publish)
    room: int | None = None     # a sending request's handoff point: its handoff goes to this room


def handoff_point(prefix: PrefixCache, q: Request) -> int:
    """A sending request's handoff point (PrefixCache.handoff_point); 0 for any other request."""
    t = q.params.kv_transfer
    return prefix.handoff_point(len(q.prompt_ids)) if t is not None and t.role == "send" else 0


class PublishPoints:
    def __init__(self, chunk_ends: bool = False):
        """chunk_ends: also publish, as spares, the LCM-grid points inside a prompt where a prefill chunk
        ends anyway (the token budget cut it there): a later prompt that branches off further along
        resumes there rather than at an earlier checkpoint, and no chunk is cut for it."""
        self.chunk_ends = chunk_ends
        self._stops: dict[str, tuple[int, ...]] = {}   # request -> publish points of its prefill
        self._branches: dict[str, int] = {}             # request -> its branch point (`admitted`)
        self.decode_publishes = 0                       # publishes of decoded tokens (`reached`)

    def points(self, prefix: PrefixCache, q: Request) -> tuple[int, ...]:
        """Where the request's prefill stops to publish: the retention policy's boundaries of its
        prompt, and its branch point (set at admission)."""
        pts = self._stops.get(q.request_id)
        if pts is None:
            pts = self._stops[q.request_id] = self._prompt_points(prefix, q)
        return pts

    @staticmethod
    def _prompt_points(prefix: PrefixCache, q: Request) -> tuple[int, ...]:
        """The retention policy's boundaries of the prompt, and a sending request's handoff point."""
        pts = prefix.publish_boundaries(len(q.prompt_ids))
        h = handoff_point(prefix, q)
        return tuple(sorted(set(pts) | {h})) if h else pts

    def next_point(self, prefix: PrefixCache, q: Request) -> int | None:
        """The scheduler's next stop for a prefilling request (its chunk ends there)."""
        return next((b for b in self.points(prefix, q) if b > q.num_computed), None)

    def admitted(self, prefix: PrefixCache, q: Request, branch: int):
        """A request was admitted with its cached prefix; `branch`: where its prompt runs off the cached
        blocks (0: nowhere), which becomes one of its publish points."""
        pts = self._prompt_points(prefix, q)
        if branch:
            pts = tuple(sorted(set(pts) | {branch}))
            self._branches[q.request_id] = branch
        self._stops[q.request_id] = pts

    def reached(self, prefix: PrefixCache, reqs, toks) -> list[Publish]:
        """After a step: the publishes of the rows that just reached one of their points (a prompt's
        boundaries and branch point, or while decoding a point of the resume grid: `decode_caps` stops
        the decode there), so a finished request leaves its prompt + output behind up to the last grid
        point. toks[i]: the tokens the step sampled for reqs[i] (-1: none)."""
        grid, out = prefix.geometry.resume, []
        for q, row in zip(reqs, toks):
            b = q.num_computed
            if not self.due(prefix, q):
                continue
            prompt_point = b in self.points(prefix, q)
            passing = not prompt_point and b < len(q.prompt_ids)      # a chunk end inside the prompt
            decoded = not prompt_point and not passing
            self.decode_publishes += int(decoded)
            ids = q.all_ids + [int(t) for t in row if t >= 0]   # the first b were fed to the model
            branch = self._branches.get(q.request_id) == b
            spare = passing or (prompt_point and not branch and b == prefix.spare_point(len(q.prompt_ids)))
            keep = len(q.prompt_ids) // grid * grid if decoded else 0
            keep = keep if keep > q.num_cached_tokens else 0     # one it published itself
            room = q.params.kv_transfer.room if prompt_point and b == handoff_point(prefix, q) else None
            out.append(Publish(q.slot, q.request_id, ids, b, branch, decoded, spare, keep, room))
        return out

    def due(self, prefix: PrefixCache, q: Request) -> bool:
        """Whether the request's row, holding its first q.num_computed tokens, is at one of its points:
        a prompt point, or a point of the resume grid past its prompt (`reached` publishes it)."""
        b = q.num_computed
        if q.slot is None or b <= 0:
            return False
        passing = (self.chunk_ends and q.num_cached_tokens < b < len(q.prompt_ids) and b % prefix.geometry.lcm == 0)
        return (b in self.points(prefix, q) or passing
                or (b > len(q.prompt_ids) and b % prefix.geometry.resume == 0))

    def decode_caps(self, prefix: PrefixCache, reqs, run_to_completion: bool) -> list[int]:
        """Per request, the most tokens a plain decode call may sample for it so that it stops on its
        next grid point (and publishes there). Serving: every grid point. Offline (run_to_completion,
        one call per request's life), only the last one before its max_tokens end: a row stopped early
        idles until the call's longest row ends."""
        grid, caps = prefix.geometry.resume, []
        for q in reqs:
            c = q.num_computed
            if run_to_completion:
                last = (c + q.remaining_tokens - 1) // grid * grid     # the last position fed, on the grid
                caps.append(last - c if last > c else q.remaining_tokens)
            else:
                caps.append((c // grid + 1) * grid - c)
        return caps

    def forget(self, request_id: str):
        self._stops.pop(request_id, None)
        self._branches.pop(request_id, None)

    def clear(self):
        self._stops.clear()
        self._branches.clear()
