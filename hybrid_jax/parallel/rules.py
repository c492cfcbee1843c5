"""Logical axis names, and the one table that maps them onto the mesh (the MaxText / Flax pattern).

Every parameter of a family declares the logical name of each of its dimensions (the family's
`param_axes`: glob pattern of the parameter path -> names), every cache group the names of its
fields' dimensions (`CacheGroup.AXES`). Nothing else in the code names a mesh axis: `rules(pc)` is
the only place that decides which logical axis is split over which mesh axis.

  vocab       the vocabulary: embedding rows and LM-head columns (vocab-parallel); replicated when the
              tensor size does not divide it
  embed       the model width (replicated: activations between blocks are whole)
  heads       attention / linear-attention heads, or a dimension made of whole heads (H * D)
  kv_heads    key-value heads; replicated when the tensor size does not divide them (vLLM does the
              same: each device then holds every KV head its query heads read)
  gate_up     a SwiGLU's fused gate | up columns: each half split over the tensor axis, a device's
              columns stored as [its gate | its up] (`placement` permutes them, `layers.mlp.swiglu`
              splits per device), so the MLP runs without moving activations; replicated when the
              tensor size does not divide a half
  mlp         dense-MLP / shared-expert intermediate columns (column then row parallel)
  experts     routed experts (split whole under enable_expert_parallel)
  expert_mlp  a routed expert's intermediate columns (split when experts are not)
  None        replicated
"""
from __future__ import annotations

from jax.sharding import PartitionSpec

from hybrid_jax.errors import ConfigError
from hybrid_jax.parallel.config import ParallelConfig

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "gate_up", "mlp", "experts", "expert_mlp")
REPLICATED_WHEN_INDIVISIBLE = frozenset({"kv_heads", "gate_up", "vocab"})


def rules(pc: ParallelConfig) -> dict[str, str | None]:
    """Logical axis -> mesh axis (None: replicated) for the layout `pc`."""
    ep = pc.enable_expert_parallel
    return {"vocab": "model", "embed": None, "heads": "model", "kv_heads": "model", "gate_up": "model",
            "mlp": "model", "experts": "model" if ep else None, "expert_mlp": None if ep else "model"}


def partition_spec(axes: tuple, shape: tuple[int, ...], table: dict[str, str | None], mesh_shape: dict[str, int],
                   where: str) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions have logical names `axes`.
    ConfigError naming `where` when a split dimension is not divisible by its mesh axis (except
    the axes in REPLICATED_WHEN_INDIVISIBLE, which are then replicated)."""
    if len(axes) != len(shape):
        raise ConfigError(f"{where}: {len(axes)} logical axes {axes} for an array of shape {tuple(shape)}")
    parts, used = [], set()
    for dim, name in zip(shape, axes):
        if name is not None and name not in table:
            raise ConfigError(f"{where}: unknown logical axis {name!r}; known: {LOGICAL_AXES}")
        m = table.get(name) if name is not None else None
        if m is None or mesh_shape.get(m, 1) == 1 or m in used:
            parts.append(None)
            continue
        if dim % (2 * mesh_shape[m] if name == "gate_up" else mesh_shape[m]):      # gate_up: each half
            if name in REPLICATED_WHEN_INDIVISIBLE:
                parts.append(None)
                continue
            raise ConfigError(f"{where}: its {name} dimension ({dim}) is not divisible by the {m!r} mesh axis "
                              f"({mesh_shape[m]} devices)")
        parts.append(m)
        used.add(m)
    return PartitionSpec(*parts)
