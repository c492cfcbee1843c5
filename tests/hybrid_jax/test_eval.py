"""`hybrid-jax eval` (hybrid_jax/evaluate.py) on the shipped default model: the perplexity it prints
is exp of the mean token NLL computed here independently (the model's forward over each window, no
engine); its comparison mode gives KL = 0, full top-1 agreement and identical greedy text for prefix
caching on / off, with the prefix cache really hit; and it reports a real difference as one."""
from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest

from hybrid_jax import LLM, evaluate
from hybrid_jax.cli import main
from hybrid_jax.errors import InputError

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CONTEXT, STRIDE = 64, 32


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    with open(os.path.join(DATA, "kjv_heldout.txt"), encoding="utf-8") as f:
        text = f.read()[:900]
    path = tmp_path_factory.mktemp("eval") / "text.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _independent_nll(llm, ids) -> dict[int, float]:
    """-log p(token p) for every position p >= 1, each from the first window (starts every STRIDE tokens,
    CONTEXT long) that gives it at least CONTEXT - STRIDE tokens of context (any, in the first window),
    read from one forward of the whole window."""
    nll: dict[int, float] = {}
    for s in range(0, len(ids), STRIDE):
        w = ids[s:s + CONTEXT]
        lg = llm.logits(w).astype(np.float64)
        for j in range(1, len(w)):
            p = s + j
            if p in nll or (s > 0 and j < CONTEXT - STRIDE):
                continue
            row = lg[j - 1]
            nll[p] = float(row.max() + np.log(np.sum(np.exp(row - row.max()))) - row[w[j]])
    return nll


def test_eval_prints_exp_of_the_mean_token_nll(llm, text_file, capsys):
    assert main(["eval", "--file", text_file, "--context", str(CONTEXT), "--stride", str(STRIDE),
                 "--generate", "0"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"perplexity ([\d.]+) \(mean NLL ([\d.]+) nats\)", out)
    assert m, out
    with open(text_file, encoding="utf-8") as f:
        ids = llm.tokenizer.encode(f.read())
    ref = _independent_nll(llm, ids)
    assert sorted(ref) == list(range(1, len(ids)))          # every position once
    mean = float(np.mean(list(ref.values())))
    assert abs(float(m.group(2)) - mean) < 1e-5, (m.group(2), mean)
    assert abs(float(m.group(1)) - math.exp(mean)) < 1e-3 * math.exp(mean)
    assert f"{len(ids) - 1} positions scored" in out


def test_prefix_caching_compares_exact(llm, text_file):
    with open(text_file, encoding="utf-8") as f:
        ids = llm.tokenizer.encode(f.read())
    kw = dict(context=CONTEXT, stride=STRIDE, generate_tokens=24)
    off = evaluate.score(llm, ids, **kw)
    on = evaluate.score(LLM(enable_prefix_caching=True, engine_config={"prefix_block_size": 16}), ids, **kw)
    assert on.cache_stats["hit_rate"] > 0.5                # the comparison read cached prefixes
    c = evaluate.compare(off, on)
    # float32 reassociation (a prefix resumed at a block boundary runs other chunk boundaries) moves
    # logits by ~1e-6, KL by ~1e-12; reading a wrong state moves it by orders of magnitude more
    assert c.kl_max < 1e-9 and c.top1_agreement == 1.0 and c.greedy_identical, c
    # Per token, the cache adds no more than another arithmetic order does: the engine's cold scores
    # against an independent forward of each whole window. Measured here: those two 2.1e-5 apart at most,
    # the cache on against off 1.4e-5 (a fixed 1e-5 held on one CPU, not on another); a wrong state moves
    # an NLL by more than 1e-2. Issue 57's exact mode is where these become bit-identical.
    ref = _independent_nll(llm, ids)
    floor = max(abs(ref[int(p)] - x) for p, x in zip(off.positions, off.nll))
    assert floor < 1e-4, floor
    assert np.max(np.abs(off.nll - on.nll)) <= 2 * max(floor, 1e-6), (np.max(np.abs(off.nll - on.nll)), floor)
    # the same comparison reports a real difference, four orders of magnitude above the exact bound:
    # scoring from half the context
    short = evaluate.score(llm, ids, context=CONTEXT // 2, stride=STRIDE // 2, generate_tokens=24)
    d = evaluate.compare(off, short)
    assert d.kl_mean > 1e-5 and short.perplexity != off.perplexity


def test_eval_cli_compare_mode_and_its_errors(text_file, capsys):
    assert main(["eval", "--file", text_file, "--context", "32", "--stride", "16", "--max-positions", "40",
                 "--generate", "8", "--compare", '{"enable_prefix_caching": true}']) == 0
    out = capsys.readouterr().out
    kl = re.search(r"KL\(A \|\| B\) per position: mean (\S+) nats, max (\S+) nats; top-1 agreement ([\d.]+)%", out)
    assert kl and float(kl.group(2)) < 1e-9 and float(kl.group(3)) == 100.0, out
    assert "40 positions scored" in out and "greedy 8 tokens: identical" in out
    assert main(["eval", "--file", text_file, "--context", "16", "--stride", "32"]) == 2
    assert "stride must be in [1, context]" in capsys.readouterr().err
    assert main(["eval", "--file", text_file, "--config", '{"no_such_option": 1}']) == 2
    assert "no_such_option" in capsys.readouterr().err
    assert main(["eval", "--file", text_file + ".missing"]) == 2


def test_score_windows_give_each_position_its_context():
    w = evaluate.score_windows(300, 128, 64)
    assert w.positions.tolist() == list(range(1, 300))
    ctx = w.positions - w.starts
    assert ctx[:127].tolist() == list(range(1, 128))                  # the first window: all it has
    assert ctx[127:].min() >= 64 and ctx[127:].max() <= 127          # then at least context - stride
    with pytest.raises(InputError, match="at least 2"):
        evaluate.score_windows(1, 128, 64)
