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

Write-behind (`begin_step(lazy=True)`, a deferred pass the next forward follows): once the gate is open, an
updated record's WRITE is held back until its buffer is needed for a READ, so the READs the next forward
waits for have the SSDs first, and the writes still held when the pass ends form the *tail*: they complete
while the next step's backward runs, and the next pass starts only after them (its `before` hook then makes
the step's staged commit durable). `tail_done` tells readers of that slot when its bytes are all written.

Resident records (`lohan.plan.pools.plan_resident`): the record buffers of some blocks stay in the pool from
one step to the next. Each step still WRITEs them (the commit needs every record on the SSDs), but the next
step finds their bytes in memory and skips their READ. The pool (`lohan.plan.pools.record_pool_bytes`) is the
least that streams the other records through `max_inflight_blocks` buffers while the records bigger than those stay (a tied embedding's,
3.5x a layer's: one buffer for it instead of `max_inflight_blocks`), never more than `max_inflight_blocks` of
the largest; `resident_mem` gives it more, and the room beyond the streaming buffers holds more resident
blocks. A buffer is tagged with the (slot, update) whose bytes it holds;
the next pass uses it only when its read slot and update follow that tag, so a skipped, redone, rolled-back
or dropped step makes its buffers read from the SSDs again.

A block whose record is larger than `chunk_elems` elements (a 175B layer's is 25 GB) goes through the
pipeline in chunks: the same READ / ADAM / WRITE per chunk, on the P32, m, v and P16 sub-ranges of the
record, so the optimizer's memory is bounded by chunks, not by the largest block.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from io_engine import AlignedBuffer, BudgetExceededError, BufferPool, Handle
from io_engine.base import align_up, wait_all_handles
from lohan.crashpoints import crashpoint
from lohan.plan import pools
from lohan.plan.pools import (  # noqa: F401  (the record geometry and pool sizes, defined in the planning layer)
    UPCAST_ELEMS,
    chunk_record_bytes,
    plan_resident,
    record_pool_bytes,
)
from lohan.runtime.optim import AdamWHyper, adamw_block_, adamw_chunk_, adamw_upcast_
from lohan.store.gradstash import GradStash, StashedGrad
from lohan.store.integrity import Sums, tensor_hash
from lohan.store.states import RecordView, StateStore, StoreLayout

_ABORT = -1  # queue marker: the compute side failed, stop the step

Unit = tuple[int, int, int]  # (block, first element, end element) of one READ / ADAM / WRITE
Provide = Callable[[int, int, int, torch.Tensor], None]
"""provide(block, lo, hi, p16): the new P16 of elements lo..hi of a block, handed over right after its update
(before its WRITE completes); called on the worker thread, in pipeline order."""


def upcast_bytes(layout: StoreLayout, chunk_elems: int | None, grad_dtype: torch.dtype | str | int,
                 clip: bool = False) -> int:
    """`lohan.plan.pools.upcast_bytes` at this module's `UPCAST_ELEMS`, the pieces `_fp32` works in (the scratch
    and the pieces change together when a test shrinks them)."""
    return pools.upcast_bytes(layout, chunk_elems, grad_dtype, clip, limit=UPCAST_ELEMS)


class _Resident:
    """A record buffer kept across steps, and the (slot, update) whose committed bytes it holds (None: not
    known to match any slot; its next READ goes to the SSDs)."""

    __slots__ = ("buf", "tag")

    def __init__(self, buf: AlignedBuffer) -> None:
        self.buf = buf
        self.tag: tuple[int, int] | None = None


class _Done:
    """The handle of a READ a resident record made unnecessary."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class ClipGate:
    """The coefficient the optimizer multiplies this step's gradients by (`clip_grad_norm_`'s clamped
    coefficient, a 0-d fp32 tensor): given at once (clipping off, or speculated), or once backward has
    ended and the global norm is known (deferred). `cancel` discards the step: the pipeline stops."""

    def __init__(self, coef: float | None = 1.0) -> None:
        self._ready = threading.Event()
        self.coef: torch.Tensor | None = None
        self.cancelled = False
        if coef is not None:
            self.open(torch.tensor(coef, dtype=torch.float32))

    @property
    def deferred(self) -> bool:
        return not self._ready.is_set()

    def open(self, coef: torch.Tensor) -> None:
        self.coef = coef
        self._ready.set()

    def cancel(self) -> None:
        self.cancelled = True
        self._ready.set()

    def wait(self) -> torch.Tensor | None:
        """The coefficient (None: the step was discarded)."""
        self._ready.wait()
        return None if self.cancelled else self.coef


class _Handles:
    """Several volume requests waited on as one."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        wait_all_handles(self.handles)


class GradOffloader:
    """The optimizer side of one training step, fed block by block from the backward pass."""

    def __init__(self, store: StateStore, pool: BufferPool, mode: str, chunk_elems: int | None = None,
                 grad_dtype: torch.dtype = torch.float32, decays: list[list[bool]] | None = None,
                 stash: GradStash | None = None, resident: list[int] | None = None,
                 thread_init: Callable[[], None] | None = None) -> None:
        if mode not in ("serial", "naive", "optimized"):
            raise ValueError(f"unknown offloading mode {mode!r}; choose serial, naive or optimized")
        if chunk_elems is not None and (chunk_elems < 4096 or chunk_elems % 4096):
            raise ValueError(f"chunk_elems={chunk_elems} must be a positive multiple of 4096 (keeps I/O aligned)")
        # The pipeline's units are the store's checksum units, so each READ and WRITE can be checked whole.
        if chunk_elems is not None and chunk_elems != store.check_elems:
            raise ValueError(f"chunk_elems={chunk_elems} differs from the store's checksum unit {store.check_elems}")
        self.store = store
        self.pool = pool
        self.mode = mode
        self.chunk_elems = store.check_elems
        self.grad_dtype = grad_dtype
        self.decays = decays or [[True] * len(b.params) for b in store.layout.blocks]
        self.stash = stash  # where gradients are kept for a redo (clipping); cleared by `release_kept`
        self._gate = ClipGate()
        self._keep = False
        self._provide: Provide | None = None
        self._upcast: torch.Tensor | None = None  # fp32 scratch for bf16 gradients, see `_fp32`
        self.read_ahead = mode == "optimized"  # READs beyond the next unit while the pool has room
        # One worker thread for the engine's life, not one per step: glibc gives every new thread one of
        # its (up to 8 x cores) malloc arenas, and what a per-step thread allocated (record buffers the
        # pool allocates on first use, the optimizer's temporaries) stayed resident in a different arena
        # each step (RSS crept up by ~50 MiB on the tiny preset over 30 steps; benchmarks/soak.py).
        # `thread_init` runs first on that thread (the engine's device becomes its current CUDA device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lohan-ago", initializer=thread_init)
        self._lazy = False
        self._held: deque[tuple[Unit, AlignedBuffer]] = deque()  # updated records whose WRITE is held back
        self._held_res: list[tuple[Unit, AlignedBuffer]] = []  # the same for resident ones: they free no room
        self._tail: list[tuple[Handle | _Handles, AlignedBuffer]] = []  # a lazy pass's last writes
        self.tail_done = threading.Event()  # set while no tail is in flight
        self.tail_done.set()
        self.tail_error: BaseException | None = None  # a tail write failed: that slot is not what was staged
        self._thread: Future | None = None  # the running step's pipeline
        self._error: BaseException | None = None
        # resident records (plan_resident): taken from the pool for the offloader's life
        self._res: dict[int, _Resident] = {}
        for i in resident or []:
            if self.units(i) != [(i, 0, store.layout.blocks[i].numel)]:
                raise ValueError(f"block {i} is updated in chunks: its record cannot stay resident")
            self._res[i] = _Resident(pool.acquire(store.layout.blocks[i].record_bytes, block=False))
        self._res_bufs = {id(r.buf) for r in self._res.values()}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.adam_s = 0.0
        self.read_wait_s = 0.0
        self.grad_wait_s = 0.0
        self.busy_s = 0.0
        self.hash_s = 0.0
        self.blocks_written = 0
        self.resident_hits = 0  # READs a resident record made unnecessary

    @property
    def resident(self) -> list[int]:
        """Blocks whose records stay in memory across steps (`plan_resident`)."""
        return sorted(self._res)

    def begin_step(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int,
                   gate: ClipGate | None = None, keep: bool = False, provide: Provide | None = None,
                   lazy: bool = False, before: Callable[[], None] | None = None) -> None:
        """Start the pipeline for optimizer step `step` (1-based); blocks are updated in `order`.

        Gradients may be submitted in any order: a block's update waits for its own. The backward order
        lets each update follow its gradient at once; a deferred step (every gradient is in hand by the
        time the gate opens) takes the forward order, so the next step's forward can follow the updates
        (`provide`). `gate` gives the gradient coefficient (default 1: no clipping); a deferred gate holds
        every update (READs still go out) until it opens. With `keep` the gradient buffers are kept after
        use, for `redo`, until `release_kept`. `provide` receives each unit's new P16 after its update.
        `lazy`: write-behind (module docstring); `finish` then returns with the tail in flight. The worker
        first completes the previous pass's tail, then calls `before` (if any), then runs this pass.
        """
        if self._thread is not None:
            raise RuntimeError("begin_step called while the previous step is still running")
        self._gate = gate or ClipGate()
        self._keep = keep
        self._provide = provide
        self._lazy = lazy
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._backward_done = threading.Event()
        self._error = None
        self._sums: dict[int, list[list[int]]] = {}
        args = (step, hyper, list(order), read_slot, write_slot)
        self._thread = self._executor.submit(self._run_guarded, args, before)

    def submit(self, block: int, grad: AlignedBuffer | StashedGrad) -> None:
        """Hand over block `block`'s complete gradient (the pipeline releases the buffer), or its place in
        the stash (a deferred update: the gradient may be on the SSDs until its update runs)."""
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
        self._thread.result()  # _run_guarded keeps the pipeline's exception in self._error
        self._thread = None
        if self._error is not None:
            raise RuntimeError("the optimizer pipeline failed") from self._error

    def sums_written(self) -> Sums | None:
        """Checksums of every record written this step, in block order (after `finish`)."""
        if not self.store.checksums:
            return None
        missing = [i for i in range(len(self.store.layout.blocks)) if i not in self._sums]
        if missing:
            raise RuntimeError(f"the optimizer step wrote no checksums for blocks {missing}")
        return [self._sums[i] for i in range(len(self.store.layout.blocks))]

    def begin_redo(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int,
                   coef: torch.Tensor, provide: Provide | None = None) -> None:
        """Start the step's optimizer pass again from `read_slot` (untouched: the speculative writes went to
        `write_slot`) with the kept gradients and the step's true coefficient; `finish` waits for it."""
        if self.stash is None:
            raise RuntimeError("redo needs a gradient stash")
        grads = [self.stash.get(i) for i in order]
        gate = ClipGate(None)
        gate.open(coef)
        self.begin_step(step, hyper, order, read_slot, write_slot, gate=gate, keep=False, provide=provide)
        for i, g in zip(order, grads):
            self._queue.put((i, g))
        self._backward_done.set()

    def redo(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int,
             coef: torch.Tensor) -> None:
        """`begin_redo`, then wait until every block is rewritten."""
        self.begin_redo(step, hyper, order, read_slot, write_slot, coef)
        self.finish()

    @property
    def busy(self) -> bool:
        """A step's pipeline is running on the worker."""
        return self._thread is not None

    @property
    def failure(self) -> BaseException | None:
        """The running step's pipeline failure, if it failed (for threads waiting on what it provides)."""
        return self._error

    def release_kept(self) -> None:
        """Give back the gradients kept for a redo (after the step is committed or discarded)."""
        if self.stash is not None:
            self.stash.clear()

    def drain_tail(self) -> None:
        """Wait for the last lazy pass's tail (between steps, on the caller's thread); raises if one of its
        writes failed, here or on the worker (`tail_error`, until `forget_tail_error`)."""
        if self._thread is not None:
            raise RuntimeError("drain_tail() while a step's pipeline is running")
        self._finish_tail()
        if self.tail_error is not None:
            raise RuntimeError("a write of the last step's optimizer pass failed") from self.tail_error

    def forget_tail_error(self) -> None:
        self.tail_error = None

    def close(self) -> None:
        """Stop the worker thread (after `finish` or `abort`); the offloader cannot run steps afterwards."""
        self._executor.shutdown(wait=True)
        try:
            self._finish_tail()  # no buffer goes back to the pool while a write still reads it
        except BaseException:  # the engine decided about this tail (flushed or discarded) before closing
            pass
        for r in self._res.values():
            r.buf.release()
        self._res.clear()
        self._res_bufs.clear()

    def abort(self) -> None:
        """Stop the step's pipeline after a failure on the compute side; no commit follows.

        The worker waits for the I/O it has in flight before giving its buffers back. Blocks it
        already wrote went to the next slot (or, in place, are covered by the dirty commit record).
        """
        if self._thread is None:
            return
        self._gate.cancel()
        self._queue.put((_ABORT, None))
        self._backward_done.set()
        self._thread.result()
        self._thread = None
        self._error = None
        self._drain()  # gradients the pipeline never took (it stopped at a cancelled gate)

    def _drain(self) -> None:
        """Give back the gradient buffers still queued, or taken out of order and not yet used."""
        for grad in getattr(self, "_arrived", {}).values():
            grad.release()
        self._arrived = {}
        while True:
            try:
                _, grad = self._queue.get_nowait()
            except queue.Empty:
                break
            if grad is not None:
                grad.release()

    # ----------------------------------------------------------------- worker
    def _finish_tail(self) -> None:
        """Wait for every write of the tail and give its buffers back (all of them, even when one failed)."""
        tail, self._tail = self._tail, []
        done: set[int] = set()
        try:
            for handle, buf in tail:
                try:
                    handle.wait()
                finally:
                    done.add(id(buf))
                    self._give_back(buf)
        except BaseException as e:
            self.tail_error = e
            for r in self._res.values():  # (their step is dropped: the tags no longer say so)
                r.tag = None
            for handle, buf in tail:
                if id(buf) not in done:
                    try:
                        handle.wait()
                    except BaseException:
                        pass
                    self._give_back(buf)
            raise
        finally:
            self.tail_done.set()

    def _run_guarded(self, args: tuple, before: Callable[[], None] | None) -> None:
        try:
            self._finish_tail()
            if before is not None:
                before()
            self._run(*args)
        except BaseException as e:  # surfaced to the compute thread by submit()/finish()
            self._error = e
            self._drain()  # the compute thread may keep handing buffers over until it sees the error

    def _run(self, step: int, hyper: AdamWHyper, order: list[int], read_slot: int, write_slot: int) -> None:
        self._read_slot, self._write_slot, self._update = read_slot, write_slot, step
        self._reads: dict[int, tuple[AlignedBuffer, Handle]] = {}
        self._writes: deque[tuple[Handle, AlignedBuffer]] = deque()
        self._held.clear()
        self._held_res.clear()
        self._arrived: dict[int, AlignedBuffer | StashedGrad] = {}  # gradients that came before their turn
        t_start = time.perf_counter()
        try:
            # write-behind: the writes still in flight complete beside the next step's backward
            if self._pipeline(step, hyper, order) and self._lazy:
                self._tail, self._writes = list(self._writes), deque()
                if self._tail:
                    self.tail_done.clear()
        finally:  # also after an abort or a failure: no buffer goes back while I/O still uses it
            for _, buf in [*self._held, *self._held_res]:  # never written (a failure or an abort)
                self._give_back(buf)
            self._held.clear()
            self._held_res.clear()
            pending = [(h, b) for b, h in self._reads.values()] + list(self._writes)
            self._reads.clear()
            self._writes.clear()
            for handle, buf in pending:
                try:
                    handle.wait()
                finally:
                    self._give_back(buf)
            self.busy_s += time.perf_counter() - t_start

    def units(self, i: int) -> list[Unit]:
        """Block i's pipeline units: the whole record, or chunks of `chunk_elems` elements."""
        n = self.store.layout.blocks[i].numel
        c = self.chunk_elems
        if c is None or n <= c:
            return [(i, 0, n)]
        return [(i, lo, min(lo + c, n)) for lo in range(0, n, c)]

    def _pipeline(self, step: int, hyper: AdamWHyper, order: list[int]) -> bool:
        """Run the pass; False if it stopped early (an aborted or discarded step)."""
        layout = self.store.layout
        if self.mode == "serial":
            self._backward_done.wait()
        prefetch = self.mode in ("optimized", "serial")
        units = [u for i in order for u in self.units(i)]
        if prefetch:
            self._issue_read(units[0])
        grad: AlignedBuffer | None = None
        current = None
        try:
            for k, unit in enumerate(units):
                i, lo, hi = unit
                if i != current:  # the block's first unit: wait for its gradients
                    if grad is not None:
                        self._done_with(current, grad)
                        grad = None
                    if self.read_ahead:  # reads need no gradient: use the wait to fetch further ahead
                        self._read_ahead(units, k)
                    t0 = time.perf_counter()
                    grad = self._take_grad(i)
                    self.grad_wait_s += time.perf_counter() - t0
                    if grad is None:
                        return False
                    current = i
                if not prefetch or unit not in self._reads:  # (a prefetch finds no room when the pool is
                    self._issue_read(unit)                    # one record, held by the unit before)
                buf, handle = self._reads.pop(unit)
                t0 = time.perf_counter()
                try:
                    handle.wait()
                except BaseException:
                    self._give_back(buf)
                    raise
                self.read_wait_s += time.perf_counter() - t0
                b = layout.blocks[i]
                if self.store.checksums and not isinstance(handle, _Done):  # (bytes that never left memory)
                    t0 = time.perf_counter()
                    try:
                        p32, m, v, _ = self._unit_views(buf, b, lo, hi)
                        self.store.check_unit(i, lo, "state", tensor_hash(p32, m, v), slot=self._read_slot)
                    except BaseException:
                        self._give_back(buf)
                        raise
                    self.hash_s += time.perf_counter() - t0
                if prefetch and k + 1 < len(units) and units[k + 1] not in self._reads:
                    self._issue_read(units[k + 1], wait=False)  # READ(i-1) goes out before WRITE(i) (Fig. 3b)
                if self.read_ahead and self._gate.deferred:  # a deferred update: read on meanwhile
                    self._read_ahead(units, k + 1)
                coef = self._gate.wait()  # deferred: until backward has ended and the norm is known
                if coef is None:  # the step was discarded (non-finite gradients, or an abort)
                    self._give_back(buf)
                    return False
                g = grad.tensor[:self.grad_dtype.itemsize * b.numel].view(self.grad_dtype)
                if i in self._res:  # updated in place: it holds no slot's bytes until its WRITE goes out
                    self._res[i].tag = None
                t0 = time.perf_counter()
                try:
                    if g.dtype != torch.float32 or float(coef) != 1.0:  # through the fp32 scratch, piece by piece
                        p32, m, v, p16 = self._unit_views(buf, b, lo, hi)
                        adamw_upcast_(p32, g[lo:hi], m, v, p16, step, hyper, b, lo, self.decays[i],
                                      lambda piece, coef=coef: self._fp32(piece, coef), UPCAST_ELEMS)
                    elif (lo, hi) == (0, b.numel):
                        adamw_block_(RecordView(buf.tensor, b, self.store.p16_dtype), g, b, step, hyper,
                                     self.decays[i])
                    else:
                        p32, m, v, p16 = self._chunk_views(buf, b, hi - lo)
                        adamw_chunk_(p32, g[lo:hi], m, v, p16, step, hyper, b, lo, self.decays[i])
                except BaseException:
                    self._give_back(buf)
                    raise
                self.adam_s += time.perf_counter() - t0
                if self._provide is not None:
                    self._provide(i, lo, hi, self._unit_views(buf, b, lo, hi)[3])
                if self.store.checksums:  # hashed before the write goes out: the bytes that reach the SSD
                    t0 = time.perf_counter()
                    p32, m, v, p16 = self._unit_views(buf, b, lo, hi)
                    self._sums.setdefault(i, []).append([tensor_hash(p32, m, v), tensor_hash(p16)])
                    self.hash_s += time.perf_counter() - t0
                if self._lazy:
                    (self._held_res if i in self._res else self._held).append((unit, buf))
                else:
                    self._issue_write(unit, buf)
                if lo == 0:
                    self.blocks_written += 1
                self._reap(wait=self.mode == "naive")
        finally:
            if grad is not None:
                self._done_with(current, grad)
        while self._held:
            self._release_held(smallest=False)
        for unit, buf in self._held_res:
            self._issue_write(unit, buf)
        self._held_res.clear()
        if not self._lazy:  # (a lazy pass leaves all of its writes in flight to the tail, failed ones too)
            self._reap(wait=True)
        return True

    def _take_grad(self, i: int) -> AlignedBuffer | StashedGrad | None:
        """Block i's gradient, from what arrived early or from the queue (None: the step was aborted)."""
        while i not in self._arrived:
            got, grad = self._queue.get()
            if got == _ABORT:
                return None
            if got in self._arrived or not 0 <= got < len(self.store.layout.blocks):
                raise RuntimeError(f"gradients of block {got} arrived twice or for no block of this store")
            self._arrived[got] = grad
        return self._arrived.pop(i)

    def _done_with(self, block: int | None, grad: AlignedBuffer | StashedGrad) -> None:
        if self._keep and block is not None and not isinstance(grad, StashedGrad):
            if self.stash is None:
                raise RuntimeError("keeping gradients needs a gradient stash")
            self.stash.put(block, grad)
        else:
            grad.release()  # a stashed gradient gives back only what reading it back took

    def _fp32(self, g: torch.Tensor, coef: torch.Tensor | None = None) -> torch.Tensor:
        """`g` as fp32: a bf16 gradient is upcast into one scratch kept for the engine's life (its size,
        `upcast_bytes`, is in the memory plan).

        Why not `g.float()`: that allocates 4 bytes per element on this thread, which is a new one every
        step. glibc hands each new thread one of its up to 8 x cores malloc arenas, and a freed chunk of
        tens of MiB stays resident at the top of a non-main arena (`malloc_trim` trims only the main
        one), so RSS grew by 27-54 MiB per step on a 110M Llama until every arena held one (~0.8 GiB on
        2 cores, more on bigger machines; found with malloc_info, see benchmarks/soak.py).
        """
        scale = coef is not None and float(coef) != 1.0  # x * 1 == x: the unclipped case needs no copy
        if g.dtype == torch.float32 and not scale:
            return g
        out = self._scratch()[:g.numel()]
        out.copy_(g)
        if scale:  # as clip_grad_norm_ scales: fp32 gradient times the fp32 0-d coefficient
            out.mul_(coef)
        return out

    def _scratch(self) -> torch.Tensor:
        """The fp32 upcast scratch (`upcast_bytes`), allocated on first use and kept."""
        if self._upcast is None:
            self._upcast = torch.empty(upcast_bytes(self.store.layout, self.chunk_elems, torch.bfloat16) // 4,
                                       dtype=torch.float32)
        return self._upcast

    def _unit_views(self, buf: AlignedBuffer, b, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        """(P32, m, v, P16) element views of a unit held in a record or chunk buffer."""
        if (lo, hi) == (0, b.numel):
            rec = RecordView(buf.tensor, b, self.store.p16_dtype)
            return rec.p32, rec.m, rec.v, rec.p16
        return self._chunk_views(buf, b, hi - lo)

    def _chunk_views(self, buf: AlignedBuffer, b, n: int) -> tuple[torch.Tensor, ...]:
        """(P32, m, v, P16) views of a chunk buffer."""
        sb = align_up(4 * n)
        t = buf.tensor
        p32, m, v = (t[k * sb:k * sb + 4 * n].view(torch.float32) for k in range(3))
        p16 = t[3 * sb:3 * sb + b.p16_itemsize * n].view(self.store.p16_dtype)
        return p32, m, v, p16

    def _ranges(self, unit: Unit, slot: int, with_p16: bool) -> list[tuple[int, int, int]]:
        """(buffer offset, volume offset, bytes) of a chunk's sections in its buffer and in the record."""
        i, lo, hi = unit
        b = self.store.layout.blocks[i]
        n, sb = hi - lo, align_up(4 * (hi - lo))
        rec = self.store.layout.record_offset(i, slot)
        out = [(k * sb, rec + k * b.state_bytes + 4 * lo, 4 * n) for k in range(3)]
        if with_p16:
            out.append((3 * sb, rec + b.p16_start + b.p16_itemsize * lo, b.p16_itemsize * n))
        return out

    def _whole(self, unit: Unit) -> bool:
        i, lo, hi = unit
        return (lo, hi) == (0, self.store.layout.blocks[i].numel)

    def _write(self, unit: Unit, buf: AlignedBuffer) -> Handle | _Handles:
        """WRITE: the updated P32, m, v, P16 to the next slot (one request for a whole record)."""
        if self._whole(unit):
            return self.store.volume.write(buf.tensor, self.store.layout.record_offset(unit[0], self._write_slot))
        vol = self.store.volume
        return _Handles([vol.write(buf.tensor[o:o + n], off)
                         for o, off, n in self._ranges(unit, self._write_slot, with_p16=True)])

    def _issue_read(self, unit: Unit, wait: bool = True) -> None:
        """READ: P32, m, v of a block (or chunk) into a record buffer. Without `wait` it is skipped when no
        write of this thread would free the room (the only other buffer is the one this thread updates)."""
        i, lo, hi = unit
        b = self.store.layout.blocks[i]
        res = self._res.get(i)
        if res is not None:  # its own buffer: no room needed, and no READ when it holds the slot's bytes
            if res.tag == (self._read_slot, self._update - 1):
                self._reads[unit] = (res.buf, _Done())
                self.resident_hits += 1
                return
            res.tag = None
            self._reads[unit] = (res.buf, self.store.volume.read_into(
                res.buf.tensor[:3 * b.state_bytes], self.store.layout.record_offset(i, self._read_slot)))
            return
        nbytes = b.record_bytes if self._whole(unit) else chunk_record_bytes(hi - lo, b.p16_itemsize)
        # The pool's buffers are held by this thread alone (reads pending, writes in flight), so when it
        # is full, retire the oldest write instead of blocking on buffers only this thread releases.
        while True:
            try:
                buf = self.pool.acquire(nbytes, block=wait and not self._writes and not self._held)
                break
            except BudgetExceededError:
                if not self._writes and not self._held:
                    return
                if not self._writes:  # write-behind: the oldest held update goes out to make room
                    self._release_held()
                self._retire_oldest_write()
        vol = self.store.volume
        if self._whole(unit):
            handle = vol.read_into(buf.tensor[:3 * b.state_bytes], self.store.layout.record_offset(i, self._read_slot))
        else:
            handle = _Handles([vol.read_into(buf.tensor[o:o + n], off)
                               for o, off, n in self._ranges(unit, self._read_slot, with_p16=False)])
        self._reads[unit] = (buf, handle)

    def _read_ahead(self, units: list[Unit], k: int) -> None:
        """Issue the READs of units[k], units[k+1], ... not yet issued while the record pool has a buffer
        free without waiting (completed writes are reaped first). The pipeline otherwise reads one unit
        ahead of the gradients; the last blocks of backward then wait on their reads after the device is
        done (a tied embedding's record is the largest and comes last). Reads go out in unit order and
        are consumed in that order, so the buffers they hold are always released."""
        self._reap(wait=False)
        for unit in units[k:]:
            if unit in self._reads:
                continue
            if unit[0] in self._res:
                self._issue_read(unit)
                continue
            i, lo, hi = unit
            b = self.store.layout.blocks[i]
            nbytes = b.record_bytes if self._whole(unit) else chunk_record_bytes(hi - lo, b.p16_itemsize)
            room = self.pool.budget_bytes - self.pool.in_use
            if room < align_up(nbytes):
                # write-behind, gate open: send out held updates until their buffers make room for this READ;
                # not one much larger than the READ (a tied embedding's record), which would hold up the READ
                # longer than waiting for the next block's update does (the unit's own READ takes any)
                coming = sum(buf.capacity for _, buf in self._writes)
                while (not self._gate.deferred and room + coming < align_up(nbytes)
                       and any(buf.capacity <= 2 * align_up(nbytes) for _, buf in self._held)):
                    coming += self._release_held(limit=2 * align_up(nbytes))
                return
            self._issue_read(unit)

    def _release_held(self, smallest: bool = True, limit: int | None = None) -> int:
        """Issue the WRITE of a held update: the smallest (its room comes soonest), the oldest, or (`limit`) the
        oldest of at most `limit` bytes. Returns its buffer's bytes."""
        if limit is not None:
            k = next(j for j, (_, buf) in enumerate(self._held) if buf.capacity <= limit)
        else:
            k = min(range(len(self._held)), key=lambda j: self._held[j][1].capacity) if smallest else 0
        unit, buf = self._held[k]
        del self._held[k]
        self._issue_write(unit, buf)
        return buf.capacity

    def _issue_write(self, unit: Unit, buf: AlignedBuffer) -> None:
        self._writes.append((self._write(unit, buf), buf))
        if unit[0] in self._res:  # its bytes are the ones of the slot written, once that step is committed
            self._res[unit[0]].tag = (self._write_slot, self._update)
        crashpoint("offload.write_issued")

    def _give_back(self, buf: AlignedBuffer) -> None:
        """Release a record buffer to the pool, unless it is a resident one."""
        if id(buf) not in self._res_bufs:
            buf.release()

    def _retire_oldest_write(self) -> None:
        handle, buf = self._writes.popleft()
        try:
            handle.wait()
        finally:
            self._give_back(buf)

    def _reap(self, wait: bool) -> None:
        """Give back the buffers of completed writes (all of them, waiting, when `wait`)."""
        while self._writes and (wait or self._writes[0][0].done()):
            self._retire_oldest_write()
