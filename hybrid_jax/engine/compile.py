"""Compiling the engine's steps: each step body (engine/steps.py) jitted once with its static options
and donated buffers, compiled ahead of time into the runner's `ProgramTable`, read from and written
to the program store, in parallel, the largest buckets first.

  Programs       the jitted step bodies of one `StepContext` by kind (KINDS), each behind a `Routed`
                 call: a step calls the table's compiled program for its key, never a jit dispatch
                 (on a mesh each is traced with the layout current: parallel.context.Traced)
  Compiler       lowers and compiles keys (`build`), many at once (`build_all`: lowering on the
                 calling thread, XLA compiles on a pool), or one a step needs that nothing covers
                 (`on_demand`: offline runs, warmup="none"; on a server that is a stall, counted)
  enable_persistent_compilation_cache   JAX's on-disk cache of XLA compiles (engine/program_store.py
                 is the engine's own, which also skips the tracing)

What is compiled at start-up, and in which order: engine/startup.py.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import threading
import time
from typing import Any, Callable

import jax

from cache.pools import copy_pages
from hybrid_jax.engine.fork import fork_rows
from hybrid_jax.engine.program_store import ProgramStore, signature, store_key
from hybrid_jax.engine.program_table import CompiledProgram, ProgramKey, ProgramTable
from hybrid_jax.engine.steps import (StepContext, decode_step, draft_step, loop_step, mixed_step, ragged_step,
                                     verify_step)
from hybrid_jax.engine.step_inputs import LOGPROBS_WIDTH
from hybrid_jax.logits_processors import seed_row
from hybrid_jax.parallel.context import Traced
from hybrid_jax.sampling import FULL_SAMPLER
from hybrid_jax.structured.bitmask import write_masks

log = logging.getLogger("hybrid_jax.engine")

KINDS = ("mixed", "ragged", "decode", "verify", "draft", "loop", "copy_pages", "seed", "fork_rows", "masks")

# the static options of the mixed and ragged steps every request the server takes runs with (the decode
# step's are these less prompt_n): the whole-vocabulary widths of logprobs=-1 are offline only
MIXED_STATICS = (("flags", FULL_SAMPLER), ("prompt_n", LOGPROBS_WIDTH), ("top_n", LOGPROBS_WIDTH))

# each kind's static options, and the bucket a call's arguments are padded to
STATICS = {"mixed": ("flags", "top_n", "prompt_n"), "ragged": ("flags", "top_n", "prompt_n"),
           "decode": ("steps", "flags", "top_n"), "verify": ("flags", "replay"), "draft": ("flags",), "loop": ("lc",)}
SHAPE = {
    "mixed": lambda a: a[5].shape,                                   # tokens [Bb, T]
    "ragged": lambda a: (a[3].rows.shape[0], a[5].tokens.shape[0]),  # rows [Bb], flat tokens [N]
    "decode": lambda a: a[3].rows.shape,                             # rows [Bb]
    "verify": lambda a: (a[3].shape[0], a[3].shape[1] - 1),          # tokens [Bb, K + 1]
    "draft": lambda a: (a[2].shape[0], a[2].shape[1] - 1),           # tokens [Bb, K + 1]
    "loop": lambda a: (a[2].rows.shape[0], a[3].shape[1]),           # rows [Bb], history [Bb, H]
}


def enable_persistent_compilation_cache(path: str | None):
    """Turns on JAX's persistent compilation cache (keyed by JAX on program, shapes and hardware)."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_thread = threading.local()


def _note_jax_cache_hit(event: str, **_):
    if event == _JAX_CACHE_HIT:           # reported on the thread that compiles (compiler.compile_or_get_cached)
        _thread.jax_cache_hit = True


jax.monitoring.register_event_listener(_note_jax_cache_hit)


def compile_fresh(lowered) -> tuple[Any, bool]:
    """lowered.compile(), and whether XLA compiled it (False: JAX's persistent cache gave it).

    The difference matters to the program store: an executable XLA:CPU loaded from a serialized form
    serializes again without all of its kernels, so another process that loads that copy fails at its
    first call (NOT_FOUND: "Function ... fusion not found"). Only programs XLA compiled are stored."""
    _thread.jax_cache_hit = False
    exe = lowered.compile()
    return exe, not _thread.jax_cache_hit


def cannot_run(error: Exception) -> bool:
    """Whether a runtime error is XLA:CPU's for an executable missing one of its functions ("Function
    add_select_fusion.2 not found"): raised by the call (NOT_FOUND) or, the call having been dispatched
    asynchronously, when its results are read (INTERNAL: "Error dispatching computation: ...")."""
    return re.search(r"Function \S+ not found", str(error)) is not None


def call_key(kind: str, args: tuple, kw: dict) -> tuple[ProgramKey, dict]:
    """The key of a call of `kind` and its dynamic keyword arguments (the statics taken out of kw; a
    verify's drafts given from a draft step count as a static option: another program)."""
    dyn = dict(kw)
    statics = {n: dyn.pop(n) for n in STATICS.get(kind, ()) if n in dyn}
    if kind == "verify":
        statics["given"] = dyn.get("given") is not None
        if not statics["given"]:
            dyn.pop("given", None)
    shape = SHAPE[kind](args) if kind in SHAPE else ()
    return ProgramKey.of(kind, shape, **statics), dyn


class Routed:
    """A step kind's calls routed to the compiled program of their key (`Compiler.program`); `lower`
    and the jitted function stay reachable (tests read the lowered HLO)."""

    def __init__(self, kind: str, jitted, compiler: "Compiler"):
        self.kind, self.jitted, self.compiler = kind, jitted, compiler

    def __call__(self, *args, **kw):
        key, dyn = call_key(self.kind, args, kw)
        p = self.compiler.program(key, self.jitted, args, dyn)
        try:
            return p.executable(*args, **dyn)
        except jax.errors.JaxRuntimeError as e:
            if p.source != "store" or not cannot_run(e):
                raise
            # An executable read from the store that cannot run here (XLA:CPU: a function of it missing at
            # run time): the entry goes, the program is compiled afresh, and the call runs again if its
            # (donated) arguments are intact; else the engine's step recovery retries the step with it.
            self.compiler.discard(key, self.jitted, args, dyn, e)
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves((args, dyn))):
                raise
            return self.compiler.table.get(key).executable(*args, **dyn)

    def lower(self, *args, **kw):
        return self.jitted.lower(*args, **kw)

    def _cache_size(self) -> int:
        return self.compiler.table.by_kind().get(self.kind, 0)


class Programs:
    """The step programs of `ctx`, jitted once each, the pools (and the drafter's state) donated, and
    the rows' state (`last`: last tokens and the logits processors' counts, [max_num_seqs + 1, V]) by
    the mixed, ragged, decode and seed programs, so a step updates it in place rather than copying it:

      mixed       steps.mixed_step     [Bb, T]  static flags, top_n, prompt_n
      ragged      steps.ragged_step    [Bb, N]  static flags, top_n, prompt_n
      decode      steps.decode_step    [Bb]     static steps, flags, top_n
      verify      steps.verify_step    [Bb, K]  static flags, replay (and whether its drafts are given)
      draft       steps.draft_step     [Bb, K]  static flags (a drafter on the device drafting alone)
      loop        steps.loop_step      [Bb, H]  static lc (device_loop.LoopConfig)
      copy_pages  cache.pools.copy_pages (copy-on-write of shared pages)
      seed        logits_processors.seed_row (a row's processors' state, at placement)
      fork_rows   engine.fork.fork_rows (a group's leader row copied into its members' rows)
      masks       structured.bitmask.write_masks (rows' structured-output bitmasks, before a step)

    Each attribute is a `Routed` call: the table's compiled program of the call's key."""

    def __init__(self, ctx: StepContext, compiler: "Compiler"):
        self.ctx, self.compiler = ctx, compiler
        jitted = {
            "mixed": jax.jit(mixed_step(ctx), static_argnames=STATICS["mixed"], donate_argnames=("cache", "last", "dcache")),
            "ragged": jax.jit(ragged_step(ctx), static_argnames=STATICS["ragged"], donate_argnames=("cache", "last")),
            "decode": jax.jit(decode_step(ctx), static_argnames=STATICS["decode"],
                              donate_argnames=("cache", "last", "dcache")),
            "verify": jax.jit(verify_step(ctx), static_argnames=STATICS["verify"], donate_argnames=("cache", "dcache")),
            "draft": jax.jit(draft_step(ctx), static_argnames=STATICS["draft"]),
            "loop": jax.jit(loop_step(ctx), static_argnames=STATICS["loop"], donate_argnames=("cache",)),
            "copy_pages": jax.jit(copy_pages, donate_argnames=("pools",)),
            "seed": jax.jit(seed_row, donate_argnames=("state",)),
            "fork_rows": jax.jit(fork_rows, donate_argnames=("pools",)),
            "masks": jax.jit(write_masks, donate_argnames=("state",)),
        }
        for kind, fn in jitted.items():
            if ctx.layout is not None and kind in ("mixed", "ragged", "decode", "verify", "draft", "loop"):
                fn = Traced(ctx.layout, fn)     # traced with the layout current: the per-device ops see the mesh
            setattr(self, kind, Routed(kind, fn, compiler))

    @property
    def table(self) -> ProgramTable:
        return self.compiler.table

    def compiled(self) -> dict[str, int]:
        """Programs compiled so far, by kind (one per bucket and static option)."""
        have = self.table.by_kind()
        return {kind: have.get(kind, 0) for kind in KINDS}

    def num_compiled(self) -> int:
        return len(self.table)


@dataclasses.dataclass
class Stats:
    """What the compiler did: programs by source, seconds lowering / compiling / loading (summed over
    threads), stalls (a step that waited on a compile while serving)."""
    lower_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    stalls: int = 0
    jax_cache_hits: int = 0      # compiles JAX's persistent cache answered: not written to the store


class Compiler:
    """Compiles one runner's programs into its table. context: what the step context is, for the
    store's key (program_store.store_key); store: the program store (None: none); serving: a step
    that needs an uncompiled program is a stall (logged and counted) rather than routine."""

    def __init__(self, context: dict, store: ProgramStore | None = None):
        self.context, self.store = context, store
        self.table = ProgramTable()
        self.stats = Stats()
        self.serving = False
        self._lock = threading.Lock()

    def program(self, key: ProgramKey, jitted, args, kw) -> CompiledProgram:
        p = self.table.get(key)
        if p is None:
            if self.serving:
                self.stats.stalls += 1
                log.warning("a step waits on a compile: %s (no compiled program covers it)", key.describe())
            p = self._build(key, jitted, args, kw, source="on_demand")
        return p

    def discard(self, key: ProgramKey, jitted, args, kw, error):
        """A program from the store failed to run: its entry is deleted and it is compiled again (not
        read from the store), replacing it in the table."""
        skey = self._store_key(key, args, kw)
        log.warning("program store: %s read from the store cannot run (%s); compiling it instead",
                    key.describe(), error)
        self.store.discard(skey)
        self.table.replace(key, self._compile(key, skey, *self._lower(key, jitted, args, kw), "on_demand"))

    def forget_unrunnable(self, key: ProgramKey, error: Exception) -> bool:
        """A step of key's program failed when its results were read: when that program came from the
        store and the error says a function of it is missing, its entry leaves the store and the table
        (the engine's step recovery then runs the step again, and the program is compiled afresh).
        Returns whether it did."""
        p = self.table.get(key)
        if p is None or p.source != "store" or not cannot_run(error):
            return False
        log.warning("program store: %s read from the store failed when its results were read (%s); it will be "
                    "compiled instead", key.describe(), error)
        if p.store_key is not None:
            self.store.discard(p.store_key)
        self.table.drop(key)
        return True

    def _build(self, key: ProgramKey, jitted, args, kw, source: str) -> CompiledProgram:
        """Reads key's program from the store, or lowers and compiles it (and stores it)."""
        skey = self._store_key(key, args, kw)
        p = self._from_store(skey) or self._compile(key, skey, *self._lower(key, jitted, args, kw), source)
        self.table.add(key, p)
        return p

    def _from_store(self, skey: str | None) -> CompiledProgram | None:
        if self.store is None:
            return None
        t = time.perf_counter()
        exe = self.store.load(skey)
        if exe is None:
            return None
        p = CompiledProgram(exe, "store", compile_s=time.perf_counter() - t, store_key=skey)
        self._count(p)
        return p

    def _store_key(self, key: ProgramKey, args, kw) -> str | None:
        if self.store is None:
            return None
        return store_key(self.context, {"kind": key.kind, "shape": key.shape, "statics": repr(key.statics),
                                        "signature": signature(args, kw)})

    def _lower(self, key, jitted, args, kw):
        t = time.perf_counter()
        lowered = jitted.lower(*args, **kw, **{k: v for k, v in key.statics if k != "given"})
        return lowered, time.perf_counter() - t

    def _compile(self, key, skey, lowered, lower_s, source) -> CompiledProgram:
        t = time.perf_counter()
        exe, fresh = compile_fresh(lowered)
        p = CompiledProgram(exe, source, lower_s=lower_s, compile_s=time.perf_counter() - t)
        if self.store is not None and fresh:
            self.store.save(skey, exe)
        elif not fresh:
            log.debug("%s came from JAX's compilation cache: not written to the program store (a loaded "
                      "executable does not serialize whole)", key.describe())
        self._count(p, jax_cache_hit=not fresh)
        return p

    def _count(self, p: CompiledProgram, jax_cache_hit: bool = False):
        with self._lock:
            self.stats.jax_cache_hits += jax_cache_hit
            self.stats.lower_s += p.lower_s
            if p.source == "store":
                self.stats.load_s += p.compile_s
            else:
                self.stats.compile_s += p.compile_s

    def build_all(self, jobs: list["Job"], workers: int, progress: Callable[[ProgramKey, CompiledProgram], Any],
                  stop: threading.Event | None = None):
        """Builds every job's key not in the table yet: store reads and lowering on this thread, in
        order; XLA compiles on `workers` threads (XLA releases the GIL while it compiles), so lowering
        the next program overlaps compiling the last ones. progress(key, program) after each."""
        with concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="hybrid-jax-compile") as pool:
            pending = []
            for job in jobs:
                if stop is not None and stop.is_set():
                    break
                if job.key in self.table:
                    continue
                skey = self._store_key(job.key, job.args, job.kw)
                p = self._from_store(skey)
                if p is not None:
                    self.table.add(job.key, p)
                    progress(job.key, p)
                    continue
                lowered, lower_s = self._lower(job.key, job.jitted, job.args, job.kw)
                pending.append(pool.submit(self._finish, job.key, skey, lowered, lower_s, job.source, progress))
            for f in pending:
                f.result()

    def _finish(self, key, skey, lowered, lower_s, source, progress):
        p = self._compile(key, skey, lowered, lower_s, source)
        self.table.add(key, p)
        progress(key, p)


@dataclasses.dataclass
class Job:
    """A program to build ahead of use: its key, the jitted function, example arguments (the runner's
    state as shape/dtype/sharding structs, the step inputs of padding rows) and its dynamic keywords."""
    key: ProgramKey
    jitted: Any
    args: tuple
    kw: dict
    source: str = "compiled"
