"""`hybrid-jax tune` (pallas_kernels/tuning.py): the search scores each candidate by its compiled program
for a TPU chip (libtpu, no TPU), never picks one the compiler refuses or one worse than the hand-picked
block sizes, and the kernel reads the table it writes for the chip it is lowered for, and only for it."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from hybrid_jax.cli import main
from pallas_kernels import tuning
from pallas_kernels.ragged_paged_attention import ops
from pallas_kernels.ragged_paged_attention import tune as rpa_tune
from pallas_kernels.ragged_paged_attention.tuned_block_sizes import BlockSizes, tuned_block_sizes

try:
    import libtpu  # noqa: F401
    HAVE_LIBTPU = True
except ImportError:
    HAVE_LIBTPU = False
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu (the TPU compiler) is not installed")

KEY = "bfloat16:hkv2:g8:d256:ps64"
WORKLOADS = rpa_tune.workloads


@pytest.fixture(autouse=True)
def no_shipped_tables(tmp_path, monkeypatch):
    """Each test starts from an empty shipped table (its own directory), so what it writes is all there is."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tuning, "SHIPPED_DIR", str(shipped))
    monkeypatch.delenv(tuning.TABLE_DIR_ENV, raising=False)
    return shipped


def _v6e():
    from hybrid_jax.plan.chips import topology  # noqa: PLC0415
    return topology("v6e:2x2")


def _cand(pages, queries):
    return {"num_kv_pages_per_block": pages, "num_queries_per_block": queries}


def _only(*names):
    return lambda key: [w for w in WORKLOADS(key) if w.name in names]


@needs_libtpu
def test_search_scores_compiled_programs_and_never_picks_worse_than_hand(monkeypatch):
    monkeypatch.setattr(rpa_tune, "workloads", _only("prefill", "decode"))    # fewer programs to compile
    topo = _v6e()
    hand = rpa_tune.hand_picked(KEY)
    assert hand == _cand(8, 32)                  # the rule's: 512 keys a block, 256 rows per kv head
    r = tuning.search("ragged_paged_attention", KEY, chip="v6e", device=topo.device,
                      peak_flops=topo.chip.peak_bf16_flops, hbm_bandwidth=topo.chip.hbm_bandwidth,
                      candidates=[_cand(4, 16), _cand(8, 128)])
    by = {(json.dumps(s.candidate, sort_keys=True), s.workload): s for s in r.scores}
    sums = {}
    for (cand, _), s in by.items():      # each figure is the compiled program's roofline plus its steps
        assert s.error is None and s.flops > 0 and s.nbytes > 0 and s.steps > 0
        assert s.seconds == pytest.approx(max(s.flops / topo.chip.peak_bf16_flops,
                                              s.nbytes / topo.chip.hbm_bandwidth) + s.steps * tuning.STEP_SECONDS)
        sums[cand] = sums.get(cand, 0.0) + s.seconds
    assert r.best_seconds == min(sums.values()) <= r.hand_seconds and r.best == _cand(8, 128)
    assert r.hand == hand and r.hand_seconds == sums[json.dumps(hand, sort_keys=True)]
    # the compiled cost counts a prefill chunk's span once per query tile: longer tiles read less
    prefill = {json.loads(c)["num_queries_per_block"]: s.nbytes for (c, w), s in by.items() if w == "prefill"}
    assert prefill[128] < prefill[32] < prefill[16]
    # a decode batch has no prefill tiles: one program per key block, not per candidate
    decode = [s for s in r.scores if s.workload == "decode" and s.candidate["num_kv_pages_per_block"] == 8]
    assert len({s.seconds for s in decode}) == 1 and len(decode) == 2
    text = tuning.format_result(r)
    assert "<- best" in text and "<- hand-picked" in text and "best / hand-picked:" in text


@needs_libtpu
def test_a_candidate_the_compiler_refuses_is_reported_and_never_chosen(monkeypatch):
    monkeypatch.setattr(rpa_tune, "workloads", _only("decode"))
    topo = _v6e()
    # key blocks of 128 pages of 64 tokens: their double-buffered K and V alone are 32 MiB, past the scoped VMEM
    too_big = _cand(128, 16)
    r = tuning.search("ragged_paged_attention", KEY, chip="v6e", device=topo.device,
                      peak_flops=topo.chip.peak_bf16_flops, hbm_bandwidth=topo.chip.hbm_bandwidth,
                      candidates=[too_big])
    refused = [s for s in r.scores if s.candidate == too_big]
    assert len(refused) == 1 and "vmem" in refused[0].error.lower() and refused[0].seconds == float("inf")
    assert r.best == r.hand and r.best_seconds < float("inf")
    assert "refused by the compiler" in tuning.format_result(r)
    # nothing that compiles: an error, not a table entry (the refusal itself as above, not compiled again)
    monkeypatch.setattr(tuning, "_score", lambda _m, _k, cand, w, *a: dataclasses.replace(refused[0], candidate=cand,
                                                                                          workload=w.name))
    with pytest.raises(tuning.TuningError, match="(?i)no candidate compiles for v6e: .*vmem"):
        tuning.search("ragged_paged_attention", KEY, chip="v6e", device=topo.device,
                      peak_flops=topo.chip.peak_bf16_flops, hbm_bandwidth=topo.chip.hbm_bandwidth,
                      candidates=[too_big])


def _table(tmp_path, monkeypatch, entry):
    path = tuning.write_entries("ragged_paged_attention", "v6e", {KEY: entry}, str(tmp_path / "user"))
    monkeypatch.setenv(tuning.TABLE_DIR_ENV, str(tmp_path / "user"))
    return path


def test_the_kernel_reads_the_tuned_entry_of_its_chip_only(tmp_path, monkeypatch):
    _table(tmp_path, monkeypatch, _cand(4, 128))
    kw = dict(pages_per_seq=128, num_tokens=2048, num_kv_heads=2)
    assert tuned_block_sizes(jnp.bfloat16, 8, 256, 64, chip="v6e", **kw) == BlockSizes(4, 128, 1)
    hand = BlockSizes(8, 32, 1)
    assert tuned_block_sizes(jnp.bfloat16, 8, 256, 64, chip="v5e", **kw) == hand          # another chip's
    assert tuned_block_sizes(jnp.bfloat16, 8, 256, 64, chip=None, **kw) == hand           # no chip: the CPU
    assert tuned_block_sizes(jnp.bfloat16, 8, 256, 32, chip="v6e", **kw) != BlockSizes(4, 128, 1)   # another key
    # explicit arguments still win, and every entry is clamped to the call
    assert tuned_block_sizes(jnp.bfloat16, 8, 256, 64, chip="v6e", num_queries_per_block=16, **kw).num_queries_per_block == 16
    assert tuned_block_sizes(jnp.bfloat16, 8, 256, 64, chip="v6e", pages_per_seq=2, num_tokens=64,
                             num_kv_heads=2) == BlockSizes(2, 64, 1)
    # the user's table over the shipped one, entry by entry
    other = KEY.replace("ps64", "ps32")
    tuning.write_entries("ragged_paged_attention", "v6e", {KEY: _cand(16, 16), other: _cand(2, 16)},
                         tuning.SHIPPED_DIR)
    assert tuning.lookup("ragged_paged_attention", "v6e", KEY) == _cand(4, 128)
    assert tuning.lookup("ragged_paged_attention", "v6e", other) == _cand(2, 16)
    monkeypatch.delenv(tuning.TABLE_DIR_ENV)
    assert tuning.lookup("ragged_paged_attention", "v6e", KEY) == _cand(16, 16)
    # a malformed table is an error naming its path
    monkeypatch.setenv(tuning.TABLE_DIR_ENV, str(tmp_path / "user"))
    (tmp_path / "user" / "ragged_paged_attention.json").write_text("[1, 2]")
    with pytest.raises(tuning.TuningError, match="ragged_paged_attention.json"):
        tuning.lookup("ragged_paged_attention", "v6e", KEY)


@needs_libtpu
def test_a_program_lowered_for_the_chip_takes_its_tuned_tiles(tmp_path, monkeypatch):
    """End to end: the op lowered for a v6e device under target_chip (as the plan compiles) reads the table:
    its 128-row query tiles read the prefill chunk's span a quarter as often as the hand-picked 32-row ones."""
    _table(tmp_path, monkeypatch, _cand(8, 128))
    device = _v6e().device
    wl = rpa_tune.workloads(KEY)[0]
    _, args = rpa_tune.program(KEY, rpa_tune.hand_picked(KEY), wl)
    sh = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args]

    def bytes_for(chip):
        with tuning.target_chip(chip):
            fn = jax.jit(lambda *a: ops.ragged_paged_attention(*a, sm_scale=0.0625, impl="pallas"))
            return fn.lower(*args).compile().cost_analysis()["bytes accessed"]
    with tuning.recording() as seen:
        tuned, hand = bytes_for("v6e"), bytes_for("v5e")        # v5e: no entry, the hand-picked tiles
    assert tuned < 0.6 * hand, (tuned, hand)
    assert seen == [tuning.Lookup("ragged_paged_attention", "v6e", KEY, True),
                    tuning.Lookup("ragged_paged_attention", "v5e", KEY, False)]


def test_the_plan_notes_which_keys_ran_tuned_and_how_to_tune_the_rest():
    from hybrid_jax.plan.planner import _block_size_notes  # noqa: PLC0415
    other = KEY.replace("ps64", "ps16")
    notes = _block_size_notes([tuning.Lookup("ragged_paged_attention", "v6e", KEY, True),
                               tuning.Lookup("ragged_paged_attention", "v6e", other, False),
                               tuning.Lookup("ragged_paged_attention", "v6e", other, False)], "v6e:2x4")
    assert notes == (f"block sizes from the tuned tables: ragged_paged_attention {KEY}",
                     f"hand-picked block sizes for ragged_paged_attention {other} (no tuned entry for v6e): "
                     f"`hybrid-jax tune --topology v6e:2x4 --kernel ragged_paged_attention --key {other}` tunes them")
    assert _block_size_notes([], "v6e:2x4") == ()


def test_tune_cli_errors_name_the_problem(capsys):
    assert main(["tune", "--topology", "v6e:2x2", "--kernel", "no_such_kernel"]) == 2
    assert "no tunable kernel 'no_such_kernel'" in capsys.readouterr().err
    if HAVE_LIBTPU:
        assert main(["tune", "--topology", "v6e:2x2", "--key", "bf16-heads-2"]) == 2
        assert "is not <kv dtype>:hkv<H>:g<G>:d<D>:ps<P>" in capsys.readouterr().err
    assert main(["tune", "--topology", "v9x:2x2"]) == 2
    assert "unknown TPU chip 'v9x'" in capsys.readouterr().err


@needs_libtpu
def test_tune_cli_writes_the_table_the_kernel_then_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rpa_tune, "PAGES", (8,))
    monkeypatch.setattr(rpa_tune, "QUERIES", (32, 128))
    monkeypatch.setattr(rpa_tune, "workloads", _only("prefill"))
    monkeypatch.setenv(tuning.TABLE_DIR_ENV, str(tmp_path / "user"))
    assert main(["tune", "--topology", "v6e:2x2", "--key", KEY]) == 0
    out = capsys.readouterr().out
    assert "best / hand-picked:" in out and f"wrote 1 v6e entries to {tmp_path / 'user'}" in out
    entry = json.loads((tmp_path / "user" / "ragged_paged_attention.json").read_text())["v6e"][KEY]
    assert entry == _cand(8, 128)            # a 2,048-token chunk reads its span 4x less often in 128-row tiles
    got = tuned_block_sizes(jnp.bfloat16, 8, 256, 64, pages_per_seq=128, num_tokens=2048, num_kv_heads=2,
                            chip="v6e")
    assert (got.num_kv_pages_per_block, got.num_queries_per_block) == (8, 128)
