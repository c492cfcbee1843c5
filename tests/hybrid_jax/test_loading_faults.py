"""Damaged checkpoints fail to load with an error naming the file or the field, never a crash, a
traceback from deep inside numpy / JAX, or a silently wrong model: a truncated model.safetensors
(the shipped default model and the fixtures' tiny checkpoint, cut at every part of the file, and a
file cut while it is being read), and config.json fields of the wrong JSON type, for every model
type the loader reads. `hybrid-jax serve` and `hybrid-jax generate` on such a checkpoint exit
non-zero with that message."""
from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from hybrid_jax import LLM, CheckpointError, ConfigError
from hybrid_jax.default_model import checkpoint_dir
from hybrid_jax.models.config_common import config_from_hf_dict

DEFAULT = os.fspath(checkpoint_dir(None))
PUBLISHED = os.path.join(os.path.dirname(DEFAULT), os.pardir, "published_configs")


@pytest.fixture(params=["default", "tiny"])
def source(request, tiny_checkpoint):
    return DEFAULT if request.param == "default" else tiny_checkpoint


def _copy(src, tmp_path) -> str:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return str(dst)


def _header_end(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


# ---- a truncated model.safetensors ---------------------------------------------------------------

@pytest.mark.parametrize("cut", ["empty", "in_length", "in_header", "at_data", "half", "last_byte"])
def test_a_truncated_weight_file_is_named_and_said_to_be_truncated(source, tmp_path, cut):
    d = _copy(source, tmp_path)
    f = os.path.join(d, "model.safetensors")
    size, header = os.path.getsize(f), _header_end(f)
    at = {"empty": 0, "in_length": 5, "in_header": header // 2, "at_data": header, "half": size // 2,
          "last_byte": size - 1}[cut]
    os.truncate(f, at)
    with pytest.raises(CheckpointError) as e:
        LLM(model=d)
    msg = str(e.value)
    assert msg.startswith(f"weight file {f} is truncated: ")          # today: "is corrupt or not safetensors"
    assert f"the file has {at} bytes" in msg
    if cut in ("at_data", "half", "last_byte"):
        assert f"{size - at} bytes missing" in msg and "tensors cut off, the first '" in msg


CUT_WHILE_READING = r"""
import os, sys
import numpy as np
from hybrid_jax.errors import CheckpointError
from hybrid_jax.weights import open_checkpoint
d = sys.argv[1]
r = open_checkpoint(d)
last = max(r.keys(), key=lambda k: r._files[r._where[k]].entries[k][3])   # the tensor stored last
os.truncate(os.path.join(d, "model.safetensors"), os.path.getsize(os.path.join(d, "model.safetensors")) // 2)
try:
    print("READ", float(np.asarray(r.get(last), np.float32).sum()))
except CheckpointError as e:
    print("ERROR", e)
"""


def test_a_weight_file_cut_while_it_is_read_is_an_error_not_a_crash(tiny_checkpoint, tmp_path):
    """Reading a page of a memory map past its file's end kills the process (SIGBUS): a file that
    shrank since it was opened is refused before its data is touched."""
    d = _copy(tiny_checkpoint, tmp_path)
    out = subprocess.run([sys.executable, "-c", CUT_WHILE_READING, d], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])     # today: -7 (SIGBUS)
    assert out.stdout.startswith(f"ERROR weight file {d}/model.safetensors was truncated while loading"), out.stdout


# ---- config.json fields of the wrong type --------------------------------------------------------

def _with(src, tmp_path, **fields) -> str:
    d = _copy(src, tmp_path)
    p = os.path.join(d, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(p, "w") as f:
        json.dump(cfg, f)
    return d


@pytest.mark.parametrize("field, value, what", [
    ("hidden_size", "64", 'must be a non-negative integer; got "64" (a string)'),
    ("num_hidden_layers", 4.5, "must be a non-negative integer; got 4.5 (a number)"),
    ("layer_types", "full_attention", 'must be a list of strings; got "full_attention" (a string)'),
    ("num_attention_heads", [4], "must be a non-negative integer; got [4] (a list)"),
    ("head_dim", 16.5, "must be a non-negative integer; got 16.5 (a number)"),
    ("tie_word_embeddings", "false", 'must be true or false; got "false" (a string)'),
    ("rms_norm_eps", "1e-6", 'must be a number; got "1e-6" (a string)'),
    ("eos_token_id", "10", 'must be an integer or a list of integers (token ids); got "10" (a string)'),
    ("mlp_only_layers", 1, "must be a list of non-negative integers; got 1 (an integer)"),
    ("num_experts", True, "must be a non-negative integer; got true (a boolean)"),
    ("linear_conv_kernel_dim", -1, "must be a non-negative integer; got -1 (an integer)"),
    ("rope_parameters", "default", 'must be a JSON object; got "default" (a string)'),
    ("vocab_size", None, "must be a non-negative integer; got null"),
])
def test_a_config_field_of_the_wrong_type_is_named(source, tmp_path, field, value, what):
    """Today some of these load a wrong model without a word (4.5 layers -> 4, "false" -> tied
    embeddings, "10" -> eos ids (1, 0)) and the rest fail with int()'s message, naming no field."""
    d = _with(source, tmp_path, **{field: value})
    with pytest.raises(ConfigError) as e:
        LLM(model=d)
    assert str(e.value) == f"{d}/config.json: field {field} {what}"


@pytest.mark.parametrize("field", ["num_key_value_heads", "num_attention_heads", "linear_num_key_heads",
                                   "linear_value_head_dim"])
def test_a_zero_head_count_or_size_is_named(tiny_checkpoint, tmp_path, field):
    """Today a zero head count is a ZeroDivisionError from inside the config's checks or the
    conversion, a zero head size an error about a tensor's shape."""
    d = _with(tiny_checkpoint, tmp_path, **{field: 0})
    with pytest.raises(ConfigError, match=f"config.json: {field} must be positive; got 0"):
        LLM(model=d)


def _published() -> dict[str, dict]:
    out = {}
    for f in sorted(glob.glob(os.path.join(PUBLISHED, "*.json"))):
        with open(f) as fh:
            d = json.load(fh)
        out[os.path.basename(f)] = {k: v for k, v in d.items() if not k.startswith("_") and k != "not included"}
    return out


WRONG = {"count": "7", "float": "0.5", "bool": "false", "str": 3, "id": "1", "ids": "1", "strs": "x",
         "counts": [1.5], "object": "x"}


def _fields(d: dict, path=()):
    """(path, kind) of every field of `d` whose type the families read, nested ones included."""
    from hybrid_jax.models.config_common import FIELD_KINDS, LINEAR_ATTN_KINDS, ROPE_KINDS  # noqa: PLC0415
    for k, v in d.items():
        inside = path[-1] if path else None
        if inside in ("rope_parameters", "rope_scaling") or (path and path[0] in ("rope_parameters", "rope_scaling")):
            kind = ROPE_KINDS.get(k)
        elif inside == "linear_attn_config":
            kind = LINEAR_ATTN_KINDS.get(k)
        elif inside == "compress_rates":
            kind = "count"
        else:
            kind = FIELD_KINDS.get(k)
        if kind is not None:
            yield path + (k,), kind
        if isinstance(v, dict) and k in ("text_config", "rope_parameters", "rope_scaling", "linear_attn_config",
                                         "compress_rates", "main", "compress"):
            yield from _fields(v, path + (k,))


def test_every_model_types_fields_are_type_checked():
    """For each published config (every model type the loader reads), every field present whose
    type a family reads, set to a value of the wrong JSON type, is a ConfigError naming the field
    (its path inside text_config, rope_parameters, linear_attn_config, compress_rates)."""
    configs = _published()
    assert {config_from_hf_dict(d).model_type for d in configs.values()} >= {
        "qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v32", "deepseek_v4", "kimi_linear", "nemotron_h"}
    accepted, unnamed, checked = [], [], 0
    for name, base in configs.items():
        for path, kind in _fields(base):
            d = copy.deepcopy(base)
            t = d
            for p in path[:-1]:
                t = t[p]
            t[path[-1]] = WRONG[kind]
            checked += 1
            try:
                config_from_hf_dict(d)
                accepted.append((name, ".".join(path)))
            except ConfigError as e:
                if f"field {'.'.join(path)} must be" not in str(e):
                    unnamed.append((name, ".".join(path), str(e)))
    assert checked >= 228
    assert accepted == [] and unnamed == [], (accepted, unnamed[:5])    # today: 156 accepted, 72 unnamed


# ---- the command line ----------------------------------------------------------------------------

def test_generate_exits_non_zero_with_the_message(tiny_checkpoint, tmp_path, capsys):
    from hybrid_jax.cli import main
    d = _with(tiny_checkpoint, tmp_path, num_attention_heads=[4])
    assert main(["generate", "--model", d, "--tokens", "1,2,3", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"hybrid-jax: error: {d}/config.json: field num_attention_heads must be a non-negative integer" in err


@pytest.mark.parametrize("damage", ["truncated", "config"])
def test_serve_exits_non_zero_naming_the_file_or_field(tiny_checkpoint, tmp_path, damage):
    """`hybrid-jax serve` on a damaged checkpoint: the model fails to load, the server stops and the
    process exits non-zero with the loader's message in its log."""
    if damage == "config":
        d = _with(tiny_checkpoint, tmp_path, num_attention_heads=[4])
        want = f"{d}/config.json: field num_attention_heads must be a non-negative integer; got [4] (a list)"
    else:
        d = _copy(tiny_checkpoint, tmp_path)
        f = os.path.join(d, "model.safetensors")
        os.truncate(f, os.path.getsize(f) // 2)
        want = f"weight file {f} is truncated: "
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "hybrid_jax.cli", "serve", "--model", d, "--port", "0"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    assert want in out.stderr, out.stderr[-3000:]
