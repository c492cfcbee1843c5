"""Prefill/decode handoffs between two engines sharing a disk tier's directory (cache/handoff.py): the
receiver's greedy tokens equal a single engine's; it resumes where a local hit would, from exactly the
request's cache bytes; a damaged handoff, one made from other tokens, and a sender that ends without
handing over are each refused or reported and the prompt recomputed, never served."""
from __future__ import annotations

import os

import pytest

from cache.handoff import KVTransfer, wait_marker_blocking
from hybrid_jax import LLM, SamplingParams


def _prompt(n: int, seed: int) -> dict:
    return {"prompt_token_ids": [(i * 37 + seed * 101 + 11) % 900 + 5 for i in range(n)]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(sender, receiver, reference, shared directory)."""
    d = str(tmp_path_factory.mktemp("handoffs"))
    kw = dict(max_num_seqs=2, max_model_len=1024)
    return (LLM(enable_prefix_caching=True, kv_cache_dir=d, **kw), LLM(enable_prefix_caching=True, kv_cache_dir=d, **kw),
            LLM(**kw), d)


def _send(sender, d, prompt, room):
    sender.generate(prompt, SamplingParams(max_tokens=1, temperature=0, kv_transfer=KVTransfer("send", room)))
    return wait_marker_blocking(d, room, 10.0)


def _handoffs(llm):
    disk = llm.engine.scheduler.prefix.store.disk
    return disk.handoffs, disk.reasons


GREEDY = SamplingParams(max_tokens=20, temperature=0)


def _receive(receiver, prompt, m):
    t = KVTransfer("receive", m.room, m.end, m.key)
    return receiver.generate(prompt, SamplingParams(max_tokens=20, temperature=0, kv_transfer=t))[0]


def test_the_receiver_resumes_from_the_handoff_and_answers_as_one_engine(engines):
    sender, receiver, ref, d = engines
    prompt = _prompt(300, 1)
    m = _send(sender, d, prompt, room=11)
    assert m.status == "ok" and m.end == 288          # the last point of the resume grid (16) before token 300
    h, _ = _handoffs(receiver)
    before = h.received
    queries, hits = (receiver.engine.metrics.prefix_queries._value.get(),
                     receiver.engine.metrics.prefix_hits._value.get())
    out = _receive(receiver, prompt, m)
    assert out.outputs[0].token_ids == ref.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert h.received == before + 1
    h.spans._writer.submit(lambda: None).result()          # the taken handoff is deleted behind the request
    assert not os.path.exists(os.path.join(d, "entries", m.key))
    assert receiver.engine.metrics.prefix_hits._value.get() - hits == 288
    assert receiver.engine.metrics.prefix_queries._value.get() - queries == 300
    # what moved is the request's cache at 288 tokens: its pages (a partial last page included) and one
    # checkpoint of each state group, as the receiver's own store sizes them
    layout = receiver.engine.scheduler.prefix.store.store.layout
    geo = receiver.engine.scheduler.prefix.store.geometry
    want = sum(layout.nbytes[g] * (-(-288 // size) if layout.paged[g] else 1) for g, size in geo.sizes.items())
    want += sum(layout.nbytes[g] for g in layout.ckpt_groups if g not in geo.sizes)
    assert m.nbytes <= 1.05 * want


def test_a_damaged_handoff_is_refused_and_the_prompt_recomputed(engines):
    sender, receiver, ref, d = engines
    prompt = _prompt(200, 2)
    m = _send(sender, d, prompt, room=12)
    entry = os.path.join(d, "entries", m.key)
    files = [os.path.join(r, f) for r, _, fs in os.walk(entry) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:                 # one byte of the largest array file flipped
        f.seek(os.path.getsize(big) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    h, reasons = _handoffs(receiver)
    received, refused = h.received, sum(v for k, v in reasons.items() if k.startswith("handoff_"))
    out = _receive(receiver, prompt, m)
    assert out.outputs[0].token_ids == ref.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert h.received == received
    assert sum(v for k, v in reasons.items() if k.startswith("handoff_")) == refused + 1


def test_a_handoff_of_other_tokens_is_refused(engines):
    sender, receiver, ref, d = engines
    m = _send(sender, d, _prompt(200, 3), room=13)
    other = _prompt(200, 4)                     # e.g. another tokenizer or template on the decode side
    _, reasons = _handoffs(receiver)
    before = reasons["handoff_mismatch"]
    out = _receive(receiver, other, m)
    assert out.outputs[0].token_ids == ref.generate(other, GREEDY)[0].outputs[0].token_ids
    assert reasons["handoff_mismatch"] == before + 1


def test_a_sender_with_nothing_to_hand_over_says_so(engines):
    """A prompt shorter than one resume point: the room's marker is a refusal at once, not a timeout."""
    sender, _, _, d = engines
    m = _send(sender, d, _prompt(10, 5), room=14)
    assert m.status == "refused" and "short" in m.reason


def test_aborted_requests_leave_no_prefetch_and_their_room_is_told(engines):
    """A receiving request aborted before admission drops its handoff's prefetch; a sending request aborted
    before its handoff writes a refused marker naming the abort (its receiver does not wait it out)."""
    sender, receiver, _, d = engines
    prompt = _prompt(200, 6)
    m = _send(sender, d, prompt, room=15)
    eng = receiver.engine
    eng.add_request("r-abort", prompt, SamplingParams(max_tokens=4, kv_transfer=KVTransfer("receive", 15, m.end, m.key)))
    h, _ = _handoffs(receiver)
    assert "r-abort" in h._prefetched              # the read started on arrival
    eng.abort_request("r-abort")
    assert "r-abort" not in h._prefetched
    sender.engine.add_request("s-abort", _prompt(200, 7), SamplingParams(max_tokens=1, kv_transfer=KVTransfer("send", 16)))
    sender.engine.abort_request("s-abort")
    m = wait_marker_blocking(d, 16, 10.0)
    assert m.status == "refused" and "aborted" in m.reason


def test_a_receiver_asking_for_prompt_logprobs_scores_the_whole_prompt_and_holds_no_read(engines):
    """prompt_logprobs: the request takes no cached prefix, so it neither reads nor takes the handoff
    (the entry stays for the tier's cap) and its prompt's log-probabilities are the reference's."""
    sender, receiver, ref, d = engines
    prompt = _prompt(200, 8)
    m = _send(sender, d, prompt, room=17)
    h, _ = _handoffs(receiver)
    before = h.received
    eng = receiver.engine
    t = KVTransfer("receive", 17, m.end, m.key)
    eng.add_request("r-plp", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0, kv_transfer=t))
    assert "r-plp" not in h._prefetched
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in eng.step() if o.request_id == "r-plp"]
    got = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    want = ref.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0].prompt_logprobs
    assert len(got) == len(want) == 200
    assert [x["logprob"] for x in got[1:]] == pytest.approx([x["logprob"] for x in want[1:]], abs=1e-4)
    assert h.received == before and os.path.exists(os.path.join(d, "entries", m.key))

