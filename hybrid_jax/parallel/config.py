"""The parallel layout a user asks for, in vLLM's option names, and its checks.

`ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel)`:
  tensor_parallel_size    devices one replica's heads, MLP columns and vocabulary are split over
                          (mesh axis "model")
  data_parallel_size      replicas over mesh axis "data" (weights replicated across it)
  enable_expert_parallel  MoE experts split whole over the "model" axis (each device holds E / tp
                          experts) instead of every expert's intermediate columns

`check(cfg, n_devices)` raises ConfigError before any weight is read when the layout cannot work:
a size that is not a positive integer, a product that is not the number of devices given, or a head
or expert count the tensor size does not divide (named, with its count). Key-value heads fewer than
the tensor size are replicated (as vLLM does), not an error, and so are the embedding and LM head of
a vocabulary the tensor size does not divide (vLLM pads it instead: less memory, a later step).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hybrid_jax.errors import ConfigError

if TYPE_CHECKING:                  # for annotations only: the models import parallel, not the other way
    from hybrid_jax.models.config_common import FamilyConfig

# What to call each of a config's head_counts() (the counts the tensor size must divide) in an error.
HEAD_FIELDS = {
    "num_attention_heads": "attention heads",
    "linear_num_key_heads": "linear-attention key heads",
    "linear_num_value_heads": "linear-attention value heads",
    "linear_num_heads": "linear-attention heads",
    "index_n_heads": "indexer heads",
    "mamba_num_heads": "Mamba2 heads",
    "n_groups": "Mamba2 groups",
    "o_groups": "output-projection groups",
}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer; got {v!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(f"enable_expert_parallel must be true or false; got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def single_device(self) -> bool:
        return self.world_size == 1

    def describe(self) -> str:
        """The layout in the prefix-cache key's words (a cache written under one layout never hits
        another): e.g. "dp1.tp4.ep" ("replicated" on one device)."""
        if self.single_device:
            return "replicated"
        return f"dp{self.data_parallel_size}.tp{self.tensor_parallel_size}" + (".ep" if self.enable_expert_parallel
                                                                               else "")

    def check(self, cfg: FamilyConfig, n_devices: int) -> None:
        """ConfigError when this layout cannot run `cfg` (a family config) on n_devices devices."""
        if self.world_size != n_devices:
            raise ConfigError(
                f"data_parallel_size x tensor_parallel_size = {self.data_parallel_size} x {self.tensor_parallel_size} "
                f"= {self.world_size} must equal the number of devices ({n_devices}); with one process JAX sees "
                f"{n_devices} device(s)")
        tp = self.tensor_parallel_size
        for field, n in cfg.head_counts().items():
            if n and n % tp:
                raise ConfigError(f"tensor_parallel_size {tp} does not divide the model's {HEAD_FIELDS[field]} "
                                  f"({field} = {n})")
        experts = cfg.routed_experts
        if self.enable_expert_parallel:
            if not experts:
                raise ConfigError("enable_expert_parallel is set but the model has no routed experts")
            if experts % tp:
                raise ConfigError(f"enable_expert_parallel: tensor_parallel_size {tp} does not divide the model's "
                                  f"{experts} routed experts")
