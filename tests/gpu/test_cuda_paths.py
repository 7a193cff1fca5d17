"""CUDA paths below the engine: page-locked buffers, io_engine into them, side-stream copies.

DESIGN.md "Device abstraction": CUDA adds streams, events and pinned buffers on the same code paths the CPU
runs. These tests run where CUDA exists and skip elsewhere (`bash benchmarks/gpu_suite.sh` runs them);
what the CPU twin does is checked in test_cuda_cpu_side.py. The engine on CUDA: test_cuda_engine.py.
"""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from io_engine import ALIGN, BufferPool, aligned_empty, open_volume
from lohan.runtime.device import Device

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

MiB = 1 << 20
# GPU clock cycles torch.cuda._sleep spins: tens of milliseconds at 1-2 GHz, far longer than it takes the
# host to queue the work that must wait behind it
SLEEP_CYCLES = 100_000_000


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------------------------------------ pinned buffers
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 5 * MiB + 123])
def test_pinned_buffers_are_page_locked_aligned_and_exact(nbytes):
    t = aligned_empty(nbytes, pin=True)
    assert t.is_pinned()
    assert t.data_ptr() % ALIGN == 0 and t.numel() == nbytes and t.dtype == torch.uint8
    src = _random_bytes(nbytes, 1)
    t.copy_(src)
    assert torch.equal(t.to("cuda", non_blocking=True).cpu(), src)


def test_pinned_pool_counts_the_bytes_it_pins():
    """A pool's budget bounds the page-locked memory: torch's pinned allocator (which rounds each block up
    to a power of two and keeps freed blocks) must not be the one behind it."""
    size = 5 * MiB + 4096  # torch's caching host allocator would pin 8 MiB for each
    budget = 3 * size
    stats = torch.cuda.host_memory_stats
    torch.empty(1, pin_memory=True)  # torch's pinned allocator has counters from here on
    assert "allocated_bytes.current" in stats(), sorted(stats())
    before = stats()["allocated_bytes.current"]
    pool = BufferPool(budget, alloc=lambda n: aligned_empty(n, pin=True))
    bufs = [pool.acquire(size) for _ in range(3)]
    assert all(b.tensor.is_pinned() for b in bufs)
    grown = stats()["allocated_bytes.current"] - before
    assert grown <= budget, f"{grown} bytes pinned through torch's allocator for a {budget}-byte budget"
    for b in bufs:
        b.release()
    pool.clear()


def test_freed_pinned_buffers_leave_the_process():
    """pool.clear() gives page-locked memory back to the system (torch's pinned allocator would keep it)."""
    n = 256 * MiB
    pool = BufferPool(n, alloc=lambda k: aligned_empty(k, pin=True))
    buf = pool.acquire(n)
    buf.tensor.fill_(1)
    held = psutil.Process().memory_info().rss
    buf.release()
    pool.clear()
    del buf
    gc.collect()
    freed = held - psutil.Process().memory_info().rss
    assert freed > n * 3 // 4, f"only {freed / MiB:.0f} MiB of a {n / MiB:.0f} MiB pinned buffer was returned"


def test_volume_buffers_are_pinned_and_round_trip_bytes(make_dirs, backend):
    """With CUDA, a volume's pinned pools hand out page-locked buffers and io_engine reads and writes them
    byte-exactly: aligned requests go straight to the disk, odd ones through the (unpinned) staging pool, on
    both backends. The volume's own buffers are not page-locked: they never cross to the GPU."""
    with open_volume(make_dirs(2), 16 * MiB, chunk_bytes=MiB, backend=backend) as vol:
        assert not vol.backend.pin
        with vol.buffer_pool(MiB).acquire(4096) as plain:
            assert not plain.tensor.is_pinned()
        pool = vol.buffer_pool(8 * MiB, pin=True)
        for nbytes, offset in ((3 * MiB, 0), (MiB + 4096, 5 * MiB), (777_777, 9 * MiB + 13), (1, 15 * MiB + 1)):
            src, dst = pool.acquire(nbytes), pool.acquire(nbytes)
            assert src.tensor.is_pinned() and dst.tensor.is_pinned()
            want = _random_bytes(nbytes, nbytes)
            src.tensor.copy_(want)
            vol.write(src.tensor, offset).wait()
            vol.read_into(dst.tensor, offset).wait()
            assert torch.equal(dst.tensor, want), f"{nbytes} bytes at {offset} did not round-trip"
            src.release()
            dst.release()


def test_device_to_ssd_and_back_through_pinned_buffers(make_dirs, backend):
    """The engine's round trip of a tensor: device -> pinned host -> SSD -> pinned host -> device."""
    dev = Device("cuda")
    x = torch.randn(3, 1000, 77, device="cuda")
    nbytes = x.numel() * x.element_size()
    with open_volume(make_dirs(1), 4 * nbytes, backend=backend) as vol:
        pool = vol.buffer_pool(2 * nbytes + 2 * ALIGN)
        out, back = pool.acquire(nbytes), pool.acquire(nbytes)
        out.tensor.view(torch.float32).view(x.shape).copy_(x)
        vol.write(out.tensor, 4096).wait()
        vol.read_into(back.tensor, 4096).wait()
        t = dev.to_device(back.tensor.view(torch.float32).view(x.shape))
        dev.wait(t.event)
        y = t.tensor
        assert y.is_cuda and torch.equal(y, x)
        t.event.synchronize()  # before the host buffer goes back
        out.release()
        back.release()


# ------------------------------------------------------------------------------------------- streams
def test_device_copy_equals_a_synchronous_copy():
    dev = Device("cuda")
    assert dev.is_cuda and dev.upload_stream is not None and dev.download_stream is not None
    host = aligned_empty(12 * MiB, pin=True).view(torch.float32)
    host.copy_(torch.randn(host.numel()))
    for src in (host, host.view(1024, -1).t(), host[5:]):  # contiguous, transposed, offset views
        t = dev.to_device(src)
        dev.wait(t.event)
        got = t.tensor
        assert got.is_cuda and got.shape == src.shape
        assert torch.equal(got, src.to("cuda"))


def test_compute_waits_for_the_side_stream_copy():
    """to_device orders the copy before anything queued on the compute stream after it: held back behind
    a sleeping copy stream, the copy must still be complete when the compute stream reads its result."""
    dev = Device("cuda")
    host = aligned_empty(64 * MiB, pin=True)
    host.copy_(_random_bytes(64 * MiB, 7))
    ref = host.to("cuda")  # synchronous
    torch.cuda.synchronize()
    with torch.cuda.stream(dev.upload_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    t = dev.to_device(host)
    assert not t.event.query()  # the copy waits behind the sleep: the host did not wait for it
    dev.wait(t.event)
    same = torch.eq(t.tensor, ref).all()  # queued on the compute stream before the copy can have run
    assert bool(same.item())


def test_a_freed_device_copy_is_not_reused_under_pending_kernels():
    """A parameter copy freed by the host while the compute stream still has kernels reading it queued must
    not be handed to the next copy (Device.to_device records the compute stream on it)."""
    dev = Device("cuda")
    n = 4 << 20
    ones, twos = (aligned_empty(4 * n, pin=True).view(torch.float32) for _ in range(2))
    ones.fill_(1.0)
    twos.fill_(2.0)
    t = dev.to_device(ones)
    dev.wait(t.event)
    a = t.tensor
    del t
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy ...
    total = a.sum()                  # ... so this read of `a` is still queued when
    del a                            # the host drops `a` and copies the next block
    t = dev.to_device(twos)
    dev.wait(t.event)
    assert total.item() == float(n), "the next copy overwrote a tensor the compute stream had yet to read"
    assert torch.equal(t.tensor, twos.to("cuda"))


def test_device_to_host_copy_waits_for_compute_and_does_not_block_it():
    """to_host runs on the copy stream after the compute queued before it (held back behind a sleeping compute
    stream, the copy must still see the compute's result), and the host only waits at the event."""
    dev = Device("cuda")
    x = torch.zeros(1 << 20, device="cuda")
    out = aligned_empty(4 << 20, pin=True).view(torch.float32)
    torch.cuda._sleep(SLEEP_CYCLES)
    x.add_(3.0)  # queued behind the sleep
    ev = dev.to_host(x, out)
    assert not ev.query(), "to_host blocked the host until the compute stream was done"
    ev.synchronize()
    assert bool((out == 3.0).all())


def test_compute_timer_measures_device_time():
    dev = Device("cuda")
    timer = dev.timer()
    with timer:
        torch.cuda._sleep(SLEEP_CYCLES)
    assert timer.seconds() > 1e-3  # the host only queued the sleep: its own clock would say ~0


def test_autocast_and_memory_counters_on_cuda():
    dev = Device("cuda")
    x = torch.randn(64, 64, device="cuda")
    with dev.autocast(torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    with dev.autocast(torch.float32):
        assert (x @ x).dtype == torch.float32
    assert dev.memory_allocated() >= x.numel() * 4
    dev.synchronize()


def test_copy_bandwidth_and_hardware_name_on_cuda():
    from lohan.runtime.profiler import hardware_name, measure_copy_bandwidth

    dev = Device("cuda")
    bw = measure_copy_bandwidth(dev, 64 * MiB)
    assert bw > 1e9, f"host<->device copies measured at {bw / 1e9:.3g} GB/s"
    assert hardware_name(dev, 2) == torch.cuda.get_device_name().replace(" ", "_") + "+2ssd"
