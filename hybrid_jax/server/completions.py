"""The request -> engine -> response path of /v1/completions and /v1/chat/completions.

A request is read and parsed (its fields checked against server/fields.py), its prompts rendered,
tokenized and checked on a worker thread (`prepare`), admitted as one (one admission ticket for all
its engine requests: all or none), fanned out into one engine request per choice
(server/fanout.py), and answered as one body or one SSE stream (server/streaming.py) whose choices
come from server/responses.py. Without `max_tokens`, a choice may use the rest of the context
(max_model_len - its prompt's tokens, at most the server's max_tokens_limit), as OpenAI and vLLM do."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from hybrid_jax.engine.async_engine import EngineRequestError, EngineUnavailable
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.server import fanout, protocol
from hybrid_jax.server.disaggregation import room_of
from hybrid_jax.server.admission import Refused, client_key
from hybrid_jax.server.chat_output import ChatOutput, chat_output, read_with
from hybrid_jax.server.plumbing import AdmittedStream, ApiError, Gone, Http, Shutdown, released
from hybrid_jax.server.protocol import RequestOptions
from hybrid_jax.server.responses import ChoiceAcc, Format, Prompt, chat_choice, completion_choice, usage
from hybrid_jax.server.state import ServerState
from hybrid_jax.server.streaming import StreamHead, events
from hybrid_jax.server.workers import OFFLOAD_BODY_BYTES


class PromptFn(Protocol):
    """A chat request's prompt (its template rendered) and checked token ids, on a worker thread."""
    def __call__(self, eng: Any, data: dict, params: SamplingParams, chat: bool) -> tuple[Any, list[int]]: ...


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request's prompts, tokenized and checked, and each prompt's sampling parameters."""
    prompts: list[Prompt]                 # as a response shows them (echo); chat: the rendered prompt
    params: list[SamplingParams]          # per prompt (choice seeds: fanout.plan)
    reading: ChatOutput | None = None     # chat: how the output is parsed (tool calls, reasoning)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    def engine_prompt(self, i: int) -> dict:
        return {"prompt_token_ids": self.prompts[i].ids}


def _first_max_tokens(data: dict, opts: RequestOptions) -> int:
    """max_tokens to tokenize and check the prompt with, before the rest of the context is known."""
    if opts.max_tokens:
        return opts.max_tokens
    mt = data.get("min_tokens")
    return max(1, mt) if isinstance(mt, int) and not isinstance(mt, bool) else 1


def _final_max_tokens(opts: RequestOptions, n_prompt: int, max_model_len: int, limit: int) -> int:
    if opts.max_tokens is None:
        room = max_model_len - n_prompt
        if room <= 0:
            raise InputError(f"prompt ({n_prompt} tokens) leaves no room to generate within max_model_len "
                             f"{max_model_len}")
        return min(room, limit)
    return max(opts.max_tokens, 1)        # echo with max_tokens 0: generate 1, drop it (vLLM's way)


def prepare(eng, data: dict, opts: RequestOptions, prompt_fn: PromptFn, limit: int,
            reading: ChatOutput | None = None) -> Prepared:
    """On a worker thread: every prompt rendered, tokenized (once) and checked with its final params
    (with `reading`, the markers its parser reads kept in the output text)."""
    first = protocol.sampling_params(data, opts, _first_max_tokens(data, opts))
    tok = eng.tokenizer
    if opts.chat:
        text, ids = prompt_fn(eng, data, first, True)
        raw = [(text if isinstance(text, str) else None, ids)]
    else:
        raw = []
        for p in protocol.completion_prompts(data):
            if isinstance(p, str) and not opts.add_special_tokens and tok is not None:
                p = {"prompt_token_ids": tok.encode(p, add_bos=False), "prompt": p}
            raw.append((p if isinstance(p, str) else p.get("prompt"), eng.validate(p, first)))
    max_model_len = eng.model_card()["max_model_len"]
    prompts, params = [], []
    for text, ids in raw:
        sp = read_with(protocol.sampling_params(data, opts, _final_max_tokens(opts, len(ids), max_model_len, limit)),
                       reading, text)
        ids = eng.validate({"prompt_token_ids": ids, "prompt": text}, sp)    # ids given: not tokenized again
        if text is None:                  # (shown only by echo)
            text = tok.decode(ids) if tok is not None and opts.echo else ""
        prompts.append(Prompt(text, ids))
        params.append(sp)
    if len(prompts) * opts.n > protocol.MAX_SEQUENCES:
        raise InputError(f"{len(prompts)} prompt(s) x 'n' = {opts.n} is {len(prompts) * opts.n} sequences; this "
                         f"server takes at most {protocol.MAX_SEQUENCES} in one request")
    return Prepared(prompts, params, reading)


class Completions:
    """Serves both generating endpoints of one app."""

    def __init__(self, state: ServerState, http: Http, prompt_fn: PromptFn):
        self.state, self.http, self.prompt_fn = state, http, prompt_fn

    async def _parse(self, request: Request, chat: bool):
        """The body read, parsed and prepared: (options, prepared prompts, data)."""
        cfg, state = self.state.config, self.state
        body = await self.http.read_body(request)
        # large bodies, chat templates and tokenization on the worker threads: never on the event loop
        data = await state.workers.run(protocol.parse_json, body) if len(body) >= OFFLOAD_BODY_BYTES \
            else protocol.parse_json(body)
        model = data.get("model")
        if model is not None and model != cfg.model_name:
            raise ApiError(404, f"the model {str(model)[:200]!r} does not exist; this server serves "
                           f"{cfg.model_name!r}", "not_found_error", param="model", code="model_not_found")
        opts = protocol.request_options(data, chat=chat, max_tokens_limit=cfg.max_tokens_limit)
        reading = chat_output(state.family, data) if chat else None
        prep = await state.workers.run(prepare, state.engine, data, opts, self.prompt_fn, cfg.max_tokens_limit,
                                       reading)
        room = room_of(data)
        if room is not None and state.disagg is not None:     # a copy of a P/D gateway's request
            if state.disagg.config.mode == "prefill":
                opts = dataclasses.replace(opts, n=1)
                prep = dataclasses.replace(prep, params=state.disagg.prefill(prep.params, room))
            else:
                prep = dataclasses.replace(prep, params=await state.disagg.decode(prep.params, room))
        return opts, prep

    async def serve(self, request: Request, chat: bool):
        arrival = time.monotonic()
        http, state = self.http, self.state
        admission = state.admission
        if not admission.bound:                    # the engine's size, once it is up
            card = state.engine.model_card()
            admission.bind(card["max_num_seqs"], card["max_model_len"])
        full = admission.full()                    # a flood is refused before its bodies are parsed
        if full is not None:
            return http.refuse(full)
        try:
            opts, prep = await self._parse(request, chat)
        except InputError as e:
            return http.input_error(e)
        except ApiError as e:
            return http.err(e.status, e.message, e.kind, e.param, e.code)
        except Gone:
            return Response(status_code=400)
        eng = state.engine
        down = eng.unavailable()
        if down is not None:
            return http.err(503, down, "unavailable", code="engine_unavailable")
        client = client_key(opts.user, request.client.host if request.client else None)
        try:                          # decided before any response starts: a stream refused is a 429 too
            ticket = admission.admit(client, prep.prompt_tokens * opts.n)
        except Refused as e:
            return http.refuse(e.refusal)
        prefix = "chatcmpl-" if chat else "cmpl-"
        internal = prefix + uuid.uuid4().hex
        rid = prefix + opts.request_id if opts.request_id else internal
        choices = fanout.plan(internal, prep.params, opts.n)
        # the ids validation made: the engine does not tokenize the prompts a second time
        gens = [eng.generate(c.tag.request_id, prep.engine_prompt(c.prompt_index), c.params, arrival=arrival)
                for c in choices]
        outputs = released(fanout.merged(gens), ticket)
        fmt = Format(eng.tokenizer, opts.logprobs, opts.tokens_as_ids, opts.echo, opts.echo and opts.max_tokens == 0,
                     opts.prompt_logprobs)
        accs = [ChoiceAcc(c.index, prep.prompts[c.prompt_index], reading=prep.reading) for c in choices]
        head = StreamHead(rid, ("chat.completion" if chat else "text_completion"), int(time.time()),
                          state.config.model_name)
        if opts.stream:
            head = dataclasses.replace(head, object=head.object + (".chunk" if chat else ""))
            return AdmittedStream(events(http, head, outputs, accs, fmt, chat, opts.stream_options,
                                         prep.prompt_tokens), ticket, media_type="text/event-stream")
        return await self._answer(request, head, outputs, accs, fmt, chat, prep.prompt_tokens)

    async def _answer(self, request: Request, head: StreamHead, outputs, accs: list[ChoiceAcc], fmt: Format,
                      chat: bool, prompt_tokens: int):
        """The whole body, once every choice has finished."""
        http = self.http
        try:
            async for i, out in http.guarded(outputs, request):
                accs[i].add(out)
        except InputError as e:
            return http.input_error(e)
        except EngineUnavailable as e:
            return http.err(503, str(e), "unavailable", code="engine_unavailable")
        except EngineRequestError as e:
            return http.err(500, str(e), "server_error")
        except Shutdown:
            return http.err(503, f"request {head.id}: the server shut down before it finished", "server_shutdown")
        except Gone:
            return Response(status_code=499)      # nobody reads it: the request was aborted
        build = chat_choice if chat else completion_choice
        n_out = 0 if fmt.drop_generated else sum(len(a.token_ids) for a in accs)
        return {**head.chunk([build(a, fmt) for a in accs]), "usage": usage(prompt_tokens, n_out)}
