"""The CPU twin of every CUDA path (DESIGN.md "Device abstraction"): the CPU stands in for the GPU, streams
are absent, copies are the tensors themselves, nothing is pinned. Runs everywhere; the tests that need the
machine to have no CUDA at all skip on one that has it (test_cuda_paths.py covers that side).
"""

from __future__ import annotations

import contextlib

import psutil
import pytest
import torch

import lohan
from io_engine import ALIGN, aligned_empty, open_volume
from lohan.runtime.device import Device
from tests.integration.test_engine_equivalence import batches, engine_config, tiny_cfg

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a machine without CUDA")


def test_cpu_device_is_a_zero_copy_twin():
    dev = Device("cpu")
    assert not dev.is_cuda and dev.type == "cpu" and dev.upload_stream is None and dev.download_stream is None
    host = torch.randn(3, 5)
    transfer = dev.to_device(host)
    assert transfer.tensor is host and transfer.event.query()  # the "device copy" of a host buffer is the buffer
    out = torch.empty(3, 5)
    assert dev.to_host(host, out).query() and torch.equal(out, host)  # written at once
    assert dev.to_host(out, out).query()  # the same memory: nothing to copy
    assert dev.put(host) is host and dev.fetch(host) is host and dev.is_host
    assert dev.memory_allocated() is None and dev.max_memory_allocated() is None
    dev.synchronize()  # a no-op, not an error
    for dtype in (None, torch.float32):
        assert isinstance(dev.autocast(dtype), contextlib.nullcontext)
    x = torch.randn(8, 8)
    with dev.autocast(torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    assert repr(dev) == "Device(cpu)"


@no_cuda
def test_auto_is_cpu_and_cuda_is_refused_without_cuda():
    assert Device("auto").type == "cpu"
    with pytest.raises(ValueError, match="torch sees no CUDA device .*; use --device cpu or auto"):
        Device("cuda")


@no_cuda
def test_nothing_is_pinned_without_cuda(make_dirs):
    t = aligned_empty(10_000)
    assert not t.is_pinned() and t.data_ptr() % ALIGN == 0
    with pytest.raises(RuntimeError, match="pin"):  # torch's own message: no pinned allocator here
        aligned_empty(4096, pin=True)
    for backend in ("threads", "auto"):
        with open_volume(make_dirs(1, backend), 1 << 20, backend=backend, name=backend) as vol:
            assert vol.backend.pin is False
            with vol.buffer_pool(1 << 16).acquire(5000) as buf:
                assert not buf.tensor.is_pinned()


@no_cuda
def test_cpu_activation_tier_is_not_pinned(make_dirs):
    """The activation manager page-locks its CPU tier only for a CUDA device; on CPU its buffers are plain."""
    ecfg = engine_config(make_dirs(1), act_policy="swap-all", act_mem="64MiB", device="cpu")
    with lohan.init(tiny_cfg(n_layer=3), ecfg) as engine:
        engine.step(next(batches(1, 4, 32, 256)))
        assert engine.activations.plan.block_tiers == ("cpu", "cpu", "keep")
        assert engine.last_stats.gpu_mem_gib is None
        with engine.activations.store.cpu_pool.acquire(4096) as buf:
            assert not buf.tensor.is_pinned()


def test_detect_hardware_on_cpu_takes_main_memory_for_device_memory(tmp_path):
    from lohan.app.fit import detect_hardware

    m = detect_hardware((str(tmp_path),), device="cpu", compute_dtype="fp32")
    assert m.device_is_host
    assert m.hardware.gpu_mem == psutil.virtual_memory().total
    given = detect_hardware((str(tmp_path),), device="cpu", compute_dtype="fp32", gpu_mem=3 << 30)
    assert given.hardware.gpu_mem == 3 << 30


class _FakeCudart:
    """Stands in for torch.cuda.cudart(): records cudaHostRegister / cudaHostUnregister calls."""

    class cudaError:  # noqa: N801 - the name torch's binding uses
        success = 0

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", size))
        if self.fail:
            return 1
        assert ptr not in self.registered and ptr % ALIGN == 0
        assert flags == 1, "registered for the current device's context only (cudaHostRegisterPortable is 1)"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", self.registered.pop(ptr)))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine where CUDA pins memory through `_FakeCudart` (and torch reports such memory as pinned)."""
    import io_engine.buffers as buffers

    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.untyped_storage().data_ptr() in rt.registered
                        or any(p <= self.data_ptr() < p + n for p, n in rt.registered.items()))
    monkeypatch.setattr(buffers, "_register_fallback", [])
    return rt


def test_pinned_buffers_are_registered_exactly_and_unregistered_with_their_last_view(fake_cuda):
    """With CUDA, pinned pool buffers are pages registered with cudaHostRegister at their exact size (torch's
    pinned allocator would round up to a power of two and keep freed blocks), unregistered when the last
    tensor over them goes."""
    from io_engine import BufferPool

    pool = BufferPool(3 * (5 << 20), alloc=lambda n: aligned_empty(n, pin=True))
    buf = pool.acquire((5 << 20) - 100)
    assert buf.tensor.is_pinned() and buf.tensor.data_ptr() % ALIGN == 0 and buf.nbytes == (5 << 20) - 100
    assert fake_cuda.calls == [("register", 5 << 20)]
    buf.tensor.fill_(3)
    view = buf.tensor[4096:]
    buf.release()
    pool.clear()
    del buf
    assert fake_cuda.calls == [("register", 5 << 20)]  # a view still uses the pages
    assert int(view.sum()) == 3 * ((5 << 20) - 100 - 4096)
    del view
    assert fake_cuda.calls == [("register", 5 << 20), ("unregister", 5 << 20)] and not fake_cuda.registered


def test_pinned_buffers_fall_back_to_torch_when_registering_fails(fake_cuda, monkeypatch):
    fake_cuda.fail = True
    seen = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kw):
        seen.append(pin_memory)
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    for _ in range(2):
        t = aligned_empty(10_000, pin=True)
        assert t.numel() == 10_000 and t.data_ptr() % ALIGN == 0
    assert fake_cuda.calls == [("register", 10_000)]  # tried once; then torch's pinned allocator
    assert seen == [True, True]


def test_only_pools_that_cross_to_a_gpu_are_page_locked_and_only_on_cuda_runs(fake_cuda, make_dirs):
    """A machine with CUDA: a volume's own buffers are not page-locked (they never leave main memory), a pool asked
    for with pin=True is; and a run on the CPU device (--device cpu) page-locks nothing at all."""
    with open_volume(make_dirs(1, "vol"), 1 << 20, backend="threads") as vol:
        assert vol.backend.pin is False
        with vol.buffer_pool(1 << 16).acquire(5000) as buf:
            assert not buf.tensor.is_pinned()
        assert fake_cuda.calls == []
        with vol.buffer_pool(1 << 16, pin=True).acquire(5000) as buf:
            assert buf.tensor.is_pinned()
        assert fake_cuda.calls == [("register", 8192)]
    fake_cuda.calls.clear()
    ecfg = engine_config(make_dirs(1, "run"), act_policy="swap-all", act_mem="64MiB", device="cpu")
    with lohan.init(tiny_cfg(n_layer=3), ecfg) as engine:
        engine.step(next(batches(1, 4, 32, 256)))
        assert engine.activations.plan.block_tiers == ("cpu", "cpu", "keep")
    assert fake_cuda.calls == [], "a CPU run page-locked memory through CUDA"


def test_the_optimizer_thread_takes_the_engines_device(make_dirs, monkeypatch):
    """Finding 5: a worker thread starts on GPU 0; the optimizer's thread binds the engine's device first, so
    what it allocates or page-locks belongs to the rank's GPU (a no-op on the CPU device, recorded here)."""
    import threading

    bound = []
    monkeypatch.setattr(Device, "bind_thread",
                        lambda self, *threads: bound.append((self.type, threading.current_thread().name)))
    with lohan.init(tiny_cfg(), engine_config(make_dirs(1), device="cpu")) as engine:
        engine.step(next(batches(1, 4, 32, 256)))
    assert bound and all(kind == "cpu" and name.startswith("lohan-ago") for kind, name in bound), bound
