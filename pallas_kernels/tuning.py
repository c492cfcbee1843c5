"""Block sizes chosen by the compiler: the search behind `hybrid-jax tune`, the tables it writes, and the
chip a kernel looks its entry up for.

A tunable kernel (`TUNABLES`: name -> module) offers, for one table key (its dtypes and head shapes),
  candidates(key)          the block sizes to try, the hand-picked ones among them;
  workloads(key)           the calls a served step makes at those shapes (a long prefill chunk, short
                           prompts, a decode batch), each a `Workload`;
  hand_picked(key)         the block sizes the kernel takes without a tuned entry;
  relevant(c, w)           the part of candidate c workload w depends on (programs are compiled once per part);
  program(key, c, w)       (fn, args): the kernel at candidate c on workload w, args as ShapeDtypeStructs;
  overheads(key, c, w, grids)  (sequential steps, extra FLOPs), given the pallas_calls' grids (read from the
                           traced program): grid steps and the inner blocks each walks; work the static
                           cost estimate cannot see (keys masked in a partly filled block).

`search` compiles every (candidate, workload) for the target device and scores a candidate by its modeled
time summed over the workloads: the compiled program's roofline, max(FLOPs / peak, bytes / HBM bandwidth),
from XLA's cost analysis (the kernels' `pl.CostEstimate`s count what each block size re-reads and pads) with
the tunable's extra FLOPs, plus STEP_SECONDS for every sequential step. A candidate the compiler refuses (scoped VMEM exceeded, a
layout Mosaic cannot take) is reported and never chosen. With a TPU attached, `search(timed=True)` times
each program on it instead.

Tables are JSON, one per kernel: {"<chip>": {"<key>": {block sizes}}}. Kernels read the shipped table
(pallas_kernels/tuned/<kernel>.json) under the one in $HYBRID_JAX_TUNED_DIR, entry by entry; the chip is
the one a program is lowered for: `target_chip(name)` while compiling for a topology (the plan, the search),
else the attached TPU's generation, else none (the hand-picked table and rule apply).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import json
import os
import time

import jax

# Per sequential step of a TPU kernel: a fixed cost of the order of a Pallas TPU grid step's overhead
# (0.35 us is an assumption, not measured here); an inner block a kernel walks itself (a fori_loop over key
# blocks, its DMA waits and issues) is counted at the same cost. With a TPU attached, time instead.
STEP_SECONDS = 0.35e-6
TABLE_DIR_ENV = "HYBRID_JAX_TUNED_DIR"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
TUNABLES = {"ragged_paged_attention": "pallas_kernels.ragged_paged_attention.tune"}
# libtpu's device_kind -> the chip names of hybrid_jax.plan.chips
_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e"}

_CHIP: contextvars.ContextVar[str | None] = contextvars.ContextVar("hybrid_jax_tuning_chip", default=None)
_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("hybrid_jax_tuning_seen", default=None)


class TuningError(ValueError):
    """A tuning request that cannot be served: unknown kernel, no candidate compiles, a malformed table."""


@dataclasses.dataclass(frozen=True)
class Lookup:
    """A kernel lowered for `chip` looked up `key`: tuned (an entry was there) or not (hand-picked sizes)."""
    kernel: str
    chip: str
    key: str
    tuned: bool


@dataclasses.dataclass(frozen=True)
class Workload:
    """One call a served step makes: name, and the shapes the tunable's `program` builds it at."""
    name: str
    shape: dict


@dataclasses.dataclass(frozen=True)
class Score:
    """One candidate on one workload: the compiled program's FLOPs and HBM bytes, its sequential steps and
    modeled (or timed) seconds; error: why the compiler refused it (then seconds is inf)."""
    candidate: dict
    workload: str
    flops: float
    nbytes: float
    steps: int
    seconds: float
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """A key's search: every score, the winner and the hand-picked candidate with their summed seconds."""
    kernel: str
    chip: str
    key: str
    scores: tuple[Score, ...]
    best: dict
    best_seconds: float
    hand: dict
    hand_seconds: float
    timed: bool = False


def tunable(kernel: str):
    if kernel not in TUNABLES:
        raise TuningError(f"no tunable kernel {kernel!r}; known: {sorted(TUNABLES)}")
    return importlib.import_module(TUNABLES[kernel])


def chip_of(device) -> str | None:
    """'v6e' for a device whose device_kind is 'TPU v6 lite', None for anything not a known TPU."""
    return _KINDS.get(getattr(device, "device_kind", ""))


@contextlib.contextmanager
def target_chip(chip: str | None):
    """Kernels traced inside read their tuned entries for `chip`. A kernel passes the chip it read to its
    jitted body as a static argument, so traces made for one chip are never reused for another."""
    token = _CHIP.set(chip)
    try:
        yield
    finally:
        _CHIP.reset(token)


@contextlib.contextmanager
def recording():
    """Yields the list of `Lookup`s the kernels traced inside make (each once): what a plan says it used."""
    seen: list[Lookup] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def replay(lookups) -> None:
    """Adds lookups made earlier (by a compile whose result is reused) to the active recording."""
    seen = _SEEN.get()
    if seen is not None:
        seen.extend(x for x in lookups if x not in seen)


def current_chip() -> str | None:
    """The chip a kernel traced now is lowered for: target_chip's, else the attached TPU's, else None."""
    chip = _CHIP.get()
    if chip is not None:
        return chip
    try:
        return chip_of(jax.devices()[0]) if jax.default_backend() == "tpu" else None
    except RuntimeError:
        return None


def table_path(kernel: str, directory: str | None = None) -> str:
    return os.path.join(directory or os.environ.get(TABLE_DIR_ENV) or SHIPPED_DIR, f"{kernel}.json")


def read_table(path: str) -> dict:
    """{chip: {key: entry}} from a table file ({} when there is none); a malformed one is an error."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise TuningError(f"tuned table {path}: {e}") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise TuningError(f"tuned table {path}: expected {{chip: {{key: block sizes}}}}")
    return table


@functools.lru_cache(maxsize=64)
def _tables(kernel: str, shipped_dir: str, user_dir: str | None, shipped_stamp: tuple, user_stamp: tuple) -> dict:
    merged: dict = {}
    for path in (table_path(kernel, shipped_dir), *([table_path(kernel, user_dir)] if user_dir else [])):
        for chip, entries in read_table(path).items():
            merged.setdefault(chip, {}).update(entries)
    return merged


def _stamp(path: str) -> tuple[int, int]:
    """When and how big a table file is ((0, 0) when absent): a rewritten table is read again."""
    if not os.path.exists(path):
        return (0, 0)
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size)


def lookup(kernel: str, chip: str | None, key: str) -> dict | None:
    """The tuned entry of `kernel` for (chip, key): the user's table ($HYBRID_JAX_TUNED_DIR) over the
    shipped one; None without a chip or an entry."""
    if chip is None:
        return None
    user = os.environ.get(TABLE_DIR_ENV) or None
    tables = _tables(kernel, SHIPPED_DIR, user, _stamp(table_path(kernel, SHIPPED_DIR)),
                     _stamp(table_path(kernel, user)) if user else (0, 0))
    entry = tables.get(chip, {}).get(key)
    replay([Lookup(kernel, chip, key, entry is not None)])
    return entry


def write_entries(kernel: str, chip: str, entries: dict[str, dict], directory: str) -> str:
    """Merges {key: block sizes} for `chip` into directory/<kernel>.json (other chips and keys kept)."""
    os.makedirs(directory, exist_ok=True)
    path = table_path(kernel, directory)
    table = read_table(path)
    table.setdefault(chip, {}).update(entries)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({c: dict(sorted(e.items())) for c, e in sorted(table.items())}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def pallas_grids(fn, args) -> list[tuple[int, ...]]:
    """The grid of every pallas_call in fn's traced program, in order."""
    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(int(g) for g in eqn.params["grid_mapping"].grid))
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else (v,)):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


def _score(mod, key, cand: dict, w: Workload, device, peak_flops: float, hbm_bandwidth: float,
           timed: bool) -> Score:
    fn, args = mod.program(key, cand, w)
    sh = jax.sharding.SingleDeviceSharding(device)
    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args)
    steps, extra_flops = mod.overheads(key, cand, w, pallas_grids(fn, args))
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001  (Mosaic reports refusals as assorted errors: VMEM, layouts)
        why = " ".join(x.strip() for x in str(e).strip().splitlines()[:3] if x.strip())
        return Score(cand, w.name, 0.0, 0.0, int(steps), float("inf"), why[:300])
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    flops, nbytes = float(ca.get("flops", 0.0)) + float(extra_flops), float(ca.get("bytes accessed", 0.0))
    if timed:
        seconds = _time_on_device(compiled, args)
    else:
        seconds = max(flops / peak_flops, nbytes / hbm_bandwidth) + steps * STEP_SECONDS
    return Score(cand, w.name, flops, nbytes, int(steps), seconds)


def _time_on_device(compiled, args, repeats: int = 5) -> float:
    """Median seconds of `compiled` on the attached device, on zeros (the kernels' costs do not depend on
    values beyond the lengths, which the workloads set through their shapes)."""
    import jax.numpy as jnp  # noqa: PLC0415
    real = [jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding) for a in args]
    jax.block_until_ready(compiled(*real))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*real))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def search(kernel: str, key: str, *, chip: str, device, peak_flops: float, hbm_bandwidth: float,
           timed: bool = False, candidates: list[dict] | None = None, progress=None) -> Result:
    """Every candidate of `kernel` at `key` (or those given, the hand-picked one added) on its workloads,
    compiled for `device` (a TPU device of `chip`, from jax.experimental.topologies or attached); the winner
    minimizes the summed seconds, the hand-picked candidate winning ties. progress(score): called per program."""
    mod = tunable(kernel)
    hand = mod.hand_picked(key)
    cands = list(mod.candidates(key) if candidates is None else candidates)
    cands += [hand] if hand not in cands else []
    loads = mod.workloads(key)
    scores, total, done = [], {}, {}
    with target_chip(chip):
        for cand in cands:
            row = []
            for w in loads:
                part = (w.name, json.dumps(mod.relevant(cand, w), sort_keys=True))
                if part not in done:
                    done[part] = _score(mod, key, cand, w, device, peak_flops, hbm_bandwidth, timed)
                    if progress is not None:
                        progress(done[part])
                row.append(dataclasses.replace(done[part], candidate=cand))
            scores.extend(row)
            total[json.dumps(cand, sort_keys=True)] = sum(s.seconds for s in row)
    hand_s = total[json.dumps(hand, sort_keys=True)]
    best_k = min(total, key=lambda k: (total[k], k != json.dumps(hand, sort_keys=True)))
    if total[best_k] == float("inf"):
        raise TuningError(f"{kernel} at {key}: no candidate compiles for {chip}: "
                          + next(s.error for s in scores if s.error))
    return Result(kernel, chip, key, tuple(scores), json.loads(best_k), total[best_k], hand, hand_s, timed)


def format_result(r: Result) -> str:
    """The search's table: each candidate's seconds per workload and summed, the winner and the hand-picked
    one marked, and the winner against the hand-picked."""
    loads = list(dict.fromkeys(s.workload for s in r.scores))
    rows: dict[str, dict[str, Score]] = {}
    for s in r.scores:
        rows.setdefault(json.dumps(s.candidate, sort_keys=True), {})[s.workload] = s
    how = ("timed on the device" if r.timed else
           f"modeled: roofline of the compiled program + {STEP_SECONDS * 1e6:.2f} us a sequential step")
    lines = [f"{r.kernel} {r.key} on {r.chip}: microseconds per workload ({how})",
             f"{'candidate':<40}" + "".join(f"{w:>12}" for w in loads) + f"{'sum':>12}"]
    order = sorted(rows, key=lambda k: sum(x.seconds for x in rows[k].values()))
    for k in order:
        cand = json.loads(k)
        mark = " <- best" if cand == r.best else ""
        mark += " <- hand-picked" if cand == r.hand else ""
        cells = [rows[k][w] for w in loads]
        total = sum(x.seconds for x in cells)
        lines.append(f"{_short(cand):<40}" + "".join(f"{_us(x.seconds):>12}" for x in cells) + f"{_us(total):>12}"
                     + mark)
    errors = {s.error for s in r.scores if s.error}
    lines += [f"  refused by the compiler: {e}" for e in sorted(errors)]
    lines.append(f"best / hand-picked: {r.best_seconds / r.hand_seconds:.3f}")
    return "\n".join(lines)


def _us(seconds: float) -> str:
    return "refused" if seconds == float("inf") else f"{seconds * 1e6:.1f}"


def _short(cand: dict) -> str:
    return " ".join(f"{k.replace('num_', '').replace('_per_block', '')}={v}" for k, v in cand.items())
