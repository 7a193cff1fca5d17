"""Active gradient offloading (paper §IV-C, Fig. 3): the CPU optimizer consumes each block's
gradients while the device continues backward on the blocks before it.

Per block i:  READ(i) = P32, m, v from the current slot;  ADAM(i) = CPU AdamW, new P16;
WRITE(i) = P32, m, v, P16 to the next slot (one sequential request each way).

Modes:
- ``serial``: nothing happens until backward is over, then the blocks are updated with READs
  prefetched one block ahead (the ZeRO-Infinity way: overlap inside the optimizer, none with backward, and
  the next step's forward starts after it: the engine gives serial passes no next forward to run beside).
- ``naive``: as each block's gradients arrive, READ(i) -> ADAM(i) -> WRITE(i), one after the other.
- ``optimized``: READ(i-1) is issued before WRITE(i), so WRITE(i) overlaps ADAM(i-1) and the SSD
  reads and writes, CPU Adam and device backward all proceed at once (Fig. 3b).

`GradOffloader` lives as long as the engine and owns one worker thread; each step's `begin_step` makes an
`UpdatePass` (the step's hyper-parameters, slots, gate, gradients, checksums and buffers in flight) that the
worker runs unit by unit as a READ step, an update step and an emit step. The fused AdamW kernel and the I/O
release the GIL. The worker's serial chain is AdamW alone: a READ's bytes are hashed on a verify thread as soon as
it completes (the worker only compares the hash with the commit's before the update), and an updated record's
on a sum thread while its WRITE is in flight (`hasher.py`); a buffer goes back only once its hash job is over.
Memory is bounded by the record pool (`max_inflight_blocks` records, plus the resident and read-ahead rooms of
`lohan.plan.pools`): a READ waits for a buffer when the pipeline is full, which also bounds the writes in flight.
In optimized mode the READs run ahead of the gradients while the pool has room; a deferred pass (its update
waits for the global norm) so reads during backward as many records as the read-ahead room
(`readahead_mem`) holds, and only the rest after it. Each buffer's life (READING, READY,
UPDATING, HELD, WRITING, back to FREE or RESIDENT) is a checked state machine, `record_buffers.py`; the optimizer gets
flat P32, m, v, P16 views cut from a buffer and never sees the record format.

Write-behind (`begin_step(lazy=True)`, a deferred pass the next forward follows; `record_buffers.WriteBehind`): once
the gate is open, an updated record's WRITE is held back (HELD) until its buffer is needed for a READ, so the
READs the next forward waits for have the SSDs first; once no READ is left to come (the read-ahead room held them
all) the WRITEs go out at once, and the writes still in flight when the pass ends (or not yet reaped) form the
*tail*: they complete while the next step's backward runs, their buffers stay WRITING until the next pass (or
`drain_tail`) retires them. The next pass starts at once and waits per buffer: a READ of a block the tail still
writes waits for that block's writes, a buffer of the tail is reused once its write retired, and the pass's
first WRITE waits for the whole tail, then the `before` hook makes the step's staged commit durable (the pass
writes the slot the commit before it names). `wait_tail` lets readers of that slot (the P16 of a block) wait for
their block's writes; `tail_done` is set once none is in flight.

Resident records (`lohan.plan.pools.plan_resident`, `record_buffers.ResidentRecords`): the record buffers of some blocks stay in the
pool from one step to the next (a block updated in chunks: one buffer per chunk, each a unit as when it streams). Each durable step still WRITEs them (the commit needs every record on the SSDs),
but the next step finds their bytes in memory and skips their READ; with every record resident, the steps between
durable ones (`engine.persist_every`, `begin_step(persist=False)`) write nothing: each updated buffer holds the
state of a RAM slot (`store.states.RAM_SLOTS`), and `persist_resident` writes them all out between steps. The pool (`pools.record_pool_bytes`) is the least
that streams the other records through `max_inflight_blocks` buffers while the records bigger than those stay
(a tied embedding's, 3.5x a layer's: one buffer for it instead of `max_inflight_blocks`), never more than
`max_inflight_blocks` of the largest; `resident_mem` gives it more, and the room beyond the streaming buffers
holds more resident blocks. A buffer is tagged with the (slot, update) whose bytes it holds; the next pass uses
it only when its read slot and update follow that tag, so a skipped, redone, rolled-back or dropped step makes
its buffers read from the SSDs again.

A block whose record is larger than the store's checksum unit (`StateStore.chunk_elems` elements; a 175B
layer's record is 25 GB) goes through the pipeline in chunks of that many elements: the same READ / ADAM /
WRITE per chunk, on the P32, m, v and P16 sub-ranges of the record, so the optimizer's memory is bounded by
chunks, not by the largest block, and each READ and WRITE is checked whole.

Compressed state formats (`--state-format`): a unit's buffer holds the format's sections (`store.states.UnitViews`),
and its update decodes, runs AdamW and encodes `pools.FORMAT_ELEMS` elements at a time (`format_adamw.adamw_unit_`);
8-bit moments need every chunk cut on each parameter's 256-element grid (checked when the offloader is built).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from io_engine import AlignedBuffer, BudgetExceededError, BufferPool, Handle
from io_engine.base import align_up
from io_engine.priority import Priority
from lohan.config import MODES
from lohan.crashpoints import crashpoint
from lohan.plan import pools
from lohan.plan.pools import (  # noqa: F401  (the record geometry and pool sizes, defined in the planning layer)
    FORMAT_ELEMS,
    UPCAST_ELEMS,
    chunk_record_bytes,
    plan_resident,
    record_pool_bytes,
)
from lohan.plan.records import chunk_refusal
from lohan.runtime.format_adamw import adamw_unit_
from lohan.runtime.hasher import Hashed, Hasher
from lohan.runtime.optim import AdamWHyper, adamw_block_, adamw_chunk_, adamw_upcast_
from lohan.runtime.param_grads import ParamGrads
from lohan.runtime.record_buffers import (
    BufState,
    Handles,
    Ledger,
    RecordBuffer,
    ResidentRecords,
    Unit,
    WriteBehind,
    param_ranges,
    unit_sections,
    unit_views,
)
from lohan.store.gradstash import GradStash, StashedGrad
from lohan.store.integrity import Sums, tensor_hash
from lohan.store.states import StateStore, StoreLayout, UnitViews, unit_sums

_ABORT = -1  # queue marker: the compute side failed, stop the step

Grad = AlignedBuffer | ParamGrads | StashedGrad
"""A block's gradient handed to the pipeline: a host buffer, autograd's own per-parameter tensors (a CPU compute
device, `lohan.plan.pools.hands_over_grads`), or its place in the stash; each has `tensor` and `release`."""

Provide = Callable[[int, int, int, torch.Tensor, bool], None]
"""provide(block, lo, hi, p16, resident): the new P16 of elements lo..hi of a block, handed over right after its
update (before its WRITE completes); called on the worker thread, in pipeline order. ``resident``: the unit's
record stays in memory and is tagged with the slot and update it now holds (`ResidentRecords.holds`), so the
receiver may copy the P16 from it where it is used instead of here, on the optimizer's serial path."""


def upcast_bytes(layout: StoreLayout, chunk_elems: int | None, grad_dtype: torch.dtype | str | int,
                 clip: bool = False) -> int:
    """`lohan.plan.pools.upcast_bytes` at this module's `UPCAST_ELEMS`, the pieces `_fp32` works in (the scratch
    and the pieces change together when a test shrinks them)."""
    return pools.upcast_bytes(layout, chunk_elems, grad_dtype, clip, limit=UPCAST_ELEMS)


class ClipGate:
    """The coefficient the optimizer multiplies this step's gradients by (`clip_grad_norm_`'s clamped
    coefficient, a 0-d fp32 tensor): given at once (clipping off, or speculated), or once backward has
    ended and the global norm is known (deferred). `cancel` discards the step: the pipeline stops."""

    def __init__(self, coef: float | None = 1.0) -> None:
        self._ready = threading.Event()
        self.coef: torch.Tensor | None = None
        self.cancelled = False
        if coef is not None:
            self.open(torch.tensor(coef, dtype=torch.float32))

    @property
    def deferred(self) -> bool:
        return not self._ready.is_set()

    def open(self, coef: torch.Tensor) -> None:
        self.coef = coef
        self._ready.set()

    def cancel(self) -> None:
        self.cancelled = True
        self._ready.set()

    @classmethod
    def known(cls, coef: torch.Tensor) -> ClipGate:
        """A gate open from the start at `coef` (a replayed step that clipped, lohan.runtime.held)."""
        gate = cls(None)
        gate.open(coef)
        return gate

    @classmethod
    def discarded(cls) -> ClipGate:
        """A gate of a step known to be skipped (a replayed failure, lohan.runtime.held): nothing is updated."""
        gate = cls(None)
        gate.cancel()
        return gate

    def wait(self) -> torch.Tensor | None:
        """The coefficient (None: the step was discarded)."""
        self._ready.wait()
        return None if self.cancelled else self.coef


class UpdatePass:
    """One optimizer pass (`GradOffloader.begin_step`): its parameters, the gradients handed over, the buffers
    it holds, and the READ / update / emit steps it runs on the worker thread for each unit.

    Every buffer the pass holds is in `reads` (READING or READY, not yet reached), `in_hand` (the unit being
    updated), `writes` (WRITING, oldest first) or the offloader's write-behind (HELD); `_cleanup` gives all of
    them back however the pass ends.
    """

    def __init__(self, owner: GradOffloader, update: int, hyper: AdamWHyper, order: list[int], read_slot: int,
                 write_slot: int, gate: ClipGate, keep: bool, provide: Provide | None, lazy: bool,
                 persist: bool = True) -> None:
        self.ago = owner
        self.update = update  # the optimizer update this pass makes (1-based): the bias correction's step
        self.hyper = hyper
        self.read_slot, self.write_slot = read_slot, write_slot
        self.gate = gate
        self.keep = keep  # gradients go to the stash after use, for `begin_redo`
        self.provide = provide
        self.lazy = lazy  # write-behind
        # False: a step between durable commits (`engine.persist_every`): every record is resident, is updated
        # in its buffer and written nowhere; `write_slot` is a RAM slot (store.states.RAM_SLOTS)
        self.persist = persist
        self.units = [u for i in order for u in owner.units(i)]
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # (block, gradient) from the compute thread
        self.backward_done = threading.Event()
        self.arrived: dict[int, Grad] = {}  # gradients that came before their turn
        # per block, per unit's first element: the WRITE and the hash of its [state, p16] checksums (`_issue_write`)
        self.sums: dict[int, dict[int, Hashed]] = {}
        self.reads: dict[Unit, RecordBuffer] = {}
        self.in_hand: RecordBuffer | None = None
        self.writes: deque[RecordBuffer] = deque()
        self.error: BaseException | None = None  # the pass failed (surfaced by submit / finish)
        # the last pass's staged commit made durable (`GradOffloader.begin_step`), once its tail is written and
        # before this pass's first WRITE (`_settle_tail`)
        self.before: Callable[[], None] | None = None
        self.settled = False
        # the tail in forward order (`follow`): what the engine asked for, under this lock, and the answer
        self._follow_lock = threading.Lock()
        self._follow: Callable[[list[int]], Provide | None] | None = None
        self._followed = threading.Event()
        self._follow_blocks: list[int] | None = None
        self._units_done = False

    # ----------------------------------------------------------------- the pass
    def run(self) -> None:
        t_start = time.perf_counter()
        try:
            # write-behind: the writes still in flight complete beside the next step's backward
            if self._pipeline() and self.lazy:
                self.ago.behind.adopt(self.writes)
        finally:  # also after an abort or a failure
            try:
                self._cleanup()
            finally:
                self.ago.busy_s += time.perf_counter() - t_start

    def _pipeline(self) -> bool:
        """READ, update and emit every unit in order; False if the pass stopped early (an aborted or discarded
        step)."""
        if self.gate.cancelled:  # discarded from the start: each gradient let go as it comes (backward waits for room)
            return self._let_go()
        if self.ago.mode == "serial":
            self.backward_done.wait()
        prefetch = self.ago.mode in ("optimized", "serial")
        if prefetch:
            self._issue_read(self.units[0])
        grad: Grad | None = None
        current = None
        try:
            for k in range(len(self.units)):
                if self.units[k][0] != current:  # the block's first unit: wait for its gradients
                    if grad is not None:
                        self._done_with(current, grad)
                        grad = None
                    self._answer_follow(k)  # (may reorder units k, k+1, ...)
                    if self.ago.read_ahead:  # reads need no gradient: use the wait to fetch further ahead
                        self._read_ahead(k)
                    grad, current = self._take_grad(self.units[k][0]), self.units[k][0]
                    if grad is None:
                        return False
                rb = self._read(k, self.units[k], prefetch)
                if not self._update(rb, grad):
                    return False
                self._emit(rb, reads_pending=self._reads_pending(k))
            self._answer_follow(len(self.units))  # every unit updated: nothing left to follow
        finally:
            if grad is not None:
                self._done_with(current, grad)
            self._answer_follow(None)  # (stopped early: the engine must not run a forward beside a failed pass)
        while self.ago.behind.held:
            self.release_held(smallest=False)
        while self.ago.behind.held_res:
            self._issue_write(self.ago.behind.held_res.pop(0))
        if not self.lazy:  # (a lazy pass leaves all of its writes in flight to the tail, failed ones too)
            self._reap(wait=True)
        return True

    def _read(self, k: int, unit: Unit, prefetch: bool) -> RecordBuffer:
        """The READ step: unit k's buffer once its P32, m, v are in memory and checked (READY), with the READs
        after it sent out."""
        ago = self.ago
        if not prefetch or unit not in self.reads:  # (a prefetch finds no room when the pool is one record,
            self._issue_read(unit)                   # held by the unit before)
        rb = self.in_hand = self.reads.pop(unit)
        if rb.state is BufState.READING:  # (not a resident record whose bytes never left memory)
            t0 = time.perf_counter()
            handle = rb.handle
            rb.wait()  # the READ, and its hash (`_issue_read`) unless done while the unit before updated
            ago.read_wait_s += time.perf_counter() - t0
            if isinstance(handle, Hashed):  # checked here, before the update uses the bytes
                ago.store.check_unit(unit[0], unit[1], "state", handle.value(), slot=self.read_slot)
            rb.to(BufState.READY)
        if prefetch and k + 1 < len(self.units) and self.units[k + 1] not in self.reads:
            self._issue_read(self.units[k + 1], wait=False)  # READ(i-1) goes out before WRITE(i) (Fig. 3b)
        if ago.read_ahead and self.gate.deferred:  # a deferred update: read on meanwhile
            self._read_ahead(k + 1)
        return rb

    def _update(self, rb: RecordBuffer, grad: Grad) -> bool:
        """The update step: AdamW on the unit once the gate is open (False: the step was discarded)."""
        ago = self.ago
        coef = self.gate.wait()  # deferred: until backward has ended and the norm is known
        if coef is None:  # the step was discarded (non-finite gradients, or an abort)
            return False
        i, lo, hi = rb.unit
        b = ago.store.layout.blocks[i]
        rb.to(BufState.UPDATING)
        if rb.resident:  # updated in place: it holds no slot's bytes until its WRITE goes out
            ago.resident_records.forget(rb.unit)
        held = grad.tensor
        if isinstance(held, ParamGrads):  # autograd's own per-parameter gradients (host device: no copy made)
            g = held[lo:hi]
        else:
            g = held[:ago.grad_dtype.itemsize * b.numel].view(ago.grad_dtype)[lo:hi]
        views = unit_views(rb.buf.tensor, b, lo, hi, ago.store.p16_dtype)
        p32, m, v, p16 = views.master, views.m, views.v, views.p16
        params = ago.params[i]
        t0 = time.perf_counter()
        if b.fmt != "exact":  # decoded, updated and encoded piece by piece (format_adamw.py)
            adamw_unit_(views, g, self.update, self.hyper, params, lo, seed=ago.seed, block=i,
                        fp32=lambda piece, coef=coef: ago._fp32(piece, coef), limit=FORMAT_ELEMS,
                        origin=ago.origins[i])
        elif g.dtype != torch.float32 or float(coef) != 1.0:  # through the fp32 scratch, piece by piece
            adamw_upcast_(p32, g, m, v, p16, self.update, self.hyper, params, lo,
                          lambda piece, coef=coef: ago._fp32(piece, coef), UPCAST_ELEMS)
        elif (lo, hi) == (0, b.numel):
            adamw_block_(p32, g, m, v, p16, self.update, self.hyper, params)
        else:
            adamw_chunk_(p32, g, m, v, p16, self.update, self.hyper, params, lo)
        ago.adam_s += time.perf_counter() - t0
        return True

    # ----------------------------------------------------------------- the tail in forward order
    def follow(self, expect: Callable[[list[int]], Provide | None]) -> list[int] | None:
        """After backward (every gradient handed over): update the blocks not yet begun in forward order, so the
        next step's forward can follow them instead of waiting for the whole pass (the last block of backward order,
        block 0, is the first the forward needs). At the pass's next block boundary, `expect(blocks)` (on the worker)
        announces the blocks still to come and returns where their new P16 goes from then on (None: the caller
        declines, the blocks updated before cannot reach the forward). Returns those blocks ([]: the pass had
        finished), or None where the rest is not reordered (declined, a deferred gate, a block whose chunks' READs
        are partly issued); the caller then waits for the pass before the next forward reads anything."""
        with self._follow_lock:
            if self._units_done:
                return []
            self._follow = expect
        self._followed.wait()
        return self._follow_blocks

    def _answer_follow(self, k: int | None) -> None:
        """At a block boundary (units k.. not begun; len(units): all done; None: the pass stopped): answer a
        pending `follow`, reordering units k.. by block."""
        with self._follow_lock:
            if k is None or k >= len(self.units):
                self._units_done = True
            if self._follow is None or self._followed.is_set():
                return
            rest = self.units[k:] if k is not None else []
            blocks = sorted(dict.fromkeys(u[0] for u in rest))
            order = self._forward_order(rest) if k is not None and rest and not self.gate.deferred else None
            provide = self._follow(blocks) if order is not None else None
            if k is not None and not rest:
                self._follow_blocks = []
            elif provide is None:
                self._follow_blocks = None
            else:
                self.units[k:] = order
                self.provide = provide
                self._follow_blocks = blocks
            self._followed.set()

    def _forward_order(self, rest: list[Unit]) -> list[Unit] | None:
        """The units not yet begun, reordered for a forward that follows: by block, except that where some READs
        are issued and others are not (a record streams from the SSDs), the issued ones come first, each group by
        block: their buffers must go back before the other READs can have room (the pool holds no more). None
        where a block's chunks are partly issued (its units would be split apart)."""
        def issued(u: Unit) -> bool:
            return u in self.reads or u[0] in self.ago.resident_records  # (a resident record needs no room)

        first = {u[0] for u in rest if issued(u)}
        if any(not issued(u) for u in rest if u[0] in first):
            return None
        if all(issued(u) for u in rest):
            return sorted(rest)
        return sorted(u for u in rest if u[0] in first) + sorted(u for u in rest if u[0] not in first)

    def _let_go(self) -> bool:
        """A discarded pass: give back each block's gradient once it arrives, until an abort; False (discarded)."""
        for i in dict.fromkeys(u[0] for u in self.units):
            grad = self._take_grad(i)
            if grad is None:
                return False
            self._done_with(i, grad)
        return False

    def _reads_pending(self, k: int) -> bool:
        """Whether a unit after unit k still waits for its READ: not issued yet (`reads` holds only units after
        k), or in flight."""
        return (len(self.units) - k - 1 > len(self.reads)
                or any(rb.state is BufState.READING for rb in self.reads.values()))

    def _emit(self, rb: RecordBuffer, reads_pending: bool = True) -> None:
        """The emit step: the new P16 to `provide`, then the WRITE (with write-behind, held back while READs are
        still to come: they have the SSDs first), whose bytes are hashed while it is in flight."""
        ago = self.ago
        i, lo, hi = rb.unit
        views = unit_views(rb.buf.tensor, ago.store.layout.blocks[i], lo, hi, ago.store.p16_dtype)
        # a resident record is tagged before its P16 is offered: the receiver copies it from the record
        if not self.persist:  # the update stays in its resident buffer, the state of RAM slot `write_slot`
            ago.resident_records.keep(rb, self.write_slot, self.update)
        elif rb.resident:  # its bytes are those of the slot it writes, once that step is committed
            ago.resident_records.written(rb.unit, self.write_slot, self.update)
        if self.provide is not None:
            self.provide(i, lo, hi, views.p16, rb.resident)
        self.in_hand = None
        if self.persist:
            if self.lazy and reads_pending:
                ago.behind.hold(rb)
            else:
                # (once every READ is done, the SSDs have nothing better to do: a write held now would only
                # lengthen the tail the next step's backward waits on before its own reads)
                self._issue_write(rb)
            if lo == 0:
                ago.blocks_written += 1
        if not self.lazy or reads_pending:  # (a lazy pass's last writes are its tail: reaped, and any failure
            self._reap(wait=ago.mode == "naive")  # met, in the next step, as when they were held to the end)

    def _cleanup(self) -> None:
        """Give back every buffer the pass still holds (a failure or an abort leaves some), each once its I/O is
        over: no buffer goes back while the volume still uses it. Raises the first I/O error met."""
        pending = [*([self.in_hand] if self.in_hand else []), *self.ago.behind.take_all(), *self.reads.values(),
                   *self.writes]
        self.in_hand = None
        self.reads.clear()
        self.writes.clear()
        first: BaseException | None = None
        for rb in pending:
            try:
                rb.abandon()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    # ----------------------------------------------------------------- gradients
    def submit(self, block: int, grad: Grad | None) -> None:
        self.queue.put((block, grad))

    def _take_grad(self, i: int) -> Grad | None:
        """Block i's gradient, from what arrived early or from the queue (None: the step was aborted)."""
        t0 = time.perf_counter()
        try:
            while i not in self.arrived:
                got, grad = self.queue.get()
                if got == _ABORT:
                    return None
                if got in self.arrived or not 0 <= got < len(self.ago.store.layout.blocks):
                    raise RuntimeError(f"gradients of block {got} arrived twice or for no block of this store")
                self.arrived[got] = grad
            return self.arrived.pop(i)
        finally:
            self.ago.grad_wait_s += time.perf_counter() - t0

    def _done_with(self, block: int | None, grad: Grad) -> None:
        if self.keep and block is not None and not isinstance(grad, StashedGrad):
            if self.ago.stash is None:
                raise RuntimeError("keeping gradients needs a gradient stash")
            self.ago.stash.put(block, grad)
        else:
            grad.release()  # a stashed gradient gives back only what reading it back took
            # autograd's own gradient (the CPU's hand-over), updated, and no redo reads it: its memory goes back now
            # (a pool's buffer stays with the stash until the step's end, as the grads pool's plan has it)
            if (isinstance(grad, StashedGrad) and not self.keep and not grad.spilled
                    and isinstance(grad.tensor, ParamGrads)):
                self.ago.stash.forget(grad.block)

    def drain(self) -> None:
        """Give back the gradient buffers still queued, or taken out of order and not yet used."""
        for grad in self.arrived.values():
            grad.release()
        self.arrived.clear()
        while True:
            try:
                _, grad = self.queue.get_nowait()
            except queue.Empty:
                break
            if grad is not None:
                grad.release()

    # ----------------------------------------------------------------- I/O
    def _unit_bytes(self, unit: Unit) -> int:
        i, lo, hi = unit
        return self.ago.store.layout.blocks[i].unit(lo, hi).total

    def _issue_read(self, unit: Unit, wait: bool = True) -> None:
        """`_send_read`; with checksums, the READ's bytes are then hashed on the verify thread as soon as it
        completes (`_read` compares the hash with the commit's before the update uses them)."""
        ago = self.ago
        self._send_read(unit, wait)
        rb = self.reads.get(unit)
        if (ago.store.checksums and rb is not None and rb.state is BufState.READING
                and not isinstance(rb.handle, Hashed)):
            i, lo, hi = unit
            views = unit_views(rb.buf.tensor, ago.store.layout.blocks[i], lo, hi, ago.store.p16_dtype)
            rb.handle = ago.verify_hasher.after_read(rb.handle, functools.partial(tensor_hash, *views.state))

    def _send_read(self, unit: Unit, wait: bool = True) -> None:
        """READ: P32, m, v of a block (or chunk) into a record buffer. Without `wait` it is skipped when no
        write of this thread would free the room (the only other buffer is the one this thread updates)."""
        ago, behind = self.ago, self.ago.behind
        i, lo, hi = unit
        if behind.tail:  # the last pass's tail may still write this block (to the slot read): only its writes
            behind.retire_block(i)
        res = ago.resident_records.get(unit)
        if res is not None:  # its own buffer: no room needed, and no READ when it holds the slot's bytes
            if ago.resident_records.holds(unit, self.read_slot, self.update - 1):
                self.reads[unit] = res.to(BufState.READY)
                if lo == 0:  # (counted per block, as `blocks_written`)
                    ago.resident_hits += 1
                return
            if ago.store.in_ram(self.read_slot):  # nowhere else: a failed or discarded update lost it
                raise RuntimeError(f"block {i}'s states of the steps since the last durable commit were held in RAM "
                                   "only and are lost (an update was discarded); resume from the last durable step")
            ago.resident_records.forget(unit)
            self._read_into(res.to(BufState.READING))
            return
        # The pool's buffers are held by this thread alone (reads pending, writes in flight, the last pass's
        # tail), so when it is full, retire the oldest write instead of blocking on buffers only this thread
        # releases: the tail's first (issued before any of this pass's).
        while True:
            try:
                buf = ago.pool.acquire(self._unit_bytes(unit),
                                       block=wait and not self.writes and not behind.held and not behind.tail)
                break
            except BudgetExceededError:
                if behind.tail:
                    behind.retire_oldest()
                    continue
                if not self.writes and not behind.held:
                    return
                if not self.writes:  # write-behind: the oldest held update goes out to make room
                    self.release_held()
                self._retire_oldest_write()
        self._read_into(RecordBuffer(unit, buf, ago.buffers).to(BufState.READING))

    def _read_into(self, rb: RecordBuffer) -> None:
        """Send the READ of rb's unit (P32, m, v of the read slot: one request for a whole record)."""
        layout, vol = self.ago.store.layout, self.ago.store.volume
        i, lo, hi = unit = rb.unit
        self.reads[unit] = rb
        if (lo, hi) == (0, layout.blocks[i].numel):
            rb.handle = vol.read_into(rb.buf.tensor[:layout.blocks[i].sections.state_end],
                                      layout.record_offset(i, self.read_slot), priority=Priority.READ)
        else:
            rb.handle = Handles([vol.read_into(rb.buf.tensor[a:a + n], off, priority=Priority.READ)
                                 for a, off, n in unit_sections(layout, unit, self.read_slot, with_p16=False)])

    def _read_ahead(self, k: int) -> None:
        """Issue the READs of units[k], units[k+1], ... not yet issued while the record pool has a buffer
        free without waiting (completed writes are reaped first). The pipeline otherwise reads one unit
        ahead of the gradients; the last blocks of backward then wait on their reads after the device is
        done (a tied embedding's record is the largest and comes last). Reads go out in unit order and
        are consumed in that order, so the buffers they hold are always released."""
        if len(self.units) - k <= len(self.reads):  # every READ from unit k on is issued (`reads` holds units >= k)
            return
        self._reap(wait=False)
        pool = self.ago.pool
        for unit in self.units[k:]:
            if unit in self.reads:
                continue
            if self.ago.behind.tail and self.ago.behind.writing(unit[0]):
                return  # (its READ waits for the tail's write: not here, where a gradient may be waiting)
            if unit[0] in self.ago.resident_records:
                self._issue_read(unit)
                continue
            need = align_up(self._unit_bytes(unit))
            room = pool.budget_bytes - pool.in_use
            if room < need:
                # write-behind, gate open: send out held updates until their buffers make room for this READ;
                # not one much larger than the READ (a tied embedding's record), which would hold up the READ
                # longer than waiting for the next block's update does (the unit's own READ takes any)
                coming = sum(rb.buf.capacity for rb in self.writes)
                while not self.gate.deferred and room + coming < need and self.ago.behind.fits(2 * need):
                    coming += self.release_held(limit=2 * need)
                return
            self._issue_read(unit)

    def release_held(self, smallest: bool = True, limit: int | None = None) -> int:
        """Issue the WRITE of a held update (`WriteBehind.take`). Returns its buffer's bytes."""
        rb = self.ago.behind.take(smallest, limit)
        self._issue_write(rb)
        return rb.buf.capacity

    def _issue_write(self, rb: RecordBuffer) -> None:
        """WRITE: the updated P32, m, v, P16 to the write slot (one request for a whole record)."""
        self._settle_tail()
        ago = self.ago
        layout = ago.store.layout
        i, lo, hi = rb.unit
        self.writes.append(rb.to(BufState.WRITING))
        rb.handle = write_unit(ago.store, rb, self.write_slot)
        if rb.resident:  # its bytes are the ones of the slot written, once that step is committed
            ago.resident_records.written(rb.unit, self.write_slot, self.update)
        if ago.store.checksums:  # hashed while the WRITE is in flight: the buffer cannot change until it retires,
            views = unit_views(rb.buf.tensor, layout.blocks[i], lo, hi, ago.store.p16_dtype)  # so these are the
            rb.handle = ago.sum_hasher.beside_write(rb.handle, functools.partial(unit_sums, views))  # SSD's bytes
            self.sums.setdefault(i, {})[lo] = rb.handle  # (write-behind may send a block's units out of order)
        crashpoint("offload.write_issued")

    def _settle_tail(self) -> None:
        """Before this pass's first WRITE: the last pass's tail complete, then its staged commit durable (`before`).
        This pass writes the slot the commit before that one names, so no WRITE may go out while a crash could
        still find that older commit on disk; READs need only their own block's tail writes (`_issue_read`)."""
        if self.settled:
            return
        self.ago.behind.finish_tail()
        if self.before is not None:
            self.before()
        self.settled = True

    def _retire_oldest_write(self) -> None:
        self.writes.popleft().retire()

    def _reap(self, wait: bool) -> None:
        """Give back the buffers of completed writes (all of them, waiting, when `wait`), the last pass's tail's
        among them (those complete, never waiting)."""
        if self.ago.behind.tail:
            self.ago.behind.reap()
        while self.writes and (wait or self.writes[0].done()):
            self._retire_oldest_write()


def write_unit(store: StateStore, rb: RecordBuffer, slot: int) -> Handle | Handles:
    """WRITE rb's unit (P32, m, v, P16) to its place in `slot`'s record: one request for a whole record."""
    layout, vol = store.layout, store.volume
    i, lo, hi = rb.unit
    if (lo, hi) == (0, layout.blocks[i].numel):
        return vol.write(rb.buf.tensor, layout.record_offset(i, slot), priority=Priority.WRITE)
    return Handles([vol.write(rb.buf.tensor[a:a + n], off, priority=Priority.WRITE)
                    for a, off, n in unit_sections(layout, rb.unit, slot, with_p16=True)])


def _load_sums(views: UnitViews, has_p16: bool) -> tuple[int, int | None]:
    """A loaded record's checksums: what the optimizer reads, and its own P16 (None: the P16 is the master)."""
    return tensor_hash(*views.state), tensor_hash(views.p16) if has_p16 else None


def _read_unit(store: StateStore, rb: RecordBuffer, slot: int) -> list[Handle]:
    """READ rb's unit whole (P32, m, v, P16) from `slot`, as `write_unit` wrote it: one request for a whole record."""
    layout, vol = store.layout, store.volume
    i, lo, hi = rb.unit
    if (lo, hi) == (0, layout.blocks[i].numel):
        return [vol.read_into(rb.buf.tensor, layout.record_offset(i, slot), priority=Priority.READ)]
    return [vol.read_into(rb.buf.tensor[a:a + n], off, priority=Priority.READ)
            for a, off, n in unit_sections(layout, rb.unit, slot, with_p16=True)]


class GradOffloader:
    """The optimizer side of training, fed block by block from the backward pass: one `UpdatePass` per step on
    a worker thread that lives as long as the engine, the record buffers it keeps across steps (resident
    records) and the writes a pass leaves behind (write-behind's tail)."""

    def __init__(self, store: StateStore, pool: BufferPool, mode: str, grad_dtype: torch.dtype = torch.float32,
                 decays: list[list[bool]] | None = None, stash: GradStash | None = None,
                 resident: list[int] | None = None, thread_init: Callable[[], None] | None = None,
                 seed: int = 0, origins: list[int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown offloading mode {mode!r}; choose serial, naive or optimized")
        layout = store.layout
        self.store = store
        self.pool = pool
        self.mode = mode
        # The pipeline's units are the store's checksum units, so each READ and WRITE can be checked whole.
        self.chunk_elems = store.chunk_elems
        self.grad_dtype = grad_dtype
        decays = decays or [[True] * len(b.params) for b in layout.blocks]
        self.params = [param_ranges(b, d) for b, d in zip(layout.blocks, decays, strict=True)]
        self.stash = stash  # where gradients are kept for a redo (clipping); cleared by `release_kept`
        self.seed = seed  # bf16-master's stochastic rounding: its noise is a hash of (seed, block, step, element)
        self.origins = origins or [0] * len(layout.blocks)  # data parallel: each shard's first element in its block
        refused = chunk_refusal(layout.blocks, self.chunk_elems)  # 8-bit moments: no chunk splits a quantization block
        if refused is not None:
            raise ValueError(refused)
        self.read_ahead = mode == "optimized"  # READs beyond the next unit while the pool has room
        self.buffers = Ledger()  # record buffers per state, and the transitions made (records.py)
        # a block updated in chunks keeps one buffer per chunk (`ResidentRecords`)
        self.resident_records = ResidentRecords(pool, layout, [u for i in resident or [] for u in self.units(i)],
                                                self.buffers)
        self.behind = WriteBehind(self.resident_records)
        self._upcast: torch.Tensor | None = None  # fp32 scratch for bf16 gradients, see `_fp32`
        # One worker thread for the engine's life, not one per step: glibc gives every new thread one of
        # its (up to 8 x cores) malloc arenas, and what a per-step thread allocated (record buffers the
        # pool allocates on first use, the optimizer's temporaries) stayed resident in a different arena
        # each step (RSS crept up by ~50 MiB on the tiny preset over 30 steps; benchmarks/soak.py).
        # `thread_init` runs first on that thread (the engine's device becomes its current CUDA device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lohan-ago", initializer=thread_init)
        self._pass: UpdatePass | None = None  # the running step's pass, or the last one
        self._thread: Future | None = None  # the running step's pass on the worker
        # per-step accounting (`reset_stats`)
        self.adam_s = 0.0  # in the AdamW kernel
        self.read_wait_s = 0.0  # waiting for READs (and for their hash, when it is not done by then)
        self.grad_wait_s = 0.0  # waiting for gradients
        self.busy_s = 0.0  # from a pass's start to its end
        # Checksums off the worker's serial path (hasher.py): READs are hashed as they complete, and records
        # while their WRITE is in flight, each on a thread of its own for the engine's life (as the worker's)
        self.verify_hasher = Hasher("lohan-ago-verify")
        self.sum_hasher = Hasher("lohan-ago-sum")
        self.blocks_written = 0
        self.resident_hits = 0  # READs a resident record made unnecessary

    def reset_stats(self) -> None:
        self.adam_s = self.read_wait_s = self.grad_wait_s = self.busy_s = 0.0
        self.blocks_written = self.resident_hits = 0
        self.verify_hasher.reset()
        self.sum_hasher.reset()

    @property
    def hash_s(self) -> float:
        """Seconds spent checksumming what was read and what is written (on the hash threads, not the worker)."""
        return self.verify_hasher.hash_s + self.sum_hasher.hash_s

    @property
    def resident(self) -> list[int]:
        """Blocks whose records stay in memory across steps (`plan_resident`)."""
        return self.resident_records.blocks

    @property
    def tail_done(self) -> threading.Event:
        """Set while no write-behind tail is in flight (the worker retires it as its next pass goes, or
        `drain_tail`): readers of that slot meanwhile wait for their block's writes (`wait_tail`)."""
        return self.behind.done

    def wait_tail(self, block: int | None = None) -> None:
        """Wait, from any thread, until the tail's writes of `block` (of every block: None) are complete; raises
        a failed write's error. The worker's pass needs no help for that: it completes on its own."""
        self.behind.wait_block(block)

    @property
    def tail_error(self) -> BaseException | None:
        """A tail write failed: that slot is not what was staged (until `forget_tail_error`)."""
        return self.behind.error

    def units(self, i: int) -> list[Unit]:
        """Block i's pipeline units: the whole record, or chunks of `chunk_elems` elements."""
        n = self.store.layout.blocks[i].numel
        c = self.chunk_elems
        if n <= c:
            return [(i, 0, n)]
        return [(i, lo, min(lo + c, n)) for lo in range(0, n, c)]

    def begin_step(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int,
                   gate: ClipGate | None = None, keep: bool = False, provide: Provide | None = None,
                   lazy: bool = False, before: Callable[[], None] | None = None, persist: bool = True) -> None:
        """Start the pipeline for optimizer step `step` (1-based); blocks are updated in `order`.

        Gradients may be submitted in any order: a block's update waits for its own. The backward order
        lets each update follow its gradient at once; a deferred step (every gradient is in hand by the
        time the gate opens) takes the forward order, so the next step's forward can follow the updates
        (`provide`). `gate` gives the gradient coefficient (default 1: no clipping); a deferred gate holds
        every update (READs still go out) until it opens. With `keep` the gradient buffers are kept after
        use, for `begin_redo`, until `release_kept`. `provide` receives each unit's new P16 after its update.
        `lazy`: write-behind (module docstring); `finish` then returns with the tail in flight. The pass starts
        at once beside the previous pass's tail and waits for it per buffer (a READ of a block the tail writes,
        a buffer it holds); before this pass's first WRITE the whole tail is complete and `before` (if any) is
        called: the previous step's staged commit becomes durable there, never before its last writes.
        `persist` False: nothing is written (every record must be resident): the updated records stay in their
        buffers as the states of RAM slot `write_slot` (the durability interval, `engine.persist_every`).
        """
        if self._thread is not None:
            raise RuntimeError("begin_step called while the previous step is still running")
        if not persist and len(self.resident_records.blocks) != len(self.store.layout.blocks):
            raise RuntimeError("a step that writes nothing needs every record resident")
        self._pass = UpdatePass(self, step, hyper, list(order), read_slot, write_slot, gate or ClipGate(), keep,
                                provide, lazy, persist)
        self._thread = self._executor.submit(self._run_guarded, self._pass, before)

    def submit(self, block: int, grad: Grad) -> None:
        """Hand over block `block`'s complete gradient (the pipeline releases the buffer), or its place in
        the stash (a deferred update: the gradient may be on the SSDs until its update runs)."""
        if self._pass is None:
            raise RuntimeError("submit() without begin_step()")
        if self._pass.error is not None:
            raise RuntimeError("the optimizer pipeline failed") from self._pass.error
        self._pass.submit(block, grad)

    def backward_done(self) -> None:
        if self._pass is not None:
            self._pass.backward_done.set()

    def follow(self, expect: Callable[[list[int]], Provide | None]) -> list[int] | None:
        """`UpdatePass.follow` on the running pass (after `backward_done`)."""
        if self._pass is None or self._thread is None:
            return []
        return self._pass.follow(expect)

    def finish(self) -> None:
        """Wait until every block is updated and written (not yet committed)."""
        if self._thread is None or self._pass is None:
            raise RuntimeError("finish() without begin_step()")
        self._pass.backward_done.set()
        self._thread.result()  # _run_guarded keeps the pass's exception in its `error`
        self._thread = None
        if self._pass.error is not None:
            raise RuntimeError("the optimizer pipeline failed") from self._pass.error

    def sums_written(self) -> Sums | None:
        """Checksums of every record written this step, in block order (after `finish`)."""
        if not self.store.checksums:
            return None
        sums = self._pass.sums if self._pass is not None else {}
        missing = [i for i in range(len(self.store.layout.blocks)) if i not in sums]
        if missing:
            raise RuntimeError(f"the optimizer step wrote no checksums for blocks {missing}")
        # (each hash job is over by now, or soon: it waits for no WRITE, only for the jobs before it)
        return [[sums[i][lo].value() for lo in sorted(sums[i])] for i in range(len(self.store.layout.blocks))]

    def begin_redo(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int,
                   coef: torch.Tensor, provide: Provide | None = None, persist: bool = True) -> None:
        """Start the step's optimizer pass again from `read_slot` (untouched: the speculative writes went to
        `write_slot`, or, `persist` False, into resident buffers now read back from it) with the kept gradients
        and the step's true coefficient; `finish` waits for it."""
        if self.stash is None:
            raise RuntimeError("redo needs a gradient stash")
        grads = [self.stash.get(i) for i in order]
        gate = ClipGate(None)
        gate.open(coef)
        self.begin_step(step, hyper, order, read_slot, write_slot, gate=gate, keep=False, provide=provide,
                        persist=persist)
        for i, g in zip(order, grads):
            self._pass.submit(i, g)
        self._pass.backward_done.set()

    @property
    def busy(self) -> bool:
        """A step's pipeline is running on the worker."""
        return self._thread is not None

    @property
    def failure(self) -> BaseException | None:
        """The running step's pipeline failure, if it failed (for threads waiting on what it provides)."""
        return None if self._pass is None else self._pass.error

    def release_kept(self) -> None:
        """Give back the gradients kept for a redo (after the step is committed or discarded)."""
        if self.stash is not None:
            self.stash.clear()

    def persist_resident(self, slot: int, update: int) -> Sums | None:
        """Write every resident record to `slot` on the SSDs, between steps, and wait for the writes; their buffers
        then hold update `update` of that slot. Returns the checksums of every block (None: the store keeps none):
        with every record resident, the whole slot (the commit that follows names it)."""
        if self._thread is not None:
            raise RuntimeError("persist_resident() while a step's pipeline is running")
        layout, res = self.store.layout, self.resident_records
        units = sorted(res.bufs)  # block by block, first element first: the order of the store's checksums
        writes = [write_unit(self.store, res.bufs[u], slot) for u in units]
        sums = None
        if self.store.checksums:  # (hashed while the writes are in flight)
            sums = [[] for _ in res.blocks]
            at = {i: k for k, i in enumerate(res.blocks)}
            for i, lo, hi in units:
                views = unit_views(res.bufs[i, lo, hi].buf.tensor, layout.blocks[i], lo, hi, self.store.p16_dtype)
                sums[at[i]].append(unit_sums(views))
        first: BaseException | None = None
        for h in writes:
            try:
                h.wait()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first
        for u in units:
            res.written(u, slot, update)
        crashpoint("offload.persisted")
        return sums

    def load_resident(self, slot: int, update: int, units: list[Unit] | None = None) -> None:
        """Read resident records (P32, m, v and P16) of `slot` into their buffers, those of `units` (None: all),
        between steps and with no write of them in flight, hashed on the verify thread as a pass's READs are and
        checked against the commit's checksums; the buffers then hold update `update` of that slot (a step reads
        none of them, and on the host device computes on them: `ParamStreamer.use_records`)."""
        if self._thread is not None:
            raise RuntimeError("load_resident() while a step's pipeline is running")
        layout, res = self.store.layout, self.resident_records
        units = sorted(res.bufs if units is None else units)
        reads = []
        for unit in units:
            i, lo, hi = unit
            handle: Handle | Handles | Hashed = Handles(_read_unit(self.store, res.bufs[unit], slot))
            if self.store.checksums:
                views = unit_views(res.bufs[unit].buf.tensor, layout.blocks[i], lo, hi, self.store.p16_dtype)
                handle = self.verify_hasher.after_read(handle, functools.partial(_load_sums, views,
                                                                                 layout.blocks[i].has_p16))
            reads.append(handle)
        first: BaseException | None = None
        for h in reads:  # every one, also after one failed: no buffer is left with a read in flight
            try:
                h.wait()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first
        for (i, lo, hi), handle in zip(units, reads, strict=True):
            if isinstance(handle, Hashed):
                state, p16 = handle.value()
                self.store.check_unit(i, lo, "state", state, slot=slot)
                if p16 is not None:
                    self.store.check_unit(i, lo, "p16", p16, slot=slot)
            res.written((i, lo, hi), slot, update)

    def drain_tail(self) -> None:
        """Wait for the last lazy pass's tail (between steps, on the caller's thread); raises if one of its
        writes failed, here or on the worker (`tail_error`, until `forget_tail_error`)."""
        if self._thread is not None:
            raise RuntimeError("drain_tail() while a step's pipeline is running")
        self.behind.finish_tail()
        if self.behind.error is not None:
            raise RuntimeError("a write of the last step's optimizer pass failed") from self.behind.error

    def forget_tail_error(self) -> None:
        self.behind.error = None

    def close(self) -> None:
        """Stop the worker thread (after `finish` or `abort`); the offloader cannot run steps afterwards."""
        self._executor.shutdown(wait=True)
        try:
            self.behind.finish_tail()  # no buffer goes back to the pool while a write still reads it
        except BaseException:  # the engine decided about this tail (flushed or discarded) before closing
            pass
        self.resident_records.close()
        self.verify_hasher.close()
        self.sum_hasher.close()

    def abort(self) -> None:
        """Stop the step's pipeline after a failure on the compute side; no commit follows.

        The worker waits for the I/O it has in flight before giving its buffers back. Blocks it
        already wrote went to the next slot (or, in place, are covered by the dirty commit record).
        """
        if self._thread is None or self._pass is None:
            return
        self._pass.gate.cancel()
        self._pass.submit(_ABORT, None)
        self._pass.backward_done.set()
        self._thread.result()
        self._thread = None
        self._pass.error = None
        self._pass.drain()  # gradients the pipeline never took (it stopped at a cancelled gate)

    # ----------------------------------------------------------------- worker
    def _run_guarded(self, p: UpdatePass, before: Callable[[], None] | None) -> None:
        try:
            # the pass starts at once, beside the last pass's tail: it waits per buffer (`_issue_read`), and for
            # the whole tail and `before` at its first WRITE (`_settle_tail`), or here if it wrote nothing
            p.before = before
            p.run()
            p._settle_tail()
        except BaseException as e:  # surfaced to the compute thread by submit()/finish()
            p.error = e
            p.drain()  # the compute thread may keep handing buffers over until it sees the error

    def _fp32(self, g: torch.Tensor | ParamGrads, coef: torch.Tensor | None = None) -> torch.Tensor:
        """`g` as fp32: a bf16 gradient is upcast into one scratch kept for the engine's life (its size,
        `upcast_bytes`, is in the memory plan).

        Why not `g.float()`: that allocates 4 bytes per element on this thread, which is a new one every
        step. glibc hands each new thread one of its up to 8 x cores malloc arenas, and a freed chunk of
        tens of MiB stays resident at the top of a non-main arena (`malloc_trim` trims only the main
        one), so RSS grew by 27-54 MiB per step on a 110M Llama until every arena held one (~0.8 GiB on
        2 cores, more on bigger machines; found with malloc_info, see benchmarks/soak.py).
        """
        scale = coef is not None and float(coef) != 1.0  # x * 1 == x: the unclipped case needs no copy
        if g.dtype == torch.float32 and not scale:
            return g
        if self._upcast is None:  # allocated on first use and kept
            self._upcast = torch.empty(upcast_bytes(self.store.layout, self.chunk_elems, torch.bfloat16) // 4,
                                       dtype=torch.float32)
        out = self._upcast[:g.numel()]
        if isinstance(g, ParamGrads):  # a run of several parameters' own gradients: gathered one by one
            g.copy_into(out)
        else:
            out.copy_(g)
        if scale:  # as clip_grad_norm_ scales: fp32 gradient times the fp32 0-d coefficient
            out.mul_(coef)
        return out
