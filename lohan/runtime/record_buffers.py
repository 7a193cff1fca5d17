"""Record buffers in the optimizer pipeline (`offload.py`): where a unit's sections sit in its buffer, and a
buffer's life as named states.

A pool buffer is taken for one unit (a block's record, or a chunk of it) and goes back once its WRITE is over:

    FREE -> READING -> READY -> UPDATING -> WRITING -> FREE
                                    \\-> HELD --/            write-behind: the WRITE waits for the room
                                    \\-> RESIDENT          a step between durable commits: not written

A resident record's buffer (`plan_resident`) is taken from the pool for the offloader's life and rests in
RESIDENT instead of FREE; a READ its bytes make unnecessary takes it straight to READY. A pass that fails or is
aborted `abandon`s what it holds, from any state: the I/O in flight is waited for first, so no buffer goes back
while the volume still reads or writes it.

Every transition checks its predecessor: a pipeline bug shows up as the unit and the two states, not as a buffer
reused under a pending read (DeepSpeed's `AsyncTensorSwapper` keeps the same states as lists of buffer indices,
unchecked). `Ledger` counts the buffers in each state and the transitions made, for tests and metrics.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from io_engine import AlignedBuffer, BufferPool, Handle
from io_engine.base import wait_all_handles
from lohan.runtime.optim import ParamRange
from lohan.store.states import BlockLayout, StoreLayout, unit_sections, unit_views  # noqa: F401 (re-exported)

Unit = tuple[int, int, int]  # (block, first element, end element) of one READ / ADAM / WRITE


# ----------------------------------------------------------------------------- the record format, cut up
def param_ranges(block: BlockLayout, decays: Sequence[bool]) -> tuple[ParamRange, ...]:
    """The block's parameters as the optimizer sees them (it knows nothing of the store's layout types)."""
    return tuple(ParamRange(p.offset, p.numel, p.shape, bool(d)) for p, d in zip(block.params, decays, strict=True))


class Handles:
    """Several volume requests (a chunk's sections) waited on as one."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        wait_all_handles(self.handles)


# ----------------------------------------------------------------------------- states
class BufState(enum.Enum):
    """Where a record buffer is in the optimizer pipeline (module docstring)."""

    FREE = "free"  # in the pool: no unit, no I/O
    READING = "reading"  # the READ of its unit's P32, m, v is in flight
    READY = "ready"  # those bytes are in memory, checked against the read slot's checksums
    UPDATING = "updating"  # the optimizer updates it and hands its P16 over
    HELD = "held"  # updated; its WRITE waits for the room it will take (write-behind)
    WRITING = "writing"  # the WRITE of its P32, m, v, P16 is in flight
    RESIDENT = "resident"  # a resident record between uses (its bytes may be a committed slot's)


_AFTER: dict[BufState, frozenset[BufState]] = {  # the legal predecessors of each state
    BufState.READING: frozenset({BufState.FREE, BufState.RESIDENT}),
    # from RESIDENT: its bytes are already the read slot's, no READ
    BufState.READY: frozenset({BufState.READING, BufState.RESIDENT}),
    BufState.UPDATING: frozenset({BufState.READY}),
    BufState.HELD: frozenset({BufState.UPDATING}),
    BufState.WRITING: frozenset({BufState.UPDATING, BufState.HELD}),
    BufState.FREE: frozenset({BufState.WRITING, BufState.RESIDENT}),  # from RESIDENT: the offloader closes
    # from FREE: taken from the pool for good; from UPDATING: a step that writes nothing (engine.persist_every)
    BufState.RESIDENT: frozenset({BufState.FREE, BufState.WRITING, BufState.UPDATING}),
}


class Ledger:
    """Buffers in each state now (FREE ones are the pool's and not counted) and the transitions made."""

    def __init__(self) -> None:
        self.now: Counter[BufState] = Counter()
        self.moves: Counter[tuple[BufState, BufState]] = Counter()

    def move(self, old: BufState, new: BufState) -> None:
        if old is not BufState.FREE:
            self.now[old] -= 1
        if new is not BufState.FREE:
            self.now[new] += 1
        self.moves[old, new] += 1

    def counts(self) -> dict[str, int]:
        """{state name: buffers in it} for the states that hold any."""
        return {s.value: n for s, n in self.now.items() if n}


class RecordBuffer:
    """One record (or chunk) buffer taken from the pool: the unit it holds, its I/O in flight, its state."""

    __slots__ = ("buf", "handle", "ledger", "resident", "state", "unit")

    def __init__(self, unit: Unit, buf: AlignedBuffer, ledger: Ledger, resident: bool = False) -> None:
        self.unit = unit
        self.buf = buf
        self.ledger = ledger
        self.resident = resident  # kept across steps: rests in RESIDENT, never goes back to the pool
        self.handle: Handle | Handles | None = None  # the READ or WRITE in flight
        self.state = BufState.FREE
        if resident:
            self.to(BufState.RESIDENT)

    def to(self, new: BufState) -> RecordBuffer:
        if self.state not in _AFTER[new]:
            raise RuntimeError(
                f"record buffer of unit {self.unit} (block, lo, hi): {self.state.name} -> {new.name} is no "
                f"transition of its lifecycle; {new.name} comes only after "
                f"{' or '.join(sorted(s.name for s in _AFTER[new]))}")
        self.ledger.move(self.state, new)
        self.state = new
        return self

    def done(self) -> bool:
        return self.handle is None or self.handle.done()

    def wait(self) -> None:
        """Wait for its I/O; afterwards none is in flight, also when it failed (its error is raised)."""
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.wait()

    def retire(self) -> None:
        """WRITING -> FREE (or RESIDENT) once the WRITE is over; a failed WRITE gives the buffer back too."""
        if self.state is not BufState.WRITING:
            raise RuntimeError(f"record buffer of unit {self.unit}: retired while {self.state.name}, not WRITING")
        try:
            self.wait()
        finally:
            self._rest(self.state)

    def abandon(self) -> None:
        """Back to FREE (or RESIDENT) from any state in flight, once its I/O is over (a failed or aborted pass)."""
        if self.state in (BufState.FREE, BufState.RESIDENT):
            raise RuntimeError(f"record buffer of unit {self.unit}: abandoned while {self.state.name}, not in flight")
        try:
            self.wait()
        finally:
            self._rest(self.state)

    def _rest(self, old: BufState) -> None:
        new = BufState.RESIDENT if self.resident else BufState.FREE
        self.ledger.move(old, new)
        self.state = new
        if not self.resident:
            self.buf.release()


# ----------------------------------------------------------------------------- resident records, write-behind
class ResidentRecords:
    """Record buffers kept across steps (`plan_resident`), taken from the pool for the offloader's life, one per
    pipeline unit of each resident block (a block updated in chunks keeps one buffer per chunk: each chunk keeps its
    own READ, update, WRITE, checksum and state as when it streams, and no buffer of a whole record larger than the
    chunking bounds is ever allocated), and the (slot, update) whose committed bytes each holds (None: not known to
    match any slot; its next READ goes to the SSDs). A skipped, redone, rolled-back or dropped step thus makes them
    read again."""

    def __init__(self, pool: BufferPool, layout: StoreLayout, units: Iterable[Unit], ledger: Ledger) -> None:
        self.bufs: dict[Unit, RecordBuffer] = {}
        self.tags: dict[Unit, tuple[int, int] | None] = {}
        for unit in units:
            i, lo, hi = unit
            buf = pool.acquire(layout.blocks[i].unit(lo, hi).total, block=False)
            self.bufs[unit] = RecordBuffer(unit, buf, ledger, resident=True)
            self.tags[unit] = None

    @property
    def blocks(self) -> list[int]:
        """The blocks whose records stay, in order."""
        return sorted({u[0] for u in self.bufs})

    def __contains__(self, block: int) -> bool:
        return any(u[0] == block for u in self.bufs)

    def get(self, unit: Unit) -> RecordBuffer | None:
        return self.bufs.get(unit)

    def of_block(self, block: int) -> list[RecordBuffer]:
        """The buffers of `block`'s units, first element first (none: not resident)."""
        return [rb for u, rb in sorted(self.bufs.items()) if u[0] == block]

    def holds(self, unit: Unit, slot: int, update: int) -> bool:
        """Whether unit's buffer holds the bytes that optimizer update `update` wrote to `slot`."""
        return self.tags[unit] == (slot, update)

    def written(self, unit: Unit, slot: int, update: int) -> None:
        self.tags[unit] = (slot, update)

    def keep(self, rb: RecordBuffer, slot: int, update: int) -> None:
        """An updated resident buffer kept unwritten (UPDATING -> RESIDENT): it holds update `update` of RAM slot
        `slot`, and no copy of it is on the SSDs until it is persisted."""
        rb.to(BufState.RESIDENT)
        self.tags[rb.unit] = (slot, update)

    def all_hold(self, slot: int, update: int) -> bool:
        """Whether every resident buffer holds update `update` of `slot` (none was updated since, or lost)."""
        return all(t == (slot, update) for t in self.tags.values())

    def forget(self, unit: Unit | None = None) -> None:
        """The buffer of `unit` (of every unit: None) no longer holds any slot's bytes."""
        for u in self.tags if unit is None else [unit]:
            self.tags[u] = None

    def close(self) -> None:
        for rb in self.bufs.values():
            rb.to(BufState.FREE)
            rb.buf.release()
        self.bufs.clear()
        self.tags.clear()


class WriteBehind:
    """Write-behind (`offload.py`): the updates whose WRITE a lazy pass holds back, and its *tail*, the writes
    still in flight when the pass ended, which complete beside the next step's backward.

    The next pass starts at once and waits for the tail per buffer, on its worker thread: before a READ of a block
    the tail still writes (`retire_block`), for room in the pool (`retire_oldest`), and for all of it before its
    own first WRITE (`finish_tail`: the staged commit is made durable then, and the new pass writes the slot that
    commit replaces). Other threads wait for a block's tail writes without touching the buffers (`wait_block`)."""

    def __init__(self, resident: ResidentRecords) -> None:
        self.resident = resident
        self.held: deque[RecordBuffer] = deque()  # held back, oldest first; their WRITE gives room back
        self.held_res: list[RecordBuffer] = []  # resident ones: their WRITE frees no room, it waits for the end
        self.tail: list[RecordBuffer] = []  # oldest first; only the worker retires them
        # per block, the requests of its tail writes, fixed when adopted: what other threads may wait on
        self._handles: dict[int, list[Handle | Handles]] = {}
        self.done = threading.Event()  # set while no tail is in flight
        self.done.set()
        self.error: BaseException | None = None  # a tail write failed: that slot is not what was staged

    def hold(self, rb: RecordBuffer) -> None:
        rb.to(BufState.HELD)
        (self.held_res if rb.resident else self.held).append(rb)

    def fits(self, limit: int) -> bool:
        """Whether a held update's buffer is at most `limit` bytes."""
        return any(rb.buf.capacity <= limit for rb in self.held)

    def take(self, smallest: bool = True, limit: int | None = None) -> RecordBuffer:
        """A held update for its WRITE: the smallest (its room comes soonest), the oldest, or (`limit`) the
        oldest of at most `limit` bytes."""
        if limit is not None:
            k = next(j for j, rb in enumerate(self.held) if rb.buf.capacity <= limit)
        else:
            k = min(range(len(self.held)), key=lambda j: self.held[j].buf.capacity) if smallest else 0
        rb = self.held[k]
        del self.held[k]
        return rb

    def take_all(self) -> list[RecordBuffer]:
        """Every held update (a pass that stopped early gives them back unwritten)."""
        out = [*self.held, *self.held_res]
        self.held.clear()
        self.held_res.clear()
        return out

    def adopt(self, writes: deque[RecordBuffer]) -> None:
        """A lazy pass ended: its writes in flight, failed ones too, become the tail."""
        if self.tail:
            raise RuntimeError("a tail is adopted while the last one is still in flight")
        self.tail = list(writes)
        writes.clear()
        handles: dict[int, list[Handle | Handles]] = {}
        for rb in self.tail:
            if rb.handle is not None:
                handles.setdefault(rb.unit[0], []).append(rb.handle)
        self._handles = handles
        if self.tail:
            self.done.clear()

    def writing(self, block: int) -> bool:
        """Whether a tail write of `block` is still in flight (the worker's view; no waiting)."""
        return any(rb.unit[0] == block and not rb.done() for rb in self.tail)

    def wait_block(self, block: int | None) -> None:
        """Wait until the tail's writes of `block` (of every block: None) are complete, from any thread (the
        buffers stay the worker's to retire). Raises a failed write's error."""
        handles = self._handles  # (the worker replaces it, never changes it)
        if self.done.is_set():
            return
        first: BaseException | None = None
        for h in handles.get(block, []) if block is not None else [h for hs in handles.values() for h in hs]:
            try:  # (a chunk's `Handles` too: each request is waited for, even after one failed)
                h.wait()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def retire_block(self, block: int) -> None:
        """Wait for the tail's writes of `block` and give their buffers back (the worker, before it READs the block
        or updates its resident buffer)."""
        self._retire([rb for rb in self.tail if rb.unit[0] == block])

    def retire_oldest(self) -> None:
        """Wait for the tail's oldest write and give its buffer back (the worker, for room in the pool)."""
        self._retire(self.tail[:1])

    def reap(self) -> None:
        """Give back the buffers of the tail's writes already complete, without waiting."""
        self._retire([rb for rb in self.tail if rb.done()])

    def finish_tail(self) -> None:
        """Wait for every write of the tail and give its buffers back (all of them, even when one failed; the
        first failure is kept in `error` and raised)."""
        self._retire(list(self.tail))

    def _retire(self, rbs: list[RecordBuffer]) -> None:
        """Retire `rbs` (of the tail); after a failure, the whole tail, then raise it."""
        if not rbs:
            return
        first: BaseException | None = None
        for rb in rbs:
            self.tail.remove(rb)
            try:
                rb.retire()
            except BaseException as e:
                first = first or e
        if first is not None:
            for rb in self.tail:
                try:
                    rb.retire()
                except BaseException:  # (the first failure is the one raised)
                    pass
            self.tail = []
            self.error = first
            self.resident.forget()  # their step is dropped: the tags no longer say so
        if not self.tail:
            self._handles = {}
            self.done.set()
        if first is not None:
            raise first
