"""The compiled update of the compressed state formats (`csrc/format_adamw.cpp`), built once per environment.

The torch version of a compressed format's update (`format_adamw._piece_torch`) is a dozen whole-tensor ops, each a
pass over memory: on 2 cores 8-bit moments update at ~80 M parameters/s and a bf16 master at ~45 M, against
~1.8 G for exact's fused AdamW. The kernel does the same steps block by block in cache: ~145 and ~135 M/s
(benchmarks/results/compressed_states/cpu2-epyc.md). It is used for those two formats; bf16 moments with an fp32 master are
a few casts around torch's fused AdamW, which is faster there.
Its AdamW is torch's fused AdamW's formula, not its exact instruction sequence, so the two paths differ in the
last bits: a process uses one of them for everything (the engine and `FormatAdamW` alike), and a store is best
resumed on the path that wrote it (both are correct; only bit-identity with the run so far needs the same one).

The build (`torch.utils.cpp_extension.load`, g++ and ninja, ~1 minute) happens on first use, or ahead with
``python -m lohan.runtime.format_kernel`` (`make` does it), into the environment's torch_extensions directory.
Without a compiler, the update falls back to the torch ops with a warning. ``LOHAN_FORMAT_KERNEL=0`` forces the
fallback (the tests run both paths).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "format_adamw.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def enabled() -> bool:
    """Whether the kernel may be used (``LOHAN_FORMAT_KERNEL`` is not 0)."""
    return os.environ.get("LOHAN_FORMAT_KERNEL", "1") != "0"


def kernel() -> ModuleType | None:
    """The compiled module (built on the first call in an environment), or None: disabled, or the build failed."""
    global _module, _tried
    if not enabled():
        return None
    with _lock:
        if not _tried:
            _tried = True
            _module = _load()
    return _module


def _load() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        if sys.prefix != sys.base_prefix:  # one build per virtual environment, as io_engine's aio op
            os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
        return load("lohan_format_adamw", [str(SOURCE)], extra_cflags=["-O3", "-fno-math-errno"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch ops do the same work, slower
        log.warning("the compiled update of the compressed state formats is unavailable (%s: %s); they run on "
                    "torch ops instead, 10-20x slower on the CPU. Install g++ and ninja, then run `python -m "
                    "lohan.runtime.format_kernel`", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def main() -> int:
    """Build (or find) the kernel; exit 1 if it cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = kernel()
    print("lohan format kernel: " + ("ready" if mod is not None else "unavailable (the torch ops are used)"))
    return 0 if mod is not None else 1


if __name__ == "__main__":
    sys.exit(main())
