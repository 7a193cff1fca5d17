"""Active gradient offloading (paper §IV-C, Fig. 3): the CPU optimizer consumes each block's
gradients while the device continues backward on the blocks before it.

Per block i:  READ(i) = P32, m, v from the current slot;  ADAM(i) = CPU AdamW, new P16;
WRITE(i) = P32, m, v, P16 to the next slot (one sequential request each way).

Modes:
- ``serial``: nothing happens until backward is over, then the blocks are updated with READs
  prefetched one block ahead (the ZeRO-Infinity way: overlap inside the optimizer, none with backward).
- ``naive``: as each block's gradients arrive, READ(i) -> ADAM(i) -> WRITE(i), one after the other.
- ``optimized``: READ(i-1) is issued before WRITE(i), so WRITE(i) overlaps ADAM(i-1) and the SSD
  reads and writes, CPU Adam and device backward all proceed at once (Fig. 3b).

A worker thread runs the pipeline; the fused AdamW kernel and the I/O release the GIL. Memory is
bounded by the record pool (`max_inflight_blocks` records): a READ waits for a buffer when the
pipeline is full, which also bounds the writes in flight.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

from io_engine import AlignedBuffer, BudgetExceededError, BufferPool, Handle

from .optim import AdamWHyper, adamw_block_
from .store import RecordView, StateStore

_ABORT = -1  # queue marker: the compute side failed, stop the step


class GradOffloader:
    """The optimizer side of one training step, fed block by block from the backward pass."""

    def __init__(self, store: StateStore, pool: BufferPool, mode: str) -> None:
        if mode not in ("serial", "naive", "optimized"):
            raise ValueError(f"unknown offloading mode {mode!r}; choose serial, naive or optimized")
        self.store = store
        self.pool = pool
        self.mode = mode
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.adam_s = 0.0
        self.read_wait_s = 0.0
        self.grad_wait_s = 0.0
        self.busy_s = 0.0
        self.blocks_written = 0

    def begin_step(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int) -> None:
        """Start the pipeline for optimizer step `step` (1-based); blocks arrive in `order`."""
        if self._thread is not None:
            raise RuntimeError("begin_step called while the previous step is still running")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._backward_done = threading.Event()
        self._error = None
        args = (step, hyper, list(order), read_slot, write_slot)
        self._thread = threading.Thread(target=self._run_guarded, args=args, name="lohan-ago", daemon=True)
        self._thread.start()

    def submit(self, block: int, grad: AlignedBuffer) -> None:
        """Hand over block `block`'s complete fp32 gradient (the pipeline releases the buffer)."""
        if self._error is not None:
            raise RuntimeError("the optimizer pipeline failed") from self._error
        self._queue.put((block, grad))

    def backward_done(self) -> None:
        self._backward_done.set()

    def finish(self) -> None:
        """Wait until every block is updated and written (not yet committed)."""
        self._backward_done.set()
        if self._thread is None:
            raise RuntimeError("finish() without begin_step()")
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise RuntimeError("the optimizer pipeline failed") from self._error

    def abort(self) -> None:
        """Stop the step's pipeline after a failure on the compute side; no commit follows.

        The worker waits for the I/O it has in flight before giving its buffers back. Blocks it
        already wrote went to the next slot (or, in place, are covered by the dirty commit record).
        """
        if self._thread is None:
            return
        self._queue.put((_ABORT, None))
        self._backward_done.set()
        self._thread.join()
        self._thread = None
        self._error = None

    # ----------------------------------------------------------------- worker
    def _run_guarded(self, *args) -> None:
        try:
            self._run(*args)
        except BaseException as e:  # surfaced to the compute thread by submit()/finish()
            self._error = e
            while True:  # give back the gradient buffers the compute thread keeps handing over
                try:
                    _, grad = self._queue.get_nowait()
                except queue.Empty:
                    break
                if grad is not None:
                    grad.release()

    def _run(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int) -> None:
        self._read_slot, self._write_slot = read_slot, write_slot
        self._reads: dict[int, tuple[AlignedBuffer, Handle]] = {}
        self._writes: deque[tuple[Handle, AlignedBuffer]] = deque()
        t_start = time.perf_counter()
        try:
            self._pipeline(step, hyper, order)
        finally:  # also after an abort or a failure: no buffer goes back while I/O still uses it
            pending = [(h, b) for b, h in self._reads.values()] + list(self._writes)
            self._reads.clear()
            self._writes.clear()
            for handle, buf in pending:
                try:
                    handle.wait()
                finally:
                    buf.release()
            self.busy_s += time.perf_counter() - t_start

    def _pipeline(self, step: int, hyper: AdamWHyper, order: list[int]) -> None:
        layout = self.store.layout
        if self.mode == "serial":
            self._backward_done.wait()
        prefetch = self.mode in ("optimized", "serial")
        if prefetch:
            self._issue_read(order[0])
        for k, i in enumerate(order):
            t0 = time.perf_counter()
            got, grad = self._queue.get()
            self.grad_wait_s += time.perf_counter() - t0
            if got is _ABORT:
                return
            try:
                if got != i:
                    raise RuntimeError(f"gradients of block {got} arrived where block {i} was expected")
                if not prefetch:
                    self._issue_read(i)
                buf, handle = self._reads.pop(i)
                t0 = time.perf_counter()
                try:
                    handle.wait()
                except BaseException:
                    buf.release()
                    raise
                self.read_wait_s += time.perf_counter() - t0
                if prefetch and k + 1 < len(order):
                    self._issue_read(order[k + 1])  # READ(i-1) goes out before WRITE(i) (Fig. 3b)
                b = layout.blocks[i]
                t0 = time.perf_counter()
                try:
                    adamw_block_(RecordView(buf.tensor, b, self.store.p16_dtype),
                                 grad.tensor[:4 * b.numel].view(torch.float32), b, step, hyper)
                except BaseException:
                    buf.release()
                    raise
                self.adam_s += time.perf_counter() - t0
            finally:
                grad.release()
            self._writes.append((self.store.volume.write(buf.tensor, layout.record_offset(i, self._write_slot)), buf))
            self.blocks_written += 1
            self._reap(wait=self.mode == "naive")
        self._reap(wait=True)

    def _issue_read(self, i: int) -> None:
        """READ(i): P32, m, v of block i into a record buffer."""
        b = self.store.layout.blocks[i]
        # The pool's buffers are held by this thread alone (reads pending, writes in flight), so when it
        # is full, retire the oldest write instead of blocking on buffers only this thread releases.
        while True:
            try:
                buf = self.pool.acquire(b.record_bytes, block=not self._writes)
                break
            except BudgetExceededError:
                self._retire_oldest_write()
        offset = self.store.layout.record_offset(i, self._read_slot)
        self._reads[i] = (buf, self.store.volume.read_into(buf.tensor[:3 * b.state_bytes], offset))

    def _retire_oldest_write(self) -> None:
        handle, buf = self._writes.popleft()
        try:
            handle.wait()
        finally:
            buf.release()

    def _reap(self, wait: bool) -> None:
        """Give back the buffers of completed writes (all of them, waiting, when `wait`)."""
        while self._writes and (wait or self._writes[0][0].done()):
            self._retire_oldest_write()
