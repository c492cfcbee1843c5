"""Real clients against `hybrid-jax serve`: lm-eval's log-likelihood and rolling-perplexity tasks and
guidellm's default (chat) mode, with the shipped default model.

Nobody here wrote these clients; they send what they send (lm-eval: lists of token-id prompts with
`echo`, `logprobs` and `max_tokens: 1`; guidellm: chat messages with content parts, streaming,
`stream_options`). For each the script prints what came back: errors, and the figures the client
computes. Side by side, the offline engine (`LLM`, prompt log-probabilities) scores the same requests
lm-eval scored over HTTP, and the largest difference per continuation is printed: the server's `echo`
must give the engine's numbers.

Two local lm-eval tasks, built from the chapters the default model never saw (tests/data/kjv_heldout.txt):
  kjv_mc    a verse's first half, four candidate second halves (its own and three others'): accuracy
  kjv_ppl   rolling log-likelihood of whole chapters: word perplexity, bits per byte

The clients are not this project's dependencies: install them (`pip install lm-eval guidellm`, e.g. in
a virtual environment made with --system-site-packages) and pass the directory of their executables.

    python benchmarks/api_clients.py --clients /path/to/venv/bin [--mc-docs 40] [--ppl-docs 6]
        [--guidellm-requests 16]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overload import free_port, wait_ready  # noqa: E402

from hybrid_jax.default_model import DEFAULT_MODEL_DIR  # noqa: E402

HELDOUT = os.path.join(HERE, "..", "tests", "data", "kjv_heldout.txt")
MAX_MODEL_LEN = 1024
SERVED = "hybrid-jax-default"


def chapters() -> list[list[str]]:
    with open(HELDOUT, encoding="utf-8") as f:
        return [c.split("\n") for c in f.read().strip().split("\n\n")]


def write_tasks(d: str, mc_docs: int, ppl_docs: int):
    """kjv_mc and kjv_ppl as lm-eval task configs over local JSON-lines files in d."""
    rng = random.Random(0)
    verses = [v for c in chapters() for v in c if len(v.split()) >= 12]
    rng.shuffle(verses)
    halves = [(" ".join(v.split()[:len(v.split()) // 2]), " ".join(v.split()[len(v.split()) // 2:])) for v in verses]
    with open(os.path.join(d, "kjv_mc.jsonl"), "w", encoding="utf-8") as f:
        for i, (ctx, cont) in enumerate(halves[:mc_docs]):
            others = [halves[(i + k) % len(halves)][1] for k in (101, 202, 303)]
            choices = others + [cont]
            rng.shuffle(choices)
            f.write(json.dumps({"context": ctx, "choices": choices, "label": choices.index(cont)}) + "\n")
    with open(os.path.join(d, "kjv_ppl.jsonl"), "w", encoding="utf-8") as f:
        for c in chapters()[:ppl_docs]:
            f.write(json.dumps({"text": "\n".join(c[:12])}) + "\n")
    common = "dataset_path: json\ntest_split: train\n"
    with open(os.path.join(d, "kjv_mc.yaml"), "w") as f:
        f.write(f"task: kjv_mc\n{common}dataset_kwargs:\n  data_files: {d}/kjv_mc.jsonl\n"
                "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n")
    with open(os.path.join(d, "kjv_ppl.yaml"), "w") as f:
        f.write(f"task: kjv_ppl\n{common}dataset_kwargs:\n  data_files: {d}/kjv_ppl.jsonl\n"
                "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                "  - metric: bits_per_byte\n")


@contextlib.contextmanager
def server(log_path: str):
    port = free_port()
    cmd = [sys.executable, "-m", "hybrid_jax.cli", "serve", "--port", str(port), "--served-model-name", SERVED,
           "--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN), "--max-tokens-limit", "512"]
    log = open(log_path, "wb")     # noqa: SIM115  (the server's whole life)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"server ready in {wait_ready(proc, url, log_path):.0f} s (log {log_path})", flush=True)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def run(cmd: list[str], log_path: str) -> int:
    with open(log_path, "wb") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600).returncode


def lm_eval(bin_dir: str, url: str, tasks_dir: str, out_dir: str) -> dict:
    """lm-eval's local-completions client over both tasks (batches of 4 prompts per request); its
    results JSON and logged samples."""
    args = (f"model={SERVED},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={DEFAULT_MODEL_DIR},num_concurrent=1,max_retries=1,max_length={MAX_MODEL_LEN}")
    rc = run([os.path.join(bin_dir, "lm_eval"), "run", "--model", "local-completions", "--model_args", args,
              "--tasks", "kjv_mc,kjv_ppl", "--include_path", tasks_dir, "--batch_size", "4",
              "--output_path", out_dir, "--log_samples"], os.path.join(out_dir, "lm_eval.log"))
    found = {}
    for root, _, files in os.walk(out_dir):
        for name in files:
            if name.startswith("results") and name.endswith(".json"):
                found["results"] = json.load(open(os.path.join(root, name)))["results"]
            if name.startswith("samples_kjv_mc") and name.endswith(".jsonl"):
                found["mc_samples"] = [json.loads(x) for x in open(os.path.join(root, name))]
    found["rc"] = rc
    return found


def offline_mc(samples: list[dict]) -> tuple[float, float]:
    """The engine's own scores of the requests lm-eval sent: (accuracy, largest |log-likelihood
    difference| against what lm-eval got from the server)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from hybrid_jax import LLM, SamplingParams  # noqa: PLC0415
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    llm = LLM(max_model_len=MAX_MODEL_LEN)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    right, worst = 0, 0.0
    for s in samples:
        scores = []
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]   # {gen_args_i: {arg_0: ctx, arg_1: cont}}
        for (ctx, cont), served in zip(pairs, s["resps"]):
            whole, head = tok(ctx + cont)["input_ids"], tok(ctx)["input_ids"]   # lm-eval's encoding of the pair
            out = llm.generate({"prompt_token_ids": whole}, sp)[0]
            ll = sum(e["logprob"] for e in out.prompt_logprobs[len(head):])
            scores.append(ll)
            worst = max(worst, abs(ll - float(served[0][0])))
        right += int(max(range(len(scores)), key=scores.__getitem__) == int(s["target"]))
    return right / max(len(samples), 1), worst


def guidellm(bin_dir: str, url: str, out_dir: str, n: int, fmt: str, profile: str) -> dict:
    """guidellm against the server (fmt: its request format; /v1/chat/completions is its default):
    request counts and output tokens/s."""
    path = os.path.join(out_dir, f"guidellm_{fmt.strip('/').replace('/', '_')}_{profile.replace('=', '').replace(',', '_')}.json")
    rc = run([os.path.join(bin_dir, "guidellm"), "run",
              "--backend", f"kind=openai_http,target={url},model={SERVED},request_format={fmt}",
              "--tokenizer", f"kind=huggingface_auto,model={DEFAULT_MODEL_DIR}",
              "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
              "--profile", profile, "--constraint", f"kind=max_requests,count={n}",
              "--output", f"kind=json,path={path}", "--disable-console-interactive"], path + ".log")
    if rc != 0 or not os.path.exists(path):
        return {"rc": rc}
    b = json.load(open(path))["benchmarks"][0]
    m, reqs = b["metrics"], b["requests"]
    errors = sorted({str((e.get("info") or {}).get("error"))[:100] for e in reqs.get("errored", [])})
    return {"rc": rc, **m["request_totals"], "out_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "errors": errors}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=os.path.dirname(shutil.which("lm_eval") or ""),
                    help="directory holding the lm_eval and guidellm executables")
    ap.add_argument("--mc-docs", type=int, default=40)
    ap.add_argument("--ppl-docs", type=int, default=6)
    ap.add_argument("--guidellm-requests", type=int, default=16)
    args = ap.parse_args()
    for exe in ("lm_eval", "guidellm"):
        if not os.path.exists(os.path.join(args.clients, exe)):
            sys.exit(f"{exe} not found in {args.clients!r}: pip install lm-eval guidellm, then pass --clients")
    tmp = tempfile.mkdtemp(prefix="hybrid_jax_clients_")
    write_tasks(tmp, args.mc_docs, args.ppl_docs)
    with server(os.path.join(tmp, "server.log")) as url:
        lm = lm_eval(args.clients, url, tmp, tmp)
        gl = {(fmt, prof): guidellm(args.clients, url, tmp, args.guidellm_requests, fmt, prof)
              for fmt in ("/v1/chat/completions", "/v1/completions")
              for prof in ("kind=synchronous", "kind=concurrent,streams=4")}
    print(f"\nlm-eval (local-completions, batch 4; exit code {lm['rc']}, log {tmp}/lm_eval.log):")
    for task, r in lm.get("results", {}).items():
        print(f"  {task:8s} " + "  ".join(f"{k.split(',')[0]} {v:.4g}" for k, v in r.items()
                                         if isinstance(v, float) and "stderr" not in k))
    if lm.get("mc_samples"):
        acc, worst = offline_mc(lm["mc_samples"])
        print(f"  kjv_mc offline engine (prompt_logprobs, same token ids): acc {acc:.4g}; largest |server - "
              f"offline| log-likelihood of a continuation {worst:.2e}")
    print("\nguidellm (synthetic 64-token prompts, 32 output tokens):")
    print(f"  {'request format':22s} {'profile':28s} {'ok':>4s} {'errors':>6s} {'out tok/s':>9s}  first errors")
    for (fmt, prof), r in gl.items():
        if "successful" not in r:
            print(f"  {fmt:22s} {prof:28s} guidellm exited {r['rc']} (logs in {tmp})")
            continue
        print(f"  {fmt:22s} {prof:28s} {r['successful']:4d} {r['errored']:6d} {r['out_tok_s']:9.1f}  "
              f"{'; '.join(r['errors'])[:120]}")


if __name__ == "__main__":
    main()
