"""Qwen4-Exp's PLE state: per request, what a PLE layer needs of the tokens before a step.

  PLEGroup (ple)  ctx  [L, B, c] int32        the last c = ngram_size - 1 token ids (hashed n-grams reach back c)
                  conv [L, B, S, N * Hd]      the dilated conv's last S = (kernel - 1) * ngram_size inputs

Both are fixed-size rows beside the Gated DeltaNet recurrent group; a prefix checkpoint stores them with it
(STORE_KIND recurrent state: whole per-row state at a boundary). A verify step overwrites them with the state
after its last fed token, so a rejected draft is undone by replay (snapshot + the accepted tokens again).
A fresh row is zeros: positions before the sequence are masked by position, not by what ctx holds.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from cache.group import CacheGroup
from cache.segments import Kind
from pallas_kernels import abi as kernel_abi


@flax.struct.dataclass
class PLEGroup(CacheGroup):
    ctx: jax.Array             # [L, B, c] int32
    conv: jax.Array            # [L, B, S, C]
    layer_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    writer_abi: str = flax.struct.field(pytree_node=False, default=kernel_abi.PLE_STATE.id)

    kind = "ple_state"
    STORE_KIND = Kind.RECURRENT_STATE
    ROW_FIELDS = {"ctx": 1, "conv": 1}
    ROLLBACK = "replay"

    def with_layer_state(self, s: int, ctx: jax.Array, conv: jax.Array) -> "PLEGroup":
        return self.replace(ctx=self.ctx.at[s].set(ctx.astype(self.ctx.dtype)),
                            conv=self.conv.at[s].set(conv.astype(self.conv.dtype)))


def ple_group(layer_ids: tuple[int, ...], batch_size: int, context: int, conv_len: int, channels: int, dtype
              ) -> PLEGroup:
    L = len(layer_ids)
    return PLEGroup(ctx=jnp.zeros((L, batch_size, context), jnp.int32),
                    conv=jnp.zeros((L, batch_size, conv_len, channels), dtype), layer_ids=tuple(layer_ids))
