"""Cache state as pure pytrees, one group per layer type, passed into and out of every jitted step.

A group stacks the objects of all layers of its kind on a leading layer axis, so the whole cache
is a handful of arrays: what a step reads and writes is explicit in its signature, and a snapshot
is just a reference to the old pytree. Static facts (which kernel ABI wrote a group, which model
layers it holds) live in the treedef, not in arrays, so they cost nothing at run time and a
mismatch changes the compiled step rather than being read silently.

  RecurrentGroup  (linear_attention)  conv  [L, B, W-1, C]     ssm [L, B, HV, K, V] fp32
  KVGroup         (full_attention)    k, v  [L, P, ps, Hkv, D] pages, page_table [B, NP]
  ModelCache      groups by layer type, lengths [B] (tokens written per row), version [B]

Per-position objects (full KV here, the MLA latent and indexer keys in cache/mla.py, DeepSeek-V4's
compressed entries in cache/compressed.py) live in pools of fixed-size pages addressed through a
per-row page table: token p of row b is at page page_table[b, p // ps], slot p % ps. Every reader
and writer goes through the table, so whoever owns the pages (a contiguous table per row here, the
engine's block manager later) can hand out any page without touching a kernel.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from cache.group import CacheGroup
from cache.mla import contiguous_page_table
from cache.segments import Kind
from pallas_kernels import abi as kernel_abi


def conv_state_after(window: jax.Array, idx: jax.Array, width: int) -> jax.Array:
    """window [B, W-1+T, C] (the conv state before a window, then its inputs); idx [B] in [0, T) ->
    the conv state after position idx[b] of each row (its W-1 inputs ending there): [B, W-1, C]."""
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width - 1, axis=0))(window, idx + 1)


def states_after(parts: dict, idx: jax.Array, l2norm_keys: bool = True,
                 value_major: bool = False) -> tuple[jax.Array, jax.Array]:
    """One layer's states after position idx[b] of each row ([B] int32, in [0, T)), from the parts
    `layers.gated_deltanet(..., per_token_states=True)` returned: (conv [B, W-1, C], ssm [B, HV, K, V] fp32).
    l2norm_keys: the rule normalised its keys (Gated DeltaNet, KDA); Mamba2's SSD rule does not.
    value_major: the states (ssm0 and the result) are [B, HV, V, K] (Mamba2's, abi.MAMBA2_SSD)."""
    width = parts["conv_window"].shape[1] - parts["k"].shape[1] + 1
    conv = conv_state_after(parts["conv_window"], idx, width)
    ssm0 = jnp.swapaxes(parts["ssm0"], -1, -2) if value_major else parts["ssm0"]
    ssm = pallas_kernels.state_after(ssm0, parts["k"], parts["g"], parts["delta"], idx,
                                     use_qk_l2norm_in_kernel=l2norm_keys)
    return conv, jnp.swapaxes(ssm, -1, -2) if value_major else ssm


# the recurrent rules whose keys enter the state as given (no l2norm): `RecurrentGroup.truncate`
UNNORMALISED_KEYS = frozenset({kernel_abi.MAMBA2_SSD.id})
# the recurrent rules whose states are value-major, [HV, V, K] a head (Mamba2's [H, headdim, dstate])
VALUE_MAJOR_STATES = frozenset({kernel_abi.MAMBA2_SSD.id})


@flax.struct.dataclass
class RecurrentGroup(CacheGroup):
    """Gated DeltaNet (or KDA) state of every linear-attention layer: conv window and recurrent state."""
    conv: jax.Array            # [L, B, W-1, C]  the last W-1 conv inputs of each row (channels as the layer orders them)
    ssm: jax.Array             # [L, B, HV, K, V] fp32
    # an in-place view (`CacheGroup.take(in_place=True)`): ssm is the whole pool [L, R, HV, K, V] and
    # these [Bb] are the step's rows of it (conv is gathered: [L, Bb, W-1, C], small)
    view_rows: jax.Array | None = None
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=kernel_abi.GATED_DELTA_RULE.id)

    kind = "recurrent_state"
    STORE_KIND = Kind.RECURRENT_STATE
    ROW_FIELDS = {"conv": 1, "ssm": 1}       # field -> its row (slot) axis
    AXES = {"conv": (None, None, None, "heads"), "ssm": (None, None, "heads", None, None)}
    ROLLBACK = "select"
    IN_PLACE_FIELDS = ("ssm",)

    def layer_state(self, s: int) -> tuple[jax.Array, jax.Array]:
        """Layer slot s's (conv [B, W-1, C], ssm [B, HV, K, V]) of the step's rows (an in-place view's
        states gathered from the pool)."""
        if self.view_rows is None:
            return self.conv[s], self.ssm[s]
        return self.conv[s], self.ssm.at[s, self.view_rows].get(mode="clip")

    def ssm_pool(self, s: int) -> tuple[jax.Array, jax.Array]:
        """An in-place view's layer slot s as the recurrent op's pooled state: (the pool's rows of every
        layer [L * R, HV, K, V], a free reshape; the step's rows of layer s in it [Bb]).
        `with_layer_state(..., pooled=True)` takes the pool back."""
        L, R = self.ssm.shape[:2]
        return self.ssm.reshape((L * R,) + self.ssm.shape[2:]), s * R + self.view_rows

    def with_layer_state(self, s: int, conv: jax.Array, ssm: jax.Array, pooled: bool = False) -> "RecurrentGroup":
        """The group with layer slot s's states of the step's rows replaced (written in place: a layer's
        slice is updated, never the [L, ...] stack rebuilt). pooled: ssm is the pool `ssm_pool` lent out,
        [L * R, HV, K, V], as the op left it (an in-place view)."""
        if pooled:
            new_ssm = ssm.reshape(self.ssm.shape)
        else:
            at = (s,) if self.view_rows is None else (s, self.view_rows)
            new_ssm = self.ssm.at[at].set(ssm.astype(self.ssm.dtype))
        return self.replace(conv=self.conv.at[s].set(conv.astype(self.conv.dtype)), ssm=new_ssm)

    def truncate(self, states: dict, n_keep: jax.Array) -> "RecurrentGroup":
        """The state after the first n_keep[b] fed tokens of each row, selected from the verify
        forward's per-position parts over the group's L layers (conv_window [L, B, W-1+T, C], ssm0
        [L, B, HV, K, V], k [L, B, T, H, K], g [L, B, T, HV], delta [L, B, T, HV, V]; see
        `layers.gated_deltanet`); rows with n_keep = 0 fed nothing and keep their state."""
        if self.view_rows is not None:
            raise ValueError("an in-place view of the recurrent pools cannot be truncated; take the verify's "
                             "view gathered")
        idx = jnp.maximum(n_keep - 1, 0)
        fed = (n_keep > 0)
        l2, vm = self.writer_abi not in UNNORMALISED_KEYS, self.writer_abi in VALUE_MAJOR_STATES
        conv, ssm = jax.vmap(lambda parts: states_after(parts, idx, l2, vm))(states)
        conv = jnp.where(fed.reshape(1, -1, 1, 1), conv, self.conv)
        ssm = jnp.where(fed.reshape(1, -1, 1, 1, 1), ssm, self.ssm)
        return self.replace(conv=conv.astype(self.conv.dtype), ssm=ssm)


@flax.struct.dataclass
class KVGroup(CacheGroup):
    """Full-attention keys and values of every full-attention layer, in pages of ps tokens."""
    k: jax.Array               # [L, P, ps, Hkv, D]
    v: jax.Array               # [L, P, ps, Hkv, D]
    page_table: jax.Array      # [B, NP] int32: row b's token p is at page page_table[b, p // ps]
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=kernel_abi.RAGGED_PAGED_ATTENTION.id)

    kind = "full_kv"
    STORE_KIND = Kind.FULL_KV
    PARTIAL_RESUME = True
    PAGE_FIELDS = {"k": 1, "v": 1}           # field -> its page axis
    AXES = {"k": (None, None, None, "kv_heads", None), "v": (None, None, None, "kv_heads", None)}

    @property
    def page_tokens(self) -> int:
        """Tokens one page covers (the prefix cache's block size for this group)."""
        return self.page_size

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def capacity(self) -> int:
        """Tokens a row's page table can address."""
        return self.page_table.shape[1] * self.page_size

    def bytes_per_token(self) -> int:
        """Bytes one token adds across all layers (K and V)."""
        L, _, _, H, D = self.k.shape
        return 2 * L * H * D * self.k.dtype.itemsize


@flax.struct.dataclass
class ModelCache:
    """The whole cache of a batch of B rows. `lengths[b]` tokens of row b are in it."""
    groups: dict[str, Any]     # layer type -> RecurrentGroup | KVGroup
    lengths: jax.Array         # [B] int32
    version: jax.Array         # [B] int32, bumped on every write of a row

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def slot(self, layer_type: str, layer_id: int) -> int:
        """Index of model layer `layer_id` inside its group's stacked arrays."""
        return self.groups[layer_type].layer_ids.index(layer_id)


DEFAULT_KV_PAGE_SIZE = 64     # tokens per full-KV page (the prefix cache's full-KV block)


def recurrent_group(layer_ids: tuple[int, ...], batch_size: int, conv_width: int, conv_dim: int,
                    heads: tuple[int, int, int], dtype, writer_abi: str = kernel_abi.GATED_DELTA_RULE.id
                    ) -> RecurrentGroup:
    """An empty recurrent group: conv [L, B, W-1, C] in `dtype`, states [L, B, HV, K, V] f32 (heads =
    (HV, K, V)), written by the rule `writer_abi` names (Gated DeltaNet's, or KDA's)."""
    hv, kd, vd = heads
    return RecurrentGroup(conv=jnp.zeros((len(layer_ids), batch_size, conv_width - 1, conv_dim), dtype),
                          ssm=jnp.zeros((len(layer_ids), batch_size, hv, kd, vd), jnp.float32),
                          layer_ids=tuple(layer_ids), writer_abi=writer_abi)


def init_cache(*, batch_size: int, capacity: int, layer_types: tuple[str, ...], dtype,
               conv_dim: int = 0, conv_width: int = 0, linear_heads: tuple[int, int, int] = (0, 0, 0),
               kv_heads: int = 0, head_dim: int = 0, page_size: int = DEFAULT_KV_PAGE_SIZE) -> ModelCache:
    """Empty cache for `batch_size` rows of up to `capacity` tokens.

    linear_heads = (HV, K, V) of the recurrent state. Only groups whose layer type occurs are made.
    Full KV comes in pages of min(page_size, capacity) tokens, ceil(capacity / ps) of them per row,
    assigned contiguously (row b owns pages b*NP .. b*NP + NP - 1).
    """
    groups: dict[str, Any] = {}
    lin = tuple(i for i, t in enumerate(layer_types) if t == "linear_attention")
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    if lin:
        groups["linear_attention"] = recurrent_group(lin, batch_size, conv_width, conv_dim, linear_heads, dtype)
    if full:
        ps = min(page_size, capacity)
        table = contiguous_page_table(batch_size, capacity, ps)
        shape = (len(full), table.size, ps, kv_heads, head_dim)
        groups["full_attention"] = KVGroup(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), page_table=table,
                                           layer_ids=full)
    return ModelCache(groups=groups, lengths=jnp.zeros((batch_size,), jnp.int32),
                      version=jnp.zeros((batch_size,), jnp.int32))


def leaf_nbytes(x) -> int:
    """Bytes of one array leaf (a jax.Array, numpy array or jax.ShapeDtypeStruct from eval_shape)."""
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _leaf_name(path) -> str:
    """'k', 'entries', 'scale' ... : the key path of a leaf inside its group, dotted."""
    parts = []
    for p in path:
        parts.append(str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))))
    return ".".join(parts) or "_"


def group_leaf_nbytes(group) -> dict[str, int]:
    """Bytes of every array leaf of one cache group, by field name (static fields are not leaves)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(group)
    return {_leaf_name(path): leaf_nbytes(x) for path, x in flat}


def nbytes_by_group(cache: ModelCache) -> dict[str, dict[str, int]]:
    """Bytes held per group and per array, read off the pytree's leaves (works for every group type,
    and for the ShapeDtypeStructs of `jax.eval_shape`): {group: {field: bytes, ..., "total": bytes}}."""
    out = {}
    for name, g in cache.groups.items():
        out[name] = group_leaf_nbytes(g)
        out[name]["total"] = sum(out[name].values())
    return out


def bytes_per_token(cache: ModelCache, new_cache=None) -> dict[str, float]:
    """Per group: bytes one more token of capacity adds to one row (0 for objects fixed per row).

    new_cache (optional): `(batch_size, capacity) -> ModelCache` of the same model. With it, the growth is
    measured from the pytrees themselves (cache/accounting.py: `jax.eval_shape` at two capacities, by
    leaves, for every group type). Without it, each group's own `bytes_per_token()` (cache.group.CacheGroup:
    a paged group's page bytes per token, 0 for state fixed per row such as RecurrentGroup)."""
    if new_cache is not None:
        from cache.accounting import measure  # noqa: PLC0415  (accounting builds on this module)
        acc = measure(new_cache)
        return {name: acc.groups[name].per_token for name in cache.groups}
    return {name: float(g.bytes_per_token()) for name, g in cache.groups.items()}
