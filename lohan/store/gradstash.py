"""Where a step's gradients wait when clipping needs them after their block's backward: in main memory
while a byte budget allows, past it on the SSDs.

Why. Global-norm clipping is only decided at the end of backward. A deferred update waits for it with
every block's gradient in hand; a speculative update (coefficient 1) that turns out wrong is redone from
the previous slot, which needs every gradient again. At 175B that is 350 GB of bf16 gradients, more than
the machine's RAM, so what does not fit the budget is written to a spill volume (`<name>-grad`, striped
over the run's NVMe directories like the states) and read back when its update runs. Small models never
spill, and then nothing is written.

Ownership. `put` takes a block's gradient buffer and returns a `StashedGrad`; its `tensor` is the
gradient (read back from the SSDs on first use if it was spilled) and `release()` gives back the memory
that use took. The stash itself owns what it keeps in RAM until `clear()` at the end of the step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from io_engine import AlignedBuffer, BufferPool, Handle, Volume, open_volume
from io_engine.base import align_up
from io_engine.priority import Priority
from lohan.store.files import remove_volume

log = logging.getLogger(__name__)


class StashedGrad:
    """A block's gradient held by the stash: in RAM, or spilled (read back on first use of `tensor`)."""

    def __init__(self, stash: GradStash, block: int, buf: AlignedBuffer | None) -> None:
        self._stash, self.block, self._buf = stash, block, buf
        self._fetched: AlignedBuffer | None = None

    @property
    def spilled(self) -> bool:
        return self._buf is None

    @property
    def tensor(self) -> torch.Tensor:
        if self._buf is not None:
            return self._buf.tensor
        if self._fetched is None:
            self._fetched = self._stash._read(self.block)
        return self._fetched.tensor

    def release(self) -> None:
        """Give back what reading a spilled gradient took (a RAM-kept one stays with the stash)."""
        if self._fetched is not None:
            self._fetched.release()
            self._fetched = None


class GradStash:
    """Keeps the gradients of one step: up to `ram_bytes` in RAM, the rest on a spill volume over `dirs`."""

    def __init__(self, dirs: Sequence[str], block_bytes: Sequence[int], pool: BufferPool, ram_bytes: int,
                 name: str, backend: str = "auto", stripe_bytes: int = 1 << 20,
                 emulate_ssd_gbps: float | None = None) -> None:
        self.dirs = list(dirs)
        self.block_bytes = [align_up(b) for b in block_bytes]
        self.offsets = [sum(self.block_bytes[:i]) for i in range(len(self.block_bytes))]
        self.pool = pool
        self.ram_bytes = ram_bytes
        self.name = f"{name}-grad"
        self._volume_args = dict(backend=backend, chunk_bytes=stripe_bytes, emulate_ssd_gbps=emulate_ssd_gbps)
        self._volume: Volume | None = None
        self._ram: dict[int, AlignedBuffer] = {}
        self._writes: dict[int, tuple[Handle, AlignedBuffer]] = {}
        self._lock = threading.Lock()
        self.ram_used = 0
        self.spilled_bytes = 0  # this step's
        self.spilled_total = 0  # since creation

    def put(self, block: int, buf: AlignedBuffer) -> StashedGrad:
        """Take block `block`'s gradient buffer: kept in RAM if the budget allows, else written out (the
        buffer goes back to its pool once the write is done)."""
        nbytes = self.block_bytes[block]
        with self._lock:
            if self.ram_used + nbytes <= self.ram_bytes:
                self.ram_used += nbytes
                self._ram[block] = buf
                return StashedGrad(self, block, buf)
            if not isinstance(buf, AlignedBuffer):  # autograd's own gradients: planned only where all fit in RAM
                raise RuntimeError(f"block {block}'s gradient is autograd's own (not a host buffer), and the stash's "
                                   f"{self.ram_bytes} bytes of RAM are full: the memory plan keeps such gradients "
                                   "only where every one fits (lohan.plan.pools.hands_over_grads)")
            volume = self._spill_volume()
            self._writes[block] = (volume.write(buf.tensor[:nbytes], self.offsets[block], priority=Priority.WRITE), buf)
            self.spilled_bytes += nbytes
            self.spilled_total += nbytes
            # At most one spill write in flight besides this one: its buffer must go back to the pool, which
            # the caller (backward) draws its next gradient buffer from.
            older = [b for b, (_, kept) in self._writes.items() if kept is not None and b != block]
        for b in older:
            self._settle_write(b)
        return StashedGrad(self, block, None)

    def forget(self, block: int) -> None:
        """Give back block `block`'s gradient kept in RAM now, before `clear` (its update is made and no redo will
        read it): autograd's own gradients are not a pool's buffers, and held to the step's end they shared the
        heap with the next forward's activations (a spilled one stays on the spill volume until `clear`). Returns a
        pool's buffer to its pool."""
        with self._lock:
            buf = self._ram.pop(block, None)
            if buf is not None:
                self.ram_used -= self.block_bytes[block]
        if buf is not None:
            buf.release()

    def _settle_write(self, block: int) -> None:
        with self._lock:
            handle, buf = self._writes[block]
            if buf is None:
                return
            self._writes[block] = (handle, None)
        try:
            handle.wait()
        finally:
            buf.release()

    def get(self, block: int) -> StashedGrad:
        """The stashed gradient of `block` again (for a redo)."""
        with self._lock:
            buf = self._ram.get(block)
            if buf is None and block not in self._writes:
                raise KeyError(f"no stashed gradient for block {block}")
        return StashedGrad(self, block, buf)

    def _read(self, block: int) -> AlignedBuffer:
        self._settle_write(block)  # the bytes are on the SSD before they are read back
        nbytes = self.block_bytes[block]
        buf = self.pool.acquire(nbytes)
        try:
            self._spill_volume().read_into(buf.tensor[:nbytes], self.offsets[block], priority=Priority.READ).wait()
        except BaseException:
            buf.release()
            raise
        return buf

    def _spill_volume(self) -> Volume:
        if self._volume is None:
            log.info("gradient stash: %.2f GiB of this step's gradients do not fit the %.2f GiB kept in main "
                     "memory; spilling them to %s", (sum(self.block_bytes) - self.ram_bytes) / 2**30,
                     self.ram_bytes / 2**30, self.dirs)
            self._volume = open_volume(self.dirs, sum(self.block_bytes), name=self.name, **self._volume_args)
        return self._volume

    def clear(self) -> None:
        """End of the step: give back every kept buffer (waiting for spill writes still in flight)."""
        with self._lock:
            ram, self._ram = self._ram, {}
            writes, self._writes = self._writes, {}
            self.ram_used = 0
            self.spilled_bytes = 0
        for buf in ram.values():
            buf.release()
        error: BaseException | None = None
        for handle, buf in writes.values():
            if buf is None:
                continue
            try:
                handle.wait()
            except BaseException as e:  # keep releasing; the first failure is raised after
                error = error or e
            finally:
                buf.release()
        if error is not None:
            raise error

    def close(self) -> None:
        self.clear()
        if self._volume is not None:
            volume, self._volume = self._volume, None
            volume.close()
            remove_volume(self.dirs, self.name)  # scratch: nothing in it outlives the step
