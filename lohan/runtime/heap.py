"""glibc heap settings for a long run: keep freed memory in the heap (`reuse_heap`) and give what store
building left back once (`release_free_memory`). The accounting of a run's peak RSS is `lohan.plan.memory`."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _libc(name: str) -> Callable[..., int] | None:
    """A glibc malloc function, or None where the C library is not glibc (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # malloc.h
_TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
_DEFAULT_MMAP_MAX, _DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults (malloc.c)


def reuse_heap() -> bool:
    """Have glibc's malloc serve every allocation from its heap and keep freed memory there (mallopt
    M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB); False where that does not exist.

    By default glibc maps each allocation over its mmap threshold (at most 32 MiB, however it is set) with
    its own mmap and unmaps it when it is freed, so a tensor that big is page-faulted in, page by page with
    the kernel zeroing each one, every time it is made. A training step makes the same big temporaries every
    step (the logits and their gradient, the embedding's gradient and its fp32 upcast). On the 110M Llama at
    batch 1 x seq 512 that was ~124k page faults and ~0.3 s of kernel time per step on 2 cores; from the
    heap they reuse pages already resident. benchmarks/soak.py, 300 steps: median step 1.054 s against
    1.187 s, peak RSS 2.457 against 2.396 GiB. What is freed stays resident for reuse instead of going
    back to the kernel, so the step-end RSS is the heap's high-water mark (there it grew once by 92 MiB, at
    step 61, by fragmentation, and stayed flat for the other 239 steps). The engine's `release_free_memory`
    after the first step still returns what store building left. glibc still maps what a heap cannot
    grow to hold (a thread arena's heap is at most 64 MiB): in that run 12-13 mappings, 0.85-0.94 GB, which
    is about the optimizer's record buffers. Process-wide and not undone.
    """
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_MAX, 0)) and bool(_MALLOPT(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_MAX))


def restore_heap_defaults() -> bool:
    """Undo `reuse_heap` for a process that goes on after a run (a test suite running many engines in one
    process): big allocations mapped and unmapped again, freed memory trimmed, and what the heap holds free given
    back now. Without it the heap keeps its high-water mark for the rest of the process: after the capacity tests
    a pytest process held a 17 GiB heap mapping, and a test's `fork()` failed with ENOMEM. False where glibc's
    malloc is not there. (glibc's threshold that adapts to freed mappings stays fixed at its start value.)"""
    if _MALLOPT is None or _MALLOC_TRIM is None:
        return False
    ok = bool(_MALLOPT(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)) and bool(_MALLOPT(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD))
    _MALLOC_TRIM(0)
    return ok


def release_free_memory() -> bool:
    """Give the pages glibc holds free in its malloc arenas back to the OS (`malloc_trim(0)`); False
    where that does not exist.

    The engine calls it once, after its first step: building the store (weights imported block by block)
    and the first step's profiling and SSD probe free a few hundred MiB that the allocator keeps resident.
    Measured on a 110M Llama at seq 512 (benchmarks/soak.py): step-end RSS 2.29 -> 2.08 GiB and peak RSS
    2.53 -> 2.32 GiB, at no cost to later steps. Trimming after every step as well takes step-end RSS from
    1.80 to 1.66 GiB (the pages each step frees and re-uses) but the peak only from 2.03 to 2.01 GiB, for
    15 ms and ~31k more page faults per step, so it is not done.
    """
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
