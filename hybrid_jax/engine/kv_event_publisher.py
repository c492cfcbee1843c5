"""Publishes the prefix cache's KV events (cache/kv_events.py) to routers over ZeroMQ, as vLLM does.

`--kv-events-config` takes vLLM's JSON (`KVEventsConfig`): {"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}. An endpoint with `*` (or ipc:// / inproc://) is
bound, another is connected to. Data-parallel replica r publishes on the endpoint's port + r and marks
its batches with data_parallel_rank r.

Wire format (vLLM's): each batch is one multipart message [topic, sequence number (8 bytes big-endian,
from 0), payload]; the payload is msgpack of {"ts": seconds since the epoch, "events": [...],
"data_parallel_rank": r}, each event a map tagged by "type": {"type": "BlockStored", "block_hashes",
"parent_block_hash", "token_ids", "block_size", "lora_id": null, "medium": "GPU", "lora_name": null},
{"type": "BlockRemoved", "block_hashes", "medium": "GPU"}, {"type": "AllBlocksCleared"}. The block hashes
are `cache.kv_events.block_hash`: a router recomputes them from a prompt's token ids.

Batches are queued and sent from a thread of their own, so a slow subscriber never holds an engine step;
a PUB socket drops what a subscriber cannot take past its high-water mark (hwm), as ZeroMQ does.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

from hybrid_jax.errors import InputError

log = logging.getLogger("hybrid_jax.engine")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` keys this server reads (an unknown key, or a replay endpoint, is an error)."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"               # "zmq" | "null" (events are collected and dropped)
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000                   # ZeroMQ's high-water mark of the PUB socket, in messages

    @classmethod
    def parse(cls, d: dict | None) -> KVEventsConfig | None:
        """From the JSON object (None: no events); None also when enable_kv_cache_events is false."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise InputError(f"kv_events_config must be a JSON object; got {type(d).__name__}")
        if d.get("replay_endpoint") is not None:
            raise InputError("kv_events_config: replay_endpoint is not supported yet (a subscriber that misses "
                             "batches sees a gap in the sequence numbers)")
        known = {f.name for f in dataclasses.fields(cls)} | {"replay_endpoint", "buffer_steps", "max_queue_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"kv_events_config: unknown keys {unknown}")
        kw = {k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}}
        c = cls(**kw)
        if not isinstance(c.enable_kv_cache_events, bool):
            raise InputError("kv_events_config: enable_kv_cache_events must be true or false")
        if c.publisher not in ("zmq", "null"):
            raise InputError(f"kv_events_config: publisher must be 'zmq' or 'null'; got {c.publisher!r}")
        if not isinstance(c.endpoint, str) or "://" not in c.endpoint:
            raise InputError(f"kv_events_config: endpoint must be a ZeroMQ address (tcp://..., ipc://...); "
                             f"got {c.endpoint!r}")
        if not isinstance(c.hwm, int) or c.hwm <= 0:
            raise InputError(f"kv_events_config: hwm must be a positive integer; got {c.hwm!r}")
        return c if c.enable_kv_cache_events else None

    def endpoint_for(self, rank: int) -> str:
        """Replica `rank`'s endpoint: a tcp port + rank; ipc / inproc names get a `_dp<rank>` suffix."""
        if rank == 0:
            return self.endpoint
        if self.endpoint.startswith("tcp://"):
            base, port = self.endpoint.rsplit(":", 1)
            return f"{base}:{int(port) + rank}"
        return f"{self.endpoint}_dp{rank}"


def encode_event(e) -> dict[str, Any]:
    """One cache.kv_events event as vLLM's map (tagged by "type")."""
    from cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: PLC0415
    if isinstance(e, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
                "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": None, "medium": e.medium,
                "lora_name": None}
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {e!r}")


def encode_batch(events: list, rank: int, ts: float | None = None) -> bytes:
    import msgpack  # noqa: PLC0415
    return msgpack.packb({"ts": time.time() if ts is None else ts, "events": [encode_event(e) for e in events],
                          "data_parallel_rank": rank})


class KVEventPublisher:
    """Sends batches of events on a ZeroMQ PUB socket from its own thread (publisher "zmq"), or drops
    them ("null"). publish(events) never blocks the engine."""

    def __init__(self, config: KVEventsConfig, rank: int = 0):
        self.config, self.rank = config, rank
        self.endpoint = config.endpoint_for(rank)
        self.sent = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        if config.publisher == "zmq":
            import zmq  # noqa: PLC0415
            self._sock = zmq.Context.instance().socket(zmq.PUB)
            self._sock.set_hwm(config.hwm)
            if "*" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
                self._sock.bind(self.endpoint)
            else:
                self._sock.connect(self.endpoint)
            self._thread = threading.Thread(target=self._run, name="hybrid-jax-kv-events", daemon=True)
            self._thread.start()

    def publish(self, events: list):
        if events and self._thread is not None:
            self._queue.put(events)

    def _run(self):
        topic, seq = self.config.topic.encode(), 0
        while True:
            events = self._queue.get()
            if events is None:
                break
            try:
                self._sock.send_multipart((topic, seq.to_bytes(8, "big"), encode_batch(events, self.rank)))
                seq += 1
                self.sent = seq
            except Exception:  # noqa: BLE001  (routers' events are best effort: never the engine's failure)
                log.exception("publishing KV events")

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=2.0)
            self._sock.close(linger=0)
            self._thread = None
