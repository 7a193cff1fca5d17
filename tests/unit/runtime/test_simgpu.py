"""The simulated device's timing model (``--sim-gpu``; lohan/runtime/simgpu.py, lohan/runtime/simdevice.py): a GPU
box's lanes on a CPU box. Compute is held for its modeled FLOPs time without holding a core, copies take their
modeled time on an upload and a download engine that run side by side, and the results stay bit-exact."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import lohan
from lohan.config import EngineConfig
from lohan.plan.planner import HARDWARE_PRESETS
from lohan.runtime.device import Device
from lohan.runtime.simdevice import StreamOrderError
from lohan.runtime.simgpu import SimGpu, parse_sim_gpu
from tests.integration import test_engine_equivalence as eq

SLOW = SimGpu("slow", flops=1e9, h2d=1e8, d2h=1e8, mem_bw=1e12)  # 1 GFLOP/s, 100 MB/s each way


@pytest.fixture
def dev():
    d = Device("sim", sim_gpu=SLOW)
    yield d
    d.close()


# ------------------------------------------------------------------------------------------------ parsing
def test_a_preset_gives_its_datasheet_rates():
    for name in ("rtx4090", "rtx4080", "rtx3090", "a100-80g", "h100", "h200"):
        spec, gpu = parse_sim_gpu(name), HARDWARE_PRESETS[name]
        assert (spec.name, spec.flops, spec.h2d, spec.d2h, spec.mem_bw) == (
            name, gpu.flops, gpu.link_bw, gpu.link_bw, gpu.mem_bw)
    assert parse_sim_gpu("rtx4090").describe() == "rtx4090: 165 TFLOPS, PCIe 25/25 GB/s, HBM 1008 GB/s"


def test_key_value_rates_with_units_override_a_base():
    spec = parse_sim_gpu("tflops=150,h2d=25GB/s,d2h=12.5,hbm=1000GB/s")
    assert (spec.flops, spec.h2d, spec.d2h, spec.mem_bw) == (150e12, 25e9, 12.5e9, 1000e9)
    spec = parse_sim_gpu("h100, tflops=40, d2h=500MB/s")
    assert (spec.flops, spec.h2d, spec.d2h, spec.mem_bw) == (40e12, 50e9, 5e8, 3.35e12)
    assert spec.name == "h100,tflops=40,d2h=500MB/s"
    assert parse_sim_gpu("tflops=500GFLOPS,h2d=2GiB/s").h2d == 2 * 2**30
    assert parse_sim_gpu("hbm=2TB/s").flops == HARDWARE_PRESETS["rtx4090"].flops  # missing keys: the rtx4090's


@pytest.mark.parametrize("spec, says", [
    ("rtx9999", r"'rtx9999' is not a known GPU: give a GPU \(rtx4090, .*h200\) and/or key=value pairs \(tflops, "
                r"h2d, d2h, hbm"),
    ("rtx4090,h100", "names two GPUs"),
    ("flops=3", r"unknown key 'flops'.*tflops, h2d, d2h, hbm"),
    ("tflops=fast", r"tflops='fast': give a positive number \(TFLOPS\) or one with a unit \(TFLOPS, GFLOPS\)"),
    ("h2d=-1GB/s", r"h2d='-1GB/s': give a positive number \(GB/s\)"),
    ("h2d=3 apples", "h2d='3 apples'"),
    ("", "empty"),
    ("rtx4090,,tflops=1", "empty part"),
])
def test_bad_specs_name_the_bad_part_and_what_is_accepted(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_sim_gpu(spec)


def test_the_config_the_device_and_the_environment_refuse_a_timing_model_off_the_simulated_device(monkeypatch):
    with pytest.raises(ValueError, match="sim_gpu='rtx4090' models a GPU's timing .* needs device sim, not cpu"):
        EngineConfig(device="cpu", sim_gpu="rtx4090")
    with pytest.raises(ValueError, match="sim_gpu=5: name a GPU"):
        EngineConfig(device="sim", sim_gpu=5)
    with pytest.raises(ValueError, match="the device is cpu"):
        Device("cpu", sim_gpu="rtx4090")
    with pytest.raises(ValueError, match="is not a known GPU"):
        Device("sim", sim_gpu="rtx9999")
    monkeypatch.setenv("LOHAN_SIM_GPU", "h100")
    assert Device("cpu").timing is None  # the environment's model is the simulated device's only
    d = Device("sim")
    try:
        assert d.timing == parse_sim_gpu("h100") and d.describe().startswith("sim (modeling h100: 989 TFLOPS")
    finally:
        d.close()
    monkeypatch.setenv("LOHAN_SIM_GPU", "nope")
    with pytest.raises(ValueError, match="LOHAN_SIM_GPU: sim_gpu 'nope' is not a known GPU"):
        Device("sim")


def test_the_cli_refuses_a_bad_spec_in_one_line(tmp_path, capsys):
    from lohan.app.cli import main

    base = ["--nvme", str(tmp_path / "nvme"), "--steps", "1"]
    assert main([*base, "--device", "sim", "--sim-gpu", "rtx9999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: sim_gpu 'rtx9999' is not a known GPU") and err.count("\n") == 1
    assert main([*base, "--device", "cpu", "--sim-gpu", "rtx4090"]) == 2
    assert "needs device sim, not cpu (--device sim)" in capsys.readouterr().err
    assert main([*base, "--sim-gpu", "rtx4090"]) == 2  # device auto, which is the CPU here (conftest.py)
    assert "but the device is cpu: add --device sim" in capsys.readouterr().err
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir())


# ------------------------------------------------------------------------------------------------ time
def test_compute_takes_its_modeled_time_asleep_not_spinning(dev):
    """A 160 MFLOP matmul at 1 GFLOP/s keeps the compute stream 0.16 s: the host wall clock says so, the
    calling thread's CPU clock does not (a sleep, the GIL released), and a thread beside it counts at the pace
    it counts beside a plain sleep."""
    a = dev.put(torch.randn(200, 2000))
    b = dev.put(torch.randn(2000, 200))
    modeled = 2 * 200 * 2000 * 200 / SLOW.flops

    def counted(work) -> tuple[float, float, int]:
        stop, n = threading.Event(), [0]

        def count():
            while not stop.is_set():
                n[0] += 1

        t = threading.Thread(target=count)
        t.start()
        wall, cpu = time.perf_counter(), time.thread_time()
        work()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        stop.set()
        t.join()
        return wall, cpu, n[0]

    dev.fetch((a[:2, :2] @ b[:2, :2]).sum())  # the first dispatch of an op is slow (torch's caches warm up)
    before = dev.lane_busy()["gpu"]
    wall, cpu, beside = counted(lambda: dev.fetch((a @ b).sum()))
    assert wall >= modeled and cpu < modeled / 2, (wall, cpu)
    assert 0.999 * modeled <= dev.lane_busy()["gpu"] - before < modeled + 0.1
    _, _, idle = counted(lambda: time.sleep(wall))
    assert beside > idle / 3, (beside, idle)  # a spinning compute thread would take the GIL from the counter


def test_attention_on_the_cpu_kernel_is_priced_by_its_flops():
    """torch's FLOP table has only the GPU attention kernels: the CPU's (which the simulated device runs) is priced
    as lohan's profiler counts attention, forward Q·K^T and P·V, backward twice that."""
    d = Device("sim", sim_gpu=SimGpu("slow", flops=1e8, h2d=1e9, d2h=1e9, mem_bw=1e15))
    try:
        q = d.put(torch.randn(2, 4, 128, 32)).requires_grad_()
        fwd = 4 * 2 * 4 * 128 * 128 * 32 / 1e8  # 0.084 s
        with d.autocast(None):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            busy = d.lane_busy()["gpu"]
            assert 0.999 * fwd <= busy < fwd + 0.05, busy
            out.sum().backward()
        assert 0.999 * 3 * fwd <= d.lane_busy()["gpu"] < 3 * fwd + 0.1
    finally:
        d.close()


def test_a_copy_takes_its_bytes_over_the_link_and_busy_adds_up(dev):
    host = torch.zeros(2_000_000)  # 8 MB: 0.08 s at 100 MB/s
    t0 = time.perf_counter()
    t = dev.to_device(host)
    t.event.synchronize()
    up = time.perf_counter() - t0
    dev.wait(t.event)
    ev = dev.to_host(t.tensor, out := torch.empty_like(host))
    ev.synchronize()
    busy = dev.lane_busy()
    assert 0.08 <= up < 0.5 and 0.08 <= busy["m2g"] <= up
    assert 0.08 <= busy["g2m"] < 0.5 and torch.equal(out, host)


def test_a_copy_lane_counts_the_modeled_link_not_the_emulators_memcpy():
    """On a fast modeled link the CPU's own memcpy outlasts the modeled time: the copy waits for it, but the lane
    counts the link's seconds, as the gpu lane counts the modeled compute (lane_bench's g2m lane measured 0.3 s of
    memcpy on busy cores against the 0.015 s its 25 GB/s link takes)."""
    d = Device("sim", sim_gpu=SimGpu("fast", flops=1e15, h2d=1e12, d2h=1e12, mem_bw=1e13))
    try:
        host = torch.ones(16_000_000)  # 64 MB: 64 us on the link, milliseconds of memcpy here
        t = d.to_device(host)
        t.event.synchronize()
        d.wait(t.event)
        d.to_host(t.tensor, torch.empty_like(host)).synchronize()
        busy = d.lane_busy()
        assert busy["m2g"] == pytest.approx(64e-6, rel=0.01) and busy["g2m"] == pytest.approx(64e-6, rel=0.01)
    finally:
        d.close()


def test_an_upload_does_not_queue_behind_a_download(dev):
    """Two copy engines: an upload issued after a long download completes first (one copy stream ran them in
    order, so a block's parameters waited behind the activations or gradients leaving the device)."""
    x = dev.put(torch.randn(5_000_000))  # 20 MB: 0.2 s to the host
    down = dev.to_host(x * 1, torch.empty(5_000_000))
    up = dev.to_device(torch.ones(1000))
    up.event.synchronize()
    assert not down.query(), "the upload waited for the download queued before it"
    down.synchronize()


def test_a_download_starts_after_the_modeled_compute_that_produced_it(dev):
    a = dev.put(torch.randn(200, 2000))
    b = dev.put(torch.randn(2000, 200))
    t0 = time.perf_counter()
    ev = dev.to_host(a @ b, torch.empty(200, 200))  # 0.16 s of compute, then 160 KB at 100 MB/s
    ev.synchronize()
    assert time.perf_counter() - t0 >= 0.16 + 0.0016


def test_the_host_runs_ahead_of_the_modeled_compute_so_an_upload_runs_beside_it(dev):
    """As on a GPU, the host queues compute and goes on: the next block's upload, issued right after this block's
    compute, runs beside it (0.4 s of compute and a 0.3 s upload take ~0.4 s, not 0.7), and the compute timer
    reads the modeled stream's clock, not the host's."""
    a = dev.put(torch.randn(200, 5000))
    b = dev.put(torch.randn(5000, 200))
    host = torch.zeros(7_500_000)  # 30 MB: 0.3 s at 100 MB/s
    dev.fetch((a[:2, :2] @ b[:2, :2]).sum())  # warm up the op's first dispatch
    timer = dev.timer()
    t0 = time.perf_counter()
    with timer:
        c = a @ b  # 400 MFLOP: 0.4 s at 1 GFLOP/s
    nxt = dev.to_device(host)
    dev.wait(nxt.event)
    dev.fetch(c.sum() + nxt.tensor[0])
    wall = time.perf_counter() - t0
    assert 0.4 <= wall < 0.6, wall
    assert 0.4 <= timer.seconds() < 0.5
    nxt.event.synchronize()  # the host saw the copy complete: `host` may be freed


def test_the_engines_order_is_checked_both_ways():
    """An upload of a host buffer a download still writes must wait for the download's event, and a download
    into a host buffer an upload still reads must wait for the upload's (the two engines run side by side)."""
    d = Device("sim")  # without a timing model: the checks are the same
    try:
        x = d.put(torch.arange(6.0))
        host = torch.empty(6)
        down = d.to_host(x, host)
        with pytest.raises(StreamOrderError, match="upload stream reads a host buffer that a copy on the download"):
            d.to_device(host)
        up = d.to_device(host, after=down)
        d.wait(up.event)
        assert torch.equal(d.fetch(up.tensor), torch.arange(6.0))
        other = torch.ones(6)
        pending = d.to_device(other)
        with pytest.raises(StreamOrderError, match="download stream writes a host buffer that a copy on the upload"):
            d.to_host(x, other)
        pending.event.synchronize()
        d.to_host(x, other).synchronize()
        assert torch.equal(other, torch.arange(6.0))
    finally:
        d.close()


def test_a_timed_device_checks_released_buffers_but_does_not_poison_them(dev):
    """A memset of every pool buffer given back is host time a GPU box's host does not spend (the optimizer's
    records, a step's worth of them, on its own thread): a timed device leaves the bytes, still refuses a buffer
    given back while a copy uses it; once an untimed device is open too, releases are poisoned again."""
    from io_engine import BufferPool

    pool = BufferPool(1 << 16)
    buf = pool.acquire(4096)
    buf.tensor.view(torch.float32).fill_(1.0)
    up = dev.to_device(buf.tensor.view(torch.float32))
    dev.wait(up.event)
    with pytest.raises(StreamOrderError, match="given back"):
        buf.release()
    up.event.synchronize()
    buf.release()
    assert torch.equal(buf._full.view(torch.float32), torch.ones(1024))
    untimed = Device("sim")
    try:
        again = pool.acquire(4096)
        again.release()
        assert torch.isnan(again._full.view(torch.float32)).all()
    finally:
        untimed.close()
    last = pool.acquire(4096)
    last.tensor.view(torch.float32).fill_(2.0)
    last.release()
    assert torch.equal(last._full.view(torch.float32), torch.full((1024,), 2.0))


# ------------------------------------------------------------------------------------------------ the engine
def test_an_engine_on_a_modeled_gpu_is_bit_exact_and_reports_its_lanes(make_dirs):
    """The simulated device at a modeled pace (slow enough that every lane sleeps) changes no bit: losses and
    parameters equal plain PyTorch's; the device's lanes were busy for at least their modeled time."""
    mcfg = eq.tiny_cfg()
    ecfg = eq.engine_config(make_dirs(1), mode="optimized", device="sim", sim_gpu="tflops=0.002,h2d=0.2,d2h=0.2")
    data = list(eq.batches(3, 4, 32, 256))
    ref_losses, ref_params = eq.reference_run(mcfg, ecfg, data)
    with lohan.init(mcfg, ecfg) as engine:
        assert engine.device.timing.flops == 0.002e12
        losses = [engine.step(b) for b in data]
        params = engine.state_dict_fp32()
        busy = engine.device.lane_busy()
        hw = engine.activations.profile.hardware
    assert losses == ref_losses
    eq.assert_params_equal(params, ref_params)
    assert busy["gpu"] > 0 and busy["m2g"] > 0 and busy["g2m"] > 0, busy
    # the profile the planner prices the run with is the modeled GPU's (compute never faster than modeled: the
    # profiler waits for the modeled stream, which the host runs ahead of)
    assert hw.bw_g == 0.2e9 and hw.thp_g <= 0.002e12 * 1.05, (hw.bw_g, hw.thp_g)


def test_the_header_names_the_modeled_gpu(tmp_path, capsys):
    from lohan.app.cli import main

    assert main(["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--steps", "1",
                 "--set", "model_overrides.n_layer=1", "--batch-size", "2", "--seq-len", "32", "--backend", "threads",
                 "--device", "sim", "--sim-gpu", "rtx4090"]) == 0
    assert "device sim (modeling rtx4090: 165 TFLOPS, PCIe 25/25 GB/s, HBM 1008 GB/s)" in capsys.readouterr().out


def test_the_engine_prices_the_optimizer_at_the_rate_its_steps_measure(make_dirs):
    """The hardware measured at the plan has no CPU rate; priced at nothing, the update hid under any lane and the
    schedule (clipping off, a next batch known) deferred every update beside the next forward, even where updating
    during backward (active gradient offloading) was the faster way. On a modeled GPU the engine prices the CPU
    lane at the rate its own steps measure, and the step's estimate carries it."""
    mcfg = eq.tiny_cfg()
    ecfg = eq.engine_config(make_dirs(1), mode="optimized", device="sim", sim_gpu="tflops=1,h2d=25,d2h=25",
                            max_grad_norm=0.0)
    data = list(eq.batches(4, 4, 32, 256))
    with lohan.init(mcfg, ecfg) as engine:
        for k in range(3):
            engine.step(data[k], next_batch=data[k + 1])
        lane = engine.last_stats.lanes["cpu"]
        hw = engine.activations.profile.hardware
        est = engine.activations.plan.estimate
    assert hw.cpu_adam_params_per_s > 0
    # priced at the median of the measured steps after the first: within a factor of this step's own lane
    assert 0.3 * lane < est.lanes_b["cpu"] < 3 * lane, (est.lanes_b["cpu"], lane)


def test_on_a_cpu_device_the_optimizer_stays_unpriced(make_dirs):
    """On the CPU the compute and the update share the cores: the model's lanes are not independent there, and
    the measured step times decide the schedule (`ClipSchedule`), so the CPU rate is not refined."""
    mcfg = eq.tiny_cfg()
    ecfg = eq.engine_config(make_dirs(1), mode="optimized", max_grad_norm=0.0)
    data = list(eq.batches(3, 4, 32, 256))
    with lohan.init(mcfg, ecfg) as engine:
        for k in range(2):
            engine.step(data[k], next_batch=data[k + 1])
        assert engine.activations.profile.hardware.cpu_adam_params_per_s == 0


# ------------------------------------------------------------------------------------------------ compute=modeled
def test_compute_modeled_is_parsed_named_and_refused_when_misspelt():
    assert parse_sim_gpu("rtx4090").arithmetic and parse_sim_gpu("rtx4090,compute=real").arithmetic
    spec = parse_sim_gpu("rtx4090,compute=modeled")
    assert not spec.arithmetic and spec.flops == HARDWARE_PRESETS["rtx4090"].flops
    assert spec.describe().endswith("arithmetic skipped (compute=modeled): losses are not real")
    with pytest.raises(ValueError, match="compute is real or modeled"):
        parse_sim_gpu("rtx4090,compute=fake")


def test_compute_modeled_takes_the_modeled_time_without_the_arithmetic():
    """The op's shape and modeled time, zeros for its result; in-place ops and copies move no bytes; a pool buffer
    downloaded into holds zeros, not its old bytes (never NaN poison, which would read as a non-finite step)."""
    d = Device("sim", sim_gpu=SimGpu("slow", flops=1e9, h2d=1e8, d2h=1e8, mem_bw=1e12, arithmetic=False))
    try:
        a = d.put(torch.ones(200, 2000))
        b = d.put(torch.ones(2000, 200))
        before = d.lane_busy()["gpu"]
        c = a @ b
        assert tuple(c.shape) == (200, 200) and float(d.fetch(c.abs().sum())) == 0.0
        assert d.lane_busy()["gpu"] - before >= 2 * 200 * 2000 * 200 / 1e9
        c.add_(1.0)  # skipped: still zeros
        assert float(d.fetch(c.sum())) == 0.0
        host = torch.full((200, 200), float("nan"))
        up = d.to_device(torch.full((200, 200), 7.0))
        d.wait(up.event)
        assert float(d.fetch(up.tensor.sum())) == 0.0  # the upload moved no bytes
        ev = d.to_host(c, host)
        ev.synchronize()
        assert torch.equal(host, torch.zeros(200, 200))
    finally:
        d.close()


def test_an_engine_with_compute_modeled_steps_finite_and_updates_every_step(make_dirs):
    """Zeros through the model: each step is finite (no step skipped), the optimizer updates, the lanes are busy."""
    mcfg = eq.tiny_cfg()
    ecfg = eq.engine_config(make_dirs(1), mode="optimized", device="sim",
                            sim_gpu="tflops=0.02,h2d=2,d2h=2,compute=modeled")
    data = list(eq.batches(3, 4, 32, 256))
    losses, skipped, meta_calls = [], [], []
    with lohan.init(mcfg, ecfg) as engine:
        for b in data:
            losses.append(engine.step(b))
            skipped.append(engine.last_stats.skipped)
            meta_calls.append(engine.device.sim.modeled.meta_calls)
        busy = engine.device.lane_busy()
    assert not any(skipped) and all(torch.isfinite(torch.tensor(x)) for x in losses), (losses, skipped)
    # the result shapes come from the meta kernels once per op signature, then from the cache
    assert meta_calls[0] > 0 and meta_calls[2] == meta_calls[1], meta_calls
    assert busy["gpu"] > 0 and busy["m2g"] > 0 and busy["g2m"] > 0, busy


def test_a_timed_devices_copies_start_after_a_gpus_launch_latency(monkeypatch):
    """The untimed device delays each copy 2 ms (a host that reads its buffer early finds it unwritten); a timed
    one models a GPU, whose copy starts ~10 us after its launch; LOHAN_SIM_LATENCY overrides either."""
    from lohan.runtime.simdevice import LATENCY_ENV, TIMED_LATENCY, UNTIMED_LATENCY

    monkeypatch.delenv(LATENCY_ENV, raising=False)
    for spec, want in ((None, UNTIMED_LATENCY), (SLOW, TIMED_LATENCY), (SLOW, 0.005)):
        if want == 0.005:
            monkeypatch.setenv(LATENCY_ENV, "0.005")
        d = Device("sim", sim_gpu=spec)
        try:
            assert d.sim.latency == want
        finally:
            d.close()
    assert TIMED_LATENCY <= 1e-4 < UNTIMED_LATENCY
