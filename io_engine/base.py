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
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

# ALIGN, align_up, ...: torch-free (align.py, which the planning layer imports), re-exported here
from .align import ALIGN, align_down, align_up, is_aligned, size_text  # noqa: F401
from .durable import fsync_dir  # noqa: F401  (its home is durable.py; imported from here too)
from .priority import Priority, default_priority

if TYPE_CHECKING:
    from .faults import Fault


class IOEngineError(OSError):
    """An I/O request failed; says what failed where, so the failure can be traced to a disk and a byte.

    Attributes (None where they do not apply): `op` ("read", "write", "fsync", "open"), `device` (index in
    the volume's directory list), `directory`, `path` (the slab file), `offset` (byte offset in that file)
    and `size` (bytes of the transfer), `errno` and `strerror` (from the failing system call).
    Code above catches this one class; `errno` tells ENOSPC (disk full) from EIO (failing disk).
    """

    def __init__(self, message: str, path: str | None = None, offset: int | None = None,
                 size: int | None = None, *, op: str | None = None, device: int | None = None,
                 directory: str | None = None, err: int | None = None) -> None:
        where = []
        if path is not None:
            where.append(f"path={path}")
        if offset is not None:
            where.append(f"offset={offset}")
        if size is not None:
            where.append(f"size={size}")
        self.message = f"{message} ({', '.join(where)})" if where else message
        super().__init__(self.message)
        self.path = path
        self.offset = offset
        self.size = size
        self.op = op
        self.device = device
        self.directory = directory
        # Set after OSError.__init__ (which leaves them None for one argument), so `except OSError` code
        # that checks e.errno sees the real cause.
        self.errno = err
        self.strerror = os.strerror(err) if err is not None else None

    def __str__(self) -> str:
        # OSError.__str__ would print "[Errno N] strerror" once errno is set, dropping the where.
        return self.message


def errno_text(err: int) -> str:
    """'No space left on device [ENOSPC]': the text for people, the name for searching."""
    return f"{os.strerror(err)} [{errno.errorcode.get(err, f'errno {err}')}]"


def device_error(op: str, err: int | None, device: int, path: str, offset: int | None = None,
                 size: int | None = None, detail: str | None = None) -> IOEngineError:
    """The error of a failed device transfer, in the one format every backend (and the fault injector) uses:

    "write failed on device 1 (/mnt/nvme1): No space left on device [ENOSPC] (path=..., offset=..., size=...)".
    `err` is the errno of the failing call; `detail` replaces the errno text where there is none.
    """
    directory = os.path.dirname(path)
    why = errno_text(err) if err is not None else (detail or "unknown error")
    if err is not None and detail:
        why += f"; {detail}"
    return IOEngineError(f"{op} failed on device {device} ({directory}): {why}", path, offset, size,
                         op=op, device=device, directory=directory, err=err)


class VolumeConfigError(ValueError):
    """The volume cannot be created or opened as asked (bad directory, not enough space, ...)."""


class BudgetExceededError(MemoryError):
    """A buffer request cannot be satisfied within the pool's hard byte budget."""


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
    length is a multiple of ALIGN, and their lengths add up to `length`. `priority`: its class on the
    device's queue (priority.py); None means the default of its direction.
    """

    device: int
    write: bool
    offset: int
    buffers: tuple[torch.Tensor, ...]
    priority: Priority | None = None

    def __post_init__(self) -> None:
        cls = default_priority(self.write) if self.priority is None else Priority(self.priority)
        object.__setattr__(self, "priority", cls)

    @property
    def length(self) -> int:
        return sum(b.numel() for b in self.buffers)


class Backend(Protocol):
    """An I/O backend: moves aligned DeviceOps between host memory and N slab files."""

    name: str

    def submit(self, op: DeviceOp, fault: Fault | None = None) -> list[Future]:
        """Start `op`; the futures complete (or fail with IOEngineError) when its bytes are on disk/in memory.

        Pieces of a more urgent `op.priority` start before queued pieces of less urgent classes (priority.py).

        `fault` (from faults.FaultyBackend only) makes this op fail or move short on purpose, at the point
        where a real failure would happen, so the backend's own error and retry paths handle it.
        """
        ...

    def promote(self, futures: list[Future], priority: Priority) -> None:
        """Move the pieces of `futures` still queued up to class `priority` (a caller now waits on them)."""
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

    def sync(self, fault_for: Callable[[int], Fault | None] | None = None) -> None:
        """Flush written data to stable storage (fsync every slab file, even after one failed; then raise
        the first failure). `fault_for(device)` is the fault-injection hook, as for submit()."""
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
    meaningful with many concurrent requests (sum of latencies would overcount). `device`, where given,
    is the same union over both directions of the device (`device_lanes`).
    """

    bytes: int = 0
    busy_s: float = 0.0
    ops: int = 0
    device: LaneStats | None = field(default=None, repr=False)
    _inflight: int = 0
    _since: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1
        if self.device is not None:
            self.device.start()

    def finish(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= 1
            self.bytes += nbytes
            self.ops += 1
            if self._inflight == 0:
                self.busy_s += time.perf_counter() - self._since
        if self.device is not None:
            self.device.finish(nbytes)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            busy = self.busy_s
            if self._inflight:
                busy += time.perf_counter() - self._since
            return {"bytes": self.bytes, "busy_s": busy, "ops": self.ops,
                    "gbps": self.bytes / busy / 1e9 if busy > 0 else 0.0}


def device_lanes() -> dict[str, LaneStats]:
    """A device's lanes: ``read`` and ``write``, and ``any``, the union of the two. A simplex device's busy time is
    the union, not the sum: a read queued on the device behind a write is in flight while the write runs, and both
    directions would count that time."""
    both = LaneStats()
    return {"read": LaneStats(device=both), "write": LaneStats(device=both), "any": both}


# A request that has not completed after this many seconds is reported (WARNING on the `io_engine` logger),
# then again after 2x, 4x, ... as long as it keeps waiting: a stuck disk must never hang a run silently,
# and a slow one is not an error. IO_ENGINE_STALL_S sets it; tests lower it directly.
STALL_WARN_S: float = 60.0
_raw_stall = os.environ.get("IO_ENGINE_STALL_S")
if _raw_stall:
    try:
        STALL_WARN_S = float(_raw_stall)
        if STALL_WARN_S <= 0:
            raise ValueError("must be positive")
    except ValueError as _e:
        STALL_WARN_S = 60.0
        logging.getLogger("io_engine").warning("IO_ENGINE_STALL_S=%r is not a positive number of seconds (%s); "
                                               "using %g", _raw_stall, _e, STALL_WARN_S)

log = logging.getLogger("io_engine")


class Handle:
    """Completion handle of one volume request; `wait()` blocks until all its pieces are done.

    Keeps the tensors of the request alive until completion, so a caller may drop its own
    references right after submitting. `devices` names where the request goes ("device 0 (/mnt/nvme0)"),
    for the stall warnings of `wait()`. `promote(futures, priority)` moves queued pieces up a class, for
    `wait(expedite=...)`.
    """

    def __init__(self, futures: list[Future], keepalive: tuple = (), describe: str = "",
                 devices: tuple[str, ...] = (),
                 promote: Callable[[list[Future], Priority], None] | None = None) -> None:
        self._futures = futures
        self._promote = promote
        self._keepalive = keepalive
        self._describe = describe
        self._devices = devices
        self._error: BaseException | None = None
        self._waited = False
        self.reported = False  # wait() has raised this request's failure to a caller

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None, expedite: Priority | None = None) -> None:
        """Block until the request is complete; raise IOEngineError if any piece failed.

        A request still pending after STALL_WARN_S seconds is logged as a WARNING (and again at doubling
        intervals) while the wait goes on; only `timeout` ends the wait early (TimeoutError). `expedite`: the
        request's pieces still queued go up to this class first, for a waiter more urgent than the request
        was (the compute blocked on a write-behind: otherwise it would wait behind background READs).
        """
        if expedite is not None and self._promote is not None and not self._waited and not self.done():
            self._promote(self._futures, expedite)
        if not self._waited:
            start = time.monotonic()
            deadline = None if timeout is None else start + timeout
            stall = STALL_WARN_S
            next_warn = start + stall
            for f in self._futures:
                while True:
                    now = time.monotonic()
                    limit = next_warn if deadline is None else min(next_warn, deadline)
                    try:
                        f.result(max(0.0, limit - now))
                        break
                    except FutureTimeout:
                        now = time.monotonic()
                        if deadline is not None and now >= deadline:
                            raise TimeoutError(f"{self._describe} not done after {timeout} s") from None
                        if now >= next_warn:
                            self._warn_stalled(now - start)
                            stall *= 2
                            next_warn = now + stall
                    except Exception as e:  # keep waiting for the rest: their buffers are still in use
                        if self._error is None:
                            self._error = e
                        break
                # KeyboardInterrupt/SystemExit raised in this thread while blocked propagate as they are;
                # the backends hold their own references to the buffers of pieces still in flight.
            self._waited = True
            self._keepalive = ()
        if self._error is not None:
            self.reported = True
            if isinstance(self._error, IOEngineError):
                raise self._error
            raise IOEngineError(f"{self._describe} failed: {self._error!r}") from self._error

    def _warn_stalled(self, waited_s: float) -> None:
        pending = sum(not f.done() for f in self._futures)
        where = ", ".join(self._devices) or "unknown device"
        log.warning("io_engine: %s on %s has not completed after %.1f s (%d of %d piece(s) pending); still "
                    "waiting. A disk this slow may be failing: check dmesg and iostat -x for %s",
                    self._describe or "request", where, waited_s, pending, len(self._futures), where)

    def __repr__(self) -> str:
        return f"Handle({self._describe}, done={self.done()})"


def wait_all_handles(handles: Iterable[Handle], skip_reported: bool = False) -> None:
    """Wait for every handle, even after one failed (their buffers stay in use until they finish); then
    raise the first failure (with skip_reported, the first one no earlier wait() has raised already)."""
    first: Exception | None = None
    for h in handles:
        seen = h.reported
        try:
            h.wait()
        except Exception as e:
            if not (skip_reported and seen):
                first = first or e
    if first is not None:
        raise first
