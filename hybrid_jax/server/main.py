"""`hybrid-jax serve`: start uvicorn at once, load and warm the model on a background thread;
/health turns 200 when the engine is ready; meanwhile the log and /health's 503 say how far the
load is (the weights, then N of M programs: server/startup_report.py). The engine core runs in its own process
(engine/core_process.py: the device loop alone on its thread; HTTP, tokenization and detokenization
stay here), or with `engine_process=False` (and always with several processes) on a thread of this one. A model that fails to load stops the server: the
process exits 1 with the error in its log (never a 503 forever). On SIGTERM the server drains
(lifecycle.py), then the engine and the prefix store's disk tier are shut down and it exits 0.
An engine that dies or hangs is restarted by server/supervisor.py (the core process, at most
--core-restarts times); when it cannot come back the server stops and exits 1."""
from __future__ import annotations

import dataclasses
import logging
import threading

from hybrid_jax.engine import EngineConfig, LLMEngine, cpu_affinity
from hybrid_jax.engine.async_engine import AsyncEngine
from hybrid_jax.errors import ConfigError, HybridJaxError
from hybrid_jax.server import lifecycle
from hybrid_jax.server.app import ServerConfig, ServerState, build_app
from hybrid_jax.llm import build_engine
from hybrid_jax.server.startup_report import StartupLog
from hybrid_jax.server.supervisor import EngineSupervisor, SupervisionConfig
from hybrid_jax.template_sources import ChatOptions, apply_chat_options, read_template_arg

log = logging.getLogger("hybrid_jax.server")

WARMUP_NOTES = {
    "all": "every step shape this server can be sent runs in a compiled program (the smaller buckets compile in "
           "the background meanwhile, each step padded to a compiled one)",
    "minimal": "every step shape this server can be sent runs in a compiled program (each family's largest "
               "bucket, every step padded to it)",
    "none": "nothing compiled ahead; every new shape compiles on first use, stalling the engine",
}


def ready_note(engine: LLMEngine) -> str:
    mode = engine.config.warmup
    return f"ok: warm-up {mode}: {WARMUP_NOTES[mode]} ({engine.num_compiled()} programs)"


def load_engine(state: ServerState, model: str | None, dtype: str, engine_config: EngineConfig, stop=None,
                parallel: dict | None = None, mirror=None, engine_process: bool = False, more_servers=None,
                supervision: SupervisionConfig = SupervisionConfig(), chat: ChatOptions | None = None):
    """Loads the model (parallel: LLM's layout keywords, tensor_parallel_size ...) and starts the engine
    (mirror: several processes, `parallel.hosts.Mirror`; engine_process: in a process of its own, and
    more_servers(address, authkey, info) then starts the other API server processes), under a
    supervisor (`supervision`) that stops the server (`stop`) when the engine cannot come back.
    chat: the chat options (--chat-template's text, --trust-request-chat-template)."""

    def on_fatal(reason: str):
        state.fatal_error = reason
        if stop is not None:
            stop()

    def keep(status):
        state.startup = status

    try:
        if engine_process:
            device = cpu_affinity.from_env()
            if device:     # HTTP, /metrics and detokenizing keep off the CPUs the core's runtime computes on
                cpu_affinity.keep_to(cpu_affinity.host_cpus(device))
            client = _start_core(state, model, dtype, engine_config, parallel, chat, StartupLog(keep, "engine core"))
            address, authkey, _ = client.connection

            def restart(on_spawn):
                from hybrid_jax.engine.core_process import start_core  # noqa: PLC0415
                progress = StartupLog(state.engine.note_startup, "restarted engine core")
                proc, _, _, info = start_core(model, dtype, engine_config, parallel, build=build_engine,
                                              address=address, authkey=authkey, on_spawn=on_spawn,
                                              on_progress=progress)
                return _core_client(state, model, address, authkey, info, proc, tokenizer=client.tokenizer, chat=chat)

            state.engine = EngineSupervisor(client, state.metrics, supervision, role="owner", renew=restart,
                                            on_fatal=on_fatal)
            if more_servers is not None:
                more_servers(*state.engine.connection)
            return
        device = cpu_affinity.from_env() if mirror is None else None      # (a mesh's processes keep theirs)
        if device:
            cpu_affinity.keep_to(device)          # the runtime's threads start on the device CPUs
        engine = build_engine(model, dtype, engine_config, parallel, StartupLog(keep))
        apply_chat_options(engine.loaded.tokenizer, chat)
        if device:
            cpu_affinity.split_threads(device)    # and Python's (HTTP, the step loop) move off them
        ae = AsyncEngine(engine, mirror)
        ae.start()
        state.ready_note = ready_note(engine)
        state.engine = EngineSupervisor(ae, state.metrics, supervision, on_fatal=on_fatal)
        log.info("model ready (warm-up %s, %.1f s, %d programs)", engine_config.warmup, engine.warmup_seconds,
                 engine.num_compiled())
    except Exception as e:  # noqa: BLE001  (the process exits with it)
        # (the core's own message already says "loading failed: <error>": not said twice)
        said = str(e) if isinstance(e, HybridJaxError) and str(e).startswith("loading failed") else None
        state.load_error = said or f"loading failed: {type(e).__name__}: {e}"
        log.error("%s; stopping the server", state.load_error)
        if stop is not None:
            stop()


def _start_core(state: ServerState, model, dtype, engine_config, parallel, chat=None, on_progress=None):
    from hybrid_jax.engine.core_process import start_core  # noqa: PLC0415
    proc, address, authkey, info = start_core(model, dtype, engine_config, parallel, build=build_engine,
                                              on_progress=on_progress)
    client = _core_client(state, model, address, authkey, info, proc, chat=chat)
    log.info("model ready in engine core process %d (warm-up %s, %.1f s, %d programs)", info["pid"], info["warmup"],
             info["warmup_seconds"], info["num_compiled"])
    return client


def _core_client(state: ServerState, model, address, authkey, info, proc=None, tokenizer=None, chat=None):
    """A client of the core for this API server, with the model's tokenizer loaded here (or `tokenizer`,
    the one a client of the same model loaded before), its chat templates with it and the server's chat
    options (`chat`: --chat-template, --trust-request-chat-template) set on it."""
    from hybrid_jax.engine.core_client import EngineCoreClient  # noqa: PLC0415
    from hybrid_jax.default_model import checkpoint_dir  # noqa: PLC0415
    from hybrid_jax.tokenizer import ByteTokenizer, load_tokenizer  # noqa: PLC0415
    load = {"byte": ByteTokenizer, "checkpoint": lambda: load_tokenizer(checkpoint_dir(model))}.get(info["tokenizer"],
                                                                                                  lambda: None)
    tok = tokenizer if tokenizer is not None else load()
    apply_chat_options(tok, chat)
    mode = info["warmup"]
    state.ready_note = f"ok: warm-up {mode}: {WARMUP_NOTES[mode]} ({info['num_compiled']} programs)"
    return EngineCoreClient(address, authkey, info, tok, process=proc)


def api_server(model, address, authkey, info, server_config: ServerConfig, host: str, port: int, timeouts: dict,
               supervision: SupervisionConfig = SupervisionConfig(), chat: ChatOptions | None = None):
    """Another API server process (`serve(api_server_count=N)`): the same port, the same core. It never
    restarts the core: while the core is down it answers 503 and reconnects to the same address once
    the first process has restarted it (server/supervisor.py)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s: %(message)s")
    state = ServerState(server_config)
    client = _core_client(state, model, address, authkey, info, chat=chat)
    state.engine = EngineSupervisor(client, state.metrics, supervision, role="follower",
                                    renew=lambda _: _core_client(state, model, address, authkey, info,
                                                                 tokenizer=client.tokenizer))
    lifecycle.run(build_app(state), state, host=host, port=port, sockets=[lifecycle.reuse_port_socket(host, port)],
                  **timeouts)
    state.engine.close()


def serve(*, model: str | None, host: str, port: int, dtype: str, engine_config: EngineConfig,
          server_config: ServerConfig, shutdown_timeout_s: float = 30.0, header_timeout_s: float = 10.0,
          keep_alive_timeout_s: float = 5.0, parallel: dict | None = None, processes: int = 1,
          engine_process: bool = True, api_server_count: int = 1,
          supervision: SupervisionConfig = SupervisionConfig(),
          max_header_bytes: int = lifecycle.MAX_HEADER_BYTES, chat_template: str | None = None,
          trust_request_chat_template: bool = False) -> int:
    """Runs the server; returns the process exit code (0 after a drain, 1 when the model failed to load
    or the engine died for good: `supervision` says when, see server/supervisor.py).
    With several processes (`parallel.hosts.start` first), process 0 serves and the others follow its
    engine (`parallel.hosts.follow`) until it stops; its engine then runs on a thread of process 0.
    Otherwise (engine_process) this process never touches a device: the core's process owns them, and
    api_server_count > 1 runs that many API server processes on the port (SO_REUSEPORT), all feeding
    the one core; a signal to this one drains them all. chat_template: --chat-template (a file, or the
    template text), served instead of the checkpoint's, read here before the model loads;
    trust_request_chat_template: a request may bring a template's text."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s: %(message)s")
    chat = ChatOptions(None if chat_template is None else read_template_arg(chat_template), trust_request_chat_template)
    mirror = None
    if processes > 1:
        import jax  # noqa: PLC0415

        from hybrid_jax.parallel import hosts  # noqa: PLC0415
        engine_process = False
        if engine_config.kv_cache_dir is not None:
            raise ConfigError("kv_cache_dir is not supported with several processes (its prefetch timing would "
                              "make the processes' steps differ)")
        if jax.process_index() != 0:
            log.info("process %d: following process 0's engine", jax.process_index())
            hosts.follow(build_engine(model, dtype, engine_config, parallel))
            return 0
        mirror = hosts.Mirror()
    if api_server_count > 1 and not engine_process:
        raise ConfigError("several API server processes feed an engine core in its own process: drop "
                          "--no-engine-process (and run one process of the mesh per host)")
    # each API server process takes its share of the admission bounds (server/admission.py)
    server_config = dataclasses.replace(server_config, admission=dataclasses.replace(
        server_config.admission, api_server_count=api_server_count))
    state = ServerState(server_config)
    app = build_app(state)
    timeouts = dict(shutdown_timeout_s=shutdown_timeout_s, header_timeout_s=header_timeout_s,
                    keep_alive_timeout_s=keep_alive_timeout_s, max_header_bytes=max_header_bytes)
    others: list = []

    def more_servers(address, authkey, info):
        import multiprocessing  # noqa: PLC0415
        ctx = multiprocessing.get_context("spawn")
        for _ in range(api_server_count - 1):
            p = ctx.Process(target=api_server, args=(model, address, authkey, info, server_config, host, port, timeouts,
                                                     supervision, chat),
                            name="hybrid-jax-api-server")
            p.start()
            others.append(p)

    def drain_others():
        for p in others:
            if p.is_alive():
                p.terminate()        # SIGTERM: each drains as this one does

    def start_loading(server):
        def stop():
            server.should_exit = True
        threading.Thread(target=load_engine, args=(state, model, dtype, engine_config, stop, parallel, mirror,
                                                   engine_process, more_servers if api_server_count > 1 else None,
                                                   supervision, chat),
                         daemon=True).start()

    sockets = [lifecycle.reuse_port_socket(host, port)] if api_server_count > 1 else None
    lifecycle.run(app, state, host=host, port=port, on_server=start_loading, sockets=sockets, on_drain=drain_others,
                  **timeouts)
    drain_others()
    for p in others:
        p.join(timeout=shutdown_timeout_s + 15)
    return _shut_down(state)


def _shut_down(state: ServerState) -> int:
    """After the HTTP server stopped: the engine shut down; the exit code (1 when loading or the engine failed)."""
    if state.engine is not None:
        log.info("shutting down the engine")
        state.engine.shutdown(timeout=5 if state.fatal_error else 30)   # (a wedged engine thread does not stop)
    for error in (state.load_error, state.fatal_error):
        if error is not None:
            log.error("exiting: %s", error)
            return 1
    return 0
