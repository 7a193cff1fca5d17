"""Aligned buffer pool: alignment, hard budget, blocking and reuse."""

from __future__ import annotations

import threading
import time

import pytest

from io_engine import ALIGN, BudgetExceededError, BufferPool

KiB = 1024


def test_buffers_are_page_aligned_and_sized():
    pool = BufferPool(1 << 20)
    for n in (1, 4095, 4096, 10000):
        with pool.acquire(n) as b:
            assert b.tensor.data_ptr() % ALIGN == 0
            assert b.nbytes == n


def test_request_larger_than_budget_raises_at_once():
    pool = BufferPool(64 * KiB)
    with pytest.raises(BudgetExceededError, match="exceeds the pool budget"):
        pool.acquire(65 * KiB)


def test_nonblocking_and_timeout_raise_when_exhausted():
    pool = BufferPool(64 * KiB)
    held = pool.acquire(48 * KiB)
    with pytest.raises(BudgetExceededError, match="exhausted"):
        pool.acquire(32 * KiB, block=False)
    with pytest.raises(BudgetExceededError, match="timed out"):
        pool.acquire(32 * KiB, timeout=0.05)
    held.release()
    pool.acquire(32 * KiB, block=False).release()


def test_blocks_until_release_and_never_exceeds_budget():
    pool = BufferPool(256 * KiB)
    peak = []
    errors = []

    def worker(i: int) -> None:
        try:
            for j in range(20):
                with pool.acquire((i + j) % 5 * 16 * KiB + 4 * KiB):
                    peak.append(pool.allocated)
                    time.sleep(0.001)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert max(peak) <= 256 * KiB and pool.peak_allocated <= 256 * KiB
    assert pool.in_use == 0


def test_released_buffers_are_reused():
    allocs = []

    def alloc(n):
        from io_engine import aligned_empty

        allocs.append(n)
        return aligned_empty(n)

    pool = BufferPool(1 << 20, alloc=alloc)
    for _ in range(10):
        pool.acquire(8 * KiB).release()
    assert allocs == [8 * KiB]


def test_double_release_is_an_error():
    pool = BufferPool(1 << 20)
    b = pool.acquire(10)
    b.release()
    with pytest.raises(RuntimeError, match="twice"):
        b.release()


def test_a_full_pool_lends_a_larger_cached_buffer_instead_of_reallocating():
    # Mixed sizes (a model's blocks differ): a full pool serves a small request from a larger cached
    # buffer rather than freeing cached ones to allocate, so steady state allocates nothing new.
    allocs, frees = [], []

    def alloc(n):
        from io_engine import aligned_empty

        allocs.append(n)
        return aligned_empty(n)

    pool = BufferPool(64 * KiB, alloc=alloc, free=lambda t: frees.append(t.numel()))
    big = [pool.acquire(32 * KiB), pool.acquire(32 * KiB)]
    for b in big:
        b.release()
    for _ in range(5):
        small = pool.acquire(8 * KiB)
        assert small.nbytes == 8 * KiB and pool.in_use == 32 * KiB  # the capacity lent is counted
        small.release()
        assert pool.in_use == 0
    assert allocs == [32 * KiB, 32 * KiB] and frees == []
    assert pool.allocated <= pool.budget_bytes


def test_kept_buffers_return_their_bytes_and_give_way_before_anyone_waits():
    pool = BufferPool(3 * 4 * KiB)
    a, b = pool.acquire(4 * KiB), pool.acquire(4 * KiB)
    a.tensor.fill_(7)
    b.tensor.fill_(9)
    a.keep(("a", 0))
    b.keep(("b", 0))
    assert pool.in_use == 0 and pool.kept_keys == [("a", 0), ("b", 0)]
    again = pool.take_kept(("b", 0))
    assert again is not None and int(again.tensor.min()) == int(again.tensor.max()) == 9
    again.keep(("b", 0))
    # room left for one more: allocated fresh, the kept ones stay
    c = pool.acquire(4 * KiB, block=False)
    assert pool.kept_keys == [("a", 0), ("b", 0)]
    # full: the oldest kept buffer is handed out (its key forgotten) instead of waiting or raising
    d = pool.acquire(4 * KiB, block=False)
    assert pool.kept_keys == [("b", 0)] and pool.take_kept(("a", 0)) is None
    assert pool.allocated <= pool.budget_bytes
    for buf in (c, d):
        buf.release()


def test_a_waiting_request_is_served_by_a_buffer_kept_after_it_started_waiting():
    pool = BufferPool(4 * KiB)
    held = pool.acquire(4 * KiB)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(4 * KiB, timeout=5)))
    t.start()
    time.sleep(0.05)
    held.keep("k")  # a keep wakes the waiter, which takes the kept buffer
    t.join(5)
    assert got and pool.kept_keys == []
    got[0].release()


def test_forget_turns_kept_buffers_into_free_ones_and_clear_frees_them():
    pool = BufferPool(8 * KiB)
    for key in ((1, 0), (2, 1)):
        pool.acquire(4 * KiB).keep(key)
    pool.forget(lambda key: key[1] != 1)  # forget slot 1's
    assert pool.kept_keys == [(1, 0)] and pool.take_kept((2, 1)) is None
    pool.clear()
    assert pool.kept_keys == [] and pool.allocated == 0
