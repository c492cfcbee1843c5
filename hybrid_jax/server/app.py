"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
/health (readiness), /metrics (Prometheus text), /docs and /openapi.json (behind the API key).

Every error is a 4xx / 5xx in OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
malformed bodies (see protocol.py), unknown routes (404) and methods (405), an unknown `model`
(404), bodies over the limit (413, counted while they stream in, before any parsing), bodies that
stop arriving (408), request headers over the limit (431, lifecycle.py) or with two Authorization
headers (400). A request the engine fails (it can attribute the failure to it) gets a 500
naming it, or an error event on its stream; the other requests go on.

Under load, a request past the bounds on waiting requests and prompt tokens gets a 429 with
Retry-After, decided before any response starts (server/admission.py); bodies, chat templates and
tokenization are worked on a pool of threads (server/workers.py), never on the event loop.

A client that disconnects aborts its request, streaming or not, which frees its cache slot. While
the server drains (SIGTERM, see lifecycle.py) new requests get 503; at the drain deadline, streams
still open get an error event and requests still waiting a 503.

While the engine is down or not responding (server/supervisor.py), new requests get a JSON 503 and
/health a 503 saying why; requests in flight when it dies end with an error event and `[DONE]` (a
stream) or a JSON 503. No answer depends on the engine: errors are counted in this process
(server/api_metrics.py) and /metrics is served from the engine's last heartbeat.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybrid_jax.engine.async_engine import EngineRequestError, EngineUnavailable
from hybrid_jax.errors import InputError
from hybrid_jax.server import chat_template, protocol
from hybrid_jax.server.admission import Admission, AdmissionConfig, Refusal, Refused, Ticket, client_key
from hybrid_jax.server.api_metrics import ApiMetrics
from hybrid_jax.server.workers import OFFLOAD_BODY_BYTES, Workers


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str = "hybrid-jax"
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    body_timeout_s: float = 30.0        # longest wait for the next piece of a request body (408 after)
    metrics_api_key: bool = False       # /metrics behind the API key too
    admission: AdmissionConfig = AdmissionConfig()   # bounds on waiting requests and tokens (server/admission.py)
    admission_workers: int | None = None  # threads that parse, template and tokenize (server/workers.py)


class ServerState:
    """What the app serves from; `engine` is None until the model is loaded and warm."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine = None           # server/supervisor.EngineSupervisor (over the engine thread or core process)
        self.metrics = ApiMetrics()  # what this process counts itself (errors, restarts)
        self.admission = Admission(config.admission, self.metrics.registry)   # 429 past the waiting bounds
        self.workers = Workers(config.admission_workers)     # parsing, templates, tokenization: off the loop
        self.load_error: str | None = None
        self.fatal_error: str | None = None    # the engine died and cannot come back: the server exits 1
        self.ready_note = "ok"       # /health's body once ready: what the warm-up compiled
        self.draining = False
        self._deadline: asyncio.Future | None = None

    def deadline(self) -> asyncio.Future:
        """Resolves when a drain's deadline passes (never, unless the server is draining)."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().create_future()
        return self._deadline

    def begin_drain(self, timeout_s: float):
        """On the event loop: refuse new requests; at `timeout_s`, end the ones still open."""
        self.draining = True
        fut = self.deadline()
        asyncio.get_running_loop().call_later(timeout_s, lambda: fut.done() or fut.set_result(None))


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


class _Shutdown(Exception):
    """The drain deadline passed while the request was still open."""


class _Gone(Exception):
    """The client disconnected."""


_PARAM = re.compile(r"'(\w+)'")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _wait_disconnect(request: Request):
    """Returns when the server reports the client gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _render_chat(tokenizer, data: dict) -> str:
    return chat_template.render_request(tokenizer, data)      # (server/chat_template.py)


def _prompt(eng, data: dict, params, chat: bool) -> tuple[Any, list[int]]:
    """On a worker thread: the request's prompt (its chat template rendered) and its checked token ids."""
    prompt = _render_chat(eng.tokenizer, data) if chat else protocol.completion_prompt(data)
    return prompt, eng.validate(prompt, params)


async def _released(gen, ticket: Ticket):
    """The engine's outputs; the request's admission ticket is given back when they end, however."""
    try:
        async for out in gen:
            yield out
    finally:
        ticket.release()
        await gen.aclose()            # closed early (client gone, drain deadline): the engine aborts it


class _AdmittedStream(StreamingResponse):
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


def _logprobs_block(tokenizer, lps: list[dict]) -> dict:
    dec = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    return {"tokens": [dec(x["token_id"]) for x in lps], "token_ids": [x["token_id"] for x in lps],
            "token_logprobs": [x["logprob"] for x in lps],
            "top_logprobs": [{dec(t): v for t, v in x["top"]} for x in lps]}


class _Guard:
    """ASGI middleware in front of every route: the API key (constant-time compare) on /v1/*,
    /docs and /openapi.json (and /metrics with `metrics_api_key`), and a 400 for a request with more
    than one Authorization header; the declared body size; 503 while loading or draining."""

    PROTECTED = ("/openapi.json", "/docs", "/docs/oauth2-redirect")

    def __init__(self, app, state: ServerState, err):
        self.app, self.state, self.err = app, state, err
        self.protected = self.PROTECTED + (("/metrics",) if state.config.metrics_api_key else ())
        key = state.config.api_key
        self.expected = None if key is None else b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, cfg = scope["path"], self.state.config
        headers = dict(scope["headers"])
        resp = None
        n_auth = sum(1 for name, _ in scope["headers"] if name == b"authorization")
        if n_auth > 1:                # which one counts would be a guess (a dict keeps the last)
            resp = self.err(400, f"the request has {n_auth} Authorization headers; send one",
                            code="duplicate_authorization_header")
        elif self.expected is not None and (path.startswith("/v1/") or path in self.protected):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                resp = self.err(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        if resp is None and path.startswith("/v1/") and scope["method"] == "POST":
            size = headers.get(b"content-length", b"").decode("latin-1")
            if size.isdigit() and int(size) > cfg.max_request_bytes:
                resp = self.err(413, f"request body of {size} bytes exceeds the limit of {cfg.max_request_bytes}",
                                code="request_too_large")
            elif self.state.draining:
                resp = self.err(503, "the server is shutting down", "unavailable")
            elif self.state.engine is None:
                resp = self.err(503, "the model is still loading", "unavailable")
        if resp is not None:
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    cfg = state.config
    app = FastAPI(title="hybrid-jax", docs_url="/docs", redoc_url=None)

    def err(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
            code: str | None = None) -> JSONResponse:
        state.metrics.count_error(kind)          # in this process: never a call into the engine
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    def input_error(e: InputError) -> JSONResponse:
        m = _PARAM.match(str(e))
        return err(400, str(e), param=m.group(1) if m else None)

    app.add_middleware(_Guard, state=state, err=err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = {404: f"no route {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return err(exc.status_code, msg, kind)

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception):
        return err(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        if state.draining:
            return PlainTextResponse("shutting down", status_code=503)
        if state.engine is None:
            return PlainTextResponse("loading failed (see the server log)" if state.load_error else "loading",
                                     status_code=503)
        down = state.engine.unavailable()
        if down is not None:
            return PlainTextResponse(down, status_code=503)
        return PlainTextResponse(state.ready_note)

    @app.get("/metrics")
    async def metrics():
        if state.engine is None:
            return PlainTextResponse("", status_code=503)
        # the engine's series as of its last heartbeat: a scrape never waits on (or costs) the engine
        return Response(state.engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "hybrid-jax"}
        if state.engine is not None:        # vLLM-style extensions: what a client may send
            card.update(state.engine.model_card())
        return {"object": "list", "data": [card]}

    async def read_body(request: Request) -> bytes:
        """The body, counted while it streams in: 413 as soon as it passes the limit, 408 when the
        next piece does not come within body_timeout_s."""
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
                raise _Gone() from None
            size += len(chunk)
            if size > cfg.max_request_bytes:
                raise ApiError(413, f"request body exceeds the limit of {cfg.max_request_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)

    async def guarded(gen, request: Request | None):
        """The engine's outputs, until the generator ends, the drain deadline passes (_Shutdown) or,
        with `request`, the client disconnects (_Gone: a task waits for the server's
        `http.disconnect`, whether or not outputs are flowing); both abort the request."""
        deadline = state.deadline()
        gone = asyncio.ensure_future(_wait_disconnect(request)) if request is not None else None
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
                        raise _Shutdown() if deadline.done() else _Gone()
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

    def refuse(r: Refusal) -> JSONResponse:
        """A 429 for a request past the admission bounds (server/admission.py)."""
        resp = err(429, r.message, "rate_limit_error", code=r.reason)
        resp.headers["Retry-After"] = str(r.retry_after_s)
        return resp

    async def serve(request: Request, chat: bool):
        arrival = time.monotonic()
        admission = state.admission
        if not admission.bound:                    # the engine's size, once it is up
            card = state.engine.model_card()
            admission.bind(card["max_num_seqs"], card["max_model_len"])
        full = admission.full()                    # a flood is refused before its bodies are parsed
        if full is not None:
            return refuse(full)
        try:
            body = await read_body(request)
            # large bodies, chat templates and tokenization on the worker threads: never on the event loop
            data = await state.workers.run(protocol.parse_json, body) if len(body) >= OFFLOAD_BODY_BYTES \
                else protocol.parse_json(body)
            model = data.get("model")
            if model is not None and model != cfg.model_name:
                raise ApiError(404, f"the model {str(model)[:200]!r} does not exist; this server serves "
                               f"{cfg.model_name!r}", "not_found_error", param="model", code="model_not_found")
            params = protocol.sampling_params(data, max_tokens_limit=cfg.max_tokens_limit, chat=chat)
            eng = state.engine
            tok = eng.tokenizer
            client = client_key(data.get("user"), request.client.host if request.client else None)
            prompt, prompt_ids = await state.workers.run(_prompt, eng, data, params, chat)
            stream = data.get("stream", False)
            if not isinstance(stream, bool):
                raise InputError("'stream' must be true or false")
        except InputError as e:
            return input_error(e)
        except ApiError as e:
            return err(e.status, e.message, e.kind, e.param, e.code)
        except _Gone:
            return Response(status_code=400)
        down = eng.unavailable()
        if down is not None:
            return err(503, down, "unavailable", code="engine_unavailable")
        try:                          # decided before any response starts: a stream refused is a 429 too
            ticket = admission.admit(client, len(prompt_ids))
        except Refused as e:
            return refuse(e.refusal)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        # the ids validation made: the engine does not tokenize the prompt a second time
        gen = _released(eng.generate(rid, {"prompt_token_ids": prompt_ids,
                                           "prompt": prompt if isinstance(prompt, str) else None},
                                     params, arrival=arrival), ticket)

        def usage(n_out):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out}

        if stream:
            async def events():
                first = True
                try:
                    async for out in guarded(gen, None):
                        if chat:
                            delta = {"content": out.new_text}
                            if first:
                                delta["role"] = "assistant"
                            choice = {"index": 0, "delta": delta, "finish_reason": out.finish_reason}
                        else:
                            choice = {"index": 0, "text": out.new_text, "token_ids": out.new_token_ids,
                                      "finish_reason": out.finish_reason,
                                      "logprobs": _logprobs_block(tok, out.new_logprobs)
                                      if params.logprobs is not None else None}
                        first = False
                        chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                 "model": cfg.model_name, "choices": [choice]}
                        if out.finished:
                            chunk["usage"] = usage(len(out.token_ids))
                        yield f"data: {json.dumps(chunk)}\n\n"
                except _Shutdown:
                    state.metrics.count_error("server_shutdown")
                    yield "data: " + json.dumps(error_body(f"request {rid}: the server shut down before it "
                                                           "finished", "server_shutdown")) + "\n\n"
                except EngineUnavailable as e:
                    state.metrics.count_error("unavailable")
                    yield "data: " + json.dumps(error_body(str(e), "unavailable", code="engine_unavailable")) + "\n\n"
                except (EngineRequestError, InputError) as e:
                    kind = "server_error" if isinstance(e, EngineRequestError) else "invalid_request_error"
                    state.metrics.count_error(kind)
                    yield "data: " + json.dumps(error_body(str(e), kind)) + "\n\n"
                except Exception as e:  # noqa: BLE001  (a stream always ends with an error event and [DONE])
                    state.metrics.count_error("server_error")
                    yield "data: " + json.dumps(error_body(f"request {rid}: internal error: {type(e).__name__}: {e}",
                                                           "server_error")) + "\n\n"
                yield "data: [DONE]\n\n"
            return _AdmittedStream(events(), ticket, media_type="text/event-stream")

        final, lps = None, []
        try:
            async for out in guarded(gen, request):
                final = out
                lps += out.new_logprobs
        except InputError as e:
            return input_error(e)
        except EngineUnavailable as e:
            return err(503, str(e), "unavailable", code="engine_unavailable")
        except EngineRequestError as e:
            return err(500, str(e), "server_error")
        except _Shutdown:
            return err(503, f"request {rid}: the server shut down before it finished", "server_shutdown")
        except _Gone:
            return Response(status_code=499)      # nobody reads it: the request was aborted
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": final.text, "token_ids": final.token_ids,
                      "finish_reason": final.finish_reason,
                      "logprobs": _logprobs_block(tok, lps) if params.logprobs is not None else None}
        return {"id": rid, "object": obj, "created": created, "model": cfg.model_name, "choices": [choice],
                "usage": usage(len(final.token_ids))}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app
