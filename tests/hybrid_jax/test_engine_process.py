"""The engine core in its own process (engine/core_process.py) behind API-side clients
(engine/core_client.py): two clients, as two API server processes would, feed one core at once and
get what the in-process engine gives, text included (each client detokenizes its own requests; the
core only those with stop strings, which it checks); a client that goes away has its requests
aborted and the core serves on."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.core_client import EngineCoreClient
from hybrid_jax.engine.core_process import start_core
from hybrid_jax.llm import build_engine
from hybrid_jax.default_model import DEFAULT_MODEL_DIR
from hybrid_jax.tokenizer import load_tokenizer

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, decode_steps=4,
                      warmup="none", compilation_cache_dir=None)


STATUSES: list = []       # the fixture's core's start-up statuses, as start_core passed them on


@pytest.fixture(scope="module")
def core():
    proc, address, authkey, info = start_core(None, "auto", CONFIG, build=build_engine, on_progress=STATUSES.append)
    yield address, authkey, info
    EngineCoreClient(address, authkey, info, load_tokenizer(DEFAULT_MODEL_DIR), process=proc).shutdown()
    assert proc.exitcode == 0


def _requests(tag: str):
    text = "Hello, hybrid world"
    return [(f"{tag}-greedy", text, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
            (f"{tag}-seeded", {"prompt_token_ids": [72, 105, 33, 10]},
             SamplingParams(max_tokens=14, temperature=0.8, seed=4, ignore_eos=True)),
            (f"{tag}-stop", text, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["@@"]))]


def _in_process(reqs, stop_at: str | None):
    """The same requests through an in-process engine (its own detokenizer); the stop request gets a
    stop string cut from its free run, so it ends on the host."""
    eng = LLMEngine(LLM(), CONFIG)
    outs = eng.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs])
    return {rid: (o.token_ids, o.text, o.finish_reason) for (rid, _, _), o in zip(reqs, outs)}


def _client_run(core, reqs, results: dict, close_after: int | None = None):
    """One API server: its own connection and event loop, its requests streamed at once."""
    address, authkey, info = core
    client = EngineCoreClient(address, authkey, info, load_tokenizer(DEFAULT_MODEL_DIR))

    async def one(rid, prompt, sp):
        text, n = "", 0
        async for o in client.generate(rid, prompt, sp):
            text += o.new_text
            n += 1
            if close_after is not None and n >= close_after:
                client.close()                    # the API server went away mid-stream
                return
        assert text == o.text                     # the streamed pieces add up to the final text
        results[rid] = (o.token_ids, o.text, o.finish_reason)

    async def main():
        await asyncio.gather(*(one(*r) for r in reqs))
    asyncio.run(main())
    return client


def test_two_clients_feed_one_core_and_get_the_in_process_outputs(core):
    a, b = _requests("a"), _requests("b")
    want = _in_process(a, None)
    stop = want["a-stop"][1][5:7]                 # a stop string from the free run: the core checks it
    a[2] = (a[2][0], a[2][1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    b[2] = (b[2][0], b[2][1], a[2][2])
    want = _in_process(a, None)
    assert want["a-stop"][2] == "stop" and stop not in want["a-stop"][1]
    got: dict = {}
    threads = [threading.Thread(target=_client_run, args=(core, r, got)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert {k: v for k, v in got.items() if k.startswith("a-")} == want
    assert {k.replace("b-", "a-"): v for k, v in got.items() if k.startswith("b-")} == want
    assert all(v[1] for v in got.values())         # text on every request: detokenized on one side or the other


def test_prompt_logprobs_and_include_stop_str_cross_the_process_boundary(core):
    """A prompt_logprobs request's entries reach the client in its first output, equal to the in-process
    engine's; a stop string kept by include_stop_str_in_output is in the text the core sends."""
    address, authkey, info = core
    client = EngineCoreClient(address, authkey, info, load_tokenizer(DEFAULT_MODEL_DIR))
    prompt = {"prompt_token_ids": [72, 105, 33, 10, 44, 90, 17, 201, 5, 66]}
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    eng = LLMEngine(LLM(), CONFIG)
    free = eng.generate(["Hello, hybrid world"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    eng.add_request("here", prompt, sp)
    want = None
    while want is None:
        want = next((o.prompt_logprobs for o in eng.step() if o.prompt_logprobs is not None), None)
    stop = free[5:7]
    sps = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)

    async def run(rid, p, params):
        outs = [o async for o in client.generate(rid, p, params)]
        return outs
    outs, souts = asyncio.run(run("plp", prompt, sp)), asyncio.run(run("kept", "Hello, hybrid world", sps))
    client.close()
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and outs[0].prompt_logprobs is carried[0]
    assert carried[0][0] is None and [e["token_id"] for e in carried[0][1:]] == prompt["prompt_token_ids"][1:]
    assert carried[0] == want              # the same engine configuration: the same programs, the same numbers
    assert souts[-1].text == free[:free.find(stop) + len(stop)] and souts[-1].finish_reason == "stop"


def test_the_core_reports_its_start_up_before_ready_and_with_its_beats(core):
    """The child's statuses cross the ready pipe before "ready" (loading, the weights loaded, ready:
    warm-up "none" plans no program), and the ready info and every beat carry the last one."""
    address, authkey, info = core
    assert [s.phase for s in STATUSES] == ["loading", "compiling", "complete"]
    assert STATUSES[0].weights_s is None and STATUSES[1].weights_s > 0
    last, ready = STATUSES[-1], info["startup"]
    assert (ready.phase, ready.weights_s, ready.ready_s) == (last.phase, last.weights_s, last.ready_s)
    assert ready.ready_s is not None
    client = EngineCoreClient(address, authkey, info, load_tokenizer(DEFAULT_MODEL_DIR))
    try:
        deadline = time.monotonic() + 30
        while client.pulse.startup is None:
            assert time.monotonic() < deadline, "no beat with the start-up's status"
            time.sleep(0.05)
        st = client.pulse.startup
        assert st.phase == "complete" and st.weights_s == info["startup"].weights_s and st.stalls == 0
        assert b"hybrid_jax_compile_stalls_total 0.0" in client.pulse.metrics
    finally:
        client.close()


def test_a_client_that_goes_away_has_its_requests_aborted(core):
    address, authkey, info = core
    watcher = EngineCoreClient(address, authkey, info, load_tokenizer(DEFAULT_MODEL_DIR))

    def aborted(at_least: float = 0.0) -> float:
        """From the core's heartbeats (a beat at most 0.5 s apart carries its metrics): the count once
        it reaches `at_least`, or after 5 s."""
        deadline = time.monotonic() + 5
        while True:
            text = watcher.render_metrics().decode()
            line = next((x for x in text.splitlines() if x.startswith("hybrid_jax_requests_aborted_total ")), None)
            value = float(line.split()[1]) if line else -1.0
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    before = aborted()
    long = [("gone", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=200, ignore_eos=True))]
    _client_run(core, long, {}, close_after=2)
    got: dict = {}
    _client_run(core, _requests("c")[:1], got)     # the core serves on
    assert got["c-greedy"][2] == "length" and len(got["c-greedy"][0]) == 20
    assert aborted(before + 1) == before + 1


def test_a_core_that_dies_fails_its_requests_and_says_so():
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from hybrid_jax.engine.async_engine import EngineRequestError  # noqa: PLC0415
    proc, address, authkey, info = start_core(None, "auto", CONFIG, build=build_engine)
    client = EngineCoreClient(address, authkey, info, load_tokenizer(DEFAULT_MODEL_DIR), process=proc)
    assert client.alive
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    client._reader.join(timeout=30)
    assert not client.alive and "exited" in client.error

    async def ask():
        async for _ in client.generate("late", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2)):
            pass
    with pytest.raises(EngineRequestError, match="engine core exited"):
        asyncio.run(ask())
    client.shutdown(timeout=1)
