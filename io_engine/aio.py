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
- A handle's wait() waits for its whole batch, so an op queued behind a long batch waits for all of it.
  -> each lane's queue is served by priority class (priority.py): URGENT reads before READ ones, one
  handle per lane kept for URGENT work, batches and ops bounded to `_OP_BYTES`, and while URGENT reads
  are pending on a device its write lane keeps one batch in flight (the disk is half-duplex).
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
import resource
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from .base import (
    ALIGN,
    BudgetExceededError,
    DeviceOp,
    IOEngineError,
    LaneStats,
    check_op,
    device_error,
    device_lanes,
)
from .buffers import aligned_empty
from .priority import ClassQueue, Priority
from .throttle import Throttle, for_directory

if TYPE_CHECKING:
    from .faults import Fault

log = logging.getLogger(__name__)

_op: ModuleType | None = None
_op_error: str | None = None
_not_built: str | None = None
_op_lock = threading.Lock()

# What a first build costs, said before it starts so a silent compile never looks like a hang (DESIGN.md §4.1).
BUILD_NOTICE = ("building DeepSpeed's async_io op: this takes several minutes (about 8 on 2 cores) the first "
                "time, then it is cached in {root}")
HOW_TO_BUILD = "`make aio-op` or `python -m io_engine build-aio`"


class AioUnavailable(RuntimeError):
    """The async_io op cannot be built or loaded here; the message says why."""


class AioNotBuilt(AioUnavailable):
    """The op could be built but is not (or is being built by another process); loading it would compile."""


class _WouldBuild(Exception):
    """Raised in place of the ninja build when loading must not compile."""


def load_aio_op(build: bool = True) -> ModuleType:
    """Load DeepSpeed's async_io extension; cached per process.

    build=True compiles it when it is not built (first time: minutes, announced by a WARNING first);
    build=False loads it only when it is already built for this venv and would load without compiling,
    and raises AioNotBuilt otherwise, at once.
    """
    global _op, _op_error, _not_built
    with _op_lock:
        if _op is not None:
            return _op
        if _op_error is not None:
            raise AioUnavailable(_op_error)
        if not build and _not_built is not None:
            raise AioNotBuilt(_not_built)
        # DeepSpeed picks its accelerator at import time. io_engine moves host memory only, so the op is always
        # built for the CPU accelerator: the same op on a GPU box as in the tests, and no CUDA toolkit needed.
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
            with _extension_build_guard(blocking=build), _ninja_gate(allow_build=build):
                _op = builder.load(verbose=False)
            # The op warns about SSD write endurance on its first write, through DeepSpeed's logger, in the
            # middle of a run's output; the README says it once instead.
            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
            _not_built = None
        except AioNotBuilt as e:
            _not_built = str(e)
            raise
        except AioUnavailable as e:
            _op_error = str(e)
            raise
        except Exception as e:  # ImportError, build failures: all mean "use threads"
            _op_error = f"DeepSpeed's async_io op failed to load: {type(e).__name__}: {e}"
            raise AioUnavailable(_op_error) from e
        return _op


class _ninja_gate:
    """Stands between torch's JIT loader and its ninja build, for the duration of one load.

    torch.utils.cpp_extension.load() always runs ninja, which rebuilds only what is out of date (sources,
    headers, flags, paths: a moved venv rebuilds), so `ninja -n` (dry run) in the build directory it has
    just written is the exact test of "would this load compile?". With allow_build=False the gate raises
    AioNotBuilt instead of building; with allow_build=True it announces the build (WARNING) before it
    starts. The loader's lock file is released by torch's own `finally`, and the name's JIT version entry
    is dropped so a later real build in this process is not skipped as "unchanged".
    """

    def __init__(self, allow_build: bool) -> None:
        self.allow_build = allow_build

    def __enter__(self) -> None:
        import torch.utils.cpp_extension as cpp

        self._cpp = cpp
        self._real = getattr(cpp, "_run_ninja_build", None)
        if self._real is None:  # another torch layout: cannot look before building
            if not self.allow_build and not _built_libraries_exist():
                raise AioNotBuilt(_not_built_message())
            return
        real = self._real
        allow = self.allow_build
        announced = []

        def gated(build_directory: str, verbose: bool, error_prefix: str) -> None:
            if _ninja_has_work(build_directory):
                if not allow:
                    versioner = getattr(cpp, "JIT_EXTENSION_VERSIONER", None)
                    entries = getattr(versioner, "entries", None)
                    if isinstance(entries, dict):
                        entries.pop(os.path.basename(build_directory.rstrip(os.sep)), None)
                    raise _WouldBuild(build_directory)
                if not announced:  # once per load: pin_memory and async_io may both need building
                    log.warning(BUILD_NOTICE.format(root=_extensions_root()))
                    announced.append(True)
                with _building_marker():
                    real(build_directory, verbose, error_prefix)
                return
            real(build_directory, verbose, error_prefix)

        cpp._run_ninja_build = gated

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if self._real is not None:
            self._cpp._run_ninja_build = self._real
        if isinstance(exc, _WouldBuild):
            raise AioNotBuilt(_not_built_message()) from None
        return False


class _building_marker:
    """A file naming the pid that is compiling right now, so a process that must not wait (backend 'auto')
    can tell a build of minutes from a load of seconds holding the same lock."""

    def __enter__(self) -> None:
        os.makedirs(_extensions_root(), exist_ok=True)
        self.path = os.path.join(_extensions_root(), _BUILDING)
        with open(self.path, "w") as f:
            f.write(str(os.getpid()))

    def __exit__(self, *exc: object) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


_BUILDING = ".io_engine-building"
# How long backend 'auto' waits for another process's load (not build) of the op to release the lock.
_LOAD_WAIT_S = 60.0


def _build_in_progress(root: str) -> bool:
    """Whether a live process has announced that it is compiling the op under `root`."""
    try:
        with open(os.path.join(root, _BUILDING)) as f:
            pid = int(f.read().strip() or 0)
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False  # no marker, or its builder died (the kernel released its lock too)
    return pid > 0


def _ninja_has_work(build_directory: str) -> bool:
    """Whether ninja would run any command in `build_directory` (a dry run: nothing is built or recorded)."""
    import subprocess

    try:
        out = subprocess.run(["ninja", "-n"], cwd=build_directory, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True  # cannot tell: treat as "would build"
    return out.returncode != 0 or "no work to do" not in out.stdout


# The build directories of the async_io op and of pin_memory, which DeepSpeed's CPU builder loads first.
_OP_DIRS = ("async_io", "pin_memory")


def _built_libraries_exist() -> bool:
    root = _extensions_root()
    return all(os.path.exists(os.path.join(root, n, f"{n}.so")) for n in _OP_DIRS)


def _not_built_message() -> str:
    return (f"DeepSpeed's async_io op is not built for this environment (in {_extensions_root()}); building it "
            f"takes several minutes (about 8 on 2 cores): run {HOW_TO_BUILD}")


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

    def __init__(self, blocking: bool = True) -> None:
        self.blocking = blocking

    def __enter__(self) -> None:
        root = _extensions_root()
        os.makedirs(root, exist_ok=True)
        self._fd = os.open(os.path.join(root, ".io_engine-build.flock"), os.O_CREAT | os.O_RDWR, 0o644)
        if self.blocking:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        else:
            # Another of our processes holds the lock: a load takes seconds and is worth waiting for (the backend
            # choice must not depend on who started first); a build takes minutes and is not.
            deadline = time.monotonic() + _LOAD_WAIT_S
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if _build_in_progress(root) or time.monotonic() > deadline:
                        os.close(self._fd)
                        raise AioNotBuilt(f"another process is building DeepSpeed's async_io op in {root} right "
                                          "now; this process uses threads (the next one will find it built)") from None
                    time.sleep(0.05)
        if not os.path.isdir("/proc/self/fd"):
            return  # cannot tell a live builder from a dead one here; leave the locks alone
        for lock in glob.glob(os.path.join(root, "*", "*", "lock")) + glob.glob(os.path.join(root, "*", "lock")):
            if not _lock_is_held(lock):
                log.warning("removing stale extension build lock %s (left by a build that was killed)", lock)
                try:
                    os.remove(lock)
                except FileNotFoundError:
                    pass
            elif not self.blocking and os.path.basename(os.path.dirname(lock)) in _OP_DIRS:
                # A live build outside our lock (another tool): torch would wait for it, for minutes.
                self.__exit__(None, None, None)
                raise AioNotBuilt(f"a live process is building a torch extension in {os.path.dirname(lock)} "
                                  "right now; this process uses threads")

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def aio_available(build: bool = True) -> tuple[bool, str]:
    """(True, "") when the op loads (building it first if `build`), else (False, reason)."""
    try:
        load_aio_op(build=build)
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

    def __init__(self, handle: object, device: int, path: str, write: bool, stats: LaneStats,
                 throttle: Throttle | None, max_batch: int, work: ClassQueue) -> None:
        super().__init__(name=f"io_engine-aio-{'w' if write else 'r'}-{os.path.basename(path)}", daemon=True)
        self.handle = handle
        self.device = device
        self.path = path
        self.write = write
        self.stats = stats
        self.throttle = throttle
        self.max_batch = max_batch
        self.queue = work  # shared by the lane's handles: an idle handle takes what a busy one cannot

    def run(self) -> None:
        submit = self.handle.async_pwrite if self.write else self.handle.async_pread
        while True:
            picked = self.queue.get()
            if picked is None:
                return
            item, priority = picked
            # One class per batch, and bounded in bytes: wait() returns when the whole batch is done, and a
            # batch holds its handle (and, under emulation, the device's clock) for that long.
            batch, nbytes = [item], item[0].numel()
            while len(batch) < self.max_batch and nbytes < _OP_BYTES:
                nxt = self.queue.get_more(priority)
                if nxt is None:
                    break
                batch.append(nxt)
                nbytes += nxt[0].numel()
            try:
                self._run_batch(submit, batch)
            finally:
                self.queue.done(priority)

    def _run_batch(self, submit, batch: list[tuple[torch.Tensor, int, Future, Fault | None]]) -> None:
        started: list[tuple[torch.Tensor, int, Future]] = []
        deadline = 0.0
        kind = "write" if self.write else "read"
        for buf, offset, fut, fault in batch:
            if not fut.set_running_or_notify_cancel():
                continue
            self.stats.start()
            if fault is not None:
                # The op ignores per-iocb results, so a real EIO/ENOSPC could not reach us through it; an
                # injected one is raised here, where the op's own submit failure is.
                self.stats.finish(0)
                fut.set_exception(device_error(kind, fault.err, self.device, self.path, offset, buf.numel()))
                continue
            rc = submit(buf, self.path, offset)
            if rc != 0:
                self.stats.finish(0)
                fut.set_exception(device_error(kind, None, self.device, self.path, offset, buf.numel(),
                                               f"the async_io op refused the request (rc={rc}; see stderr "
                                               "for its message)"))
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
                fut.set_exception(device_error(
                    kind, None, self.device, self.path, offset, buf.numel(),
                    f"the async_io op completed {completed} of {len(started)} requests ({err!r})"))
            else:
                self.stats.finish(buf.numel())
                fut.set_result(buf.numel())



class AioBackend:
    """One read handle and one write handle (each with its dispatcher thread) per device."""

    name = "aio"
    # The op's wait() returns an op count and it never reads per-iocb results: no byte counts, so short
    # transfers can neither be produced (fault injection) nor detected through it.
    reports_transfer_bytes = False

    def __init__(self, paths: list[str], file_size: int, queue_depth: int = 32, block_bytes: int = 1 << 20,
                 throttle_gbps: float | None = None, pin: bool = False, handles_per_lane: int = 4,
                 build_op: bool = True) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        op = load_aio_op(build=build_op)
        for p in paths:  # the op opens files with O_DIRECT and fails every request where that is refused
            try:
                os.close(os.open(p, os.O_RDWR | os.O_DIRECT))
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise AioUnavailable(f"{p}: the filesystem refuses O_DIRECT, which libaio needs; "
                                         "use backend='threads'") from e
                raise IOEngineError(f"cannot open slab file: {e.strerror}", p, op="open",
                                    directory=os.path.dirname(p), err=e.errno) from e
        self.paths = list(paths)
        self.file_size = file_size
        self.pin = pin
        self._mlock_limit = None if _can_mlock_unlimited() else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        self._locked = 0
        self._lock = threading.Lock()
        self._example = torch.empty(0, dtype=torch.uint8)
        self.stats = [device_lanes() for _ in paths]
        self._throttles = [for_directory(p, throttle_gbps) if throttle_gbps else None for p in paths]
        if handles_per_lane < 1:
            raise ValueError(f"handles_per_lane must be >= 1, got {handles_per_lane}")
        # _queues[device][write] feeds `handles_per_lane` dispatchers, each owning one
        # aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism).
        # A device's write queue yields to the URGENT reads of its read queue.
        self._queues = []
        for _ in paths:
            reads = ClassQueue(handles_per_lane)
            self._queues.append([reads, ClassQueue(handles_per_lane, yield_to=reads)])
        self._lanes = [
            _Lane(op.aio_handle(block_bytes, queue_depth, False, True, 1), i, p, bool(write),
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

    def submit(self, op: DeviceOp, fault: Fault | None = None) -> list[Future]:
        if fault is not None and fault.err is None:
            raise ValueError(f"the aio backend cannot inject {fault.kind} transfers (no byte counts)")
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
        for run in _coalesce(op.buffers):
            for at in range(0, run.numel(), _OP_BYTES):
                buf = run[at:at + _OP_BYTES]
                fut: Future = Future()
                work.put((buf, offset, fut, fault), op.priority)
                fault = None  # an injected fault hits the op's first piece only
                futures.append(fut)
                offset += buf.numel()
        return futures

    def promote(self, futures: list[Future], priority: Priority) -> None:
        """The queued pieces of `futures` go up to class `priority` (someone waits on them now)."""
        ids = {id(f) for f in futures}
        for pair in self._queues:
            for work in pair:
                work.promote(lambda item: id(item[2]) in ids, priority)

    def sync(self, fault_for: Callable[[int], Fault | None] | None = None) -> None:
        first: IOEngineError | None = None
        for device, p in enumerate(self.paths):
            fault = fault_for(device) if fault_for is not None else None
            try:
                fd = os.open(p, os.O_RDWR)
                try:
                    if fault is not None:
                        fault.fsync()
                    else:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:  # fsync the other devices anyway: their data is not at fault
                err = device_error("fsync", e.errno, device, p)
                err.__cause__ = e
                first = first or err
        if first is not None:
            raise first

    def close(self) -> None:
        for pair in self._queues:
            for work in pair:
                work.close()  # the lanes finish what is queued, then stop
        for lane in self._lanes:
            lane.join()
        self._lanes = []


# Largest op, and largest batch, a lane submits at once: 8 iocbs of 1 MiB keep a handle busy, and an URGENT read
# never waits behind more than one of them per busy handle.
_OP_BYTES = 8 << 20


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
