"""Command line: `hybrid-jax generate | align | serve | warmup | bench | plan | eval`.

    hybrid-jax generate --prompt "And God said"          # the default model shipped in the package
    hybrid-jax generate --model PATH --prompt "Hello" --max-tokens 64 --temperature 0
    hybrid-jax align --model PATH --tokens 1,2,3
    hybrid-jax serve --model PATH --port 8000
    hybrid-jax warmup --model PATH --compilation-cache-dir DIR   # serve's programs built ahead (no server)
    hybrid-jax bench --url http://127.0.0.1:8000 --num-requests 64 --concurrency 8
    hybrid-jax plan --model qwen3_next_80b_a3b_instruct --topology v6e:2x4 --tensor-parallel-size 8
    hybrid-jax eval --file text.txt                                         # perplexity
    hybrid-jax eval --file text.txt --compare '{"enable_prefix_caching": true}'   # what an option costs
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from hybrid_jax.errors import HybridJaxError, InputError


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: the "
                   "small trained model shipped in the package)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])


def _add_parallel_args(p: argparse.ArgumentParser):
    """vLLM's layout options (hybrid_jax.parallel): devices are jax.devices()."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices the heads, MLP columns and vocabulary are split over")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas, each on its own tensor_parallel_size devices with its own weights and cache")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split MoE experts whole over the tensor-parallel devices")
    p.add_argument("--num-processes", type=int, default=None,
                   help="processes (hosts) the mesh spans, each running this command (env HYBRID_JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="this process's index (env HYBRID_JAX_PROCESS_ID)")
    p.add_argument("--coordinator-address", default=None,
                   help="HOST:PORT of process 0 (env HYBRID_JAX_COORDINATOR_ADDRESS)")


def parallel_options(args) -> dict:
    """LLM(...)'s layout keywords from parsed arguments."""
    return dict(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                enable_expert_parallel=args.enable_expert_parallel)


def _parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise HybridJaxError(f"--tokens must be comma-separated integers; got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybrid-jax", description="Serve hybrid-attention LLMs in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _align_parser(sub)
    _serve_parser(sub)
    _warmup_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    _eval_parser(sub)
    return ap


def _generate_parser(sub):
    """`generate`: one prompt through the offline engine."""
    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--tokens", help="prompt token ids, comma-separated")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    _add_parallel_args(g)


def _align_parser(sub):
    """`align`: hidden states layer by layer against transformers."""
    a = sub.add_parser("align", help="compare hidden states layer by layer with transformers")
    _add_model_args(a)
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--tokens")
    a.add_argument("--atol", type=float, default=1e-4)
    a.add_argument("--quantization", default=None, choices=["fp8"],
                   help="keep a quantized checkpoint's weights in FP8 (default: dequantized at load)")


def _serve_parser(sub):
    """`serve`: the OpenAI-compatible server, its limits, supervision and admission."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /docs and "
                   "/openapi.json (visible in ps: prefer $HYBRID_JAX_API_KEY or --api-key-file)")
    s.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--chat-template", default=None,
                   help="the chat template to serve instead of the checkpoint's: a Jinja file, or the template "
                        "text itself (default: chat_template.jinja, else tokenizer_config.json's)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat template's text sent in a request's 'chat_template' (default: only the "
                        "names of the model's own templates, as in vLLM)")
    from hybrid_jax.server.tool_parsers import REASONING_FORMATS, TOOL_FORMATS  # noqa: PLC0415
    s.add_argument("--tool-call-parser", default=None, choices=[*TOOL_FORMATS, "none"],
                   help="the tool-call format chat output is parsed with (default: the checkpoint's family's, by "
                        "its config.json model_type; none: tool calls stay text)")
    s.add_argument("--reasoning-parser", default=None, choices=[*REASONING_FORMATS, "none"],
                   help="the reasoning format split into reasoning_content (default: the family's)")
    s.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"],
                   help="prefill/decode disaggregation behind the SGLang Model Gateway's --pd-disaggregation: a "
                        "prefill server computes prompts and hands their caches over, a decode server takes them "
                        "(both with --enable-prefix-caching and the same --kv-cache-dir on shared storage)")
    s.add_argument("--disaggregation-timeout", type=float, default=60.0,
                   help="seconds a decode server waits for a request's handoff before computing its prompt itself")
    s.add_argument("--disaggregation-bootstrap-port", type=int, default=None,
                   help="the bootstrap port the gateway is given for this prefill server (reported in /server_info; "
                        "the handoff itself goes through --kv-cache-dir)")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20)
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the requests in flight get to finish (default 30)")
    s.add_argument("--timeout-header", type=float, default=10.0,
                   help="close connections whose request headers take longer (seconds)")
    s.add_argument("--timeout-body", type=float, default=30.0,
                   help="408 when a request body stops arriving for this long (seconds)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0, help="close idle keep-alive connections")
    s.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="run the engine on a thread of the server's process instead of a process of its own "
                        "(always so with several processes)")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes on the port, all feeding the one engine core (default 1)")
    s.add_argument("--core-restarts", type=int, default=3,
                   help="restarts of an engine core that died or hung, over the server's life; then the server "
                        "exits 1 for an orchestrator to replace it (default 3; 0: exit at the first death)")
    s.add_argument("--core-unresponsive-timeout", type=float, default=5.0,
                   help="seconds without an engine heartbeat before new requests and /health get 503 (default 5)")
    s.add_argument("--core-hang-timeout", type=float, default=None,
                   help="seconds without an engine heartbeat before the core is killed and restarted (default: 60 "
                        "with --warmup all, else 0: never, since a first-use compile stalls the engine for as long "
                        "as it takes)")
    s.add_argument("--metrics-require-api-key", action="store_true",
                   help="put /metrics behind the API key too")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests that may wait for an engine row (beyond the --max-num-seqs running); past it, "
                        "429 with Retry-After (default: 4 x --max-num-seqs, at least 128; 0: none wait)")
    s.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt tokens that may wait for an engine row; past it, 429 (default: --max-queued-requests "
                        "x --max-model-len / 4; a prompt is always admitted when nothing waits)")
    s.add_argument("--no-fair-admission", dest="fair_admission", action="store_false",
                   help="no per-client shares of the waiting slots (by the request's 'user', else the peer "
                        "address): first come, first served up to the bounds")
    s.add_argument("--max-header-bytes", type=int, default=64 << 10,
                   help="largest request header block; past it, 431 and the connection closed (default 65536)")
    _add_engine_args(s)
    _add_parallel_args(s)
    s.set_defaults(warmup="all")      # no request compiles on the serving path (see /health)


def _warmup_parser(sub):
    """`warmup`: serve's programs compiled into the program store, no server (hybrid_jax/prebuild.py).
    The engine flags are serve's, with serve's defaults: the same flags give the same EngineConfig,
    so the programs are the ones serve looks up."""
    w = sub.add_parser("warmup", help="compile every program `serve` would, into --compilation-cache-dir "
                       "(a container build or init container), and exit")
    _add_model_args(w)
    _add_engine_args(w)
    _add_parallel_args(w)
    w.set_defaults(warmup="all")


def _bench_parser(sub):
    """`bench`: the load generator."""
    b = sub.add_parser("bench", help="load generator: TTFT / ITL percentiles and throughput")
    _add_model_args(b)
    b.add_argument("--url", default=None, help="a running server (http://127.0.0.1:8000); default: offline engine")
    b.add_argument("--api-key", default=None)
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--prompt-len", default="32:128", help="uniform range MIN:MAX of prompt tokens")
    b.add_argument("--output-len", default="16:64", help="uniform range MIN:MAX of output tokens")
    b.add_argument("--shared-prefix", type=float, default=0.0, help="fraction of each prompt shared by all")
    b.add_argument("--seed", type=int, default=0)
    _add_engine_args(b)
    _add_parallel_args(b)


def _plan_parser(sub):
    """`plan`: per-chip HBM, capacity and roofline on a TPU topology."""
    p = sub.add_parser("plan", help="per-chip HBM, capacity and roofline on a TPU topology (TPU compiler, no TPU)")
    p.add_argument("--model", required=True, help="a config.json, a checkpoint directory, or a published config's "
                   "name (hybrid_jax/published_configs, e.g. qwen3_next_80b_a3b_instruct)")
    p.add_argument("--topology", required=True, help="TPU slice as libtpu names it, e.g. v6e:2x4, v5e:2x2, v5p:2x2x2")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="chips one replica is split over, with the engine's layout (an ideal split for a family "
                        "without sharding rules)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split routed experts whole over the chips instead of each expert's columns")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="linear weights in FP8 (block scales)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens of the compiled prefill chunk")
    p.add_argument("--layers", default="auto", choices=["auto", "full", "reduced"],
                   help="compile every layer, or one of each kind scaled by the layer counts (auto: by size)")


def _eval_parser(sub):
    """`eval`: perplexity and KL through the engine."""
    e = sub.add_parser("eval", help="perplexity of a text through the engine; --compare: KL between two configurations")
    _add_model_args(e)
    e.add_argument("--file", required=True, help="a UTF-8 text file")
    e.add_argument("--context", type=int, default=256, help="tokens of each scoring window")
    e.add_argument("--stride", type=int, default=128, help="tokens between window starts (each position is scored "
                   "with at least context - stride tokens before it)")
    e.add_argument("--max-positions", type=int, default=None, help="score only the text's first N positions")
    e.add_argument("--generate", type=int, default=32, help="greedy tokens compared after the text's start")
    e.add_argument("--config", default=None, type=_json_dict, help="configuration A: LLM options as JSON "
                   '(e.g. \'{"quantization": "fp8"}\'); default: none')
    e.add_argument("--compare", default=None, type=_json_dict, help="configuration B: report perplexity of both "
                   'and KL(A || B), e.g. \'{"enable_prefix_caching": true}\'')


def _add_engine_args(p: argparse.ArgumentParser):
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="read each step's tokens back before enqueueing the next (no overlapped stepping)")
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--warmup", default="minimal", choices=["none", "minimal", "all"],
                   help="programs compiled before serving: all = every shape (serve's default), minimal = "
                   "decode shapes, none")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache (default: a per-user cache dir; 'none' disables)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse validated cached prefixes across requests (every layer type)")
    p.add_argument("--prefix-block-size", type=int, default=64, help="tokens per cached full-KV block")
    p.add_argument("--prefix-checkpoint-interval", type=int, default=8,
                   help="keep a recurrent-state checkpoint every INTERVAL blocks (plus the last)")
    p.add_argument("--prefix-cache-bytes", type=int, default=None, help="cap on the prefix store's bytes")
    p.add_argument("--kv-cache-dir", default=None, help="on-disk prefix tier (with --enable-prefix-caching)")
    p.add_argument("--kv-cache-dir-bytes", type=int, default=8 << 30, help="cap of the on-disk prefix tier")
    p.add_argument("--prefetch-policy", default="wait", choices=["best_effort", "wait", "timeout"])
    p.add_argument("--speculative-config", default=None, type=_json_dict,
                   help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--kv-events-config", default=None, type=_json_dict,
                   help='KV-cache events for routers over ZeroMQ, vLLM\'s shape: \'{"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\' (with '
                        '--enable-prefix-caching)')


def _json_dict(text: str) -> dict:
    import json  # noqa: PLC0415
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return d


def _engine_config(args):
    from hybrid_jax.engine import EngineConfig  # noqa: PLC0415
    from hybrid_jax.engine.config import default_compilation_cache_dir  # noqa: PLC0415
    ccd = args.compilation_cache_dir
    ccd = None if ccd == "none" else (ccd or default_compilation_cache_dir())
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, decode_steps=args.decode_steps,
                        kv_cache_bytes=args.kv_cache_bytes, warmup=args.warmup, compilation_cache_dir=ccd,
                        enable_prefix_caching=args.enable_prefix_caching, prefix_block_size=args.prefix_block_size,
                        prefix_checkpoint_interval=args.prefix_checkpoint_interval,
                        prefix_cache_bytes=args.prefix_cache_bytes, kv_cache_dir=args.kv_cache_dir,
                        kv_cache_dir_bytes=args.kv_cache_dir_bytes, prefetch_policy=args.prefetch_policy,
                        speculative_config=args.speculative_config, async_scheduling=args.async_scheduling,
                        kv_events_config=args.kv_events_config)


def _disaggregation(args):
    from hybrid_jax.server.disaggregation import DisaggregationConfig  # noqa: PLC0415
    if args.disaggregation_mode != "null" and not args.enable_prefix_caching:
        raise SystemExit("--disaggregation-mode needs --enable-prefix-caching (handoffs go through the prefix "
                         "cache's disk tier)")
    try:
        return DisaggregationConfig(mode=args.disaggregation_mode, directory=args.kv_cache_dir,
                                    timeout_s=args.disaggregation_timeout,
                                    bootstrap_port=args.disaggregation_bootstrap_port)
    except InputError as e:
        raise SystemExit(str(e)) from None


def _serve(args) -> int:
    from hybrid_jax.server.app import ServerConfig  # noqa: PLC0415
    from hybrid_jax.server.main import serve  # noqa: PLC0415
    from hybrid_jax.server.worker_info import ModelIdentity  # noqa: PLC0415
    name = args.served_model_name or (args.model or "hybrid-jax-default")
    return serve(model=args.model, host=args.host, port=args.port, dtype=args.dtype,
                 engine_config=_engine_config(args), parallel=parallel_options(args),
                 server_config=ServerConfig(model_name=name, api_key=_api_key(args),
                                            max_request_bytes=args.max_request_bytes,
                                            max_tokens_limit=args.max_tokens_limit, body_timeout_s=args.timeout_body,
                                            metrics_api_key=args.metrics_require_api_key,
                                            admission=_admission(args), model_type=_model_type(args.model),
                                            identity=ModelIdentity.read(args.model, parallel_options(args)),
                                            tool_call_parser=args.tool_call_parser,
                                            reasoning_parser=args.reasoning_parser,
                                            disaggregation=_disaggregation(args)),
                 shutdown_timeout_s=args.shutdown_timeout, header_timeout_s=args.timeout_header,
                 max_header_bytes=args.max_header_bytes,
                 keep_alive_timeout_s=args.timeout_keep_alive, engine_process=args.engine_process,
                 api_server_count=args.api_server_count, supervision=_supervision(args),
                 processes=_processes(args), chat_template=args.chat_template,
                 trust_request_chat_template=args.trust_request_chat_template)


def _admission(args):
    from hybrid_jax.server.admission import AdmissionConfig  # noqa: PLC0415
    for flag in ("max_queued_requests", "max_queued_tokens"):
        v = getattr(args, flag)
        if v is not None and v < 0:
            raise HybridJaxError(f"--{flag.replace('_', '-')} must be >= 0; got {v}")
    if args.max_header_bytes < 1024:
        raise HybridJaxError(f"--max-header-bytes must be at least 1024; got {args.max_header_bytes}")
    return AdmissionConfig(max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens,
                           fair=args.fair_admission)


def _supervision(args):
    from hybrid_jax.server.supervisor import SupervisionConfig  # noqa: PLC0415
    hang = args.core_hang_timeout if args.core_hang_timeout is not None else (60.0 if args.warmup == "all" else 0.0)
    if args.core_restarts < 0:
        raise HybridJaxError("--core-restarts must be >= 0")
    if not 0 < args.core_unresponsive_timeout or hang < 0 or 0 < hang <= args.core_unresponsive_timeout:
        raise HybridJaxError("--core-unresponsive-timeout must be > 0, and --core-hang-timeout 0 (never) or longer")
    return SupervisionConfig(core_restarts=args.core_restarts, unresponsive_after_s=args.core_unresponsive_timeout,
                             hung_after_s=hang)


API_KEY_ENV = "HYBRID_JAX_API_KEY"


def _model_type(model: str | None) -> str | None:
    """The checkpoint's config.json model_type (None for the embedded default model, or none found):
    it picks the chat endpoint's tool-call and reasoning formats."""
    from hybrid_jax.server.worker_info import ModelIdentity  # noqa: PLC0415
    return ModelIdentity.read(model).model_type if model else None


def _api_key(args) -> str | None:
    """--api-key, else --api-key-file, else $HYBRID_JAX_API_KEY, else None (no key)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise HybridJaxError("give --api-key or --api-key-file, not both")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise HybridJaxError(f"--api-key-file: {e.strerror}: {args.api_key_file}") from None
    if key is None:
        key = os.environ.get(API_KEY_ENV) or None
    if key is not None and not key:
        raise HybridJaxError("the API key is empty")
    return key


def _warmup(args) -> int:
    from hybrid_jax.prebuild import format_report, prebuild  # noqa: PLC0415
    report = prebuild(args.model, args.dtype, _engine_config(args), parallel_options(args))
    print(format_report(report))
    if report.unstored:
        print(f"hybrid-jax: error: {report.unstored} programs could not be written to the program store "
              f"(see the warnings above): serve will compile them", file=sys.stderr)
        return 1
    return 0


def _bench(args) -> int:
    from hybrid_jax.bench import main as bench_main  # noqa: PLC0415
    return bench_main(args, _engine_config(args))


def _generate(args) -> int:
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    from hybrid_jax.sampling import SamplingParams  # noqa: PLC0415
    llm = LLM(model=args.model, dtype=args.dtype, **parallel_options(args))
    prompt = {"prompt_token_ids": _parse_tokens(args.tokens)} if args.tokens is not None else args.prompt
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    read = getattr(llm, "checkpoint_read", None)
    if read is not None:
        print(f"hybrid-jax: this process read {read['bytes_read'] / 2**20:.1f} MiB of the checkpoint's "
              f"{read['checkpoint_bytes'] / 2**20:.1f} MiB (its devices' slices)", file=sys.stderr)
    out = llm.generate(prompt, sp)[0].outputs[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}] token_ids={out.token_ids}",
          file=sys.stderr)
    return 0


def _align(args) -> int:
    from hybrid_jax.align import align  # noqa: PLC0415
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    llm = LLM(model=args.model, dtype="float32", quantization=args.quantization)
    if args.tokens is not None:
        ids = _parse_tokens(args.tokens)
    else:
        if llm.tokenizer is None:
            raise HybridJaxError("this checkpoint has no tokenizer: use --tokens")
        ids = llm.tokenizer.encode(args.prompt)
    report = align(llm, ids, atol=args.atol)
    print(report)
    return 0 if report.first_divergent is None else 1


def _plan(args) -> int:
    # The TPU compiler is reached through jax.experimental.topologies; no TPU is probed for, and libtpu's
    # one-process lock is not taken (nothing is shared without a TPU attached).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax  # noqa: PLC0415
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    from hybrid_jax.plan import format_plan, plan  # noqa: PLC0415
    p = plan(args.model, args.topology, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
             tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
             dtype=args.dtype, quantization=args.quantization,
             chunk=args.prefill_chunk, layers=args.layers)
    print(format_plan(p))
    if not p.fits:
        print(f"hybrid-jax: error: {p.model} does not fit {p.split} x {p.chip.name} at max_num_seqs "
              f"{p.max_num_seqs} x max_model_len {p.max_model_len}: {-p.memory.free / 2**30:.2f} GiB per chip short "
              f"(raise --tensor-parallel-size, lower --max-num-seqs / --max-model-len, or use --quantization fp8)",
              file=sys.stderr)
        return 1
    return 0


def _eval(args) -> int:
    from hybrid_jax import evaluate  # noqa: PLC0415
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise HybridJaxError(f"--file {args.file}: {e}") from None
    configs = [args.config or {}] + ([args.compare] if args.compare is not None else [])
    scored, ids = [], None
    for opts in configs:
        opts = dict(opts)
        opts.setdefault("max_model_len", max(args.context, args.context // 2 + args.generate) + 1)
        try:
            llm = LLM(model=args.model, dtype=opts.pop("dtype", args.dtype), **opts)
        except TypeError as e:
            raise HybridJaxError(f"a configuration names an option LLM() does not take: {e}") from None
        if llm.tokenizer is None:
            raise HybridJaxError("this checkpoint has no tokenizer.json: eval reads text")
        ids = llm.tokenizer.encode(text)
        scored.append(evaluate.score(llm, ids, context=args.context, stride=args.stride,
                                     max_positions=args.max_positions, generate_tokens=args.generate,
                                     keep_distributions=len(configs) > 1))
        del llm
    if len(scored) == 1:
        print(evaluate.format_score(args.file, len(ids), scored[0], args.context, args.stride))
        return 0
    labels = tuple(json.dumps(c) if c else "(default)" for c in configs)
    print(evaluate.format_comparison(args.file, len(ids), evaluate.compare(*scored), labels, args.context,
                                     args.stride))
    return 0


def _processes(args) -> int:
    from hybrid_jax.parallel import hosts  # noqa: PLC0415
    return hosts.resolve(args.coordinator_address, args.num_processes, args.process_id)[1]


def _join_processes(args):
    """Several processes: joins them (hybrid_jax.parallel.hosts) before any device is touched; only
    process 0 prints results (and serves: the others follow its engine)."""
    if not hasattr(args, "num_processes"):
        return
    from hybrid_jax.parallel import hosts  # noqa: PLC0415
    if _processes(args) > 1:
        # The runtime's C++ threads (gloo's "connected to N peer ranks" lines) write to fd 1 a piece at a
        # time, and would land inside our output: fd 1 goes to stderr, Python's stdout keeps the real one.
        sys.stdout.flush()
        real = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(real, "w", buffering=1)      # noqa: SIM115  (the process's whole life)
    if hosts.start(args.coordinator_address, args.num_processes, args.process_id) != 0:
        sys.stdout = open(os.devnull, "w")      # noqa: SIM115  (the process's whole life)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        _join_processes(args)
        return {"generate": _generate, "align": _align, "serve": _serve, "warmup": _warmup, "bench": _bench,
                "plan": _plan, "eval": _eval}[args.command](args)
    except HybridJaxError as e:
        print(f"hybrid-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
