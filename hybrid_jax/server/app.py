"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions (SSE streaming; the path in
server/completions.py), /v1/models and /v1/models/{id}, vLLM's /tokenize and /detokenize
(server/tokenize_api.py), /health (readiness), /metrics (Prometheus text), /docs and /openapi.json
(behind the API key); for routers and orchestrators, /server_info and /model_info (the SGLang Model
Gateway's worker discovery, behind the API key), /liveness and /readiness (server/worker_info.py).

/health: 503 while the model loads, its body saying how far ("loading: loading weights (12.0 s so
far)", "loading: compiling 3 of 12 programs before ready (2 from the program store), last decode[4]
... (40.1 s so far)"); then 200, the warm-up's note followed by the background compiles' progress
("compiling in the background: 5 of 40 programs ...") or "start-up complete: N programs"
(server/startup_report.py). Which request fields are honoured or refused: server/fields.py.

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

import hmac
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid_jax.server import chat_template, protocol, worker_info
from hybrid_jax.server.completions import Completions
from hybrid_jax.server.plumbing import ApiError, Http, error_body  # noqa: F401  (ApiError, error_body: re-exported)
from hybrid_jax.server.startup_report import loading_body, ready_body
from hybrid_jax.server.state import ServerConfig, ServerState  # noqa: F401  (re-exported: the server's API)
from hybrid_jax.server.tokenize_api import add_routes, model_card


def _render_chat(tokenizer, data: dict) -> str:
    return chat_template.render_request(tokenizer, data)      # (server/chat_template.py)


def _prompt(eng, data: dict, params, chat: bool) -> tuple[Any, list[int]]:
    """On a worker thread: the request's prompt (its chat template rendered) and its checked token ids."""
    prompt = _render_chat(eng.tokenizer, data) if chat else protocol.completion_prompt(data)
    return prompt, eng.validate(prompt, params)


class _Guard:
    """ASGI middleware in front of every route: the API key (constant-time compare) on /v1/*,
    /tokenize, /detokenize, /docs and /openapi.json (and /metrics with `metrics_api_key`), and a 400
    for a request with more than one Authorization header; the declared body size; 503 while loading
    or draining."""

    PROTECTED = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/tokenize", "/detokenize", "/server_info",
                 "/get_server_info", "/model_info", "/get_model_info")
    ENGINE_POSTS = ("/tokenize", "/detokenize")     # like /v1/* POSTs: body limit, 503 while loading / draining

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
        if resp is None and (path.startswith("/v1/") or path in self.ENGINE_POSTS) and scope["method"] == "POST":
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
    app = FastAPI(title="hybrid-jax", docs_url="/docs", redoc_url=None)
    http = Http(state)
    err = http.err
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
            if state.load_error:
                return PlainTextResponse("loading failed (see the server log)", status_code=503)
            return PlainTextResponse(loading_body(state.startup, time.monotonic() - state.loading_since),
                                     status_code=503)
        down = state.engine.unavailable()
        if down is not None:
            return PlainTextResponse(down, status_code=503)
        return PlainTextResponse(ready_body(state.ready_note, state.engine.startup_status()))

    worker_info.add_routes(app, state, readiness=health)

    @app.get("/metrics")
    async def metrics():
        if state.engine is None:
            return PlainTextResponse("", status_code=503)
        # the engine's series as of its last heartbeat: a scrape never waits on (or costs) the engine
        return Response(state.engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state)]}

    add_routes(app, state, http, _prompt)
    completions_path = Completions(state, http, _prompt)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completions_path.serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completions_path.serve(request, chat=True)

    return app
