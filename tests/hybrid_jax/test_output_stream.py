"""A request's output stream (engine/async_engine.OutputStream): outputs that queued while the reader
was busy come out as one, with every new token, piece of text and logprob in order; an error or an
exception behind them is neither merged nor lost; a finished output ends the stream."""
from __future__ import annotations

import asyncio

import pytest

from hybrid_jax.engine.async_engine import EngineRequestError, OutputStream
from hybrid_jax.engine.request import EngineOutput


def _out(ids, done=False, error=None):
    seen = list(range(ids[-1] + 1)) if ids else []
    return EngineOutput("r", ids, "".join(chr(97 + i) for i in ids), seen, "", done, "length" if done else None,
                         [1, 2], [{"token_id": i} for i in ids], error=error)


async def _read(items, pause_after=None):
    """Puts items on a queue, all at once or one at a time (pause_after: read after each put)."""
    q, got = asyncio.Queue(), []
    stream = OutputStream(q)
    if pause_after:
        for it in items:
            q.put_nowait(it)
            try:
                got.append(await stream.__anext__())
            except StopAsyncIteration:
                break
        return got
    for it in items:
        q.put_nowait(it)
    try:
        async for o in stream:
            got.append(o)
    except EngineRequestError as e:
        got.append(e)
    return got


def test_queued_outputs_come_out_as_one():
    got = asyncio.run(_read([_out([0, 1]), _out([2, 3]), _out([4], done=True), _out([9])]))
    assert len(got) == 1
    o = got[0]
    assert o.new_token_ids == [0, 1, 2, 3, 4] and o.new_text == "abcde" and o.finished
    assert [x["token_id"] for x in o.new_logprobs] == [0, 1, 2, 3, 4] and o.token_ids == [0, 1, 2, 3, 4]


def test_a_reader_that_keeps_up_sees_every_output():
    got = asyncio.run(_read([_out([0, 1]), _out([2, 3]), _out([4], done=True)], pause_after=True))
    assert [o.new_token_ids for o in got] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("bad", [_out([], error="boom"), EngineRequestError("boom")])
def test_an_error_behind_queued_outputs_is_raised_after_them(bad):
    got = asyncio.run(_read([_out([0]), _out([1]), bad]))
    assert got[0].new_token_ids == [0, 1] and not got[0].finished
    assert isinstance(got[1], EngineRequestError) and "boom" in str(got[1]) and len(got) == 2
