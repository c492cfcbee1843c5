"""A plan as the text table `hybrid-jax plan` prints."""
from __future__ import annotations

from cache.accounting import KIND_ORDER
from hybrid_jax.plan.shapes import KIND_LABELS

UNBOUNDED = 1 << 26


def _b(x: float) -> str:
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def _kind_rank(k: str):
    order = ("full_kv", "recurrent_state", "conv_state") + KIND_ORDER
    return order.index(k) if k in order else len(order)


def format_plan(p) -> str:
    m, c, r = p.memory, p.capacity, p.roofline
    q = f", {p.quantization} weights" if p.quantization else ""
    lines = [f"plan: {p.model} ({p.model_type}, {p.num_params / 1e9:.2f}B params, {p.dtype}{q}) on {p.topology}"
             f" ({p.num_chips} x {p.chip.name}), split over {p.split} chip{'s' if p.split > 1 else ''}"
             + (" (expert parallel)" if p.expert_parallel and p.split > 1 else ""),
             f"  max_num_seqs {p.max_num_seqs} (decode bucket {p.decode_batch}), max_model_len {p.max_model_len},"
             f" prefill chunk {p.chunk}",
             "",
             f"HBM per chip ({p.chip.name}: {_b(m.capacity)})"]
    row = "  {:<34}{:>14}"
    lines.append(row.format("weights", _b(m.weights)))
    for k in sorted(m.cache_by_kind, key=_kind_rank):
        if m.cache_by_kind[k]:
            lines.append(row.format(f"cache: {KIND_LABELS.get(k, k)}", _b(m.cache_by_kind[k])))
    lines.append(row.format("cache total", _b(m.cache)))
    lines.append(row.format("compiler temporaries", _b(m.temporaries)))
    lines.append(row.format("free", _b(m.free)) + ("" if p.fits else "   DOES NOT FIT"))
    ctx = "any (no per-token cache)" if c.context_at_batch >= UNBOUNDED else f"{c.context_at_batch} tokens"
    lines += ["", "capacity (cache pools given all HBM the weights and temporaries leave)",
              f"  largest batch at {c.context} tokens: {c.batch_at_context}",
              f"  context at batch {c.batch}: {ctx}",
              "",
              f"decode step (batch {p.max_num_seqs}, per chip; compiler cost analysis)",
              f"  FLOPs                {r.decode_flops:.4g}",
              f"  bytes accessed       {_b(r.decode_bytes)}",
              f"  minimum bytes        {_b(r.min_decode_bytes)}  (weights + the batch's cache, read once)",
              f"  accessed / minimum   {r.bytes_over_min:.2f}x",
              *([f"  collectives          {r.decode_collectives:.0f} per step, {_b(r.decode_collective_bytes)} of results"]
                if p.sharded else []),
              "",
              "roofline ESTIMATE per chip (published peaks, not measured)",
              f"  decode  {r.decode_tok_s:,.0f} tok/s ({r.decode_bound}-bound); "
              f"{r.decode_tok_s_at_min:,.0f} tok/s if only the minimum bytes were read",
              f"  prefill {r.prefill_tok_s:,.0f} tok/s ({r.prefill_bound}-bound; chunk of {p.chunk}: "
              f"{r.prefill_flops:.4g} FLOPs, {_b(r.prefill_bytes)} accessed)",
              ""]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
