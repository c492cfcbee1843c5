"""The API server's side of an engine core in its own process (engine/core_process.py).

`EngineCoreClient` offers what the server reads from an in-process `AsyncEngine` (`validate`,
`generate`, `tokenizer`, `model_card`, `render_metrics`, `pulse`, `shutdown`): admission checks
and tokenization run here, on the server's event loop, before anything is sent; the outputs arrive
on a reader thread and are detokenized incrementally on the event loop as they are handed to each
request's stream. The device loop in the core never waits on any of it, and nothing here waits on
the core: commands leave through a writer thread (a core that stops reading cannot block the event
loop), and the core's heartbeats (engine/heartbeat.py) land in `pulse`, with the metrics /metrics is
served from.

When the core goes away (its socket closes), every open request fails with `EngineUnavailable` and
so does every new one; a shutdown this client asked for is not a failure and logs none.
server/supervisor.py decides what happens next (a restart, a reconnect, an exit).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Client
from typing import Any

from hybrid_jax.engine.async_engine import CARD_KEYS, EngineRequestError, EngineUnavailable, OutputStream
from hybrid_jax.engine.detokenize import IncrementalDetokenizer
from hybrid_jax.engine.heartbeat import Beat, Pulse
from hybrid_jax.engine.limits import admit
from hybrid_jax.engine.request import EngineOutput
from hybrid_jax.sampling import SamplingParams

log = logging.getLogger("hybrid_jax.server")


class _Stream:
    """One request on this side: where its outputs go, and its text so far."""

    def __init__(self, loop, prompt_ids, params, tokenizer):
        self.loop, self.queue = loop, asyncio.Queue()
        self.prompt_ids, self.params = prompt_ids, params
        self.token_ids: list[int] = []
        # the core detokenizes a request with stop strings (it checks them); this side all the others
        self.detok = IncrementalDetokenizer(tokenizer, params.keep_special_tokens) \
            if tokenizer is not None and not params.stop else None


class EngineCoreClient:
    def __init__(self, address: str, authkey: bytes, info: dict, tokenizer, process=None):
        """address, authkey, info: what `core_process.start_core` returned; tokenizer: the same one the
        core's model has (loaded here); process: the core's process when this server started it (its
        `shutdown` then stops it)."""
        self.info, self._tokenizer, self.process = info, tokenizer, process
        self.connection = (address, authkey, info)      # what another API server needs to connect
        self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        self._streams: dict[str, _Stream] = {}
        self.pulse = Pulse()                   # the core's last heartbeat and its metrics
        self.error: str | None = None          # set when the core went away
        self._closed = False
        self._stopping = False                 # this client asked the core to stop: its exit is no failure
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="hybrid-jax-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="hybrid-jax-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # --- what the API server reads ---------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    def model_card(self) -> dict:
        return {k: self.info[k] for k in CARD_KEYS}

    @property
    def alive(self) -> bool:
        """False once the core has gone away (/health then answers 503)."""
        return self.error is None

    def render_metrics(self) -> bytes:
        """The core's Prometheus text as of its last heartbeat (no round trip: b"" before the first)."""
        return self.pulse.metrics

    def validate(self, prompt: Any, params: SamplingParams) -> list[int]:
        """Raises InputError for a prompt or parameters the core would refuse; returns its token ids."""
        return admit(prompt, params, self._tokenizer, self.info["vocab_size"], self.info["max_model_len"],
                     speculative=self.info.get("speculative", False))[1]

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival: float | None = None) -> AsyncIterator[EngineOutput]:
        """Streams the request's outputs, as `AsyncEngine.generate` does; EngineUnavailable when the
        core is gone (before or while the request runs)."""
        if self.error is not None:
            raise EngineUnavailable(f"request {request_id!r}: {self.error}")
        ids = self.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), ids, params, self._tokenizer)
        self._streams[request_id] = stream
        outs = OutputStream(stream.queue)
        try:
            if self.error is not None:         # lost meanwhile: the reader may have failed the others without it
                raise EngineUnavailable(f"request {request_id!r}: {self.error}")
            self._send(("add", request_id, ids, params, time.monotonic() if arrival is None else arrival))
            async for item in outs:
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not outs.finished and self.error is None and not self._closed:
                try:
                    self._send(("abort", request_id))
                except EngineUnavailable:      # the core is gone: nothing left to abort
                    pass

    def shutdown(self, timeout: float = 30.0):
        """Stops the core (after its current step; it closes the prefix store) when this server
        started it; else just disconnects."""
        if self.process is not None:
            self._stopping = True
            try:
                self._send(("shutdown",))
            except EngineUnavailable:
                pass
            self.process.join(timeout=timeout)
            if self.process.is_alive():
                self.process.terminate()
        self.close()

    def kill(self):
        """SIGKILLs the core when this server started it (a wedged core: see server/supervisor.py)."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def abandon(self, reason: str):
        """Gives up on a core that died or hung: its open requests fail with `reason`, the connection
        closes."""
        self._lost(reason)
        self.close()

    def close(self):
        """Disconnects from the core (which aborts this client's requests)."""
        self._closed = True
        self._outbox.put(None)
        self._writer.join(timeout=5)
        self.conn.close()

    # --- the channel -------------------------------------------------------------------------------
    def _send(self, msg):
        """Queues `msg` for the writer thread; EngineUnavailable once the core is gone."""
        if self.error is not None or self._closed:
            raise EngineUnavailable(f"the engine core is gone: {self.error or 'disconnected'}")
        self._outbox.put(msg)

    def _write(self):
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError) as e:     # the reader sees the end too
                if not (self._closed or self._stopping):
                    self._lost(f"the engine core exited ({type(e).__name__}: {e})")
                return

    def _lost(self, reason: str):
        """Once: every open request fails with EngineUnavailable (set before the streams are read,
        so a request registered after this is refused by `generate` itself)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = reason
        for s in list(self._streams.values()):
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineUnavailable(reason))
            except RuntimeError:           # that request's event loop has closed
                pass

    def _read(self):
        try:
            while True:
                msg = self.conn.recv()
                if type(msg) is Beat:
                    self.pulse.note(msg)
                    continue
                kind = msg[0]
                if kind == "out":
                    by_loop: dict = {}
                    for item in msg[1]:
                        s = self._streams.get(item[0])
                        if s is not None:
                            by_loop.setdefault(s.loop, []).append((s, item))
                    for loop, items in by_loop.items():
                        loop.call_soon_threadsafe(self._hand_over, items)
                elif kind == "failed":
                    s = self._streams.get(msg[1])
                    if s is not None:
                        s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineRequestError(msg[2]))
        except (EOFError, OSError, TypeError) as e:     # (TypeError: the connection was closed under recv)
            if self._closed:
                return
            if self._stopping:                 # the shutdown this client sent: no failure
                log.info("the engine core stopped")
                self._lost("the engine core stopped")
                return
            log.error("the engine core exited (%s): the requests in flight fail", type(e).__name__)
            self._lost(f"the engine core exited ({type(e).__name__})")

    @staticmethod
    def _hand_over(items):
        """On the event loop: each output detokenized and put on its stream."""
        for s, (rid, new_ids, finished, reason, new_lps, error, text, new_text, lps, prompt_lps) in items:
            s.token_ids += new_ids
            if s.detok is not None:
                old = s.detok.text
                s.detok.add(new_ids)
                if finished:
                    s.detok.finish()
                text = s.detok.text
                new_text = text[len(old):] if text.startswith(old) else text
            s.queue.put_nowait(EngineOutput(rid, new_ids, new_text, list(s.token_ids), text, finished, reason,
                                             s.prompt_ids, new_lps, lps, error, prompt_lps))
