"""The GPU whose timing the simulated device models (``--sim-gpu``, ``LOHAN_SIM_GPU``; lohan/runtime/simdevice.py).

A `SimGpu` is four rates: the compute stream's FLOP/s, the host link's two directions (an upload and a download
copy engine, as a GPU has) and the device memory's bandwidth. `parse_sim_gpu` reads one from a GPU name of the
planner's hardware presets (``rtx4090``: its datasheet peak, its PCIe rate both ways, its memory bandwidth) or
from ``key=value`` pairs over such a base (``tflops=150,h2d=25GB/s``; ``rtx4090,tflops=40``).

``compute=modeled`` (benchmarks only) skips the device's arithmetic: each op's result is zeros of its shape, its
modeled time still passes, and copies move no bytes. On a GPU box the device's math and its copies take no host
core; here, run for real, they take the cores that AdamW, hashing and the I/O threads need, so a lane benchmark on a
small CPU measures the emulator as much as the schedule. Losses are then meaningless (the header says so); the
default, ``compute=real``, keeps every result bit-identical to a CPU run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lohan.plan.planner import HARDWARE_PRESETS, GpuSpec

ENV = "LOHAN_SIM_GPU"  # the simulated device's timing model when the config names none
DEFAULT_BASE = "rtx4090"  # the base of a spec that names no GPU (the paper's consumer GPU)
_KEYS = {"tflops": 1e12, "h2d": 1e9, "d2h": 1e9, "hbm": 1e9}  # key -> the unit of a plain number
_COMPUTE = ("real", "modeled")  # compute=...: run the device's arithmetic, or only its modeled time
_UNITS = {"tflops": {"TFLOPS": 1e12, "GFLOPS": 1e9},
          "rate": {"TB/s": 1e12, "GB/s": 1e9, "MB/s": 1e6, "GiB/s": 2**30, "MiB/s": 2**20}}


@dataclass(frozen=True)
class SimGpu:
    """The rates the simulated device runs at: an op takes ``max(FLOPs / flops, bytes / mem_bw)``, a copy
    ``bytes / h2d`` (upload engine) or ``bytes / d2h`` (download engine)."""

    name: str
    """What it models, as given (``rtx4090``, ``rtx4090,tflops=40``)."""
    flops: float
    """Compute FLOP/s (a preset's dense bf16 peak; fp32 ops are priced at it too)."""
    h2d: float
    """Host -> device bytes/s."""
    d2h: float
    """Device -> host bytes/s."""
    mem_bw: float
    """Device memory bytes/s."""
    arithmetic: bool = True
    """Whether the device computes its ops' results (``compute=real``, the default) or only their shapes and modeled
    time (``compute=modeled``: zeros, for lane benchmarks; no result is meaningful)."""

    def describe(self) -> str:
        """One line for the run header: ``rtx4090: 165 TFLOPS, PCIe 25/25 GB/s, HBM 1008 GB/s``."""
        return (f"{self.name}: {_num(self.flops / 1e12)} TFLOPS, PCIe {_num(self.h2d / 1e9)}/{_num(self.d2h / 1e9)} "
                f"GB/s, HBM {_num(self.mem_bw / 1e9)} GB/s"
                + ("" if self.arithmetic else "; arithmetic skipped (compute=modeled): losses are not real"))


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _gpus(presets: Mapping[str, object]) -> dict[str, GpuSpec]:
    return {k: v for k, v in presets.items() if isinstance(v, GpuSpec)}


def _rate(key: str, text: str) -> float:
    """A key's value in FLOP/s or bytes/s: a plain number is TFLOPS or GB/s, else a number with a unit."""
    t = text.strip().lower().replace(" ", "")
    units = _UNITS["tflops" if key == "tflops" else "rate"]
    scale = _KEYS[key]
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit.lower()):
            t, scale = t[:-len(unit)], units[unit]
            break
    try:
        value = float(t) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        shown = "TFLOPS" if key == "tflops" else "GB/s"
        raise ValueError(f"sim_gpu {key}={text!r}: give a positive number ({shown}) or one with a unit "
                         f"({', '.join(units)})")
    return value


def parse_sim_gpu(spec: str, presets: Mapping[str, object] = HARDWARE_PRESETS) -> SimGpu:
    """The `SimGpu` a spec names: a GPU of `presets` and/or ``key=value`` pairs (keys ``tflops``, ``h2d``, ``d2h``,
    ``hbm``; and ``compute=real|modeled``), comma-separated, the pairs overriding the named GPU's rates (the
    rtx4090's when none is named).

    Raises:
        ValueError: an unknown name or key, a bad number, two GPUs named, or an empty spec; the message names the
            bad part and lists the accepted names and keys.
    """
    gpus = _gpus(presets)
    accepted = (f"give a GPU ({', '.join(gpus)}) and/or key=value pairs ({', '.join(_KEYS)}; plain numbers are "
                f"TFLOPS and GB/s; compute={'|'.join(_COMPUTE)}), e.g. rtx4090 or tflops=150,h2d=25GB/s,d2h=25GB/s")
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else []
    if not parts or not all(parts):
        raise ValueError(f"sim_gpu={spec!r} is empty or has an empty part: {accepted}")
    base, rates, compute = None, {}, _COMPUTE[0]
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq:
            if key not in gpus:
                raise ValueError(f"sim_gpu {part!r} is not a known GPU: {accepted}")
            if base is not None:
                raise ValueError(f"sim_gpu={spec!r} names two GPUs ({base}, {key}): name one, then override its rates")
            base = key
        elif key == "compute":
            compute = value.strip().lower()
            if compute not in _COMPUTE:
                raise ValueError(f"sim_gpu {part!r}: compute is {' or '.join(_COMPUTE)}")
        elif key not in _KEYS:
            raise ValueError(f"sim_gpu {part!r}: unknown key {key!r}: {accepted}")
        else:
            rates[key] = _rate(key, value)
    gpu = gpus[base or DEFAULT_BASE]
    return SimGpu(name=",".join(parts) if rates or compute != "real" else (base or DEFAULT_BASE), flops=rates.get("tflops", gpu.flops),
                  h2d=rates.get("h2d", gpu.link_bw), d2h=rates.get("d2h", gpu.link_bw),
                  mem_bw=rates.get("hbm", gpu.mem_bw), arithmetic=compute == "real")
