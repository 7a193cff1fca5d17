"""What ``compute_dtype: auto`` (the default) means on a machine, and why (README "Compute dtype").

bf16 halves the P16 copy's bytes and runs at the tensor cores' rate on a GPU, and at AMX's or AVX-512 bf16's on a
CPU that has them. A CPU without native bf16 (AVX2 only: most desktop and cloud CPUs) converts every operand in
software: the tiny preset trains ~10x slower in bf16 than in fp32 there (issue 39: ~500 tok/s against ~5,000), so
`auto` computes in fp32 on it, which is also bit-exact with a plain PyTorch fp32 loop.

Pure: the machine comes in as arguments (the device kind, the CPU's flags as /proc/cpuinfo names them, whether the
GPU has bf16), so every choice is testable on any box; `lohan.runtime.device.compute_dtype_choice` detects them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from lohan.config import COMPUTE_DTYPES

NATIVE_BF16 = {"amx_bf16": "AMX bf16", "avx512_bf16": "AVX-512 bf16"}
"""CPU flags (as /proc/cpuinfo names them) under which torch's CPU kernels compute bf16 natively."""

SLOW_BF16 = "bf16 would run ~10x slower than fp32"
"""What bf16 costs on a CPU without native bf16 (the tiny preset on an AVX2 box, issue 39)."""

NEEDS_BF16 = ("bf16-master",)
"""State formats whose compute reads the bf16 master as it is (`plan.formats`: no separate P16)."""


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype a run uses, and why (the run header and the dry run print `describe()`)."""

    dtype: str
    """bf16, fp16 or fp32."""
    reason: str
    """Why, in words: the machine's capability, the state format, the store, or the setting."""

    def describe(self) -> str:
        return f"compute {self.dtype} ({self.reason})"


def native_bf16(cpu_flags: Collection[str]) -> str | None:
    """The CPU's native bf16 support in words (e.g. "AMX bf16"), or None when it has none."""
    found = [label for flag, label in NATIVE_BF16.items() if flag in cpu_flags]
    return " and ".join(found) or None


def choose(asked: str, device: str, cpu_flags: Collection[str], *, gpu_bf16: bool = True,
           state_format: str = "exact", stored: str | None = None) -> DtypeChoice:
    """The compute dtype for `asked` (`EngineConfig.compute_dtype`) on a machine.

    Args:
        asked: ``auto``, or bf16/fp16/fp32 (kept, with a word on what it costs where it is slow).
        device: the resolved device kind: ``cuda``, ``cpu`` or ``sim`` (the simulated device computes on the CPU).
        cpu_flags: the CPU's feature flags, as /proc/cpuinfo lists them (``amx_bf16``, ``avx512_bf16``, ...).
        gpu_bf16: on ``cuda``, whether the GPU computes bf16 (compute capability 8.0 and later).
        state_format: the run's `EngineConfig.state_format` (``bf16-master`` computes in bf16 whatever the machine).
        stored: the compute dtype of the store a resume opens (its P16 copy is laid out in it), None for a new one.
    """
    if asked not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={asked!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    on_cpu = device != "cuda"
    native = native_bf16(cpu_flags)
    slow = f"this CPU has no native bf16 (AMX or AVX-512 bf16): {SLOW_BF16}"
    if asked != "auto":
        if asked == "bf16" and on_cpu and not native:
            return DtypeChoice(asked, f"as set; {slow}: --compute-dtype auto picks fp32 here")
        return DtypeChoice(asked, "as set")
    if stored is not None:
        mine = choose("auto", device, cpu_flags, gpu_bf16=gpu_bf16, state_format=state_format)
        if mine.dtype == stored:
            return mine
        why = f"auto: the store was created with {stored}, which a resume keeps; a new run here would pick {mine.dtype}"
        return DtypeChoice(stored, why + (f"; {slow}" if stored == "bf16" and on_cpu and not native else ""))
    if state_format in NEEDS_BF16:
        if on_cpu and not native:
            return DtypeChoice("bf16", f"auto: state format {state_format} computes on its bf16 master; {slow} "
                                       "(the other state formats compute in fp32 here)")
        return DtypeChoice("bf16", f"auto: state format {state_format} computes on its bf16 master")
    if not on_cpu:
        if gpu_bf16:
            return DtypeChoice("bf16", "auto: the GPU computes bf16")
        return DtypeChoice("fp32", "auto: this GPU has no bf16 (compute capability below 8.0); --compute-dtype "
                                   "fp16 is faster, with loss scaling")
    if native:
        return DtypeChoice("bf16", f"auto: this CPU has {native}")
    return DtypeChoice("fp32", f"auto: this CPU has no native bf16 (AMX or AVX-512 bf16): {SLOW_BF16}; "
                               "--compute-dtype bf16 forces it")
