"""io_engine: asynchronous tensor I/O over one or many NVMe SSDs.

Standalone (never imports lohan). One protocol, two backends (`aio` through DeepSpeed's
libaio op, `threads` through os.preadv/os.pwritev), a striped volume over N directories,
and a hard-budgeted pool of aligned host buffers. Failures raise IOEngineError naming the operation,
device, directory, file, offset and errno; `faults.py` injects them on cue for tests (IO_ENGINE_FAULTS).

    vol = open_volume(["/mnt/nvme0", "/mnt/nvme1"], capacity_bytes=64 << 30)
    h = vol.write(tensor, offset=0); h.wait()
    vol.read_into(out, offset=0).wait()
    vol.read_into(out, offset=0, priority=Priority.URGENT).wait()  # served before queued READs, WRITEs
    vol.close()

The names below are loaded on first use (PEP 562): `io_engine.align` (ALIGN, align_up) is torch-free, and the
planning layer imports it without loading torch through this package.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .align import ALIGN

if TYPE_CHECKING:
    from .base import BudgetExceededError, Handle, IOEngineError, VolumeConfigError
    from .buffers import AlignedBuffer, BufferPool, aligned_empty
    from .faults import FaultPlan, FaultyBackend, inject_faults
    from .priority import Priority
    from .volume import Volume, open_volume

_LAZY = {
    "BudgetExceededError": "base", "Handle": "base", "IOEngineError": "base", "VolumeConfigError": "base",
    "AlignedBuffer": "buffers", "BufferPool": "buffers", "aligned_empty": "buffers",
    "FaultPlan": "faults", "FaultyBackend": "faults", "inject_faults": "faults", "Priority": "priority",
    "Volume": "volume", "open_volume": "volume",
}

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "BudgetExceededError",
    "BufferPool",
    "FaultPlan",
    "FaultyBackend",
    "Handle",
    "IOEngineError",
    "Priority",
    "Volume",
    "VolumeConfigError",
    "aligned_empty",
    "inject_faults",
    "open_volume",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once loaded, an ordinary attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
