"""One registry of kernel ABI ids.

An ABI id names what a kernel wrote and how it laid it out: the kernel's name, the layout of the
cache object it writes, and a version that changes whenever either changes. The cache stores the
id beside every object it holds, and refuses to let a kernel with another id read it.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelABI:
    name: str      # the op, e.g. "gated_delta_rule"
    layout: str    # the layout of the object it writes, e.g. "state[N,HV,K,V]:f32"
    version: int

    @property
    def id(self) -> str:
        return f"{self.name}/{self.layout}/v{self.version}"


_REGISTRY: dict[str, KernelABI] = {}


def register(abi: KernelABI) -> KernelABI:
    """Adds an ABI to the registry; registering a different ABI under the same name is an error."""
    old = _REGISTRY.get(abi.name)
    if old is not None and old != abi:
        raise ValueError(f"kernel ABI {abi.name!r} is already registered as {old.id}, not {abi.id}")
    _REGISTRY[abi.name] = abi
    return abi


def get(name: str) -> KernelABI:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel ABI registered under {name!r}; known: {sorted(_REGISTRY)}") from None


def all_abis() -> dict[str, KernelABI]:
    return dict(_REGISTRY)


# The objects the current kernels write. Every implementation of one op (reference, xla, pallas)
# writes the same layout, so they share one id: a state written by one may be read by another.
GATED_DELTA_RULE = register(KernelABI("gated_delta_rule", "state[N,HV,K,V]:f32", 1))
# Kimi Delta Attention (pallas_kernels.kda): the gated delta rule with a decay per key channel. Its state has GDN's
# layout, but a state one rule wrote means nothing to the other, so the id is its own.
KIMI_DELTA_ATTENTION = register(KernelABI("kimi_delta_attention", "state[N,HV,K,V]:f32", 1))
# Mamba2's SSD rule (pallas_kernels.mamba2): the state as transformers' / mamba_ssm's ssm_state, [N, H, headdim,
# dstate] (version 3; versions 1 and 2 held GDN's [N, H, dstate, headdim], whose head dim of 64 the TPU stores
# with its last two axes swapped, so the decode kernel's pool was copied in and out each step). Its group's conv
# state holds the x / B / C channels group-major (each group's x, B, C together: layers.mamba2; since version 2).
# A state of an older version is refused, never read in the new layout.
MAMBA2_SSD = register(KernelABI("mamba2_ssd", "state[N,H,headdim,dstate]:f32,conv[N,W-1,C]:group-major", 3))
CAUSAL_CONV1D = register(KernelABI("causal_conv1d", "conv_state[N,C,W-1]", 1))
# Full attention over a paged KV pool (pallas_kernels.ragged_paged_attention): separate K and V pools of pages of
# ps tokens, token-major inside a page, addressed per sequence by page_indices. The op only reads; the full-attention
# KV group that writes these pages records this id as its writer.
RAGGED_PAGED_ATTENTION = register(KernelABI("ragged_paged_attention", "k,v[P,ps,Hkv,D]:paged", 1))
SPARSE_MLA_LATENT = register(KernelABI(
    "sparse_mla", "latent[P,ps,R]+rope[P,ps,ceil128(Dr)]:paged", 2))   # v2: the rope pool 128 lanes wide
INDEXER_KEYS = register(KernelABI("dsa_indexer", "keys[P,ps,D](+scale[P,ps]:f32):paged", 1))
# DeepSeek-V4 compressed attention (pallas_kernels.compressed_attention). The compressor writes, per layer,
# entries (RMS-normed, RoPE'd at w * rate) into pages, the open window's tail (raw gates, with its count) and
# CSA's overlap (the a-half of the last closed window, gates biased); the model writes the raw K=V sliding
# window as a ring (slot = position % W). The sparse read writes nothing cached; it reads both.
V4_COMPRESSOR = register(KernelABI(
    "v4_compress", "entries[P,ps,D]:paged,rms+rope@w*m;tail[B,m,C]:raw_gate+count;overlap[B,m,C/2]:biased_gate", 2))
V4_WINDOW = register(KernelABI("v4_window", "kv[B,W,D]:ring", 1))
V4_SPARSE_READ = register(KernelABI("v4_sparse_read", "window[B,S,D]+entries[P,ps,D]:paged(reads only)", 1))
# Qwen4-Exp (hybrid_jax.layers.qsa / layers.ple, XLA): the QSA indexer's keys are kept raw (before the block
# pooling, norm and RoPE; a DSA-written key page means something else), and the PLE state is the last c token ids
# plus the dilated conv's last (K-1) * n inputs per row.
QSA_RAW_KEYS = register(KernelABI("qsa_indexer", "raw_keys[P,ps,D]:paged", 1))
PLE_STATE = register(KernelABI("qwen4_ple", "ctx[B,c]:i32+conv[B,(K-1)n,N*Hd]", 1))
