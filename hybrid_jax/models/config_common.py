"""What every model family's frozen config shares: the layer pattern lookup and EOS parsing."""
from __future__ import annotations


class LayerPattern:
    """Mixin for a config dataclass with a `layer_types` tuple (one mixer name per layer)."""

    layer_types: tuple[str, ...]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers whose mixer is `kind`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def eos_ids(v) -> tuple[int, ...]:
    """config.json's `eos_token_id` (None, an int or a list) -> a tuple of ids."""
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)
