"""Reasoning separation (server/tool_parsers/reasoning.py): where the output starts is read off the
rendered prompt — the released Qwen templates open `<think>` in the generation prompt unless
`enable_thinking` is false (Qwen3.5) or the model is the Instruct one (Qwen3-Next) — and the
reasoning / answer split is the same at every split point of the streamed text."""
from __future__ import annotations

import random
from pathlib import Path
from types import MappingProxyType

import pytest

from hybrid_jax.server.chat_template import render
from hybrid_jax.server.chat_messages import parse_conversation
from hybrid_jax.server.tool_parsers import REASONING_FORMATS, MessageParser, collect
from hybrid_jax.server.tool_parsers.reasoning import ReasoningSplitter
from hybrid_jax.template_sources import ChatTemplates

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
THINK = REASONING_FORMATS["qwen3"]


def _prompt(template: str, **kwargs) -> str:
    conv = parse_conversation({"messages": [{"role": "user", "content": "hi"}], **kwargs})
    return render(ChatTemplates(MappingProxyType({"default": (TEMPLATES / template).read_text()})), conv)


@pytest.mark.parametrize("template, kwargs, inside", [
    ("qwen3_5.jinja", {}, True),                                            # thinking by default
    ("qwen3_5.jinja", {"chat_template_kwargs": {"enable_thinking": True}}, True),
    ("qwen3_5.jinja", {"chat_template_kwargs": {"enable_thinking": False}}, False),   # <think>\n\n</think>
    ("qwen3_next_thinking.jinja", {}, True),
    ("qwen3_next_instruct.jinja", {}, False),
    ("qwen3_5.jinja", {"add_generation_prompt": False}, False),
])
def test_the_prompt_decides_where_the_output_starts(template, kwargs, inside):
    prompt = _prompt(template, **kwargs)
    assert THINK.starts_inside(prompt) is inside
    p = MessageParser(None, THINK)
    out = "Weighing it up.\n</think>\n\nHello!" if inside else "Hello!"
    msg = p.parse(out, prompt)
    assert (msg.reasoning, msg.content) == (("Weighing it up.", "Hello!") if inside else (None, "Hello!"))


def test_enable_thinking_false_renders_the_closed_block():
    """(Qwen3.5's template: the empty block is in the prompt, so nothing of the output is reasoning.)"""
    assert _prompt("qwen3_5.jinja", chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


CASES = [
    # (prompt tail, output, reasoning, content)
    ("<think>\n", "Step 1.\nStep 2.\n</think>\n\nThe answer is 4.", "Step 1.\nStep 2.", "The answer is 4."),
    ("", "<think>\nHmm, 2 + 2.\n</think>\n\nFour.", "Hmm, 2 + 2.", "Four."),     # the model opens it itself
    ("", "  \n<think>x</think>y", "x", "y"),
    ("<think>\n", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("", "No reasoning at all, <think> later is text.", None, "No reasoning at all, <think> later is text."),
    ("", "<thinking is not the marker>", None, "<thinking is not the marker>"),
    ("<think>\n", "</think>\n\nOnly an answer.", None, "Only an answer."),
    ("<think>\n\n</think>\n\n", "Answer with </think> inside.", None, "Answer with </think> inside."),
    ("", "  leading blanks stay", None, "  leading blanks stay"),
]


@pytest.mark.parametrize("prompt, text, reasoning, content", CASES)
def test_split_is_the_same_at_every_split_point(prompt, text, reasoning, content):
    p = MessageParser(None, THINK)
    whole = p.parse(text, prompt)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    rng = random.Random(7)
    for _ in range(20):
        ks = sorted(rng.sample(range(len(text) + 1), 4))
        cuts.append([text[i:j] for i, j in zip([0, *ks], [*ks, len(text)])])
    for pieces in cuts:
        st = p.stream(prompt)
        deltas = [d for piece in pieces for d in st.feed(piece)] + st.finish()
        msg = collect(deltas)
        assert (msg.reasoning, msg.content) == (reasoning, content), pieces
        # a partial marker is never handed on as text
        assert not any(d.reasoning and d.reasoning.endswith(("<", "</", "</th")) for d in deltas)


def test_a_partial_end_marker_is_held_then_released_as_text():
    s = ReasoningSplitter(THINK, inside=True)
    assert s.feed("a </thi").reasoning == "a"           # held: it may be </think>
    assert s.feed("ng> b").reasoning == " </thing> b"     # it was not
    assert s.feed("</think>c").answer == "c"
