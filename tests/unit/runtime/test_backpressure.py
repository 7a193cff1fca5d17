"""Back-pressure and tails (issue 38): optimized mode's gradient pool holds every block's gradient, as serial
mode's, where cpu_mem allows it (backward no longer waits for an optimizer that fell behind), and the next
optimizer pass waits for the last pass's write-behind tail per buffer instead of draining it whole first."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest

import lohan
from io_engine.align import ALIGN, align_up
from lohan.config import EngineConfig, get_model_config
from lohan.plan.pools import model_geometry, plan_host_memory
from lohan.runtime.record_buffers import BufState, Handles, Ledger, RecordBuffer, WriteBehind
from tests.unit.runtime.test_clipping import batches, config, reference, same_weights, tiny_cfg

GiB = 1 << 30


def _plan(mode: str, cpu_mem: int, **kw):
    ecfg = EngineConfig(compute_dtype="bf16", cpu_mem=cpu_mem, mode=mode, nvme=("unused",), max_grad_norm=0.0,
                        **kw)
    return plan_host_memory(model_geometry(get_model_config("350m"), "bf16", 2, align=ALIGN), ecfg, check=False)


@pytest.mark.parametrize("kw", [dict(clip_mode="speculate"), dict(clip_mode="speculate", resident_mem=0)])
def test_optimized_grads_pool_is_at_least_serials_where_memory_allows(kw):
    """350m, bf16, clipping off, 8 GiB: optimized's grads pool was two block buffers (0.20 GiB) against serial's
    every block (0.66 GiB), and backward waited for the optimizer to give one back."""
    serial, optimized = _plan("serial", 8 * GiB, **kw), _plan("optimized", 8 * GiB, **kw)
    assert optimized.grads + optimized.grad_stash >= serial.grads
    assert not optimized.grads_short and "short" not in optimized.describe()
    assert optimized.total <= optimized.budget


def test_where_cpu_mem_does_not_allow_the_pool_stays_and_the_plan_says_so():
    # (2.5 GiB: the record pool keeps the chunked embedding whole beside three layer buffers instead of three chunk
    # buffers, 1.28 instead of 1.63 GB, so 3 GiB now holds every block's gradient)
    tight = _plan("optimized", int(2.5 * GiB), clip_mode="speculate", resident_mem=0)
    serial = _plan("serial", 8 * GiB, clip_mode="speculate", resident_mem=0)
    two = 2 * max(_block_grads())
    assert tight.grads == two < serial.grads and tight.total <= tight.budget
    assert tight.grads_short == serial.grads - two
    assert "short of every block's gradient" in tight.describe()


def _block_grads() -> list[int]:
    layout = model_geometry(get_model_config("350m"), "bf16", 2, align=ALIGN).layout
    return [align_up(2 * b.numel) for b in layout.blocks]  # bf16 gradients, one buffer a block


# ------------------------------------------------------------------------------ the tail, waited for per buffer
WRITE_S = 0.2  # the emulated disk completes one record WRITE every WRITE_S seconds, in issue order


class _SlowWrite:
    """A store WRITE that completes at `at` (the emulated disk's turn), and not before the real one."""

    def __init__(self, real, at: float) -> None:
        self.real, self.at = real, at

    @property
    def reported(self) -> bool:
        return self.real.reported

    def done(self) -> bool:
        return time.monotonic() >= self.at and self.real.done()

    def wait(self, timeout: float | None = None) -> None:
        self.real.wait()
        time.sleep(max(0.0, self.at - time.monotonic()))


def _io(handle):
    """The write request under a handle (a checksummed WRITE's handle wraps it with its hash job: `Hashed`)."""
    return getattr(handle, "io", None) or handle


def _slow_disk(monkeypatch, volume) -> tuple[list, list, list]:
    """Writes to `volume` complete one every WRITE_S seconds while `slow[0]`; returns the logs of (offset, issued,
    done) writes and (offset, issued) reads, and `slow`."""
    writes, reads, lock, turn, slow = [], [], threading.Lock(), [0.0], [True]
    real_write, real_read = volume.write, volume.read_into

    def write(tensor, offset, *a, **kw):
        handle = real_write(tensor, offset, *a, **kw)
        if not slow[0]:
            return handle
        with lock:
            now = time.monotonic()
            turn[0] = max(turn[0], now) + WRITE_S
            writes.append((offset, now, turn[0]))
            return _SlowWrite(handle, turn[0])

    def read_into(tensor, offset, *a, **kw):
        reads.append((offset, time.monotonic()))
        return real_read(tensor, offset, *a, **kw)

    monkeypatch.setattr(volume, "write", write)
    monkeypatch.setattr(volume, "read_into", read_into)
    return writes, reads, slow


def test_the_next_pass_reads_beside_the_tail_and_waits_per_block(make_dirs, monkeypatch):
    """A deferred pass's last writes (its tail) are still on a slow disk when the next step begins: that step's
    pass READs a block the tail does not write at once, before the tail's last write completes, while a READ (of
    the records or of the P16) of a block the tail still writes waits for that block's write; the staged commit
    becomes durable only once the whole tail is written, and before the pass's first WRITE. Bit-exact."""
    mcfg = tiny_cfg(n_layer=4)
    ecfg = config(make_dirs(1), clip_mode="defer", max_grad_norm=0.0, max_inflight_blocks=4, resident_mem=0,
                  readahead_mem=0, prefetch_depth=1)
    data = list(batches(3))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    with lohan.init(mcfg, ecfg) as engine:
        writes, reads, slow = _slow_disk(monkeypatch, engine.store.volume)
        losses = [engine.step(data[0], next_batch=data[1])]
        ago, layout, slot = engine.offloader, engine.layout, engine.store.slot
        assert engine.store.staged and ago.behind.tail
        tail = {rb.unit[0]: _io(rb.handle).at for rb in ago.behind.tail}
        assert len(tail) < len(layout.blocks)  # some blocks' records were written before the tail
        persisted = []
        real_persist = engine.store.persist
        monkeypatch.setattr(engine.store, "persist", lambda: (persisted.append(time.monotonic()), real_persist()))
        first_write = len(writes)
        reads.clear()
        losses.append(engine.step(data[1], next_batch=data[2]))  # in forward order, the next forward beside it
        slow[0] = False
        reads = reads[:]  # step 1's
        losses.append(engine.step(data[2]))
        params = engine.state_dict_fp32()
    record = {layout.record_offset(i, slot): i for i in range(len(layout.blocks))}
    p16 = {layout.p16_offset(i, slot): i for i in range(len(layout.blocks))}
    record_reads = [(record[off], t) for off, t in reads if off in record]
    # a block the tail does not write: READ before the tail's last write completes (it waits for room only)
    assert min(t for i, t in record_reads if i not in tail) < max(tail.values())
    for i, t in record_reads + [(p16[off], t) for off, t in reads if off in p16]:
        assert t >= tail.get(i, 0.0), (i, t - tail[i])  # a block the tail writes: after its write is complete
    assert persisted and persisted[0] >= max(tail.values())  # durable once every tail write is complete
    assert writes[first_write:] and all(issued >= persisted[0] for _, issued, _ in writes[first_write:])  # then WRITEs
    assert losses == ref_losses
    same_weights(params, ref_params)


class _Request:
    """A volume request that completes when told (`finish`), or fails."""

    def __init__(self) -> None:
        self.event, self.error, self.reported = threading.Event(), None, False

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            self.reported = True
            raise self.error

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.event.set()


def _tail(units, handles):
    """A WriteBehind whose tail is one WRITING buffer per unit, with the given requests."""
    ledger, released = Ledger(), []
    behind = WriteBehind(SimpleNamespace(forget=lambda: released.append("forget")))
    writes = deque()
    for unit, handle in zip(units, handles):
        rb = RecordBuffer(unit, SimpleNamespace(release=lambda u=unit: released.append(u), capacity=4096), ledger)
        for state in (BufState.READING, BufState.READY, BufState.UPDATING, BufState.WRITING):
            rb.to(state)
        rb.handle = handle
        writes.append(rb)
    behind.adopt(writes)
    return behind, released


def test_the_tail_is_waited_for_and_retired_per_block():
    a, b, c1, c2 = (_Request() for _ in range(4))
    behind, released = _tail([(0, 0, 8), (1, 0, 8), (2, 0, 4)], [a, b, Handles([c1, c2])])  # block 2: a chunk's two
    assert not behind.done.is_set() and behind.writing(2)
    waiter = threading.Thread(target=behind.wait_block, args=(2,))  # another thread: waits, retires nothing
    waiter.start()
    c1.finish()
    waiter.join(0.05)
    assert waiter.is_alive()  # its second request is still in flight
    c2.finish()
    waiter.join(5)
    assert not waiter.is_alive() and len(behind.tail) == 3 and not released
    behind.reap()  # the complete ones go back, without waiting for the others
    assert released == [(2, 0, 4)] and [rb.unit[0] for rb in behind.tail] == [0, 1]
    b.finish()
    behind.retire_block(1)
    assert released[-1] == (1, 0, 8) and not behind.done.is_set()
    a.finish()
    behind.retire_oldest()
    assert behind.done.is_set() and not behind.tail and behind.error is None
    behind.wait_block(0)  # nothing in flight: returns at once


def test_a_failed_tail_write_retires_the_whole_tail_and_is_kept():
    a, b = _Request(), _Request()
    behind, released = _tail([(0, 0, 8), (1, 0, 8)], [a, b])
    a.finish(OSError("EIO"))
    b.finish()
    with pytest.raises(OSError, match="EIO"):
        behind.retire_block(0)
    assert behind.done.is_set() and not behind.tail and isinstance(behind.error, OSError)
    assert sorted(u for u in released if u != "forget") == [(0, 0, 8), (1, 0, 8)] and "forget" in released
