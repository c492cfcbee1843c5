"""Trains the embedded default model (hybrid_jax/assets/default_model) from nothing, with JAX + Optax.

The corpus is the King James Version of the Bible as Debian ships it (packages `bible-kjv-text`, the
text, and `bible-kjv`, the program that decodes it; the KJV's copyright has expired, Debian's
packaging of it is GPL-2+, and a model trained on public-domain text may be redistributed). The
script downloads both packages with `apt-get download`, decodes the text, holds out one chapter in 40,
trains a byte-level BPE tokenizer (`tokenizers`), trains a small Qwen3-Next (three Gated DeltaNet
layers and one gated full-attention layer, MoE in two of the four) on the rest with the project's own
`forward` (the function that serves it), and writes a Hugging Face checkpoint directory: config.json,
model.safetensors (bf16), tokenizer.json, tokenizer_config.json and training.json (the run's figures).

    python scripts/train_default.py --out hybrid_jax/assets/default_model            # the full run
    python scripts/train_default.py --corpus slice.txt --steps 3 --out /tmp/m        # a smoke run

--corpus FILE skips the download: chapters separated by blank lines, one verse per line.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hybrid_jax.models import get_model
from hybrid_jax.models.config_common import load_config

EOS = "<|endoftext|>"
HELDOUT_EVERY = 40          # chapter i is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1


# --- corpus -----------------------------------------------------------------------------------------
def fetch_kjv(workdir: str) -> str:
    """Downloads Debian's bible-kjv packages into workdir and returns the whole text: chapters separated
    by blank lines, one verse per line, verse references removed."""
    os.makedirs(workdir, exist_ok=True)
    subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=workdir, check=True)
    root = os.path.join(workdir, "root")
    for deb in sorted(glob.glob(os.path.join(workdir, "bible-kjv*.deb"))):
        subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    out = subprocess.run([os.path.join(root, "usr/bin/bible"), "-f", "-p", os.path.join(root, "usr/lib"),
                          "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    chapters, key = [], None
    for line in out.splitlines():
        m = re.match(r"^(\w+?)(\d+):(\d+) (.*)$", line)
        if m is None:
            continue
        if (m.group(1), m.group(2)) != key:
            key = (m.group(1), m.group(2))
            chapters.append([])
        chapters[-1].append(m.group(4).strip())
    return "\n\n".join("\n".join(c) for c in chapters) + "\n"


def split_chapters(text: str) -> tuple[list[str], list[str]]:
    """(training chapters, held-out chapters): every HELDOUT_EVERY-th chapter is held out."""
    chapters = [c.strip() for c in text.split("\n\n") if c.strip()]
    held = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return train, held


# --- tokenizer --------------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer) with one special token, EOS, between documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


# --- model ------------------------------------------------------------------------------------------
def hf_config(vocab_size: int, eos_id: int) -> dict:
    """The model, as a Hugging Face Qwen3-Next config.json."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "dtype": "float32",      # run in float32; stored in bf16
        "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "intermediate_size": 768, "decoder_sparse_step": 2, "mlp_only_layers": [], "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
        "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "attention_dropout": 0.0, "max_position_embeddings": 4096, "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "use_cache": True,
    }


def hf_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint of config c and its shape (torch layout, experts fused
    as transformers writes them)."""
    Hd, V = c["hidden_size"], c["vocab_size"]
    H, HV, K, Vd = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                    c["linear_value_head_dim"])
    Hq, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, I, Is = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    s = {"model.embed_tokens.weight": (V, Hd), "model.norm.weight": (Hd,), "lm_head.weight": (V, Hd)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (Hd,)
        if kind == "linear_attention":
            a = p + "linear_attn."
            s.update({a + "in_proj_qkvz.weight": (2 * H * K + 2 * HV * Vd, Hd), a + "in_proj_ba.weight": (2 * HV, Hd),
                      a + "conv1d.weight": (2 * H * K + HV * Vd, 1, c["linear_conv_kernel_dim"]),
                      a + "A_log": (HV,), a + "dt_bias": (HV,), a + "norm.weight": (Vd,),
                      a + "out_proj.weight": (Hd, HV * Vd)})
        else:
            a = p + "self_attn."
            s.update({a + "q_proj.weight": (2 * Hq * D, Hd), a + "k_proj.weight": (Hkv * D, Hd),
                      a + "v_proj.weight": (Hkv * D, Hd), a + "o_proj.weight": (Hd, Hq * D),
                      a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
        m = p + "mlp."
        if (i + 1) % c["decoder_sparse_step"] == 0 and i not in c["mlp_only_layers"]:
            s.update({m + "gate.weight": (E, Hd), m + "shared_expert_gate.weight": (1, Hd),
                      m + "shared_expert.gate_proj.weight": (Is, Hd), m + "shared_expert.up_proj.weight": (Is, Hd),
                      m + "shared_expert.down_proj.weight": (Hd, Is),
                      m + "experts.gate_up_proj": (E, 2 * I, Hd), m + "experts.down_proj": (E, Hd, I)})
        else:
            s.update({m + "gate_proj.weight": (c["intermediate_size"], Hd),
                      m + "up_proj.weight": (c["intermediate_size"], Hd), m + "down_proj.weight": (Hd, c["intermediate_size"])})
    return s


def layout_map(cfg, shapes: dict) -> tuple[dict, dict]:
    """Where each parameter of the project's layout comes from in the checkpoint. The loader's
    re-layout (`convert_hf_weights`) only moves elements, so it is run once on a checkpoint whose every
    element holds its own global index: the result says, per parameter element, which checkpoint
    element it is. Returns (that index pytree, the checkpoint tensors' offsets). Fails unless the
    re-layout is a bijection (then the inverse, `to_checkpoint`, is exact)."""
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += math.prod(shape)
    if total >= 2 ** 24:
        raise ValueError(f"{total} checkpoint elements: float32 indices are exact only below 2^24")
    tensors = {n: (offsets[n] + np.arange(math.prod(s), dtype=np.float64)).reshape(s).astype(np.float32)
               for n, s in shapes.items()}
    index = get_model(cfg.model_type).convert_hf_weights(cfg, tensors.__getitem__, tensors.__contains__, jnp.float32)
    flat = np.concatenate([np.asarray(a).ravel() for a in jax.tree_util.tree_leaves(index)])
    if not (np.array_equal(np.sort(flat), np.arange(total, dtype=np.float32))):
        raise ValueError("the checkpoint re-layout is not a permutation: cannot invert it by index")
    return jax.tree_util.tree_map(lambda a: np.asarray(a).astype(np.int64), index), offsets


def to_checkpoint(params, index, shapes: dict, offsets: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensors (float32) holding params (the project's layout)."""
    total = sum(math.prod(s) for s in shapes.values())
    flat = np.zeros(total, np.float32)
    for p, i in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(index)):
        flat[i.ravel()] = np.asarray(p, np.float32).ravel()
    return {n: flat[offsets[n]:offsets[n] + math.prod(s)].reshape(s) for n, s in shapes.items()}


def write_checkpoint(out: str, config: dict, tok, tensors: dict, figures: dict) -> None:
    import ml_dtypes  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
                   "bos_token": None, "add_bos_token": False, "model_max_length": config["max_position_embeddings"]},
                  f, indent=2)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(figures, f, indent=2)


# --- training ---------------------------------------------------------------------------------------
def encode_stream(tok, docs: list[str]) -> np.ndarray:
    """Every document's ids, each followed by EOS, as one int32 stream."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + [eos]
    return np.asarray(ids, np.int32)


def make_loss(cfg, impl: str = "xla"):
    model = get_model(cfg.model_type)

    def loss_fn(params, batch):
        """Mean next-token cross-entropy of batch [B, T + 1] through the serving forward."""
        x, y = batch[:, :-1], batch[:, 1:]
        B, T = x.shape
        cache = model.new_cache(cfg, B, T, jnp.float32)
        logits = model.forward(cfg, params, cache, x, jnp.full((B,), T, jnp.int32), logits_at="all",
                               impl=impl).logits
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(lp, y[..., None], axis=-1))
    return loss_fn


def heldout_loss(loss_fn, params, stream: np.ndarray, T: int, B: int) -> float:
    """Mean NLL per token over non-overlapping windows of T + 1 tokens of stream (the windows that fit)."""
    n = (len(stream) - 1) // T
    wins = np.stack([stream[i * T:i * T + T + 1] for i in range(n)])
    f = jax.jit(loss_fn)
    tot = 0.0
    for s in range(0, n - n % B, B):
        tot += float(f(params, jnp.asarray(wins[s:s + B]))) * B
    return tot / (n - n % B)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the checkpoint directory to write")
    ap.add_argument("--corpus", help="a text file (chapters separated by blank lines) instead of the download")
    ap.add_argument("--workdir", default=None, help="where the Debian packages are downloaded (default: a temp dir)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-corpus", default=None, help="also write train.txt / heldout.txt into this directory")
    a = ap.parse_args(argv)
    t0 = time.time()

    if a.corpus:
        with open(a.corpus, encoding="utf-8") as f:
            text = f.read()
        corpus_name = os.path.basename(a.corpus)
    else:
        text = fetch_kjv(a.workdir or tempfile.mkdtemp(prefix="kjv-"))
        corpus_name = "King James Version (Debian bible-kjv-text 4.38, public domain text)"
    train_docs, held_docs = split_chapters(text)
    if a.save_corpus:
        os.makedirs(a.save_corpus, exist_ok=True)
        for name, docs in (("train.txt", train_docs), ("heldout.txt", held_docs)):
            with open(os.path.join(a.save_corpus, name), "w", encoding="utf-8") as f:
                f.write("\n\n".join(docs) + "\n")
    tok = train_tokenizer(train_docs, a.vocab)
    eos = tok.token_to_id(EOS)
    config = hf_config(tok.get_vocab_size(), eos)
    train_ids, held_ids = encode_stream(tok, train_docs), encode_stream(tok, held_docs)
    print(f"corpus: {len(train_docs)} training chapters ({len(train_ids)} tokens), {len(held_docs)} held out "
          f"({len(held_ids)} tokens); vocabulary {tok.get_vocab_size()}", flush=True)

    with tempfile.TemporaryDirectory() as d:        # the config as the loader reads it
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        cfg = load_config(d)
    shapes = hf_shapes(config)
    index, offsets = layout_map(cfg, shapes)
    params = get_model(cfg.model_type).init_params(cfg, seed=a.seed, dtype=jnp.float32)
    n_params = sum(math.prod(s) for s in shapes.values())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    sched = optax.warmup_cosine_decay_schedule(0.0, a.lr, min(a.warmup, max(a.steps // 10, 1)), max(a.steps, 2),
                                               end_value=a.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))
    state = opt.init(params)
    loss_fn = make_loss(cfg)

    @jax.jit
    def step(params, state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    rng = np.random.default_rng(a.seed)
    T, B = a.seq, a.batch
    log, t_train = [], time.time()
    ema = None
    for i in range(1, a.steps + 1):
        starts = rng.integers(0, len(train_ids) - T - 1, B)
        batch = jnp.asarray(np.stack([train_ids[s:s + T + 1] for s in starts]))
        params, state, loss = step(params, state, batch)
        if i == 1:
            first_loss = float(loss)
        if i % 25 == 0 or i == a.steps:
            loss = float(loss)
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            el = time.time() - t_train
            print(f"step {i}: loss {loss:.3f} (avg {ema:.3f}), {i * B * T / el:.0f} tok/s", flush=True)
        if (a.eval_every and i % a.eval_every == 0) or i == a.steps:
            h = heldout_loss(loss_fn, params, held_ids, T, min(B, max((len(held_ids) - 1) // T, 1)))
            log.append({"step": i, "train_loss": float(loss), "heldout_loss": h})
            print(f"step {i}: held-out loss {h:.3f} (perplexity {math.exp(h):.1f})", flush=True)
    wall = time.time() - t0
    figures = {"corpus": corpus_name, "training_tokens_seen": a.steps * B * T, "corpus_training_tokens": int(len(train_ids)),
               "heldout_tokens": int(len(held_ids)), "steps": a.steps, "batch": B, "seq_len": T, "peak_lr": a.lr,
               "parameters": n_params, "first_train_loss": first_loss, "final_train_loss": log[-1]["train_loss"],
               "final_heldout_loss": log[-1]["heldout_loss"], "uniform_loss": math.log(tok.get_vocab_size()),
               "wall_time_s": round(wall, 1), "train_time_s": round(time.time() - t_train, 1),
               "host": f"{os.cpu_count()} CPU cores, jax {jax.__version__}", "log": log}
    write_checkpoint(a.out, config, tok, to_checkpoint(params, index, shapes, offsets), figures)
    print(f"wrote {a.out}: {json.dumps({k: v for k, v in figures.items() if k != 'log'})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
