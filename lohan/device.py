"""Device abstraction: CUDA when available, else the CPU stands in for the GPU.

On CPU the "device" is main memory: host buffers are used in place (no copy), streams and
events are no-op twins, and nothing is pinned (pin_memory() raises without CUDA). With CUDA the
same code paths copy on a side stream from page-locked buffers and order it with events.
"""

from __future__ import annotations

import contextlib
import os

import torch


def resolve_device(kind: str = "auto") -> str:
    """``auto`` -> ``LOHAN_DEVICE`` when set (``cpu`` keeps a CUDA machine's runs on the CPU, as the test
    suite's plain-PyTorch references run), else ``cuda`` when available, else ``cpu``."""
    if kind == "auto":
        kind = os.environ.get("LOHAN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"LOHAN_DEVICE={kind!r}: choose cpu or cuda (or unset it for auto)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device (a CPU-only torch build, "
                           "no driver, or CUDA_VISIBLE_DEVICES hides it); use --device cpu or auto")
    return kind


class Device:
    """The compute device plus the copy machinery the engine needs."""

    def __init__(self, kind: str = "auto") -> None:
        # "cuda:N": one GPU of several (a data-parallel rank's, parallel.py); it becomes the current device,
        # so the streams, the caching allocator and the copies all use it
        kind, _, index = kind.partition(":")
        kind = resolve_device(kind)
        self.type = kind
        self.torch = torch.device(f"{kind}:{index}" if index and kind == "cuda" else kind)
        self.is_cuda = kind == "cuda"
        if self.is_cuda and index:
            torch.cuda.set_device(self.torch)
        self.copy_stream = torch.cuda.Stream() if self.is_cuda else None

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """The device copy of a host tensor; on CPU the tensor itself (zero copy)."""
        if not self.is_cuda:
            return host
        current = torch.cuda.current_stream()
        with torch.cuda.stream(self.copy_stream):
            out = host.to(self.torch, non_blocking=True)
        current.wait_stream(self.copy_stream)
        # `out` was allocated on the copy stream, and the caching allocator would hand its block to the next
        # copy as soon as it is freed, while kernels queued on the compute stream may still read it (the host
        # runs ahead of the GPU): the next block's parameters would overwrite these under the kernels' feet.
        out.record_stream(current)
        return out

    def autocast(self, dtype: torch.dtype | None):
        """Autocast context for the compute dtype (none for fp32)."""
        if dtype is None or dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.type, dtype=dtype)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def memory_allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.is_cuda else None

    def __repr__(self) -> str:
        return f"Device({self.type})"
