"""Compiling the engine's steps: each step body (engine/steps.py) jitted once with its static options
and donated buffers, counted, and warmed up before serving. Start-up work builds on this module.

  Programs                 the jitted programs of one `StepContext`, by kind (KINDS); on a mesh each
                           is traced with the layout current (parallel.context.Traced)
  warmup                   compiles the mixed / ragged / decode programs of every bucket a mode names
                           (`minimal` or `all`), and with `all` the copy-on-write of shared pages
  warmup_verify            compiles the verify program of every (batch bucket, draft length)
  enable_persistent_compilation_cache   JAX's on-disk cache of compiled programs (a restart with
                           the same programs, shapes and hardware reads them instead of compiling)

Warm-up calls each program with padding rows only (every row points at the null row) and numpy
inputs, as the runner's steps pass them: one dispatch-cache entry per program (so `num_compiled`
counts exactly what serving runs), and the pools come back as they were.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from cache.pools import copy_pages
from hybrid_jax.engine.fork import fork_rows, warmup_forks
from hybrid_jax.engine.step_inputs import LOGPROBS_WIDTH
from hybrid_jax.engine.steps import (StepContext, decode_step, draft_step, loop_step, mixed_step, ragged_step,
                                     verify_step)
from hybrid_jax.logits_processors import seed_row, seeds
from hybrid_jax.structured.bitmask import WRITE_WIDTH, write_masks
from hybrid_jax.structured.grammars import words
from hybrid_jax.models.ragged import pack
from hybrid_jax.parallel.context import Traced
from hybrid_jax.sampling import FULL_SAMPLER, MAX_LOGIT_BIAS, SamplingParams

KINDS = ("mixed", "ragged", "decode", "verify", "draft", "loop", "copy_pages", "seed", "fork_rows", "masks")


def enable_persistent_compilation_cache(path: str | None):
    """Turns on JAX's persistent compilation cache (keyed by JAX on program, shapes and hardware)."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Programs:
    """The step programs of `ctx`, jitted once each, the pools (and the drafter's state) donated, and
    the rows' state (`last`: last tokens and the logits processors' counts, [max_num_seqs + 1, V]) by
    the mixed, ragged, decode and seed programs, so a step updates it in place rather than copying it:

      mixed       steps.mixed_step     static flags, top_n, prompt_n
      ragged      steps.ragged_step    static flags, top_n, prompt_n
      decode      steps.decode_step    static steps, flags, top_n
      verify      steps.verify_step    static flags, replay (and whether its drafts are given)
      draft       steps.draft_step     static flags (a drafter on the device drafting alone: structured outputs)
      loop        steps.loop_step      static lc (device_loop.LoopConfig)
      copy_pages  cache.pools.copy_pages (copy-on-write of shared pages)
      seed        logits_processors.seed_row (a row's processors' state, at placement)
      fork_rows   engine.fork.fork_rows (a group's leader row copied into its members' rows)
      masks       structured.bitmask.write_masks (rows' structured-output bitmasks, before a step)
    """

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.mixed = jax.jit(mixed_step(ctx), static_argnames=("flags", "top_n", "prompt_n"),
                             donate_argnames=("cache", "last", "dcache"))
        self.ragged = jax.jit(ragged_step(ctx), static_argnames=("flags", "top_n", "prompt_n"),
                              donate_argnames=("cache", "last"))
        self.decode = jax.jit(decode_step(ctx), static_argnames=("steps", "flags", "top_n"),
                              donate_argnames=("cache", "last", "dcache"))
        self.verify = jax.jit(verify_step(ctx), static_argnames=("flags", "replay"),
                              donate_argnames=("cache", "dcache"))
        self.draft = jax.jit(draft_step(ctx), static_argnames=("flags",))
        self.loop = jax.jit(loop_step(ctx), static_argnames=("lc",), donate_argnames=("cache",))
        if ctx.layout is not None:      # traced with the layout current: the per-device ops see the mesh
            for kind in ("mixed", "ragged", "decode", "verify", "draft", "loop"):
                setattr(self, kind, Traced(ctx.layout, getattr(self, kind)))
        self.copy_pages = jax.jit(copy_pages, donate_argnames=("pools",))
        self.seed = jax.jit(seed_row, donate_argnames=("state",))
        self.fork_rows = jax.jit(fork_rows, donate_argnames=("pools",))
        self.masks = jax.jit(write_masks, donate_argnames=("state",))

    def compiled(self) -> dict[str, int]:
        """Programs compiled so far, by kind (one per bucket and static option)."""
        return {kind: getattr(self, kind)._cache_size() for kind in KINDS}

    def num_compiled(self) -> int:
        return sum(self.compiled().values())


def warmup(runner, mode: str):
    """Compiles the runner's step programs ahead of serving: `minimal` = every decode bucket and the
    mixed step at the smallest token bucket; `all` = every (batch, token) bucket, with and without
    logprobs, and (with prefix caching) the copy-on-write of shared pages: every program a step can
    run; both compile, where the engine forks (engine/fork.py), the row copy of a fork and the
    copy-on-write its members' first writes run; `none` = nothing. The pools come back untouched:
    every row points at the null row.
    runner: the engine's ModelRunner (its step programs, pools and drafter state are used and kept)."""
    if mode == "none":
        return
    ecfg = runner.ecfg
    forking = warmup_forks(runner)
    if runner.widths and (forking or (mode == "all" and ecfg.enable_prefix_caching)):
        W = ecfg.max_num_seqs
        pad = (np.full((W,), -1, np.int32), np.full((W,), -1, np.int32))
        runner.cache = runner._copy_pages(runner.cache, {n: pad for n in runner.widths})
    # the seeding program, on the null row with neutral parameters (no step reads the null row's state)
    null = seeds(runner.null_slot, [], [], SamplingParams(), runner.inputs.held_ids(SamplingParams()), MAX_LOGIT_BIAS)
    runner.slot_last = runner._seed(runner.slot_last, null[0])
    # the bitmask writer, every row padding (dropped)
    runner.slot_last = runner._masks(runner.slot_last, np.full((WRITE_WIDTH,), runner.null_slot + 1, np.int32),
                                     np.zeros((WRITE_WIDTH, words(runner.cfg.vocab_size)), np.int32))
    tbs = runner.token_buckets() if mode == "all" else runner.token_buckets()[:1]
    widths = (0, LOGPROBS_WIDTH) if mode == "all" else (0,)
    dparams = runner.drafter.params
    for Bb in runner.batch_buckets():
        r = runner.inputs.rows([], Bb)
        z = np.zeros((Bb,), bool)     # numpy, as the steps pass them: one dispatch-cache entry per program
        rm = r.replace(fresh=z) if runner.drafter.fresh_rows else r
        for top_n in widths:
            for T in tbs:
                if runner.ragged and Bb > 1:        # a step of several rows may run either way
                    _, _, runner.cache, runner.slot_last, _ = runner._ragged(
                        runner.params, runner.cache, runner.slot_last, r, z, pack([], [], T, Bb), z, flags=FULL_SAMPLER,
                        top_n=top_n, targets=np.full((T,), -1, np.int32), prompt_n=LOGPROBS_WIDTH)
                _, _, runner.cache, runner.dcache, runner.slot_last, _ = runner._mixed(
                    runner.params, runner.cache, runner.slot_last, rm, z, np.zeros((Bb, T), np.int32),
                    np.zeros((Bb,), np.int32), z, dparams, runner.dcache, flags=FULL_SAMPLER, top_n=top_n,
                    targets=np.full((Bb, T), -1, np.int32), prompt_n=LOGPROBS_WIDTH)
            _, _, runner.cache, runner.dcache, runner.slot_last = runner._decode(
                runner.params, runner.cache, runner.slot_last, r, np.zeros((Bb,), np.int32), z,
                np.full((Bb, ecfg.max_stop_ids), -1, np.int32), np.zeros((Bb,), np.int32), dparams,
                runner.dcache, steps=ecfg.decode_steps, flags=FULL_SAMPLER, top_n=top_n)
    jax.block_until_ready(runner.cache)


def warmup_verify(runner, k_buckets, replay: bool):
    """Compiles the runner's verify program for every (batch bucket, draft length) pair; every row is
    padding. With a drafter on the device also its drafts drawn alone and the verify of drafts given
    (what a structured output's row takes: ModelRunner.draft)."""
    for Bb in runner.batch_buckets():
        for K in k_buckets:
            r, tokens, meta = runner.inputs.rows([], Bb), np.zeros((Bb, K + 1), np.int32), np.zeros((2, Bb), np.int32)
            _, _, runner.cache, runner.dcache = runner._verify(
                runner.params, runner.cache, r, tokens, meta, runner.inputs.verify_masks(Bb, K), runner.drafter.params,
                runner.dcache, flags=FULL_SAMPLER, replay=replay)
            if runner.drafter.on_device:
                _, probs = runner._draft(runner.params, r, tokens, meta, runner.drafter.params, runner.dcache,
                                         flags=FULL_SAMPLER)
                _, _, runner.cache, runner.dcache = runner._verify(
                    runner.params, runner.cache, r, tokens, meta, runner.inputs.verify_masks(Bb, K),
                    runner.drafter.params, runner.dcache, flags=FULL_SAMPLER, replay=replay, given=probs)
    jax.block_until_ready(runner.cache)
