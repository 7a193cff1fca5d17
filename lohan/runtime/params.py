"""Parameter streaming: P16 of upcoming blocks read ahead from the SSDs, released after use.

The engine asks for block i's parameters (`acquire`) and, ahead of time, for the next
`prefetch_depth` blocks in the direction it is walking (`prefetch`): forward 0..n-1, backward
n-1..0. Each block's P16 is one sequential read into a budgeted host buffer, then (on a separate device)
one copy to the device on the copy stream, started by `stage` once the block before it has been queued,
so that it runs beside that block's compute; `acquire` makes the compute stream wait for the copy's event,
and the host buffer goes back to the pool once the copy completed. The module's parameters become views
of the flat device copy, and `release` puts the meta placeholders back. The number of resident blocks is tracked and
reported: it is bounded by the prefetch depth plus the blocks the engine keeps on purpose.

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
from typing import Any

import torch
from torch import nn

from io_engine import AlignedBuffer, BufferPool, Handle
from io_engine.base import BudgetExceededError
from io_engine.priority import Priority
from lohan.runtime.device import Device, Transfer
from lohan.runtime.parallel import DataParallel
from lohan.store.integrity import tensor_hash, unit_bounds
from lohan.store.states import StateStore, StoreLayout


class ParamStreamer:
    """Moves P16 of blocks between the store and the device's module parameters."""

    def __init__(self, store: StateStore, pool: BufferPool, device: Device, blocks: list[nn.Module],
                 layout: StoreLayout | None = None, dp: DataParallel | None = None,
                 bounds: list[tuple[int, ...] | None] | None = None) -> None:
        self.store = store
        self.layout = layout or store.layout  # the whole blocks (the store's are the rank's shards of them)
        self.dp = dp
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
        self._inflight: dict[int, tuple[AlignedBuffer, Handle]] = {}
        # a separate device: blocks whose copy to the device has started (stage), and host buffers that copies
        # still read, given back once their event completes
        self._staged: dict[int, tuple[AlignedBuffer, Transfer, int]] = {}
        self._draining: list[tuple[AlignedBuffer, Any, int, int]] = []
        self._lock = threading.Lock()  # provisions are filled on the optimizer's thread
        self._provisions: dict[int, _Provision] = {}
        self._failure: Callable[[], BaseException | None] = lambda: None
        self._handover: _Handover | None = None  # the running in-backward pass's blocks being filled
        self.handed_over = 0  # blocks kept from an update for the next forward
        # block -> (host buffer, or None once copied to a separate device; its parameters; the slot read)
        self._resident: dict[int, tuple[AlignedBuffer | None, list[nn.Parameter], int]] = {}
        self.max_resident = 0
        self.wait_s = 0.0
        self.hash_s = 0.0
        self.bytes_read = 0
        self.kept_hits = 0
        self.late_copies = 0  # blocks whose copy to a separate device started only when they were needed
        self.gather_s = 0.0
        self._gathering: dict[int, tuple[AlignedBuffer, object, int]] = {}  # block -> (buffer, gather work, slot)
        # called with the slot before any read from the SSDs: the engine waits there while the last step's
        # writes to that slot may still be in flight (write-behind)
        self.before_read: Callable[[int], None] | None = None

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
            clash = [i for i in blocks
                     if i in self._resident or i in self._inflight or i in self._provisions or i in self._staged]
            if clash:
                raise RuntimeError(f"blocks {clash} are resident or on their way; release them before expecting them")
            self._provisions.update({i: _Provision() for i in blocks})
            self._failure = failure

    def offer(self, i: int, lo: int, hi: int, p16: torch.Tensor) -> None:
        """Elements lo..hi of block i's new P16 (the optimizer's thread); dropped if i is not expected."""
        start, numel = self._own(i)  # lo..hi count in the rank's shard
        with self._lock:
            prov = self._provisions.get(i)
            if prov is None:
                return
            prov.busy = True  # release_all leaves the buffer to this call from here on
        if prov.buf is None:  # waits while the pool is full: the forward releases the blocks it is done with
            prov.buf = self.pool.acquire(self.buffer_bytes(i))  # (kept blocks give way first)
        flat = prov.buf.tensor.view(self.store.p16_dtype)
        flat[start + lo:start + hi].copy_(p16)
        with self._lock:
            prov.busy = False
            if prov.cancelled:
                prov.buf.release()
                return
            prov.filled += hi - lo
            if prov.filled == numel:
                prov.ready.set()

    def handover(self, old_slot: int, new_slot: int) -> Callable[[int, int, int, torch.Tensor], None] | None:
        """A `provide` for an update pass that runs during backward: each block's new P16 is kept under
        (block, `new_slot`) for the next forward (module docstring). None in place, where nothing is kept."""
        if not self.keeps:
            return None
        with self._lock:
            self._drop_handover()
            self._handover = _Handover(old_slot, new_slot)
            return functools.partial(self._hand_over, self._handover)

    def _hand_over(self, h: _Handover, i: int, lo: int, hi: int, p16: torch.Tensor) -> None:
        """Elements lo..hi of block i's new P16 (the optimizer's thread). Never waits for room: backward needs
        the pool, and a block without room is read by the next forward as before."""
        start, numel = self._own(i)
        with self._lock:  # (release_all may give the buffers back meanwhile: the copy stays under the lock)
            if h is not self._handover:
                return
            if i not in h.blocks:
                buf = self.pool.take_kept((i, h.old_slot))  # backward is done with block i
                if buf is None:
                    try:
                        buf = self.pool.acquire(self.buffer_bytes(i), block=False, evict=False)
                    except BudgetExceededError:
                        buf = None
                h.blocks[i] = [buf, 0]
            entry = h.blocks[i]
            if entry[0] is None:
                return
            entry[0].tensor.view(self.store.p16_dtype)[start + lo:start + hi].copy_(p16)
            entry[1] += hi - lo
            if entry[1] == numel:
                entry[0].keep((i, h.new_slot))
                entry[0] = None
                self.handed_over += 1

    def _drop_handover(self) -> None:
        """Give back the buffers of blocks an ended (or failed) pass left half filled (lock held)."""
        if self._handover is not None:
            for entry in self._handover.blocks.values():
                if entry[0] is not None:
                    entry[0].release()
            self._handover = None

    def prefetch(self, i: int, slot: int) -> None:
        """Start reading block i's P16 from `slot` unless it is already resident, on its way or expected."""
        if (i in self._resident or i in self._inflight or i in self._provisions or i in self._gathering
                or i in self._staged or not 0 <= i < len(self.blocks)):
            return
        if self.keeps and (i, slot) in self.pool.kept_keys:
            return
        if self.before_read is not None:
            self.before_read(slot)
        own = self.store.layout.blocks[i]
        buf = self._room(self.buffer_bytes(i))
        at = self._own(i)[0] * own.p16_itemsize
        handle = self.store.volume.read_into(buf.tensor[at:at + own.p16_bytes], self.store.layout.p16_offset(i, slot),
                                             priority=Priority.URGENT)  # the compute waits on it
        self._inflight[i] = (buf, handle)
        self.bytes_read += own.p16_bytes

    def stage(self, i: int, slot: int) -> None:
        """Start copying block i's P16 to the device now (waiting for its read if needed), so that the copy
        runs beside the compute queued before it; `acquire(i)` then only orders the compute stream after the
        copy. Nothing to do on the CPU device, or for a block resident, staged, or provided by the optimizer."""
        if (self.device.is_host or i in self._resident or i in self._staged or i in self._provisions
                or not 0 <= i < len(self.blocks)):
            return
        self._staged[i] = (*self._copy_in(i, slot), slot)

    def acquire(self, i: int, slot: int) -> list[nn.Parameter]:
        """Block i's parameters on the device (waits for its prefetch; reads now if none was issued). On a
        separate device the compute stream waits for the block's copy; the host buffer goes back to the pool
        once the copy has completed (`_reap`)."""
        if i in self._resident:
            return self._resident[i][1]
        layout = self.layout.blocks[i]
        staged = self._staged.pop(i, None)
        if staged is not None and staged[2] != slot:  # staged from another slot: not these parameters
            self._draining.append((staged[0], staged[1].event, i, staged[2]))
            staged = None
        if staged is None and not self.device.is_host:
            self.late_copies += 1
        buf, transfer = staged[:2] if staged is not None else self._copy_in(i, slot)
        self.device.wait(transfer.event)
        if not self.device.is_host:  # the device copy is independent of the host buffer once it completed
            self._draining.append((buf, transfer.event, i, slot))
            buf = None
        self._reap()
        params = []
        for spec, (module, leaf, _) in zip(layout.params, self._slots[i]):
            p = nn.Parameter(transfer.tensor[spec.offset:spec.offset + spec.numel].view(spec.shape))
            module._parameters[leaf] = p
            params.append(p)
        self._resident[i] = (buf, params, slot)
        self.max_resident = max(self.max_resident, len(self._resident) + len(self._staged))
        return params

    def _copy_in(self, i: int, slot: int) -> tuple[AlignedBuffer, Transfer]:
        """Block i's whole P16 in a host buffer (read, kept, provided; data parallel: gathered), and its copy
        to the device started."""
        layout = self.layout.blocks[i]
        if i in self._gathering:  # data parallel: started by gather_ahead
            buf, work, _ = self._gathering.pop(i)
            t0 = time.perf_counter()
            try:
                work.wait()
            except BaseException:
                buf.release()
                raise
            self.gather_s += time.perf_counter() - t0
        else:
            buf = self._host(i, slot)
            bd = self.bounds[i]
            if bd is not None:  # the other ranks' shards (the same collectives on every rank, kept or not)
                t0 = time.perf_counter()
                try:
                    self.dp.all_gather_(self._padded(buf, i), bd[1] - bd[0])
                except BaseException:
                    buf.release()
                    raise
                self.gather_s += time.perf_counter() - t0
        return buf, self.device.to_device(self._padded(buf, i)[:layout.numel])

    def _reap(self, wait: bool = False) -> None:
        """Give back the host buffers whose device copies have completed (all of them, waiting, with `wait`)."""
        pending = []
        for buf, event, i, slot in self._draining:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._give_back(buf, i, slot)
            else:
                pending.append((buf, event, i, slot))
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
        if (self.dp is None or self.bounds[i] is None or i in self._resident or i in self._gathering
                or i in self._provisions or i in self._staged or not 0 <= i < len(self.blocks)):
            return
        buf = self._host(i, slot)
        bd = self.bounds[i]
        try:
            work = self.dp.all_gather_(self._padded(buf, i), bd[1] - bd[0], async_op=True)
        except BaseException:
            buf.release()
            raise
        self._gathering[i] = (buf, work, slot)

    def _padded(self, buf: AlignedBuffer, i: int) -> torch.Tensor:
        return buf.tensor[:self.buffer_bytes(i)].view(self.store.p16_dtype)

    def _host(self, i: int, slot: int) -> AlignedBuffer:
        """Block i's host buffer with this rank's part in place: kept from earlier, read from the SSDs (its
        checksums verified), or provided by the optimizer."""
        kept = None if i in self._provisions or i in self._inflight or not self.keeps else self.pool.take_kept((i, slot))
        from_ssd = i not in self._provisions and kept is None
        if kept is not None:  # checked when it was read (or the optimizer's own bytes)
            buf = kept
            self.kept_hits += 1
        elif from_ssd:
            self.prefetch(i, slot)
            buf, handle = self._inflight.pop(i)
            t0 = time.perf_counter()
            handle.wait()
            self.wait_s += time.perf_counter() - t0
        else:
            return self._take_provision(i)  # the optimizer's own bytes: nothing was read, nothing to check
        if self.store.checksums and from_ssd:
            start, numel = self._own(i)
            padded = self._padded(buf, i)
            t0 = time.perf_counter()
            try:
                for lo, hi in unit_bounds(numel, self.store.chunk_elems):
                    self.store.check_unit(i, lo, "p16", tensor_hash(padded[start + lo:start + hi]), slot=slot)
            except BaseException:
                buf.release()
                raise
            self.hash_s += time.perf_counter() - t0
        return buf

    def _take_provision(self, i: int) -> AlignedBuffer:
        """Wait for block i's offer to be complete and take its buffer."""
        prov = self._provisions[i]
        t0 = time.perf_counter()
        self._reap(wait=True)  # the optimizer's offer may wait for the room these take
        while not prov.ready.wait(0.05):
            err = self._failure()
            if err is not None:
                raise RuntimeError(f"the optimizer failed before providing block {i}'s parameters") from err
        self.wait_s += time.perf_counter() - t0
        with self._lock:
            del self._provisions[i]
        return prov.buf

    def release(self, i: int) -> None:
        """Drop block i's device parameters (the module gets its meta placeholders back); its host bytes
        are kept while the pool has room."""
        buf, _, slot = self._resident.pop(i)
        for module, leaf, placeholder in self._slots[i]:
            module._parameters[leaf] = placeholder
        if buf is not None:
            self._give_back(buf, i, slot)

    def _give_back(self, buf: AlignedBuffer, i: int, slot: int) -> None:
        if self.keeps:
            buf.keep((i, slot))
        else:
            buf.release()

    @property
    def resident(self) -> list[int]:
        return sorted(self._resident)

    def release_all(self) -> None:
        """Drop every resident block, wait for reads in flight, and cancel the provisions not yet taken (a
        hand-over goes on: its pass may outlast backward)."""
        with self._lock:
            provisions, self._provisions = self._provisions, {}
            for prov in provisions.values():
                prov.cancelled = True
                if prov.buf is not None and not prov.busy:  # a busy one is released by its offer
                    prov.buf.release()
        for i in list(self._resident):
            self.release(i)
        for i, (buf, transfer, slot) in list(self._staged.items()):
            self._draining.append((buf, transfer.event, i, slot))
        self._staged.clear()
        self._reap(wait=True)
        for buf, handle in list(self._inflight.values()):
            handle.wait()
            buf.release()
        self._inflight.clear()
        for buf, work, _ in list(self._gathering.values()):  # the collective still writes into the buffer
            try:
                work.wait()
            finally:
                buf.release()
        self._gathering.clear()


class _Handover:
    """An in-backward pass's hand-over: block -> [its buffer while being filled (None: no room, or kept once
    whole), elements filled]."""

    def __init__(self, old_slot: int, new_slot: int) -> None:
        self.old_slot = old_slot
        self.new_slot = new_slot
        self.blocks: dict[int, list[Any]] = {}


class _Provision:
    """A block's P16 as the optimizer fills it in (`ParamStreamer.offer`)."""

    def __init__(self) -> None:
        self.buf: AlignedBuffer | None = None
        self.filled = 0
        self.busy = False  # an offer is filling it
        self.cancelled = False
        self.ready = threading.Event()
