"""The API server's side of an engine core in its own process (engine/core_process.py).

`EngineCoreClient` offers what the server reads from an in-process `AsyncEngine` (`validate`,
`generate`, `tokenizer`, `model_card`, `render_metrics`, `count_error`, `shutdown`): admission checks
and tokenization run here, on the server's event loop, before anything is sent; the outputs arrive
on a reader thread and are detokenized incrementally on the event loop as they are handed to each
request's stream. The device loop in the core never waits on any of it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Client
from typing import Any

from hybrid_jax.engine.async_engine import EngineRequestError, OutputStream
from hybrid_jax.engine.detokenize import IncrementalDetokenizer
from hybrid_jax.engine.limits import admit
from hybrid_jax.engine.request import RequestOutput
from hybrid_jax.errors import HybridJaxError
from hybrid_jax.sampling import SamplingParams

log = logging.getLogger("hybrid_jax.server")


class _Stream:
    """One request on this side: where its outputs go, and its text so far."""

    def __init__(self, loop, prompt_ids, params, tokenizer):
        self.loop, self.queue = loop, asyncio.Queue()
        self.prompt_ids, self.params = prompt_ids, params
        self.token_ids: list[int] = []
        # the core detokenizes a request with stop strings (it checks them); this side all the others
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None and not params.stop else None


class EngineCoreClient:
    def __init__(self, address: str, authkey: bytes, info: dict, tokenizer, process=None):
        """address, authkey, info: what `core_process.start_core` returned; tokenizer: the same one the
        core's model has (loaded here); process: the core's process when this server started it (its
        `shutdown` then stops it)."""
        self.info, self._tokenizer, self.process = info, tokenizer, process
        self.connection = (address, authkey, info)      # what another API server needs to connect
        self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._metrics: dict[int, threading.Event] = {}
        self._metric_values: dict[int, bytes] = {}
        self._tokens = itertools.count()
        self.error: str | None = None          # set when the core went away
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="hybrid-jax-core-reader", daemon=True)
        self._reader.start()

    # --- what the API server reads ---------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    def model_card(self) -> dict:
        return {"max_model_len": self.info["max_model_len"], "vocab_size": self.info["vocab_size"]}

    @property
    def alive(self) -> bool:
        """False once the core has gone away (/health then answers 503)."""
        return self.error is None

    def render_metrics(self) -> bytes:
        """The core's /metrics text (blocking: the server calls it on a worker thread)."""
        token, done = next(self._tokens), threading.Event()
        self._metrics[token] = done
        self._send(("metrics", token))
        if not done.wait(timeout=10):
            self._metrics.pop(token, None)
            raise HybridJaxError("the engine core did not answer for its metrics within 10 s")
        return self._metric_values.pop(token)

    def count_error(self, kind: str):
        self._send(("error", kind))

    def validate(self, prompt: Any, params: SamplingParams) -> list[int]:
        """Raises InputError for a prompt or parameters the core would refuse; returns its token ids."""
        return admit(prompt, params, self._tokenizer, self.info["vocab_size"], self.info["max_model_len"])[1]

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival: float | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs, as `AsyncEngine.generate` does."""
        import time  # noqa: PLC0415
        if self.error is not None:
            raise EngineRequestError(f"request {request_id!r}: {self.error}")
        ids = self.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), ids, params, self._tokenizer)
        self._streams[request_id] = stream
        self._send(("add", request_id, ids, params, time.monotonic() if arrival is None else arrival))
        outs = OutputStream(stream.queue)
        try:
            async for item in outs:
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not outs.finished and self.error is None and not self._closed:
                try:
                    self._send(("abort", request_id))
                except HybridJaxError:         # the core is gone: nothing left to abort
                    pass

    def shutdown(self, timeout: float = 30.0):
        """Stops the core (after its current step; it closes the prefix store) when this server
        started it; else just disconnects."""
        if self.process is not None:
            try:
                self._send(("shutdown",))
            except HybridJaxError:
                pass
            self.process.join(timeout=timeout)
            if self.process.is_alive():
                self.process.terminate()
        self.close()

    def close(self):
        """Disconnects from the core (which aborts this client's requests)."""
        self._closed = True
        self.conn.close()

    # --- the channel -------------------------------------------------------------------------------
    def _send(self, msg):
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError) as e:
                raise HybridJaxError(f"the engine core is gone: {e}") from None

    def _read(self):
        try:
            while True:
                msg = self.conn.recv()
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
                elif kind == "metrics":
                    self._metric_values[msg[1]] = msg[2]
                    done = self._metrics.pop(msg[1], None)
                    if done is not None:
                        done.set()
        except (EOFError, OSError, TypeError) as e:     # (TypeError: the connection was closed under recv)
            if self._closed:
                return
            self.error = f"the engine core exited ({type(e).__name__})"
            log.error("%s: every open request fails, and new ones get a 500", self.error)
            for s in list(self._streams.values()):
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineRequestError(self.error))

    @staticmethod
    def _hand_over(items):
        """On the event loop: each output detokenized and put on its stream."""
        for s, (rid, new_ids, finished, reason, new_lps, error, text, new_text, lps) in items:
            s.token_ids += new_ids
            if s.detok is not None:
                old = s.detok.text
                s.detok.add(new_ids)
                if finished:
                    s.detok.finish()
                text = s.detok.text
                new_text = text[len(old):] if text.startswith(old) else text
            s.queue.put_nowait(RequestOutput(rid, new_ids, new_text, list(s.token_ids), text, finished, reason,
                                             s.prompt_ids, new_lps, lps, error))
