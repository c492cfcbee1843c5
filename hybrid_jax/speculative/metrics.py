"""Speculative decoding metrics: acceptance rate, accepted length, draft / verify time, a step log."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecMetrics:
    """Counters of one engine's speculation since it started or `EngineSpeculator.reset_stats()`."""
    verify_steps: int = 0          # verify forwards (one per batch step that speculated)
    row_verifies: int = 0          # (row, verify step) pairs with at least one draft
    draft_tokens: int = 0          # drafts proposed and verified
    accepted_tokens: int = 0       # drafts accepted
    emitted_tokens: int = 0        # tokens emitted by verify steps (accepted + one per row-verify)
    fallback_chunks: int = 0       # plain decode chunks run because no row speculated
    fallback_tokens: int = 0
    replays: int = 0               # verify steps that rolled a rejection back by replay (rollback="replay")
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0     # verify forwards, acceptance, rollback (selection or replay)
    decode_time_s: float = 0.0     # fallback plain decode chunks
    # One entry per (row, verify step): (request id, tokens generated before, k, accepted).
    log: list = dataclasses.field(default_factory=list)

    def record(self, request: str, position: int, k: int, accepted: int):
        self.row_verifies += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        self.log.append((request, position, k, accepted))

    def as_dict(self) -> dict:
        """The figures `stats()` reports (the step log is left out)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "log"}
        d["acceptance_rate"] = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        d["mean_accepted_length"] = self.emitted_tokens / self.row_verifies if self.row_verifies else 0.0
        d["mean_accepted_drafts"] = self.accepted_tokens / self.row_verifies if self.row_verifies else 0.0
        return d
