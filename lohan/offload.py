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
        assert self._thread is not None, "finish() without begin_step()"
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise RuntimeError("the optimizer pipeline failed") from self._error

    # ----------------------------------------------------------------- worker
    def _run_guarded(self, *args) -> None:
        try:
            self._run(*args)
        except BaseException as e:  # surfaced to the compute thread by submit()/finish()
            self._error = e

    def _run(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int) -> None:
        layout = self.store.layout
        volume = self.store.volume
        reads: dict[int, tuple[AlignedBuffer, Handle]] = {}
        writes: deque[tuple[Handle, AlignedBuffer]] = deque()

        def issue_read(i: int) -> None:
            b = layout.blocks[i]
            # The pool's buffers are held by this thread alone (reads pending, writes in flight), so
            # when it is full, retire the oldest write instead of blocking on buffers only we release.
            while True:
                try:
                    buf = self.pool.acquire(b.record_bytes, block=not writes)
                    break
                except BudgetExceededError:
                    handle, old = writes.popleft()
                    handle.wait()
                    old.release()
            reads[i] = (buf, volume.read_into(buf.tensor[:3 * b.state_bytes], layout.record_offset(i, read_slot)))

        def reap(block_until_empty: bool) -> None:
            while writes and (block_until_empty or writes[0][0].done()):
                handle, buf = writes.popleft()
                handle.wait()
                buf.release()

        if self.mode == "serial":
            self._backward_done.wait()
        t_start = time.perf_counter()
        prefetch = self.mode in ("optimized", "serial")
        if prefetch:
            issue_read(order[0])
        for k, i in enumerate(order):
            t0 = time.perf_counter()
            got, grad = self._queue.get()
            self.grad_wait_s += time.perf_counter() - t0
            if got != i:
                raise RuntimeError(f"gradients of block {got} arrived where block {i} was expected")
            if not prefetch:
                issue_read(i)
            buf, handle = reads.pop(i)
            t0 = time.perf_counter()
            handle.wait()
            self.read_wait_s += time.perf_counter() - t0
            if prefetch and k + 1 < len(order):
                issue_read(order[k + 1])  # READ(i-1) goes out before WRITE(i) (Fig. 3b)
            b = layout.blocks[i]
            t0 = time.perf_counter()
            adamw_block_(RecordView(buf.tensor, b, self.store.p16_dtype),
                         grad.tensor[:4 * b.numel].view(torch.float32), b, step, hyper)
            self.adam_s += time.perf_counter() - t0
            grad.release()
            handle = volume.write(buf.tensor, layout.record_offset(i, write_slot))
            writes.append((handle, buf))
            reap(block_until_empty=self.mode == "naive")
        reap(block_until_empty=True)
        self.busy_s += time.perf_counter() - t_start
