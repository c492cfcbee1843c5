"""The on-disk prefix tier in the engine: outputs with disk hits are token-identical to outputs
without caching; device evictions offload to disk and come back; corrupt or truncated spans are
refused with their reason and recomputed; a new process reuses the directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cache.segments import SegState
from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=32, compilation_cache_dir=None, warmup="none",
              enable_prefix_caching=True, prefix_block_size=16, prefix_checkpoint_interval=2)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return LLM(model=tiny_checkpoint, max_model_len=256)


def _prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 100).tolist()
    ps = [system + rng.integers(0, vocab, int(k)).tolist() for k in (7, 30, 18)]
    return ps + [rng.integers(0, vocab, 120).tolist(), ps[1]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _one_by_one(eng, prompts):
    """One request at a time; spans written behind each are made durable before the next, so that
    evictions find them on disk (in serving, writes simply finish in the background)."""
    out = []
    for p in prompts:
        out.append(eng.generate([{"prompt_token_ids": p}], SP)[0].token_ids)
        eng.step()                       # runs the publishes queued by the last step
        eng.prefix.disk.flush()
    return out


@pytest.fixture(scope="module")
def disk_engine(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_tier")
    return LLMEngine(base, EngineConfig(max_model_len=256, kv_cache_dir=str(d), prefix_cache_bytes=150_000, **ENGINE))


def test_offload_restore_and_reuse_after_reset_are_token_identical(base, disk_engine):
    eng = disk_engine
    prompts = _prompts(base.config.vocab_size)
    want = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], SP))
    assert _one_by_one(eng, prompts) == want                  # a small device cap: evictions go to disk
    eng.prefix.disk.flush()
    st = eng.cache_stats()
    assert st["offloads"] > 0 and st["disk"]["writes"] > 0
    on_disk = [s for s in eng.prefix.alloc.segments.values() if s.state is SegState.DISK]
    assert on_disk and all(s.ref_count == 0 for s in on_disk)
    eng.reset_prefix_cache()                                  # device store and index gone; the directory stays
    assert _one_by_one(eng, prompts) == want
    st = eng.cache_stats()
    assert st["disk"]["spans_restored"] >= 3 and st["passes"] >= 4 and not st["misses_by_reason"].get("no_hit")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_spans_are_refused_with_a_reason_and_recomputed(base, disk_engine, damage):
    eng = disk_engine
    prompts = _prompts(base.config.vocab_size, seed=1)
    want = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], SP))
    eng.reset_prefix_cache()
    assert _one_by_one(eng, prompts[:1]) == want[:1]
    eng.prefix.disk.flush()
    root = os.path.join(eng.prefix.disk.tier.directory, "entries")
    for key in os.listdir(root):                              # damage the biggest file of every entry
        files = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(root, key)) for f in fs]
        big = max(files, key=os.path.getsize)
        with open(big, "r+b") as f:
            if damage == "flip":
                f.seek(os.path.getsize(big) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
            else:
                f.truncate(os.path.getsize(big) // 2)
    eng.reset_prefix_cache()
    assert _one_by_one(eng, prompts) == want
    reasons = eng.cache_stats()["misses_by_reason"]
    assert reasons.get({"flip": "disk_corrupt", "truncate": "disk_truncated"}[damage], 0) >= 1, reasons


CHILD = r"""
import json, sys
from hybrid_jax import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=256, enable_prefix_caching=True, kv_cache_dir=sys.argv[2],
          engine_config=json.loads(sys.argv[3]))
sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
outs = [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in json.loads(sys.argv[4])]
llm.engine.prefix.disk.flush()
st = llm.cache_stats()
print(json.dumps({"outs": outs, "restored": st["disk"]["spans_restored"], "passes": st["passes"]}))
"""


def test_a_new_process_reuses_the_directory(base, tiny_checkpoint, tmp_path):
    prompts = _prompts(base.config.vocab_size, seed=2)[:3]
    want = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], SP))
    cfg = {k: v for k, v in ENGINE.items() if k != "enable_prefix_caching"}
    # A restarted server keeps its compilation cache as well as its KV directory; sharing it here
    # keeps the second process from compiling everything again.
    cfg["compilation_cache_dir"] = str(tmp_path / "xla")

    def child():
        out = subprocess.run([sys.executable, "-c", CHILD, tiny_checkpoint, str(tmp_path / "kv"), json.dumps(cfg),
                              json.dumps(prompts)], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    first, second = child(), child()
    assert first["outs"] == want and second["outs"] == want
    assert first["restored"] == 0 and second["restored"] >= 3
    assert second["passes"] == 3                               # every prompt resumed, the first one from disk
