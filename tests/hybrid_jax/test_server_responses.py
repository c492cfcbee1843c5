"""Response bodies built from made-up engine outputs (server/responses.py) and the fan-out's plan
(server/fanout.py): echo's text and log-probabilities, chat's logprobs shape, seeds per choice."""
from __future__ import annotations

import asyncio

import pytest

from hybrid_jax.engine.request import EngineOutput, ForkGroup
from hybrid_jax.errors import InputError
from hybrid_jax.sampling import SamplingParams
from hybrid_jax.server import fanout
from hybrid_jax.server.responses import ChoiceAcc, Format, Prompt, chat_choice, completion_choice


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _lp(t, v, top=()):
    return {"token_id": t, "logprob": v, "top": list(top)}


def _out(new_ids, lps, prompt_lps=None, finished=True):
    return EngineOutput(request_id="r", new_token_ids=new_ids, new_text="".join(f"<{i}>" for i in new_ids),
                        token_ids=new_ids, text="", finished=finished, finish_reason="length" if finished else None,
                        prompt_token_ids=[1, 2, 3], new_logprobs=lps, prompt_logprobs=prompt_lps)


def test_echo_with_logprobs_covers_the_prompt_first():
    prompt_lps = [None, _lp(2, -1.5, [(2, -1.5), (9, -0.5)]), _lp(3, -2.0, [(4, -0.1)])]
    acc = ChoiceAcc(0, Prompt("<1><2><3>", [1, 2, 3]))
    acc.add(_out([7], [_lp(7, -0.25, [(7, -0.25)])], prompt_lps))
    ch = completion_choice(acc, Format(_Tok(), logprobs=1, echo=True))
    assert ch["text"] == "<1><2><3><7>"
    lp = ch["logprobs"]
    assert lp["tokens"] == ["<1>", "<2>", "<3>", "<7>"] and lp["token_ids"] == [1, 2, 3, 7]
    assert lp["token_logprobs"] == [None, -1.5, -2.0, -0.25]
    assert lp["top_logprobs"] == [None, {"<2>": -1.5, "<9>": -0.5}, {"<4>": -0.1}, {"<7>": -0.25}]
    assert lp["text_offset"] == [0, 3, 6, 9]


def test_echo_of_max_tokens_0_shows_the_prompt_only():
    prompt_lps = [None, _lp(2, -1.5), _lp(3, -2.0)]
    acc = ChoiceAcc(3, Prompt("<1><2><3>", [1, 2, 3]))
    acc.add(_out([7], [_lp(7, -0.25)], prompt_lps))
    ch = completion_choice(acc, Format(_Tok(), logprobs=0, echo=True, drop_generated=True))
    assert ch["index"] == 3 and ch["text"] == "<1><2><3>" and ch["token_ids"] == []
    assert ch["logprobs"]["token_logprobs"] == [None, -1.5, -2.0]


def test_prompt_logprobs_by_name_get_vllms_field():
    acc = ChoiceAcc(0, Prompt("", [1, 2]))
    acc.add(_out([7], [], [None, _lp(2, -1.5, [(5, -0.5)])]))
    ch = completion_choice(acc, Format(_Tok(), prompt_logprobs=True))
    assert ch["prompt_logprobs"] == [None, {"5": {"logprob": -0.5, "decoded_token": "<5>"},
                                            "2": {"logprob": -1.5, "decoded_token": "<2>"}}]
    assert ch["logprobs"] is None and "prompt_logprobs" not in completion_choice(acc, Format(_Tok()))


def test_chat_logprobs_shape_and_token_ids():
    acc = ChoiceAcc(1, Prompt("", []))
    acc.add(_out([7, 8], [_lp(7, -0.25, [(7, -0.25), (3, -2.0)]), _lp(8, -1.0, [(8, -1.0), (3, -3.0)])]))
    ch = chat_choice(acc, Format(_Tok(), logprobs=2))
    first = ch["logprobs"]["content"][0]
    assert first == {"token": "<7>", "logprob": -0.25, "bytes": list(b"<7>"),
                     "top_logprobs": [{"token": "<7>", "logprob": -0.25, "bytes": list(b"<7>")},
                                      {"token": "<3>", "logprob": -2.0, "bytes": list(b"<3>")}]}
    ch = chat_choice(acc, Format(_Tok(), logprobs=0, tokens_as_ids=True))
    assert [e["token"] for e in ch["logprobs"]["content"]] == ["token_id:7", "token_id:8"]
    assert chat_choice(acc, Format(_Tok()))["logprobs"] is None


def test_fanout_plan_indices_tags_and_seeds():
    plan = fanout.plan("cmpl-x", [SamplingParams(seed=5), SamplingParams()], 3)
    assert [c.index for c in plan] == list(range(6)) and [c.prompt_index for c in plan] == [0, 0, 0, 1, 1, 1]
    assert [c.params.seed for c in plan] == [5, 6, 7, None, None, None]
    assert plan[4].tag.request_id == "cmpl-x-p1#1/3"
    assert ForkGroup.from_request_id(plan[4].tag.request_id) == ForkGroup("cmpl-x-p1", 1, 3)
    assert ForkGroup.from_request_id("plain-id") is None
    with pytest.raises(InputError, match="seed"):
        fanout.plan("c", [SamplingParams(seed=2**63 - 1)], 2)


def test_merged_interleaves_and_closes_every_generator():
    closed = []

    async def gen(name, n, fail=False):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield (name, i)
            if fail:
                raise RuntimeError(name)
        finally:
            closed.append(name)

    async def main():
        got = [x async for x in fanout.merged([gen("a", 2), gen("b", 3)])]
        assert sorted(got) == [(0, ("a", 0)), (0, ("a", 1)), (1, ("b", 0)), (1, ("b", 1)), (1, ("b", 2))]
        with pytest.raises(RuntimeError, match="c"):
            async for _ in fanout.merged([gen("c", 1, fail=True), gen("d", 10**6)]):
                pass
        assert "d" in closed                       # the sibling of a failed choice is closed (aborted)
        closed.clear()
        outs = fanout.merged([gen("e", 10**6), gen("f", 10**6)])
        await outs.__anext__()
        await outs.aclose()                        # the response ended early (client gone, drain deadline)
        assert sorted(closed) == ["e", "f"]        # every choice's engine request is closed: aborted together

    asyncio.run(main())
