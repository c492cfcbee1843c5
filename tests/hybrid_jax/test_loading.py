"""Checkpoint loading: single file, sharded index, one-time re-layout, progress bar."""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

from hybrid_jax import LLM


def _shard(src, dst):
    """Rewrites a single-file checkpoint as two shards plus an index, the way large models ship."""
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(dst, fname), metadata={"format": "pt"})
        wm.update({n: fname for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def test_sharded_checkpoint_equals_single_file(tiny_checkpoint, tmp_path):
    _shard(tiny_checkpoint, tmp_path / "sharded")
    a = LLM(model=tiny_checkpoint)
    b = LLM(model=str(tmp_path / "sharded"))
    ids = [5, 7, 11, 13, 17]
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_missing_shard_is_named(tiny_checkpoint, tmp_path):
    import pytest  # noqa: PLC0415
    from hybrid_jax import CheckpointError  # noqa: PLC0415
    d = tmp_path / "sharded"
    _shard(tiny_checkpoint, d)
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        LLM(model=str(d))


def test_progress_bar_shown_when_asked(tiny_checkpoint, capsys):
    LLM(model=tiny_checkpoint, progress=True)
    assert "loading weights" in capsys.readouterr().err
    LLM(model=tiny_checkpoint)          # small checkpoint: no bar by default
    assert "loading weights" not in capsys.readouterr().err


def test_weights_are_relaid_once_at_load(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint)
    lp = llm.params["layers"][0]["gdn"]
    cfg = llm.config
    H, HV, K, V = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim)
    # grouped per key head (q | k | v | z, and b | a), already transposed to [in, out]
    assert lp["qkvz"].shape == (cfg.hidden_size, 2 * H * K + 2 * HV * V)
    assert lp["ba"].shape == (cfg.hidden_size, 2 * HV)
    assert lp["conv"].shape == (cfg.linear_conv_kernel_dim, cfg.linear_conv_dim)
