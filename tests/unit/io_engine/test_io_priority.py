"""io_engine priority classes: URGENT reads overtake queued background reads and writes on both backends,
no class starves, and the bytes are the same whatever the classes (io_engine/priority.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from io_engine import Priority, open_volume
from io_engine.priority import AGE_LIMIT, ClassQueue

MiB = 1 << 20
GBPS = 0.2  # an emulated SSD this slow makes the order of service visible over the noise of a loaded box


@contextmanager
def _direct(vol, *sizes: int) -> Iterator[list[torch.Tensor]]:
    """Buffers the backend transfers without staging (aio: its own page-locked memory, given back after)."""
    pool = vol.buffer_pool(sum(sizes))
    bufs = [pool.acquire(n) for n in sizes]
    try:
        yield [b.tensor for b in bufs]
    finally:
        vol.wait_all()
        for b in bufs:
            b.release()
        pool.clear()


def test_an_urgent_read_overtakes_megabytes_of_queued_reads(backend, make_dirs):
    """96 MiB of READ-class reads are queued on a 0.2 GB/s device (~0.5 s of work); a 64 KiB URGENT read
    issued after them completes while most of them are still queued, in a fraction of the queue's time.
    With one FIFO per device it would complete last."""
    with (open_volume(make_dirs(1), 160 * MiB, backend=backend, emulate_ssd_gbps=GBPS) as vol,
          _direct(vol, 64 << 10, *[4 * MiB] * 24) as (small, *big)):
        small.copy_(torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
        vol.write(small, 100 * MiB).wait()
        want = small.clone()
        small.zero_()
        t0 = time.perf_counter()
        reads = [vol.read_into(b, i * 4 * MiB, priority=Priority.READ) for i, b in enumerate(big)]
        vol.read_into(small, 100 * MiB, priority=Priority.URGENT).wait()
        urgent_s = time.perf_counter() - t0
        reads_done = sum(h.done() for h in reads)
        got = small.clone()  # the buffer goes back to the backend when the block ends
        for h in reads:
            h.wait()
        total_s = time.perf_counter() - t0
    assert torch.equal(got, want)
    assert reads_done <= len(reads) // 2, f"{backend}: the URGENT read finished after {reads_done} of {len(reads)}"
    assert urgent_s < 0.5 * total_s, f"{backend}: URGENT read took {urgent_s:.3f} s of the queue's {total_s:.3f} s"


def test_an_urgent_read_overtakes_queued_writes(backend, make_dirs):
    """The disk is half-duplex: 64 MiB of queued writes must not delay a small URGENT read by all of them."""
    with (open_volume(make_dirs(1), 96 * MiB, backend=backend, emulate_ssd_gbps=GBPS) as vol,
          _direct(vol, 64 << 10, *[4 * MiB] * 16) as (small, *bufs)):
        t0 = time.perf_counter()
        writes = [vol.write(b, i * 4 * MiB) for i, b in enumerate(bufs)]
        vol.read_into(small, 80 * MiB, priority=Priority.URGENT).wait()
        urgent_s = time.perf_counter() - t0
        writes_done = sum(h.done() for h in writes)
        for h in writes:
            h.wait()
        total_s = time.perf_counter() - t0
    assert writes_done <= len(writes) // 2 and urgent_s < 0.5 * total_s, (
        f"{backend}: URGENT read done after {writes_done} of {len(writes)} writes, {urgent_s:.3f} of {total_s:.3f} s")


def test_a_background_read_is_not_starved_by_urgent_reads(backend, make_dirs):
    """A READ-class read queued behind 128 MiB of URGENT reads gets its turn after AGE_LIMIT more pieces, long
    before they are all done (strict priority would serve it last)."""
    with (open_volume(make_dirs(1), 160 * MiB, backend=backend, emulate_ssd_gbps=GBPS) as vol,
          _direct(vol, *[MiB] * 129) as (late, *urgent)):
        handles = [vol.read_into(b, i * MiB, priority=Priority.URGENT) for i, b in enumerate(urgent)]
        before = sum(h.done() for h in handles)  # on a loaded box the device may be well into them already
        vol.read_into(late, 140 * MiB, priority=Priority.READ).wait()
        urgent_done = sum(h.done() for h in handles) - before
        for h in handles:
            h.wait()
    assert urgent_done <= len(handles) // 2, (
        f"{backend}: the READ waited for {urgent_done} of the {len(handles) - before} URGENT reads queued before it")


def test_a_waiter_expedites_a_queued_write(backend, make_dirs):
    """A 64 KiB write queued behind 96 MiB of writes completes early once someone waits on it with
    expedite=URGENT (priority inheritance: the compute blocked on a write-behind); without it, it is last."""
    with (open_volume(make_dirs(1), 160 * MiB, backend=backend, emulate_ssd_gbps=GBPS) as vol,
          _direct(vol, 64 << 10, *[4 * MiB] * 24) as (small, *bufs)):
        t0 = time.perf_counter()
        writes = [vol.write(b, i * 4 * MiB) for i, b in enumerate(bufs)]
        vol.write(small, 100 * MiB).wait(expedite=Priority.URGENT)
        waited_s = time.perf_counter() - t0
        writes_done = sum(h.done() for h in writes)
        for h in writes:
            h.wait()
        total_s = time.perf_counter() - t0
    assert writes_done <= len(writes) // 2 and waited_s < 0.5 * total_s, (
        f"{backend}: expedited write done after {writes_done} of {len(writes)}, {waited_s:.3f} of {total_s:.3f} s")


@pytest.mark.parametrize("n_dirs", [1, 3])
def test_mixed_classes_move_the_same_bytes(backend, make_dirs, n_dirs):
    """Reads and writes of every class, aligned and staged, at odd sizes, all in flight at once: byte-exact."""
    gen = torch.Generator().manual_seed(n_dirs)
    with open_volume(make_dirs(n_dirs), 64 * MiB, chunk_bytes=256 << 10, backend=backend) as vol:
        sizes = [4096, 3 * MiB, 5000, MiB + 17, 8 * MiB, 12345]
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += n + 4096 + 123  # unaligned starts for some
        data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
        classes = list(Priority)
        hs = [vol.write(d, o, priority=classes[k % 3]) for k, (d, o) in enumerate(zip(data, offsets))]
        for h in hs:
            h.wait()
        outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        hs = [vol.read_into(out, o, priority=classes[(k + 1) % 3]) for k, (out, o) in enumerate(zip(outs, offsets))]
        for h in hs:
            h.wait()
    for k, (d, out) in enumerate(zip(data, outs)):
        assert torch.equal(d, out), f"{backend}, {n_dirs} dirs: request {k} ({sizes[k]} bytes) differs"


def _order(q: ClassQueue, n: int) -> list[str]:
    """Start and finish n items one at a time; the classes in the order they started."""
    out = []
    for _ in range(n):
        item, cls = q.get()
        out.append(item)
        q.done(cls)
    return out


def test_queue_serves_urgent_then_read_then_write_fifo_within_a_class():
    q = ClassQueue(workers=1)
    for name, cls in [("w1", Priority.WRITE), ("r1", Priority.READ), ("w2", Priority.WRITE), ("u1", Priority.URGENT),
                      ("r2", Priority.READ), ("u2", Priority.URGENT)]:
        q.put(name, cls)
    assert _order(q, 6) == ["u1", "u2", "r1", "r2", "w1", "w2"]


def test_queue_ages_a_waiting_class_in():
    """Under a continuous stream of URGENT work, a WRITE starts after at most AGE_LIMIT URGENT pieces."""
    q = ClassQueue(workers=1)
    q.put("w", Priority.WRITE)
    for i in range(3 * AGE_LIMIT):
        q.put(f"u{i}", Priority.URGENT)
    order = _order(q, 3 * AGE_LIMIT + 1)
    assert order.index("w") == AGE_LIMIT


def test_queue_keeps_a_worker_for_urgent_work():
    """Lower classes never hold every worker: with 2 workers and reads queued, the second worker is kept
    free, so an URGENT piece arriving later starts at once."""
    q = ClassQueue(workers=2)
    for i in range(4):
        q.put(f"r{i}", Priority.READ)
    assert q.get() == ("r0", Priority.READ)
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()), daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got, "a second READ took the worker kept for URGENT work"
    q.put("u", Priority.URGENT)
    t.join(5)
    assert got == [("u", Priority.URGENT)]


def test_queue_caps_writes_while_urgent_work_is_pending():
    """With URGENT work in flight, one WRITE may be in flight, not more; the next starts when it is over."""
    q = ClassQueue(workers=4)
    q.put("u", Priority.URGENT)
    for i in range(3):
        q.put(f"w{i}", Priority.WRITE)
    assert q.get() == ("u", Priority.URGENT)
    assert q.get() == ("w0", Priority.WRITE)
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()), daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got, "a second WRITE started beside URGENT work"
    q.done(Priority.URGENT)
    t.join(5)
    assert got == [("w1", Priority.WRITE)]


def test_write_queue_yields_to_the_urgent_reads_of_its_device():
    """The aio backend's write lane holds back while the read lane of its device has URGENT work."""
    reads = ClassQueue(workers=4)
    writes = ClassQueue(workers=4, yield_to=reads)
    for i in range(3):
        writes.put(f"w{i}", Priority.WRITE)
    reads.put("u", Priority.URGENT)
    assert writes.get() == ("w0", Priority.WRITE)
    got: list = []
    t = threading.Thread(target=lambda: got.append(writes.get()), daemon=True)
    t.start()
    assert reads.get() == ("u", Priority.URGENT)
    t.join(0.2)
    assert t.is_alive() and not got
    reads.done(Priority.URGENT)  # wakes the write lane
    t.join(5)
    assert got == [("w1", Priority.WRITE)]


def test_queue_promotes_waited_items_in_their_order():
    q = ClassQueue(workers=1)
    for name, cls in [("w0", Priority.WRITE), ("r0", Priority.READ), ("w1", Priority.WRITE), ("u0", Priority.URGENT),
                      ("w2", Priority.WRITE)]:
        q.put(name, cls)
    assert q.promote(lambda item: item in ("w2", "w1", "u0"), Priority.URGENT) == 2  # u0 is there already
    assert q.promote(lambda item: item == "w0", Priority.READ) == 1
    assert _order(q, 5) == ["u0", "w1", "w2", "r0", "w0"]


def test_closed_queue_drains_then_stops():
    q = ClassQueue(workers=1)
    q.put("r", Priority.READ)
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.put("x", Priority.READ)
    assert q.get() == ("r", Priority.READ)
    q.done(Priority.READ)
    assert q.get() is None


def test_the_engine_asks_for_urgent_parameter_reads_and_background_record_io(make_dirs, monkeypatch):
    """A step with states streamed from the SSDs and activations spilled to them: the reads the compute waits
    on (P16, activations) are URGENT, the optimizer's record READs (its read-ahead among them) are READ, and
    every write is WRITE, so the forward's P16 never queues behind the optimizer's I/O; where the compute
    waits on an activation write, it expedites it."""
    import sys

    import lohan
    from io_engine import Handle
    from io_engine.volume import Volume
    from tests.unit.runtime.test_clipping import batches, config, tiny_cfg

    seen: dict[tuple[str, str], set] = {}
    real = {"read": Volume.read_into, "write": Volume.write}

    def recorder(kind):
        def call(self, tensor, offset, priority=None):
            caller = sys._getframe(1).f_globals["__name__"].rsplit(".", 1)[-1]
            seen.setdefault((caller, kind), set()).add(priority)
            return real[kind](self, tensor, offset) if priority is None else real[kind](self, tensor, offset, priority)
        return call

    monkeypatch.setattr(Volume, "read_into", recorder("read"))
    monkeypatch.setattr(Volume, "write", recorder("write"))
    real_wait = Handle.wait

    def wait(self, timeout=None, expedite=None):
        caller = sys._getframe(1).f_globals["__name__"].rsplit(".", 1)[-1]
        seen.setdefault((caller, "wait for " + self._describe.split(" ")[0]), set()).add(expedite)
        return real_wait(self, timeout, expedite)

    monkeypatch.setattr(Handle, "wait", wait)
    ecfg = config(make_dirs(1), resident_mem=0, act_mem=0, total_steps=2)
    with lohan.init(tiny_cfg(n_layer=3), ecfg) as engine:
        for batch in batches(2):
            engine.step(batch)
    want = {("params", "read"): {Priority.URGENT}, ("offload", "read"): {Priority.READ},
            ("offload", "write"): {Priority.WRITE}, ("activation_store", "read"): {Priority.URGENT},
            ("activation_store", "write"): {Priority.WRITE},
            ("activation_store", "wait for write"): {Priority.URGENT}}  # the compute waiting on a spill write expedites it
    for key, classes in want.items():
        assert seen.get(key) == classes, f"{key}: asked for {seen.get(key)}, want {classes} (all: {seen})"


def test_a_write_never_waited_for_is_on_disk_after_the_process_exits(make_dirs):
    """The threads backend's workers are daemons; its queues are still drained at exit (ThreadPoolExecutor did)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    d = make_dirs(1)[0]
    script = (
        "import torch\n"
        "from io_engine import open_volume\n"
        "from io_engine.buffers import aligned_empty\n"
        f"vol = open_volume([{d!r}], 16 << 20, backend='threads', emulate_ssd_gbps=0.05)\n"
        "buf = aligned_empty(8 << 20)\n"
        "buf.fill_(7)\n"
        "vol.write(buf, 0)  # and exit without waiting or closing\n")
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    with open(os.path.join(d, "lohan.slab"), "rb") as f:
        assert f.read(8 << 20).count(7) == 8 << 20
