"""Portable backend: a thread pool per device issuing os.preadv/os.pwritev on O_DIRECT descriptors.

The reference backend that `aio` is tested against. Python threads release the GIL in the
syscalls, so a pool per device keeps `queue_depth` requests in flight on each SSD; on this kind
of machine it matches libaio (DESIGN.md §4.1). Each device's pool serves its queue by priority class
(priority.py), reads and writes together: the disk is one queue for both directions.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from .base import ALIGN, DeviceOp, IOEngineError, check_op, device_error, device_lanes, memview
from .buffers import aligned_empty
from .priority import Priority, PriorityExecutor
from .throttle import Throttle, for_directory

if TYPE_CHECKING:
    from .faults import Fault

log = logging.getLogger(__name__)

# Linux caps an iovec at 1024 entries (IOV_MAX); stay well under it.
_IOV_MAX = 512


def open_direct(path: str) -> tuple[int, bool]:
    """Open `path` read-write with O_DIRECT, or buffered (with a warning) where the filesystem refuses it."""
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise IOEngineError(f"cannot open slab file: {e.strerror}", path, op="open",
                                directory=os.path.dirname(path), err=e.errno) from e
    log.warning("filesystem of %s refuses O_DIRECT; using buffered I/O (page cache) for it, "
                "so bandwidth numbers include caching", path)
    return os.open(path, os.O_RDWR | os.O_NOFOLLOW), False


class ThreadsBackend:
    """Thread pool per device; requests are cut into `block_bytes` pieces so one large request
    keeps every worker of its device busy, and a more urgent request's pieces start before the
    queued pieces of less urgent ones."""

    name = "threads"
    reports_transfer_bytes = True  # every syscall returns its byte count, so short transfers are seen

    def __init__(self, paths: list[str], file_size: int, queue_depth: int = 8, block_bytes: int = 1 << 20,
                 throttle_gbps: float | None = None, pin: bool = False) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        self.paths = list(paths)
        self.file_size = file_size
        self.block_bytes = block_bytes
        self.pin = pin
        self._fds: list[int] = []
        self.direct: list[bool] = []
        try:
            for p in self.paths:
                fd, direct = open_direct(p)
                self._fds.append(fd)
                self.direct.append(direct)
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            raise
        self._pools = [PriorityExecutor(queue_depth, f"io_engine-dev{i}") for i in range(len(paths))]
        self._throttles = [for_directory(p, throttle_gbps) if throttle_gbps else None for p in paths]
        self.stats = [device_lanes() for _ in paths]

    def is_direct(self, buffer: torch.Tensor) -> bool:
        return buffer.data_ptr() % ALIGN == 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pin=self.pin)

    def free(self, buffer: torch.Tensor) -> None:
        pass  # storage is reclaimed when the last reference goes

    def submit(self, op: DeviceOp, fault: Fault | None = None) -> list[Future]:
        path = self.paths[op.device]
        check_op(op, path, self.file_size)
        futures = []
        for offset, pieces in _split(op, self.block_bytes):
            futures.append(self._pools[op.device].submit(self._transfer, op.device, op.write, offset, pieces, fault,
                                                         priority=op.priority))
            fault = None  # an injected fault hits the op's first piece only
        return futures

    def promote(self, futures: list[Future], priority: Priority) -> None:
        """The queued pieces of `futures` go up to class `priority` (someone waits on them now)."""
        for pool in self._pools:
            pool.promote(futures, priority)

    def _transfer(self, device: int, write: bool, offset: int, pieces: list[torch.Tensor],
                  fault: Fault | None = None) -> int:
        fd, path = self._fds[device], self.paths[device]
        views = [memview(p) for p in pieces]
        total = sum(len(v) for v in views)
        kind = "write" if write else "read"
        lane = self.stats[device][kind]
        lane.start()
        # An emulated device's time runs while the bytes move, as a real SSD's does: booked when the transfer
        # starts and waited for after it, it takes max(real, paced) (the aio backend's rule). Booked after the
        # copy, the two would add, and a medium that copies at 5 GB/s would make a 2 GB/s device a 1.4 GB/s one.
        throttle = self._throttles[device]
        deadline = throttle.reserve(total) if throttle is not None else None
        done = 0
        try:
            # A regular file may return fewer bytes than asked (signals, I/O errors part way, O_DIRECT
            # edge cases): keep going from where it stopped; only an error or no progress at all fails.
            while done < total:
                try:
                    if fault is not None:  # stands in for this one call (faults.py)
                        n, fault = fault.syscall(write, fd, views, offset + done), None
                    else:
                        n = os.pwritev(fd, views, offset + done) if write else os.preadv(fd, views, offset + done)
                except OSError as e:
                    raise device_error(kind, e.errno, device, path, offset + done, total - done,
                                       None if e.errno is not None else str(e)) from e
                if n <= 0:
                    raise device_error(kind, None, device, path, offset + done, total - done, detail=(
                        f"read returned 0 bytes after {done} of {total} (end of file: the slab file is shorter "
                        "than the volume; was it truncated?)" if not write else
                        f"write made no progress (0 bytes written after {done} of {total})"))
                done += n
                views = _advance(views, n)
            if deadline is not None:
                Throttle.wait_until(deadline)
        finally:
            lane.finish(done)
        return done

    def sync(self, fault_for: Callable[[int], Fault | None] | None = None) -> None:
        first: IOEngineError | None = None
        for device, (fd, path) in enumerate(zip(self._fds, self.paths)):
            fault = fault_for(device) if fault_for is not None else None
            try:
                if fault is not None:
                    fault.fsync()
                else:
                    os.fsync(fd)
            except OSError as e:  # fsync the other devices anyway: their data is not at fault
                err = device_error("fsync", e.errno, device, path)
                err.__cause__ = e
                first = first or err
        if first is not None:
            raise first

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown()
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _split(op: DeviceOp, block_bytes: int) -> list[tuple[int, list[torch.Tensor]]]:
    """Cut an iovec op into (offset, buffers) pieces of at most block_bytes, on buffer slices."""
    pieces: list[tuple[int, list[torch.Tensor]]] = []
    cur: list[torch.Tensor] = []
    cur_len = 0
    start = op.offset
    for buf in op.buffers:
        pos = 0
        n = buf.numel()
        while pos < n:
            take = min(n - pos, block_bytes - cur_len)
            cur.append(buf[pos:pos + take])
            cur_len += take
            pos += take
            if cur_len == block_bytes or len(cur) == _IOV_MAX:
                pieces.append((start, cur))
                start += cur_len
                cur, cur_len = [], 0
    if cur:
        pieces.append((start, cur))
    return pieces


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes from an iovec after a short transfer."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out
