"""The SSE body of a streamed completion: one chunk per engine output of any choice (interleaved,
each with its choice index; a chat choice's parser may make an output several chunks, or none while
it holds back text that may begin a marker), then, with `stream_options.include_usage`, a last chunk with
`choices: []` and the usage (every chunk before it carries `"usage": null`, or the usage so far with
`continuous_usage_stats`), then `[DONE]`. A failure ends the stream with an error event and `[DONE]`."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from hybrid_jax.engine.async_engine import EngineRequestError, EngineUnavailable
from hybrid_jax.errors import InputError
from hybrid_jax.server.plumbing import Http, Shutdown, error_body
from hybrid_jax.server.protocol import StreamOptions
from hybrid_jax.server.responses import ChoiceAcc, Format, chat_delta, completion_deltas, usage


@dataclasses.dataclass(frozen=True)
class StreamHead:
    """What every chunk of one response repeats."""
    id: str
    object: str
    created: int
    model: str

    def chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage_now(accs: list[ChoiceAcc], prompt_tokens: int, fmt: Format) -> dict:
    return usage(prompt_tokens, 0 if fmt.drop_generated else sum(len(a.token_ids) for a in accs))


async def events(http: Http, head: StreamHead, outputs, accs: list[ChoiceAcc], fmt: Format, chat: bool,
                 options: StreamOptions, prompt_tokens: int) -> AsyncIterator[str]:
    """`outputs` yields (choice position, EngineOutput); `accs` the choices in that order."""
    first = [True] * len(accs)
    deltas = chat_delta if chat else completion_deltas
    metrics = http.state.metrics
    try:
        async for i, out in http.guarded(outputs, None):
            acc = accs[i]
            acc.add(out)
            for entry in deltas(acc, out, fmt, first[i]):      # (a parser holding text back gives none)
                first[i] = False
                chunk = head.chunk([entry])
                if options.include_usage:
                    chunk["usage"] = _usage_now(accs, prompt_tokens, fmt) if options.continuous_usage_stats else None
                yield sse(chunk)
        if options.include_usage:
            yield sse({**head.chunk([]), "usage": _usage_now(accs, prompt_tokens, fmt)})
    except Shutdown:
        metrics.count_error("server_shutdown")
        yield sse(error_body(f"request {head.id}: the server shut down before it finished", "server_shutdown"))
    except EngineUnavailable as e:
        metrics.count_error("unavailable")
        yield sse(error_body(str(e), "unavailable", code="engine_unavailable"))
    except (EngineRequestError, InputError) as e:
        kind = "server_error" if isinstance(e, EngineRequestError) else "invalid_request_error"
        metrics.count_error(kind)
        yield sse(error_body(str(e), kind))
    except Exception as e:  # noqa: BLE001  (a stream always ends with an error event and [DONE])
        metrics.count_error("server_error")
        yield sse(error_body(f"request {head.id}: internal error: {type(e).__name__}: {e}", "server_error"))
    yield "data: [DONE]\n\n"
