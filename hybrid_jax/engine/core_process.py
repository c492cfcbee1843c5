"""The engine core in its own process: the device loop with nothing else on its thread.

`hybrid-jax serve` starts it (`start_core`, a spawned child) and talks to it from the API server
process through `EngineCoreClient` (engine/core_client.py). The API servers do HTTP, JSON, chat
templates, tokenization (once, at admission) and incremental detokenization; the core only adds
and aborts requests and steps the engine (`EngineConfig.detokenize=False`: it detokenizes only the
requests whose stop strings it must check). Several API server processes can feed one core: each
connects to its address and gets the outputs of the requests it sent.

Start-up, over the pipe `start_core` reads until the core is warm (child to parent):

  ("progress", StartupStatus)     as the weights begin to load, after each program of the warm-up, and
                                  at ready (engine/startup_status.py; `start_core`'s on_progress)
  ("ready", info) | ("failed", message)   the last message: after it, the start-up's status comes
                                  with every heartbeat (Beat.startup: the background compiles)

Channel: `multiprocessing.connection` over a Unix socket (an authenticated local socket, pickled
tuples). Client to core:

  ("add", request_id, prompt_ids, SamplingParams, arrival)   arrival: time.monotonic() (one clock per host)
  ("abort", request_id)
  ("shutdown",)                   finish the current step, close the prefix store, exit

Core to client, once per engine step for the requests that client sent:

  ("out", [(request_id, new_token_ids, finished, finish_reason, new_logprobs, error, text, new_text,
            logprobs, prompt_logprobs), ...])
                                  text / new_text: "" unless the request has stop strings (the core
                                  detokenizes only those; the client all the others); prompt_logprobs:
                                  None but in a prompt_logprobs request's first output
  ("failed", request_id, message) the core refused a request (the client validated it already)

and to every client, from the step loop between steps and while idle (engine/heartbeat.py):

  Beat(seq, metrics, startup)     at most HEARTBEAT_S apart, and when the core runs out of work;
                                  metrics: the core's Prometheus text, which the API servers serve
                                  /metrics from (a scrape never reaches the core); startup: the
                                  core's StartupStatus (/health's background compiles)

A core that stops beating is wedged (the API server's supervisor marks it unresponsive, then kills
it); one whose socket closes is dead (server/supervisor.py restarts it at the same address).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from prometheus_client import CollectorRegistry, Counter, generate_latest

from hybrid_jax.engine import cpu_affinity
from hybrid_jax.engine.heartbeat import HEARTBEAT_S, BeatSchedule
from hybrid_jax.errors import HybridJaxError

log = logging.getLogger("hybrid_jax.engine")


def start_core(model: str | None, dtype: str, engine_config, parallel: dict | None = None, *, build,
               address: str | None = None, authkey: bytes | None = None, heartbeat_s: float = HEARTBEAT_S,
               on_spawn=None, on_progress=None):
    """Spawns the core for a checkpoint directory (or the embedded default model) and waits until it
    is warm. build(model, dtype, engine_config, parallel, on_status) -> the engine: the loader the child runs (a
    module-level function, so it pickles: `hybrid_jax.llm.build_engine`; the engine package does not
    import the LLM facade above it). Returns (process, address, authkey, info: the core's "ready"
    dict). Raises HybridJaxError with the core's message when loading fails.

    address, authkey: a restart passes the dead core's, so API servers reconnect where they were (a
    socket file the dead core left behind is removed first); heartbeat_s: the core's beat period;
    on_spawn(process): called once the process started, before it is warm (a supervisor that must
    be able to stop a core that is still loading); on_progress(StartupStatus): each start-up status
    the core sends before it is ready (on this thread)."""
    ctx = multiprocessing.get_context("spawn")     # a fresh interpreter: no fork of a threaded process
    if address is None:
        address = os.path.join(tempfile.mkdtemp(prefix="hybrid-jax-core-"), "core.sock")
    elif os.path.exists(address):
        os.unlink(address)
    authkey = secrets.token_bytes(32) if authkey is None else authkey
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_core, args=(build, model, dtype, engine_config, parallel, address, authkey, child,
                                              heartbeat_s),
                       name="hybrid-jax-engine-core", daemon=True)
    proc.start()
    child.close()
    if on_spawn is not None:
        on_spawn(proc)
    msg = _until_warm(parent, proc, on_progress)
    if msg[0] != "ready":
        proc.join(timeout=30)
        raise HybridJaxError(msg[1])
    return proc, address, authkey, msg[1]


def _until_warm(parent: Connection, proc, on_progress):
    """The core's last start-up message ("ready" or "failed"), its progress reports passed on before."""
    while True:
        try:
            msg = parent.recv()
        except EOFError:
            proc.join(timeout=5)
            raise HybridJaxError(f"the engine core process exited while loading (exit code {proc.exitcode})") \
                from None
        if msg[0] != "progress":
            return msg
        if on_progress is not None:
            on_progress(msg[1])


class _Reporter:
    """The child's side of the start-up reports: each StartupStatus sent over the ready pipe (from the
    warm-up's threads: one send at a time) until the core says it is ready; after that, nothing (the
    background compiles' progress goes with the heartbeats)."""

    def __init__(self, pipe: Connection):
        self.pipe, self.open = pipe, True
        self._lock = threading.Lock()

    def __call__(self, status):
        with self._lock:
            if self.open:
                self.pipe.send(("progress", status))

    def last(self, msg):
        with self._lock:
            self.open = False
            self.pipe.send(msg)
            self.pipe.close()


def run_core(build, model, dtype, engine_config, parallel, address, authkey, ready: Connection,
             heartbeat_s: float = HEARTBEAT_S):
    """The core process's body: load and warm up (`build`), then serve clients until told to shut down. With
    HYBRID_JAX_ENGINE_CPUS set, XLA's compute threads keep to those CPUs and the core's Python threads
    (its step loop) to the others (`engine/cpu_affinity.py`): the step loop never takes a cycle from
    the computation it feeds."""
    import dataclasses  # noqa: PLC0415
    try:
        device = cpu_affinity.from_env()
        if device:
            cpu_affinity.keep_to(device)          # before the runtime starts: its threads inherit it
    except (HybridJaxError, OSError, AttributeError) as e:     # (AttributeError: no affinity on this OS)
        ready.send(("failed", f"{cpu_affinity.CPUS_ENV}: {e}"))
        return

    from hybrid_jax.engine.async_engine import engine_card  # noqa: PLC0415
    from hybrid_jax.tokenizer import ByteTokenizer  # noqa: PLC0415
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s: %(message)s")
    report = _Reporter(ready)
    try:
        engine = build(model, dtype, dataclasses.replace(engine_config, detokenize=False), parallel, report)
    except Exception as e:  # noqa: BLE001  (reported to the server, which exits with it)
        report.last(("failed", f"loading failed: {type(e).__name__}: {e}"))
        return
    if device:
        try:
            cpu_affinity.split_threads(device)     # warm-up ran: the runtime's threads have all started
        except OSError as e:
            report.last(("failed", f"{cpu_affinity.CPUS_ENV}: {e}"))
            return
    tok = engine.loaded.tokenizer
    info = {**engine_card(engine),
            "tokenizer": "byte" if isinstance(tok, ByteTokenizer) else ("checkpoint" if tok is not None else None),
            "warmup": engine.config.warmup, "warmup_seconds": getattr(engine, "warmup_seconds", 0.0),
            "num_compiled": engine.num_compiled(), "pid": os.getpid(),
            "speculative": engine.config.speculative_config is not None, "startup": engine.startup_status()}
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    report.last(("ready", info))
    Core(engine, listener, heartbeat_s).run()


class Core:
    """The loop: take every waiting command, step the engine when it has work, send each client its
    requests' outputs, and beat (engine/heartbeat.py) between steps and while idle. A client that goes
    away has its requests aborted."""

    def __init__(self, engine, listener: Listener, heartbeat_s: float = HEARTBEAT_S):
        self.engine, self.listener = engine, listener
        self.clients: list[Connection] = []
        self.owner: dict[str, Connection] = {}
        self._lock = threading.Lock()
        self._stop = False
        self._beats = BeatSchedule(heartbeat_s)
        self._new_client = False         # set by the accept thread: the newcomer gets a beat at once
        self.registry = CollectorRegistry()
        self.commands = Counter("hybrid_jax_engine_core_commands", "Commands the engine core received from API "
                                "servers, by kind (a /metrics scrape sends none)", ["kind"], registry=self.registry)
        threading.Thread(target=self._accept, name="hybrid-jax-core-accept", daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn = self.listener.accept()
            except OSError:                 # closed at shutdown
                return
            except Exception:  # noqa: BLE001  (a connection that failed authentication)
                log.warning("engine core: refused a connection", exc_info=True)
                continue
            with self._lock:
                self.clients.append(conn)
                self._new_client = True

    def run(self):
        eng = self.engine
        try:
            while not self._stop:
                with self._lock:
                    clients = list(self.clients)
                busy = eng.has_unfinished()
                if clients:
                    for conn in wait(clients, timeout=0 if busy else 0.05):
                        self._receive(conn)
                elif not busy:
                    time.sleep(0.05)             # nobody connected: nothing can arrive but a client
                if self._stop:
                    break
                if not eng.has_unfinished():
                    self._beat(busy=False)
                    continue
                try:
                    outs = eng.step()
                except Exception as e:  # noqa: BLE001  (step() isolates failures itself: a last resort)
                    log.exception("engine step raised; failing every request it held and going on")
                    for rid in eng.abort_all():
                        self._send_to(self.owner.pop(rid, None), ("failed", rid, f"request {rid!r}: engine step "
                                                                   f"failed: {e}"))
                    continue
                self._beat(busy=eng.has_unfinished())    # a step that ends the work: its counts go out first
                self._deliver(outs)
                eng.flush_publishes()    # after the tokens went out: publishing never delays one
        finally:
            self.listener.close()
            eng.close()

    def _beat(self, busy: bool):
        """From the step loop only: a Beat with the metrics to every client, when one is due."""
        if not (self._beats.due(busy) or self._new_client):
            return
        self._new_client = False
        beat = self._beats.beat(self.engine.metrics.render() + generate_latest(self.registry),
                                self.engine.startup_status())
        with self._lock:
            clients = list(self.clients)
        for conn in clients:
            self._send_to(conn, beat)

    def _receive(self, conn: Connection):
        eng = self.engine
        try:
            while conn.poll():
                cmd = conn.recv()
                kind = cmd[0]
                self.commands.labels(kind=kind).inc()
                if kind == "add":
                    _, rid, ids, params, arrival = cmd
                    try:
                        eng.add_request(rid, {"prompt_token_ids": ids}, params, arrival=arrival)
                        self.owner[rid] = conn
                    except Exception as e:  # noqa: BLE001  (reported to the request's stream)
                        self._send_to(conn, ("failed", rid, str(e)))
                elif kind == "abort":
                    eng.abort_request(cmd[1])
                    self.owner.pop(cmd[1], None)
                elif kind == "shutdown":
                    self._stop = True
                    return
        except (EOFError, OSError):        # the client went away: its requests end
            with self._lock:
                if conn in self.clients:
                    self.clients.remove(conn)
            for rid in [r for r, c in self.owner.items() if c is conn]:
                eng.abort_request(rid)
                del self.owner[rid]

    def _deliver(self, outs):
        batches: dict[int, tuple[Connection, list]] = {}
        for o in outs:
            conn = self.owner.get(o.request_id)
            if o.finished:
                self.owner.pop(o.request_id, None)
            if conn is None:
                continue
            item = (o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.new_logprobs, o.error,
                    o.text, o.new_text, o.logprobs, o.prompt_logprobs)
            batches.setdefault(id(conn), (conn, []))[1].append(item)
        for conn, items in batches.values():
            self._send_to(conn, ("out", items))

    def _send_to(self, conn: Connection | None, msg):
        if conn is None:
            return
        try:
            conn.send(msg)
        except (OSError, EOFError):        # gone: `_receive` notices and aborts its requests
            pass
