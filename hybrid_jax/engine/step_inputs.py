"""The host side of a step: each row's inputs, built in numpy from the scheduler's requests.

A compiled step (engine/runner.py) takes its rows padded to a batch bucket Bb. Per row: the cache
row it owns, its block tables, the tokens it holds before the step, its sampling parameters and
seed, its stop ids, and whether its last token is still on the device. What never changes for a
request (seed, sampling parameters, stop ids) is made once and kept on it (`Request.row_consts`);
the rest is filled by columns each step. A step's rows travel as one `StepRows` (a pytree: the
compiled steps take it as one argument and read its fields by name).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from hybrid_jax.engine.limits import MAX_STOP_TOKEN_IDS, row_temperature, row_top_k
from hybrid_jax.engine.request import attributed
from hybrid_jax.structured.grammars import words

LOGPROBS_WIDTH = 20      # top log-probabilities computed when any request of a step asks for them


# The fields flatten in the order the dict these rows replaced did (sorted keys; "fresh" was "mtp_fresh"),
# so every step program keeps its parameter order: XLA:CPU fuses a reordered program differently, and
# the float32 sums moved by ~1e-5 (tests/hybrid_jax/test_eval.py compares cached and uncached scores).
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("from_dev", "lengths", "fresh", "rows", "seeds", "steps", "tables", "temperature",
                                "top_k", "top_p", "procs", "masked", "logprobs"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class StepRows:
    """A step's per-row inputs, padded to the batch bucket Bb (numpy on the host, traced in a step).
    rows [Bb] int32: the cache row each owns (padding rows: the null row); tables: paged group ->
    block table [Bb, NP_g] int32; lengths [Bb] int32: tokens each row holds before the step; steps
    [Bb] int32: tokens it generated so far (the sampler's RNG index); seeds [Bb] uint32; temperature,
    top_p [Bb] f32; top_k [Bb] int32; from_dev [Bb] bool: its last token is still on the device;
    fresh [Bb] bool or None: rows whose MTP state starts over (a mixed step with the MTP drafter;
    None in every other step, so the other programs do not carry it); procs [Bb] bool: rows whose
    request has logits processors on (hybrid_jax/logits_processors.py; None: no processing); masked
    [Bb] bool: rows whose next token is held to their structured output's bitmask
    (hybrid_jax/structured/bitmask.py; None: none); logprobs [Bb] bool: rows whose request asked for
    its tokens' top log-probabilities (the sampler computes the top-n only when a row did; None:
    always)."""
    rows: Any
    tables: dict
    lengths: Any
    steps: Any
    seeds: Any
    temperature: Any
    top_k: Any
    top_p: Any
    from_dev: Any
    fresh: Any = None
    procs: Any = None
    masked: Any = None
    logprobs: Any = None

    def replace(self, **kw) -> "StepRows":
        return dataclasses.replace(self, **kw)


class StepInputs:
    """Builds the per-row inputs of a step. null_slot: the row padding rows point at; widths: the
    block-table width of each paged group; blocks: the engine's block manager (set by the engine,
    None before, when every table is -1)."""

    def __init__(self, null_slot: int, widths: dict[str, int], max_stop_ids: int, eos_ids: tuple[int, ...],
                 vocab_size: int):
        self.null_slot, self.widths, self.max_stop_ids = null_slot, widths, max_stop_ids
        self.eos_ids, self.vocab_size = tuple(eos_ids), vocab_size
        self.blocks = None
        # ids min_tokens holds back, as a static width: every stop id a request may name and the EOS ids
        self.held_width = MAX_STOP_TOKEN_IDS + len(self.eos_ids)
        self._all_allowed: dict[tuple[int, int], np.ndarray] = {}     # verify_masks' arrays, by (Bb, K)

    def rows(self, reqs, Bb: int) -> StepRows:
        """The step's per-row inputs (a StepRows), padded to the batch bucket Bb."""
        n = len(reqs)
        rows, seeds = np.full((Bb,), self.null_slot, np.int32), np.zeros((Bb,), np.uint32)
        steps, temperature = np.zeros((Bb,), np.int32), np.zeros((Bb,), np.float32)
        top_k, top_p = np.full((Bb,), -1, np.int32), np.ones((Bb,), np.float32)
        lengths, from_dev, procs = np.zeros((Bb,), np.int32), np.zeros((Bb,), bool), np.zeros((Bb,), bool)
        masked, logprobs = np.zeros((Bb,), bool), np.zeros((Bb,), bool)
        ids = [q.request_id for q in reqs] + [None] * (Bb - n)
        tables = (self.blocks.block_tables(ids, self.widths) if self.blocks is not None
                  else {g: np.full((Bb, w), -1, np.int32) for g, w in self.widths.items()})
        if n:
            consts = [self.row_consts(q) for q in reqs]
            seeds[:n], temperature[:n], top_k[:n], top_p[:n] = zip(*(c[:4] for c in consts))
            rows[:n] = [q.slot for q in reqs]
            lengths[:n] = [q.num_computed for q in reqs]
            steps[:n] = [q.num_output for q in reqs]
            from_dev[:n] = [q.num_inflight > 0 for q in reqs]      # its last token is still on the device
            procs[:n] = [q.params.processes_logits for q in reqs]
            masked[:n] = [q.masked for q in reqs]
            logprobs[:n] = [q.params.logprobs is not None for q in reqs]
        return StepRows(rows=rows, tables=tables, lengths=lengths, steps=steps, seeds=seeds,
                        temperature=temperature, top_k=top_k, top_p=top_p, from_dev=from_dev, procs=procs,
                        masked=masked, logprobs=logprobs)

    def row_consts(self, q) -> tuple:
        """A request's step inputs that never change, made once: (seed, temperature, top_k, top_p, its
        stop ids [max_stop_ids] -1 padded: stop_token_ids and, unless ignore_eos, the model's EOS)."""
        if q.row_consts is None:
            with attributed(q):
                S = self.max_stop_ids
                ids = (list(q.params.stop_token_ids) + ([] if q.params.ignore_eos else list(self.eos_ids)))[:S]
                stop = np.full((S,), -1, np.int32)
                stop[:len(ids)] = ids
                q.row_consts = (q.seed % 2**32, row_temperature(q.params.temperature),
                                row_top_k(q.params.top_k, self.vocab_size), q.params.top_p, stop)
        return q.row_consts

    def held_ids(self, params) -> np.ndarray:
        """[held_width] int32, -1 padded: the ids min_tokens masks for a request with SamplingParams
        `params`, all its stop_token_ids and, unless ignore_eos, the model's EOS (the steps' stop ids
        hold only the first max_stop_ids; the host stops at the others)."""
        ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
        held = np.full((self.held_width,), -1, np.int32)
        held[:len(ids)] = ids
        return held

    def stop_ids(self, reqs, Bb: int) -> np.ndarray:
        """[Bb, max_stop_ids] int32, -1 padded: each request's stop ids (`row_consts`)."""
        stop_ids = np.full((Bb, self.max_stop_ids), -1, np.int32)
        if reqs:
            stop_ids[:len(reqs)] = [self.row_consts(q)[4] for q in reqs]
        return stop_ids

    def verify_masks(self, Bb: int, K: int, masked: bool = False) -> np.ndarray:
        """[Bb, K+1, W] int32, every token allowed: a verify step's structured-output bitmasks (one array
        per shape, made once and read-only); masked: a fresh copy the masked rows' are filled into
        (structured/grammars.RequestGrammar.fill_along)."""
        full = self._all_allowed.get((Bb, K))
        if full is None:
            full = self._all_allowed[(Bb, K)] = np.full((Bb, K + 1, words(self.vocab_size)), -1, np.int32)
            full.flags.writeable = False
        return full.copy() if masked else full

    def top_n(self, reqs) -> int:
        """The step's static logprobs width: the vocabulary when a request asks for all of it
        (logprobs=-1: offline only, the server refuses it), else LOGPROBS_WIDTH, asked or not: whether
        any row asks is a runtime input (StepRows.logprobs), so one program serves both."""
        return self.vocab_size if any(q.params.logprobs == -1 for q in reqs) else LOGPROBS_WIDTH
