"""Hardware-aware profiling (DESIGN.md §4.5): what each op costs to recompute and to swap, and what
the machine can move.

Measured at the first step on the real model and data shapes (or loaded with ``profile_from``):
- per op of one transformer block: forward FLOPs (`FlopCounterMode`) and the bytes of its outputs
  (what swapping it stores: exactly what the activation runtime packs, 64-byte aligned per tensor), as they
  are and int8-compressed (`act_quant.stored_nbytes`, for ``act_compress: int8``);
- `THP_G` from the block's measured forward time, `BW_G` from host<->device copies (on a CPU-only
  box: a copy into an activation buffer, which is what "moving to the CPU tier" costs there),
  `BW_S2M` / `BW_M2S` from reads and writes through io_engine on the run's own SSD directories
  (aggregate over all of them), and `MEM_avail` given by the engine (free memory minus its pools);
- with int8 records, the rate at which the device quantizes activations (`measure_quant_rate`).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from io_engine import durable, open_volume
from io_engine.base import align_up
from lohan.plan.planner import Hardware, OpProfile, Profile, ProfileError
from lohan.runtime.act_quant import dequantize_rows, quantize_rows, stored_nbytes
from lohan.runtime.activation_store import TENSOR_ALIGN, OpTracker, SelectiveMode, block_ops
from lohan.runtime.device import Device
from lohan.store.files import remove_volume


def _sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of attention: Q·K^T and P·V, 2 FLOPs per multiply-add each (no causal discount), over the
    query heads: with grouped-query attention the keys and values have fewer heads, each shared by several."""
    b, h, t, d = q_shape
    s, dv = k_shape[-2], v_shape[-1]
    return 2 * b * h * t * s * d + 2 * b * h * t * s * dv


# Every fused attention kernel is counted here, the same way on every device and torch version: torch's table
# does not cover the CPU flash kernel, and before 2.13 it refuses grouped-query shapes (an AssertionError
# from `sdpa_flop_count` at the first step of an HF model with fewer key/value heads, seen on CUDA).
_EXTRA_FLOPS = {op: _sdpa_flops for op in (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
)}


def _timed(fn: Callable[[], object], device: Device, repeats: int, warmup: int = 1) -> float:
    """Best-of-`repeats` wall time of fn (after `warmup` discarded calls: first-touch allocations)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        device.synchronize()  # a GPU's (or the simulated device's modeled) stream runs behind the host
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_block(run: Callable[[Tensor], Tensor], block: torch.nn.Module, x: Tensor, tracker: OpTracker,
                  device: Device, autocast: Callable[[], object], repeats: int = 4
                  ) -> tuple[list[OpProfile], tuple[int, int], float, float]:
    """Per-op (FLOPs, output bytes, int8 output bytes) of one block on input x, its input bytes (as they are,
    int8), total FLOPs, and the seconds one forward's worth of FLOPs takes: a third of a measured forward +
    backward, so `THP_G = FLOPs / seconds` is the rate the cost model's compute lanes (forward 1x, backward 2x)
    actually run at."""
    names = block_ops(block)
    with torch.no_grad(), autocast(), FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as fc:
        run(x)
    counts = fc.get_flop_counts()
    flops = {}
    for name in names:
        key = next((k for k in counts if k.split(".")[-1] == name and k.count(".") == 1), None)
        flops[name] = float(sum(counts[key].values())) if key else 0.0
    mode = SelectiveMode(tracker, frozenset(names))
    with torch.no_grad(), autocast(), mode:
        run(x)
    nbytes, int8 = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for rec in mode.records:
        for t in rec.leaves:
            if device.holds(t):  # what a record packs (host outputs such as an RNG seed stay as they are)
                nbytes[rec.op] += align_up(t.numel() * t.element_size(), TENSOR_ALIGN)
                int8[rec.op] += stored_nbytes(t, TENSOR_ALIGN)

    params = [p for p in block.parameters() if p.requires_grad]

    def fwd_bwd() -> None:  # the work of a step: forward, then backward (twice the forward's FLOPs)
        z = x.detach().requires_grad_()
        with torch.enable_grad(), autocast():
            out = run(z)
        torch.autograd.grad(out, [z, *params], grad_outputs=torch.ones_like(out))  # leaves .grad untouched

    seconds = _timed(fwd_bwd, device, repeats, warmup=2) / 3
    ops = [OpProfile(name, flops[name], nbytes[name], int8[name]) for name in names]
    input_bytes = (align_up(x.numel() * x.element_size(), TENSOR_ALIGN), stored_nbytes(x, TENSOR_ALIGN))
    return ops, input_bytes, sum(flops.values()), seconds


def measure_quant_rate(device: Device, dtype: torch.dtype, numel: int = 1 << 22) -> tuple[float, float]:
    """Bytes/s of activations (in `dtype`, as the device holds them) that int8 quantization, and dequantization, of
    a record process on the device: `act_quant` on rows of 4096 values, ``numel`` of them (16 MiB in fp32, larger
    than a cache, as a block's outputs are)."""
    x = device.put(torch.randn(max(1, numel // 4096), 4096).to(dtype))
    q, scale = quantize_rows(x)
    nbytes = x.numel() * x.element_size()
    return (nbytes / _timed(lambda: quantize_rows(x), device, 3),
            nbytes / _timed(lambda: dequantize_rows(q, scale, dtype), device, 3))


def measure_copy_bandwidth(device: Device, nbytes: int = 64 << 20) -> float:
    """Bytes/s of moving activations between device and main memory (the slower direction)."""
    if device.timing is not None:  # the simulated device's modeled link (its copy engines run at these rates)
        return min(device.timing.h2d, device.timing.d2h)
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    if not device.is_cuda:
        dst = torch.empty_like(host)
        return nbytes / _timed(lambda: dst.copy_(host), device, 3)
    host = host.pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device.torch)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device, 3)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device, 3)
    return nbytes / max(h2d, d2h)


def measure_ssd_bandwidth(dirs: list[str], backend: str, name: str, nbytes: int = 64 << 20,
                          request_bytes: int = 4 << 20, emulate_ssd_gbps: float | None = None) -> tuple[float, float]:
    """(read, write) bytes/s through io_engine over all `dirs`, with requests in flight at once.

    Uses a scratch volume `<name>-probe` that is removed afterwards; the store is never touched.
    """
    nbytes = max(request_bytes, nbytes // request_bytes * request_bytes)
    remove_volume(list(dirs), f"{name}-probe")  # left by a killed run
    vol = open_volume(list(dirs), nbytes, backend=backend, name=f"{name}-probe", emulate_ssd_gbps=emulate_ssd_gbps)
    try:
        pool = vol.buffer_pool(nbytes)
        buf = pool.acquire(nbytes)
        buf.tensor.fill_(7)
        pieces = [buf.tensor[o:o + request_bytes] for o in range(0, nbytes, request_bytes)]
        offsets = range(0, nbytes, request_bytes)

        def run(write: bool) -> float:
            t0 = time.perf_counter()
            hs = [(vol.write(p, o) if write else vol.read_into(p, o)) for p, o in zip(pieces, offsets)]
            for h in hs:
                h.wait()
            if write:
                vol.sync()
            return time.perf_counter() - t0

        run(True)  # allocate the extents before timing
        write_s = min(run(True) for _ in range(2))
        read_s = min(run(False) for _ in range(2))
        buf.release()
    finally:
        vol.close()
        remove_volume(list(dirs), f"{name}-probe")
    return nbytes / read_s, nbytes / write_s


def hardware_name(device: Device, n_ssd: int) -> str:
    """A stable label of the machine for profile cache keys."""
    if device.is_cuda:
        dev = torch.cuda.get_device_name().replace(" ", "_")
    else:
        dev = f"cpu-{platform.machine()}-{os.cpu_count()}c"
    return f"{dev}+{n_ssd}ssd"


def measure_hardware(device: Device, dirs: list[str], backend: str, name: str, thp_g: float, mem_avail: int,
                     probe_bytes: int = 64 << 20, emulate_ssd_gbps: float | None = None) -> Hardware:
    """A Hardware record for this machine: copy and SSD bandwidths measured now, THP_G given."""
    bw_s2m, bw_m2s = measure_ssd_bandwidth(dirs, backend, name, probe_bytes, emulate_ssd_gbps=emulate_ssd_gbps)
    return Hardware(name=hardware_name(device, len(dirs)), thp_g=thp_g, bw_g=measure_copy_bandwidth(device),
                    bw_s2m=bw_s2m, bw_m2s=bw_m2s, mem_avail=int(mem_avail))


def saved_profile_usable(path: str | os.PathLike, note: Callable[[str], None]) -> bool:
    """Whether the profile a run saved at `path` loads (`Profile.load`). One that does not (damaged, or saved
    without a checksum) is only a cache of measurements: it is set aside (renamed beside itself, never deleted),
    `note` says so and where it went, and the run measures again (False)."""
    try:
        Profile.load(path)
        return True
    except ProfileError as e:
        try:
            where = f"set aside as {durable.set_aside(path)}"
        except OSError as err:  # then the profile this run measures replaces it
            where = f"it could not be set aside ({err.strerror or err})"
        note(f"note: {e}; {where}: this run measures the model and the SSDs again")
        return False
