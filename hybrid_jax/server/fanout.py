"""One HTTP request, many engine requests: a completions request's list of prompts times `n` choices
each. Choice `prompt_index * n + i` is an engine request of its own (vLLM v1 fans `n` out in its
front end too, its ParentRequest), all admitted together (one admission ticket) and aborted together
(`merged` closes every one when the response ends early).

Each engine request's id carries its fork group and index (`ForkGroup.request_id`): the choices of one prompt
form a group (`<response id>-p<prompt index>`), so an engine can later prefill the group's prompt
once and fork it, telling siblings by their ids, without a change to `add_request`.

Seeds follow vLLM's parallel sampling: with a `seed`, choice i of a prompt gets seed + i (the same
for every prompt of a list); without one, each choice draws its own."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from hybrid_jax.engine.request import EngineOutput, ForkGroup
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams

@dataclasses.dataclass(frozen=True)
class Choice:
    """One engine request of a response: its choice index, prompt and sampling."""
    index: int
    prompt_index: int
    tag: ForkGroup
    params: SamplingParams


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling parameters: the request's, with seed + i where a seed was sent."""
    if params.seed is None or i == 0:
        return params
    if params.seed + i >= 2**63:
        raise InputError(f"'seed' + {i} (choice {i}'s seed) must stay below 2**63; got seed {params.seed}")
    return dataclasses.replace(params, seed=params.seed + i)


def plan(response_id: str, params: list[SamplingParams], n: int) -> list[Choice]:
    """The engine requests of a response with one SamplingParams per prompt, in choice order."""
    return [Choice(index=p * n + i, prompt_index=p, tag=ForkGroup(f"{response_id}-p{p}", i, n),
                   params=choice_params(sp, i))
            for p, sp in enumerate(params) for i in range(n)]


async def merged(gens: list[AsyncIterator[EngineOutput]]) -> AsyncIterator[tuple[int, EngineOutput]]:
    """(position in `gens`, output) as they come, interleaved; ends when all end. The first error
    of any raises here; closing this generator (or an error) closes every one (the engine aborts them)."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen):
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001  (handed to the reader, which raises it)
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
