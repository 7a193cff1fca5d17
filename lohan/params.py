"""Parameter streaming: P16 of upcoming blocks read ahead from the SSDs, released after use.

The engine asks for block i's parameters (`acquire`) and, ahead of time, for the next
`prefetch_depth` blocks in the direction it is walking (`prefetch`): forward 0..n-1, backward
n-1..0. Each block's P16 is one sequential read into a budgeted host buffer, then (with CUDA) one
copy to the device; the module's parameters become views of that flat copy, and `release` puts
the meta placeholders back and returns the buffer. The number of resident blocks is tracked and
reported: it is bounded by the prefetch depth plus the blocks the engine keeps on purpose.
"""

from __future__ import annotations

import time

from torch import nn

from io_engine import AlignedBuffer, BufferPool, Handle

from .device import Device
from .integrity import tensor_hash, unit_bounds
from .store import StateStore


class ParamStreamer:
    """Moves P16 of blocks between the store and the device's module parameters."""

    def __init__(self, store: StateStore, pool: BufferPool, device: Device, blocks: list[nn.Module]) -> None:
        self.store = store
        self.pool = pool
        self.device = device
        self.blocks = blocks
        self._slots: list[list[tuple[nn.Module, str, nn.Parameter]]] = []
        for layout, block in zip(store.layout.blocks, blocks):
            entries = []
            for spec in layout.params:
                owner, _, leaf = spec.name.rpartition(".")
                module = block.get_submodule(owner) if owner else block
                entries.append((module, leaf, module._parameters[leaf]))  # the meta placeholder
            self._slots.append(entries)
        self._inflight: dict[int, tuple[AlignedBuffer, Handle]] = {}
        self._resident: dict[int, tuple[AlignedBuffer | None, list[nn.Parameter]]] = {}
        self.max_resident = 0
        self.wait_s = 0.0
        self.hash_s = 0.0
        self.bytes_read = 0

    def prefetch(self, i: int, slot: int) -> None:
        """Start reading block i's P16 from `slot` unless it is already resident or on its way."""
        if i in self._resident or i in self._inflight or not 0 <= i < len(self.blocks):
            return
        layout = self.store.layout.blocks[i]
        buf = self.pool.acquire(layout.p16_bytes)
        handle = self.store.volume.read_into(buf.tensor, self.store.layout.p16_offset(i, slot))
        self._inflight[i] = (buf, handle)
        self.bytes_read += layout.p16_bytes

    def acquire(self, i: int, slot: int) -> list[nn.Parameter]:
        """Block i's parameters on the device (waits for its prefetch; reads now if none was issued)."""
        if i in self._resident:
            return self._resident[i][1]
        self.prefetch(i, slot)
        buf, handle = self._inflight.pop(i)
        t0 = time.perf_counter()
        handle.wait()
        self.wait_s += time.perf_counter() - t0
        layout = self.store.layout.blocks[i]
        flat = buf.tensor[:layout.p16_itemsize * layout.numel].view(self.store.p16_dtype)
        if self.store.checksums:
            t0 = time.perf_counter()
            try:
                for lo, hi in unit_bounds(layout.numel, self.store.check_elems):
                    self.store.check_unit(i, lo, "p16", tensor_hash(flat[lo:hi]), slot=slot)
            except BaseException:
                buf.release()
                raise
            self.hash_s += time.perf_counter() - t0
        dev = self.device.to_device(flat)
        if self.device.is_cuda:  # the device copy is independent of the host buffer once it completed
            self.device.copy_stream.synchronize()
            buf.release()
            buf = None
        params = []
        for spec, (module, leaf, _) in zip(layout.params, self._slots[i]):
            p = nn.Parameter(dev[spec.offset:spec.offset + spec.numel].view(spec.shape))
            module._parameters[leaf] = p
            params.append(p)
        self._resident[i] = (buf, params)
        self.max_resident = max(self.max_resident, len(self._resident))
        return params

    def release(self, i: int) -> None:
        """Drop block i's device parameters (the module gets its meta placeholders back)."""
        buf, _ = self._resident.pop(i)
        for module, leaf, placeholder in self._slots[i]:
            module._parameters[leaf] = placeholder
        if buf is not None:
            buf.release()

    @property
    def resident(self) -> list[int]:
        return sorted(self._resident)

    def release_all(self) -> None:
        for i in list(self._resident):
            self.release(i)
        for buf, handle in list(self._inflight.values()):
            handle.wait()
            buf.release()
        self._inflight.clear()
