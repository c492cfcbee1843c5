"""A start-up as the API server reports it: where it is (loading the weights, compiling the programs
needed before ready, serving while the rest compile, complete), how far, and how long each phase took.

`StartupStatus` is what travels: from `hybrid_jax.llm.build_engine`'s on_status callback (the core
process sends each one to the API server over its ready pipe: engine/core_process.py), then with
every heartbeat (engine/heartbeat.Beat), so /health, /metrics and the API server's log say the same.
It is built from the engine's warm-up progress (engine/startup.StartupProgress: programs done of the
ready set and of all), its compiler's figures (engine/compile.Stats: seconds lowering, compiling,
loading from the program store; stalls) and a `StartupClock` (when the phases ended).
"""
from __future__ import annotations

import dataclasses
import time

PHASES = ("loading", "compiling", "ready", "complete")


@dataclasses.dataclass
class StartupClock:
    """When a load's phases ended (time.perf_counter() of the process that loads): set by build_engine
    (`weights_loaded`, `ready`) and by the warm-up's progress (`program_built`)."""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    weights_at: float | None = None     # the weights loaded and the engine built
    ready_at: float | None = None       # the ready set built: the engine serves
    last_program_at: float | None = None

    def weights_loaded(self):
        self.weights_at = time.perf_counter()

    def ready(self):
        self.ready_at = time.perf_counter()

    def program_built(self):
        self.last_program_at = time.perf_counter()


@dataclasses.dataclass(frozen=True)
class StartupStatus:
    """phase: "loading" (the weights), "compiling" (the programs needed before ready), "ready" (serving;
    the rest compiling in the background), "complete". done / ready_total / total: programs built, of
    the ready set, of all planned (ready set and background); from_store: how many of the built ones
    came from the program store; last: the last one built. Seconds: since loading began (`seconds`),
    loading the weights and building the engine (`weights_s`), building the ready set (`ready_s`), the
    background set so far or in all (`background_s`); None until the phase began. lower_s / compile_s /
    load_s: the compiler's seconds lowering, compiling (summed over its threads) and reading programs
    from the store; stalls: steps that waited on a compile while serving."""
    phase: str = "loading"
    done: int = 0
    ready_total: int = 0
    total: int = 0
    from_store: int = 0
    last: str = ""
    seconds: float = 0.0
    weights_s: float | None = None
    ready_s: float | None = None
    background_s: float | None = None
    lower_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    stalls: int = 0

    def describe(self, seconds: float | None = None) -> str:
        """One line for the log and /health; seconds: since loading began, when the caller knows
        better than this status (which is as old as its last update)."""
        s = self.seconds if seconds is None else seconds
        store = f" ({self.from_store} from the program store)" if self.from_store else ""
        if self.phase == "loading":
            return f"loading weights ({s:.1f} s so far)"
        if self.phase == "compiling" and not self.ready_total:       # (the warm-up's plan not made yet)
            return f"weights loaded in {self.weights_s or 0.0:.1f} s, planning the warm-up ({s:.1f} s so far)"
        if self.phase == "compiling":
            last = f", last {self.last}" if self.last else ""
            return (f"compiling {min(self.done, self.ready_total)} of {self.ready_total} programs before ready"
                    f"{store}{last} ({s:.1f} s so far)")
        if self.phase == "ready":
            bg = self.total - self.ready_total
            return (f"compiling in the background: {max(self.done - self.ready_total, 0)} of {bg} programs "
                    f"({self.done} of {self.total} built{store})")
        return f"start-up complete: {self.done} programs{store}"

    def split(self) -> str:
        """Where the time to ready went: loading weights / compiling / loading programs from the store."""
        parts = [f"loading weights {self.weights_s or 0.0:.1f} s",
                 f"building {self.ready_total} programs {self.ready_s or 0.0:.1f} s (lowering {self.lower_s:.1f} s, "
                 f"XLA compiling {self.compile_s:.1f} s summed over threads, loading {self.from_store} from the "
                 f"program store {self.load_s:.1f} s)"]
        return ", ".join(parts)

    def phase_seconds(self) -> dict[str, float]:
        """The phases' seconds that have begun: loading_weights, compiling (the ready set), background."""
        out = {"loading_weights": self.weights_s if self.weights_s is not None else self.seconds}
        if self.ready_s is not None or self.phase == "compiling":
            out["compiling"] = self.ready_s if self.ready_s is not None else self.seconds - (self.weights_s or 0.0)
        if self.background_s is not None:
            out["background"] = self.background_s
        return out


def status(progresses: list, stats: list, clock: StartupClock) -> StartupStatus:
    """The status of one engine (or a data-parallel engine's replicas, summed): progresses: their
    warm-ups' StartupProgress (empty: no warm-up yet), stats: their compilers' Stats, clock: the load's."""
    now = time.perf_counter()
    if clock.weights_at is None:
        return StartupStatus(seconds=now - clock.started)
    if progresses:
        phase = min((p.phase for p in progresses), key=PHASES.index)
    else:
        phase = "complete" if clock.ready_at is not None else "compiling"
    if clock.ready_at is None and phase in ("ready", "complete"):    # (build_engine's ready comes after the
        phase = "compiling"                                           # warm-up's: the prefix store's programs)
    background = None
    if clock.ready_at is not None and phase in ("ready", "complete"):
        end = clock.last_program_at if phase == "complete" and clock.last_program_at else now
        background = max(end - clock.ready_at, 0.0)
    return StartupStatus(
        phase=phase, done=sum(p.done for p in progresses), ready_total=sum(p.ready_total for p in progresses),
        total=sum(p.total for p in progresses), from_store=sum(p.from_store for p in progresses),
        last=progresses[-1].last if progresses else "", seconds=now - clock.started,
        weights_s=clock.weights_at - clock.started,
        ready_s=None if clock.ready_at is None else clock.ready_at - clock.weights_at, background_s=background,
        lower_s=sum(s.lower_s for s in stats), compile_s=sum(s.compile_s for s in stats),
        load_s=sum(s.load_s for s in stats), stalls=sum(s.stalls for s in stats))
