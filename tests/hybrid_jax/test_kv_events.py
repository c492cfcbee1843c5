"""KV-cache events for routers (cache/kv_events.py, engine/kv_event_publisher.py): an engine with prefix
caching publishes, over ZeroMQ in vLLM's format, the blocks it stores (hashes a router recomputes from the
prompt's token ids alone, chained by parent), the blocks it lets go of, and a cleared cache; the config
is vLLM's and refuses what it does not serve."""
from __future__ import annotations

import hashlib
import struct
import time

import msgpack
import numpy as np
import pytest
import zmq

from hybrid_jax import LLM, SamplingParams
from hybrid_jax.engine import EngineConfig, LLMEngine
from hybrid_jax.engine.kv_event_publisher import KVEventsConfig
from hybrid_jax.errors import InputError

B = 16


def router_hashes(tokens, block=B):
    """What a router computes, written from the documented rule (not the server's code): SHA-256 of the
    parent's 8 bytes (none for the first block) and the block's int64 little-endian ids, first 8 bytes."""
    out, parent = [], b""
    for i in range(len(tokens) // block):
        body = b"".join(struct.pack("<q", t) for t in tokens[i * block:(i + 1) * block])
        h = hashlib.sha256(parent + body).digest()[:8]
        out.append(struct.unpack(">q", h)[0])
        parent = h
    return out


def _receive(sub, timeout_ms=3000):
    batches = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        batches.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        timeout_ms = 500
    return batches


@pytest.fixture
def engine_and_sub(tiny_checkpoint, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv.sock"
    eng = LLMEngine(LLM(model=tiny_checkpoint), EngineConfig(
        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=True,
        prefix_block_size=B, compilation_cache_dir=None, warmup="none",
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                          "topic": "kv"}))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)            # a PUB socket drops what it sends before the subscription arrives
    yield eng, sub
    sub.close(linger=0)
    eng.close()


def _events(batches):
    return [e for _, _, b in batches for e in b["events"]]


def test_stored_blocks_are_the_prompts_chain_and_a_hit_adds_only_new_blocks(engine_and_sub):
    eng, sub = engine_and_sub
    vocab = eng.loaded.config.vocab_size
    a = np.random.default_rng(0).integers(0, vocab, 100).tolist()
    eng.generate([{"prompt_token_ids": a}], SamplingParams(max_tokens=2, temperature=0))
    batches = _receive(sub)
    assert batches and [t for t, _, _ in batches] == [b"kv"] * len(batches)
    assert [s for _, s, _ in batches] == list(range(len(batches)))           # sequence numbers from 0
    assert all(b["data_parallel_rank"] == 0 for _, _, b in batches)
    stored = [e for e in _events(batches) if e["type"] == "BlockStored"]
    hashes = [h for e in stored for h in e["block_hashes"]]
    want = router_hashes(a)
    assert len(hashes) >= 4 and hashes == want[:len(hashes)]      # the prompt's blocks up to its publish
    assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == B
    assert [t for e in stored for t in e["token_ids"]] == a[:len(hashes) * B]
    assert all((e["lora_id"], e["medium"]) == (None, "GPU") for e in stored)

    b = a[:64] + np.random.default_rng(1).integers(0, vocab, 50).tolist()      # 4 blocks shared
    eng.generate([{"prompt_token_ids": b}], SamplingParams(max_tokens=2, temperature=0))
    new = [e for e in _events(_receive(sub)) if e["type"] == "BlockStored"]
    got = [h for e in new for h in e["block_hashes"]]
    want_b = router_hashes(b)
    assert got and got == want_b[4:4 + len(got)]             # only the blocks past the shared prefix
    assert new[0]["parent_block_hash"] == want_b[3]


def test_a_block_let_go_is_removed_and_a_reset_clears_all(engine_and_sub):
    eng, sub = engine_and_sub
    a = np.random.default_rng(2).integers(0, eng.loaded.config.vocab_size, 80).tolist()
    eng.generate([{"prompt_token_ids": a}], SamplingParams(max_tokens=2, temperature=0))
    hashes = [h for e in _events(_receive(sub)) if e["type"] == "BlockStored" for h in e["block_hashes"]]
    store, group = eng.prefix.store, eng.kv_events.group
    last = max((sid for sid, (g, _) in store.units.items() if g == group), key=lambda s: store.alloc.get(s).start)
    store.evict([last])
    eng.flush_publishes()
    removed = [e for e in _events(_receive(sub)) if e["type"] == "BlockRemoved"]
    assert removed and removed[0]["block_hashes"][-1] == hashes[-1] and removed[0]["medium"] == "GPU"
    eng.reset_prefix_cache()
    assert _events(_receive(sub)) == [{"type": "AllBlocksCleared"}]


def test_config_is_vllms_and_refuses_what_it_does_not_serve():
    assert KVEventsConfig.parse({"enable_kv_cache_events": False}) is None
    c = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "topic": "t"})
    assert (c.endpoint_for(0), c.endpoint_for(2)) == ("tcp://*:5557", "tcp://*:5559")
    for bad, word in (({"enable_kv_cache_events": True, "frobnicate": 1}, "frobnicate"),
                      ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5558"}, "replay_endpoint"),
                      ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
                      ({"enable_kv_cache_events": True, "endpoint": "localhost"}, "endpoint")):
        with pytest.raises(InputError, match=word):
            KVEventsConfig.parse(bad)
    with pytest.raises(InputError, match="enable_prefix_caching"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True})
