"""Parameter streaming: P16 of upcoming blocks read ahead from the SSDs, released after use.

The engine asks for block i's parameters (`acquire`) and, ahead of time, for the next
`prefetch_depth` blocks in the direction it is walking (`prefetch`): forward 0..n-1, backward
n-1..0. Each block's P16 is one sequential read into a budgeted host buffer, then (on a separate device)
one copy to the device on the copy stream, started by `stage` once the block before it has been queued,
so that it runs beside that block's compute; `acquire` makes the compute stream wait for the copy's event,
and the host buffer goes back to the pool once the copy completed. The module's parameters become views
of the flat device copy, and `release` puts the meta placeholders back. The number of resident blocks is tracked and
reported: it is bounded by the prefetch depth plus the blocks the engine keeps on purpose. Each block's host
buffer goes through named, checked states (READING, GATHERING, FILLING, STAGED, IN_USE, DRAINING, back to the
pool KEPT or FREE; `p16_buffers.py`), one entry per block in flight or in use. A read P16 is hashed on a thread of
its own as soon as it completes, and compared with the commit's checksums when the block is taken for its copy.

Kept blocks: a released block's host buffer stays in the pool under (block, slot) while the pool has room
(`AlignedBuffer.keep`), so backward finds the blocks forward used without reading them again (for a model
whose P16 fits the pool, no P16 is read twice in a step), and the next step's forward finds the blocks
provided by the optimizer. Any request for room takes the oldest kept buffer first; a slot's entries
are dropped (`invalidate`) before the optimizer writes that slot. In place (one slot) nothing is kept.

Hand-over during backward: an update that runs during backward (clipping off, or speculated) gives each block's
new P16 to `handover`'s callable, which copies it into the buffer block i's backward just released (or free room,
never a kept block backward still needs) and keeps it under (block, written slot): the next step's forward then
reads from the SSDs only the blocks there was no room for (2 bytes a parameter a step less, as a deferred pass's
provisions save them). A speculated step that clips forgets them before its redo rewrites the slot.

Zero copy (`use_records`): on the host device, a block whose optimizer record stays resident in RAM and holds the
P16 of the slot wanted (P16 beside the master, or the master itself where the compute dtype is the master's) is not
copied at all: its parameters are views of the record, with no host buffer of this pool. The record is current
while its tags say it holds that slot's bytes (`current`): an update of the block starts only once its gradient is
complete, after its last use in the step, and forgets the tags until its new bytes are those of the slot it writes;
a forward beside a deferred pass waits for the block's offer as it does for a provision (no bytes copied). Where the
record is not current (the first step before anything loaded it, a skipped, redone or rolled-back step), the block
is read into this pool as before.

Data parallel (parallel.py): the rank's store holds its shard of each block; the shard is read into its
place in a buffer of the whole (padded) block and the ranks all-gather the rest in `acquire`, every time
(a kept block too: the ranks' kept blocks may differ, their collectives may not).

Provisions: while the optimizer rewrites the blocks after a step (a deferred or redone update, in forward
order), the next step's forward can run on the new parameters as each block's update is done, before they
reach the SSDs: the engine `expect`s the blocks, the optimizer `offer`s each one's new P16 (copied into a
buffer of this pool), and `acquire` waits for the offer instead of reading the SSDs.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from io_engine import AlignedBuffer, BufferPool
from io_engine.base import BudgetExceededError
from io_engine.priority import Priority
from lohan.runtime.device import Device
from lohan.runtime.hasher import Hashed, Hasher
from lohan.runtime.p16_buffers import P16Buffer, P16State
from lohan.runtime.parallel import Group, current_group
from lohan.runtime.record_buffers import ResidentRecords
from lohan.store.integrity import tensor_hash, unit_bounds
from lohan.store.states import StateStore, StoreLayout, unit_views


class ParamStreamer:
    """Moves P16 of blocks between the store and the device's module parameters."""

    def __init__(self, store: StateStore, pool: BufferPool, device: Device, blocks: list[nn.Module],
                 layout: StoreLayout | None = None, dp: Group | None = None,
                 bounds: list[tuple[int, ...] | None] | None = None) -> None:
        self.store = store
        self.layout = layout or store.layout  # the whole blocks (the store's are the rank's shards of them)
        self.dp = current_group(dp)
        self.bounds = bounds or [None] * len(blocks)
        self.pool = pool
        self.keeps = store.layout.slots > 1  # in place, a slot's bytes change while its blocks are read
        self.device = device
        self.blocks = blocks
        self._slots: list[list[tuple[nn.Module, str, nn.Parameter]]] = []
        for layout, block in zip(self.layout.blocks, blocks):
            entries = []
            for spec in layout.params:
                owner, _, leaf = spec.name.rpartition(".")
                module = block.get_submodule(owner) if owner else block
                entries.append((module, leaf, module._parameters[leaf]))  # the meta placeholder
            self._slots.append(entries)
        # Each block's P16 host buffer in flight or in use is one object in named, checked states
        # (p16_buffers.py): READING, GATHERING, FILLING (a provision), STAGED or IN_USE. On a separate device the
        # host buffers that copies still read are DRAINING, given back once their event completes.
        self._blocks: dict[int, P16Buffer] = {}
        self._draining: list[P16Buffer] = []
        self._lock = threading.Lock()  # provisions are filled on the optimizer's thread
        self._failure: Callable[[], BaseException | None] = lambda: None
        self._handover: _Handover | None = None  # the running in-backward pass's blocks being filled
        self.handed_over = 0  # blocks kept from an update for the next forward
        self.offered_bytes = 0  # P16 bytes the optimizer's thread copied into provisions (`offer`)
        self.max_resident = 0
        self.wait_s = 0.0  # seconds acquire waited for P16 being read or copied in
        self.provision_wait_s = 0.0  # seconds acquire waited for a block the optimizer provides (`expect`)
        self.hasher = Hasher("lohan-p16-verify")  # P16 checksums, off the compute thread (`hash_s`)
        self.bytes_read = 0
        self.kept_hits = 0
        self.late_copies = 0  # blocks whose copy to a separate device started only when they were needed
        self.gather_s = 0.0
        # called with the slot and the block before any read from the SSDs: the engine waits there while the
        # last step's writes of that block to that slot may still be in flight (write-behind)
        self.before_read: Callable[[int, int], None] | None = None
        # (block, RAM slot) -> that block's P16 as (first element, piece) of each optimizer unit, held in RAM only
        # (a step between durable commits, engine.persist_every): copied from there, never read from the SSDs,
        # whose slots hold an older step
        self.ram_p16: Callable[[int, int], list[tuple[int, torch.Tensor]]] | None = None
        # whether block i's resident record holds the P16 of a slot now (`ram_p16` can supply it)
        self.ram_current: Callable[[int, int], bool] = lambda i, slot: False
        # zero copy (`use_records`): block -> its parameters as views of its resident record (None: streamed), and
        # whether that record holds the P16 of a slot now
        self._records: list[list[torch.Tensor] | None] = [None] * len(blocks)
        self._current: Callable[[int, int], bool] = lambda i, slot: False
        self.zero_copies = 0  # blocks acquired as views of their records
        # a LoRA run's base (`lohan.runtime.lora_engine`): its parameters take no gradient, and its one slot is never
        # rewritten, so a released block may be kept across steps (`keeps`)
        self.frozen = False

    def use_records(self, views: list[list[torch.Tensor] | None], current: Callable[[int, int], bool]) -> None:
        """Zero copy (module docstring): `views[i]`, block i's parameters as views of its resident record (None:
        streamed); `current(i, slot)`: whether that record holds `slot`'s P16 now. The host device only, one
        process: a separate device needs its copy, and a rank's record holds its shard alone."""
        if not self.device.is_host or not self.dp.alone:
            raise RuntimeError("parameters as views of their records need the host device and one process")
        self._records = list(views)
        self._current = current

    def zero_copy(self, i: int) -> bool:
        """Whether block i's parameters can be views of its resident record (module docstring)."""
        return 0 <= i < len(self._records) and self._records[i] is not None

    def _state(self, i: int) -> P16State | None:
        """Block i's buffer's state (None: none in flight or in use)."""
        entry = self._blocks.get(i)
        return None if entry is None else entry.state

    def _in(self, *states: P16State) -> list[P16Buffer]:
        return [e for e in self._blocks.values() if e.state in states]

    def buffer_bytes(self, i: int) -> int:
        """Host bytes of block i's P16 buffer: the block, or (sharded) the ranks' equal shards end to end."""
        bd, b = self.bounds[i], self.layout.blocks[i]
        return b.p16_bytes if bd is None else len(bd[:-1]) * (bd[1] - bd[0]) * b.p16_itemsize

    def _own(self, i: int) -> tuple[int, int]:
        """(first element, elements) of this rank's part of block i inside the buffer."""
        bd = self.bounds[i]
        return (0 if bd is None else bd[self.dp.rank]), self.store.layout.blocks[i].numel

    def invalidate(self, slot: int) -> None:
        """Forget the kept blocks of `slot` (call before anything rewrites it); buffers still being copied to
        the device are given back first, so none of them is kept after this."""
        self._reap(wait=True)
        self.pool.forget(lambda key: key[1] != slot)

    def drop_kept(self) -> None:
        """Forget every kept block (after a failed step, whose slots are no longer known to be what they were)."""
        self.end_handover()
        self._reap(wait=True)
        self.pool.forget()

    def end_handover(self) -> None:
        """The in-backward pass ended or was stopped: the blocks it completed stay kept, those it left half
        filled are given back."""
        with self._lock:
            self._drop_handover()

    def expect(self, blocks: list[int], failure: Callable[[], BaseException | None]) -> None:
        """Blocks whose new P16 the optimizer will `offer`: acquiring them waits for the offer (or raises
        once `failure()` reports the optimizer's error). Nothing of them may be resident or in flight."""
        with self._lock:
            clash = [i for i in blocks if i in self._blocks]
            if clash:
                raise RuntimeError(f"blocks {clash} are resident or on their way; release them before expecting them")
            for i in blocks:
                self._blocks[i] = P16Buffer(i, -1).to(P16State.FILLING, "expect")
            self._failure = failure

    def offer(self, i: int, lo: int, hi: int, p16: torch.Tensor, resident: bool = False) -> None:
        """Elements lo..hi of block i's new P16 (the optimizer's thread); dropped if i is not expected. Those of a
        `resident` record are not copied here: the record holds them, and the forward copies them from it when it
        takes the block (`_host`), on its own thread, off the optimizer's serial path (one process: a rank's
        record holds its shard, gathered through this buffer)."""
        start, numel = self._own(i)  # lo..hi count in the rank's shard
        with self._lock:
            prov = self._blocks.get(i)
            if prov is None or prov.state is not P16State.FILLING:
                return
            # zero copy: acquire takes the record's views; resident: `_host` copies from the record
            if self.zero_copy(i) or resident and self.dp.alone and prov.buf is None:
                prov.filled += hi - lo
                if prov.filled == numel:
                    prov.ready.set()
                return
            prov.busy = True  # release_all leaves the buffer to this call from here on
        if prov.buf is None:  # waits while the pool is full: the forward releases the blocks it is done with
            prov.buf = self.pool.acquire(self.buffer_bytes(i))  # (kept blocks give way first)
        flat = prov.buf.tensor.view(self.store.p16_dtype)
        flat[start + lo:start + hi].copy_(p16)
        self.offered_bytes += p16.numel() * p16.element_size()
        with self._lock:
            prov.busy = False
            if prov.cancelled:
                prov.to(P16State.FREE, "offer (cancelled)")
                return
            prov.filled += hi - lo
            if prov.filled == numel:
                prov.ready.set()

    def take_handed_over(self, blocks: list[int], slot: int) -> bool:
        """Where an in-backward pass turns to forward order with the next forward following it (a durable step:
        `GradOffloader.follow`): `blocks`, updated before the turn, must reach that forward from memory, their
        slot being on no SSD yet. Each one's P16 the hand-over kept under (block, `slot`) becomes a provision
        already filled (FILLING, ready), which no request for room can evict as it could a kept buffer. False, and
        nothing taken, unless every one of them is kept."""
        taken: list[tuple[int, AlignedBuffer]] = []
        with self._lock:
            if any(i in self._blocks for i in blocks):
                return False
            for i in blocks:
                buf = self.pool.take_kept((i, slot))
                if buf is None:  # (no room during backward, or given way since)
                    for j, b in taken:
                        b.keep((j, slot))
                    return False
                taken.append((i, buf))
            for i, buf in taken:
                prov = P16Buffer(i, slot, buf).to(P16State.FILLING, "hand over (kept)")
                prov.filled = self._own(i)[1]
                prov.ready.set()
                self._blocks[i] = prov
        return True

    def handover(self, old_slot: int, new_slot: int) -> Callable[[int, int, int, torch.Tensor, bool], None] | None:
        """A `provide` for an update pass that runs during backward: each block's new P16 is kept under
        (block, `new_slot`) for the next forward (module docstring). None in place, where nothing is kept."""
        if not self.keeps:
            return None
        with self._lock:
            self._drop_handover()
            self._handover = _Handover(old_slot, new_slot)
            return functools.partial(self._hand_over, self._handover)

    def _hand_over(self, h: _Handover, i: int, lo: int, hi: int, p16: torch.Tensor, resident: bool = False) -> None:
        """Elements lo..hi of block i's new P16 (the optimizer's thread). Never waits for room: backward needs
        the pool, and a block without room is read by the next forward as before. Nothing is kept of a
        `resident` record: the next forward copies from the record, which holds the slot (`prefetch`)."""
        start, numel = self._own(i)
        with self._lock:  # (release_all may give the buffers back meanwhile: the copy stays under the lock)
            if h is not self._handover or self.zero_copy(i) or resident:  # (the next forward takes the record's)
                return
            if i not in h.blocks:
                buf = self.pool.take_kept((i, h.old_slot))  # backward is done with block i
                if buf is None:
                    try:
                        buf = self.pool.acquire(self.buffer_bytes(i), block=False, evict=False)
                    except BudgetExceededError:
                        buf = None
                h.blocks[i] = None if buf is None else P16Buffer(i, h.new_slot, buf).to(P16State.HANDING_OVER,
                                                                                          "hand over")
            entry = h.blocks[i]
            if entry is None or entry.state is not P16State.HANDING_OVER:  # no room, or kept already
                return
            entry.buf.tensor.view(self.store.p16_dtype)[start + lo:start + hi].copy_(p16)
            entry.filled += hi - lo
            if entry.filled == numel:
                entry.to(P16State.KEPT, "hand over")
                self.handed_over += 1

    def _drop_handover(self) -> None:
        """Give back the buffers of blocks an ended (or failed) pass left half filled (lock held)."""
        if self._handover is not None:
            for entry in self._handover.blocks.values():
                if entry is not None and entry.state is P16State.HANDING_OVER:
                    entry.to(P16State.FREE, "end hand-over")
            self._handover = None

    def prefetch(self, i: int, slot: int) -> None:
        """Start reading block i's P16 from `slot` unless it is already resident, on its way or expected."""
        if i in self._blocks or not 0 <= i < len(self.blocks):
            return
        if self.keeps and (i, slot) in self.pool.kept_keys:
            return
        if self.zero_copy(i) and self._current(i, slot):  # nothing to read: acquire takes its record's views
            return
        own = self.store.layout.blocks[i]
        # a RAM slot's P16 is nowhere else; a durable slot's is also in a resident record that holds it (the step that
        # wrote the slot wrote it from there): a copy in memory, not a read of the SSDs and its checksum
        if self.store.in_ram(slot) or self.ram_current(i, slot):
            entry = P16Buffer(i, slot, self._from_record(i, slot))
            entry.handle = _Done()
            self._blocks[i] = entry.to(P16State.READING, "copy from RAM")
            return
        if self.before_read is not None:
            self.before_read(slot, i)
        entry = P16Buffer(i, slot, self._room(self.buffer_bytes(i)))
        at = self._own(i)[0] * own.p16_itemsize
        handle = self.store.volume.read_into(entry.buf.tensor[at:at + own.p16_bytes],
                                             self.store.layout.p16_offset(i, slot),
                                             priority=Priority.URGENT)  # the compute waits on it
        if self.store.checksums:  # hashed on the hash thread as soon as it is read, not before its upload
            handle = self.hasher.after_read(handle, functools.partial(self._unit_hashes, entry.buf, i))
        entry.handle = handle
        self._blocks[i] = entry.to(P16State.READING, "prefetch")
        self.bytes_read += own.p16_bytes

    def _from_record(self, i: int, slot: int) -> AlignedBuffer:
        """A buffer of block i's P16 of a RAM slot, or of a slot a resident record holds, copied from that record
        (the optimizer's own bytes: a step updates a block in place only once its gradient is complete, after the
        last read of its P16 in the step, or after backward)."""
        if self.ram_p16 is None:
            raise RuntimeError(f"block {i}'s parameters of slot {slot} have no source in memory")
        own = self.store.layout.blocks[i]
        buf = self._room(self.buffer_bytes(i))
        try:
            at = self._own(i)[0] * own.p16_itemsize
            dst = buf.tensor[at:at + own.numel * own.p16_itemsize].view(self.store.p16_dtype)
            for lo, piece in self.ram_p16(i, slot):  # (a block updated in chunks: one piece per chunk)
                dst[lo:lo + piece.numel()].copy_(piece)
        except BaseException:
            buf.release()
            raise
        return buf

    def stage(self, i: int, slot: int) -> None:
        """Start copying block i's P16 to the device now (waiting for its read if needed), so that the copy
        runs beside the compute queued before it; `acquire(i)` then only orders the compute stream after the
        copy. Nothing to do on the CPU device, or for a block resident, staged, or provided by the optimizer."""
        if (self.device.is_host or self._state(i) in (P16State.IN_USE, P16State.STAGED, P16State.FILLING)
                or not 0 <= i < len(self.blocks)):
            return
        self._blocks[i] = self._copy_in(i, slot)

    def acquire(self, i: int, slot: int) -> list[nn.Parameter]:
        """Block i's parameters on the device (waits for its prefetch; reads now if none was issued). On a
        separate device the compute stream waits for the block's copy; the host buffer goes back to the pool
        once the copy has completed (`_reap`)."""
        entry = self._blocks.get(i)
        if entry is not None and entry.state is P16State.IN_USE:
            return entry.params
        if self.zero_copy(i) and (entry is None and self._current(i, slot) or entry is not None
                                  and entry.state is P16State.FILLING):
            return self._acquire_record(i, slot)
        layout = self.layout.blocks[i]
        staged = entry if entry is not None and entry.state is P16State.STAGED else None
        if staged is not None:
            del self._blocks[i]
            if staged.slot != slot:  # staged from another slot: not these parameters
                self._draining.append(staged.to(P16State.DRAINING, "acquire (another slot)"))
                staged = None
        if staged is None and not self.device.is_host:
            self.late_copies += 1
        entry = staged if staged is not None else self._copy_in(i, slot)
        self.device.wait(entry.transfer.event)
        if self.device.is_host:
            entry.to(P16State.IN_USE, "acquire")
        else:  # the device copy is independent of the host buffer once it completed
            self._draining.append(entry.split())
        self._reap()
        for spec, (module, leaf, _) in zip(layout.params, self._slots[i]):
            p = nn.Parameter(entry.transfer.tensor[spec.offset:spec.offset + spec.numel].view(spec.shape),
                             requires_grad=not self.frozen)
            module._parameters[leaf] = p
            entry.params.append(p)
        self._blocks[i] = entry
        self.max_resident = max(self.max_resident, len(self._in(P16State.IN_USE, P16State.STAGED)))
        return entry.params

    def _acquire_record(self, i: int, slot: int) -> list[nn.Parameter]:
        """`acquire` of block i as views of its resident record (zero copy), once the optimizer offered it where it
        is expected (its update of the step before done)."""
        entry = self._take_provision(i) if self._state(i) is P16State.FILLING else P16Buffer(i, slot)
        entry.slot = slot
        entry.to(P16State.STAGED, "acquire (its record)").to(P16State.IN_USE, "acquire (its record)")
        for (module, leaf, _), view in zip(self._slots[i], self._records[i], strict=True):
            p = nn.Parameter(view, requires_grad=not self.frozen)
            module._parameters[leaf] = p
            entry.params.append(p)
        self._blocks[i] = entry
        self.zero_copies += 1
        self.max_resident = max(self.max_resident, len(self._in(P16State.IN_USE, P16State.STAGED)))
        return entry.params

    def _copy_in(self, i: int, slot: int) -> P16Buffer:
        """Block i's whole P16 in a host buffer (read, kept, provided; data parallel: gathered), and its copy
        to the device started (STAGED)."""
        layout = self.layout.blocks[i]
        if self._state(i) is P16State.GATHERING:  # data parallel: started by gather_ahead
            entry = self._blocks.pop(i)
            t0 = time.perf_counter()
            try:
                entry.work.wait()
            except BaseException:
                entry.to(P16State.FREE, "gather")
                raise
            self.gather_s += time.perf_counter() - t0
        else:
            entry = self._host(i, slot)
            bd = self.bounds[i]
            if bd is not None:  # the other ranks' shards (the same collectives on every rank, kept or not)
                t0 = time.perf_counter()
                try:
                    self.dp.all_gather_(self._padded(entry.buf, i), bd[1] - bd[0])
                except BaseException:
                    entry.to(P16State.FREE, "gather")
                    raise
                self.gather_s += time.perf_counter() - t0
        entry.slot = slot
        entry.transfer = self.device.to_device(self._padded(entry.buf, i)[:layout.numel])
        return entry.to(P16State.STAGED, "copy to the device")

    def _reap(self, wait: bool = False) -> None:
        """Give back the host buffers whose device copies have completed (all of them, waiting, with `wait`)."""
        pending = []
        for entry in self._draining:
            if wait:
                entry.transfer.event.synchronize()
            if wait or entry.transfer.event.query():
                self._give_back(entry, "reap")
            else:
                pending.append(entry)
        self._draining = pending

    def _room(self, nbytes: int) -> AlignedBuffer:
        """A buffer of the pool; host buffers still read by device copies are given back first if it is full
        (they are the main thread's to give back, so waiting for another thread would never end)."""
        self._reap()
        try:
            return self.pool.acquire(nbytes, block=False)
        except BudgetExceededError:
            self._reap(wait=True)
            return self.pool.acquire(nbytes)

    def gather_ahead(self, i: int, slot: int) -> None:
        """Data parallel: start all-gathering block i's shards now, so the gather runs beside the compute of
        the block before it; `acquire(i)` then only waits for it. The engine calls it at the same point on
        every rank, and whether a gather starts depends on nothing that differs between ranks (not on kept
        blocks, nor on reads' progress: the read of block i, prefetched a block earlier, is waited for).
        Blocks the optimizer provides are gathered when acquired (waiting for them here would hold up the
        block before)."""
        if (self.bounds[i] is None or self._state(i) not in (None, P16State.READING)
                or not 0 <= i < len(self.blocks)):
            return
        entry = self._host(i, slot)
        bd = self.bounds[i]
        try:
            entry.work = self.dp.all_gather_(self._padded(entry.buf, i), bd[1] - bd[0], async_op=True)
        except BaseException:
            entry.to(P16State.FREE, "gather ahead")
            raise
        self._blocks[i] = entry.to(P16State.GATHERING, "gather ahead")

    def _padded(self, buf: AlignedBuffer, i: int) -> torch.Tensor:
        return buf.tensor[:self.buffer_bytes(i)].view(self.store.p16_dtype)

    def _host(self, i: int, slot: int) -> P16Buffer:
        """Block i's host buffer with this rank's part in place, taken out of `_blocks`: kept from earlier (NEW),
        read from the SSDs (READING; its checksums verified), or provided by the optimizer (FILLING)."""
        state = self._state(i)
        if state is P16State.FILLING:  # the optimizer's own bytes: nothing was read, nothing to check
            prov = self._take_provision(i)
            if prov.buf is None:  # offered in its resident record (`offer`): copied from there, on this thread
                try:
                    prov.buf = self._from_record(i, slot)
                except RuntimeError:
                    self._raise_failure(i)  # (a pass that failed since forgets what its records hold)
                    raise
            return prov
        kept = None if state is P16State.READING or not self.keeps else self.pool.take_kept((i, slot))
        if kept is not None:  # checked when it was read (or the optimizer's own bytes)
            self.kept_hits += 1
            return P16Buffer(i, slot, kept)
        self.prefetch(i, slot)
        entry = self._blocks.pop(i)
        t0 = time.perf_counter()
        try:
            entry.handle.wait()  # the read, and its hash unless that was done before it was needed
            self.wait_s += time.perf_counter() - t0
            if isinstance(entry.handle, Hashed):  # compared here, before anything uses the bytes
                for (lo, _), got in zip(unit_bounds(self._own(i)[1], self.store.chunk_elems), entry.handle.value(),
                                        strict=True):
                    self.store.check_unit(i, lo, "p16", got, slot=slot)
        except Exception:  # (the wait is over: no read or hash is in flight on it any more; an interrupt may
            entry.to(P16State.FREE, "verify")  # leave one, and then the buffer stays out of the pool)
            raise
        return entry

    def _unit_hashes(self, buf: AlignedBuffer, i: int) -> list[int]:
        """The checksums of this rank's part of block i's P16 in `buf`, unit by unit (on the hash thread)."""
        start, numel = self._own(i)
        padded = self._padded(buf, i)
        return [tensor_hash(padded[start + lo:start + hi]) for lo, hi in unit_bounds(numel, self.store.chunk_elems)]

    def _raise_failure(self, i: int) -> None:
        """Raise the optimizer's error, if its pass failed, as the reason block i was not provided."""
        err = self._failure()
        if err is not None:
            raise RuntimeError(f"the optimizer failed before providing block {i}'s parameters") from err

    def _take_provision(self, i: int) -> P16Buffer:
        """Wait for block i's offer to be complete and take its buffer."""
        prov = self._blocks[i]
        t0 = time.perf_counter()
        self._reap(wait=True)  # the optimizer's offer may wait for the room these take
        while not prov.ready.wait(0.05):
            self._raise_failure(i)
        # a wait for the optimizer's update of the block (the forward follows the pass), not for a read
        self.provision_wait_s += time.perf_counter() - t0
        with self._lock:
            del self._blocks[i]
        return prov

    def release(self, i: int) -> None:
        """Drop block i's device parameters (the module gets its meta placeholders back); its host bytes
        are kept while the pool has room."""
        entry = self._blocks.get(i)
        if entry is None or entry.state is not P16State.IN_USE:
            raise RuntimeError(f"block {i}'s parameters are released while "
                               f"{'not streamed' if entry is None else entry.state.name}, not IN_USE")
        del self._blocks[i]
        for module, leaf, placeholder in self._slots[i]:
            module._parameters[leaf] = placeholder
        self._give_back(entry, "release")  # (on a separate device, its host buffer went DRAINING at acquire)

    def _give_back(self, entry: P16Buffer, verb: str) -> None:
        entry.to(P16State.KEPT if self.keeps else P16State.FREE, verb)

    @property
    def resident(self) -> list[int]:
        return sorted(e.block for e in self._in(P16State.IN_USE))

    @property
    def hash_s(self) -> float:
        """Seconds spent checksumming the P16 read (cumulative, on the hash thread)."""
        return self.hasher.hash_s

    def close(self) -> None:
        """Give everything back (`release_all`) and stop the hash thread."""
        try:
            self.release_all()
        finally:
            self.hasher.close()

    def release_all(self) -> None:
        """Drop every resident block, wait for reads in flight, and cancel the provisions not yet taken (a
        hand-over goes on: its pass may outlast backward)."""
        with self._lock:
            for prov in self._in(P16State.FILLING):
                del self._blocks[prov.block]
                prov.cancelled = True
                if not prov.busy:  # a busy one is given back by its offer
                    prov.to(P16State.FREE, "release all")
        for entry in self._in(P16State.IN_USE):
            self.release(entry.block)
        for entry in self._in(P16State.STAGED):
            del self._blocks[entry.block]
            self._draining.append(entry.to(P16State.DRAINING, "release all"))
        self._reap(wait=True)
        for entry in self._in(P16State.READING):
            del self._blocks[entry.block]
            try:
                entry.handle.wait()
            finally:
                entry.to(P16State.FREE, "release all")
        for entry in self._in(P16State.GATHERING):  # the collective still writes into the buffer
            del self._blocks[entry.block]
            try:
                entry.work.wait()
            finally:
                entry.to(P16State.FREE, "release all")


def record_params(layout: StoreLayout, resident: ResidentRecords, p16_dtype: torch.dtype,
                  blocks: tuple[int, ...] | list[int]) -> list[list[torch.Tensor] | None]:
    """Each of `blocks`' parameters as views of the P16 of its resident record (`ParamStreamer.use_records`), shaped
    as the module's; None for the other blocks (they stream). `blocks`: the plan's (`pools.zero_copy_blocks`: their
    records keep the P16 of `p16_dtype`, and no parameter spans two of their units)."""
    out: list[list[torch.Tensor] | None] = [None] * len(layout.blocks)
    for i in blocks:
        b = layout.blocks[i]
        pieces = [(lo, hi, unit_views(rb.buf.tensor, b, lo, hi, p16_dtype).p16)
                  for rb in resident.of_block(i) for _, lo, hi in [rb.unit]]
        views = []
        for spec in b.params:
            at = [(lo, t) for lo, hi, t in pieces if lo <= spec.offset and spec.offset + spec.numel <= hi]
            if not at or at[0][1].dtype != p16_dtype:
                raise RuntimeError(f"block {i} ({b.name}) was planned to compute on its record, which has no "
                                   f"{p16_dtype} P16 of its parameter {spec.name} in one piece")
            lo, t = at[0]
            views.append(t[spec.offset - lo:spec.offset - lo + spec.numel].view(spec.shape))
        out[i] = views
    return out


class _Handover:
    """An in-backward pass's hand-over: block -> its buffer (HANDING_OVER while being filled, KEPT once whole;
    None: no room)."""

    def __init__(self, old_slot: int, new_slot: int) -> None:
        self.old_slot = old_slot
        self.new_slot = new_slot
        self.blocks: dict[int, P16Buffer | None] = {}


class _Done:
    """The handle of a P16 copied from a resident record (`_from_record`): complete from the start."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True
