"""AsyncEngine: the engine on a background thread, with asyncio streams for each request.

The engine thread owns the LLMEngine (no locks inside it): commands (add, abort) arrive on a
queue, outputs leave through each request's asyncio.Queue on the server's event loop. A stream
that is closed early (client gone) aborts its request, which frees its cache slot.

A request that fails inside a step (the engine could attribute the failure to it) gets an
EngineRequestError on its stream; the others go on. `shutdown` stops the thread and closes the
prefix store (waiting for the disk tier's pending writes).

The thread beats (engine/heartbeat.py) between steps and while idle: `pulse` says when it last did
and holds the metrics it rendered then, which /metrics serves (a scrape never renders on the event
loop or waits on the thread). If the thread ends other than by `shutdown`, every open request and
every new one fails with EngineUnavailable.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from hybrid_jax.engine.contracts import EngineCore
from hybrid_jax.engine.heartbeat import HEARTBEAT_S, BeatSchedule, Pulse
from hybrid_jax.engine.request import EngineOutput
from hybrid_jax.sampling import SamplingParams

log = logging.getLogger("hybrid_jax.engine")


def engine_rows(engine) -> int:
    """Requests an engine (or a data-parallel engine's replicas together) runs at once."""
    return engine.config.max_num_seqs * len(getattr(engine, "replicas", None) or (engine,))


CARD_KEYS = ("max_model_len", "vocab_size", "max_num_seqs", "max_num_batched_tokens", "max_total_tokens",
             "kv_block_size")


def engine_card(engine) -> dict:
    """`EngineClient.model_card` of an engine (or a data-parallel engine): max_model_len, vocab_size,
    max_num_seqs (rows over all replicas), max_num_batched_tokens (one step's), max_total_tokens (the
    tokens the attention pools hold, over all replicas), kv_block_size (the prefix cache's block)."""
    c = engine.config
    block, blocks = engine.cache_config()
    return {"max_model_len": c.max_model_len, "vocab_size": engine.loaded.config.vocab_size,
            "max_num_seqs": engine_rows(engine), "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_total_tokens": block * blocks, "kv_block_size": block}


class EngineRequestError(RuntimeError):
    """This request failed inside the engine (the server answers 500 naming it)."""


class EngineUnavailable(EngineRequestError):
    """The engine is gone or not answering (its process died, its thread stopped, its heartbeat
    stopped): the request did not fail by itself, and the server answers 503."""


class OutputStream:
    """A request's outputs from its asyncio.Queue until the one that finishes it; an exception put on
    the queue, or an output that carries an error, is raised (the request is over either way).
    Outputs that queued up while the reader was busy come as one (their new tokens, text and logprobs
    joined, as vLLM's output streams merge them): a reader that falls behind catches up in one piece
    instead of paying the per-output cost (an SSE event, a JSON encode) once for each step."""

    def __init__(self, q: asyncio.Queue):
        self.q, self.finished = q, False
        self._held = None          # taken from the queue while merging, not mergeable: the next one out

    def __aiter__(self):
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        item, self._held = (self._held, None) if self._held is not None else (await self.q.get(), None)
        while not isinstance(item, BaseException) and item.error is None and not item.finished \
                and not self.q.empty():
            nxt = self.q.get_nowait()
            if isinstance(nxt, BaseException) or nxt.error is not None:
                self._held = nxt
                break
            item = merged(item, nxt)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.error is not None:
            self.finished = True
            raise EngineRequestError(item.error)
        self.finished = item.finished
        return item


def merged(a: EngineOutput, b: EngineOutput) -> EngineOutput:
    """Two consecutive outputs of one request as one: b's state, both steps' new tokens / text / logprobs
    (and the prompt_logprobs the first carried)."""
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text,
                               new_logprobs=a.new_logprobs + b.new_logprobs,
                               prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


class AsyncEngine:
    def __init__(self, engine: EngineCore, mirror=None, heartbeat_s: float = HEARTBEAT_S):
        """mirror: with several processes, process 0's `parallel.hosts.Mirror`: what this loop applies
        to the engine and each step are sent to the other processes, which step with it."""
        self.engine = engine
        self.pulse = Pulse()
        self._beats = BeatSchedule(heartbeat_s)
        self.mirror = mirror
        self._events: list = []     # applied since the last message (mirror only)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hybrid-jax-engine", daemon=True)
        self.error: BaseException | None = None
        self._sent = self._picked = 0   # adds queued (event loop) / taken (engine thread): each written by one thread
        engine.metrics.bind(self._live)

    def _live(self) -> dict:
        figures = self.engine.live_figures()
        figures["waiting"] += max(self._sent - self._picked, 0)
        return figures

    def start(self):
        self._thread.start()

    def shutdown(self, timeout: float = 30.0):
        """Stops the engine thread (after its current step) and closes the prefix store, which
        waits for the disk tier's pending writes."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():          # wedged in a step: closing the store under it is not safe
            log.warning("the engine thread did not stop within %g s; not closing the prefix store", timeout)
            return
        self.engine.close()

    def abandon(self, reason: str):
        """Gives up on an engine thread that died or hung: every open request fails with `reason`."""
        for rid in list(self._streams):
            self._deliver(rid, EngineUnavailable(f"request {rid!r}: {reason}"))

    # --- what the API server reads (the same on an EngineCoreClient) ------------------------------
    @property
    def tokenizer(self):
        return self.engine.loaded.tokenizer

    def model_card(self) -> dict:
        """What a client may send (max_model_len, vocab_size) and how many requests run at once
        (max_num_seqs: the engine's rows, over all its data-parallel replicas); for routers
        (server/worker_info.py), a step's token budget and the cache's tokens."""
        return engine_card(self.engine)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it stops only at shutdown)."""
        return self._thread.is_alive() or not self._thread.ident

    def render_metrics(self) -> bytes:
        """The metrics as of the thread's last beat (rendered here only before the first)."""
        return self.pulse.metrics or self.engine.metrics.render()

    # --- called from the event loop ----------------------------------------------------------------
    def validate(self, prompt: Any, params: SamplingParams) -> list[int]:
        """Raises InputError for a prompt or parameters the engine would refuse (before streaming)."""
        return self.engine.check(prompt, params)[1]

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival: float | None = None) -> AsyncIterator[EngineOutput]:
        """Streams the request's outputs. `arrival` (time.monotonic()) is when the client sent it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if not self.alive:
            raise EngineUnavailable(f"request {request_id!r}: the engine thread stopped")
        self._streams[request_id] = (loop, q)
        self._sent += 1
        self._commands.put(("add", request_id, prompt, params, arrival))
        outs = OutputStream(q)
        try:
            if not self.alive:               # ended meanwhile: its last act may have missed this stream
                raise EngineUnavailable(f"request {request_id!r}: the engine thread stopped")
            async for item in outs:
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not outs.finished:           # the caller stopped early: the request is aborted
                self._commands.put(("abort", request_id))

    # --- the engine thread -------------------------------------------------------------------------
    def _deliver(self, request_id: str, item):
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain(self, block: bool):
        try:
            cmd = self._commands.get(timeout=self._beats.period_s / 2 if block else 0)   # (idle: still beating)
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                _, rid, prompt, params, arrival = cmd
                self._picked += 1
                if self.mirror is not None:
                    self._events.append(self.mirror.add_event(rid, prompt, params, arrival))
                try:
                    self.engine.add_request(rid, prompt, params, arrival=arrival)
                except Exception as e:  # noqa: BLE001  (reported to the request's stream)
                    self._deliver(rid, e)
            elif cmd[0] == "abort":
                if self.mirror is not None:
                    self._events.append(["abort", cmd[1]])
                self.engine.abort_request(cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self):
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001  (logged; the streams are told below)
            self.error = e
            log.exception("the engine thread stopped")
        finally:
            if not self._stop.is_set():          # not a shutdown: whoever still waits is told
                for rid in list(self._streams):
                    self._deliver(rid, EngineUnavailable(f"request {rid!r}: the engine thread stopped"))
            if self.mirror is not None:          # the other processes stop with this one
                self.mirror.exchange({"events": [], "step": False, "stop": True})

    def _beat(self, busy: bool):
        """From this thread only (a wedged step stops the beats): the pulse, with the metrics."""
        if self._beats.due(busy):
            self.pulse.note(self._beats.beat(self.engine.metrics.render(), self.engine.startup_status()))

    def _run(self):
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self.mirror is not None:          # every iteration, idle ones too: the others wait on it
                self.mirror.exchange({"events": self._events, "step": self.engine.has_unfinished(), "stop": False})
                self._events = []
            if not self.engine.has_unfinished():
                self._beat(busy=False)
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001  (step() isolates failures itself: this is a last resort)
                self.error = e
                log.exception("engine step raised; failing every request it held and going on")
                for rid in self.engine.abort_all():
                    self._deliver(rid, EngineRequestError(f"request {rid!r}: engine step failed: {e}"))
                continue
            self._beat(busy=self.engine.has_unfinished())    # a step that ends the work: its counts first
            for o in outs:
                self._deliver(o.request_id, o)
            self.engine.flush_publishes()     # after the tokens went out: publishing never delays one

