"""Start-up: which step programs exist before the engine is ready, which are compiled after, in what
order, and how far it got (what /health and the log report while it works).

Every program a step can run is one `ProgramKey` (engine/program_table.py). `plan` lists the ones
traffic can reach, by family, and splits them:

  ready       before the engine serves: for each family its largest bucket (the decode step at
              the most rows; the ragged step at the most rows and the token budget, which also
              serves every padded mixed step; each verify draft length at the most rows), and the
              fixed-width programs (seeding, bitmasks, copy-on-write, forks). Any step can run
              padded in one of them, so nothing a request does waits on a compile.
  background  the smaller buckets, compiled after ready on a thread of their own, smallest first
              (a step uses its own bucket as soon as it exists: ModelRunner.cover).

Both come from the program store when they are in it (engine/program_store.py: a restart, or a
replica sharing the directory, traces nothing), else they are lowered on the start-up's thread and
compiled by XLA on a pool of threads (`compile.Compiler.build_all`).

Warm-up modes: "none" compiles nothing (each program on first use: offline runs); "minimal" the
ready set only; "all" (the server's) the ready set, then the background set.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading

from hybrid_jax.engine.compile import MIXED_STATICS
from hybrid_jax.engine.fork import can_fork
from hybrid_jax.engine.program_jobs import job, state_structs
from hybrid_jax.engine.program_table import CompiledProgram, ProgramKey
from hybrid_jax.sampling import FULL_SAMPLER

log = logging.getLogger("hybrid_jax.engine")

FAMILY_REASONS = {
    "decode": "decode steps: one per batch bucket (rows, padded to a power of two)",
    "ragged": "mixed steps as one flat batch: one per (batch bucket, token bucket)",
    "mixed": "mixed steps padded to [rows, tokens]: one per (batch bucket, token bucket) that fits the token "
             "budget (one row, or rows of equal length; every mixed step of a ragged family also runs in the "
             "ragged program)",
    "verify": "speculative verify: one per (batch bucket, draft length); with a drafter on the device, also "
              "its drafts given (structured outputs)",
    "draft": "a drafter on the device drafting alone (a structured output's row): per (batch bucket, draft length)",
    "copy_pages": "copy-on-write of shared pages (prefix caching, forks): one, fixed width",
    "fork_rows": "a parallel-sampling group's rows forked from its leader: one, fixed width",
    "seed": "a row's logits-processor state seeded at placement: one",
    "masks": "structured-output bitmasks written before a step: one, fixed width",
}


@dataclasses.dataclass
class StartupPlan:
    """The programs to build before ready, then after (see the module's docstring)."""
    ready: list[ProgramKey]
    background: list[ProgramKey]

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (programs before ready, programs after)."""
        out: dict[str, list[int]] = {}
        for i, keys in enumerate((self.ready, self.background)):
            for k in keys:
                out.setdefault(k.kind, [0, 0])[i] += 1
        return {k: tuple(v) for k, v in out.items()}


def plan(runner, mode: str, spec=None) -> StartupPlan:
    """The start-up plan of `runner` (engine/runner.ModelRunner) for warm-up `mode`; spec: the
    engine's SpeculativeConfig (None: no speculation)."""
    if mode == "none":
        return StartupPlan([], [])
    ecfg = runner.ecfg
    bbs, tbs = runner.batch_buckets(), runner.token_buckets()
    top_b, top_t = bbs[-1], tbs[-1]
    step = dict(MIXED_STATICS)
    lp = {k: v for k, v in step.items() if k != "prompt_n"}
    ready = [ProgramKey.of("decode", (top_b,), steps=ecfg.decode_steps, **lp)]
    later = [ProgramKey.of("decode", (b,), steps=ecfg.decode_steps, **lp) for b in bbs[:-1]]
    mixed = [ProgramKey.of("mixed", (b, t), **step) for b in bbs for t in tbs if b * t <= top_t or t == tbs[0]]
    if runner.ragged and top_b > 1:
        flat = [ProgramKey.of("ragged", (b, t), **step) for b in bbs[1:] for t in tbs]
        ready.append(flat[-1])
        later += flat[:-1] + mixed
    else:
        cover = [max((k for k in mixed if k.shape[0] == top_b), key=lambda k: k.shape[1]),
                 ProgramKey.of("mixed", (1, top_t), **step)]
        ready += list(dict.fromkeys(cover))
        later += [k for k in mixed if k not in cover]
    if spec is not None:
        for K in spec.k_buckets():
            kinds = [("verify", dict(replay=spec.rollback == "replay", given=False))]
            if runner.drafter.on_device:
                kinds += [("draft", {}), ("verify", dict(replay=spec.rollback == "replay", given=True))]
            for kind, opts in kinds:
                keys = [ProgramKey.of(kind, (b, K), flags=FULL_SAMPLER, **opts) for b in bbs]
                ready.append(keys[-1])
                later += keys[:-1]
    ready += [ProgramKey.of("seed"), ProgramKey.of("masks")]
    forking = can_fork(runner)
    if runner.widths and (forking or ecfg.enable_prefix_caching):
        ready.append(ProgramKey.of("copy_pages"))
    if forking:
        ready.append(ProgramKey.of("fork_rows"))
    later.sort(key=lambda k: (k.shape[0] * (k.shape[1] if len(k.shape) > 1 else 1), k.kind))
    return StartupPlan(ready, later if mode == "all" else [])


@dataclasses.dataclass
class StartupProgress:
    """How far the start-up is: phase "loading" (weights), "compiling" (the ready set), "ready" (serving;
    the background set still compiling), "complete"; programs done of the ready set and of all, how
    many came from the program store, the last one built."""
    phase: str = "loading"
    done: int = 0
    ready_total: int = 0
    total: int = 0
    from_store: int = 0
    last: str = ""

    def describe(self) -> str:
        s = f"{self.phase}: {self.done} of {self.total} programs ({self.ready_total} before ready"
        return s + (f", {self.from_store} from the program store)" if self.from_store else ")") + \
            (f", last {self.last}" if self.last else "")



class Startup:
    """Runs a runner's plan: `ready_phase` (blocking, every CPU compiling), then `start_background`
    (one thread, `workers` compiles); `progress` is read from any thread; on_progress(progress) after
    each program (the core process forwards it to the API server)."""

    def __init__(self, runner, plan: StartupPlan, on_progress=None):
        self.runner, self.plan, self.on_progress = runner, plan, on_progress
        self.progress = StartupProgress(phase="compiling", ready_total=len(plan.ready),
                                        total=len(plan.ready) + len(plan.background))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None

    def _note(self, key: ProgramKey, p: CompiledProgram):
        pr = self.progress
        pr.done += 1
        pr.from_store += p.source == "store"
        pr.last = key.describe()
        if pr.phase == "compiling" or pr.done == pr.total or pr.done % 8 == 0:
            log.info("start-up %s (%s %.1f s)", pr.describe(), "loaded" if p.source == "store" else "compiled",
                     p.compile_s + p.lower_s)
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def ready_phase(self, workers: int | None = None):
        st = state_structs(self.runner)
        jobs = [job(self.runner, k, st) for k in self.plan.ready]
        self.runner.compiler.build_all(jobs, workers or os.cpu_count() or 1, self._note)
        self._jobs = [job(self.runner, k, st) for k in self.plan.background]   # built here: the runner's
        self.progress.phase = "ready" if self._jobs else "complete"           # state is this thread's

    def start_background(self, workers: int = 1):
        if not self._jobs:
            return
        def run():
            try:
                self.runner.compiler.build_all(self._jobs, workers, self._note, stop=self._stop)
                self.progress.phase = "complete"
                log.info("start-up %s", self.progress.describe())
            except BaseException as e:      # noqa: BLE001 -- steps still run padded in the ready set
                self.error = e
                log.exception("background compile failed; steps keep running in the larger buckets")
        self._thread = threading.Thread(target=run, name="hybrid-jax-background-compile", daemon=True)
        self._thread.start()
        atexit.register(self.stop, wait=True)   # a compile left running while the interpreter ends crashes it

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the background set is built; whether it is."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self, wait: bool = False):
        """No further background compiles (the one under way finishes: XLA cannot be interrupted);
        wait: until it has."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join()
