"""The command line: generate with the shipped default model (subprocess, as a user runs it) and align."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hybrid_jax.cli import main


def test_generate_default_model_subprocess():
    r = subprocess.run([sys.executable, "-m", "hybrid_jax.cli", "generate", "--prompt", "Hello", "--max-tokens", "5",
                        "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "untrained" not in r.stderr.lower() and r.stdout.strip()
    assert "[5 tokens, finish_reason=length]" in r.stderr


def test_generate_with_checkpoint_tokens(tiny_checkpoint, capsys):
    assert main(["generate", "--model", tiny_checkpoint, "--tokens", "1,2,3", "--max-tokens", "4"]) == 0
    assert "[4 tokens" in capsys.readouterr().err


def test_generate_bad_input_is_an_error_not_a_traceback(tiny_checkpoint, capsys):
    assert main(["generate", "--model", tiny_checkpoint, "--tokens", "1,99999", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "outside the vocabulary" in err and "Traceback" not in err
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_align_reports_every_layer_and_agrees(tiny_checkpoint, capsys):
    assert main(["align", "--model", tiny_checkpoint, "--tokens", "1,2,3,4,5,6,7,8"]) == 0
    out = capsys.readouterr().out
    assert "layer 2 (linear_attention)" in out and "all stages agree" in out


def test_serve_prefix_caching_options_reach_the_engine_config():
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    from hybrid_jax.cli_config import _engine_config  # noqa: PLC0415
    args = build_parser().parse_args(["serve", "--enable-prefix-caching", "--prefix-block-size", "32",
                                      "--prefix-cache-bytes", "1000000", "--compilation-cache-dir", "none"])
    cfg = _engine_config(args)
    assert (cfg.enable_prefix_caching, cfg.prefix_block_size, cfg.prefix_cache_bytes) == (True, 32, 1_000_000)
    assert not _engine_config(build_parser().parse_args(["serve"])).enable_prefix_caching
    args = build_parser().parse_args(["serve", "--kv-cache-dir", "/tmp/x", "--enable-prefix-caching",
                                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    cfg = _engine_config(args)
    assert cfg.kv_cache_dir == "/tmp/x" and cfg.speculative_config["num_speculative_tokens"] == 4
    assert _engine_config(build_parser().parse_args(["serve"])).async_scheduling
    assert not _engine_config(build_parser().parse_args(["serve", "--no-async-scheduling"])).async_scheduling


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    from hybrid_jax.cli_args import build_parser  # noqa: PLC0415
    from hybrid_jax.cli_config import _api_key  # noqa: PLC0415
    from hybrid_jax.errors import HybridJaxError  # noqa: PLC0415

    def key(*argv):
        return _api_key(build_parser().parse_args(["serve", *argv]))

    monkeypatch.delenv("HYBRID_JAX_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("HYBRID_JAX_API_KEY", "from-env")
    assert key() == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert key("--api-key-file", str(f)) == "from-file"          # a file beats the environment
    assert key("--api-key", "flag") == "flag"
    with pytest.raises(HybridJaxError, match="not both"):
        key("--api-key", "flag", "--api-key-file", str(f))
    with pytest.raises(HybridJaxError, match="No such file"):
        key("--api-key-file", str(tmp_path / "missing"))
    f.write_text("\n")
    with pytest.raises(HybridJaxError, match="empty"):
        key("--api-key-file", str(f))
