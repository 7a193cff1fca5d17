"""Page-aligned host buffers under a hard byte budget.

DeepSpeed users hit host OOM from unbounded pinned pools; here every byte of staging memory
is accounted for, and a request that would cross the budget waits for a release (or raises),
it never allocates past it.

Buffer lifecycle: FREE (cached, counted in `allocated`) -> IN_USE (handed out) -> FREE on
release, or KEPT (`AlignedBuffer.keep(key)`: free, but its bytes retained under a key until
`take_kept(key)` hands it out again). Kept buffers are a cache of content: any acquire that finds no
plain free buffer takes the oldest kept one (its key is forgotten) before it would wait, so keeping
never makes a request wait. Cached free buffers of the wrong size are evicted when room is needed.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable

import torch

from .base import ALIGN, BudgetExceededError, align_up

log = logging.getLogger(__name__)


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose address is ALIGN-aligned.

    torch CPU allocations are only 64-byte aligned, so over-allocate by one page and slice;
    the slice keeps the base storage alive. `pin=True` page-locks exactly these bytes through CUDA
    for as long as the tensor lives (`pinned_empty`).
    """
    if pin and nbytes > 0:
        return pinned_empty(nbytes)
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-base.data_ptr()) % ALIGN
    return base[skip:skip + nbytes]


class _RegisteredPages(mmap.mmap):
    """Anonymous pages that CUDA has page-locked (cudaHostRegister); unregistered when the last tensor
    over them is gone (torch.frombuffer holds a reference to this object until then), before the unmap."""

    registered = 0

    def __del__(self) -> None:
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered)
            except Exception:  # interpreter shutdown: the process is going away with its mappings
                pass
            self.registered = 0


_register_fallback: list[str] = []
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable (CUDA runtime API, cudaHostRegister flags)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-aligned host memory, page-locked through CUDA, that count exactly.

    Not `torch.empty(pin_memory=True)`: torch's pinned allocator rounds every block up to the next power
    of two (a 2.1 GiB buffer pins 4 GiB) and keeps freed blocks page-locked in its own cache, so a
    BufferPool's budget would neither bound the memory pinned nor get any of it back when it evicts or
    clears (PYTORCH_ALLOC_CONF pinned_max_round_threshold_mb / pinned_max_cached_size_mb, process-wide).
    Here the pages are an anonymous mapping registered with cudaHostRegister and released with the tensor.
    Falls back to torch's pinned allocator (with a warning) where registering fails.
    """
    if torch.cuda.is_available() and not _register_fallback:  # without CUDA, pin_memory=True below raises
        try:
            rt = torch.cuda.cudart()
            pages = _RegisteredPages(-1, nbytes, flags=mmap.MAP_PRIVATE)
            t = torch.frombuffer(pages, dtype=torch.uint8)
            # portable: page-locked for every GPU's context, not only for the device current on this thread (a
            # pool grows from whichever thread asks it for a buffer; on a multi-GPU box that may be device 0's)
            err = rt.cudaHostRegister(t.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
            if err != rt.cudaError.success:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
            pages.registered = t.data_ptr()
            if not t.is_pinned():  # torch must see it as page-locked, or copies and the aio op would not
                raise RuntimeError("registered memory is not reported as pinned by torch")
            return t
        except (RuntimeError, AttributeError, OSError) as e:
            _register_fallback.append(str(e))
            log.warning("io_engine: cannot page-lock buffers with cudaHostRegister (%s); using torch's pinned "
                        "allocator, which rounds sizes up to powers of two and caches freed blocks", e)
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    skip = (-base.data_ptr()) % ALIGN
    return base[skip:skip + nbytes]


_release_hooks: list[Callable[[torch.Tensor, bool], None]] = []


def add_release_hook(hook: Callable[[torch.Tensor, bool], None]) -> None:
    """Call `hook(memory, poison)` whenever a pool buffer is given back: `poison` is True on `release` (its
    bytes are garbage from then on) and False on `keep` (they are retained). The hook may raise to refuse the
    release. A test harness uses it to catch buffers given back while an asynchronous copy still uses them
    (lohan's simulated device)."""
    if hook not in _release_hooks:
        _release_hooks.append(hook)


class AlignedBuffer:
    """A buffer handed out by a BufferPool; call `release()` (or use as a context manager) when done."""

    __slots__ = ("tensor", "_full", "_pool", "_released")

    def __init__(self, full: torch.Tensor, nbytes: int, pool: BufferPool) -> None:
        self.tensor = full[:nbytes]
        self._full = full
        self._pool = pool
        self._released = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def capacity(self) -> int:
        """Bytes the buffer takes from its pool's budget (at least `nbytes`)."""
        return self._full.numel()

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            raise RuntimeError("buffer released twice")
        for hook in _release_hooks:
            hook(self._full, True)
        self._released = True
        self._pool._release(self)

    def keep(self, key: Hashable) -> None:
        """Release the buffer but retain its bytes under `key` (`BufferPool.take_kept`), for as long as no
        other request needs the room."""
        if self._released:
            raise RuntimeError("buffer released twice")
        for hook in _release_hooks:
            hook(self._full, False)
        self._released = True
        self._pool._keep(self, key)

    def __enter__(self) -> AlignedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BufferPool:
    """Aligned host buffers with a hard budget on the bytes allocated at any time.

    Args:
        budget_bytes: upper bound on bytes allocated by this pool (cached + in use).
        alloc: returns an aligned uint8 tensor of the given size (the backend's allocator,
            so buffers are directly usable for its transfers: mlocked for libaio, CUDA-pinned
            with a GPU).
        free: returns a tensor from `alloc` to the system.
    """

    def __init__(self, budget_bytes: int, alloc: Callable[[int], torch.Tensor] | None = None,
                 free: Callable[[torch.Tensor], None] | None = None) -> None:
        if budget_bytes < ALIGN:
            raise ValueError(f"buffer budget must be at least {ALIGN} bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._alloc = alloc or aligned_empty
        self._free = free or (lambda t: None)
        self._cond = threading.Condition()
        self._cache: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._kept: OrderedDict[Hashable, tuple[torch.Tensor, int]] = OrderedDict()  # key -> (full, nbytes)
        self.allocated = 0
        self.in_use = 0
        self.peak_allocated = 0
        self.waits = 0

    def acquire(self, nbytes: int, block: bool = True, timeout: float | None = None,
                evict: bool = True) -> AlignedBuffer:
        """A buffer of at least `nbytes` (exposed as exactly `nbytes`, capacity rounded to ALIGN).

        Blocks while the budget is exhausted by buffers in use, unless `block=False` (raises
        BudgetExceededError at once) or `timeout` elapses (raises as well). A request larger
        than the whole budget raises immediately, since no release could ever satisfy it. With
        `evict=False` kept buffers do not give way: only free room serves the request (for content
        that is worth less than what is kept).
        """
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        cap = align_up(nbytes)
        if cap > self.budget_bytes:
            raise BudgetExceededError(
                f"a {cap}-byte buffer exceeds the pool budget of {self.budget_bytes} bytes; "
                "raise the budget or use smaller requests")
        with self._cond:
            waited = False
            while True:
                cached = self._cache.get(cap)
                if cached:
                    tensor = cached.pop()
                    break
                if self.allocated + cap > self.budget_bytes:
                    # Full: lend the smallest larger cached buffer instead of freeing cached ones to
                    # allocate this size. Pools serve mixed sizes (a model's blocks differ), and evicting
                    # made the optimizer's pool free and re-allocate buffers every step, which fragments
                    # the malloc heap (RSS crept up; benchmarks/soak.py). Budgets are sized as count x
                    # the largest request, so lending a larger buffer never makes a planned request wait.
                    bigger = min((size for size, bufs in self._cache.items() if size > cap and bufs), default=None)
                    if bigger is not None:
                        tensor = self._cache[bigger].pop()
                        break
                    kept = self._oldest_kept(cap) if evict else None  # content kept for later gives way
                    if kept is not None:  # before anyone waits
                        tensor = self._kept.pop(kept)[0]
                        break
                if self._make_room(cap, evict):
                    self.allocated += cap
                    self.peak_allocated = max(self.peak_allocated, self.allocated)
                    try:
                        tensor = self._alloc(cap)
                    except BaseException:
                        self.allocated -= cap
                        raise
                    break
                if not block:
                    raise BudgetExceededError(
                        f"buffer pool budget of {self.budget_bytes} bytes exhausted "
                        f"({self.in_use} in use, {cap} requested)")
                if not waited:
                    self.waits += 1
                    waited = True
                if not self._cond.wait(timeout):
                    raise BudgetExceededError(
                        f"timed out after {timeout} s waiting for {cap} bytes of the "
                        f"{self.budget_bytes}-byte buffer budget ({self.in_use} in use)")
            self.in_use += tensor.numel()  # the buffer's capacity: `cap`, or more when a larger one is lent
        return AlignedBuffer(tensor, nbytes, self)

    def _oldest_kept(self, cap: int) -> Hashable | None:
        """The key of the oldest kept buffer of at least `cap` bytes (lock held)."""
        return next((k for k, (t, _) in self._kept.items() if t.numel() >= cap), None)

    def _make_room(self, cap: int, evict: bool = True) -> bool:
        """Evict cached free buffers, then (`evict`) kept ones, oldest first, until `cap` more bytes fit in
        the budget (lock held)."""
        if self.allocated + cap <= self.budget_bytes:
            return True
        for size in list(self._cache):
            bufs = self._cache[size]
            while bufs and self.allocated + cap > self.budget_bytes:
                self._free(bufs.pop())
                self.allocated -= size
            if not bufs:
                del self._cache[size]
        while evict and self._kept and self.allocated + cap > self.budget_bytes:
            t, _ = self._kept.popitem(last=False)[1]
            self._free(t)
            self.allocated -= t.numel()
        return self.allocated + cap <= self.budget_bytes

    def _release(self, buf: AlignedBuffer) -> None:
        cap = buf._full.numel()
        with self._cond:
            self.in_use -= cap
            self._cache[cap].append(buf._full)
            self._cond.notify_all()

    def _keep(self, buf: AlignedBuffer, key: Hashable) -> None:
        with self._cond:
            self.in_use -= buf._full.numel()
            old = self._kept.pop(key, None)
            if old is not None:  # a newer copy replaces it: the old buffer is plain free memory again
                self._cache[old[0].numel()].append(old[0])
            self._kept[key] = (buf._full, buf.nbytes)
            self._cond.notify_all()

    def take_kept(self, key: Hashable) -> AlignedBuffer | None:
        """The buffer kept under `key`, with the bytes it had, handed out again; None if it gave way."""
        with self._cond:
            hit = self._kept.pop(key, None)
            if hit is None:
                return None
            self.in_use += hit[0].numel()
        return AlignedBuffer(hit[0], hit[1], self)

    def forget(self, keep: Callable[[Hashable], bool] | None = None) -> None:
        """Turn kept buffers back into plain free ones: those whose key `keep` rejects, or all."""
        with self._cond:
            for key in [k for k in self._kept if keep is None or not keep(k)]:
                t, _ = self._kept.pop(key)
                self._cache[t.numel()].append(t)

    @property
    def kept_keys(self) -> list[Hashable]:
        with self._cond:
            return list(self._kept)

    def clear(self) -> None:
        """Free every cached and kept buffer (buffers in use stay valid)."""
        with self._cond:
            self.forget()
            for size, bufs in self._cache.items():
                for t in bufs:
                    self._free(t)
                    self.allocated -= size
            self._cache.clear()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"budget_bytes": self.budget_bytes, "allocated": self.allocated,
                    "in_use": self.in_use, "peak_allocated": self.peak_allocated, "waits": self.waits}
