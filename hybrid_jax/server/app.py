"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
/health (readiness), /metrics (Prometheus text).

Bad requests (malformed JSON, bad parameters, oversize bodies, too many tokens) get a 4xx with a
message and the server keeps serving. A streaming client that disconnects aborts its request,
which frees its cache slot.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from hybrid_jax.errors import InputError
from hybrid_jax.server import protocol


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str = "hybrid-jax"
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096


class ServerState:
    """What the app serves from; `engine` is None until the model is loaded and warm."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine = None           # AsyncEngine
        self.load_error: str | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _render_chat(tokenizer, messages) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputError("this model has no chat template: use /v1/completions")
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def _logprobs_block(tokenizer, lps: list[dict]) -> dict:
    dec = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    return {"tokens": [dec(x["token_id"]) for x in lps], "token_ids": [x["token_id"] for x in lps],
            "token_logprobs": [x["logprob"] for x in lps],
            "top_logprobs": [{dec(t): v for t, v in x["top"]} for x in lps]}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hybrid-jax", docs_url=None, redoc_url=None)
    cfg = state.config

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1/"):
            if cfg.api_key is not None and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
                return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > cfg.max_request_bytes:
                return _error(413, f"request body of {size} bytes exceeds the limit of {cfg.max_request_bytes}")
            if state.engine is None and path != "/v1/models":
                return _error(503, "the model is still loading", "unavailable")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.engine is None:
            return PlainTextResponse(state.load_error or "loading", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        if state.engine is None:
            return PlainTextResponse("", status_code=503)
        return Response(state.engine.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "hybrid-jax"}
        if state.engine is not None:        # vLLM-style extensions: what a client may send
            eng = state.engine.engine
            card.update(max_model_len=eng.config.max_model_len, vocab_size=eng.llm.config.vocab_size)
        return {"object": "list", "data": [card]}

    async def _body(request: Request) -> dict:
        body = await request.body()
        if len(body) > cfg.max_request_bytes:
            raise InputError(f"request body of {len(body)} bytes exceeds the limit of {cfg.max_request_bytes}")
        return protocol.parse_json(body)

    async def _serve(request: Request, chat: bool):
        try:
            data = await _body(request)
            params = protocol.sampling_params(data, max_tokens_limit=cfg.max_tokens_limit, chat=chat)
            eng = state.engine
            tok = eng.engine.llm.tokenizer
            if chat:
                prompt = _render_chat(tok, protocol.chat_messages(data))
            else:
                prompt = protocol.completion_prompt(data)
            prompt_ids = eng.validate(prompt, params)
            stream = data.get("stream", False)
            if not isinstance(stream, bool):
                raise InputError("'stream' must be true or false")
        except InputError as e:
            return _error(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        gen = eng.generate(rid, prompt, params)

        def usage(n_out):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out}

        if stream:
            async def events():
                first = True
                async for out in gen:
                    if chat:
                        delta = {"content": out.new_text}
                        if first:
                            delta["role"] = "assistant"
                        choice = {"index": 0, "delta": delta, "finish_reason": out.finish_reason}
                    else:
                        choice = {"index": 0, "text": out.new_text, "token_ids": out.new_token_ids,
                                  "finish_reason": out.finish_reason,
                                  "logprobs": _logprobs_block(tok, out.new_logprobs) if params.logprobs is not None
                                  else None}
                    first = False
                    chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                             "model": cfg.model_name, "choices": [choice]}
                    if out.finished:
                        chunk["usage"] = usage(len(out.token_ids))
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        final, lps = None, []
        try:
            async for out in gen:
                final = out
                lps += out.new_logprobs
        except InputError as e:
            return _error(400, str(e))
        except RuntimeError as e:
            return _error(500, str(e), "server_error")
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
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    return app
