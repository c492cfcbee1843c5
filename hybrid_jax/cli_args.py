"""The `hybrid-jax` command line's argument parsers: `build_parser` and one parser builder per command,
the argument groups several commands share (model, engine, parallel layout), and the JSON-object flag type.
What the parsed flags become (EngineConfig and the server's configs) is hybrid_jax/cli_config.py; the
commands themselves are hybrid_jax/cli.py."""
from __future__ import annotations

import argparse


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybrid-jax", description="Serve hybrid-attention LLMs in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _align_parser(sub)
    _serve_parser(sub)
    _warmup_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    _tune_parser(sub)
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


def _tune_parser(sub):
    """`tune`: Pallas kernels' block sizes searched by the TPU compiler's cost analysis."""
    t = sub.add_parser("tune", help="search a Pallas kernel's block sizes for a TPU chip by the compiler's cost "
                       "analysis (or by timing, on an attached TPU) and write the table the kernel reads")
    t.add_argument("--topology", required=True, help="a TPU slice as libtpu names it, e.g. v6e:2x2; its chip is tuned for")
    t.add_argument("--kernel", default="ragged_paged_attention", help="the kernel to tune")
    t.add_argument("--key", action="append", default=None, help="a table key of the kernel (repeatable; "
                   "ragged_paged_attention: <kv dtype>:hkv<H>:g<Hq/H>:d<D>:ps<page size>, e.g. "
                   "bfloat16:hkv2:g8:d256:ps64); default: the kernel's DEFAULT_KEYS")
    t.add_argument("--out", default=None, help="directory of the tables written (default $HYBRID_JAX_TUNED_DIR, "
                   "else ~/.cache/hybrid_jax/tuned); kernels read it when HYBRID_JAX_TUNED_DIR names it")
    t.add_argument("--timed", action="store_true", help="time each program on the attached TPU instead of modeling")


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
