"""Device abstraction: the compute device and the copy machinery the engine needs (DESIGN.md §3).

Three kinds, one set of code paths:

- ``cuda``: host->device copies run on one side stream (`upload_stream`), device->host copies on another
  (`download_stream`), from page-locked buffers, so that a GPU's two copy engines carry both directions at
  once: the next block's parameters are not queued behind this block's activations or gradients. Each copy
  returns an event. The compute stream waits for an upload's event before it uses the copy (`wait`); a download
  waits for an event recorded on the compute stream when it is issued (the compute that produced what it
  reads), not for the uploads; the host keeps the host buffer until the event completes (`Event.query` /
  `synchronize`).
- ``cpu``: the CPU is the device. Host buffers are used in place (no copy), every event is already
  complete, and nothing is pinned (pin_memory() raises without CUDA).
- ``sim`` (``LOHAN_DEVICE=sim``, for tests): the CPU behaving as a separate device would. Device tensors
  and host buffers are told apart, copies complete later on an upload and a download worker thread, and
  missing waits raise (lohan/runtime/simdevice.py). The engine's equivalence tests run in this mode, so the CPU
  suite fails on the device bugs a plain CPU run cannot show. With a timing model (``sim_gpu``,
  ``--sim-gpu rtx4090``, ``LOHAN_SIM_GPU``; lohan/runtime/simgpu.py) it also runs at a modeled GPU's pace.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lohan.config import DEVICES
from lohan.plan.compute_dtype import DtypeChoice, choose
from lohan.runtime.simdevice import SIM_DEVICE, SimDevice
from lohan.runtime.simgpu import ENV as SIM_GPU_ENV
from lohan.runtime.simgpu import SimGpu, parse_sim_gpu

KINDS = tuple(d for d in DEVICES if d != "auto")


def resolve_device(kind: str = "auto") -> str:
    """``auto`` -> ``LOHAN_DEVICE`` when set (``cpu`` keeps a CUDA machine's runs on the CPU, as the test
    suite's plain-PyTorch references run; ``sim`` simulates a separate device), else ``cuda`` when
    available, else ``cpu``."""
    if kind == "auto":
        kind = os.environ.get("LOHAN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        if kind not in KINDS:
            raise ValueError(f"LOHAN_DEVICE={kind!r}: choose cpu, cuda or sim (or unset it for auto)")
    if kind not in KINDS:
        raise ValueError(f"unknown device {kind!r}: choose auto, cpu, cuda or sim")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device (a CPU-only torch build, "
                         "no driver, or CUDA_VISIBLE_DEVICES hides it); use --device cpu or auto")
    return kind


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (``avx2``, ``amx_bf16``, ``avx512_bf16``, ...); where
    there is no /proc/cpuinfo (not Linux), the bf16 ones torch's own CPU queries report."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86; aarch64 calls them Features
                    return frozenset(value.split())
    except OSError:
        pass
    queries = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}  # private: guarded
    return frozenset(flag for flag, name in queries.items() if getattr(torch.cpu, name, lambda: False)())


def compute_dtype_choice(asked: str, device: str = "auto", state_format: str = "exact",
                         stored: str | None = None) -> DtypeChoice:
    """`lohan.plan.compute_dtype.choose` on this machine: `device` (a kind, ``auto``, or ``cuda:N``) resolved, this
    CPU's flags, and on CUDA whether the GPU computes bf16."""
    kind = resolve_device(device.partition(":")[0])
    gpu_bf16 = kind != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
    return choose(asked, kind, cpu_flags(), gpu_bf16=gpu_bf16, state_format=state_format, stored=stored)


class Event(Protocol):
    """Completion of work queued on a stream (torch.cuda.Event, simdevice.SimEvent, or `DONE`)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    """The event of work that completed when it was issued (the CPU device)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = _Done()


@dataclass
class Transfer:
    """A host->device copy in flight: `tensor` is usable on the compute stream after `Device.wait(event)`;
    the host memory it was copied from must stay untouched until `event` completes."""

    tensor: Tensor
    event: Any


class Device:
    """The compute device plus the copy machinery the engine needs."""

    def __init__(self, kind: str = "auto", sim_gpu: str | SimGpu | None = None) -> None:
        """`sim_gpu`: the GPU whose timing the simulated device models (a `SimGpu` or a spec for
        `parse_sim_gpu`; None: ``LOHAN_SIM_GPU`` when set, else none). Only with the simulated device."""
        # "cuda:N": one GPU of several (a data-parallel rank's, parallel.py); it becomes the current device,
        # so the streams, the caching allocator and the copies all use it
        kind, _, index = kind.partition(":")
        kind = resolve_device(kind)
        self.type = kind
        self.is_cuda = kind == "cuda"
        self.is_host = kind == "cpu"  # device memory is main memory: copies are the tensors themselves
        self.timing = _timing(kind, sim_gpu)
        self.sim = SimDevice(timing=self.timing) if kind == "sim" else None
        if self.is_cuda:
            if index:
                torch.cuda.set_device(int(index))
            self.torch = torch.device("cuda", torch.cuda.current_device())
        else:
            self.torch = SIM_DEVICE if self.sim is not None else torch.device("cpu")
        # one stream per copy direction (a GPU has an engine for each): uploads never queue behind downloads
        self.upload_stream = torch.cuda.Stream(self.torch) if self.is_cuda else None
        self.download_stream = torch.cuda.Stream(self.torch) if self.is_cuda else None

    def worker_threads(self) -> int | None:
        """Intra-op threads for a thread that computes beside the compute thread (the optimizer's AdamW), read
        on the compute thread. On the CPU device the compute thread's own pool already runs on
        `torch.get_num_threads()` cores, and a worker's second pool of as many threads would oversubscribe them,
        so the worker gets the cores left over, at least one. A GPU computes elsewhere, so there the worker gets torch's default (None)."""
        if not self.is_host:
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores - torch.get_num_threads())

    def bind_thread(self, intra_op_threads: int | None = None) -> None:
        """Make this device the current one of the calling thread (a worker thread starts on GPU 0, and anything
        it allocates or registers with CUDA would go there on a data-parallel rank's machine), and give the
        thread `intra_op_threads` for its torch ops when given (`worker_threads`; torch's count is per thread)."""
        if self.is_cuda:
            torch.cuda.set_device(self.torch)
        if intra_op_threads is not None:
            torch.set_num_threads(intra_op_threads)

    # ------------------------------------------------------------------ small, synchronous moves
    def put(self, host: Tensor) -> Tensor:
        """A small host tensor (token ids, targets) on the device."""
        if self.sim is not None:
            return self.sim.put(host)
        return host.to(self.torch) if self.is_cuda else host

    def fetch(self, t: Tensor) -> Tensor:
        """A device tensor's value on the host: a synchronization, for values the host needs (a step's loss
        and gradient norm), never inside the per-block loop."""
        if self.sim is not None:
            return self.sim.fetch(t)
        return t.cpu() if self.is_cuda else t

    def empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> Tensor:
        """Uninitialized device memory."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if self.sim is not None:
            return self.sim.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.torch)

    def holds(self, t: Any) -> bool:
        """Whether `t` is a tensor in this device's memory (on the CPU device: any CPU tensor). Ops on a GPU
        may return host tensors too (an attention kernel's RNG seed), which device copies must leave alone."""
        if not isinstance(t, Tensor):
            return False
        if self.sim is not None:
            return t.device == SIM_DEVICE
        return t.is_cuda if self.is_cuda else t.device.type == "cpu"

    # ------------------------------------------------------------------ asynchronous copies
    def to_device(self, host: Tensor, after: Any = None) -> Transfer:
        """Start copying a host tensor to the device on the upload stream (on the CPU: the tensor itself), after
        `after` when given: the event of a download (`to_host`) that writes the host memory it reads, which
        the upload stream would not otherwise wait for.

        The compute stream may use `Transfer.tensor` after `wait(transfer.event)`; the host buffer must not
        be reused before the event completes."""
        if self.sim is not None:
            return Transfer(*self.sim.h2d(host, after))
        if not self.is_cuda:
            return Transfer(host, DONE)
        if after is not None:
            self.upload_stream.wait_event(after)
        with torch.cuda.stream(self.upload_stream):
            out = host.to(self.torch, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.upload_stream)
        # `out` was allocated on the upload stream, and the caching allocator would hand its block to the next
        # copy as soon as it is freed, while kernels queued on the compute stream may still read it (the host
        # runs ahead of the GPU): the next block's parameters would overwrite these under the kernels' feet.
        out.record_stream(torch.cuda.current_stream(self.torch))
        return Transfer(out, event)

    def wait(self, event: Any) -> None:
        """Work queued on the compute stream from now on runs after `event` (no host synchronization on CUDA)."""
        if self.sim is not None:
            event._done.wait()  # the simulated compute stream runs on the host: it must see the bytes now
            self.sim.compute_stream.wait_event(event)
        elif self.is_cuda:
            torch.cuda.current_stream(self.torch).wait_event(event)

    def to_host(self, dev: Tensor, out: Tensor) -> Any:
        """Copy device tensor `dev` into host tensor `out` on the download stream, after everything queued on the
        compute stream so far (an event recorded there now), not after the uploads; returns the copy's event, which the host waits for before it reads `out`.
        `dev` is not freed for reuse before the copy has read it. On the CPU, `out` is written now (nothing
        when `dev` is `out`)."""
        if self.sim is not None:
            self.sim.copy_after_compute()
            return self.sim.d2h(dev, out)
        if not self.is_cuda:
            if dev.data_ptr() != out.data_ptr():
                out.copy_(dev)
            return DONE
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.torch))
        self.download_stream.wait_event(produced)
        with torch.cuda.stream(self.download_stream):
            out.copy_(dev, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.download_stream)
        dev.record_stream(self.download_stream)  # the allocator keeps `dev` until the download has read it
        return event

    # ------------------------------------------------------------------ compute
    def autocast(self, dtype: torch.dtype | None):
        """The compute context: autocast for the compute dtype (none for fp32); on the simulated device, factory
        ops inside it create device tensors."""
        cast = (contextlib.nullcontext() if dtype is None or dtype == torch.float32
                else torch.autocast(device_type="cuda" if self.is_cuda else "cpu", dtype=dtype))
        if self.sim is None:
            return cast
        stack = contextlib.ExitStack()
        stack.enter_context(self.sim.compute())
        stack.enter_context(cast)
        return stack

    def timer(self) -> Timer:
        """Accumulates the device time of compute spans (CUDA events on a GPU, where the host only queues)."""
        return Timer(self)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)
        elif self.sim is not None:
            self.sim.synchronize()

    def close(self) -> None:
        """Release what the device holds beyond tensors (the simulated device's copy worker)."""
        if self.sim is not None:
            self.sim.close()

    def lane_busy(self) -> dict[str, float] | None:
        """Seconds the compute stream (``gpu``), the upload (``m2g``) and the download engine (``g2m``) were busy so
        far, on the simulated device (`SimDevice.busy`); None elsewhere."""
        return self.sim.busy() if self.sim is not None else None

    def describe(self) -> str:
        """The device for the run header: ``sim (modeling rtx4090: 165 TFLOPS, PCIe 25/25 GB/s, HBM 1008 GB/s)``."""
        return f"{self.type} (modeling {self.timing.describe()})" if self.timing is not None else self.type

    @property
    def syncs(self) -> int:
        """Values read back to the host so far (counted on the simulated device only)."""
        return self.sim.syncs if self.sim is not None else 0

    def memory_allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.torch) if self.is_cuda else None

    def max_memory_allocated(self) -> int | None:
        """The allocator's peak since `reset_peak_memory` (CUDA), else None."""
        return torch.cuda.max_memory_allocated(self.torch) if self.is_cuda else None

    def reset_peak_memory(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.torch)

    def __repr__(self) -> str:
        return f"Device({self.type})"


def _timing(kind: str, sim_gpu: str | SimGpu | None) -> SimGpu | None:
    """The simulated device's timing model: `sim_gpu`, else ``LOHAN_SIM_GPU`` (which other devices ignore, so that
    a suite run with it set keeps its CPU runs plain)."""
    if sim_gpu is not None and kind != "sim":
        raise ValueError(f"sim_gpu={sim_gpu if isinstance(sim_gpu, str) else sim_gpu.name!r} models a GPU's timing "
                         f"on the simulated device, but the device is {kind}: use --device sim (LOHAN_DEVICE=sim) "
                         "or drop --sim-gpu")
    if kind != "sim":
        return None
    if sim_gpu is None:
        sim_gpu = os.environ.get(SIM_GPU_ENV) or None
        if sim_gpu is None:
            return None
        try:
            return parse_sim_gpu(sim_gpu)
        except ValueError as e:
            raise ValueError(f"{SIM_GPU_ENV}: {e}") from None
    return parse_sim_gpu(sim_gpu) if isinstance(sim_gpu, str) else sim_gpu


class Timer:
    """Device seconds spent in `with timer:` spans. On CUDA each span is a pair of timing events on the compute
    stream, read at `seconds()` (one synchronization, at the end of a step); on the simulated device its modeled
    compute stream's clock (`SimDevice.stream_time`); on the CPU the host's clock."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._host = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        if self.device.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._t0 = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._host += self._now() - self._t0

    def _now(self) -> float:
        # the simulated device's modeled compute stream may be ahead of the host, as a GPU's is
        return self.device.sim.stream_time() if self.device.sim is not None else time.perf_counter()

    def seconds(self) -> float:
        total = self._host
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total
