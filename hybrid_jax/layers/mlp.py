"""Feed-forward layers: SwiGLU MLP, and the sparse MoE block with a gated shared expert.

MoE routing: softmax over experts in fp32, Top-k, optional renormalisation. Three static choices by
shape: few routed rows (decode) gather the k chosen experts' weights per token (lowered for a TPU they take
the sorted form instead: `_routed_few`); many rows with few
experts (E <= 4k) run every expert densely and mask by the routing weights; many rows with many
experts sort rows by expert and run two grouped matmuls (`lax.ragged_dot`), so no expert computes a
token it was not routed.

Expert parallelism (`hybrid_jax.parallel`, experts split whole over the tensor axis): each device runs
the chosen form over its own experts for the assignments routed to them (the others masked), and the
outputs are summed over the devices: one all-reduce of [M, Hd] per block, no expert weight moves.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybrid_jax.layers.linear import ColumnConcat, Fp8Weight, dequantize, linear, take
from hybrid_jax.parallel.context import MODEL, constrain, current, per_device, tensor_size
from pallas_kernels.grouped_matmul import fp8_grouped_matmul


def gate_up_devices(gate_up) -> int:
    """Devices a SwiGLU's fused gate | up columns are laid out for under the current layout (the logical
    axis "gate_up": device d's columns are [its gate | its up], `interleave_gate_up`); 1 when whole
    (one device, a half the tensor size does not divide, an FP8 weight whose halves' parts would not
    be whole scale blocks, a ColumnConcat)."""
    lay = current()
    if lay is None or tensor_size() == 1 or isinstance(gate_up, ColumnConcat):
        return 1
    if isinstance(gate_up, Fp8Weight):
        if gate_up.axes is None:
            return 1
        spec = lay.spec(gate_up.axes, gate_up.w.shape, "gate_up")
    else:
        spec = lay.spec((None,) * (gate_up.ndim - 1) + ("gate_up",), gate_up.shape, "gate_up")
    return tensor_size() if spec[-1] is not None else 1


def interleave_gate_up(a, n: int):
    """[..., 2I] columns gate | up -> n device blocks [gate_d | up_d] (each I / n of both): a contiguous
    split of the result over n devices gives each its own gate and up columns. Any array along its last
    axis (an FP8 weight's block scales too, whose blocks then stay whole)."""
    lead = a.shape[:-1]
    return a.reshape(lead + (2, n, -1)).swapaxes(-3, -2).reshape(lead + (-1,))


def _act(g, u, limit: float | None):
    """silu(gate) * up; with `limit` (DeepSeek-V4's swiglu_limit) the gate clamped above and up both sides."""
    if limit is not None:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return jax.nn.silu(g) * u


def _split_act(h, limit: float | None = None):
    """The SwiGLU activation [..., I] of pre-activations h [..., 2I] = [gate | up]."""
    g, u = jnp.split(h, 2, axis=-1)
    return _act(g, u, limit)


def swiglu(x: jax.Array, gate_up: jax.Array, down: jax.Array, limit: float | None = None) -> jax.Array:
    """x: [..., Hd]; gate_up: [Hd, 2I]; down: [I, Hd] (arrays or `layers.linear` weights); limit: clamp
    the pre-activations (`_act`). Under a layout that splits gate_up (`gate_up_devices`), its columns
    are per device [gate_d | up_d] and each device multiplies its own halves: the activation [..., I]
    comes out split as down's rows are."""
    h = linear(x, gate_up)
    n = gate_up_devices(gate_up)
    if n > 1:
        h = h.reshape(h.shape[:-1] + (n, 2, -1))
        act = _act(h[..., 0, :], h[..., 1, :], limit).reshape(h.shape[:-3] + (-1,))
    else:
        act = _split_act(h, limit)
    return linear(act, down)


def relu2(h):
    """Nemotron-H's activation: relu(h) squared (an ungated MLP: its up projection is [.., I], not [.., 2I])."""
    return jnp.square(jax.nn.relu(h))


def _routed_gather(x, idx, w, gate_up, down, act=_split_act):
    # x: [M, Hd]; idx, w: [M, k]; gate_up: [E, Hd, 2I]; down: [E, I, Hd] (only the chosen experts are decoded);
    # idx E (another device's expert, weight 0) reads expert E - 1
    idx = jnp.minimum(idx, gate_up.shape[0] - 1)
    h = jnp.einsum("mh,mkhi->mki", x, dequantize(take(gate_up, idx), x.dtype))
    y = jnp.einsum("mki,mkih->mkh", act(h), dequantize(take(down, idx), x.dtype))
    return jnp.einsum("mkh,mk->mh", y, w.astype(y.dtype))


BATCHED_UP_ROWS = 64   # _routed_dense: fewer rows than this use the batched up projection


def _routed_dense(x, idx, w, gate_up, down, act=_split_act):
    # Every expert on every row, with the routing weights (zero where not routed) folded into the
    # activations. Wastes E/k of the FLOPs but has no gather or scatter: the fastest form when E is
    # small. Two up projections: few rows (decode, short verify windows) take a batched matmul over
    # the experts, which reads gate_up in its stored layout; many rows (prefill) take one GEMM over
    # the experts side by side, which transposes gate_up first but runs at the GEMM's full rate. On
    # CPU, the whole layer: 8 rows 60 -> 39 us and 25 rows 116 -> 92 us batched; 256 rows 746 ->
    # 515 us and 512 rows 1591 -> 1020 us as one GEMM. The down projection is one GEMM either way.
    gate_up, down = dequantize(gate_up, x.dtype), dequantize(down, x.dtype)
    E, Hd, I2 = gate_up.shape
    M = x.shape[0]
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=x.dtype) * w[..., None].astype(x.dtype), axis=1)   # [M, E]
    if M < BATCHED_UP_ROWS:
        h = jnp.einsum("emh,ehi->emi", jnp.broadcast_to(x, (E, M, Hd)), gate_up)        # [E, M, 2I]
        act = jnp.moveaxis(act(h) * combine.T[..., None], 0, 1)            # [M, E, I]
    else:
        h = jnp.einsum("mh,ehi->mei", x, gate_up)                                        # [M, E, 2I]
        act = act(h) * combine[..., None]                                                # [M, E, I]
    # contracted over (E, I) as two axes, not reshaped into one: split experts or a split intermediate
    # axis (hybrid_jax.parallel) stay split, and each device sums its own part
    return jnp.einsum("mei,eih->mh", act, down)


def _grouped(xs, w, sizes):
    """Rows sorted by expert times their expert's weight. FP8 experts go through the FP8 grouped matmul,
    which on TPU dequantizes tiles in VMEM (dequantizing the whole stack first would materialise every
    expert in the compute dtype: ~70 GB of temporaries for DeepSeek-V3.2) and elsewhere is the
    ragged_dot below over the dequantized weights."""
    if isinstance(w, Fp8Weight):
        return fp8_grouped_matmul(xs, w.w, w.scale, sizes, block=w.block)
    return jax.lax.ragged_dot(xs, dequantize(w, xs.dtype), sizes)


def _routed_sorted(x, idx, w, gate_up, down, act=_split_act):
    # idx may hold E (= gate_up.shape[0]): an assignment to no expert here (another device's), sorted
    # last and left out of the groups
    M, k = idx.shape
    E = gate_up.shape[0]
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = x[tok]
    y = _grouped(act(_grouped(xs, gate_up, sizes)), down, sizes)
    mine = (flat_e[order] < E)[:, None]              # rows past the groups are not computed: never read them
    y = jnp.where(mine, y * w.reshape(-1)[order][:, None].astype(y.dtype), 0)
    return jnp.zeros_like(x).at[tok].add(y)


def _routed_few(x, idx, w, gate_up, down, act=_split_act):
    """Few rows (rows x k <= E). Lowered for a TPU, the sorted form: its grouped matmul (`lax.ragged_dot`, or
    the FP8 kernel, which dequantizes tiles in VMEM) visits only the groups with rows, so each chosen expert is
    read once. The gather form there gathered each row's experts as slabs (FP8 ones dequantized whole): one
    chip at 8 rows read DeepSeek-V3.2 FP8 at 588 GB a token (25 GB sorted) and Nemotron-3-Nano bf16 at 27.5
    GB (8.4 GB sorted). Elsewhere the gather form, as before (the FP8 path's XLA form dequantizes every
    expert)."""
    def gather(x, idx, w):
        return _routed_gather(x, idx, w, gate_up, down, act)

    def sorted_(x, idx, w):
        return _routed_sorted(x, idx, w, gate_up, down, act)
    return jax.lax.platform_dependent(x, idx, w, tpu=sorted_, default=gather)


def _form(M: int, k: int, E: int):
    """The routed experts' form for M rows, k experts each, of E (module docstring)."""
    if M * k <= E:
        return _routed_few
    if E <= 4 * k:
        return _routed_dense
    return _routed_sorted


_EXPERTS = ("experts", None, None)     # gate_up [E, Hd, 2I], down [E, I, Hd] (and an FP8 weight's scales)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, gate_up: jax.Array, down: jax.Array,
                   limit: float | None = None, activation=None) -> jax.Array:
    """The routed experts' output: x [M, Hd]; idx, w [M, k] (chosen experts, their weights; an expert
    chosen twice in a row counts twice); gate_up [E, Hd, 2I]; down [E, I, Hd] (arrays or `layers.linear`
    weights: an FP8 expert is decoded inside the step, only the chosen ones on the gather path); limit:
    clamp the SwiGLU pre-activations (DeepSeek-V4); activation: an ungated experts' activation of the up
    projection (gate_up then [E, Hd, I]: Nemotron-H's `relu2`) in place of SwiGLU. Picks the form by
    shape (see the module docstring); with the experts split over devices, each runs it on its own
    (module docstring)."""
    M, k = idx.shape
    E = gate_up.shape[0]
    act = functools.partial(_split_act, limit=limit) if activation is None else activation
    form = functools.partial(_form(M, k, E), act=act)
    lay = current()
    if lay is None or tensor_size() == 1 or lay.spec(_EXPERTS, gate_up.shape, "experts")[0] is None:
        return form(x, idx, w, gate_up, down)

    def own_experts(x, idx, w, gate_up, down):
        El = gate_up.shape[0]
        first = jax.lax.axis_index(MODEL) * El
        mine = (idx >= first) & (idx < first + El)
        # another device's expert: index El (the sorted form leaves it out of its groups, the gather form
        # reads expert El - 1 with weight 0); the dense form's one-hot of El is all zeros
        local = jnp.where(mine, idx - first, El)
        y = form(x, local, jnp.where(mine, w, jnp.zeros_like(w)), gate_up, down)
        return jax.lax.psum(y, MODEL)
    return per_device(own_experts, (None, None, None, _EXPERTS, _EXPERTS), None)(x, idx, w, gate_up, down)


def sparse_moe(p: dict, x: jax.Array, *, num_experts: int, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """x: [B, T, Hd]. p: in_proj [Hd, E + 1 + 2Is] (router | shared gate | shared gate_up),
    shared_down [Is, Hd], gate_up [E, Hd, 2I], down [E, I, Hd]."""
    B, T, Hd = x.shape
    x2 = x.reshape(B * T, Hd)
    E = num_experts
    # whole on every device (in_proj is replicated): left free, the partitioner splits these columns
    # unevenly (E + 1 + 2Is of them) and runs the router's Top-K over the pieces with all-to-alls
    proj = constrain(linear(x2, p["in_proj"]), (None, None))
    logits, sgate, shared_gu = proj[:, :E], proj[:, E:E + 1], proj[:, E + 1:]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    w = w.astype(logits.dtype)
    routed = routed_experts(x2, idx, w, p["gate_up"], p["down"])
    sg, su = jnp.split(shared_gu, 2, axis=-1)
    # the shared expert's activation split as shared_down's rows are (each device slices its columns out of
    # the whole projection: no exchange)
    shared = linear(constrain(jax.nn.silu(sg) * su, (None, "mlp")), p["shared_down"]) * jax.nn.sigmoid(sgate)
    return (routed + shared).reshape(B, T, Hd)
