"""Context-parallel prefill of the ragged linear-attention mixers: Gated DeltaNet, KDA and Mamba2, their causal
convs included, over a packed batch split by position over 8 CPU devices (`context_axis`), give one device's
outputs, conv states and recurrent states (context_parallel_layers_worker.py, in a subprocess)."""
from __future__ import annotations

from multi_device import run_worker


def test_each_mixer_split_over_eight_devices_gives_one_devices_outputs_and_states():
    res = run_worker("context_parallel_layers_worker.py")
    assert set(res) == {"gdn", "kda", "mamba2"}
    for name, r in res.items():
        # a sequence through four spans, one starting on a span's first row, one shorter than the conv's window
        assert max(r["split"].values()) < 2e-6, (name, r)
        # the control, each span alone: far off in every figure, so the halo and the carried state are tested
        assert min(r["unjoined"].values()) > 1e-2, (name, r)
