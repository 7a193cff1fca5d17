"""The simulated device (``LOHAN_DEVICE=sim``, ``--device sim``): the CPU behaving as a separate accelerator.

On a plain CPU run a "device" tensor and a host buffer are the same kind of tensor, streams are absent and
every copy is synchronous, so nothing can tell a missing copy, event or wait from a correct one. This mode
makes those mistakes fail on a machine without a GPU, on the same code paths CUDA takes:

- **Device memory.** Tensors on the simulated device are `SimTensor`s, a wrapper subclass over CPU storage
  (PyTorch's FakeTensor propagates a device the same way). An op that mixes one with a host tensor of one or
  more dimensions raises `DeviceMixError`, as CUDA raises "Expected all tensors to be on the same device";
  only copies cross. A SimTensor reports the device ``cpu:1`` (`SIM_DEVICE`), so ``x.device`` differs from
  the host's ``cpu``: inside the device's compute context (`SimDevice.compute`) an op given
  ``device=x.device`` creates a SimTensor, as model code's ``torch.arange(..., device=x.device)`` does on a
  GPU, and ``.cpu()`` / ``.to("cpu")`` copy to the host. 0-dim host tensors mix freely, as CPU scalars do
  with CUDA tensors.
- **Streams and events.** The compute stream runs its ops at once, on the calling thread; two copy engines, an
  upload (host to device) and a download (device to host) stream, each run their copies later, in order, on a
  worker thread of their own, as a GPU's two copy engines do: a download does not wait for the uploads queued
  before it, nor an upload for the downloads. Each stream keeps a vector clock of the events it waited
  for; every SimTensor remembers which stream last wrote it and when. An op that reads it on another stream
  that has not waited for an event recorded after that write raises `StreamOrderError` (the check
  ``TORCH_CUDA_SANITIZER`` makes on a GPU, made deterministic here); so does an op that overwrites a tensor
  a pending copy still reads, and a download of a tensor whose producing compute it was not ordered after.
- **Host buffers.** Until the host has seen an asynchronous copy's event complete (`query`, `synchronize`; a
  compute stream's wait is not enough), giving back the pool buffer that it reads or writes raises
  `StreamOrderError`; every released pool buffer is then filled with 0xFF bytes (NaN in
  every float format; not while a timed device is open: Time), so a read after release gives a wrong result, not
  the old one. A device-to-host
  copy's destination holds that poison until the copy has run: a host that reads it without waiting for
  the copy's event reads NaNs.
- **Host syncs.** Every value read back to the host (``float()``, ``.item()``, ``bool()``, `SimDevice.fetch`)
  is counted in `SimDevice.syncs`, so a test can bound the syncs of a step.
- **Time (opt-in: a `SimGpu`, ``--sim-gpu rtx4090``, ``LOHAN_SIM_GPU``).** Without one the device checks order, not
  time. With one it runs at a modeled GPU's pace: each compute op (forward and autograd backward alike, all come
  through `SimDevice.dispatch`) takes ``max(FLOPs / flops, bytes moved / mem_bw)``, its FLOPs from torch's
  ``flop_counter`` registry (matmuls, convolutions; the CPU's fused attention from `_EXTRA_FLOPS`; other ops
  are priced by their bytes), its bytes its
  inputs' and outputs'. The op still runs for real (results are bit-identical) and its real time counts toward
  the modeled one. The modeled compute stream keeps its own clock (when it will have finished what was issued):
  the host runs ahead of it, as a GPU's host does, by up to `RUN_AHEAD` seconds, then sleeps (the GIL released,
  no core held) until it is back within that; a host sync (a value read back, `synchronize`) sleeps until the
  stream is done. A download starts no earlier than the modeled end of the compute it was ordered after; the
  compute stream's use of an upload starts once the upload is done. The compute lane thus takes max(real,
  modeled) time while AdamW, hashing and I/O threads get the cores, and `Device.timer` spans read the modeled
  stream's clock (as CUDA events do). A copy takes ``bytes / h2d`` or ``bytes / d2h`` on its engine, after a
  GPU's launch latency (`TIMED_LATENCY`, not the untimed device's 2 ms: a block's upload and its gradient's
  download each on the step's path would add 4 ms a block that no GPU box spends).
  `SimDevice.busy` sums each lane's busy seconds under the cost model's lane names (gpu, m2g, g2m). Not modeled:
  kernel efficiency and launch overhead (every op at the peak rate; fp32 ops at the bf16 peak), the caching
  allocator, and the host's own issue order beyond that: the compute's real part runs when the host issues it,
  and a wait for an upload (`Device.wait`) blocks the host until the upload is done (on a GPU only the stream).
  A timed device poisons neither the destinations of its copies (they hold their old bytes until the copy runs, as
  on a GPU) nor the pool buffers given back while it is open (the only devices open): filling every uploaded,
  downloaded and released byte would take the host time the model leaves to AdamW and the I/O (the optimizer's
  record buffers alone, ~1.4 GB a step on lane_bench's 125m, a memset on the optimizer's own thread). The ordering
  checks still run, and the untimed device, which the equivalence suite runs, poisons them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

from lohan.runtime.sim_modeled import REAL, ModeledCompute
from lohan.runtime.simgpu import SimGpu

SIM_DEVICE = torch.device("cpu", 1)  # what a SimTensor reports: `x.device` differs from the host's `cpu`
POISON_BYTE = 0xFF  # NaN in fp32, bf16 and fp16; -1 in integer types (an invalid token id)
LATENCY_ENV = "LOHAN_SIM_LATENCY"  # seconds a copy waits on the worker before it runs (default: below)
UNTIMED_LATENCY = 2e-3  # long enough that a host reading a copy's buffer without waiting for it finds it unwritten
TIMED_LATENCY = 1e-5  # a GPU's copy launch: a timed device's copies take their modeled time, not 2 ms more each
RUN_AHEAD = 0.5  # modeled compute seconds the host may have queued before it sleeps (CUDA's launch queue)

aten = torch.ops.aten
# copies are the one kind of op that may take a host tensor and a device tensor together
_COPIES = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}
# reading a value to the host: a device synchronization
_SYNCS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


class DeviceMixError(RuntimeError):
    """An op mixed a tensor on the simulated device with a host tensor (CUDA would raise too)."""


class StreamOrderError(RuntimeError):
    """A tensor or host buffer was used across streams without the event that orders the use."""


# ------------------------------------------------------------------------------------------ streams
class SimEvent:
    """An event recorded on a `SimStream`: the recording stream's vector clock at that point."""

    def __init__(self, stream: SimStream, seq: int, clock: dict[SimStream, int]) -> None:
        self.stream, self.seq, self.clock = stream, seq, clock
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        """Whether the work before the event is complete (then the host may reuse what it used)."""
        if not self._done.is_set():
            return False
        self.stream.device.host_saw(self)
        return True

    def synchronize(self) -> None:
        """The host waits for the work before the event; whatever the host issues next is ordered after it."""
        self._done.wait()
        if self.error is not None:
            raise RuntimeError("a simulated copy failed") from self.error
        self.stream.device.host_saw(self)

    @property
    def observed(self) -> bool:
        """Whether the host has seen this event, or a later one of its stream, complete (query or synchronize):
        only then may it reuse the host memory the work used. A compute stream's wait does not count, though
        the simulated compute stream blocks the host."""
        return self.stream.device.host_seen.get(self.stream, 0) > self.seq

    def _finish(self) -> None:
        self._done.set()


class SimStream:
    """A stream's clock: how many events it recorded, and the latest event of each stream it waited for."""

    def __init__(self, device: SimDevice, name: str) -> None:
        self.device, self.name = device, name
        self.count = 0
        self.seen: dict[SimStream, int] = {}
        self.lock = threading.Lock()

    def record(self) -> SimEvent:
        with self.lock:
            clock = dict(self.seen)
            clock[self] = self.count + 1
            ev = SimEvent(self, self.count, clock)
            self.count += 1
        return ev

    def wait_event(self, ev: SimEvent) -> None:
        with self.lock:
            for stream, seq in ev.clock.items():
                if self.seen.get(stream, 0) < seq:
                    self.seen[stream] = seq

    def sees(self, writer: tuple[SimStream, int] | None) -> bool:
        """Whether work now issued on this stream is ordered after the write `writer` = (stream, count then)."""
        if writer is None or writer[0] is self:
            return True
        return self.seen.get(writer[0], 0) > writer[1]

    def __repr__(self) -> str:
        return f"SimStream({self.name})"



# aten ops take tensors, scalars and flat lists of them, and return a tensor or a tuple: these walk just that, at a
# fraction of torch.utils._pytree's cost (its generic walk was most of the emulator's per-op time, which a timing
# model must keep small: it is the host time the modeled GPU waits for)
def _leaves(tree: Any, out: list) -> list:
    """`tree`'s leaves (tuples, lists and dicts walked) appended to `out`."""
    if isinstance(tree, (tuple, list)):
        for x in tree:
            _leaves(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _leaves(x, out)
    else:
        out.append(tree)
    return out


def _map(cls: type, fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """`tree` with every instance of `cls` replaced by ``fn(it)``; other leaves kept."""
    kind = type(tree)
    if isinstance(tree, cls):
        return fn(tree)
    if kind is tuple or kind is list:
        return kind(_map(cls, fn, x) for x in tree)
    if kind is dict:
        return {k: _map(cls, fn, x) for k, x in tree.items()}
    if isinstance(tree, tuple):  # torch.return_types (a structseq): the generic walk rebuilds it
        return tree_map_only(cls, fn, tree)
    return tree

def _inner(t: SimTensor) -> Tensor:
    return t._inner


# ------------------------------------------------------------------------------------------ tensors
class _Memory:
    """What a SimTensor and all its views share: the last write (stream, count) and the copies reading it."""

    __slots__ = ("writer", "readers")

    def __init__(self, writer: tuple[SimStream, int] | None) -> None:
        self.writer = writer
        self.readers: list[SimEvent] = []


class SimTensor(Tensor):
    """A tensor on the simulated device: CPU storage (`_inner`) that host tensors may not mix with."""

    _inner: Tensor
    _mem: _Memory
    _device: SimDevice

    @staticmethod
    def __new__(cls, inner: Tensor, device: SimDevice, mem: _Memory) -> SimTensor:
        r = Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                          storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                          device=SIM_DEVICE, requires_grad=inner.requires_grad)
        r._inner, r._device, r._mem = inner, device, mem
        return r

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"SimTensor({tuple(self.shape)}, {self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_inner"], (self._device, self._mem)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: Any, size: Any, stride: Any) -> SimTensor:
        return SimTensor(inner["_inner"], *meta)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _leaves((args, kwargs), [])
        device = next(t._device for t in leaves if isinstance(t, SimTensor))
        return device.dispatch(func, args, kwargs, leaves)


def _schema_writes(func: Any) -> list[int]:
    """Positions of the arguments an op writes (in-place and out= ops)."""
    hit = _WRITES.get(func)
    if hit is None:
        hit = _WRITES[func] = [k for k, a in enumerate(func._schema.arguments)
                               if a.alias_info is not None and a.alias_info.is_write]
    return hit


def _is_view(func: Any) -> bool:
    hit = _VIEWS.get(func)
    if hit is None:
        hit = _VIEWS[func] = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    return hit


_WRITES: dict[Any, list[int]] = {}
_VIEWS: dict[Any, bool] = {}


def _to_host_kwargs(kwargs: dict) -> dict:
    """`kwargs` with the simulated device replaced by the host's (the storage is CPU memory)."""
    if kwargs.get("device") == SIM_DEVICE:
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


class _FactoryMode(TorchDispatchMode):
    """Inside the compute context, ops that make a tensor on the simulated device (``device=x.device``) from no
    device tensor make a SimTensor: factories, and copies of host tensors (``host.to(x.device)``)."""

    def __init__(self, device: SimDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") != SIM_DEVICE or any(isinstance(t, SimTensor) for t in _leaves(args, [])):
            return func(*args, **kwargs)
        out = func(*args, **_to_host_kwargs(kwargs))
        return _map(Tensor, lambda t: t if isinstance(t, SimTensor) else self.device.wrap(t), out)


# ------------------------------------------------------------------------------------------ the device
class _CopyEngine:
    """One copy engine: a stream and the worker thread that runs its copies in order, each after the device's
    latency (from its issue) and, with a timing model, for at least ``bytes / rate`` seconds, which its lane
    counts (without one, its real time)."""

    def __init__(self, device: SimDevice, name: str, rate: float | None) -> None:
        self.device, self.rate = device, rate
        self.stream = SimStream(device, name)
        self.busy = 0.0  # seconds a copy was running, or modeled (the latency before it started is not counted)
        self.not_before = 0.0  # the modeled end of the compute this engine's stream last waited for
        self._jobs: queue.Queue[tuple[Callable[[], None], SimEvent, float, int] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"lohan-sim{name}", daemon=True)
        self._worker.start()

    def submit(self, job: Callable[[], None], ev: SimEvent, nbytes: int = 0, late: bool = True) -> None:
        """Queue a copy (`late`: run no sooner than the device's latency after now, as copies do here)."""
        due = time.monotonic() + (self.device.latency if late else 0.0)
        self._jobs.put((job, ev, max(due, self.not_before), nbytes))

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, ev, due, nbytes = item
            _sleep_until(due)
            start = time.monotonic()
            try:
                job()
            except BaseException as e:  # the waiter raises it
                ev.error = e
            if self.rate:
                _sleep_until(start + nbytes / self.rate)
                # the modeled seconds only, as the gpu lane counts them: where the CPU's own memcpy outlasts them
                # (two busy cores copy a few GB/s), the engine waits on the emulator, not on the modeled link
                self.busy += nbytes / self.rate
            else:
                self.busy += time.monotonic() - start
            ev._finish()

    def close(self) -> None:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()


def _sleep_until(when: float) -> None:
    delay = when - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _sdpa_cpu_flops(q: Tensor, k: Tensor, v: Tensor, *_: Any, **__: Any) -> float:
    """Attention's Q·K^T and P·V (2 FLOPs a multiply-add; no causal discount), as lohan's profiler counts them:
    torch's FLOP table has the GPU kernels only, and the simulated device runs the CPU's."""
    b, h, t, d = q.shape
    return 2.0 * b * h * t * k.shape[-2] * (d + v.shape[-1])


# the CPU's fused attention, which torch's flop_registry lacks: forward, and backward at twice its FLOPs (the
# gradients of Q, K, V and the recomputed scores, as torch counts the GPU kernels' backward)
_EXTRA_FLOPS: dict[Any, Callable[..., float]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *_, **__: 2 * _sdpa_cpu_flops(q, k, v),
}


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(tree, []) if isinstance(t, Tensor))


class SimDevice:
    """Streams, two copy engines, the checks and (with `timing`) the pace of the simulated device;
    `lohan.runtime.device.Device` drives it."""

    def __init__(self, latency: float | None = None, timing: SimGpu | None = None) -> None:
        if latency is None:
            latency = float(os.environ.get(LATENCY_ENV, TIMED_LATENCY if timing else UNTIMED_LATENCY))
        self.latency = latency
        self.timing = timing
        self.compute_stream = SimStream(self, "compute")
        self.syncs = 0
        self.copies = {"h2d": 0, "d2h": 0}
        self.host_seen: dict[SimStream, int] = {}  # the host's clock: events it saw complete
        self._host_lock = threading.Lock()
        self._upload = _CopyEngine(self, "upload", timing.h2d if timing else None)
        self._download = _CopyEngine(self, "download", timing.d2h if timing else None)
        self.upload_stream, self.download_stream = self._upload.stream, self._download.stream
        self._clock = threading.Lock()
        self._free_at = 0.0  # when the modeled compute stream has finished what was issued on it
        self._gpu_busy = 0.0
        # compute=modeled (SimGpu.arithmetic False): ops yield zeros of their shape, copies move no bytes
        self.modeled_only = timing is not None and not timing.arithmetic
        self.modeled = ModeledCompute() if self.modeled_only else None
        _HOST.install(timed=timing is not None)

    # -- time
    def _charge(self, t0: float, t1: float, modeled: float) -> None:
        """An op ran on the host from `t0` to `t1`; on the modeled GPU it starts once the ops before it are done
        (or at `t0`) and takes `modeled` seconds. Its result exists only once the host has computed it, so the
        stream is not done before `t1`; but the lane counts only the modeled seconds as busy: where the CPU's
        real run of an op outlasts its modeled time (small ops, Python dispatch, cores taken by the optimizer),
        the modeled GPU would have finished and waits for the emulator, which a GPU box would not do: that
        time shows as idle, not as GPU work the cost model would then seem to underprice."""
        with self._clock:
            start = max(self._free_at, t0)
            self._gpu_busy += modeled
            self._free_at = max(t1, start + modeled)

    def _pay(self, slack: float = 0.0) -> None:
        """Sleep (no core held) until the modeled compute stream is at most `slack` seconds from done."""
        if self._free_at - time.monotonic() > slack:
            _sleep_until(self._free_at - slack)

    def stream_time(self) -> float:
        """Where the modeled compute stream is: when work issued now would start (`time.monotonic` seconds)."""
        with self._clock:
            return max(time.monotonic(), self._free_at)

    def _op_seconds(self, func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        """The modeled time of an aten op on plain tensors: max(FLOPs / flops, bytes / mem_bw)."""
        timing = self.timing
        if timing is None or _is_view(func):
            return 0.0
        packet = func._overloadpacket
        if packet in _EXTRA_FLOPS:
            flops = _EXTRA_FLOPS[packet](*args, **kwargs)
        else:
            count = flop_registry.get(packet)
            flops = count(*args, **kwargs, out_val=out) if count is not None else 0
        nbytes = _nbytes((args, kwargs)) + _nbytes(out)
        return max(flops / timing.flops, nbytes / timing.mem_bw if timing.mem_bw else 0.0)

    def _copy_seconds(self, func: Any, args: tuple, kwargs: dict) -> float:
        """A synchronous copy's modeled time: its bytes over the device memory, or over the link when it crosses."""
        timing = self.timing
        if timing is None:
            return 0.0
        src = args[1] if func is aten.copy_.default else args[0]
        nbytes = _nbytes(src)
        to_host = func is aten.copy_.default and not isinstance(args[0], SimTensor) or (
            kwargs.get("device") not in (None, SIM_DEVICE))
        rate = timing.d2h if to_host else timing.h2d if not isinstance(src, SimTensor) else timing.mem_bw
        return nbytes / rate if rate else 0.0

    def busy(self) -> dict[str, float]:
        """Seconds each lane was busy so far, under the cost model's lane names (lohan.plan.planner.LANES): the
        compute stream ``gpu`` (its ops' modeled seconds, `_charge`), the upload engine ``m2g`` and the
        download engine ``g2m`` (their copies' modeled seconds; without a timing model, their running time)."""
        with self._clock:
            gpu = self._gpu_busy
        return {"gpu": gpu, "m2g": self._upload.busy, "g2m": self._download.busy}

    # -- tensors
    def wrap(self, inner: Tensor, writer: tuple[SimStream, int] | None = None) -> SimTensor:
        if writer is None:
            writer = (self.compute_stream, self.compute_stream.count)
        return SimTensor(inner, self, _Memory(writer))

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> SimTensor:
        if self.modeled_only:  # nothing writes it (every write is skipped): the shared zeros, never NaN
            return self.wrap(self._zeros_of(shape, dtype))
        inner = torch.empty(shape, dtype=dtype)
        _poison(inner)  # uninitialized device memory: whatever reads it before a write reads NaN
        return self.wrap(inner)

    def _zeros_of(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
        """compute=modeled: a view of the shared zeros (no op writes device memory, so every buffer the device would
        have filled may be the same zeros, at no memset or allocation; `sim_modeled`)."""
        return self.modeled.zeros(shape, dtype)

    def dispatch(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Run (or, compute=modeled, stand in for) an aten op on SimTensors; `leaves`: its arguments' leaves."""
        if func in _COPIES:
            t0 = time.monotonic()
            out = self._copy_op(func, args, kwargs)
            self._charge(t0, time.monotonic(), self._copy_seconds(func, args, kwargs))
            self._pay(0.0 if not isinstance(out, SimTensor) else RUN_AHEAD)  # to the host: a sync
            return out
        self._check_compute_op(func, args, kwargs, leaves)
        if func in _SYNCS:
            self.syncs += 1
        inner_args, inner_kwargs = _map(SimTensor, _inner, (args, _to_host_kwargs(kwargs)))
        t0 = time.monotonic()
        out, seconds = REAL, None
        if self.modeled_only and func not in _SYNCS and not _is_view(func):
            out, seconds = self.modeled.result(func, inner_args, inner_kwargs, _schema_writes(func),
                                               lambda o: self._op_seconds(func, inner_args, inner_kwargs, o))
        if out is REAL:
            out = func(*inner_args, **inner_kwargs)
            seconds = self._op_seconds(func, inner_args, inner_kwargs, out)
        self._charge(t0, time.monotonic(), seconds)
        self._pay(0.0 if func in _SYNCS else RUN_AHEAD)
        if func in _SYNCS or not isinstance(out, Tensor | tuple | list):
            return out
        if _is_view(func):
            mem = next(t._mem for t in leaves if isinstance(t, SimTensor))
            wrapped = _map(Tensor, lambda t: SimTensor(t, self, mem), out)
        else:
            wrapped = _map(Tensor, self.wrap, out)
        return return_and_correct_aliasing(func, args, kwargs, wrapped)

    def _check_compute_op(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> None:
        """An op on the compute stream: no host tensor mixed in, every device input ordered before it, and what it
        overwrites read by no pending copy; then it is the last writer of what it writes."""
        stream = self.compute_stream
        host = [t for t in leaves if isinstance(t, Tensor) and not isinstance(t, SimTensor) and t.dim() > 0]
        if host:
            raise DeviceMixError(
                f"{func} mixes a tensor on the simulated device with a host tensor of shape {tuple(host[0].shape)}; "
                "CUDA raises 'Expected all tensors to be on the same device' here: copy one of them across first")
        for t in leaves:
            if isinstance(t, SimTensor) and not stream.sees(t._mem.writer):
                raise StreamOrderError(
                    f"{func} on the compute stream reads a device tensor that the {t._mem.writer[0].name} stream "
                    "wrote, without waiting for an event recorded after that write (a missing Device.wait)")
        for k in _schema_writes(func):
            t = args[k] if k < len(args) else kwargs.get(func._schema.arguments[k].name)
            if isinstance(t, SimTensor):
                self._check_readers(t, f"{func} overwrites")
                t._mem.writer = (stream, stream.count)

    def _check_readers(self, t: SimTensor, what: str) -> None:
        pending = [ev for ev in t._mem.readers if not ev.query()]
        t._mem.readers = pending
        if pending and not all(self.compute_stream.sees((ev.stream, ev.seq)) for ev in pending):
            raise StreamOrderError(f"{what} a device tensor that an asynchronous copy still reads (wait for the "
                                   "copy's event, or keep the tensor until it completes)")

    def _copy_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A synchronous copy between the device and the host (`Tensor.copy_`, `.to(dtype)` on the device)."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, SimTensor):
                self._check_readers(dst, "copy_ overwrites")
                if isinstance(src, SimTensor) and not self.compute_stream.sees(src._mem.writer):
                    raise StreamOrderError("copy_ reads a device tensor before the copy that writes it completed")
                if not self.modeled_only:
                    dst._inner.copy_(src._inner if isinstance(src, SimTensor) else src, **kwargs)
                dst._mem.writer = (self.compute_stream, self.compute_stream.count)
                return dst
            self.syncs += 1  # device -> host, synchronously: the host waits for the device
            if not self.compute_stream.sees(src._mem.writer):
                raise StreamOrderError("copy_ to the host reads a device tensor before the copy that writes it completed")
            return dst.copy_(src._inner, **kwargs)
        if func is aten._to_copy.default:
            src = args[0]
            if not self.compute_stream.sees(src._mem.writer):
                raise StreamOrderError(f"{func} reads a device tensor before the copy that writes it completed")
            target = kwargs.get("device")
            if target is not None and target != SIM_DEVICE:  # .cpu(), .to("cpu"): to the host, synchronously
                self.syncs += 1
                return func(src._inner, *args[1:], **kwargs)
            if self.modeled_only:  # a cast on the device: its result's shape, no arithmetic
                out = self.modeled.result(func, (src._inner, *args[1:]), _to_host_kwargs(kwargs), [])
                if out is not REAL:
                    return self.wrap(out)
            return self.wrap(func(src._inner, *args[1:], **_to_host_kwargs(kwargs)))
        inner_args, inner_kwargs = _map(SimTensor, _inner, (args, _to_host_kwargs(kwargs)))
        return _map(Tensor, self.wrap, func(*inner_args, **inner_kwargs))

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """The compute context: factory ops create device tensors."""
        with _FactoryMode(self):
            yield

    # -- host syncs
    def host_saw(self, ev: SimEvent) -> None:
        """After the host waited for `ev`, every stream's later work is ordered after it."""
        with self._host_lock:
            for stream, seq in ev.clock.items():
                if self.host_seen.get(stream, 0) < seq:
                    self.host_seen[stream] = seq
        for stream in (self.compute_stream, self.upload_stream, self.download_stream):
            stream.wait_event(ev)

    def fetch(self, t: Tensor) -> Tensor:
        """A device tensor's value on the host (a synchronization)."""
        if not isinstance(t, SimTensor):
            return t
        self.syncs += 1
        if not self.compute_stream.sees(t._mem.writer):
            raise StreamOrderError("a device tensor was read to the host before the copy that writes it completed")
        self._pay()
        return t._inner.clone()

    def put(self, host: Tensor) -> SimTensor:
        """A synchronous host-to-device copy (small tensors: token ids, targets)."""
        return self.wrap(host.detach().clone())

    # -- asynchronous copies on the copy engines
    def h2d(self, host: Tensor, after: SimEvent | None = None) -> tuple[SimTensor, SimEvent]:
        """Copy `host` to a new device tensor on the upload engine, after `after` (a download's event: the
        upload stream waits for it); returns the tensor and the copy's event. The host memory must stay
        untouched until the event completes; the compute stream reads the tensor after it waited for the event
        (`Device.wait`)."""
        if isinstance(host, SimTensor):
            raise DeviceMixError("h2d of a tensor that is already on the device")
        if self.modeled_only:  # no bytes move (nothing reads them as numbers)
            inner = self._zeros_of(host.shape, host.dtype)
        else:
            inner = torch.empty(host.shape, dtype=host.dtype)
        if self.timing is None:  # a timed device leaves it unpoisoned (the module's docstring, Time)
            _poison(inner)
        stream = self.upload_stream
        if after is not None:
            stream.wait_event(after)
        src = host.detach()
        _HOST.check_order(src, stream, "read")
        out = self.wrap(inner, writer=(stream, stream.count))
        ev = stream.record()
        _HOST.track(src, ev, "read")
        self.copies["h2d"] += 1

        def job() -> None:
            if after is not None:  # the engine stalls until the other engine's copy is done, as a GPU's would
                after._done.wait()
            if not self.modeled_only:
                inner.copy_(src)

        self._upload.submit(job, ev, _nbytes(src))
        return out, ev

    def d2h(self, dev: Tensor, out: Tensor) -> SimEvent:
        """Copy device tensor `dev` into host tensor `out` on the download engine, which must have waited for the
        compute stream's write of `dev` (`SimDevice.copy_after_compute`)."""
        if not isinstance(dev, SimTensor) or isinstance(out, SimTensor):
            raise DeviceMixError("d2h copies a device tensor into a host tensor")
        if not self.download_stream.sees(dev._mem.writer):
            raise StreamOrderError(f"the download stream reads a device tensor the {dev._mem.writer[0].name} stream "
                                   "wrote, without waiting for an event recorded after that write (a missing wait "
                                   "for the producing stream: Device.to_host orders it after the compute)")
        _HOST.check_order(out, self.download_stream, "write")
        if self.timing is None:  # what the host finds there before the copy has run (untimed only: Time)
            _poison(out)
        ev = self.download_stream.record()
        src = dev._inner
        dev._mem.readers.append(ev)
        _HOST.track(out, ev, "write")
        self.copies["d2h"] += 1
        # compute=modeled: the host finds zeros (a pool buffer given back holds NaN poison, which would make the step
        # look non-finite); a GPU's DMA writes host memory without a core, a memset is the least this box can do
        self._download.submit(out.zero_ if self.modeled_only else lambda: out.copy_(src), ev, _nbytes(src))
        return ev

    def copy_after_compute(self) -> None:
        """The download engine waits for everything issued on the compute stream so far (an event recorded there
        now: the producing compute), not for the uploads queued on the other engine."""
        with self._clock:  # the download starts once the modeled compute stream has produced what it reads
            self._download.not_before = max(self._download.not_before, self._free_at)
        self.download_stream.wait_event(self.compute_stream.record())

    def close(self) -> None:
        """Finish the copies issued so far and stop the copy engines."""
        if self._upload._worker.is_alive() or self._download._worker.is_alive():
            self._upload.close()
            self._download.close()
            _HOST.uninstall(self)

    def synchronize(self) -> None:
        """Wait for the compute and every copy issued so far."""
        self._pay()
        events = []
        for engine in (self._upload, self._download):
            ev = engine.stream.record()
            engine.submit(lambda: None, ev, late=False)  # a marker, not a copy: no latency of its own
            events.append(ev)
        for ev in events:
            ev.synchronize()


def _poison(t: Tensor) -> None:
    """Fill `t` with the poison pattern (NaN for floats, -1 for integers)."""
    if not t.numel():
        return
    if t.is_contiguous() and t.dim():
        t.view(torch.uint8).fill_(POISON_BYTE)
    else:
        t.fill_(float("nan") if t.is_floating_point() else -1)


# ------------------------------------------------------------------------------------------ host memory
class _HostRanges:
    """Host memory that pending asynchronous copies read or write; checked and poisoned when a pool buffer
    is released (`io_engine.buffers.add_release_hook`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[int, tuple[int, int, SimEvent, str]] = {}
        self._ids = itertools.count()
        self._installed = False
        self._open = 0  # simulated devices not yet closed: only while one is, released buffers are checked
        self._untimed = 0  # of those, the ones without a timing model: only while one is, they are also poisoned

    def install(self, timed: bool) -> None:
        from io_engine.buffers import add_release_hook

        with self._lock:
            self._open += 1
            self._untimed += not timed
            if not self._installed:
                add_release_hook(self.on_release)
                self._installed = True

    def uninstall(self, device: SimDevice) -> None:
        """A simulated device closed, its copies all done: its ranges go (a later device's buffers may reuse that
        memory), and once none is open, releases are plain again (later code in the same process, a CPU test,
        must not find its released buffers poisoned)."""
        with self._lock:
            self._open = max(0, self._open - 1)
            if device.timing is None:
                self._untimed = max(0, self._untimed - 1)
            for key in [k for k, r in self._ranges.items() if r[2].stream.device is device]:
                del self._ranges[key]

    def track(self, t: Tensor, ev: SimEvent, how: str) -> None:
        start = t.data_ptr()
        end = start + _span_bytes(t)
        with self._lock:
            for key in [k for k, r in self._ranges.items() if r[2].observed]:
                del self._ranges[key]
            self._ranges[next(self._ids)] = (start, end, ev, how)

    def check_order(self, t: Tensor, stream: SimStream, how: str) -> None:
        """A copy on `stream` that `how`s host tensor `t` ("read" or "write") must be ordered after the pending
        copies of the other engine that write it (or, for a write, read it): the two engines run side by side."""
        start = t.data_ptr()
        end = start + _span_bytes(t)
        clash = "write" if how == "read" else "read"
        with self._lock:
            busy = [ev for s, e, ev, h in self._ranges.values()
                    if s < end and start < e and h == clash and not ev.observed and not stream.sees((ev.stream, ev.seq))]
        if busy:
            raise StreamOrderError(f"the {stream.name} stream {how}s a host buffer that a copy on the {busy[0].stream.name} "
                                   f"stream still {clash}s, without waiting for that copy's event (the two copy "
                                   "engines run side by side: pass the event as Device.to_device(..., after=event), or "
                                   "synchronize it first)")

    def on_release(self, t: Tensor, poison: bool) -> None:
        if not self._open:
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        with self._lock:
            busy = [how for s, e, ev, how in self._ranges.values() if s < end and start < e and not ev.observed]
        if busy:
            raise StreamOrderError(f"a host buffer was given back while an asynchronous copy {busy[0]}s it, before the "
                                   "host saw the copy's event complete (Event.query or synchronize): the copy may "
                                   "still be using it")
        if poison and self._untimed and t.numel():
            t.view(torch.uint8).fill_(POISON_BYTE)


def _span_bytes(t: Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


_HOST = _HostRanges()
