"""Prefill/decode disaggregation at the server's door, in the protocol the SGLang Model Gateway speaks in
its prefill/decode mode (`--pd-disaggregation --prefill URL [PORT] --decode URL`): the gateway sends
each request to one prefill server and one decode server at once, both copies carrying the same
`bootstrap_room` (with `bootstrap_host` / `bootstrap_port`, the prefill server's), and answers with
the decode server's response.

- A prefill server (`--disaggregation-mode prefill`) computes the prompt only (max_tokens 1, one
  choice) and hands its cache over under the room (cache/handoff.py: an entry in the shared
  `--kv-cache-dir`, then the room's marker).
- A decode server (`--disaggregation-mode decode`) waits for the room's marker (up to
  `--disaggregation-timeout`) before admitting the request, which then resumes from the handoff if
  every check passes; with no handoff (timed out, refused, damaged, another prompt) it computes the
  prompt itself. Either way its answer is the one a single server gives.

The transfer needs no connection between the two servers, only the shared directory (the address and
port the gateway passes are accepted and not used). A request without a room is served as usual.
"""
from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter

from cache.handoff import KVTransfer, remove_marker, wait_marker
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams

MODES = ("null", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class DisaggregationConfig:
    """mode: SGLang's --disaggregation-mode ("null": off); directory: the shared disk tier handoffs go
    through (the engine's kv_cache_dir); timeout_s: a decode server's longest wait for a room's
    handoff; bootstrap_port: the port the gateway is told for a prefill server (reported, not used)."""
    mode: str = "null"
    directory: str | None = None
    timeout_s: float = 60.0
    bootstrap_port: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise InputError(f"--disaggregation-mode must be one of {MODES}; got {self.mode!r}")
        if self.mode != "null" and not self.directory:
            raise InputError(f"--disaggregation-mode {self.mode} hands caches over through the disk tier: give "
                             f"--enable-prefix-caching and --kv-cache-dir on shared storage (the same directory on "
                             f"the prefill and the decode servers)")
        if not self.timeout_s > 0:
            raise InputError(f"--disaggregation-timeout must be positive; got {self.timeout_s}")

    @property
    def on(self) -> bool:
        return self.mode != "null"


def room_of(data: dict) -> int | None:
    """The request's `bootstrap_room`, or None. One room per request: a list is refused."""
    room = data.get("bootstrap_room")
    if room is None:
        return None
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise InputError(f"bootstrap_room must be a non-negative integer (one request, one room); got {room!r}")
    return room


class Disaggregation:
    """The server's side of one mode: what a prefill server does to a request's parameters, and the
    decode server's wait for the handoff."""

    def __init__(self, config: DisaggregationConfig, registry: CollectorRegistry):
        self.config = config
        self.handoffs = Counter("hybrid_jax_kv_transfer_requests", "Requests of prefill/decode disaggregation, by "
                                "role and outcome (sent; taken; or why the decode server recomputed the prompt)",
                                ["role", "outcome"], registry=registry)

    def prefill(self, params: list[SamplingParams], room: int) -> list[SamplingParams]:
        """A prefill server's copy of the request: the prompt computed, its cache handed to `room`."""
        if len(params) != 1:
            raise InputError(f"a request of prefill/decode disaggregation carries one prompt (one "
                             f"bootstrap_room); got {len(params)}")
        self.handoffs.labels(role="prefill", outcome="sent").inc()
        return [dataclasses.replace(params[0], max_tokens=1, min_tokens=0, kv_transfer=KVTransfer("send", room))]

    async def decode(self, params: list[SamplingParams], room: int) -> list[SamplingParams]:
        """A decode server's copy: once the room's marker is there, the handoff it names to take (or
        none, with the reason counted)."""
        if len(params) != 1:
            raise InputError(f"a request of prefill/decode disaggregation carries one prompt (one "
                             f"bootstrap_room); got {len(params)}")
        m = await wait_marker(self.config.directory, room, self.config.timeout_s)
        remove_marker(self.config.directory, room)
        if m.status != "ok":
            self.handoffs.labels(role="decode", outcome="handoff_timeout" if m.reason == "handoff_timeout"
                                 else "refused_by_prefill").inc()
            return params
        self.handoffs.labels(role="decode", outcome="marker_ok").inc()
        return [dataclasses.replace(params[0], kv_transfer=KVTransfer("receive", room, m.end, m.key))]
