"""Machines the planner prices: a measured or described :class:`Hardware` and the presets a description is made of
(GPUs, SSDs with their effective bandwidths, CPUs' AdamW rates), each with its source (:func:`parse_hardware`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lohan.config import parse_bytes
from lohan.plan.pools import ram_budget
from lohan.plan.units import GiB


@dataclass(frozen=True)
class Hardware:
    """Measured or described machine. Bandwidths in bytes/s, one direction, aggregate over SSDs."""

    name: str
    thp_g: float  # FLOP/s of the compute device (the CPU on a CPU-only box)
    bw_g: float  # device <-> main memory, per direction (the link is duplex)
    bw_s2m: float  # SSD -> main memory
    bw_m2s: float  # main memory -> SSD
    mem_avail: int  # main memory left for swapped activations
    gpu_mem: int = 0  # the capacity fields: 0 = unknown, not checked
    ram: int = 0
    ssd_bytes: int = 0
    cpu_adam_params_per_s: float = 0.0
    """Parameters per second the CPU AdamW updates (P32, m, v and the P16 copy), the ``cpu`` lane's rate.
    0 = unknown: the lane is not priced (profiles measured before this field existed, engine profiles)."""
    act_quant_bps: float = 0.0
    """Activation bytes (as the device holds them) per second that int8 quantization of a record processes on the
    device. 0 = unknown: compressed records cost no GPU time in the cost model."""
    act_dequant_bps: float = 0.0
    """The same for dequantization (it moves a third of quantization's bytes in bf16, a sixth in fp32); 0: priced at
    ``act_quant_bps``."""

    def __post_init__(self) -> None:
        # A zero rate would turn every estimate into a ZeroDivisionError far from its cause.
        bad = [f"{f}={getattr(self, f)!r}" for f in ("thp_g", "bw_g", "bw_s2m", "bw_m2s")
               if not getattr(self, f) > 0]
        for f in ("cpu_adam_params_per_s", "act_quant_bps", "act_dequant_bps"):
            if not getattr(self, f) >= 0:
                bad.append(f"{f}={getattr(self, f)!r}")
        if bad:
            raise ValueError(f"hardware {self.name!r}: rates must be positive ({', '.join(bad)})")

    def describe(self) -> str:
        """The rates the cost model uses, with units, on one line."""
        cpu = (f"CPU AdamW {self.cpu_adam_params_per_s / 1e9:.3g} G params/s" if self.cpu_adam_params_per_s
               else "CPU AdamW not priced (rate unknown)")
        quant = (f" | int8 activations {self.act_quant_bps / 1e9:.3g} GB/s quantized, "
                 f"{(self.act_dequant_bps or self.act_quant_bps) / 1e9:.3g} GB/s dequantized" if self.act_quant_bps else "")
        return (f"GPU {self.thp_g / 1e12:.4g} TFLOPS | PCIe {self.bw_g / 1e9:.3g} GB/s per direction | "
                f"SSD read {self.bw_s2m / 1e9:.3g} GB/s, write {self.bw_m2s / 1e9:.3g} GB/s | {cpu}{quant}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Hardware:
        return Hardware(**d)


@dataclass(frozen=True)
class GpuSpec:
    flops: float
    """Dense bf16 tensor FLOP/s with fp32 accumulate (datasheet peak; measured profiles replace it)."""
    mem: int
    link_bw: float
    """Usable host link bytes/s per direction."""
    source: str
    mem_bw: float = 0.0
    """Device memory bytes/s (datasheet), which prices int8 activation records' quantization (:data:`QUANT_TRAFFIC`);
    0: not priced."""


QUANT_TRAFFIC = (14.5, 5.5)
"""Device-memory bytes that quantizing, and dequantizing, a record moves per byte of bf16 activation, for a described
GPU's ``act_quant_bps = mem_bw / 14.5`` and ``act_dequant_bps = mem_bw / 5.5``. `runtime/act_quant.py`'s eager kernels
quantize reading 2 bytes per value for the row min/max, 2 and writing 4 dividing, reading and writing 4 rounding and
again for the NaN guard, reading 4 and writing 1 casting (29 bytes per 2-byte value); they dequantize reading 1 and
writing 4 multiplying, reading 4 and writing 2 casting (11). A run measures its device's rates instead
(``profiler.measure_quant_rate``)."""


@dataclass(frozen=True)
class SsdSpec:
    read_bw: float
    write_bw: float
    capacity: int
    source: str
    read_eff: float = 1.0
    """Effective / datasheet read bandwidth under the engine's workload (large sequential requests,
    reads and writes of a step interleaved, every step for hours); ``eff_source`` says where it comes from."""
    write_eff: float = 1.0
    """Effective / datasheet write bandwidth (e.g. what is left once an SLC write cache is full)."""
    eff_source: str = ""

    @property
    def effective_read(self) -> float:
        return self.read_bw * self.read_eff

    @property
    def effective_write(self) -> float:
        return self.write_bw * self.write_eff


@dataclass(frozen=True)
class CpuSpec:
    adam_params_per_s: float
    """Parameters per second one socket of this CPU updates with a vectorized CPU AdamW."""
    cores: int
    source: str


_P5510_EFF = (
    "1.0: a datacenter TLC drive with no SLC write cache, so the datasheet's full-span 128 KiB sequential "
    "figures are what it sustains; lohan's I/O path reaches fio on O_DIRECT (benchmarks/results/io_bench/quick/cpu2-epyc.md: "
    "engine/fio >= 1.0); reads and writes of a step are priced as adding up (simplex), and the engine's mixed "
    "traffic on this project's disk moved more than that predicts (benchmarks/results/ago_bench/cpu2-epyc.md). "
    "Cross-check, not calibration: LoHan §V-F's 3 SSDs at 135 TFLOPS (13B, batch 64) need >= ~0.9 of it")

HARDWARE_PRESETS: dict[str, GpuSpec | SsdSpec | CpuSpec] = {
    "rtx4090": GpuSpec(165.2e12, 24 * GiB, 25e9, "Ada whitepaper: 165.2 TFLOPS FP16/BF16 FP32-acc dense; PCIe 4.0 x16; "
                       "memory 1008 GB/s", mem_bw=1008e9),
    "rtx4080": GpuSpec(97.5e12, 16 * GiB, 25e9, "Ada whitepaper: 97.5 TFLOPS FP16/BF16 FP32-acc dense; PCIe 4.0 x16; "
                       "memory 716.8 GB/s", mem_bw=716.8e9),
    "rtx3090": GpuSpec(71e12, 24 * GiB, 25e9, "Ampere GA102 whitepaper: 71 TFLOPS FP16 FP32-acc dense; PCIe 4.0; "
                       "memory 936 GB/s", mem_bw=936e9),
    "a100-80g": GpuSpec(312e12, 80 * GiB, 25e9, "A100 datasheet: 312 TFLOPS BF16 dense; PCIe 4.0 x16 host link; "
                        "memory 1935 GB/s (PCIe card)", mem_bw=1935e9),
    "h100": GpuSpec(989e12, 80 * GiB, 50e9, "H100 SXM datasheet: 989 TFLOPS BF16 dense; PCIe 5.0 x16; "
                    "memory 3.35 TB/s", mem_bw=3.35e12),
    "h200": GpuSpec(989e12, 141 * 10**9, 50e9, "H200 datasheet: 989 TFLOPS BF16 dense, 141 GB; PCIe 5.0 x16; "
                    "memory 4.8 TB/s", mem_bw=4.8e12),
    "p5510": SsdSpec(6.5e9, 3.4e9, 3_840 * 10**9, "Intel D7-P5510 3.84 TB: 6500 MB/s seq read, 3400 MB/s write",
                     1.0, 1.0, _P5510_EFF),
    "980pro": SsdSpec(7.0e9, 5.0e9, 1_000 * 10**9, "Samsung 980 PRO 1 TB: 7000 MB/s seq read, 5000 MB/s write",
                      1.0, 0.30, "write 0.30: TechPowerUp's 980 PRO 1 TB review (sustained write test) measured "
                      "1.5 GB/s once the 113 GB SLC cache is full, and a step rewrites 14 bytes per parameter "
                      "(far more than the cache for any model worth offloading); read: no derating found"),
    # LoHan's testbed (seed 004, Table III): dual Xeon Gold 5320 (26 cores, AVX-512, 8 DDR4 channels per socket).
    "gold5320": CpuSpec(0.707e9, 26, "DeepSpeed PR #735: DeepSpeed CPU-Adam updated an 11.6B-param GPT-2 in 8.2 s "
                        "on a 2-socket AVX-512 Xeon server (1.41e9 params/s, 0.707e9 per socket): the "
                        "vectorized CPU Adam of the paper's ZeRO baselines (the paper does not name LoHan's "
                        "kernel); the nearest published rate, not one measured on a Gold 5320"),
}

DEFAULT_CPU = (2, "gold5320")
"""The CPU a description without one is priced with: the paper testbed's (2 sockets of :data:`HARDWARE_PRESETS`
``gold5320``), so described machines are compared on the same optimizer speed unless told otherwise."""

_SSD_RE = re.compile(r"^(\d+)\s*[x×*]\s*(\S+)$")
_ADAM_RE = re.compile(r"^adam=(\S+)$")
_EXAMPLE = ('e.g. "rtx4090, 12xP5510, 256GB, 2xGold5320" (a GPU, SSD count x model, RAM size and optionally the '
            'CPU as sockets x model or adam=PARAMS_PER_S; any order)')


def _known(kind: type) -> str:
    return ", ".join(k for k, v in HARDWARE_PRESETS.items() if isinstance(v, kind))


def parse_hardware(desc: str) -> Hardware:
    """Describe a machine from its parts. SSD bandwidths and capacities add up (striped volume; no
    host-side PCIe ceiling is modelled, so many SSDs are optimistic); the bandwidths are the *effective*
    ones (:class:`SsdSpec`: datasheet x a derating per model, each with its source).

    The CPU (``2xGold5320``: sockets x preset, or ``adam=1.4e9``: a measured AdamW rate in params/s) sets the
    ``cpu`` lane; without one, :data:`DEFAULT_CPU` is used and the name does not mention it.
    ``mem_avail`` is RAM minus :data:`OS_RESERVE`; the engine's own pools come off it later
    (:func:`reserve_engine_pools`), since they depend on the model.
    """
    parts = [p.strip() for p in str(desc).split(",") if p.strip()]
    gpus: list[tuple[str, GpuSpec]] = []
    ssds: list[tuple[int, str, SsdSpec]] = []
    cpus: list[tuple[str, float]] = []
    rams: list[tuple[str, int]] = []
    problems: list[str] = []
    for part in parts:
        key = part.lower().replace(" ", "")
        m, adam = _SSD_RE.match(key), _ADAM_RE.match(key)
        if adam:
            try:
                rate = float(adam.group(1))
            except ValueError:
                rate = 0.0
            if rate > 0:
                cpus.append((f"adam={adam.group(1)}", rate))
            else:
                problems.append(f"{part!r}: adam= takes the params/s a CPU AdamW updates, e.g. adam=1.4e9")
            continue
        if m:
            spec = HARDWARE_PRESETS.get(m.group(2))
            if not isinstance(spec, SsdSpec | CpuSpec):
                problems.append(f"unknown SSD {m.group(2)!r} (known: {_known(SsdSpec)}; or, for the CPU, "
                                f"sockets x one of: {_known(CpuSpec)})")
            elif int(m.group(1)) < 1:
                problems.append(f"{part!r}: the count must be >= 1")
            elif isinstance(spec, CpuSpec):
                cpus.append((f"{m.group(1)}x{m.group(2).capitalize()}", int(m.group(1)) * spec.adam_params_per_s))
            else:
                ssds.append((int(m.group(1)), m.group(2), spec))
            continue
        spec = HARDWARE_PRESETS.get(key)
        if isinstance(spec, GpuSpec):
            gpus.append((key, spec))
            continue
        try:
            rams.append((part.replace(" ", ""), parse_bytes(key)))
        except ValueError:
            problems.append(f"unknown component {part!r} (GPUs: {_known(GpuSpec)}; SSDs: {_known(SsdSpec)}; "
                            f"CPUs: {_known(CpuSpec)})")
    if len(gpus) != 1:
        problems.append(f"give exactly one GPU, got {len(gpus)} (known: {_known(GpuSpec)})")
    if not ssds:
        problems.append("give the SSDs as COUNTxMODEL, e.g. 12xP5510")
    if len(rams) != 1 or rams[0][1] < 10**9:
        problems.append("give the RAM size once, with a unit, e.g. 256GB or 128GiB")
    if len(cpus) > 1:
        problems.append(f"give the CPU at most once, got {len(cpus)}")
    if problems:
        raise ValueError(f"cannot read hardware {desc!r}: " + "; ".join(problems) + f". Write {_EXAMPLE}")
    (gpu_name, gpu), (ram_text, ram) = gpus[0], rams[0]
    cpu_name, adam = cpus[0] if cpus else ("", DEFAULT_CPU[0] * _cpu_preset(DEFAULT_CPU[1]).adam_params_per_s)
    name = ",".join([gpu_name, *(f"{n}x{m.upper()}" for n, m, _ in ssds), ram_text, *([cpu_name] if cpu_name else [])])
    return Hardware(name, gpu.flops, gpu.link_bw, sum(n * s.effective_read for n, _, s in ssds),
                    sum(n * s.effective_write for n, _, s in ssds), ram_budget(ram),
                    gpu.mem, ram, sum(n * s.capacity for n, _, s in ssds), adam, gpu.mem_bw / QUANT_TRAFFIC[0],
                    gpu.mem_bw / QUANT_TRAFFIC[1])


def _cpu_preset(name: str) -> CpuSpec:
    spec = HARDWARE_PRESETS[name]
    assert isinstance(spec, CpuSpec), f"{name} is not a CPU preset"
    return spec
