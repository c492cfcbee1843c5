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

This module holds the commands and `main`; their parsers are hybrid_jax/cli_args.py, and what the
parsed flags become (EngineConfig, the server's configs) is hybrid_jax/cli_config.py.
"""
from __future__ import annotations

import json
import os
import sys

from hybrid_jax.cli_args import build_parser
from hybrid_jax.cli_config import (_admission, _api_key, _disaggregation, _engine_config, _model_type, _parse_tokens,
                                   _supervision, parallel_options)
from hybrid_jax.errors import HybridJaxError


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


def _tune(args) -> int:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax  # noqa: PLC0415
    if not args.timed and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    from hybrid_jax.plan.chips import topology  # noqa: PLC0415
    from pallas_kernels import tuning  # noqa: PLC0415
    try:
        mod = tuning.tunable(args.kernel)
        topo = topology(args.topology)
        device = topo.device
        if args.timed:
            device = jax.devices()[0]
            if tuning.chip_of(device) != topo.chip.name:
                raise tuning.TuningError(f"--timed needs an attached {topo.chip.name} TPU; the first device is "
                                         f"{getattr(device, 'device_kind', device)}")
        out = args.out or os.environ.get(tuning.TABLE_DIR_ENV) or os.path.join(
            os.path.expanduser("~"), ".cache", "hybrid_jax", "tuned")
        entries = {}
        for key in args.key or mod.DEFAULT_KEYS:
            r = tuning.search(args.kernel, key, chip=topo.chip.name, device=device, timed=args.timed,
                              peak_flops=topo.chip.peak_bf16_flops, hbm_bandwidth=topo.chip.hbm_bandwidth)
            print(tuning.format_result(r), flush=True)
            entries[key] = r.best
    except tuning.TuningError as e:
        raise HybridJaxError(str(e)) from None
    path = tuning.write_entries(args.kernel, topo.chip.name, entries, out)
    print(f"wrote {len(entries)} {topo.chip.name} entries to {path}; kernels read it with {tuning.TABLE_DIR_ENV}={out}")
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
                "plan": _plan, "tune": _tune, "eval": _eval}[args.command](args)
    except HybridJaxError as e:
        print(f"hybrid-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
