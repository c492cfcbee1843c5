"""The arguments a step program is built with ahead of use (engine/startup.py): the runner's device
state as shape/dtype/sharding structs, and each kind's step inputs for padding rows only (every row
points at the null row), made by the same builders the runner's steps use (`ModelRunner._mixed_args`,
`_decode_args`, `StepInputs.rows`), so a program built ahead has exactly the signature a step calls.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.engine.compile import Job
from hybrid_jax.engine.program_table import ProgramKey
from hybrid_jax.errors import InputError
from hybrid_jax.logits_processors import seeds
from hybrid_jax.sampling import MAX_LOGIT_BIAS, SamplingParams
from hybrid_jax.structured.bitmask import WRITE_WIDTH
from hybrid_jax.structured.grammars import words


def state_structs(runner) -> dict:
    """The runner's device state as shape/dtype/sharding structs (what a program is compiled for,
    whatever the arrays' fate: steps donate them)."""
    def struct(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a
    return jax.tree.map(struct, {"params": runner.params, "cache": runner.cache, "last": runner.slot_last,
                                 "dparams": runner.drafter.params, "dcache": runner.dcache})



def job(runner, key: ProgramKey, st: dict | None = None) -> Job:
    """A program to build ahead of use: key's arguments for padding rows only (every row points at
    the null row) over the runner's state structs `st` (`state_structs`)."""
    st = st or state_structs(runner)
    P, C, L, DP, DC = st["params"], st["cache"], st["last"], st["dparams"], st["dcache"]
    kind, W = key.kind, runner.ecfg.max_num_seqs
    fn = getattr(runner._programs, kind).jitted
    if kind in ("mixed", "ragged"):
        args, kw, _ = runner._mixed_args([], key)
        args = (P, C, L, *args) + ((DP, DC) if kind == "mixed" else ())
        return Job(key, fn, args, kw)
    if kind == "decode":
        return Job(key, fn, (P, C, L, *runner._decode_args([], key.shape[0]), DP, DC), {})
    if kind in ("verify", "draft"):
        Bb, K = key.shape
        r, tokens, meta = runner.inputs.rows([], Bb), np.zeros((Bb, K + 1), np.int32), np.zeros((2, Bb), np.int32)
        if kind == "draft":
            return Job(key, fn, (P, r, tokens, meta, DP, DC), {})
        kw = {}
        if key.static_kwargs()["given"]:
            V = runner.cfg.vocab_size
            kw["given"] = jax.ShapeDtypeStruct((Bb, K, V), jnp.float32)
        return Job(key, fn, (P, C, r, tokens, meta, runner.inputs.verify_masks(Bb, K), DP, DC), kw)
    if kind == "copy_pages":
        pad = (np.full((W,), -1, np.int32), np.full((W,), -1, np.int32))
        return Job(key, fn, (C, {n: pad for n in runner.widths}), {})
    if kind == "fork_rows":
        pad = np.full((W,), -1, np.int32)
        return Job(key, fn, (C, pad, pad), {})
    if kind == "seed":
        null = seeds(runner.null_slot, [], [], SamplingParams(), runner.inputs.held_ids(SamplingParams()),
                     MAX_LOGIT_BIAS)
        return Job(key, fn, (L, null[0]), {})
    if kind == "masks":
        return Job(key, fn, (L, np.full((WRITE_WIDTH,), runner.null_slot + 1, np.int32),
                             np.zeros((WRITE_WIDTH, words(runner.cfg.vocab_size)), np.int32)), {})
    raise InputError(f"no start-up build for a {kind!r} program")
