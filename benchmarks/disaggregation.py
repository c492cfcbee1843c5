"""Prefill/decode disaggregation, 1P1D in one process: a prefill engine and a decode engine sharing a disk
tier's directory (cache/handoff.py), beside one engine serving alone, on every family (tiny random
checkpoints written as the family tests write them), prefix caching and n-gram speculation on.

Per family it prints:
- identical: the decode engine's greedy tokens equal the single engine's, for every prompt;
- tampered: the same after one byte of each handoff was flipped on disk (refused, recomputed): wrong
  tokens must be 0 and every tampered handoff refused;
- bytes: bytes moved per request / the request's cache bytes (its pages and one checkpoint of each
  state group, sized by the decode engine's own store);
- ttft: the decode engine's TTFT resuming from a handoff / its TTFT on a local prefix hit at the same
  point (a prompt of the same length it prefilled itself just before; alternating, medians).

    python benchmarks/disaggregation.py [--families qwen3_next,kimi_linear,...] [--prompt-len 400] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from cache.handoff import KVTransfer, wait_marker_blocking
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

HERE = os.path.dirname(os.path.abspath(__file__))


def writers() -> dict:
    """family -> make_checkpoint(path, seed) writing a tiny random checkpoint, as the family's tests do
    (the test modules' own writers; imported after hybrid_jax, whose name tests/hybrid_jax would shadow)."""
    sys.path += [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "tests", "hybrid_jax")]
    import conftest  # noqa: PLC0415
    import test_deepseek_v32, test_deepseek_v4, test_glm_moe_dsa, test_kimi_linear, test_nemotron_h  # noqa: E401,PLC0415
    import test_qwen3_5, test_qwen4_exp  # noqa: E401,PLC0415
    return {"qwen3_next": lambda p, s: conftest.make_checkpoint(p, s),
            "qwen3_5": lambda p, s: test_qwen3_5._write(p, moe=True, seed=s, tie=False),
            "kimi_linear": test_kimi_linear.make_checkpoint, "deepseek_v32": test_deepseek_v32.make_checkpoint,
            "glm_moe_dsa": test_glm_moe_dsa.make_checkpoint, "nemotron_h": test_nemotron_h.make_checkpoint,
            "qwen4_exp": test_qwen4_exp.make_checkpoint, "deepseek_v4": test_deepseek_v4.make_checkpoint}


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def engine(path: str, kv_dir: str | None, max_len: int) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=max_len,
                       enable_prefix_caching=kv_dir is not None, kv_cache_dir=kv_dir, speculative_config=SPEC,
                       compilation_cache_dir=None)
    return LLMEngine(LLM(model=path, dtype="float32"), cfg)   # (a first untimed round compiles what is timed)


def run(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """(tokens, seconds from arrival to the first token)."""
    rid = f"r{time.monotonic_ns()}"
    t0, first, toks = time.perf_counter(), None, []
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    while True:
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                if first is None and toks:
                    first = time.perf_counter() - t0
                if o.finished:
                    eng.flush_publishes()
                    return toks, first
    # (unreachable)


def settle(eng: LLMEngine):
    """Waits for the engine's disk tier to finish writing behind (its writer thread would otherwise share
    the two cores with the request timed next)."""
    disk = eng.scheduler.prefix.store.disk
    disk.flush()
    disk._writer.submit(lambda: None).result()       # (its one thread: whatever it had queued is done)


def cache_bytes(eng: LLMEngine, end: int) -> int:
    store = eng.scheduler.prefix.store
    layout, geo = store.store.layout, store.geometry
    n = sum(layout.nbytes[g] * (-(-end // size) if layout.paged[g] else 1) for g, size in geo.sizes.items())
    return n + sum(layout.nbytes[g] for g in layout.ckpt_groups if g not in geo.sizes)


def flip(d: str, key: str):
    entry = os.path.join(d, "entries", key)
    files = [os.path.join(r, f) for r, _, fs in os.walk(entry) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def family(name: str, write, prompt_len: int, repeats: int, tmp: str) -> dict:
    path = write(os.path.join(tmp, name), 0)
    shared = os.path.join(tmp, name + "-shared")
    max_len = prompt_len + 64
    P, D, alone = engine(path, shared, max_len), engine(path, shared, max_len), engine(path, None, max_len)
    vocab = P.loaded.config.vocab_size
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    room, same, wrong, refused, tampered, ratios, t_hand, t_local = 1000, 0, 0, 0, 0, [], [], []
    for i in range(-1, 2 * repeats):          # i = -1: a first round untimed (first reads, allocations)
        room += 1
        prompt = [(j * (7 + i) + 3 * i + 1) % (vocab - 2) + 1 for j in range(prompt_len)]
        run(P, prompt, SamplingParams(max_tokens=1, temperature=0, kv_transfer=KVTransfer("send", room)))
        m = wait_marker_blocking(shared, room, 10.0)
        bad = i >= repeats                        # the second half: every handoff damaged on disk
        if bad:
            flip(shared, m.key)
            tampered += 1
        before = D.scheduler.prefix.store.disk.handoffs.received
        settle(D)
        got, ttft_h = run(D, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                    kv_transfer=KVTransfer("receive", room, m.end, m.key)))
        took = D.scheduler.prefix.store.disk.handoffs.received - before
        want, _ = run(alone, prompt, greedy)
        if i < 0:
            continue
        same += got == want
        if bad:
            wrong += sum(a != b for a, b in zip(got, want))
            refused += took == 0
        else:
            assert took == 1, "a sound handoff was not taken"
            ratios.append(m.nbytes / cache_bytes(D, m.end))
            # a local hit at the same point: another prompt of the same length whose first m.end tokens
            # were prefilled here first (their chain's last checkpoint: kept under pressure, where a
            # prompt's spare checkpoint before its last token is let go first)
            other = [(t + 1) % (vocab - 2) + 1 for t in prompt]
            run(D, other[:m.end], SamplingParams(max_tokens=1, temperature=0))
            settle(D)
            hits = D.metrics.prefix_hits._value.get()
            _, ttft_l = run(D, other, greedy)
            got_hit = D.metrics.prefix_hits._value.get() - hits
            assert got_hit == m.end, f"the local hit is not at the handoff's point ({got_hit} tokens, not {m.end})"
            t_hand.append(ttft_h)
            t_local.append(ttft_l)
    return {"identical": f"{same}/{2 * repeats}", "tampered_refused": f"{refused}/{tampered}", "wrong_tokens": wrong,
            "bytes_ratio": max(ratios), "ttft_handoff_ms": 1e3 * statistics.median(t_hand),
            "ttft_local_hit_ms": 1e3 * statistics.median(t_local),
            "ttft_ratio": statistics.median(t_hand) / statistics.median(t_local)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=None)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    ws = writers()
    names = a.families.split(",") if a.families else list(ws)
    print(f"{'family':14s} {'identical':>9s} {'tampered refused':>16s} {'wrong':>5s} {'bytes/cache':>11s} "
          f"{'ttft handoff':>12s} {'ttft local':>10s} {'ratio':>6s}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            r = family(n, ws[n], a.prompt_len, a.repeats, tmp)
            print(f"{n:14s} {r['identical']:>9s} {r['tampered_refused']:>16s} {r['wrong_tokens']:>5d} "
                  f"{r['bytes_ratio']:>11.3f} {r['ttft_handoff_ms']:>10.1f}ms {r['ttft_local_hit_ms']:>8.1f}ms "
                  f"{r['ttft_ratio']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
