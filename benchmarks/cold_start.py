"""Cold start, side by side in one run (issue 53): how long `hybrid-jax serve` takes to /health 200
cold and on a warm restart, against `hybrid-jax generate`'s first answer, and whether any request
then waits on a compile.

  generate   `hybrid-jax generate`, fresh process, no compilation cache: seconds from process start to
             its answer; and the same in one child timed in parts (imports, weights, first generate)
  serve      `hybrid-jax serve` with an empty --compilation-cache-dir to /health 200 and to the end of
             its background compiles, then restarted on the same directory (the program store); the
             ratios serve_cold / generate (goal <= 3) and serve_warm / generate (goal <= 1); programs
             by kind (before ready / after ready), and the start-up's split (weights, ready set:
             compiling vs reading the store, the rest: process start, imports, waiting), read from
             /metrics when the server has the start-up series, else from its log lines
  kinds      against the warm server, once its background compiles are complete: one request of each
             kind (benchmarks/request_kinds.py) and the compile stalls they caused (must be 0:
             hybrid_jax_compile_stalls_total, else the change of hybrid_jax_compiled_programs)
  spec       a second configuration (--enable-prefix-caching --kv-cache-dir --speculative-config
             ngram): built ahead by `hybrid-jax warmup`, served from the store, the request kinds plus
             a shared prefix and a repetitive prompt; restarted to hit the disk tier; stalls again

    python benchmarks/cold_start.py [--parts generate,serve,kinds,spec] [--model PATH]
        [--engine-args "--max-num-seqs 8 --max-num-batched-tokens 256 --max-model-len 2048"]

The engine flags default to serve's own. Nothing is shared with ~/.cache: every cache directory is
a fresh temporary one (--keep keeps them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from request_kinds import format_outcomes, run_cases  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
GENERATE_PROMPT = "And God said"
TIMED_GENERATE = r"""
import json, sys, time
t0 = time.perf_counter()
from hybrid_jax import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(model=sys.argv[1] or None)
t2 = time.perf_counter()
llm.generate(sys.argv[2], SamplingParams(max_tokens=32, temperature=0))
t3 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "weights": t2 - t1, "first generate": t3 - t2}))
"""


def child_env() -> dict:
    """The environment of every child: no inherited JAX compilation cache (each run picks its own)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_jax.cli", *argv]


# --- /metrics and the server log ---------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (and 'name' for unlabelled series)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(ms: dict[str, float], name: str, **labels) -> float | None:
    """A series' value (name with or without _total; labels matched exactly), None if absent."""
    lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for n in (name, name + "_total"):
        if n + lab in ms:
            return ms[n + lab]
    return None


@dataclasses.dataclass
class LogFigures:
    """What the serve log says (tolerant: lines this version or a later one writes)."""
    warmup_s: float | None = None        # "model ready ... (warm-up all, X s, N programs)"
    programs: int | None = None
    weights_s: float | None = None       # "weights loaded in X s"
    compiled_s: float = 0.0              # per-program "(compiled X s)" of the start-up, summed
    loaded_s: float = 0.0                # per-program "(loaded X s)": read from the program store
    complete: bool = False               # "start-up complete"
    stalls: int = 0                      # "a step waits on a compile"


def parse_log(text: str) -> LogFigures:
    f = LogFigures()
    m = re.search(r"model ready.*?\(warm-up \w+, ([\d.]+) s, (\d+) programs\)", text)
    if m:
        f.warmup_s, f.programs = float(m.group(1)), int(m.group(2))
    m = re.search(r"weights loaded in ([\d.]+) s", text)
    f.weights_s = float(m.group(1)) if m else None
    for how, s in re.findall(r"start-up .*?\((loaded|compiled) ([\d.]+) s\)", text):
        setattr(f, f"{how}_s", getattr(f, f"{how}_s") + float(s))
    f.complete = "start-up complete" in text
    f.stalls = text.count("a step waits on a compile")
    return f


# --- a server ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Start:
    """One server start: seconds from process start to /health 200 and to its background compiles'
    end (None: not waited for), what its log and /metrics said."""
    ready_s: float
    complete_s: float | None
    log: LogFigures
    metrics: dict[str, float]


class Server:
    """A `hybrid-jax serve` subprocess (log in `log_path`); `start()` waits for /health 200."""

    def __init__(self, flags: list[str], log_path: Path, limit_s: float):
        self.flags, self.log_path, self.limit_s = flags, log_path, limit_s
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def start(self, until_complete: bool) -> Start:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = open(self.log_path, "wb")      # noqa: SIM115  (the server's whole life)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cli("serve", "--port", str(port), "--tool-call-parser", "hermes", *self.flags),
                                     stdout=log, stderr=subprocess.STDOUT, env=child_env())
        self._until(lambda: self._get("/health") == 200, t0, "/health 200")
        ready_s = time.perf_counter() - t0
        complete_s = self._until(self._complete, t0, "start-up complete") if until_complete else None
        return Start(ready_s, complete_s, self.log_figures(), self.settled_metrics())

    def _until(self, cond, t0: float, what: str) -> float:
        while not cond():
            if self.proc.poll() is not None or time.perf_counter() - t0 > self.limit_s:
                raise SystemExit(f"the server did not reach {what} (log: {self.log_path})")
            time.sleep(0.25)
        return time.perf_counter() - t0

    def _get(self, path: str) -> int:
        try:
            return httpx.get(self.url + path, timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def _complete(self) -> bool:
        done = metric(self.metrics(), "hybrid_jax_startup_complete")
        return done == 1 if done is not None else self.log_figures().complete

    def metrics(self) -> dict[str, float]:
        try:
            r = httpx.get(self.url + "/metrics", timeout=10)
        except httpx.HTTPError:
            return {}
        return parse_metrics(r.text) if r.status_code == 200 else {}

    def settled_metrics(self, limit_s: float = 15.0) -> dict[str, float]:
        """/metrics once its compiled-program count reads the same three times 0.5 s apart (the core
        sends its series with its heartbeat: a scrape right after an event may predate it)."""
        seen: list[float | None] = []
        t0 = time.perf_counter()
        while True:
            ms = self.metrics()
            seen.append(metric(ms, "hybrid_jax_compiled_programs"))
            if (len(seen) >= 3 and len(set(seen[-3:])) == 1) or time.perf_counter() - t0 > limit_s:
                return ms
            time.sleep(0.5)

    def log_figures(self) -> LogFigures:
        return parse_log(self.log_path.read_text(errors="replace"))

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        r = httpx.post(self.url + path, json=body, timeout=600)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"text": r.text}

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)


def stalls(server: Server, before: dict[str, float]) -> str:
    """Compile stalls since `before` (metrics): the counter if the server has it, else the change in
    compiled programs (meaningful once the background compiles are complete), else the log's count."""
    now = server.settled_metrics()
    s0, s1 = metric(before, "hybrid_jax_compile_stalls"), metric(now, "hybrid_jax_compile_stalls")
    if s1 is not None:
        return f"hybrid_jax_compile_stalls_total {s1 - (s0 or 0):g}"
    c0, c1 = metric(before, "hybrid_jax_compiled_programs"), metric(now, "hybrid_jax_compiled_programs")
    log_n = server.log_figures().stalls
    if c0 is None or c1 is None:
        return f"no compile series in /metrics; log stall lines {log_n}"
    return (f"hybrid_jax_compiled_programs (steps + prefix store) {c0:g} -> {c1:g} (+{c1 - c0:g}); "
            f"log stall lines {log_n}")


# --- the parts ---------------------------------------------------------------------------------------

def part_generate(args) -> float:
    model = ["--model", args.model] if args.model else []
    t0 = time.perf_counter()
    r = subprocess.run(cli("generate", *model, "--prompt", GENERATE_PROMPT), capture_output=True, text=True,
                       env=child_env())
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"generate failed: {r.stderr[-2000:]}")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", TIMED_GENERATE, args.model or "", GENERATE_PROMPT], capture_output=True,
                       text=True, env=child_env(), check=True)
    split = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"generate cold: {secs:.1f} s process start to answer   (a second cold process, timed inside: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in split.items()) + f"; {time.perf_counter() - t0:.1f} s in all)")
    return secs


def plan_by_kind(flags: list[str]) -> dict[str, tuple[int, int]]:
    """The start-up plan serve makes with these flags, by kind (computed here: nothing compiled)."""
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    from hybrid_jax.cli_config import _engine_config  # noqa: PLC0415
    from hybrid_jax.engine.startup import plan  # noqa: PLC0415
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    args = build_parser().parse_args(["serve", *flags])
    cfg = dataclasses.replace(_engine_config(args), compilation_cache_dir=None)
    engine = LLM(model=args.model).make_engine(cfg)
    spec = engine.spec.spec if engine.spec is not None else None
    out = plan(engine.runner, cfg.warmup, spec).by_kind()
    engine.close()
    return out


def describe_start(name: str, st: Start) -> str:
    """The start's times and split: /metrics' start-up series when the server has them, else its log."""
    ms, lg = st.metrics, st.log
    weights = metric(ms, "hybrid_jax_startup_phase_seconds", phase="loading_weights")
    weights = weights if weights is not None else lg.weights_s
    ready_set = metric(ms, "hybrid_jax_startup_phase_seconds", phase="compiling")
    ready_set = ready_set if ready_set is not None else lg.warmup_s
    parts = [f"weights {weights:.1f} s" if weights is not None else "weights: not reported (in the rest)"]
    if ready_set is not None:
        parts.append(f"ready set {ready_set:.1f} s (per program, summed over threads: compiling {lg.compiled_s:.1f} s, "
                     f"reading the store {lg.loaded_s:.1f} s)")
        parts.append(f"the rest (process start, imports{'' if weights is not None else ', weights'}, waiting) "
                     f"{st.ready_s - ready_set - (weights or 0):.1f} s")
    src = {s: metric(ms, "hybrid_jax_compiled_programs_by_source", source=s)
           for s in ("store", "compiled", "on_demand")}
    src_note = ", ".join(f"{k} {v:g}" for k, v in src.items() if v is not None)
    complete = f"; background complete at {st.complete_s:.1f} s" if st.complete_s is not None else ""
    return (f"{name}: /health 200 at {st.ready_s:.1f} s{complete}; programs at ready {lg.programs}"
            + (f" ({src_note})" if src_note else "") + "\n    " + "; ".join(parts))


def print_kinds_table(by_kind: dict[str, tuple[int, int]]):
    print(f"  {'kind':<12}{'before ready':>14}{'after ready':>13}")
    for k, (b, a) in sorted(by_kind.items()):
        print(f"  {k:<12}{b:>14}{a:>13}")
    print(f"  {'total':<12}{sum(b for b, _ in by_kind.values()):>14}{sum(a for _, a in by_kind.values()):>13}")


def run_kinds(server: Server, budget: int, label: str, speculative: bool = False):
    before = server.settled_metrics()
    outs = run_cases(server.post, budget, speculative)
    print(f"request kinds ({label}):")
    print(format_outcomes(outs))
    print(f"  stalls: {stalls(server, before)}; {sum(o.ok for o in outs)} of {len(outs)} ok")


def part_serve(args, tmp: Path, gen_s: float | None):
    flags = args.flags + ["--compilation-cache-dir", str(tmp / "cc")]
    print("programs by kind (serve's start-up plan):")
    print_kinds_table(plan_by_kind(flags))
    cold_server = Server(flags, tmp / "serve_cold.log", args.limit)
    try:
        cold = cold_server.start(until_complete=True)
    finally:
        cold_server.stop()
    print(describe_start("serve cold", cold))
    warm_server = Server(flags, tmp / "serve_warm.log", args.limit)
    try:
        warm = warm_server.start(until_complete=True)
        print(describe_start("serve warm restart", warm))
        if gen_s:
            print(f"ratios: serve_cold / generate = {cold.ready_s / gen_s:.2f} (goal <= 3), "
                  f"serve_warm / generate = {warm.ready_s / gen_s:.2f} (goal <= 1)")
        if "kinds" in args.parts:
            run_kinds(warm_server, args.max_model_len, "warm server, start-up complete")
    finally:
        warm_server.stop()


def prefix_and_speculation(server: Server, budget: int, label: str):
    """A prompt sharing a long prefix (whole 64-token blocks, at most 512 tokens) with the one before
    (prefix hits), and a repetitive one decoded greedily (n-gram drafts); the counters they moved."""
    before = server.settled_metrics()
    prefix = [(i * 13) % 180 + 20 for i in range(min(512, max(64, (budget - 24) // 64 * 64)))]
    codes = [server.post("/v1/completions", {"prompt": prefix + tail, "max_tokens": 4})[0] for tail in ([7], [9])]
    loop = [11, 12, 13, 14] * min(24, (budget - 60) // 4)
    rep = server.post("/v1/completions", {"prompt": loop, "max_tokens": 48, "temperature": 0, "ignore_eos": True})[0]
    now = server.settled_metrics()
    hits = (metric(now, "hybrid_jax_prefix_cache_hits") or 0) - (metric(before, "hybrid_jax_prefix_cache_hits") or 0)
    acc = metric(now, "hybrid_jax_spec_decode_acceptance_rate")
    acc_note = f"{acc:.2f}" if acc is not None else "?"
    print(f"  {label}: HTTP {codes + [rep]}; prefix-cache hit tokens +{hits:g}; spec acceptance rate {acc_note}; "
          f"stalls: {stalls(server, before)}")


def part_spec(args, tmp: Path):
    cc, kv = tmp / "cc_spec", tmp / "kv"
    flags = args.flags + ["--compilation-cache-dir", str(cc), "--enable-prefix-caching", "--kv-cache-dir", str(kv),
                          "--speculative-config", json.dumps(SPEC)]
    t0 = time.perf_counter()
    r = subprocess.run(cli("warmup", *flags), capture_output=True, text=True, env=child_env())
    if r.returncode != 0:
        raise SystemExit(f"hybrid-jax warmup failed ({r.returncode}): {r.stderr[-2000:]}")
    print(f"second config: {' '.join(flags[len(args.flags):])}")
    print(f"hybrid-jax warmup: {time.perf_counter() - t0:.1f} s, exit 0")
    print("\n".join("  " + ln for ln in r.stdout.strip().splitlines()))
    for i, label in enumerate(("served from the store", "restarted (disk tier)")):
        server = Server(flags, tmp / f"serve_spec_{i}.log", args.limit)
        try:
            st = server.start(until_complete=True)
            print(describe_start(f"spec server, {label}", st))
            if i == 0 and "kinds" in args.parts:
                run_kinds(server, args.max_model_len, "prefix caching + disk tier + n-gram speculation", True)
            prefix_and_speculation(server, args.max_model_len, "shared prefix and n-gram speculation" if i == 0 else
                                   "the same prefix after a restart (RAM store empty: hits come from the disk tier)")
        finally:
            server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="generate,serve,kinds,spec",
                    help="comma-separated: generate, serve, kinds (needs serve), spec")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--engine-args", default="", help="engine flags for serve and warmup (default: serve's own)")
    ap.add_argument("--limit", type=float, default=1800, help="seconds a server may take to start")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories (logs, caches)")
    args = ap.parse_args()
    args.parts = set(args.parts.split(","))
    args.flags = (["--model", args.model] if args.model else []) + shlex.split(args.engine_args)
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    args.max_model_len = build_parser().parse_args(["serve", *args.flags]).max_model_len
    tmp = Path(tempfile.mkdtemp(prefix="hybrid_jax_cold_start_"))
    print(f"logs and caches: {tmp}")
    try:
        gen_s = part_generate(args) if "generate" in args.parts else None
        if "serve" in args.parts:
            part_serve(args, tmp, gen_s)
        if "spec" in args.parts:
            part_spec(args, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
