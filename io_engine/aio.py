"""libaio backend through DeepSpeed's async_io op, wrapped so its sharp edges cannot cut.

What the op does, and what this wrapper does about it (DESIGN.md §4.1; read from
deepspeed/ops/csrc/aio):
- A misaligned size or offset under O_DIRECT fails in the kernel, but the op never checks
  per-iocb results, so it writes nothing and reports success.  -> `check_op` rejects every
  misaligned or out-of-bounds op before it reaches the op.
- A read past the end of a file hits an `assert` and aborts the process.  -> bounds are
  checked against the preallocated slab size first.
- `wait()` waits for *all* pending ops of a handle, returns an op count (not bytes) and holds
  the handle mutex while it blocks, so a second thread submitting meanwhile would block with
  the GIL held.  -> each handle is owned by exactly one dispatcher thread; other threads only
  enqueue. Reads and writes of every device have their own handle and thread, so they overlap.
- Each handle's worker thread runs its ops one after the other, so one handle keeps at most
  `op_bytes / block_size` iocbs in flight.  -> every (device, direction) lane has several handles,
  each with its dispatcher, pulling from one shared queue, so several ops are in flight at once.
- Unpinned buffers go through a bounce buffer that the op allocates and mlocks per request,
  outside any budget, and an mlock failure trips another assert.  -> only buffers the op
  recognizes as page-locked are submitted; they come from `alloc()`, which checks
  RLIMIT_MEMLOCK before asking the op for memory.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import queue
import resource
import sys
import threading
from concurrent.futures import Future
from types import ModuleType

import torch

from .base import ALIGN, BudgetExceededError, DeviceOp, IOEngineError, LaneStats, check_op
from .buffers import aligned_empty
from .throttle import Throttle, for_directory

log = logging.getLogger(__name__)

_op: ModuleType | None = None
_op_error: str | None = None
_op_lock = threading.Lock()


class AioUnavailable(RuntimeError):
    """The async_io op cannot be built or loaded here; the message says why."""


def load_aio_op() -> ModuleType:
    """Build (first time: minutes) or load DeepSpeed's async_io extension; cached per process."""
    global _op, _op_error
    with _op_lock:
        if _op is not None:
            return _op
        if _op_error is not None:
            raise AioUnavailable(_op_error)
        if not torch.cuda.is_available():
            # DeepSpeed picks its accelerator at import time; without CUDA it must be told "cpu".
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if sys.prefix != sys.base_prefix:
            # One build cache per virtual environment: the op compiles against that venv's torch and
            # DeepSpeed headers, so checkouts sharing ~/.cache would rebuild it back and forth.
            os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            builder = AsyncIOBuilder()
            if not builder.is_compatible(verbose=False):
                raise AioUnavailable("DeepSpeed's async_io op is not compatible here: libaio headers are "
                                     "missing (install libaio-dev)")
            log.info("loading DeepSpeed async_io op (the first build takes several minutes)")
            with _extension_build_guard():
                _op = builder.load(verbose=False)
            # The op warns about SSD write endurance on its first write, through DeepSpeed's logger, in the
            # middle of a run's output; the README says it once instead.
            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        except AioUnavailable as e:
            _op_error = str(e)
            raise
        except Exception as e:  # ImportError, build failures: all mean "use threads"
            _op_error = f"DeepSpeed's async_io op failed to load: {type(e).__name__}: {e}"
            raise AioUnavailable(_op_error) from e
        return _op


def _extensions_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def _lock_is_held(path: str) -> bool:
    """Whether a live process has `path` open (torch's FileBaton keeps the lock file open while it builds)."""
    target = os.path.realpath(path)
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # the process ended, or is not ours to look at
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) == target:
                    return True
            except OSError:
                continue
    return False


class _extension_build_guard:
    """Serializes extension builds among our processes and clears build locks nobody holds.

    torch's JIT build marks a build directory with a `lock` file and waits, without limit, for it to go.
    A build that was killed (Ctrl-C, a session or CI job ended) leaves that file behind, and every later
    load then hangs forever. Holding an flock (released by the kernel when a process dies) while we check
    and load makes the check race-free among our processes; a lock file that no live process has open is
    stale and removed.
    """

    def __enter__(self) -> None:
        root = _extensions_root()
        os.makedirs(root, exist_ok=True)
        self._fd = os.open(os.path.join(root, ".io_engine-build.flock"), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        if not os.path.isdir("/proc/self/fd"):
            return  # cannot tell a live builder from a dead one here; leave the locks alone
        for lock in glob.glob(os.path.join(root, "*", "*", "lock")) + glob.glob(os.path.join(root, "*", "lock")):
            if not _lock_is_held(lock):
                log.warning("removing stale extension build lock %s (left by a build that was killed)", lock)
                try:
                    os.remove(lock)
                except FileNotFoundError:
                    pass

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def aio_available() -> tuple[bool, str]:
    """(True, "") when the op loads, else (False, reason)."""
    try:
        load_aio_op()
        return True, ""
    except AioUnavailable as e:
        return False, str(e)


def _can_mlock_unlimited() -> bool:
    if os.geteuid() == 0:
        return True  # root has CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY


class _Lane(threading.Thread):
    """Owns one aio handle: takes queued ops, submits them as a batch, waits, completes futures."""

    def __init__(self, handle: object, path: str, write: bool, stats: LaneStats,
                 throttle: Throttle | None, max_batch: int, work: queue.SimpleQueue) -> None:
        super().__init__(name=f"io_engine-aio-{'w' if write else 'r'}-{os.path.basename(path)}", daemon=True)
        self.handle = handle
        self.path = path
        self.write = write
        self.stats = stats
        self.throttle = throttle
        self.max_batch = max_batch
        self.queue = work  # shared by the lane's handles: an idle handle takes what a busy one cannot

    def run(self) -> None:
        submit = self.handle.async_pwrite if self.write else self.handle.async_pread
        while True:
            item = self.queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._run_batch(submit, batch)

    def _run_batch(self, submit, batch: list[tuple[torch.Tensor, int, Future]]) -> None:
        started: list[tuple[torch.Tensor, int, Future]] = []
        deadline = 0.0
        for buf, offset, fut in batch:
            if not fut.set_running_or_notify_cancel():
                continue
            self.stats.start()
            rc = submit(buf, self.path, offset)
            if rc != 0:
                self.stats.finish(0)
                fut.set_exception(IOEngineError(f"aio {'write' if self.write else 'read'} submit failed "
                                                f"(rc={rc}; see stderr for the op's message)",
                                                self.path, offset, buf.numel()))
                continue
            if self.throttle is not None:
                deadline = self.throttle.reserve(buf.numel())
            started.append((buf, offset, fut))
        if not started:
            return
        try:
            completed = self.handle.wait()
        except Exception as e:  # defensive: the op raises nothing today
            completed = -1
            err: BaseException | None = e
        else:
            err = None
        if deadline:
            Throttle.wait_until(deadline)
        for buf, offset, fut in started:
            if completed != len(started):
                self.stats.finish(0)
                fut.set_exception(IOEngineError(
                    f"aio wait completed {completed} of {len(started)} ops ({err!r})", self.path, offset, buf.numel()))
            else:
                self.stats.finish(buf.numel())
                fut.set_result(buf.numel())



class AioBackend:
    """One read handle and one write handle (each with its dispatcher thread) per device."""

    name = "aio"

    def __init__(self, paths: list[str], file_size: int, queue_depth: int = 32, block_bytes: int = 1 << 20,
                 throttle_gbps: float | None = None, pin: bool = False, handles_per_lane: int = 4) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        op = load_aio_op()
        for p in paths:  # the op opens files with O_DIRECT and fails every request where that is refused
            try:
                os.close(os.open(p, os.O_RDWR | os.O_DIRECT))
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise AioUnavailable(f"{p}: the filesystem refuses O_DIRECT, which libaio needs; "
                                         "use backend='threads'") from e
                raise IOEngineError(f"cannot open slab file: {e.strerror}", p) from e
        self.paths = list(paths)
        self.file_size = file_size
        self.pin = pin
        self._mlock_limit = None if _can_mlock_unlimited() else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        self._locked = 0
        self._lock = threading.Lock()
        self._example = torch.empty(0, dtype=torch.uint8)
        self.stats = [{"read": LaneStats(), "write": LaneStats()} for _ in paths]
        self._throttles = [for_directory(p, throttle_gbps) if throttle_gbps else None for p in paths]
        if handles_per_lane < 1:
            raise ValueError(f"handles_per_lane must be >= 1, got {handles_per_lane}")
        # _queues[device][write] feeds `handles_per_lane` dispatchers, each owning one
        # aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism).
        self._queues = [[queue.SimpleQueue(), queue.SimpleQueue()] for _ in paths]
        self._lanes = [
            _Lane(op.aio_handle(block_bytes, queue_depth, False, True, 1), p, bool(write),
                  self.stats[i]["write" if write else "read"], self._throttles[i], 64, self._queues[i][write])
            for i, p in enumerate(paths) for write in (0, 1) for _ in range(handles_per_lane)]
        self._alloc_handle = self._lanes[0].handle if self._lanes else op.aio_handle()
        for lane in self._lanes:
            lane.start()

    def is_direct(self, buffer: torch.Tensor) -> bool:
        if buffer.data_ptr() % ALIGN:
            return False
        return bool(buffer.is_pinned() or self._alloc_handle.is_pinned(buffer))

    def alloc(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            return aligned_empty(nbytes, pin=True)
        with self._lock:
            if self._mlock_limit is not None and self._locked + nbytes > self._mlock_limit:
                raise BudgetExceededError(
                    f"page-locking {nbytes} more bytes would exceed RLIMIT_MEMLOCK ({self._mlock_limit} bytes, "
                    f"{self._locked} locked); raise `ulimit -l` or use backend='threads'")
            self._locked += nbytes
        t = self._alloc_handle.new_cpu_locked_tensor(nbytes, self._example)
        if t.data_ptr() == 0 or t.numel() != nbytes:
            with self._lock:
                self._locked -= nbytes
            raise BudgetExceededError(f"the async_io op could not page-lock {nbytes} bytes")
        return t

    def free(self, buffer: torch.Tensor) -> None:
        if self.pin:
            return
        if self._alloc_handle.free_cpu_locked_tensor(buffer):
            with self._lock:
                self._locked -= buffer.numel()

    def submit(self, op: DeviceOp) -> list[Future]:
        path = self.paths[op.device]
        check_op(op, path, self.file_size)
        work = self._queues[op.device][1 if op.write else 0]
        for buf in op.buffers:
            if not self.is_direct(buf):
                raise IOEngineError("aio buffers must come from the backend's allocator (page-locked); "
                                    "an unlocked buffer would make the op mlock an unbudgeted bounce buffer",
                                    path, op.offset, buf.numel())
        futures = []
        offset = op.offset
        for buf in _coalesce(op.buffers):
            fut: Future = Future()
            work.put((buf, offset, fut))
            futures.append(fut)
            offset += buf.numel()
        return futures

    def sync(self) -> None:
        for p in self.paths:
            fd = os.open(p, os.O_RDWR)
            try:
                os.fsync(fd)
            except OSError as e:
                raise IOEngineError(f"fsync failed: {e.strerror}", p) from e
            finally:
                os.close(fd)

    def close(self) -> None:
        for lane in self._lanes:
            lane.queue.put(None)
        for lane in self._lanes:
            lane.join()
        self._lanes = []


def _coalesce(buffers: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Merge iovec pieces that are adjacent in memory into one tensor each.

    A handle runs its ops one after another, each with up to queue_depth iocbs of block_size, so a
    176 MB record cut into 1 MiB stripe pieces would crawl at one iocb per handle; with one SSD (or
    any run of memory-contiguous pieces) the whole run becomes a single op.
    """
    out: list[torch.Tensor] = []
    for buf in buffers:
        if out:
            prev = out[-1]
            if (prev.data_ptr() + prev.numel() == buf.data_ptr()
                    and prev.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()):
                storage_offset = prev.storage_offset()
                out[-1] = prev.new_empty(0).set_(prev.untyped_storage(), storage_offset,
                                                 (prev.numel() + buf.numel(),))
                continue
        out.append(buf)
    return out
