"""Checksums off the serial paths (issue 38): the optimizer worker runs AdamW alone (READs are hashed as they
complete and records while their WRITE is in flight, on hash threads), the compute thread never hashes a P16
before its upload, and damaged bytes still stop the step before they are used."""

from __future__ import annotations

import threading
import time

import pytest

import lohan
import lohan.runtime.offload as offload
import lohan.runtime.params as params
from lohan.runtime.hasher import Hasher
from lohan.store.integrity import StoreCorruptError
from lohan.store.states import StateStore
from tests.unit.store.test_integrity import flip, store_offsets, trained_store
from tests.unit.store.test_store import batch, ecfg, small_model


def spy(monkeypatch, module, name: str, seen: list[str], delay: float = 0.0) -> None:
    """Wrap module.name (a hash function) to note the thread it runs on (and take `delay` seconds longer)."""
    real = getattr(module, name)

    def wrapped(*args):
        seen.append(threading.current_thread().name)
        if delay:
            time.sleep(delay)
        return real(*args)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize(("mode", "device"), [("optimized", "cpu"), ("serial", "cpu"), ("optimized", "sim")])
def test_the_optimizer_worker_and_the_compute_thread_hash_nothing(make_dirs, monkeypatch, mode, device):
    monkeypatch.setenv("LOHAN_DEVICE", device)
    dirs = make_dirs(1)
    trained_store(dirs, steps=1, mode=mode)
    record_hashes, record_sums, p16_hashes = [], [], []
    spy(monkeypatch, offload, "tensor_hash", record_hashes)
    spy(monkeypatch, offload, "unit_sums", record_sums)
    spy(monkeypatch, params, "tensor_hash", p16_hashes)
    with lohan.init(small_model(), ecfg(dirs, mode=mode), resume=True) as engine:  # nothing kept yet
        engine.step(batch(1))
        blocks = len(engine.store.layout.blocks)
        # the CPU computes on the resident records in place: it reads (and hashes) no P16 of theirs
        streamed = blocks - len(engine.run_plan.zero_copy)
        assert engine.offloader.hash_s > 0 and (engine.streamer.hash_s > 0 or not streamed)  # where they now run
    # every record READ from the SSDs (none is resident after a resume: read before the pass where the CPU computes
    # on them), every record written, every P16 read
    assert len(record_hashes) == blocks and len(record_sums) == blocks and len(p16_hashes) >= streamed
    assert {n.rsplit("_", 1)[0] for n in record_hashes} == {"lohan-ago-verify"}
    assert {n.rsplit("_", 1)[0] for n in record_sums} == {"lohan-ago-sum"}
    assert {n.rsplit("_", 1)[0] for n in p16_hashes} == ({"lohan-p16-verify"} if streamed else set())


def test_a_slow_hash_runs_beside_adamw_not_in_series(make_dirs, monkeypatch):
    """Each record's hash (40 ms of CPU) and each AdamW (40 ms asleep) longer: in serial mode (every gradient in hand, READs one ahead)
    the worker's AdamW calls follow one another, the hash of what was just updated running beside the next
    update, instead of N x (AdamW + hash). Checked by the spans' overlap, not by the pass's length (a loaded
    machine stretches every span): in series, no hash span overlaps an AdamW span."""
    dirs = make_dirs(1)
    trained_store(dirs, steps=1, mode="serial")
    hashes: list[tuple[float, float]] = []
    real_sums = offload.unit_sums

    def slow_sums(*args):  # 40 ms of CPU (what the cpu lane counts of hashing), not a sleep
        t0 = time.perf_counter()
        burn(0.04)
        out = real_sums(*args)
        hashes.append((t0, time.perf_counter()))
        return out

    monkeypatch.setattr(offload, "unit_sums", slow_sums)
    spans: list[tuple[float, float]] = []
    for name in ("adamw_block_", "adamw_chunk_", "adamw_upcast_", "adamw_unit_"):
        real = getattr(offload, name)

        def slow(*args, _real=real, **kw):
            t0 = time.perf_counter()
            time.sleep(0.04)
            out = _real(*args, **kw)
            spans.append((t0, time.perf_counter()))
            return out

        monkeypatch.setattr(offload, name, slow)
    with lohan.init(small_model(), ecfg(dirs, mode="serial"), resume=True) as engine:
        engine.step(batch(1))
        assert engine.offloader.hash_s >= 0.04 * len(hashes)
    n = len(spans)
    assert n == len(hashes) >= 4
    beside = [h for h in hashes if any(h[0] < a[1] and a[0] < h[1] for a in spans)]
    # each record's hash beside the next record's AdamW: all but the last (nothing follows it) can overlap one
    assert len(beside) >= (n - 1) // 2, (hashes, spans)


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("section", ["p32", "p16"])
def test_damaged_bytes_still_stop_the_step_before_the_update(make_dirs, monkeypatch, section, device):
    """As test_integrity's check, in serial mode (its READs are issued ahead, so their hashes run before the
    worker asks for them) and on a separate device (P16 staged for its copy): the mismatch raises the same error
    and nothing is committed."""
    monkeypatch.setenv("LOHAN_DEVICE", device)
    dirs = make_dirs(1)
    trained_store(dirs, mode="serial")
    p32, p16 = store_offsets(dirs, 1)
    flip(dirs, (p32 if section == "p32" else p16) + 64)
    with lohan.init(small_model(), ecfg(dirs, mode="serial"), resume=True) as engine:
        with pytest.raises((StoreCorruptError, RuntimeError)) as info:
            engine.step(batch(2))
        cause = info.value if isinstance(info.value, StoreCorruptError) else info.value.__cause__
        assert isinstance(cause, StoreCorruptError) and "block 1 " in str(cause)
        assert engine.step_count == 2
    store = StateStore.open(dirs, backend="threads")
    try:
        assert store.step == 2 and len(store.verify()) == 1
    finally:
        store.close()


def test_the_sums_committed_are_those_of_the_bytes_written_chunk_by_chunk(make_dirs):
    """Records in chunks, deferred passes with write-behind: each chunk's sums, hashed beside its WRITE, are
    committed in element order (write-behind could send a block's chunks out of order) and match what reached
    the SSDs (a clean verify)."""
    dirs = make_dirs(1)
    trained_store(dirs, steps=3, opt_chunk_bytes=4096 * 16, clip_mode="defer")
    store = StateStore.open(dirs, backend="threads")
    try:
        assert store.step == 3 and store.verify() == []
    finally:
        store.close()


def test_a_hash_job_waits_for_its_read_and_raises_its_error():
    class Failing:
        def __init__(self) -> None:
            self.gate = threading.Event()

        def done(self) -> bool:
            return self.gate.is_set()

        def wait(self) -> None:
            self.gate.wait()
            raise OSError("the read failed")

    hasher = Hasher("test-hash")
    try:
        io = Failing()
        ran: list[int] = []
        h = hasher.after_read(io, lambda: ran.append(1))
        time.sleep(0.05)
        assert not h.done() and not ran  # the job waits for the read
        io.gate.set()
        with pytest.raises(OSError, match="the read failed"):
            h.wait()
        assert not ran and h.done()
    finally:
        hasher.close()


def burn(seconds: float) -> None:
    """Hold a core for `seconds` of this thread's CPU time (torch ops: the GIL is released meanwhile)."""
    import torch

    x, c0 = torch.ones(1 << 14), time.thread_time()
    while time.thread_time() - c0 < seconds:
        x.mul_(1.0)


def test_hash_time_is_the_cpu_the_jobs_take_not_the_time_they_wait_for_a_core():
    """The cpu lane counts hashing as CPU seconds: a job off its core (here it sleeps; on a busy box, the emulated
    SSDs' copies take the cores) is not hashing meanwhile."""
    hasher = Hasher("test-hash")
    try:
        hasher.beside_write(None, lambda: time.sleep(0.2)).future.result()
        assert hasher.hash_s < 0.05
        hasher.beside_write(None, lambda: burn(0.1)).future.result()
        assert 0.1 <= hasher.hash_s < 0.2
    finally:
        hasher.close()
