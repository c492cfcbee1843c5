"""`hybrid-jax warmup`: every step program a server will run, built ahead of time into the program
store (engine/program_store.py) and JAX's compilation cache, with no server.

The engine is made exactly as `serve` makes it (the same EngineConfig from the same flags, so each
program's store key is the one serve looks up), its warm-up runs to the end (the ready set, then the
background set, nothing left to a background thread), and the programs are reported by kind: how
many the server builds before it is ready and after, and how many were read from the store or
compiled now. A container build or an init container runs it once; every `serve` sharing the
directory then loads its programs instead of compiling them.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

from hybrid_jax.errors import HybridJaxError


@dataclasses.dataclass
class KindCount:
    """One program kind's counts: in the start-up plan before ready and after, and by where the
    built programs came from."""
    before_ready: int = 0
    after_ready: int = 0
    from_store: int = 0
    compiled: int = 0


@dataclasses.dataclass
class PrebuildReport:
    """What a warm-up built: counts by kind, seconds (loading the weights, to ready, to the end; XLA
    compiling, lowering and reading the store, summed over threads), and the store's writes."""
    kinds: dict[str, KindCount]
    store_dir: str
    load_s: float
    ready_s: float
    total_s: float
    compile_s: float
    lower_s: float
    store_load_s: float
    written: int
    unstored: int       # programs of the plan neither read from the store nor written to it


def check_store_dir(compilation_cache_dir: str | None) -> str:
    """The program store's directory under compilation_cache_dir, created and proven writable (a
    file written and removed); HybridJaxError naming the problem otherwise."""
    if compilation_cache_dir is None:
        raise HybridJaxError("warmup writes programs to the compilation cache: give --compilation-cache-dir DIR "
                             "(not 'none')")
    path = os.path.join(compilation_cache_dir, "hybrid_jax_programs")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise HybridJaxError(f"--compilation-cache-dir {compilation_cache_dir}: cannot write there "
                             f"({e.strerror or e})") from None
    return path


def _engines(engine) -> list:
    """The LLMEngines of an engine core: itself, or a data-parallel engine's replicas."""
    from hybrid_jax.engine.data_parallel import DataParallelEngine  # noqa: PLC0415
    return list(engine.replicas) if isinstance(engine, DataParallelEngine) else [engine]


def _count_kinds(engines: list) -> dict[str, KindCount]:
    kinds: dict[str, KindCount] = {}
    for e in engines:
        for kind, (before, after) in e.startup.plan.by_kind().items():
            c = kinds.setdefault(kind, KindCount())
            c.before_ready += before
            c.after_ready += after
        table = e.runner.compiler.table
        for key in table.keys():
            c = kinds.setdefault(key.kind, KindCount())
            if table.get(key).source == "store":
                c.from_store += 1
            else:
                c.compiled += 1
    return kinds


def prebuild(model: str | None, dtype: str, engine_config, parallel: dict | None = None) -> PrebuildReport:
    """Loads the model, makes its engine with engine_config and builds every program of its warm-up
    into the store (engine_config.warmup: "all" for what serve builds)."""
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    if engine_config.warmup == "none":
        raise HybridJaxError("--warmup none builds nothing: use all (what serve builds) or minimal")
    store_dir = check_store_dir(engine_config.compilation_cache_dir)
    t0 = time.perf_counter()
    engine = LLM(model=model, dtype=dtype, **(parallel or {})).make_engine(engine_config)
    load_s = time.perf_counter() - t0
    engine.warmup()
    ready_s = time.perf_counter() - t0
    engines = _engines(engine)
    for e in engines:
        e.wait_compiled()
    total_s = time.perf_counter() - t0
    stats = [e.runner.compiler.stats for e in engines]
    stores = [e.runner.store for e in engines]
    planned = sum(len(e.startup.plan.ready) + len(e.startup.plan.background) for e in engines)
    report = PrebuildReport(kinds=_count_kinds(engines), store_dir=store_dir, load_s=load_s, ready_s=ready_s,
                            total_s=total_s, compile_s=sum(s.compile_s for s in stats),
                            lower_s=sum(s.lower_s for s in stats), store_load_s=sum(s.load_s for s in stats),
                            written=sum(s.writes for s in stores),
                            unstored=planned - sum(s.hits + s.writes for s in stores))
    engine.close()
    return report


def format_report(r: PrebuildReport) -> str:
    """The report as a table by kind and a line of seconds."""
    lines = [f"{'kind':<12}{'before ready':>14}{'after ready':>13}{'from store':>12}{'compiled':>10}"]
    total = KindCount()
    for kind, c in sorted(r.kinds.items()):
        lines.append(f"{kind:<12}{c.before_ready:>14}{c.after_ready:>13}{c.from_store:>12}{c.compiled:>10}")
        for f in dataclasses.fields(KindCount):
            setattr(total, f.name, getattr(total, f.name) + getattr(c, f.name))
    lines.append(f"{'total':<12}{total.before_ready:>14}{total.after_ready:>13}{total.from_store:>12}"
                 f"{total.compiled:>10}")
    lines.append(f"seconds: weights {r.load_s:.1f}, to ready {r.ready_s:.1f}, to the end {r.total_s:.1f} "
                 f"(XLA compiling {r.compile_s:.1f}, lowering {r.lower_s:.1f}, reading the store "
                 f"{r.store_load_s:.1f}; summed over threads)")
    lines.append(f"program store: {r.store_dir} ({r.written} written now)")
    return "\n".join(lines)
