"""Record buffers in the optimizer pipeline (`offload.py`): the record format, cut up for the optimizer."""

from __future__ import annotations

from collections.abc import Sequence

from lohan.runtime.optim import ParamRange
from lohan.store.states import BlockLayout


def param_ranges(block: BlockLayout, decays: Sequence[bool]) -> tuple[ParamRange, ...]:
    """The block's parameters as the optimizer sees them (it knows nothing of the store's layout types)."""
    return tuple(ParamRange(p.offset, p.numel, p.shape, bool(d)) for p, d in zip(block.params, decays, strict=True))
