"""io_engine: asynchronous tensor I/O over one or many NVMe SSDs.

Standalone (never imports lohan). One protocol, two backends (`aio` through DeepSpeed's
libaio op, `threads` through os.preadv/os.pwritev), a striped volume over N directories,
and a hard-budgeted pool of aligned host buffers. Failures raise IOEngineError naming the operation,
device, directory, file, offset and errno; `faults.py` injects them on cue for tests (IO_ENGINE_FAULTS).

    vol = open_volume(["/mnt/nvme0", "/mnt/nvme1"], capacity_bytes=64 << 30)
    h = vol.write(tensor, offset=0); h.wait()
    vol.read_into(out, offset=0).wait()
    vol.close()
"""

from .base import ALIGN, BudgetExceededError, Handle, IOEngineError, VolumeConfigError
from .buffers import AlignedBuffer, BufferPool, aligned_empty
from .faults import FaultPlan, FaultyBackend, inject_faults
from .volume import Volume, open_volume

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "BudgetExceededError",
    "BufferPool",
    "FaultPlan",
    "FaultyBackend",
    "Handle",
    "IOEngineError",
    "Volume",
    "VolumeConfigError",
    "aligned_empty",
    "inject_faults",
    "open_volume",
]
