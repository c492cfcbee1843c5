"""The on-disk prefix tier in the engine: outputs with disk hits are token-identical to outputs
without caching; device evictions offload to disk and come back; corrupt or truncated spans are
refused with their reason and recomputed; a new process reuses the directory; a directory that
turns read-only mid-serve, or cannot be used at all, changes no output (writes go off, with a
warning); warm-up leaves another model's spans alone."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from cache.disk_tier import DiskTier
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


# ---- a directory that cannot be written, at open and mid-serve (cache/disk_tier.py) --------------

def _tier_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cache.disk_tier" and r.levelno == logging.WARNING]


def test_a_directory_that_turns_read_only_mid_serve_changes_no_output(base, tmp_path, monkeypatch, caplog):
    """The directory turns read-only after the first request (every write call fails with EROFS):
    requests in flight and after finish with the tokens of a run without any cache, writes go off
    with one warning and spans are no longer even copied to the host; the store reopened on the
    read-only directory (reset) starts with writes off and still restores what was written before."""
    from tests.cache.test_disk_tier_faults import ReadOnlyOS, use_os
    caplog.set_level(logging.WARNING, logger="cache.disk_tier")
    eng = LLMEngine(base, EngineConfig(max_model_len=256, kv_cache_dir=str(tmp_path / "kv"), prefix_cache_bytes=150_000,
                                       **ENGINE))
    prompts = _prompts(base.config.vocab_size, seed=3)
    want = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], SP))
    assert _one_by_one(eng, prompts[:1]) == want[:1]
    written = eng.cache_stats()["disk"]["writes"]
    assert written > 0 and eng.cache_stats()["disk"]["writable"] is True
    use_os(monkeypatch, ReadOnlyOS(errno.EROFS))
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts[1:]], SP)   # in flight together
    assert [o.token_ids for o in outs] == want[1:]
    eng.step()
    eng.prefix.disk.flush()
    assert _one_by_one(eng, prompts[1:]) == want[1:]
    d = eng.cache_stats()["disk"]
    assert d["writable"] is False and d["write_faults"] >= 1 and d["writes"] == written
    assert d["write_fault"].endswith("EROFS: Read-only file system") and d["skipped_writes"] > 0
    assert eng.prefix.disk.health() == {k: d[k] for k in ("writable", "write_faults", "write_fault", "skipped_writes")}
    scraped = {line.split()[0]: float(line.split()[1]) for line in eng.metrics.render().decode().splitlines()
               if line.startswith("hybrid_jax_kv_cache_dir")}          # what an operator's dashboard sees
    assert scraped == {"hybrid_jax_kv_cache_dir_writable": 0.0, "hybrid_jax_kv_cache_dir_write_faults_total":
                       d["write_faults"], "hybrid_jax_kv_cache_dir_skipped_writes_total": d["skipped_writes"]}
    assert len(_tier_warnings(caplog)) == 1
    old = eng.prefix.disk.tier
    eng.reset_prefix_cache()                       # today: OSError from opening the read-only directory
    assert old._pool._shutdown                     # the dropped store's tier threads are stopped
    assert _one_by_one(eng, prompts) == want
    st = eng.cache_stats()
    assert st["disk"]["writable"] is False and st["disk"]["spans_restored"] >= 1
    assert len(_tier_warnings(caplog)) == 2 and "open: EROFS" in _tier_warnings(caplog)[1]


def test_a_directory_that_cannot_be_used_starts_the_engine_without_a_tier(base, tmp_path, caplog):
    """kv_cache_dir names a regular file: the engine starts (a warning names the path), runs as
    without a disk tier and its outputs are those of a run without any cache."""
    caplog.set_level(logging.WARNING, logger="cache.disk_tier")
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    eng = LLMEngine(base, EngineConfig(max_model_len=256, kv_cache_dir=str(path), prefix_cache_bytes=150_000,
                                       **ENGINE))                       # today: FileExistsError
    (msg,) = _tier_warnings(caplog)
    assert str(path) in msg and "ENOTDIR" in msg and "runs without a disk tier" in msg
    prompts = _prompts(base.config.vocab_size, seed=4)[:3]
    want = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], SP))
    assert _one_by_one(eng, prompts) == want
    d = eng.cache_stats()["disk"]
    assert d["writable"] is False and d["entries"] == 0 and d["writes"] == 0 and path.read_text() == "x"


def test_warm_up_does_not_delete_another_models_span(disk_engine):
    """Two servers of different models on one directory: warming up reads a span without deleting
    one that belongs to the other model (today it read the first key with `get`, which deletes a
    foreign entry)."""
    from cache.tier_entry import EntryMeta
    eng = disk_engine
    tier = eng.prefix.disk.tier
    arrays = {"x": np.arange(16, dtype=np.float32)}
    foreign = "0" * 32                                           # sorts before every other key
    with DiskTier(tier.directory, tier.cap_bytes, fingerprint="another-model") as other:
        assert other.put(foreign, arrays, EntryMeta.of(arrays, fingerprint="another-model", abi="a", start=0, end=16))
    before = tier.stats()["misses"]
    eng.runner.cache = eng.prefix.disk.warmup(eng.runner.cache)
    assert foreign in tier and tier.stats()["misses"] == before
