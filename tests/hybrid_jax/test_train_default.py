"""scripts/train_default.py end to end on a slice of the held-out chapters (the full run is not part of
the suite): it trains a tokenizer and the model, the loss falls, and what it writes is a checkpoint
the ordinary loader reads and that generates from the parameters it trained."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np

from hybrid_jax import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_training_script_runs_end_to_end(tmp_path):
    with open(os.path.join(ROOT, "tests", "data", "kjv_heldout.txt"), encoding="utf-8") as f:
        chapters = f.read().split("\n\n")
    corpus = tmp_path / "slice.txt"
    corpus.write_text("\n\n".join(chapters * 2), encoding="utf-8")     # 58 chapters: one held out
    out = tmp_path / "model"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_default.py"), "--corpus", str(corpus),
                        "--out", str(out), "--vocab", "400", "--seq", "32", "--batch", "4", "--steps", "12",
                        "--lr", "1e-2", "--warmup", "1", "--eval-every", "0"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads((out / "training.json").read_text())
    assert figures["steps"] == 12 and figures["training_tokens_seen"] == 12 * 4 * 32
    assert figures["first_train_loss"] > figures["final_train_loss"]           # it learned something
    assert math.isfinite(figures["final_heldout_loss"])
    llm = LLM(model=str(out), dtype="float32")                                 # the ordinary loader
    assert llm.config.vocab_size == 400 and llm.tokenizer.encode("And God said")
    o = llm.generate("And God said", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(o.outputs[0].token_ids) == 4
    # the checkpoint holds the trained weights (in bf16): the script's held-out loss (chapter 39 of the
    # slice, windows of seq + 1 tokens in whole batches) recomputed from them within bf16 rounding
    stream = llm.tokenizer.encode(chapters[39 % len(chapters)].strip()) + [llm.tokenizer.eos_token_id]
    T, n = 32, (len(stream) - 1) // 32
    n -= n % min(4, n)
    nll = []
    for i in range(n):
        w = stream[i * T:i * T + T + 1]
        lg = llm.logits(w).astype(np.float64)[:-1]
        nll += list(lg.max(-1) + np.log(np.sum(np.exp(lg - lg.max(-1, keepdims=True)), -1)) - lg[np.arange(T), w[1:]])
    assert abs(np.mean(nll) - figures["final_heldout_loss"]) < 0.02 * figures["final_heldout_loss"]
    assert figures["final_heldout_loss"] < math.log(400)
