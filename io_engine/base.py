"""Shared contract of the I/O backends: alignment, device operations, errors, handles.

Everything below the volume speaks in *aligned* terms: a device operation moves whole
`ALIGN`-byte blocks between page-aligned host memory and a preallocated slab file. The
volume (`volume.py`) is the only layer that accepts arbitrary sizes and offsets and turns
them into aligned operations, staging through the buffer pool when it must. Backends
re-check the contract before touching the disk, because the libaio op silently writes
nothing for misaligned requests and aborts the process on reads past the end of a file
(DESIGN.md §4.1).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Protocol

import torch

# O_DIRECT needs buffer address, file offset and length aligned to the logical block size
# (512 B on most NVMe, 4 KiB on 4Kn drives). 4 KiB satisfies both and equals the page size.
ALIGN = 4096


class IOEngineError(OSError):
    """An I/O request failed; names the file, offset and size so the failure can be traced."""

    def __init__(self, message: str, path: str | None = None, offset: int | None = None,
                 size: int | None = None) -> None:
        where = []
        if path is not None:
            where.append(f"path={path}")
        if offset is not None:
            where.append(f"offset={offset}")
        if size is not None:
            where.append(f"size={size}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.offset = offset
        self.size = size


class VolumeConfigError(ValueError):
    """The volume cannot be created or opened as asked (bad directory, not enough space, ...)."""


class BudgetExceededError(MemoryError):
    """A buffer request cannot be satisfied within the pool's hard byte budget."""


def is_aligned(value: int, align: int = ALIGN) -> bool:
    return value % align == 0


def align_down(value: int, align: int = ALIGN) -> int:
    return value - value % align


def align_up(value: int, align: int = ALIGN) -> int:
    return -(-value // align) * align


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's storage (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("I/O needs a contiguous tensor; call .contiguous() first")
    return tensor.detach().reshape(-1).view(torch.uint8)


def memview(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a uint8 CPU tensor, for os.preadv/os.pwritev (no copy, no numpy).

    The caller keeps `tensor` alive for as long as the view is used.
    """
    n = tensor.numel()
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


@dataclass(frozen=True)
class DeviceOp:
    """One aligned transfer on one device: `length` bytes at `offset` of device `device`'s slab file.

    `buffers` are uint8 CPU tensors concatenated in order (an iovec); each one's address and
    length is a multiple of ALIGN, and their lengths add up to `length`.
    """

    device: int
    write: bool
    offset: int
    buffers: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return sum(b.numel() for b in self.buffers)


class Backend(Protocol):
    """An I/O backend: moves aligned DeviceOps between host memory and N slab files."""

    name: str

    def submit(self, op: DeviceOp) -> list[Future]:
        """Start `op`; the futures complete (or fail with IOEngineError) when its bytes are on disk/in memory."""
        ...

    def is_direct(self, buffer: torch.Tensor) -> bool:
        """Whether the backend can transfer into/out of `buffer` without a bounce copy."""
        ...

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 host tensor the backend transfers without copying."""
        ...

    def free(self, buffer: torch.Tensor) -> None:
        """Release a tensor returned by alloc()."""
        ...

    def sync(self) -> None:
        """Flush written data to stable storage (fsync every slab file)."""
        ...

    def close(self) -> None:
        """Stop workers and close files; outstanding operations must have been waited for."""
        ...


def check_op(op: DeviceOp, path: str, file_size: int) -> None:
    """Enforce the alignment and bounds contract before any byte moves (DESIGN.md §4.1)."""
    if not is_aligned(op.offset):
        raise IOEngineError(f"device offset not aligned to {ALIGN}", path, op.offset, op.length)
    for b in op.buffers:
        if b.dtype != torch.uint8 or b.device.type != "cpu":
            raise IOEngineError("device buffers must be uint8 CPU tensors", path, op.offset, op.length)
        if not is_aligned(b.data_ptr()) or not is_aligned(b.numel()):
            raise IOEngineError(f"buffer address/length not aligned to {ALIGN}", path, op.offset, b.numel())
    if op.length == 0:
        raise IOEngineError("empty device operation", path, op.offset, 0)
    if op.offset + op.length > file_size:
        raise IOEngineError(f"transfer past end of slab file of {file_size} bytes", path, op.offset, op.length)


@dataclass
class LaneStats:
    """Bytes moved and busy time of one device in one direction.

    Busy time is the union of intervals with at least one operation in flight, so it stays
    meaningful with many concurrent requests (sum of latencies would overcount).
    """

    bytes: int = 0
    busy_s: float = 0.0
    ops: int = 0
    _inflight: int = 0
    _since: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def finish(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= 1
            self.bytes += nbytes
            self.ops += 1
            if self._inflight == 0:
                self.busy_s += time.perf_counter() - self._since

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            busy = self.busy_s
            if self._inflight:
                busy += time.perf_counter() - self._since
            return {"bytes": self.bytes, "busy_s": busy, "ops": self.ops,
                    "gbps": self.bytes / busy / 1e9 if busy > 0 else 0.0}


class Handle:
    """Completion handle of one volume request; `wait()` blocks until all its pieces are done.

    Keeps the tensors of the request alive until completion, so a caller may drop its own
    references right after submitting.
    """

    def __init__(self, futures: list[Future], keepalive: tuple = (), describe: str = "") -> None:
        self._futures = futures
        self._keepalive = keepalive
        self._describe = describe
        self._error: BaseException | None = None
        self._waited = False

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the request is complete; raise IOEngineError if any piece failed."""
        if not self._waited:
            deadline = None if timeout is None else time.monotonic() + timeout
            for f in self._futures:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    f.result(remaining)
                except FutureTimeout:
                    raise TimeoutError(f"{self._describe} not done after {timeout} s") from None
                except Exception as e:  # keep waiting for the rest: their buffers are still in use
                    if self._error is None:
                        self._error = e
                # KeyboardInterrupt/SystemExit raised in this thread while blocked propagate as they are;
                # the backends hold their own references to the buffers of pieces still in flight.
            self._waited = True
            self._keepalive = ()
        if self._error is not None:
            if isinstance(self._error, IOEngineError):
                raise self._error
            raise IOEngineError(f"{self._describe} failed: {self._error!r}") from self._error

    def __repr__(self) -> str:
        return f"Handle({self._describe}, done={self.done()})"


def wait_all_handles(handles: Iterable[Handle]) -> None:
    """Wait for every handle, even after one failed (their buffers stay in use until they finish); then
    raise the first failure."""
    first: Exception | None = None
    for h in handles:
        try:
            h.wait()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first
