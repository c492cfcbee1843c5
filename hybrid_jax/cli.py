"""Command line: `hybrid-jax generate | align`.

    hybrid-jax generate --prompt "Hello"                 # the embedded default model (untrained)
    hybrid-jax generate --model PATH --prompt "Hello" --max-tokens 64 --temperature 0
    hybrid-jax align --model PATH --tokens 1,2,3
"""
from __future__ import annotations

import argparse
import os
import sys

from hybrid_jax.errors import HybridJaxError


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: the "
                   "embedded untrained model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])


def _parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise HybridJaxError(f"--tokens must be comma-separated integers; got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybrid-jax", description="Serve hybrid-attention LLMs in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
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
    a = sub.add_parser("align", help="compare hidden states layer by layer with transformers")
    _add_model_args(a)
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--tokens")
    a.add_argument("--atol", type=float, default=1e-4)
    return ap


def _generate(args) -> int:
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    from hybrid_jax.sampling import SamplingParams  # noqa: PLC0415
    if args.model is None:
        print("hybrid-jax: using the embedded default model. It is UNTRAINED (deterministic random "
              "weights): its output is noise. Pass --model PATH for a real checkpoint.", file=sys.stderr)
    llm = LLM(model=args.model, dtype=args.dtype)
    prompt = {"prompt_token_ids": _parse_tokens(args.tokens)} if args.tokens is not None else args.prompt
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    out = llm.generate(prompt, sp)[0].outputs[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}] token_ids={out.token_ids}",
          file=sys.stderr)
    return 0


def _align(args) -> int:
    from hybrid_jax.align import align  # noqa: PLC0415
    from hybrid_jax.llm import LLM  # noqa: PLC0415
    if args.model is None:
        raise HybridJaxError("align needs --model PATH (a checkpoint transformers can also load)")
    llm = LLM(model=args.model, dtype="float32")
    if args.tokens is not None:
        ids = _parse_tokens(args.tokens)
    else:
        if llm.tokenizer is None:
            raise HybridJaxError("this checkpoint has no tokenizer: use --tokens")
        ids = llm.tokenizer.encode(args.prompt)
    report = align(llm, ids, atol=args.atol)
    print(report)
    return 0 if report.first_divergent is None else 1


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return {"generate": _generate, "align": _align}[args.command](args)
    except HybridJaxError as e:
        print(f"hybrid-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
