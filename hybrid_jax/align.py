"""Layer-by-layer alignment against the Hugging Face transformers model of the same checkpoint.

Runs one input through this project and through transformers (fp32, offline), and reports per
layer the max abs and relative error of the residual stream, and the first layer whose error
exceeds the tolerance. This is how a new architecture is brought up: the first diverging layer
names the piece to look at.

A block-quantized checkpoint (FP8 / FP4, see `quantization.py`) is compared with transformers on
its dequantized weights: they are written, with the checkpoint's tensor names, to a temporary float32
copy that transformers loads as it would the release (its own renaming included). The model under
test may keep its weights in FP8 (`--quantization fp8`).

    hybrid-jax align --model PATH [--tokens 1,2,3 | --prompt TEXT] [--atol 1e-4] [--quantization fp8]
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np

from hybrid_jax.errors import InputError
from hybrid_jax.models import get_model


@dataclasses.dataclass
class LayerDiff:
    name: str
    max_abs: float
    rel: float          # ||a - b|| / ||b||

    def ok(self, atol: float) -> bool:
        return self.max_abs <= atol


@dataclasses.dataclass
class AlignmentReport:
    rows: list[LayerDiff]
    atol: float

    @property
    def first_divergent(self) -> str | None:
        return next((r.name for r in self.rows if not r.ok(self.atol)), None)

    def __str__(self) -> str:
        w = max([24] + [len(r.name) + 2 for r in self.rows])
        lines = [f"{'stage':<{w}}{'max_abs':>14}{'rel':>14}  ok (atol={self.atol:g})"]
        lines += [f"{r.name:<{w}}{r.max_abs:>14.3e}{r.rel:>14.3e}  {'yes' if r.ok(self.atol) else 'NO'}"
                  for r in self.rows]
        fd = self.first_divergent
        lines.append("all stages agree" if fd is None else f"first divergent stage: {fd}")
        return "\n".join(lines)


def _diff(name: str, a: np.ndarray, b: np.ndarray) -> LayerDiff:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise InputError(f"stage {name}: shapes differ, {a.shape} vs {b.shape}")
    return LayerDiff(name, float(np.max(np.abs(a - b))),
                     float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))


@contextlib.contextmanager
def dequantized_copy(path: str):
    """The checkpoint directory transformers should load as the reference: `path` itself, or, for a
    checkpoint with a quantization_config, a temporary float32 copy of its dequantized weights (same
    tensor names, scale tensors dropped, config without quantization_config)."""
    from hybrid_jax.weights import open_checkpoint  # noqa: PLC0415
    reader = open_checkpoint(path)
    if reader.quant is None:
        yield path
        return
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from hybrid_jax.quantization import scale_names  # noqa: PLC0415
    names = reader.keys()
    scales = {s for n in names for s in scale_names(n) if s in names and s != n}
    with tempfile.TemporaryDirectory(prefix="hybrid_jax_align_") as tmp:
        tensors = {}
        for n in names:
            if n not in scales:
                a = reader.get(n)
                tensors[n] = torch.from_numpy(np.array(a, np.float32) if a.dtype.kind == "f" else np.array(a))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop("quantization_config", None)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(path, extra)):
                shutil.copy(os.path.join(path, extra), tmp)
        yield tmp


def hf_hidden_states(path: str, token_ids: list[int]):
    """Transformers' residual streams (embedding, each layer, the last one after the final norm)
    and logits, in fp32, offline (on the dequantized weights of a quantized checkpoint)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    with dequantized_copy(path) as ref, torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, local_files_only=True).eval()
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states], out.logits[0].numpy()


def align(llm, token_ids: list[int], atol: float = 1e-4) -> AlignmentReport:
    """Compares `llm` (a hybrid_jax.LLM loaded from a checkpoint dir) with transformers on token_ids."""
    if not token_ids:
        raise InputError("align needs at least one token")
    if llm.checkpoint_dir is None:
        raise InputError("align compares against a checkpoint directory; this LLM was built from parameters")
    ref_hidden, ref_logits = hf_hidden_states(llm.checkpoint_dir, token_ids)
    mine = llm.generator.hidden_states(np.asarray(token_ids, np.int32))
    L = len(mine) - 1
    cfg = llm.config
    last = np.asarray(get_model(cfg.model_type).final_norm(cfg, llm.params, jnp.asarray(mine[-1])))
    rows = [_diff("embedding", mine[0], ref_hidden[0])]
    rows += [_diff(f"layer {i} ({cfg.layer_types[i]})", mine[i + 1], ref_hidden[i + 1]) for i in range(L - 1)]
    rows.append(_diff(f"layer {L - 1} + final norm", last, ref_hidden[L]))
    rows.append(_diff("logits", llm.logits(token_ids), ref_logits))
    return AlignmentReport(rows, atol)
