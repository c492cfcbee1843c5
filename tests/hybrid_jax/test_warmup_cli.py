"""`hybrid-jax warmup`: serve's programs built ahead into the program store, then read back by a
separate process that builds the engine exactly as serve's engine core does; a corrupt store entry
is deleted and compiled again, never loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hybrid_jax.cli import main
from hybrid_jax.cli_args import build_parser
from hybrid_jax.cli_config import _engine_config

SMALL = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "128"]

# What serve's engine core process does with serve's flags (cli._serve -> server.main.load_engine ->
# engine.core_process.run_core): the EngineConfig from the flags, detokenize off, llm.build_engine.
SERVE_CORE = r"""
import dataclasses, json, sys
from hybrid_jax.cli_args import build_parser
from hybrid_jax.cli_config import _engine_config
from hybrid_jax.llm import build_engine
cfg = dataclasses.replace(_engine_config(build_parser().parse_args(["serve", *sys.argv[1:]])), detokenize=False)
engine = build_engine(None, "auto", cfg)
engine.wait_compiled()
c = engine.runner.compiler
print(json.dumps({"by_source": c.table.by_source(), "compile_s": c.stats.compile_s,
                  "rejected": engine.runner.store.rejected, "jax_cache_hits": c.stats.jax_cache_hits,
                  "planned": len(engine.startup.plan.ready) + len(engine.startup.plan.background)}))
"""


def _run(*argv, code=None):
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "hybrid_jax.cli", *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _programs(d: Path) -> list[Path]:
    return sorted((d / "hybrid_jax_programs").glob("*.xprog"))


def test_warmup_flags_give_serves_engine_config():
    """Same flags, same EngineConfig (so the same store keys); serve's defaults are warmup's."""
    parse = build_parser().parse_args
    flags = ["--compilation-cache-dir", "/tmp/x", "--enable-prefix-caching", "--max-num-seqs", "3",
             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    assert _engine_config(parse(["warmup", *flags])) == _engine_config(parse(["serve", *flags]))
    assert _engine_config(parse(["warmup"])) == _engine_config(parse(["serve"]))
    assert _engine_config(parse(["warmup"])).warmup == "all"


def test_warmup_then_serve_loads_every_program_and_a_corrupt_one_is_compiled(tmp_path):
    ccd = tmp_path / "cc"
    out = _run("warmup", "--compilation-cache-dir", str(ccd), *SMALL).stdout
    files = _programs(ccd)
    assert "before ready" in out and "from store" in out and len(files) > 5
    total = out.splitlines()[[ln.split()[0] for ln in out.splitlines()].index("total")].split()
    assert int(total[1]) + int(total[2]) == int(total[4]) == len(files)    # planned = compiled = stored

    served = json.loads(_run("--compilation-cache-dir", str(ccd), *SMALL, code=SERVE_CORE).stdout.splitlines()[-1])
    assert served["by_source"] == {"store": len(files)} == {"store": served["planned"]}
    assert served["compile_s"] == 0 and served["rejected"] == 0

    bad = files[len(files) // 2]
    os.truncate(bad, bad.stat().st_size // 2)                      # a torn write
    r = _run("--compilation-cache-dir", str(ccd), *SMALL, code=SERVE_CORE)
    again = json.loads(r.stdout.splitlines()[-1])
    assert "unreadable" in r.stderr and bad.name in r.stderr
    assert again["rejected"] == 1 and again["compile_s"] > 0
    assert again["by_source"] == {"store": len(files) - 1, "compiled": 1}
    # the torn entry is deleted; its program came back from JAX's compilation cache (the same directory), which
    # the store does not copy (compile.compile_fresh): the next start reads it there again, nothing rejected
    assert again["jax_cache_hits"] == 1 and not bad.exists()
    healed = json.loads(_run("--compilation-cache-dir", str(ccd), *SMALL, code=SERVE_CORE).stdout.splitlines()[-1])
    assert healed["by_source"] == {"store": len(files) - 1, "compiled": 1} and healed["rejected"] == 0


def test_warmup_errors_are_clear_exit_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["warmup", "--compilation-cache-dir", str(blocker / "cc")]) == 2
    assert "cannot write there" in capsys.readouterr().err
    assert main(["warmup", "--compilation-cache-dir", "none"]) == 2
    assert "--compilation-cache-dir" in capsys.readouterr().err
    assert main(["warmup", "--compilation-cache-dir", str(tmp_path), "--warmup", "none"]) == 2
    assert "builds nothing" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "hybrid_jax.cli", "warmup", "--max-num-seqs", "many"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-num-seqs" in r.stderr
