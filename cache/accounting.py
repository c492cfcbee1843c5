"""Memory accounting of a cache: bytes per token per group and per object kind, read off the pytrees.

Nothing here knows a group class or a model. A model hands in its cache constructor
`new_cache(batch_size, capacity) -> ModelCache`; `jax.eval_shape` builds that cache abstractly (so a
1M-token cache costs no memory) at batch sizes 1 and 2 and at two capacities, and every array leaf
counts prod(shape) * itemsize. From those four points each group's bytes split exactly, as a
bilinear function of rows B and capacity C, into

  bytes(B, C) = shared_fixed + shared_per_token * C + B * (fixed + per_token * C)

  fixed            bytes a row holds whatever its length (SWA window, tails, overlap, recurrent state, counts)
  per_token        bytes a row adds per token of capacity (full KV, compressed entries, indexer entries, latents)
  shared_*         bytes the cache holds whatever its rows (0 for every group today; kept so nothing is lost)

The leaves of the ModelCache outside its groups (lengths, version) are the pseudo-group "_rows",
kind "row_metadata". A group's kind is its `kind` attribute (full_kv, compressed_kv, indexer_entries,
uncompressed_tail, swa_window, csa_overlap, recurrent_state, mla_latent, indexer_keys, ...).

Bytes per token at a length n are those of one row of a cache of capacity n, divided by n: the fixed
parts amortised over the length. `bytes_per_token_at` evaluates the cache at exactly n (so rounding of
entries or pages at n is counted); `Accounting.per_token_at` uses the linear split (equal whenever n is a
multiple of every compression rate and page size; the tests check that).

Full-attention baseline: `full_kv_cache_fn(num_layers, kv_heads, head_dim, dtype)` is a standard
full-attention KV cache (cache.state KVGroup: separate K and V in pages [L, P, ps, Hkv, D]) of the given width;
callers compare a model against the one with its layer count, KV heads and head dim.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax

from cache.group import CacheGroup
from cache.state import ModelCache, group_leaf_nbytes, init_cache, leaf_nbytes

NewCache = Callable[[int, int], ModelCache]       # (batch_size, capacity) -> ModelCache
ROW_METADATA = "_rows"
# display order of the kinds this project has; unknown kinds sort after them
KIND_ORDER = ("full_kv", "swa_window", "compressed_kv", "indexer_entries", "uncompressed_tail", "csa_overlap",
              "mla_latent", "indexer_keys", "recurrent_state", "row_metadata")


def kind_of(name: str, group) -> str:
    """A group's object kind: its `kind` attribute; 'row_metadata' for the pseudo-group of lengths /
    version. Raises ValueError naming a group that has none (accounting by kind would drop it)."""
    if name == ROW_METADATA:
        return "row_metadata"
    k = group.kind if isinstance(group, CacheGroup) else ""
    if not k:
        raise ValueError(f"cache group {name!r} ({type(group).__name__}) has no `kind`; every group must name "
                         f"its object kind")
    return k


def abstract_cache(new_cache: NewCache, batch_size: int, capacity: int) -> ModelCache:
    """The cache new_cache(batch_size, capacity) as ShapeDtypeStructs: no memory is allocated."""
    return jax.eval_shape(lambda: new_cache(batch_size, capacity))


def bytes_of(cache: ModelCache) -> dict[str, int]:
    """Bytes per group of a cache (arrays or ShapeDtypeStructs), plus '_rows' for leaves outside groups."""
    out = {name: sum(group_leaf_nbytes(g).values()) for name, g in cache.groups.items()}
    total = sum(leaf_nbytes(x) for x in jax.tree_util.tree_leaves(cache))
    out[ROW_METADATA] = total - sum(out.values())
    return out


def kinds_of(cache: ModelCache) -> dict[str, str]:
    """Group name -> kind, '_rows' included."""
    out = {name: kind_of(name, g) for name, g in cache.groups.items()}
    out[ROW_METADATA] = "row_metadata"
    return out


def row_bytes(new_cache: NewCache, capacity: int) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes one row adds, bytes held whatever the rows) per group, at exactly `capacity`, from the
    abstract caches of 1 and 2 rows."""
    b1 = bytes_of(abstract_cache(new_cache, 1, capacity))
    b2 = bytes_of(abstract_cache(new_cache, 2, capacity))
    return {k: b2[k] - b1[k] for k in b1}, {k: 2 * b1[k] - b2[k] for k in b1}


@dataclasses.dataclass(frozen=True)
class GroupBytes:
    """One group's bytes: per row `fixed + per_token * C`, plus `shared_fixed + shared_per_token * C` per cache."""
    name: str
    kind: str
    fixed: float
    per_token: float
    shared_fixed: float = 0.0
    shared_per_token: float = 0.0

    def row_bytes_at(self, n: int) -> float:
        """Bytes of a one-row cache of capacity n held by this group."""
        return self.fixed + self.shared_fixed + (self.per_token + self.shared_per_token) * n


@dataclasses.dataclass(frozen=True)
class Accounting:
    """The linear split of every group of one model's cache (see the module docstring)."""
    groups: dict[str, GroupBytes]
    capacities: tuple[int, int]

    def per_token_at(self, n: int) -> dict[str, float]:
        """Group -> bytes per token of one row holding n tokens (fixed parts amortised over n)."""
        return {name: g.row_bytes_at(n) / n for name, g in self.groups.items()}

    def by_kind(self, per_group: dict[str, float]) -> dict[str, float]:
        """Sums a per-group figure by object kind, in KIND_ORDER."""
        out: dict[str, float] = {}
        for name, v in per_group.items():
            k = self.groups[name].kind
            out[k] = out.get(k, 0.0) + v
        return dict(sorted(out.items(), key=lambda kv: _kind_rank(kv[0])))

    def kind_per_token_at(self, n: int) -> dict[str, float]:
        """Kind -> bytes per token of one row holding n tokens."""
        return self.by_kind(self.per_token_at(n))

    def total_per_token_at(self, n: int) -> float:
        return sum(self.per_token_at(n).values())

    @property
    def per_token(self) -> float:
        """Bytes the whole cache grows by per token of one row (the slope, fixed parts excluded)."""
        return sum(g.per_token + g.shared_per_token for g in self.groups.values())

    @property
    def fixed(self) -> float:
        """Bytes of one row whatever its length (its share of shared parts included)."""
        return sum(g.fixed + g.shared_fixed for g in self.groups.values())


def _kind_rank(kind: str):
    return (KIND_ORDER.index(kind), "") if kind in KIND_ORDER else (len(KIND_ORDER), kind)


def measure(new_cache: NewCache, capacities: tuple[int, int] = (1 << 16, 1 << 17)) -> Accounting:
    """Splits each group of new_cache's pytree into fixed and per-token bytes per row (and per cache)
    from abstract caches at B in {1, 2} and the two capacities (pick multiples of every compression
    rate and page size: the default 64k and 128k are)."""
    c1, c2 = capacities
    if not 0 < c1 < c2:
        raise ValueError(f"capacities must be increasing positive ints; got {capacities}")
    r1, s1 = row_bytes(new_cache, c1)
    r2, s2 = row_bytes(new_cache, c2)
    kinds = kinds_of(abstract_cache(new_cache, 1, c1))
    groups = {}
    for name in r1:
        pt = (r2[name] - r1[name]) / (c2 - c1)
        spt = (s2[name] - s1[name]) / (c2 - c1)
        groups[name] = GroupBytes(name=name, kind=kinds[name], fixed=r1[name] - pt * c1, per_token=pt,
                                  shared_fixed=s1[name] - spt * c1, shared_per_token=spt)
    return Accounting(groups=groups, capacities=(c1, c2))


def bytes_per_token_at(new_cache: NewCache, lengths: Iterable[int]) -> dict[int, dict[str, float]]:
    """{n: {group: bytes per token}} of a one-row cache of capacity exactly n (abstract, so any n is free)."""
    out = {}
    for n in lengths:
        b = bytes_of(abstract_cache(new_cache, 1, n))
        out[n] = {k: v / n for k, v in b.items()}
    return out


def full_kv_cache_fn(num_layers: int, kv_heads: int, head_dim: int, dtype) -> NewCache:
    """A standard full-attention cache: every layer keeps K and V of every token, [L, B, S, Hkv, D] each
    (cache.state.KVGroup, kind full_kv)."""
    layer_types = ("full_attention",) * num_layers

    def new_cache(batch_size: int, capacity: int) -> ModelCache:
        return init_cache(batch_size=batch_size, capacity=capacity, layer_types=layer_types, dtype=dtype,
                          kv_heads=kv_heads, head_dim=head_dim)
    return new_cache


def table(accountings: dict[str, Accounting], lengths: Iterable[int], baseline: str) -> list[dict]:
    """Rows {model, n, kind -> bytes/token..., total, vs_baseline} for printing or plotting:
    every model's bytes per token by kind at each length, and the baseline's total over the model's."""
    rows = []
    for n in lengths:
        base = accountings[baseline].total_per_token_at(n)
        for label, acc in accountings.items():
            kinds = acc.kind_per_token_at(n)
            total = sum(kinds.values())
            rows.append({"model": label, "n": n, "kinds": kinds, "total": total, "baseline_over_this": base / total})
    return rows


def format_bytes(x: float) -> str:
    """1234.5 -> '1.21 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} TiB"
