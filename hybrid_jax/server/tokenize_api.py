"""The small endpoints: `GET /v1/models/{id}` (the model card; OpenAI's 404 for another id) and
vLLM's `POST /tokenize` (a prompt, or chat messages rendered by the same path as
/v1/chat/completions: tokens, count, max_model_len, token_strs with return_token_strs) and
`POST /detokenize` (tokens -> prompt). Behind the API key like /v1/*; their fields are checked
against server/fields.py like every other request's."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.server import protocol
from hybrid_jax.server.completions import PromptFn
from hybrid_jax.server.fields import Endpoint, check_fields, field
from hybrid_jax.server.plumbing import ApiError, Gone, Http
from hybrid_jax.server.state import ServerState


def model_card(state: ServerState) -> dict:
    card = {"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "hybrid-jax"}
    if state.engine is not None:        # vLLM-style extensions: what a client may send
        card.update(state.engine.model_card())
    return card


def _tokenizer(eng):
    if eng.tokenizer is None:
        raise InputError("this model has no tokenizer (no tokenizer.json): send and read token ids")
    return eng.tokenizer


def tokenize(eng, data: dict, prompt_fn: PromptFn) -> dict:
    """On a worker thread: vLLM's TokenizeResponse for a prompt or chat messages."""
    check_fields(data, Endpoint.TOKENIZE)
    tok = _tokenizer(eng)
    strs = protocol.typed(data, "return_token_strs", (bool,), False)
    if ("prompt" in data) == ("messages" in data):
        raise InputError("send either 'prompt' (a string) or 'messages'")
    if "messages" in data:
        special = data.get("add_special_tokens")
        if field(Endpoint.CHAT, "add_special_tokens").refuses(special):
            raise InputError("'add_special_tokens' is not supported yet with 'messages': the chat template decides "
                             "the special tokens")
        chat = {k: v for k, v in data.items() if k not in ("return_token_strs", "add_special_tokens")}
        _, ids = prompt_fn(eng, chat, SamplingParams(max_tokens=1), True)
    else:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise InputError(f"'prompt' must be a string; got {type(prompt).__name__}")
        ids = tok.encode(prompt, add_bos=protocol.typed(data, "add_special_tokens", (bool,), True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": eng.model_card()["max_model_len"], "tokens": ids}
    if strs:
        out["token_strs"] = [tok.decode([t]) for t in ids]
    return out


def detokenize(eng, data: dict) -> dict:
    check_fields(data, Endpoint.DETOKENIZE)
    tok = _tokenizer(eng)
    ids = data.get("tokens")
    vocab = eng.model_card()["vocab_size"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError("'tokens' must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InputError(f"'tokens' outside the vocabulary [0, {vocab}): {bad[:5]}")
    return {"prompt": tok.decode(ids)}


def add_routes(app: FastAPI, state: ServerState, http: Http, prompt_fn: PromptFn):
    async def body_of(request: Request) -> dict:
        data = await state.workers.run(protocol.parse_json, await http.read_body(request))
        model = data.get("model")
        if model is not None and model != state.config.model_name:
            raise ApiError(404, f"the model {str(model)[:200]!r} does not exist; this server serves "
                           f"{state.config.model_name!r}", "not_found_error", param="model", code="model_not_found")
        return data

    async def answer(request: Request, work, *args):
        try:
            return await state.workers.run(work, state.engine, await body_of(request), *args)
        except InputError as e:
            return http.input_error(e)
        except ApiError as e:
            return http.err(e.status, e.message, e.kind, e.param, e.code)
        except Gone:
            return http.err(400, "the client left before its body arrived")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.config.model_name:
            return http.err(404, f"The model '{model_id[:200]}' does not exist", "not_found_error", param="model",
                            code="model_not_found")
        return model_card(state)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await answer(request, tokenize, prompt_fn)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await answer(request, detokenize)
