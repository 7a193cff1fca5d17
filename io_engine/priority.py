"""I/O priority classes, and the per-device scheduler that serves them.

A disk serves one request queue. With one FIFO per device, a read the compute is blocked on waits behind
whatever was queued before it: a training step queues gigabytes of background reads (the next blocks' optimizer
records) and writes (updated records, spilled activations) well before the compute asks for the few megabytes it
needs next. Every request therefore carries a class, and each device serves the most urgent class first:

    URGENT  reads something is blocked on right now (the caller's critical path)
    READ    background reads: prefetches and read-ahead that may wait
    WRITE   write-behind: the bytes are in memory already; only a flush or a buffer's reuse waits for them

Three bounds keep strict priority from going wrong (`ClassQueue`):
- a worker is kept for URGENT work: lower classes never occupy all of a device's workers (when it has more
  than one), so an URGENT request starts at once instead of behind a full queue of lower ones;
- while URGENT work is queued or in flight, at most `write_cap` WRITE pieces are in flight (a disk is
  half-duplex: a deep queue of writes slows the reads the compute waits on), but never none;
- no class starves: once `age_limit` pieces of more urgent classes have started while a class waited, its
  oldest piece goes next.
Within a class, pieces start in the order they were queued (the pieces of one request stay in order).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any


class Priority(IntEnum):
    """How urgent an I/O request is; a lower value is served first."""

    URGENT = 0
    READ = 1
    WRITE = 2


def default_priority(write: bool) -> Priority:
    """The class of a request that names none: writes are WRITE, reads are READ."""
    return Priority.WRITE if write else Priority.READ


AGE_LIMIT = 16
"""Pieces of more urgent classes that may start while a less urgent one waits, before it gets a turn."""

_CLASSES = tuple(Priority)


class ClassQueue:
    """The pending pieces of one device (or one direction of one device), in priority classes.

    Thread-safe. Workers call `get()` for the next piece to start and `done(priority)` when it has finished,
    so the in-flight bounds can count it. `yield_to`: another ClassQueue of the same device (the aio backend
    keeps one per direction) whose URGENT work also caps this queue's WRITEs.
    """

    def __init__(self, workers: int, write_cap: int = 1, age_limit: int = AGE_LIMIT,
                 yield_to: ClassQueue | None = None) -> None:
        if workers < 1 or write_cap < 1 or age_limit < 1:
            raise ValueError(f"workers, write_cap and age_limit must be >= 1, got {workers}, {write_cap}, {age_limit}")
        # Lower classes may hold all workers but one, which stays free for URGENT work.
        self.lower_cap = max(1, workers - 1)
        self.write_cap = write_cap
        self.age_limit = age_limit
        self._queues: dict[Priority, deque] = {c: deque() for c in _CLASSES}
        self._inflight: dict[Priority, int] = {c: 0 for c in _CLASSES}
        self._skipped: dict[Priority, int] = {c: 0 for c in _CLASSES}
        self._cond = threading.Condition()
        self._closed = False
        self._yield_to = yield_to
        self._followers: list[ClassQueue] = []
        if yield_to is not None:
            yield_to._followers.append(self)

    def put(self, item: Any, priority: Priority) -> None:
        """Queue `item` (never None) behind the pieces of its class."""
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot queue I/O on a closed device queue")
            self._queues[Priority(priority)].append(item)
            self._cond.notify()

    def get(self) -> tuple[Any, Priority] | None:
        """The next (item, class) to start, waiting until one may start; None once closed and drained."""
        with self._cond:
            while True:
                picked = self._pick()
                if picked is not None:
                    if any(self._queues.values()):
                        self._cond.notify()  # more may start: wake the next idle worker
                    return picked
                if self._closed and not any(self._queues.values()):
                    self._cond.notify_all()
                    return None
                self._cond.wait()

    def get_more(self, priority: Priority) -> Any | None:
        """The next queued item of class `priority`, or None, without waiting: for a worker that batches, to
        add to the item get() gave it. The batch counts as one in flight (it holds one worker); its caller
        bounds its size, and calls done() once for it."""
        with self._cond:
            q = self._queues[priority]
            if not q:
                return None
            self._count_skips(priority)  # a piece started: the waiting classes age by one, as for get()
            return q.popleft()

    def done(self, priority: Priority) -> None:
        """A started item of class `priority` has finished."""
        with self._cond:
            self._inflight[priority] -= 1
            self._cond.notify()
            urgent_over = priority == Priority.URGENT and not self._urgent_here()
        if urgent_over:
            for f in self._followers:  # their WRITEs were capped for our URGENT work
                f.wake()

    def promote(self, match: Callable[[Any], bool], priority: Priority) -> int:
        """Move the queued items that `match` picks from less urgent classes to the end of `priority`'s, in
        their order (someone now waits on them: priority inheritance). Returns how many moved."""
        moved = 0
        with self._cond:
            target = self._queues[priority]
            for c in _CLASSES:
                if c <= priority or not self._queues[c]:
                    continue
                keep = deque()
                for item in self._queues[c]:
                    if match(item):
                        target.append(item)
                        moved += 1
                    else:
                        keep.append(item)
                self._queues[c] = keep
            if moved:
                self._cond.notify_all()
        return moved

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Let the workers finish what is queued, then return None from get()."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def urgent_pending(self) -> bool:
        """URGENT work is queued or in flight here."""
        with self._cond:
            return self._urgent_here()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Queued and in-flight pieces per class (for tests and diagnostics)."""
        with self._cond:
            return {c.name: {"queued": len(self._queues[c]), "inflight": self._inflight[c]} for c in _CLASSES}

    # -------------------------------------------------------------- policy
    def _urgent_here(self) -> bool:
        return bool(self._queues[Priority.URGENT]) or self._inflight[Priority.URGENT] > 0

    def _may_start(self, c: Priority) -> bool:
        if c == Priority.URGENT:
            return True
        if sum(self._inflight[k] for k in _CLASSES if k != Priority.URGENT) >= self.lower_cap:
            return False
        if c == Priority.WRITE and self._inflight[c] >= self.write_cap:
            urgent = self._urgent_here() or (self._yield_to is not None and self._yield_to.urgent_pending())
            return not urgent
        return True

    def _pick(self) -> tuple[Any, Priority] | None:
        """Start the next piece: a starved class first, else the most urgent class that may start."""
        waiting = [c for c in _CLASSES if self._queues[c]]
        starved = [c for c in waiting if self._skipped[c] >= self.age_limit]
        chosen = None
        for c in starved + waiting:
            # a starved class ignores the in-flight bounds once: it must get a turn
            if c in starved or self._may_start(c):
                chosen = c
                break
        if chosen is None:
            return None
        self._count_skips(chosen)
        self._inflight[chosen] += 1
        return self._queues[chosen].popleft(), chosen

    def _count_skips(self, chosen: Priority) -> None:
        for c in _CLASSES:
            if c > chosen and self._queues[c]:
                self._skipped[c] += 1
        self._skipped[chosen] = 0


class PriorityExecutor:
    """`workers` threads running submitted calls, most urgent class first (a ClassQueue's policy).

    The calls' exceptions go to their futures, as with concurrent.futures.ThreadPoolExecutor. Threads start
    on the first submit; `shutdown()` runs what is queued, then joins them. As with ThreadPoolExecutor, what
    is queued when the interpreter exits still runs (a write handed over and never waited for is not lost).
    """

    def __init__(self, workers: int, name: str, write_cap: int = 1, age_limit: int = AGE_LIMIT) -> None:
        self.queue = ClassQueue(workers, write_cap=write_cap, age_limit=age_limit)
        self._workers = workers
        self._name = name
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        _live.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any, priority: Priority = Priority.READ) -> Future:
        fut: Future = Future()
        self.queue.put((fut, fn, args), priority)
        if len(self._threads) < self._workers:
            with self._lock:
                while len(self._threads) < self._workers:
                    t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                    t.start()
                    self._threads.append(t)
        return fut

    def promote(self, futures: Iterable[Future], priority: Priority) -> int:
        """Move the queued calls of `futures` up to class `priority` (ClassQueue.promote)."""
        ids = {id(f) for f in futures}
        return self.queue.promote(lambda item: id(item[0]) in ids, priority) if ids else 0

    def _run(self) -> None:
        while True:
            picked = self.queue.get()
            if picked is None:
                return
            (fut, fn, args), priority = picked
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # as ThreadPoolExecutor: the caller's future carries it
                        fut.set_exception(e)
            finally:
                self.queue.done(priority)

    def shutdown(self) -> None:
        self.queue.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join()


_live: weakref.WeakSet[PriorityExecutor] = weakref.WeakSet()


def _drain_at_exit() -> None:
    for executor in list(_live):
        executor.shutdown()


# Run before the interpreter joins its threads, as concurrent.futures does; the workers are daemons so that an
# executor never shut down cannot keep a process alive, and this drains their queues first.
threading._register_atexit(_drain_at_exit)
