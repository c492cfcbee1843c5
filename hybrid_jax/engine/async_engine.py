"""AsyncEngine: the engine on a background thread, with asyncio streams for each request.

The engine thread owns the LLMEngine (no locks inside it): commands (add, abort) arrive on a
queue, outputs leave through each request's asyncio.Queue on the server's event loop. A stream
that is closed early (client gone) aborts its request, which frees its cache slot.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from hybrid_jax.engine.engine import LLMEngine
from hybrid_jax.engine.request import RequestOutput
from hybrid_jax.sampling import SamplingParams


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hybrid-jax-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self):
        self._thread.start()

    def shutdown(self):
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)

    # --- called from the event loop ----------------------------------------------------------------
    def validate(self, prompt: Any, params: SamplingParams) -> list[int]:
        """Raises InputError for a prompt or parameters the engine would refuse (before streaming)."""
        params.validate()
        _, ids = self.engine.llm._encode(prompt)
        limit = self.engine.config.max_model_len
        if len(ids) + params.max_tokens > limit:
            from hybrid_jax.errors import InputError  # noqa: PLC0415
            raise InputError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len {limit}")
        return ids

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._commands.put(("add", request_id, prompt, params))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    # --- the engine thread -------------------------------------------------------------------------
    def _deliver(self, request_id: str, item):
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain(self, block: bool):
        try:
            cmd = self._commands.get(timeout=0.5 if block else 0)
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                _, rid, prompt, params = cmd
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:  # noqa: BLE001  (reported to the request's stream)
                    self._deliver(rid, e)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self):
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001  (a failed step fails its requests, not the server)
                self.error = e
                for rid in list(self.engine.requests):
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                    self.engine.abort_request(rid)
                continue
            for o in outs:
                self._deliver(o.request_id, o)
            self.engine.flush_publishes()     # after the tokens went out: publishing never delays one
