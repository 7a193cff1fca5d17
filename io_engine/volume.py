"""One logical byte space striped in fixed chunks over N SSD directories (RAID-0 without mdadm).

Logical byte `x` lives in chunk `c = x // chunk`, on device `c % N`, at local offset
`(c // N) * chunk + x % chunk` of that device's slab file. Within one request the chunks that
land on one device are consecutive in its file, so every request becomes at most one
contiguous (iovec) operation per device, all issued at once.

Any size and offset is accepted. Aligned requests on buffers the backend can use directly go
straight to the disk; everything else is staged through a budgeted pool of aligned buffers,
and writes that cover only part of a 4 KiB block read-modify-write that block under a lock,
so neighbouring bytes are never clobbered (no garbage padding, no stale tails).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Literal

import torch

from . import durable
from .base import (
    ALIGN,
    Backend,
    DeviceOp,
    Handle,
    IOEngineError,
    VolumeConfigError,
    align_down,
    align_up,
    byte_view,
    is_aligned,
    size_text,
    wait_all_handles,
)
from .buffers import BufferPool, aligned_empty
from .faults import FAULTS_ENV, FaultyBackend, plan_from_env
from .priority import Priority, PriorityExecutor

log = logging.getLogger(__name__)

BackendName = Literal["auto", "aio", "threads"]
MANIFEST_VERSION = 2
"""2: the manifest carries a checksum (`durable.write_json_atomic`); 1 did not."""


def open_volume(dirs: list[str] | str, capacity_bytes: int, chunk_bytes: int = 1 << 20,
                backend: BackendName = "auto", **kwargs) -> Volume:
    """Create (or reopen) a striped volume; see `Volume` for the arguments."""
    return Volume(dirs, capacity_bytes, chunk_bytes=chunk_bytes, backend=backend, **kwargs)


class Volume:
    """A striped, preallocated byte space on N directories with an async tensor API.

    Args:
        dirs: one directory per SSD (mount points). Order matters: reopen with the same order.
        capacity_bytes: logical size; each directory gets ceil(capacity / N) rounded up to a chunk.
        chunk_bytes: stripe unit, a multiple of 4 KiB (1-8 MiB is typical).
        backend: "aio" (libaio via DeepSpeed), "threads" (portable), or "auto" (aio when its op
            loads, else threads; the choice and the reason are logged and kept in `backend_reason`).
        name: file name stem of the slab files and manifests, so several volumes can share directories.
        queue_depth: requests in flight per device (threads: workers per device; aio: iocbs per handle).
        block_bytes: size of the pieces a request is cut into per device.
        staging_budget_bytes: hard bound on the staging memory used for unaligned requests.
        emulate_ssd_gbps: pace each directory to this bandwidth (shared by reads and writes), to
            emulate several slower SSDs on one fast disk. Results measured so are emulated.
        pin: page-lock the volume's own staging buffers through CUDA (default: no; they never cross to a
            GPU). Pools whose buffers do are asked for with `buffer_pool(..., pin=True)`.
    """

    def __init__(self, dirs: list[str] | str, capacity_bytes: int, chunk_bytes: int = 1 << 20,
                 backend: BackendName = "auto", name: str = "lohan", queue_depth: int | None = None,
                 block_bytes: int = 1 << 20, staging_budget_bytes: int = 64 << 20,
                 emulate_ssd_gbps: float | None = None, pin: bool | None = None,
                 stager_threads: int = 4) -> None:
        self.dirs = [dirs] if isinstance(dirs, str | os.PathLike) else [os.fspath(d) for d in dirs]
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.n_devices = len(self.dirs)
        self._validate_args(backend, block_bytes, staging_budget_bytes, stager_threads)
        chunks = -(-capacity_bytes // chunk_bytes)
        self.file_size = -(-chunks // self.n_devices) * chunk_bytes
        self.paths = [os.path.join(d, f"{name}.slab") for d in self.dirs]
        self._manifests = [os.path.join(d, f"{name}.volume.json") for d in self.dirs]
        self.emulated_gbps = emulate_ssd_gbps
        pin = bool(pin)
        try:  # before anything is written: a test that meant to inject faults must not run without them
            fault_plan = plan_from_env(name)
        except ValueError as e:
            raise VolumeConfigError(f"cannot open volume: {FAULTS_ENV}: {e}") from e

        self.volume_id = self._prepare_files()
        self.backend, self.backend_reason = _make_backend(
            backend, self.paths, self.file_size, queue_depth, block_bytes, emulate_ssd_gbps, pin)
        if fault_plan is not None and not fault_plan.rules:
            log.info("io_engine: %s names no faults for volume %r", FAULTS_ENV, name)
        elif fault_plan is not None:
            try:
                self.backend = FaultyBackend(self.backend, fault_plan)
            except ValueError as e:
                self.backend.close()
                raise VolumeConfigError(f"cannot open volume: {FAULTS_ENV}: {e}") from e
            log.warning("io_engine: %s is set: injecting faults %s into volume %r (for tests only)",
                        FAULTS_ENV, ",".join(map(str, fault_plan.rules)), name)
        log.info("io_engine: %d device(s), backend=%s (%s)", self.n_devices, self.backend.name, self.backend_reason)

        self._staging = BufferPool(staging_budget_bytes, self.backend.alloc, self.backend.free)
        self._window = max(ALIGN, align_down(min(8 << 20, staging_budget_bytes // stager_threads)))
        self._stager = PriorityExecutor(stager_threads, "io_engine-stage")
        self._edge_locks = [threading.Lock() for _ in range(64)]
        self._pending: set[Handle] = set()
        self._pending_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ setup
    def _validate_args(self, backend: str, block_bytes: int, staging_budget_bytes: int, stager_threads: int) -> None:
        problems = []
        if not self.dirs:
            problems.append("no directories given: pass at least one SSD directory")
        if len({os.path.realpath(d) for d in self.dirs}) != len(self.dirs):
            problems.append(f"directories repeat in {self.dirs}: each SSD directory may appear once")
        if self.capacity_bytes <= 0:
            problems.append(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            problems.append(f"chunk_bytes must be a positive multiple of {ALIGN}, got {self.chunk_bytes}")
        if block_bytes <= 0 or block_bytes % ALIGN:
            problems.append(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        if backend not in ("auto", "aio", "threads"):
            problems.append(f"backend must be 'auto', 'aio' or 'threads', got {backend!r}")
        if stager_threads < 1 or staging_budget_bytes < ALIGN * stager_threads:
            problems.append(f"staging_budget_bytes must be at least {ALIGN} per stager thread")
        if problems:
            raise VolumeConfigError("cannot open volume:\n  - " + "\n  - ".join(problems))

    def _prepare_files(self) -> str:
        """Check every directory and the free space, then create/extend the slab files.

        All problems are reported together, and nothing is written unless all checks pass.
        """
        problems: list[str] = []
        manifests: list[dict | None] = []
        for d, path, mpath in zip(self.dirs, self.paths, self._manifests):
            if not os.path.exists(d):
                problems.append(f"{d}: directory does not exist; create it (e.g. mkdir -p {d}) or pass an existing mount point")
                manifests.append(None)
                continue
            if not os.path.isdir(d):
                problems.append(f"{d}: not a directory")
                manifests.append(None)
                continue
            err = _probe_writable(d)
            if err:
                problems.append(f"{d}: not writable ({err}); fix its permissions or pick another directory")
            manifests.append(_read_manifest(mpath, problems))
            if manifests[-1] is None and os.path.exists(path) and not os.path.exists(mpath):
                problems.append(f"{path} exists without its manifest {os.path.basename(mpath)}; refusing to "
                                f"overwrite it. Delete it, or open the volume with another name")
            elif manifests[-1] is not None:
                problems.extend(_slab_problems(path, mpath, manifests[-1]))
        ids = {m["volume_id"] for m in manifests if m}
        if manifests and any(manifests) and not all(manifests) and not problems:
            problems.append("some directories hold this volume and some do not: pass the same directories "
                            "as when it was created")
        if len(ids) > 1:
            problems.append(f"the directories hold parts of different volumes (ids {sorted(ids)})")
        for i, m in enumerate(manifests):
            if not m:
                continue
            if (m["n_devices"], m["index"], m["chunk_bytes"]) != (self.n_devices, i, self.chunk_bytes):
                problems.append(
                    f"{self.dirs[i]} holds device {m['index']} of a {m['n_devices']}-device volume with "
                    f"{m['chunk_bytes']}-byte chunks; asked for device {i} of {self.n_devices} with "
                    f"{self.chunk_bytes}-byte chunks. Reopen with the original directories, order and chunk size")
        if not problems:
            problems.extend(self._space_problems())
        if problems:
            raise VolumeConfigError("cannot open volume:\n  - " + "\n  - ".join(problems))

        volume_id = ids.pop() if ids else uuid.uuid4().hex
        created: list[str] = []
        try:
            for path in self.paths:
                existed = os.path.exists(path)
                # never through a link: the slab would be written into whatever it points at (ELOOP instead)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                if not existed:
                    created.append(path)
                try:
                    if os.fstat(fd).st_size < self.file_size:
                        os.posix_fallocate(fd, 0, self.file_size)
                finally:
                    os.close(fd)
        except OSError as e:
            for path in created:
                os.unlink(path)
            raise VolumeConfigError(f"cannot preallocate {self.file_size} bytes for the volume: {e}") from e
        for i, mpath in enumerate(self._manifests):
            data = {"version": MANIFEST_VERSION, "volume_id": volume_id, "index": i, "n_devices": self.n_devices,
                    "chunk_bytes": self.chunk_bytes, "file_size": max(self.file_size, os.path.getsize(self.paths[i]))}
            if manifests[i] != data:  # unchanged on a reopen: nothing to write (a full disk can still be reopened)
                _write_manifest(mpath, data)
        return volume_id

    def _space_problems(self) -> list[str]:
        need_by_fs: dict[int, int] = {}
        dir_by_fs: dict[int, str] = {}
        for d, path in zip(self.dirs, self.paths):
            dev = os.stat(d).st_dev
            have = os.stat(path).st_blocks * 512 if os.path.exists(path) else 0
            need_by_fs[dev] = need_by_fs.get(dev, 0) + max(0, self.file_size - have)
            dir_by_fs.setdefault(dev, d)
        out = []
        for dev, need in need_by_fs.items():
            free = shutil.disk_usage(dir_by_fs[dev]).free
            if need > free:
                out.append(f"not enough free space on the filesystem of {dir_by_fs[dev]}: the volume needs "
                           f"{size_text(need)} more, {size_text(free)} free. Lower the capacity, free space, or "
                           "add SSD directories")
        return out

    # --------------------------------------------------------------- requests
    def write(self, tensor: torch.Tensor, offset: int, priority: Priority = Priority.WRITE) -> Handle:
        """Start writing `tensor`'s bytes at logical `offset`; returns a Handle to wait on.

        The tensor must not be modified until the handle completes. `priority`: the request's class on
        each device's queue (priority.py); a write someone is blocked on may say URGENT.
        """
        return self._request(tensor, offset, write=True, priority=priority)

    def read_into(self, tensor: torch.Tensor, offset: int, priority: Priority = Priority.READ) -> Handle:
        """Start reading `tensor.nbytes` bytes at logical `offset` into `tensor` (contiguous, CPU).

        `priority`: URGENT for a read the caller's critical path waits on (it starts before queued READ
        and WRITE pieces), READ for background reads (prefetch, read-ahead).
        """
        return self._request(tensor, offset, write=False, priority=priority)

    def _where(self, offset: int, n: int) -> tuple[str, ...]:
        """The devices a request of n bytes at logical `offset` touches, named for messages."""
        first, last = offset // self.chunk_bytes, (offset + max(n, 1) - 1) // self.chunk_bytes
        devs = range(self.n_devices) if last - first + 1 >= self.n_devices else \
            sorted({c % self.n_devices for c in range(first, last + 1)})
        return tuple(f"device {d} ({self.dirs[d]})" for d in devs)

    def _request(self, tensor: torch.Tensor, offset: int, write: bool, priority: Priority) -> Handle:
        if self._closed:
            raise IOEngineError("volume is closed", self.dirs[0], offset)
        if tensor.device.type != "cpu":
            raise IOEngineError(f"io_engine moves host memory only; got a {tensor.device.type} tensor "
                                "(copy it to a CPU buffer first)", self.dirs[0], offset, tensor.nbytes)
        if not write and not tensor.is_contiguous():
            raise IOEngineError("read_into needs a contiguous tensor", self.dirs[0], offset, tensor.nbytes)
        buf = byte_view(tensor if tensor.is_contiguous() else tensor.contiguous())
        n = buf.numel()
        kind = "write" if write else "read"
        if offset < 0 or offset + n > self.capacity_bytes:
            raise IOEngineError(f"{kind} outside the volume's {self.capacity_bytes} bytes", self.dirs[0], offset, n)
        if n == 0:
            return Handle([], describe=f"{kind} of 0 bytes")
        if is_aligned(offset) and is_aligned(n) and self.backend.is_direct(buf):
            futures = self._submit(offset, buf, write, priority)
        else:
            futures = [self._stager.submit(self._staged, offset, buf, write, priority, priority=priority)]
        handle = Handle(futures, keepalive=(buf,), describe=f"{kind} of {n} bytes at {offset}",
                        devices=self._where(offset, n), promote=self._promote)
        with self._pending_lock:
            if len(self._pending) > 4096:
                self._pending = {h for h in self._pending if not h.done()}
            self._pending.add(handle)
        return handle

    def _promote(self, futures: list[Future], priority: Priority) -> None:
        # A staged request's future is the stager's: it moves up there (its device ops, once issued, keep
        # the request's class).
        self._stager.promote(futures, priority)
        self.backend.promote(futures, priority)

    def _device_ops(self, offset: int, buf: torch.Tensor, write: bool,
                    priority: Priority | None = None) -> list[DeviceOp]:
        """Split an aligned logical range into one contiguous iovec op per device."""
        chunk, n_dev = self.chunk_bytes, self.n_devices
        per_dev: dict[int, tuple[int, list[torch.Tensor]]] = {}
        pos, end = offset, offset + buf.numel()
        while pos < end:
            c = pos // chunk
            within = pos - c * chunk
            take = min(chunk - within, end - pos)
            dev = c % n_dev
            local = (c // n_dev) * chunk + within
            piece = buf[pos - offset:pos - offset + take]
            if dev in per_dev:
                per_dev[dev][1].append(piece)
            else:
                per_dev[dev] = (local, [piece])
            pos += take
        return [DeviceOp(dev, write, local, tuple(pieces), priority) for dev, (local, pieces) in sorted(per_dev.items())]

    def _submit(self, offset: int, buf: torch.Tensor, write: bool, priority: Priority) -> list[Future]:
        futures: list[Future] = []
        for op in self._device_ops(offset, buf, write, priority):
            futures.extend(self.backend.submit(op))
        return futures

    def _sync_io(self, offset: int, buf: torch.Tensor, write: bool, priority: Priority) -> None:
        for f in self._submit(offset, buf, write, priority):
            f.result()

    def _staged(self, offset: int, user: torch.Tensor, write: bool, priority: Priority) -> None:
        """Move an unaligned or indirect request window by window through aligned staging buffers."""
        n = user.numel()
        lo, hi = align_down(offset), align_up(offset + n)
        pos = lo
        while pos < hi:
            end = min(pos + self._window, hi)
            seg_lo, seg_hi = max(offset, pos), min(offset + n, end)
            with self._staging.acquire(end - pos) as st:
                view = st.tensor
                if write:
                    head, tail = seg_lo > pos, seg_hi < end
                    # Lock the partially covered edge blocks for the read-modify-write; taking
                    # striped locks in index order means two requests can never deadlock.
                    edges = [b for b, need in ((pos, head), (end - ALIGN, tail)) if need]
                    with ExitStack() as locks:
                        for i in sorted({(b // ALIGN) % len(self._edge_locks) for b in edges}):
                            locks.enter_context(self._edge_locks[i])
                        # the edge reads hold up this write alone: they go in its class
                        if head:
                            self._sync_io(pos, view[:ALIGN], False, priority)
                        if tail and not (head and end - pos == ALIGN):
                            self._sync_io(end - ALIGN, view[end - pos - ALIGN:], False, priority)
                        view[seg_lo - pos:seg_hi - pos].copy_(user[seg_lo - offset:seg_hi - offset])
                        self._sync_io(pos, view, True, priority)
                else:
                    self._sync_io(pos, view, False, priority)
                    user[seg_lo - offset:seg_hi - offset].copy_(view[seg_lo - pos:seg_hi - pos])
            pos = end

    # ------------------------------------------------------------- lifecycle
    def buffer_pool(self, budget_bytes: int, pin: bool = False) -> BufferPool:
        """A pool of buffers this volume's backend transfers without copying, under `budget_bytes`. `pin`: the
        buffers are page-locked through CUDA, for pools whose buffers are copied to or from a GPU (both backends
        transfer page-locked buffers directly); page-locked memory is scarce, so only those ask for it."""
        if pin:
            return BufferPool(budget_bytes, lambda n: aligned_empty(n, pin=True))
        return BufferPool(budget_bytes, self.backend.alloc, self.backend.free)

    def wait_all(self) -> None:
        """Wait for every request issued so far; raises the first failure after all have finished.

        A failure that a handle's own wait() has raised already is not raised again: the caller has it,
        and sync()/close() after a handled error must not fail on it.
        """
        with self._pending_lock:
            pending, self._pending = self._pending, set()
        wait_all_handles(pending, skip_reported=True)

    def sync(self) -> None:
        """Wait for all requests, then make the written bytes durable (fsync)."""
        self.wait_all()
        self.backend.sync()

    def stats(self) -> dict:
        """Bytes, busy seconds and GB/s per device and direction (and ``any``: both, as a union), plus totals."""
        devices = []
        totals = {"read_bytes": 0, "write_bytes": 0}
        for path, lanes in zip(self.paths, self.backend.stats):
            entry = {"path": path, **{k: lane.snapshot() for k, lane in lanes.items()}}
            totals["read_bytes"] += entry["read"]["bytes"]
            totals["write_bytes"] += entry["write"]["bytes"]
            devices.append(entry)
        return {"backend": self.backend.name, "devices": devices, **totals,
                "staging": self._staging.stats(), "emulated_gbps": self.emulated_gbps}

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            self._stager.shutdown()
            self.backend.close()
            self._staging.clear()

    def __enter__(self) -> Volume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Volume({self.n_devices} device(s), {self.capacity_bytes} bytes, chunk={self.chunk_bytes}, "
                f"backend={self.backend.name})")


def _make_backend(name: str, paths: list[str], file_size: int, queue_depth: int | None, block_bytes: int,
                  gbps: float | None, pin: bool) -> tuple[Backend, str]:
    from .threads import ThreadsBackend

    if name in ("auto", "aio"):
        from .aio import AioBackend, AioUnavailable

        try:
            # auto never compiles: a silent ~8-minute op build would look like a hang. An explicit "aio" may,
            # and the build announces itself first.
            be = AioBackend(paths, file_size, queue_depth or 32, block_bytes, gbps, pin, build_op=name == "aio")
            return be, "libaio via DeepSpeed async_io" + (" (requested)" if name == "aio" else " (auto)")
        except AioUnavailable as e:
            if name == "aio":
                raise
            reason = f"aio unavailable: {e}"
            # Once per process and reason: a run opens several volumes, and the first line says it all.
            level = logging.INFO if reason in _fallbacks_said else logging.WARNING
            _fallbacks_said.add(reason)
            log.log(level, "io_engine: %s; backend 'auto' uses threads", reason)
            return ThreadsBackend(paths, file_size, queue_depth or 8, block_bytes, gbps, pin), reason
    return ThreadsBackend(paths, file_size, queue_depth or 8, block_bytes, gbps, pin), "requested"


_fallbacks_said: set[str] = set()


def _probe_writable(d: str) -> str:
    """Try to create a file: os.access lies for root and for read-only mounts."""
    probe = os.path.join(d, f".io_engine-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return ""


def _slab_problems(path: str, mpath: str, manifest: dict) -> list[str]:
    """A slab file missing or shorter than its manifest records: its bytes are gone, whatever we do.

    Re-extending it (posix_fallocate) would turn the lost tail into zeros that read back as valid data.
    """
    expected = manifest.get("file_size")
    fix = (f"the data in it is lost: restore it (from a backup or snapshot), or start over (delete this "
           f"volume's {os.path.basename(path)} and {os.path.basename(mpath)} in every directory)")
    if not os.path.exists(path):
        return [f"{path} is missing, but its manifest {os.path.basename(mpath)} records a slab file of "
                f"{expected} bytes: the slab file was deleted or moved; {fix}"]
    actual = os.path.getsize(path)
    if isinstance(expected, int) and actual < expected:
        return [f"{path} is {actual} bytes, but its manifest {os.path.basename(mpath)} records {expected} "
                f"bytes: the slab file was truncated or replaced; {fix}"]
    return []


_MANIFEST_FIELDS = {"version": int, "volume_id": str, "index": int, "n_devices": int, "chunk_bytes": int,
                    "file_size": int}


def _read_manifest(path: str, problems: list[str]) -> dict | None:
    """A volume manifest, checked: its checksum (version 2) and its fields; None when there is none, or when it is
    damaged (the problem, with the fix, is added to `problems`). A version 1 manifest (before manifests carried a
    checksum) is still read, fields checked, and rewritten as version 2 when the volume opens: refusing it would
    strand every store created before, and a damaged value in it still meets the volume's checks (devices, chunk,
    file size) and the store's (its volume id)."""
    if not os.path.exists(path):
        return None
    try:
        m, problem = durable.load_json(path)
    except OSError as e:
        m, problem = None, e.strerror or str(e)
    if problem is None and not (isinstance(m, dict) and m.get("version") == 1 and durable.CHECKSUM not in m):
        problem = durable.checksum_problem(m)
    if problem is None:
        problem = durable.fields_problem(m, _MANIFEST_FIELDS)
        if problem is None and m["version"] not in (1, MANIFEST_VERSION):
            problem = f"version {m['version']} is not one this io_engine reads (1 or {MANIFEST_VERSION})"
    if problem:
        problems.append(f"{path}: damaged volume manifest ({problem}); the volume's layout cannot be trusted: restore "
                        "the file from a backup, or start over (delete this volume's slab and manifest files in "
                        "every directory)")
        return None
    return {k: v for k, v in m.items() if k != durable.CHECKSUM}


def _write_manifest(path: str, data: dict) -> None:
    durable.write_json_atomic(path, data)
