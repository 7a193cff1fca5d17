"""P16 host buffers in parameter streaming (`params.py`): a block's buffer's life as named, checked states, as
`record_buffers.py` keeps the optimizer's records.

    NEW -> READING -> GATHERING -> STAGED      taken for the block, read from the SSDs (or kept: no READING),
    NEW -> FILLING ----------------> STAGED      gathered (data parallel only); or filled by the optimizer
    STAGED -> IN_USE -> KEPT or FREE             the CPU device: the parameters are views of the host buffer
    STAGED -> split: IN_USE + DRAINING           a separate device: the block in use by its device copy, and
                        DRAINING -> KEPT or FREE     its host buffer, back once the copy has completed
    STAGED -> DRAINING                           staged from another slot, or `release_all`
    NEW -> HANDING_OVER -> KEPT                  an in-backward pass fills it for the next forward (`handover`)
    NEW -> FILLING (filled) -> STAGED            that kept buffer taken back as a provision where the pass turns to
                                                 forward order (`take_handed_over`)

NEW is a buffer just taken for a block (from the pool, or a kept one taken back); KEPT and FREE are the pool's
(kept under (block, slot), or free): the object ends there. A failure or a `release_all` sends any state but
those to FREE. On a separate device, when the compute starts using a block (`acquire`), its entry `split`s in
two: the host buffer goes on DRAINING until its device copy has completed, and the block stays IN_USE with its
device copy only.

Every transition checks its predecessor and names the verb that made it, so a streaming bug shows up as the
block, the state and the verb, not as a buffer reused under a pending read or copy.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from torch import nn

from io_engine import AlignedBuffer


class P16State(enum.Enum):
    """Where a block's P16 host buffer is (module docstring)."""

    NEW = "new"  # taken for the block: nothing started yet
    READING = "reading"  # its read from the SSDs (and the read's hash) in flight
    GATHERING = "gathering"  # data parallel: the other ranks' shards being all-gathered into it
    FILLING = "filling"  # a provision: the optimizer fills it with the block's new P16
    HANDING_OVER = "handing_over"  # an in-backward pass fills it with the block's new P16 for the next forward
    STAGED = "staged"  # its copy to the device is in flight
    IN_USE = "in_use"  # the block's parameters are the module's (views of the device copy)
    DRAINING = "draining"  # no longer needed on the host; waits for its device copy to complete
    KEPT = "kept"  # back in the pool under (block, slot), for a later use of the same bytes
    FREE = "free"  # back in the pool


_S = P16State
_AFTER: dict[P16State, frozenset[P16State]] = {  # the legal predecessors of each state
    _S.READING: frozenset({_S.NEW}),
    _S.GATHERING: frozenset({_S.NEW, _S.READING}),
    _S.FILLING: frozenset({_S.NEW}),
    _S.HANDING_OVER: frozenset({_S.NEW}),
    _S.STAGED: frozenset({_S.NEW, _S.READING, _S.GATHERING, _S.FILLING}),
    _S.IN_USE: frozenset({_S.STAGED}),
    _S.DRAINING: frozenset({_S.STAGED}),
    _S.KEPT: frozenset({_S.IN_USE, _S.DRAINING, _S.HANDING_OVER}),
    _S.FREE: frozenset(set(P16State) - {_S.KEPT, _S.FREE}),
}
ENDS = frozenset({_S.KEPT, _S.FREE})


class P16Buffer:
    """A block's P16 host buffer (None: none, e.g. a provision not yet given room, a block in use whose host
    buffer drains apart) and what is in flight on it: the read, the all-gather, the copy to the device."""

    __slots__ = ("block", "slot", "buf", "state", "handle", "work", "transfer", "params", "filled", "busy",
                 "cancelled", "ready")

    def __init__(self, block: int, slot: int, buf: AlignedBuffer | None = None) -> None:
        self.block = block
        self.slot = slot  # the slot its bytes are (or will be) the P16 of
        self.buf = buf
        self.state = _S.NEW
        self.handle: Any = None  # READING: the read (and its hash)
        self.work: Any = None  # GATHERING: the all-gather
        self.transfer: Any = None  # STAGED, IN_USE, DRAINING: the copy to the device
        self.params: list[nn.Parameter] = []  # IN_USE: the module's parameters
        self.filled = 0  # FILLING, HANDING_OVER: elements filled in
        self.busy = False  # FILLING: an offer is filling it (release_all leaves the buffer to that offer)
        self.cancelled = False  # FILLING: no longer wanted; the busy offer gives it back
        self.ready = threading.Event()  # FILLING: every element is in

    def to(self, new: P16State, verb: str) -> P16Buffer:
        """Move to `new` (`verb`: what moves it, for the message of an illegal transition); KEPT keeps the host
        buffer under (block, slot) in its pool and FREE gives it back."""
        if self.state not in _AFTER[new]:
            raise RuntimeError(
                f"P16 buffer of block {self.block} (slot {self.slot}): {verb} while {self.state.name} would move "
                f"it to {new.name}, which comes only after {' or '.join(sorted(s.name for s in _AFTER[new]))}")
        self.state = new
        if new in ENDS and self.buf is not None:
            buf, self.buf = self.buf, None
            if new is _S.KEPT:
                buf.keep((self.block, self.slot))
            else:
                buf.release()
        return self

    def split(self) -> P16Buffer:
        """A STAGED block's compute starts (separate device): its host buffer goes on in a twin, DRAINING until
        the copy completes, and this entry goes IN_USE with the device copy only."""
        twin = P16Buffer(self.block, self.slot, self.buf)
        twin.state, twin.transfer = self.state, self.transfer
        twin.to(_S.DRAINING, "acquire")
        self.buf = None
        self.to(_S.IN_USE, "acquire")
        return twin
