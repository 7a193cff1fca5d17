"""Checksums off the serial paths (issue 38): the bytes of a READ are hashed as soon as the READ completes, and
those of a WRITE while the WRITE is in flight (its buffer cannot change then), on a thread of their own, so the
optimizer worker runs AdamW alone and the compute thread never hashes a block before its upload.

A `Hasher` is one long-lived thread (made once for its owner's life, as the optimizer's worker is: a thread
made per step gets a new glibc malloc arena each time, see `GradOffloader.__init__`). Its jobs run in the order
they are submitted, and a job never waits for I/O that is not already issued, so it never waits on its owner.
What a job computes is only the hash: comparing it with the commit's sums stays where the bytes are used
(`StateStore.check_unit`, on the worker or the compute thread), at the same point and with the same sums as
when the hashing ran there, so a mismatch still fails the step before the bytes are used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol


class _Waitable(Protocol):
    def done(self) -> bool: ...
    def wait(self) -> Any: ...


class Hashed:
    """An I/O request and the hash job of its buffer, waited on as one handle: `done` once both are over, `wait`
    until both are (the buffer may be reused only then: the hash job reads it too) and raises the I/O's error,
    `value` the job's result. For a READ the job itself waits for the I/O first (`io` None here)."""

    __slots__ = ("future", "io")

    def __init__(self, future: Future, io: _Waitable | None = None) -> None:
        self.future = future
        self.io = io

    def done(self) -> bool:
        return self.future.done() and (self.io is None or self.io.done())

    def wait(self) -> None:
        try:
            if self.io is not None:
                self.io.wait()
        finally:  # whatever the I/O did, the job still reads the buffer until it ends
            self.future.exception()
        self.future.result()

    def value(self) -> Any:
        """The hash job's result once the job is over, without waiting for a WRITE (a write-behind tail's sums
        are taken while it is in flight); for a READ, the job waited for it and raises its error."""
        return self.future.result()


class Hasher:
    """One thread hashing buffers for its owner; `hash_s` counts the CPU seconds its jobs spent hashing: the
    thread's own CPU time (`time.thread_time`), not the wall time of a job, which on a box whose cores are taken
    (by the I/O threads' copies, the emulated SSDs' through tmpfs above all) grows by the time the job waits for
    a core, work the cpu lane would then count twice: the lane is the CPU the optimizer's work takes."""

    def __init__(self, name: str = "lohan-hash") -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()  # hash_s is read and reset by the owner's thread
        self._hash_s = 0.0

    @property
    def hash_s(self) -> float:
        with self._lock:
            return self._hash_s

    def reset(self) -> None:
        with self._lock:
            self._hash_s = 0.0

    def after_read(self, io: _Waitable, fn: Callable[[], Any]) -> Hashed:
        """`fn()` (the hashing of a READ's buffer) on this thread once the READ `io` has completed; the returned
        handle stands for the READ and its hash (`io` is waited for by the job only)."""
        return Hashed(self._executor.submit(self._after, io, fn))

    def beside_write(self, io: _Waitable, fn: Callable[[], Any]) -> Hashed:
        """`fn()` (the hashing of a buffer whose WRITE `io` is in flight) on this thread now; the returned handle
        stands for the WRITE and its hash."""
        return Hashed(self._executor.submit(self._after, None, fn), io)

    def _after(self, io: _Waitable | None, fn: Callable[[], Any]) -> Any:
        if io is not None:
            io.wait()
        t0 = time.thread_time()
        try:
            return fn()
        finally:
            dt = time.thread_time() - t0
            with self._lock:
                self._hash_s += dt

    def close(self) -> None:
        """Wait for the jobs submitted and stop the thread."""
        self._executor.shutdown(wait=True)
