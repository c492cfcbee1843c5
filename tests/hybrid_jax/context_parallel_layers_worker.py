"""Worker of test_context_parallel_layers.py, on 8 CPU devices: the ragged linear-attention mixers (Gated
DeltaNet, KDA, Mamba2 with their causal convs) over a packed batch on one device, and split by position over
8 with `context_axis`; prints one RESULT line of relative RMS errors per mixer (output, conv and recurrent
states) and the same for a control that joins nothing between the spans."""
from __future__ import annotations

import json

from multi_device import eight_devices

eight_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hybrid_jax.layers.gated_deltanet import gated_deltanet_ragged  # noqa: E402
from hybrid_jax.layers.kimi_delta_attention import kimi_delta_attention_ragged  # noqa: E402
from hybrid_jax.layers.mamba2 import mamba2_mixer_ragged  # noqa: E402
from hybrid_jax.models import get_model  # noqa: E402
from hybrid_jax.models.config_common import config_from_hf_dict  # noqa: E402
from hybrid_jax.models.nemotron_h_params import mamba_dims  # noqa: E402

SPAN = 24
N = 8 * SPAN
# a sequence through four spans, one starting on a span's first row, one of 2 rows (< the conv's W - 1 = 3,
# inside a span), an empty one, and rows of no sequence at the end
CU = [0, 70, 72, 72, 96, 180]
COMMON = dict(vocab_size=97, hidden_size=32, max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
              pad_token_id=None, initializer_range=0.2)
MIXERS = {
    "gdn": (dict(COMMON, model_type="qwen3_next", intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=["linear_attention"]),
            "gdn"),
    "kda": (dict(COMMON, model_type="kimi_linear", intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=12, num_experts=8, num_experts_per_token=2, first_k_dense_replace=1,
                 linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1],
                                     "full_attn_layers": []}), "kda"),
    "mamba2": (dict(COMMON, model_type="nemotron_h", hybrid_override_pattern="M", num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                    n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16, n_routed_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24),
               "mamba"),
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def mixer(name, cfg):
    if name == "gdn":
        kw = dict(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                  head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim, eps=cfg.rms_norm_eps,
                  impl="xla")
        return lambda *a, **c: gated_deltanet_ragged(*a, **kw, **c)
    if name == "kda":
        kw = dict(num_heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim, eps=cfg.rms_norm_eps, impl="xla")
        return lambda *a, **c: kimi_delta_attention_ragged(*a, **kw, **c)
    return lambda *a, **c: mamba2_mixer_ragged(*a, dims=mamba_dims(cfg), impl="xla", **c)


def main():
    rng = np.random.default_rng(0)
    cu = jnp.asarray(CU, jnp.int32)
    t = np.arange(N)
    seq = jnp.asarray(np.clip(np.searchsorted(np.asarray(CU[1:]), t, side="right"), 0, len(CU) - 2), jnp.int32)
    valid = jnp.asarray(t < CU[-1])
    mesh = Mesh(np.array(jax.devices()), ("cp",))
    tok = P("cp")
    res = {}
    for name, (spec, key) in MIXERS.items():
        cfg = config_from_hf_dict(spec)
        lp = next(lp[key] for lp in get_model(cfg.model_type).init_params(cfg, seed=1)["layers"] if key in lp)
        run = mixer(name, cfg)
        x = jnp.asarray(rng.standard_normal((N, cfg.hidden_size)), jnp.float32)
        conv_w = lp["conv"].shape
        C = conv_w[-1]
        S = len(CU) - 1
        conv0 = jnp.asarray(rng.standard_normal((S, conv_w[0] - 1, C)), jnp.float32)
        ssm0 = jnp.asarray(0.1 * rng.standard_normal(_ssm_shape(name, cfg, S)), jnp.float32)
        one = run(lp, x, seq, valid, cu, conv0, ssm0)
        out = {}
        for label, axis in (("split", "cp"), ("unjoined", None)):
            def body(x, seq, valid, cu, conv0, ssm0, axis=axis):
                if axis is None:            # control: each span alone, its batch's boundaries clipped to it
                    lo = jax.lax.axis_index("cp") * SPAN
                    o, _, _ = run(lp, x, seq, valid, jnp.clip(cu - lo, 0, SPAN), conv0, ssm0)
                    return o, conv0, ssm0
                return run(lp, x, seq, valid, cu, conv0, ssm0, context_axis=axis)
            got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, P(), P(), P()),
                                        out_specs=(tok, P(), P()), check_vma=False))(x, seq, valid, cu, conv0, ssm0)
            out[label] = {"o": rel(got[0], one[0]), "conv": rel(got[1], one[1]), "ssm": rel(got[2], one[2])}
        res[name] = out
    print("RESULT " + json.dumps(res))


def _ssm_shape(name, cfg, S):
    if name == "gdn":
        return (S, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    if name == "kda":
        return (S, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim)
    return (S, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)


if __name__ == "__main__":
    main()
