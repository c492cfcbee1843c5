"""The HTTP plumbing every generating route shares: OpenAI's error shape, reading a body under its
limits (413 / 408), the engine's outputs watched for the client leaving and the drain deadline, and
the admission ticket given back however a response ends."""
from __future__ import annotations

import asyncio
import re

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from hybrid_jax.errors import InputError
from hybrid_jax.server.admission import Refusal, Ticket
from hybrid_jax.server.state import ServerState


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


class Shutdown(Exception):
    """The drain deadline passed while the request was still open."""


class Gone(Exception):
    """The client disconnected."""


_PARAM = re.compile(r"'(\w+)'")
_UNRECOGNIZED = re.compile(r"^Unrecognized request argument supplied: (\S+)")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def wait_disconnect(request: Request):
    """Returns when the server reports the client gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def released(gen, ticket: Ticket):
    """The engine's outputs; the request's admission ticket is given back when they end, however."""
    try:
        async for out in gen:
            yield out
    finally:
        ticket.release()
        await gen.aclose()            # closed early (client gone, drain deadline): the engine aborts it


class AdmittedStream(StreamingResponse):
    """A stream that gives its admission ticket back when the response is over, even one whose body
    was never iterated (its client left before it began)."""

    def __init__(self, content, ticket: Ticket, **kwargs):
        super().__init__(content, **kwargs)
        self.ticket = ticket

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


class Http:
    """Error answers (counted in this process: never a call into the engine), bodies and watched
    output streams, for the routes of one app."""

    def __init__(self, state: ServerState):
        self.state = state

    def err(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
            code: str | None = None) -> JSONResponse:
        self.state.metrics.count_error(kind)
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    def input_error(self, e: InputError) -> JSONResponse:
        m = _UNRECOGNIZED.match(str(e)) or _PARAM.match(str(e))
        return self.err(400, str(e), param=m.group(1) if m else None)

    def refuse(self, r: Refusal) -> JSONResponse:
        """A 429 for a request past the admission bounds (server/admission.py)."""
        resp = self.err(429, r.message, "rate_limit_error", code=r.reason)
        resp.headers["Retry-After"] = str(r.retry_after_s)
        return resp

    async def read_body(self, request: Request) -> bytes:
        """The body, counted while it streams in: 413 as soon as it passes the limit, 408 when the
        next piece does not come within body_timeout_s."""
        cfg = self.state.config
        chunks, size = [], 0
        it = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(it.__anext__(), cfg.body_timeout_s)
            except StopAsyncIteration:
                return b"".join(chunks)
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body stopped arriving (nothing for {cfg.body_timeout_s:g} s)",
                               code="request_timeout") from None
            except ClientDisconnect:
                raise Gone() from None
            size += len(chunk)
            if size > cfg.max_request_bytes:
                raise ApiError(413, f"request body exceeds the limit of {cfg.max_request_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)

    async def guarded(self, gen, request: Request | None):
        """The engine's outputs, until the generator ends, the drain deadline passes (Shutdown) or,
        with `request`, the client disconnects (Gone: a task waits for the server's
        `http.disconnect`, whether or not outputs are flowing); both abort the request."""
        deadline = self.state.deadline()
        gone = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
        watch = {deadline} | ({gone} if gone is not None else set())

        async def stop(nxt):
            if nxt.done():
                await gen.aclose()                    # suspended at a yield: closing it aborts the request
            else:
                nxt.cancel()                          # waiting for output: the cancellation aborts it
                await asyncio.gather(nxt, return_exceptions=True)

        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                try:
                    await asyncio.wait({nxt} | watch, return_when=asyncio.FIRST_COMPLETED)
                    if deadline.done() or (gone is not None and gone.done()):
                        await stop(nxt)
                        raise Shutdown() if deadline.done() else Gone()
                finally:
                    if not nxt.done():            # we were cancelled (a stream's client went away)
                        nxt.cancel()
                try:
                    yield nxt.result()
                except StopAsyncIteration:
                    return
        finally:
            if gone is not None:
                gone.cancel()
