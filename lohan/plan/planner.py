"""Cost model, Algorithm 1 and capacity planner of traffic-aware activation swapping (DESIGN §4.4-4.5).

Pure policy: no torch and no I/O (except the ``Profile.save``/``load`` JSON helpers), so plans can be
made, printed and tested on any machine. The engine executes a :class:`Plan`; this module never runs one.

Notation, per training step (bytes unless noted; the profile is for the whole step batch):

- ``P`` = ``param_count``; ``p16 = p16_itemsize * P`` (the "2P" of DESIGN: compute-precision params,
  and as many gradient bytes); ``states = (12 + p16_itemsize) * P`` (the "14P": P32, m, v and P16). In a
  compressed state format (`lohan.plan.formats`) the record's 12 bytes are ``Profile.record_bytes`` wherever
  12 appears below, and ``bf16-master`` stores no separate P16 (``Profile.separate_p16``).
- ``S``: the ops swapped in every block. The block inputs are always swapped (nothing inside a block
  can be recomputed without them); everything not in ``S`` is recomputed in backward.
- ``A_G2M(S) = (n_blocks - 1) * (input_bytes + sum(op.bytes for op in S))``: the last block's
  activations stay on the device because backward starts with it, so only n_blocks - 1 blocks move.
  With ``Profile.act_compress = "int8"`` every byte count of a record that leaves the device is its compressed one
  (``OpProfile.bytes_int8``, ``Profile.input_bytes_int8``: int8 codes plus an fp32 scale per row), and the ``gpu``
  lane pays ``R(S) / act_quant_bps`` in forward (quantizing them) and ``R(S) / act_dequant_bps`` in backward
  (dequantizing them), ``R(S) = (n_blocks - 1) * (input_bytes + sum(op.bytes for op in S))`` their raw bytes.
- ``FLOP_r(S) = n_blocks * sum(op.flops for op not in S)``: every block, the last included, recomputes.
- ``alpha = max(0, A_G2M - mem_avail)``: what main memory cannot hold goes on to SSD.

The lanes, each a resource that works in parallel with the others (the time one step keeps it busy):

- ``gpu``: forward ``flop_f / thp_g``; backward ``(2 flop_f + FLOP_r) / thp_g`` (backward is twice the
  forward, plus the recomputation of every op not swapped); with int8 records, plus their quantization (f) and
  dequantization (b).
- ``m2g`` (PCIe host -> device; the link is duplex, so each direction is its own lane): the block
  parameters P16 once in forward and once in backward (recomputation runs on the copy backward loads,
  so it moves nothing more), plus the swapped activations coming back in backward.
- ``g2m`` (PCIe device -> host): the swapped activations in forward; the G16 gradients in backward, which
  active gradient offloading hands to the CPU optimizer block by block.
- ``ssd`` (simplex: its reads and writes add): forward reads P16 and writes the activations main memory
  cannot hold; backward reads P16 again, the optimizer's P32, m, v (``store/states.py``: one record per block,
  ``P32 | m | v | P16``; the optimizer reads the first three and writes the whole record) and the
  overflowed activations, and writes P32, m, v, P16. So per step the SSDs read ``(12 + 2 s) P`` and write
  ``(12 + s) P`` bytes, at the *effective* bandwidths of :class:`Hardware` (see :class:`SsdSpec`); the
  records kept in main memory across steps (``Profile.resident_params``, ``pools.plan_resident``) are
  written but not read: ``12 R`` bytes less, nor is their P16 (copied from the record): ``2 s R`` less; and the
  P16 the parameter pool keeps over a turn
  (``Profile.kept_p16_params``, K) are read in neither pass: backward finds those forward read, the next forward
  those the update handed over: ``2 s K`` bytes less.
- ``cpu`` (backward only): the CPU AdamW, ``P / cpu_adam_params_per_s`` (the fp32 master, m and v
  updated and the P16 copy made). Active gradient offloading (DESIGN §4.3) runs the optimizer of block i
  while the GPU runs backward of block i-1, so it is one more lane of the backward phase. A rate of 0
  (a measured profile that does not know it) leaves the lane out: it reads 0.
- A LoRA step (``Profile.frozen``): the base takes no gradient, so backward's ``gpu`` lane is
  ``(flop_f + FLOP_r) / thp_g`` and ``g2m`` carries no G16; its optimizer fields are zero (``record_bytes`` 0, no
  separate P16, ``update_cost`` 0): no record is read or written and the ``cpu`` lane is empty.

Each phase is a pipeline over the ``n_blocks`` identical blocks: block i is on the SSD, then the link,
then the GPU (then, in backward, the link, the CPU and the SSD again) while its neighbours are on the
other lanes. ``n`` identical items through stages of per-item times ``L_k / n`` take
``max_k L_k + (sum_k L_k - max_k L_k) / n`` (the flow-shop makespan): the slowest lane for the whole
step plus one block's worth of every other lane to fill the pipeline and drain it (in backward: the first
block's backward before any gradient exists, and the last block's AdamW and write after the GPU is
done). That ``fill`` is the non-overlapped head and tail; the paper's equations (DESIGN §4.4) are the
``n -> infinity`` limit. It slightly over-counts the SSD reads of backward, which can run ahead::

    T_f = max(gpu, g2m, m2g, ssd)_f + fill_f
    T_b = max(gpu, g2m, m2g, ssd, cpu)_b + fill_b
    T_iter = T_f + T_b

With a durability interval (``persist_every`` N > 1, the next batch known), a step held in RAM updates the blocks
its backward has not reached in forward order once backward ends, the next forward following them, so that forward
hides under the cpu lane: such a step takes ``max(T_f + T_b0, T_b)`` (``T_b0``: backward without the optimizer),
and ``T_iter`` is the interval's mean, one durable step in N (`_held_iter`).

``t_serial`` is the same step with the optimizer after backward instead of under it (ZeRO-Infinity's
schedule, the engine's ``offload=serial``): backward without the optimizer's lanes, then a phase of
``cpu`` and the optimizer's SSD traffic; its forward reads every P16 (nothing is handed over). ``t_serial / t_iter`` is the gain of active gradient offloading.

Clipping (``engine.max_grad_norm`` > 0) needs the global gradient norm, known only when backward ends. ``T_iter``
is a *speculated* step that did not clip: every block updated at coefficient 1 under backward. Two more steps
are priced, each counted from its backward's start to the next step's (so its forward is the next step's, and
an unclipped step costs ``T_iter``; ``phase(L) = max(L) + (sum(L) - max(L)) / n``, the pipeline above):

- ``t_deferred``, a step whose update waits for the norm (``clip_mode: auto`` after a clipped step, ``defer``,
  and every step with ``slots=1``). Backward runs the lanes ``B0`` of ``t_serial``'s backward (no ``cpu``, the
  SSDs read P16 and the overflow); the SSD time the slowest of them leaves idle, ``idle = max(B0) - B0[ssd]``,
  takes first the READs of the records the read-ahead room holds (``Profile.readahead_params``), then, with
  ``follow`` and ``write_behind`` (two slots: the next batch's forward follows the update block by block, and
  the update's last writes complete during the next backward), the previous step's writes still in flight. The
  update phase ``U`` then runs AdamW over every block with the remaining READs and the writes, and with ``follow``
  (the next batch known; in place too) the next step's forward beside it, whose P16 come straight from the
  update (its ``gpu``, ``g2m`` and ``m2g`` lanes and its overflow writes, no P16 from the SSDs)::

      read  = 12 (P - R) / bw_s2m;  ahead = min(12 RA / bw_s2m, idle);  W = (12 + s) P / bw_m2s
      spill = min(W, idle - ahead) if follow and write_behind else 0
      B_def = B0 + {ssd: ahead + spill}
      U     = {cpu: P / rate, ssd: read - ahead + W - spill}  [+ T_f's gpu, g2m, m2g and alpha / bw_m2s: follow]
      t_deferred = [T_f if not follow] + phase(B_def) + phase(U)

  The model counts the read-ahead under backward only as far as the SSDs are idle there: a READ beyond it would
  lengthen backward by as much as it shortens the update at best, and the read then counts in ``U``. So more
  read-ahead never lengthens ``t_deferred``. It is the cost in steady clipping: after a speculated step no
  write is behind, and the first deferred step is shorter by at most ``spill``. It can undercut ``T_iter`` when
  the SSDs bind: its forward reads no P16 from them.
- ``t_redo``, a speculated step that clipped: ``T_iter``, then the optimizer pass again from the previous slot
  (every record read, resident ones too: their buffers hold the wrong update) with the next forward beside it
  when ``follow``::

      R_redo = {cpu: P / rate, ssd: 12 P / bw_s2m + W}  [+ the next forward's lanes as in U: follow]
      t_redo = T_iter + phase(R_redo) - [T_f if follow]

The gradients a deferred or redone update takes are assumed in main memory (a stash spilled to the SSDs adds its
writes and reads). ``lohan.plan.clipping`` weighs ``t_deferred - T_iter`` against ``t_redo - T_iter`` to choose.

Why Algorithm 1 may stop at the first op that does not help: taking ops by decreasing offload benefit
``OB = flops/bytes`` makes ``FLOP_r`` a convex decreasing piecewise-linear function of ``A_G2M``; every
transfer lane is linear or (through ``alpha``) convex increasing in it, and sums and maxima of convex
functions are convex; the ``cpu`` lane does not depend on it. ``max + (sum - max) / n`` is
``(1 - 1/n) max + sum / n``, a positive combination of convex functions, so the pipeline fill keeps it
convex. So ``T_iter`` along the walk falls, then rises: the first rise is the minimum. With int8 records the walk
takes ops by ``(FLOP_l - thp_g bytes_l (1 / act_quant_bps + 1 / act_dequant_bps)) / bytes_int8_l`` instead (the
FLOPs a swap saves net of the GPU time its quantization and dequantization take, per byte moved): the backward
``gpu`` lane stays convex in ``A_G2M``, and the forward one grows by ``R / act_quant_bps`` nearly linearly (raw /
compressed bytes is about the itemsize for every op), so the first rise is still the minimum up to that. The GPU
time is why int8 records may swap *less* than uncompressed ones where the GPU binds (an op whose FLOPs per byte
are few, such as the QKV projection, costs more to quantize than to recompute there), and more where the links or
the SSDs bind: compression pays only there.

The GPU memory plan (:func:`gpu_need`) counts, part by part, what the engine allocates on the device at a
step's peak; :func:`capacity` holds it to ``Hardware.gpu_mem`` (the free memory, on a detected machine) and
:func:`check_gpu_budget` lets the engine refuse a run with it at run time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from io_engine import durable
from lohan.config import ACT_COMPRESSIONS, ACT_POLICIES, PRESETS, ModelConfig, parse_bytes
from lohan.plan import durability, formats, pools, vocab
from lohan.plan.pools import OPT_CHUNK_BYTES, OS_RESERVE, ram_budget
from lohan.plan.run_plan import RunPlan, plan_run

__all__ = [
    "Hardware", "OpProfile", "Profile", "Estimate", "Plan", "Capacity", "GpuSpec", "SsdSpec", "CpuSpec",
    "POLICIES", "LANES", "LANES_B", "LANE_DOC", "DEFAULT_CPU", "HARDWARE_PRESETS", "OS_RESERVE", "QUANT_TRAFFIC",
    "estimate", "reprice", "WAIT_LANES", "LEGACY_LANES", "upgrade_lanes", "predict_lanes", "SsdCost", "ssd_cost",
    "walk_order", "walk", "algorithm1",
    "forced_plan", "make_plan", "place_tiers", "analytic_profile", "parse_hardware", "engine_pools", "resident_records",
    "reserve_engine_pools", "capacity", "activations_in_ram_capacity", "max_batch", "max_model",
    "gpu_need", "check_gpu_budget", "format_gpu_parts", "GpuMemoryPlanError", "HOST_SHARED_PARTS",
    "CUBLAS_WORKSPACE_BYTES", "CUBLAS_STREAMS", "FRAGMENTATION",
]

POLICIES = ACT_POLICIES
LANES = ("gpu", "g2m", "m2g", "ssd")
"""The forward lanes; backward has these and ``cpu`` (:data:`LANES_B`)."""
LANES_B = (*LANES, "cpu")
LANE_DOC = {
    "gpu": "GPU compute: forward FLOP_f; backward 2 FLOP_f + recomputation, at THP_G; int8 records' (de)quantization",
    "g2m": "PCIe device->host: swapped activations (f), G16 gradients to the CPU optimizer (b)",
    "m2g": "PCIe host->device: block params P16 (f and b; recompute reuses them), activations back (b)",
    "ssd": "SSD, reads + writes (simplex): P16 (f, b); P32,m,v read (but resident records') and P32,m,v,P16 "
           "written (b); activation overflow; effective bandwidth",
    "cpu": "CPU AdamW of every param (P32, m, v, P16 copy), under backward by active gradient offloading",
    "fill": "pipeline head and tail: one block's worth of every lane but the slowest",
}
"""One line per term of the cost model, printed under the plan (see the module docstring)."""
WAIT_LANES = ("param_wait", "provision_wait", "optimizer_tail", "gather", "reduce_wait")
"""What a step's measured lanes (`runtime.step.StepStats.lanes`) record beside :data:`LANES_B`: time the compute
thread waited (for streamed P16 being read or copied in, for the optimizer's update of a block the next forward
follows, for the optimizer pass after backward, for the other ranks), not work."""
LEGACY_LANES = {"compute": "gpu", "cpu_adam": "cpu"}
"""Measured lane names of lohan before the engine reported the cost model's: ``compute`` is ``gpu``, ``cpu_adam``
(AdamW alone) ``cpu``; they had no ``ssd`` (:func:`upgrade_lanes`)."""


def upgrade_lanes(lanes: Mapping[str, float]) -> dict[str, float]:
    """A step's measured lanes in the cost model's vocabulary: an older metrics record or commit note names them
    as :data:`LEGACY_LANES` says, and has no ``ssd``, which is then its reads' and writes' busy time added (the
    SSDs are simplex). Lanes already in the vocabulary are kept as they are."""
    out = {LEGACY_LANES.get(k, k): v for k, v in lanes.items() if not (k in LEGACY_LANES and
                                                                        LEGACY_LANES[k] in lanes)}
    if "ssd" not in out and ("ssd_read" in out or "ssd_write" in out):
        out["ssd"] = out.get("ssd_read", 0.0) + out.get("ssd_write", 0.0)
    return out

_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
GiB = 2**30


def _itemsize(compute_dtype: str) -> int:
    if compute_dtype not in _ITEMSIZE:
        raise ValueError(f"compute_dtype={compute_dtype!r}: choose one of {', '.join(_ITEMSIZE)}")
    return _ITEMSIZE[compute_dtype]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _secs(t: float) -> str:
    return f"{t:.4g}s" if t < 1e4 else f"{t:,.0f}s"


# ------------------------------------------------------------------------------------------ profile

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
class OpProfile:
    """One op of a transformer block: forward FLOPs and output bytes, for one block and the whole batch."""

    name: str
    flops: float
    bytes: int
    bytes_int8: int | None = None
    """Bytes of its outputs in an int8-compressed record (codes and row scales of the tensors worth it, the others
    as they are: `runtime/act_quant.py`); None: not known, priced as ``bytes`` (no saving)."""


@dataclass(frozen=True)
class Profile:
    """Everything the cost model needs about one (model, batch, seq, machine); see the module docstring."""

    model: str
    batch: int
    seq: int
    n_blocks: int  # identical transformer blocks
    ops: tuple[OpProfile, ...]  # of one block, in forward order
    input_bytes: int  # one block's input for the whole batch (A_interBlock per block)
    param_count: int  # P, whole model
    p16_itemsize: int  # bytes per compute-precision param/grad element: 2 (bf16) or 4 (fp32)
    flop_f: float  # forward FLOPs of the whole model per step, embeddings and head included
    hardware: Hardware
    source: str  # "measured" | "analytic"
    resident_params: int = 0  # params whose optimizer records stay in main memory (P32, m, v not read)
    readahead_params: int = 0
    """Params whose records the read-ahead room holds: read during backward ahead of a deferred update
    (``pools.HostMemoryPlan.readahead``), none of them resident."""
    kept_p16_params: int = 0
    """Params whose P16 the parameter pool keeps over a turn (``pools.HostMemoryPlan.params``, all of them for a
    small model): backward finds those forward read, and the next forward those the update during backward handed
    over, so neither reads them from the SSDs. Serial mode hands nothing over: its forward reads every P16."""
    follow: bool = True
    """The next step's forward runs beside a deferred or redone update (the next batch known, as the training
    loop always gives it); False: it starts after the update."""
    write_behind: bool = True
    """The writes still in flight when a deferred update ends complete during the next backward (two slots, one
    process: `engine.write_behind`); False with ``slots=1``, whose step is committed only once written."""
    record_bytes: float = 12.0
    """Bytes per parameter of the optimizer record the update reads and writes: 12 (P32, m, v in fp32, the
    ``exact`` state format); less in a compressed one (`lohan.plan.formats.StateFormat.record`)."""
    separate_p16: bool = True
    """Whether the P16 copy is stored (and written each step) beside the record; False for ``bf16-master``, whose
    master is the copy the compute reads, and for ``exact`` states computed in fp32 (`StateFormat.keeps_p16`)."""
    update_cost: float = 1.0
    """The CPU update's time per parameter relative to exact's AdamW (`lohan.plan.formats.StateFormat.update_cost`)."""
    persist_every: int = 1
    """Steps per durable commit where every record is resident (`engine.persist_every`): the records are written
    once in that many steps, so a step's share of their writes is ``states / persist_every``."""
    input_bytes_int8: int | None = None
    """``input_bytes`` in an int8-compressed record; None: not known, priced as ``input_bytes``."""
    act_compress: str = "none"
    """``int8``: records that leave the device are compressed (``EngineConfig.act_compress``): the transfer lanes
    and the tiers count ``bytes_int8``, and the ``gpu`` lane pays their quantization (module docstring)."""
    frozen: bool = False
    """A LoRA step's (`lohan.runtime.lora_engine`): the weights take no gradient, so backward computes the inputs'
    gradients only (``flop_f`` instead of ``2 flop_f``, plus the recomputation) and sends no G16 to the host. Its
    optimizer fields are zero: ``record_bytes`` 0, no separate P16, ``update_cost`` 0."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        names = [op.name for op in self.ops]
        problems = []
        if len(set(names)) != len(names):
            problems.append(f"op names must be unique (swap sets are named): {names}")
        if self.n_blocks < 1:
            problems.append(f"n_blocks={self.n_blocks} must be >= 1")
        if not 0 <= self.resident_params <= self.param_count:
            problems.append(f"resident_params={self.resident_params} must be in [0, param_count]")
        if not (isinstance(self.persist_every, int) and self.persist_every >= 1):
            problems.append(f"persist_every={self.persist_every!r} must be an int >= 1")
        if not 0 <= self.kept_p16_params <= self.param_count:
            problems.append(f"kept_p16_params={self.kept_p16_params} must be in [0, param_count]")
        if not 0 <= self.readahead_params <= self.param_count - max(0, self.resident_params):
            problems.append(f"readahead_params={self.readahead_params} must be in [0, param_count - resident_params]")
        if any(op.flops < 0 or op.bytes < 0 or (op.bytes_int8 or 0) < 0 for op in self.ops) or self.input_bytes < 0:
            problems.append("op flops/bytes and input_bytes must be >= 0")
        if self.act_compress not in ACT_COMPRESSIONS:
            problems.append(f"act_compress={self.act_compress!r} must be none or int8")
        if problems:
            raise ValueError(f"invalid profile {self.model!r}: " + "; ".join(problems))

    @property
    def p16(self) -> int:
        return self.p16_itemsize * self.param_count

    def swap_bytes(self, op: OpProfile) -> int:
        """Bytes op's outputs take on the swap tiers (and on the link): compressed ones with ``act_compress``."""
        return op.bytes_int8 if self.act_compress == "int8" and op.bytes_int8 is not None else op.bytes

    @property
    def swap_input_bytes(self) -> int:
        """``input_bytes`` as a record that leaves the device carries it."""
        compressed = self.act_compress == "int8" and self.input_bytes_int8 is not None
        return self.input_bytes_int8 if compressed else self.input_bytes

    def quant_seconds(self, raw_bytes: float) -> tuple[float, float]:
        """GPU seconds to quantize and to dequantize ``raw_bytes`` of records; 0 without compression or a rate."""
        hw = self.hardware
        if self.act_compress != "int8" or not hw.act_quant_bps:
            return 0.0, 0.0
        return raw_bytes / hw.act_quant_bps, raw_bytes / (hw.act_dequant_bps or hw.act_quant_bps)

    @property
    def states(self) -> int:
        return round((self.record_bytes + (self.p16_itemsize if self.separate_p16 else 0)) * self.param_count)

    @property
    def states_written(self) -> float:
        """Record bytes a step writes, on average: all of them each durable step (`persist_every`)."""
        return self.states / max(1, self.persist_every)

    def key(self) -> str:
        # The itemsize is part of the key: a bf16 and an fp32 profile of one run differ in every byte count.
        raw = f"{self.model}-b{self.batch}-s{self.seq}-w{self.p16_itemsize}-{self.hardware.name}"
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Profile:
        """The profile `to_dict` gave (a saved file's own checksum, if `d` has it, is not a field)."""
        return Profile(**{**{k: v for k, v in d.items() if k != durable.CHECKSUM},
                          "ops": tuple(OpProfile(**op) for op in d["ops"]), "hardware": Hardware.from_dict(d["hardware"])})

    def save(self, path: str | Path) -> None:
        """Write with a checksum, atomically and durably (`io_engine.durable`): a resumed run reuses the profile,
        so it is never half-written, and a damaged one is known as such."""
        durable.write_json_atomic(path, self.to_dict(), indent=2)

    @staticmethod
    def load(path: str | Path) -> Profile:
        """Read a profile `save` wrote. ProfileError, naming the file, when it is not JSON, carries no checksum
        (a profile saved before they were written, or one whose key was damaged), its checksum does not match, or
        its fields are not a profile's; OSError when it cannot be read."""
        data, problem = durable.load_json(path)
        problem = problem or durable.checksum_problem(data) or durable.dataclass_problem(Profile, data)
        if problem is None:
            try:
                return Profile.from_dict(data)
            except (TypeError, ValueError) as e:  # values a profile cannot have (__post_init__)
                problem = str(e)
        raise ProfileError(f"{path} (an activation profile) is damaged: {problem}")


class ProfileError(ValueError):
    """A saved profile that cannot be used (`Profile.load`): damaged, or saved without a checksum."""


# -------------------------------------------------------------------------------------- cost model

@dataclass(frozen=True)
class Estimate:
    """Predicted step time of one swap set, with every lane's time so the bottleneck can be read off."""

    swap: tuple[str, ...]
    a_g2m: int
    flop_r: float
    alpha_bytes: int
    t_f: float
    t_b: float
    t_iter: float
    lanes_f: dict[str, float]
    lanes_b: dict[str, float]
    bottleneck_f: str
    bottleneck_b: str
    fill_f: float = 0.0
    """Pipeline head and tail of forward, included in ``t_f`` (module docstring)."""
    fill_b: float = 0.0
    """Pipeline head and tail of backward, included in ``t_b``."""
    t_serial: float = 0.0
    """The step with the optimizer after backward (ZeRO-Infinity's schedule) instead of under it."""
    traffic: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bytes per step: ``m2g``/``g2m`` over PCIe, ``ssd_read``/``ssd_write``; ``adam_params`` updated."""
    t_deferred: float = 0.0
    """A clipped step: its update waits for the global norm (module docstring). 0: not priced (an old estimate)."""
    t_redo: float = 0.0
    """A speculated step that clipped: ``t_iter`` and its optimizer pass redone after backward."""
    read_ahead_bytes: int = 0
    """P32, m, v bytes the read-ahead room holds (``12 * Profile.readahead_params``), read ahead of a deferred update."""
    a_g2m_raw: int = 0
    """``a_g2m`` as the device holds those records before compression (= ``a_g2m`` without it)."""
    quant_s: float = 0.0
    """GPU seconds the forward ``gpu`` lane spends quantizing int8 records."""
    dequant_s: float = 0.0
    """GPU seconds the backward ``gpu`` lane spends dequantizing them."""
    lanes_serial: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds each lane is busy in a whole step of the serial schedule (``t_serial``): forward, backward and the
    update after it. Empty: not priced (an old estimate)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Estimate:
        return Estimate(**{**d, "swap": tuple(d["swap"])})

    def step_lanes(self, mode: str = "optimized") -> dict[str, float]:
        """Seconds each lane (:data:`LANES_B`) is busy in a whole step of the engine's ``mode``: forward and
        backward added, as the engine measures them (`runtime.step.StepStats.lanes`). ``naive`` and ``optimized``
        do the same work in another order; ``serial`` reads every P16 from the SSDs in forward (nothing is handed
        over) and runs the update after backward."""
        if mode == "serial" and self.lanes_serial:
            return dict(self.lanes_serial)
        return {k: self.lanes_f.get(k, 0.0) + self.lanes_b.get(k, 0.0) for k in LANES_B}

    def format_lanes(self, clip: bool = True, defer: bool = False) -> str:
        """Seconds each lane is busy per step, forward and backward, one line per term, and the bottleneck; then
        what clipping costs (``clip``: the run clips), what an update after backward costs with clipping off
        (``defer``: the run may defer one, `pools.may_defer_unclipped`) and the optimizer after backward (serial
        mode)."""
        lines = [f"{'lane':<6}{'forward':>10}{'backward':>10}  term"]
        for lane in LANES_B:
            f, b = self.lanes_f.get(lane), self.lanes_b.get(lane)
            cell_f = "-" if f is None else _secs(f)
            cell_b = "-" if b is None else _secs(b)
            phases = "/".join(ph for ph, slow in (("f", self.bottleneck_f), ("b", self.bottleneck_b)) if slow == lane)
            mark = f"  <- bottleneck ({phases})" if phases else ""
            lines.append(f"{lane:<6}{cell_f:>10}{cell_b:>10}  {LANE_DOC[lane]}{mark}")
        lines.append(f"{'fill':<6}{_secs(self.fill_f):>10}{_secs(self.fill_b):>10}  {LANE_DOC['fill']}")
        lines.append(f"T_f = {_secs(self.t_f)} (bottleneck {self.bottleneck_f}), T_b = {_secs(self.t_b)} "
                     f"(bottleneck {self.bottleneck_b}), T_iter = {_secs(self.t_iter)}")
        lines += self._clip_lines(clip, defer)
        return "\n".join(lines)

    def _clip_lines(self, clip: bool, defer: bool = False) -> list[str]:
        """What clipping costs (when the run clips and the estimate prices it), or an update after backward with
        clipping off, and the serial schedule's step."""
        def ratio(t: float) -> str:
            return f"{_secs(t)} ({t / self.t_iter:.2f}x)" if self.t_iter else _secs(t)
        lines = []
        if clip and self.t_deferred:
            ahead = f"{_gb(self.read_ahead_bytes)} read ahead" if self.read_ahead_bytes else "no read-ahead room"
            lines += [f"clipping: a step whose update waits for the global norm ({ahead} during backward) takes "
                      f"{ratio(self.t_deferred)};",
                      f"          a speculated step that clipped after all (its optimizer pass redone) "
                      f"{ratio(self.t_redo)}; one that did not clip, T_iter"]
        elif defer and self.t_deferred:
            lines.append(f"clipping off: an update after backward, beside the next forward, takes "
                         f"{ratio(self.t_deferred)}; clip_mode auto runs it there where it measures faster than "
                         "under backward (T_iter)")
        if self.t_serial:
            lines.append(f"optimizer after backward (serial mode): {ratio(self.t_serial)}")
        return lines


def _pipeline(lanes: Mapping[str, float], n_blocks: int) -> tuple[float, float]:
    """(slowest lane, fill): ``n_blocks`` identical blocks through the lanes take ``max + (sum - max) / n``."""
    slowest = max(lanes.values())
    return slowest, (sum(lanes.values()) - slowest) / max(1, n_blocks)


def _phase(lanes: Mapping[str, float], n_blocks: int) -> float:
    """A phase's time: its pipeline's slowest lane plus the fill."""
    return sum(_pipeline(lanes, n_blocks))


def _clipped(profile: Profile, lanes_f: Mapping[str, float], serial_b: Mapping[str, float], cpu: float,
             alpha: int, t_f: float, t_iter: float) -> tuple[float, float]:
    """(t_deferred, t_redo), the module docstring's equations: ``serial_b`` is backward without the optimizer
    (``B0``), ``cpu`` the AdamW lane, ``alpha`` the activation overflow."""
    hw, n, p = profile.hardware, profile.n_blocks, profile.param_count
    writes = profile.states_written / hw.bw_m2s
    read = profile.record_bytes * (p - profile.resident_params) / hw.bw_s2m
    idle = max(serial_b.values()) - serial_b["ssd"]
    # READs issued ahead fill the SSD time backward leaves idle; write-behind (with follow) takes what they leave
    ahead = min(profile.record_bytes * profile.readahead_params / hw.bw_s2m, idle)
    spill = min(writes, idle - ahead) if profile.follow and profile.write_behind else 0.0
    backward = {**serial_b, "ssd": serial_b["ssd"] + ahead + spill}
    # with follow, the next forward runs beside the update: its P16 come from it, not from the SSDs
    beside = {k: lanes_f[k] for k in ("gpu", "g2m", "m2g")} if profile.follow else {}
    overflow = alpha / hw.bw_m2s if profile.follow else 0.0
    update = {**beside, "cpu": cpu, "ssd": read - ahead + writes - spill + overflow}
    t_deferred = (0.0 if profile.follow else t_f) + _phase(backward, n) + _phase(update, n)
    # a redo reads every record from the previous slot: resident buffers hold the speculated update
    redo = {**beside, "cpu": cpu, "ssd": profile.record_bytes * p / hw.bw_s2m + writes + overflow}
    t_redo = t_iter + _phase(redo, n) - (t_f if profile.follow else 0.0)
    return t_deferred, t_redo


def _evaluate(profile: Profile, swap: tuple[str, ...], a_g2m: int, flop_r: float, a_raw: int | None = None
              ) -> Estimate:
    """The lanes of one swap set: ``a_g2m`` bytes leave the device as the tiers hold them, ``a_raw`` as the device
    made them (quantized on the way out with int8 records; None: the same bytes)."""
    hw = profile.hardware
    a_raw = a_g2m if a_raw is None else a_raw
    quant, dequant = profile.quant_seconds(a_raw)
    p16, states, n = profile.p16, profile.states_written, profile.n_blocks
    # P32, m, v: what the optimizer reads of each record, but of those kept in memory across steps
    opt_read = profile.record_bytes * (profile.param_count - profile.resident_params)
    alpha = max(0, a_g2m - hw.mem_avail)
    cpu = profile.update_cost * profile.param_count / hw.cpu_adam_params_per_s if hw.cpu_adam_params_per_s else 0.0
    # P16 read from the SSDs in each pass: what the parameter pool does not keep over the turn, and not a resident
    # record's (copied from the record: `runtime.params.ParamStreamer.prefetch`) (Profile)
    p = max(1, profile.param_count)
    p16_read = p16 * max(0.0, 1 - (profile.kept_p16_params + profile.resident_params) / p)
    lanes_f = {"gpu": profile.flop_f / hw.thp_g + quant, "g2m": a_g2m / hw.bw_g, "m2g": p16 / hw.bw_g,
               "ssd": p16_read / hw.bw_s2m + alpha / hw.bw_m2s}
    grads = 0 if profile.frozen else p16  # G16 to the host (none: frozen weights)
    lanes_b = {"gpu": ((1 if profile.frozen else 2) * profile.flop_f + flop_r) / hw.thp_g + dequant,
               "g2m": grads / hw.bw_g,
               "m2g": (p16 + a_g2m) / hw.bw_g, "ssd": (p16_read + opt_read + alpha) / hw.bw_s2m + states / hw.bw_m2s,
               "cpu": cpu}
    (slow_f, fill_f), (slow_b, fill_b) = _pipeline(lanes_f, n), _pipeline(lanes_b, n)
    t_f, t_b = slow_f + fill_f, slow_b + fill_b
    # The optimizer after backward: backward keeps its own traffic, then the optimizer's lanes run alone; its
    # forward reads every P16 but the resident records' (nothing handed over)
    serial_f = {**lanes_f, "ssd": p16 * (1 - profile.resident_params / p) / hw.bw_s2m + alpha / hw.bw_m2s}
    serial_b = {**lanes_b, "cpu": 0.0, "ssd": (p16_read + alpha) / hw.bw_s2m}
    serial_opt = {"cpu": cpu, "ssd": opt_read / hw.bw_s2m + states / hw.bw_m2s}
    t_serial = sum(_pipeline(serial_f, n)) + _phase(serial_b, n) + _phase(serial_opt, n)
    lanes_serial = {k: serial_f.get(k, 0.0) + serial_b.get(k, 0.0) + serial_opt.get(k, 0.0) for k in LANES_B}
    t_iter = _held_iter(profile, t_f, t_b, _phase(serial_b, n))
    t_deferred, t_redo = _clipped(profile, lanes_f, serial_b, cpu, alpha, t_f, t_iter)
    traffic = {"m2g": 2.0 * p16 + a_g2m, "g2m": float(a_g2m + grads),
               "ssd_read": float(2 * p16_read + opt_read + alpha), "ssd_write": float(states + alpha),
               "adam_params": float(profile.param_count)}
    return Estimate(swap, a_g2m, flop_r, alpha, t_f, t_b, t_iter, lanes_f, lanes_b,
                    max(LANES, key=lanes_f.__getitem__), max(LANES_B, key=lanes_b.__getitem__),
                    fill_f, fill_b, t_serial, traffic, t_deferred, t_redo,
                    int(profile.record_bytes * profile.readahead_params), a_raw, quant, dequant, lanes_serial)


def _held_iter(profile: Profile, t_f: float, t_b: float, t_b0: float) -> float:
    """``T_iter`` on average over a durability interval: a durable step ``T_f + T_b``; a step between durable ones
    (held in RAM, the next batch known) updates in backward order while gradients come and the rest in forward order
    with the next forward following (`runtime.step.StepPlan.tail_follows`), so that forward hides under the cpu
    lane's tail: ``max(T_f + T_b0, T_b)``, ``T_b0`` being backward without the optimizer."""
    every = max(1, profile.persist_every)
    if every == 1 or not profile.follow:
        return t_f + t_b
    held = max(t_f + t_b0, t_b)
    return ((every - 1) * held + t_f + t_b) / every


def reprice(est: Estimate, profile: Profile) -> Estimate:
    """`est`'s point (its swap set, its bytes on each tier) priced again on `profile`: what a profile refined by
    the run's own measurements (the optimizer's CPU rate in its steps) says of the same plan."""
    return _evaluate(profile, est.swap, est.a_g2m, est.flop_r, est.a_g2m_raw)


def estimate(profile: Profile, swap: Sequence[str]) -> Estimate:
    """Cost of swapping the block inputs plus the ops named in ``swap`` in every block."""
    by_name = {op.name: op for op in profile.ops}
    unknown = [s for s in swap if s not in by_name]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; valid ops are: {', '.join(by_name)}")
    chosen = tuple(dict.fromkeys(swap))
    moved = profile.n_blocks - 1
    a_g2m = moved * (profile.swap_input_bytes + sum(profile.swap_bytes(by_name[s]) for s in chosen))
    a_raw = moved * (profile.input_bytes + sum(by_name[s].bytes for s in chosen))
    flop_r = profile.n_blocks * sum(op.flops for op in profile.ops if op.name not in chosen)
    return _evaluate(profile, chosen, a_g2m, flop_r, a_raw)


def walk_order(profile: Profile) -> list[OpProfile]:
    """Ops by decreasing offload benefit ``flops/bytes``; ties keep forward order. With int8 records, the FLOPs net
    of the quantization's GPU time per compressed byte (module docstring).

    Ops with no output bytes come first: swapping them moves nothing, so it can only save recomputation.
    """
    flops_per_s = profile.hardware.thp_g

    def key(item: tuple[int, OpProfile]) -> tuple[int, float, int]:
        i, op = item
        if op.bytes == 0:
            return (0, 0.0, i)
        net = op.flops - flops_per_s * sum(profile.quant_seconds(op.bytes))  # quantized forward, dequantized back
        return (1, -net / max(1, profile.swap_bytes(op)), i)
    return [op for _, op in sorted(enumerate(profile.ops), key=key)]


def walk(profile: Profile) -> list[Estimate]:
    """Point 0 swaps the block inputs only; point k adds the first k ops of :func:`walk_order`."""
    names = [op.name for op in walk_order(profile)]
    return [estimate(profile, names[:k]) for k in range(len(names) + 1)]


# ------------------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class Plan:
    """What to swap in every block, where each block's activation record lives, and the predicted cost.

    ``block_tiers[i]`` is where block i's record (its input plus its swapped op outputs) stays between
    forward and backward: ``keep`` (device), ``cpu`` or ``ssd``. ``points`` is the whole walk. ``block_bytes`` is
    a record as the ``cpu`` and ``ssd`` tiers hold it (compressed, with int8 records); ``cpu_bytes`` and
    ``ssd_bytes`` are those tiers' totals.
    """

    policy: str
    swap: tuple[str, ...]
    block_tiers: tuple[str, ...]
    estimate: Estimate
    points: tuple[Estimate, ...]
    chosen: int
    case: int
    block_bytes: int
    cpu_bytes: int
    ssd_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        return Plan(**{**d, "swap": tuple(d["swap"]), "block_tiers": tuple(d["block_tiers"]),
                       "estimate": Estimate.from_dict(d["estimate"]),
                       "points": tuple(Estimate.from_dict(p) for p in d["points"])})

    def tier_summary(self) -> str:
        """Runs of equal tiers, e.g. ``blocks 0-3: ssd, 4-10: cpu, 11: keep``."""
        runs, start = [], 0
        for tier, group in itertools.groupby(self.block_tiers):
            end = start + len(list(group)) - 1
            runs.append(f"{start}{'' if end == start else f'-{end}'}: {tier}")
            start = end + 1
        return "blocks " + ", ".join(runs)

    def format_table(self, clip: bool = True, defer: bool = False) -> str:
        """The walk, the tiers and the chosen point's lanes; ``clip``: the run clips, ``defer``: clipping off, it may
        update after backward (:meth:`Estimate.format_lanes`)."""
        rows = self.points or (self.estimate,)
        head = (f"{'':2}{'#':>2}  {'swap (cumulative)':<18}{'A_G2M':>11}{'to SSD':>11}{'FLOP_r':>12}"
                f"{'T_f':>10}{'T_b':>10}{'T_iter':>10}  bottleneck f/b")
        lines = [f"policy {self.policy}: " + ("Algorithm 1 walk" if self.points else "forced"), head]
        prev: tuple[str, ...] = ()
        for i, e in enumerate(rows):
            if not self.points:
                label = self.policy
            elif not e.swap:
                label = "inputs only"
            else:  # a walk: show what this point adds to the previous one
                label = "+" + ",".join(n for n in e.swap if n not in prev)
            prev = e.swap
            mark = "*" if (i == self.chosen or not self.points) else " "
            lines.append(f"{mark:<2}{i:>2}  {label:<18}{_gb(e.a_g2m):>11}{_gb(e.alpha_bytes):>11}"
                         f"{e.flop_r / 1e12:>9.2f} TF{_secs(e.t_f):>10}{_secs(e.t_b):>10}{_secs(e.t_iter):>10}"
                         f"  {e.bottleneck_f}/{e.bottleneck_b}")
        swapped = ", ".join(("inputs", *self.swap)) if self.policy != "recompute-all" else "nothing"
        lines.append(f"swapped in every block: {swapped}; {_gb(self.block_bytes)} per block record")
        est = self.estimate
        if est.a_g2m_raw > est.a_g2m:
            lines.append(f"int8 records: {_gb(est.a_g2m)} leave the device per step instead of {_gb(est.a_g2m_raw)}; "
                         f"quantizing them takes {_secs(est.quant_s)} of the gpu lane in forward, dequantizing them "
                         f"{_secs(est.dequant_s)} in backward" + ("" if est.quant_s else " (rate unknown: not priced)"))
        lines.append(f"{self.tier_summary()} (cpu {_gb(self.cpu_bytes)}, ssd {_gb(self.ssd_bytes)})")
        lines.append(_CASES.get(self.case, "") or f"forced policy {self.policy!r} (not chosen by Algorithm 1)")
        lines.append("lanes of the chosen point (seconds each resource is busy per step):")
        lines += ["  " + line for line in self.estimate.format_lanes(clip, defer).splitlines()]
        return "\n".join(lines)


_CASES = {
    1: "case 1 (PCIe/SSD-bound): any op swapped beyond the block inputs would lengthen the step, "
       "so only the block inputs are swapped and the rest is recomputed",
    2: "case 2 (compute-bound): every op that costs FLOPs to recompute is swapped",
    3: "case 3 (interior optimum): swapping stops where the transfer lanes would cost more than "
       "the recomputation they save",
}


def place_tiers(n_blocks: int, block_bytes: int, mem_avail: int, policy: str) -> tuple[str, ...]:
    """Where each block's record lives: last block ``keep``; earliest blocks ``ssd``, the rest ``cpu``.

    The earliest blocks are read back last in backward, so their slower SSD reads get the most time
    to prefetch. Placement is by whole blocks, so the SSD share may exceed the cost model's alpha by
    less than one block record.
    """
    if policy == "recompute-all":
        return ("keep",) * n_blocks
    movable = n_blocks - 1
    fit = movable if block_bytes <= 0 else max(0, mem_avail) // block_bytes
    k_ssd = max(0, movable - fit)
    return ("ssd",) * k_ssd + ("cpu",) * (movable - k_ssd) + ("keep",)


def _plan(profile: Profile, policy: str, est: Estimate, points: Sequence[Estimate] = (),
          chosen: int = -1, case: int = 0) -> Plan:
    # what one record of a block that leaves the device takes on its tier (compressed with int8 records)
    sizes = {op.name: profile.swap_bytes(op) for op in profile.ops}
    block_bytes = profile.swap_input_bytes + sum(sizes[s] for s in est.swap)
    tiers = place_tiers(profile.n_blocks, block_bytes, profile.hardware.mem_avail, policy)
    return Plan(policy, est.swap, tiers, est, tuple(points), chosen, case, block_bytes,
                tiers.count("cpu") * block_bytes, tiers.count("ssd") * block_bytes)


def algorithm1(profile: Profile) -> Plan:
    """DESIGN's Algorithm 1: walk ops by decreasing OB from interblock; stop at the first non-improvement.

    Case 1: no op with bytes and FLOPs is taken (PCIe/SSD-bound). Case 2: every such op is taken
    (compute-bound; zero-FLOP ops such as LayerNorm recompute for free, so they never help). Case 3: between.
    """
    order = walk_order(profile)
    points = walk(profile)
    # Zero-byte ops lead the order and never raise T_iter; taking them keeps a zero-FLOP one from
    # stopping the walk at a flat step before it reaches the ops that matter.
    k = sum(op.bytes == 0 for op in order)
    while k < len(order) and points[k + 1].t_iter < points[k].t_iter:
        k += 1
    taken = {op.name for op in order[:k]}
    useful = [op.name for op in order if op.flops > 0 and op.bytes > 0]
    if useful and all(n in taken for n in useful):
        case = 2
    elif not any(n in taken for n in useful):
        case = 1
    else:
        case = 3
    return _plan(profile, "plan", points[k], points, k, case)


def forced_plan(profile: Profile, policy: str) -> Plan:
    """Baseline policies: ``recompute-all`` (nothing leaves the device), ``interblock``
    (ZeRO-Infinity: block inputs only) and ``swap-all`` (G10: every op)."""
    if policy == "recompute-all":
        est = _evaluate(profile, (), 0, profile.n_blocks * sum(op.flops for op in profile.ops))
    elif policy == "interblock":
        est = estimate(profile, ())
    elif policy == "swap-all":
        est = estimate(profile, [op.name for op in profile.ops])
    else:
        raise ValueError(f"unknown forced policy {policy!r}; choose one of {', '.join(POLICIES[1:])}")
    return _plan(profile, policy, est)


def ops_plan(profile: Profile, ops: Sequence[str]) -> Plan:
    """Swap the block inputs and exactly ``ops`` in every block (ablations, sweeps): policy ``ops:a,b``."""
    est = estimate(profile, ops)
    return _plan(profile, "ops:" + ",".join(est.swap), est)


def make_plan(profile: Profile, policy: str) -> Plan:
    """``plan`` runs :func:`algorithm1`; the other :data:`POLICIES` are :func:`forced_plan`;
    ``ops:NAME,NAME`` is :func:`ops_plan`."""
    if policy.startswith("ops:"):
        return ops_plan(profile, [n.strip() for n in policy[4:].split(",") if n.strip()])
    if policy not in POLICIES:
        raise ValueError(f"unknown activation policy {policy!r}; choose one of {', '.join(POLICIES)} "
                         "or ops:NAME,NAME")
    return algorithm1(profile) if policy == "plan" else forced_plan(profile, policy)


# ------------------------------------------------------------------------------- analytic profile

def analytic_profile(cfg: ModelConfig, batch: int, seq: int, hw: Hardware,
                     compute_dtype: str = "bf16") -> Profile:
    """Formula profile of the GPT block (pre-LN), counted the way ``FlopCounterMode`` counts.

    A matmul is ``2·M·N·K``; SDPA is ``4·B·T²·d`` (no causal discount); LayerNorm and GELU are 0.
    Bytes are op outputs; LayerNorm also returns fp32 mean and rstd, SDPA an fp32 logsumexp per head.
    int8 bytes: a byte per value plus a 4-byte scale per row of the last dim (a head's ``d / n_head`` values for
    the attention output, a head's ``seq`` for its logsumexp); mean and rstd, one value per row, stay fp32.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch={batch} and seq={seq} must be >= 1")
    if seq > cfg.seq_len:
        raise ValueError(f"seq={seq} exceeds the model's {cfg.seq_len} position embeddings")
    s = _itemsize(compute_dtype)
    n, d, h, heads = batch * seq, cfg.d_model, cfg.mlp_hidden, cfg.n_head

    def int8(rows: int, cols: int) -> int:
        return rows * cols + 4 * rows

    ln, ln8 = n * d * s + 2 * n * 4, int8(n, d) + 2 * n * 4
    attn8 = int8(n * heads, d // heads) + int8(batch * heads, seq)
    ops = (
        OpProfile("ln1", 0.0, ln, ln8),
        OpProfile("qkv", 2.0 * n * d * 3 * d, 3 * n * d * s, int8(n, 3 * d)),
        OpProfile("attn", 4.0 * batch * seq * seq * d, n * d * s + batch * heads * seq * 4, attn8),
        OpProfile("proj", 2.0 * n * d * d, n * d * s, int8(n, d)),
        OpProfile("ln2", 0.0, ln, ln8),
        OpProfile("fc", 2.0 * n * d * h, n * h * s, int8(n, h)),
        OpProfile("act", 0.0, n * h * s, int8(n, h)),
        OpProfile("fc_proj", 2.0 * n * h * d, n * d * s, int8(n, d)),
    )
    # flops_per_token is forward-only and counts exactly these matmuls plus the LM head.
    return Profile(cfg.name, batch, seq, cfg.n_layer, ops, n * d * s, cfg.param_count(), s,
                   float(cfg.flops_per_token(seq)) * n, hw, "analytic", input_bytes_int8=int8(n, d))


# -------------------------------------------------------------------------------------- hardware

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
    "figures are what it sustains; lohan's I/O path reaches fio on O_DIRECT (benchmarks/results/io_bench_quick.md: "
    "engine/fio >= 1.0); reads and writes of a step are priced as adding up (simplex), and the engine's mixed "
    "traffic on this project's disk moved more than that predicts (benchmarks/results/ago_bench.md). "
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


# ------------------------------------------------------------------------------ capacity planner

def engine_pools(cfg: ModelConfig, compute_dtype: str = "bf16", prefetch_depth: int = 2,
                 max_inflight: int = 3, micro_batches: int = 1, block_grads: bool = True,
                 opt_chunk_bytes: int = OPT_CHUNK_BYTES, resident: bool = True) -> dict[str, int]:
    """Main-memory pools of the engine for a model: ``pools.plan_host_memory`` (the engine's own function) on the
    model's blocks (``pools.model_geometry``), without the 4 KiB padding of each buffer.

    params: current + k prefetched + k kept over the forward/backward turn + a borrowed tied block, at most every
    block; grads: two block buffers (one filling, one queued; ``pools.grad_dtype``; ``block_grads=False``: none,
    for a design that counts the gradients itself);
    optimizer: ``max_inflight`` records of the largest block, or of an ``opt_chunk_bytes`` chunk when records are
    bigger, with ``resident`` records no more than the records bigger than the streamed ones plus ``max_inflight``
    of those (a tied embedding stays: one buffer for it instead of ``max_inflight``), and the fp32 scratch bf16
    gradients are upcast into. Without clipping, resident_mem or a gradient stash (see :func:`capacity`).
    """
    ecfg = pools.pool_config(compute_dtype, micro_batches, prefetch_depth, max_inflight, resident=resident,
                             opt_chunk_bytes=opt_chunk_bytes)
    plan = pools.plan_host_memory(pools.model_geometry(cfg, compute_dtype), ecfg, check=False)
    return {"params": plan.params, "grads": plan.grads if block_grads else 0,
            "optimizer": plan.records + plan.upcast}


def _ram_budget(hw: Hardware) -> int:
    # A measured Hardware may not know the RAM size; its mem_avail is then the whole budget.
    return ram_budget(hw.ram) if hw.ram else hw.mem_avail


def reserve_engine_pools(hw: Hardware, cfg: ModelConfig, **pool_args: Any) -> Hardware:
    """``hw`` with ``mem_avail`` = RAM budget minus :func:`engine_pools` (what is left for activations)."""
    return dataclasses.replace(hw, mem_avail=max(0, _ram_budget(hw) - sum(engine_pools(cfg, **pool_args).values())))


@dataclass(frozen=True)
class Capacity:
    """Whether a (model, batch, seq) fits a machine, what each tier needs, and why not if it does not."""

    design: str
    model: str
    batch: int
    seq: int
    hardware: str
    fits: bool
    reasons: tuple[str, ...]
    gpu_bytes: int
    cpu_bytes: int
    ssd_bytes: int
    ssd_states_bytes: int
    ssd_act_bytes: int
    plan: Plan
    gpu_parts: dict[str, int]
    cpu_parts: dict[str, int]
    limits: dict[str, int]
    persist_every: int = 1
    """Steps per durable commit of the records (`engine.persist_every` as it applies to this plan: 1 unless every
    record is resident)."""
    persist_note: str = ""
    """Why ``persist_every`` is 1 where the run asked for more or ``auto``."""
    over_cpu_mem: bool = False
    """The engine's pools exceed ``cpu_mem`` (its refusal is the first reason), though the machine's RAM may not."""

    def format(self) -> str:
        def row(tier: str, need: int, parts: Mapping[str, int]) -> str:
            limit = self.limits[tier]
            verdict = "not checked (size unknown)" if not limit else "ok" if need <= limit else "TOO BIG"
            if tier == "cpu" and self.over_cpu_mem and need <= limit:  # RAM would hold it, cpu_mem does not
                verdict = "over cpu_mem"
            detail = ", ".join(f"{k} {_gb(v)}" for k, v in parts.items())
            return f"  {tier:<4}{_gb(need):>12} of {_gb(limit):>11}  {verdict:<8} ({detail})"
        lines = [f"{self.design}: {self.model}, batch {self.batch} x seq {self.seq} on {self.hardware}",
                 row("gpu", self.gpu_bytes, self.gpu_parts), row("cpu", self.cpu_bytes, self.cpu_parts),
                 row("ssd", self.ssd_bytes, {"states": self.ssd_states_bytes, "activations": self.ssd_act_bytes}),
                 f"  activations: {self.plan.tier_summary()}",
                 "  => fits" if self.fits else "  => does NOT fit:"]
        lines += [f"     - {r}" for r in self.reasons]
        return "\n".join(lines)


CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS workspace per (handle, stream) pair, taken from the caching allocator: PyTorch's default
``CUBLAS_WORKSPACE_CONFIG`` on Hopper is ``:4096:8`` (8 chunks of 4096 KiB); older GPUs get less
(``:4096:2:16:8``, ~8 MiB), so this bounds them too (PyTorch ``aten/src/ATen/cuda/CublasHandlePool.cpp``)."""
CUBLAS_STREAMS = 2
"""The engine's streams (compute and copy). PyTorch keys workspaces by (handle, stream), so each stream that
runs a matmul gets its own; the copy stream normally runs none, so counting both is a bound."""
FRAGMENTATION = 0.10
"""Margin for the caching allocator, as a fraction of everything else the plan counts. It rounds each
request up (to 512 B; requests over 10 MiB to 2 MiB multiples) and carves requests of 1-10 MiB out of
20 MiB segments, and a cached block split for a smaller tensor cannot serve a bigger one, so what it
reserves exceeds what tensors hold (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``; the "reserved" vs
"allocated" of ``torch.cuda.memory_stats``). The plan's big tensors recur with the same sizes every block
and step, which keeps the gap small; 10% is a round margin above that, not a measurement."""
HOST_SHARED_PARTS = ("params", "gradient accumulators", "cuBLAS workspace", "fragmentation")
"""Parts of :func:`gpu_need` that add nothing to main memory when the CPU is the device: its parameters and
gradient accumulators are the host pools' own buffers, cuBLAS does not run, and the C allocator's slack
is ``plan.memory.SLACK_BYTES``'s to count."""
_GPU_FIXES = ("a smaller batch or more engine.micro_batches (activations and logits are per micro-batch), "
              "a shorter sequence, a lower engine.prefetch_depth (fewer blocks held), an act_policy that "
              "swaps more (interblock or the planner's plan instead of recompute-all), or, if the memory "
              "really is there, a larger engine.gpu_mem")


class GpuMemoryPlanError(ValueError):
    """A run's GPU memory plan does not fit the memory the device has free (:func:`check_gpu_budget`)."""


def _size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (the plan's parts span KiB to tens of GiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def format_gpu_parts(need: Mapping[str, int]) -> str:
    """``params 1.50 GiB, logits 96.0 MiB, ...``: every part of a GPU memory plan, for plans and errors."""
    return ", ".join(f"{k} {_size(v)}" for k, v in need.items())


def check_gpu_budget(need: Mapping[str, int], budget: int, what: str = "this run") -> None:
    """Refuse a run whose GPU memory plan (:func:`gpu_need`) exceeds ``budget`` bytes.

    The engine calls it at its first step with the bytes ``torch.cuda.mem_get_info`` reports free, so a run
    that would run out of memory hours in, at its biggest block or its longest batch, stops before it writes.
    What this process's caching allocator already reserved is not free but is the run's: called after the
    engine has allocated on the device, add ``torch.cuda.memory_reserved()`` to the free bytes.

    Raises:
        GpuMemoryPlanError: The plan needs more than ``budget``; the message lists every part, the total,
            the budget and what to change.
    """
    total = sum(need.values())
    if total <= budget:
        return
    raise GpuMemoryPlanError(
        f"GPU memory: {what} needs {_size(total)} but {_size(budget)} is available ({_size(total - budget)} "
        f"short). Parts: {format_gpu_parts(need)}. To fit, try {_GPU_FIXES}")


def gpu_need(cfg: ModelConfig, batch: int, seq: int, hw: Hardware, compute_dtype: str, micro_batches: int,
             prefetch_depth: int, swap: Sequence[str], world: int = 1,
             measured: Profile | None = None, host: bool = False) -> dict[str, int]:
    """Bytes the engine allocates on the GPU at a step's peak, by part (the keys are printed in plans and
    errors). The CUDA context lies outside the caching allocator: budget this against the *free* memory.

    ``batch`` is this process's (one rank's) batch; ``world`` the data-parallel ranks, which make the
    gradients fp32 as micro-batches do (``engine.grad_dtype``). ``swap``: the ops the plan swaps, named as in
    ``measured`` when given (the run's profile of ``batch`` x ``seq``, which sizes the activations: an HF
    block's ops are its own sub-modules, not the analytic GPT block's), else as in :func:`analytic_profile`.
    ``host``: the CPU is the device; it sums autograd's gradients into the host buffer at once (no accumulator, no
    copy in flight), so it holds one block's of them, or after them the fp32 upcast of the largest parameter
    that the norms take (``pools.device_grad_bytes``), not two blocks'.
    """
    s = _itemsize(compute_dtype)
    big = max(cfg.block_param_count(), cfg.embed_param_count(), cfg.head_param_count())
    g = pools.grad_itemsize(compute_dtype, micro_batches, world)  # the host gradient buffers' dtype
    mb = math.ceil(batch / micro_batches)
    full = measured if measured is not None else analytic_profile(cfg, batch, seq, hw, compute_dtype)
    sizes = {op.name: op.bytes for op in full.ops}
    unknown = sorted(set(swap) - set(sizes))
    if unknown:
        raise ValueError(f"gpu_need: the swap set names ops {unknown} that the {full.source} profile of "
                         f"{full.model!r} does not have (its ops: {list(sizes)})")
    record = full.input_bytes + sum(sizes[n] for n in swap)  # one block's record, every micro-batch
    if measured is not None:  # measured for the whole batch; a micro-batch's share, rounded up
        block_acts = math.ceil((full.input_bytes + sum(sizes.values())) / micro_batches)
    else:
        micro = analytic_profile(cfg, mb, seq, hw, compute_dtype)
        block_acts = micro.input_bytes + sum(op.bytes for op in micro.ops)
    tied = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    need = {
        # the block computing, the next one copied in, up to k kept over the forward/backward turn, and a
        # tied embedding, which its borrower (the head) needs at both ends of the step, kept all step
        "params": (prefetch_depth + 2) * s * big + (s * cfg.embed_param_count() if tied else 0),
    }
    if host:
        largest = pools.model_geometry(cfg, compute_dtype).largest_param
        need["block gradients"] = max(s * big, 4 * largest if g < 4 else 0)
    elif micro_batches == 1 and g == s:  # engine._direct: nothing to sum, autograd's gradients go to the host
        # this block's, and the block after's until its copy to the host has completed
        need["block gradients"] = 2 * s * big
    else:
        # a flat buffer per block: one filling while the previous one is copied to the host
        need["gradient accumulators"] = 2 * g * big
        # autograd's own gradients of one micro-batch, before they are added to the accumulator
        need["block gradients"] = s * big
    if tied:  # the head's gradient of the embedding, one per micro-batch, held until the embedding's backward
        need["borrowed gradients"] = micro_batches * s * tied
    need.update({
        # recomputing a block materializes every op of one micro-batch, and backward as many gradients
        "block activations": 2 * block_acts,
        # micro-batches are interleaved per block, so the last block keeps the whole batch's record
        "last block kept": record,
        # and the records of the block before, brought back ahead of its backward
        "next block's records": record,
        "logits": _logits_bytes(cfg, mb * seq, s),
        "cuBLAS workspace": CUBLAS_STREAMS * CUBLAS_WORKSPACE_BYTES,
    })
    need["fragmentation"] = int(FRAGMENTATION * sum(need.values()))
    return need


def _logits_bytes(cfg: ModelConfig, tokens: int, s: int) -> int:
    """The head's loss at its peak, one micro-batch of ``tokens`` (``models.lm_head.head_loss``:
    ``vocab.head_loss_bytes``). It never holds the micro-batch's fp32 logits: the gradient of the padded logits
    in the compute dtype (``s`` bytes per logit) and one chunk's fp32 temporaries, where the unchunked
    ``lm_loss`` held ``s + 12`` bytes per logit of every token."""
    return vocab.head_loss_bytes(cfg.vocab_size, tokens, s, cfg.d_model)


_gpu_need = gpu_need
"""The old private name, kept for callers that import it."""


def _judge(design: str, cfg: ModelConfig, batch: int, seq: int, hw: Hardware, plan: Plan,
           gpu_parts: dict[str, int], cpu_parts: dict[str, int], ssd_states: int, ssd_act: int) -> Capacity:
    limits = {"gpu": hw.gpu_mem, "cpu": _ram_budget(hw), "ssd": hw.ssd_bytes}
    gpu, cpu, ssd = sum(gpu_parts.values()), sum(cpu_parts.values()), ssd_states + ssd_act
    reasons = []
    if limits["gpu"] and gpu > limits["gpu"]:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in gpu_parts.items())
        reasons.append(f"GPU memory: needs {_gb(gpu)} ({parts}) but {_gb(limits['gpu'])} is available (free on "
                       f"this device, the card's size for a described one, or engine.gpu_mem); try {_GPU_FIXES}")
    if limits["cpu"] and cpu > limits["cpu"]:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in cpu_parts.items())
        reasons.append(f"main memory: needs {_gb(cpu)} ({parts}) but {_gb(limits['cpu'])} is usable "
                       f"({_gb(hw.ram)} RAM minus the {OS_RESERVE:.0%} OS reserve)")
    if limits["ssd"] and ssd > limits["ssd"]:
        reasons.append(f"SSD: needs {_gb(ssd)} (states {_gb(ssd_states)}, activations "
                       f"{_gb(ssd_act)}) but the SSDs hold {_gb(limits['ssd'])}")
    return Capacity(design, cfg.name, batch, seq, hw.name, not reasons, tuple(reasons), gpu, cpu, ssd,
                    ssd_states, ssd_act, plan, gpu_parts, cpu_parts, limits)


def resident_records(cfg: ModelConfig, compute_dtype: str, max_inflight: int, pool: int, extra: int | str,
                     opt_chunk_bytes: int = OPT_CHUNK_BYTES, micro_batches: int = 1,
                     clip: bool = False) -> tuple[int, int]:
    """(bytes `resident_mem` adds, parameters whose records then stay in memory) for the optimizer's share of
    the pools `pool` (:func:`engine_pools`' ``optimizer``: the record pool and the fp32 upcast scratch):
    ``pools.resident_extra`` and ``pools.plan_resident`` on the model's blocks, without alignment. `extra`:
    bytes, or ``all``. Records bigger than ``opt_chunk_bytes`` are updated in chunks and stay whole (every chunk)."""
    ecfg = pools.pool_config(compute_dtype, micro_batches, max_inflight=max_inflight, clip=clip, resident_mem=extra,
                             opt_chunk_bytes=opt_chunk_bytes)
    layout = pools.model_geometry(cfg, compute_dtype).store
    chunk = pools.optimizer_chunk_elems(layout, ecfg)
    g = pools.grad_itemsize(compute_dtype, micro_batches)
    records = pool - pools.upcast_bytes(layout, chunk, g, clip)
    add = pools.resident_extra(layout, ecfg, chunk, records, align=1)
    kept = pools.plan_resident(layout, records + add, max_inflight, chunk, align=1)
    return add, sum(layout.blocks[i].numel for i in kept)


def design_plan(cfg: ModelConfig, hw: Hardware, compute_dtype: str = "bf16", micro_batches: int = 1,
                prefetch_depth: int = 2, max_inflight: int = 3, slots: int = 2, keep_grads: bool = False,
                resident_mem: int | str = 0, cpu_mem: int | None = None, readahead_mem: int | str = "auto",
                clip_mode: str = "auto", state_format: str = "exact", act_compress: str = "none",
                host_device: bool = False, persist_every: int | str = 1, mode: str = "optimized",
                opt_chunk_bytes: int = OPT_CHUNK_BYTES) -> RunPlan:
    """The run plan of a design priced from settings given as keywords (:func:`capacity`'s, for a model and
    machine with no run behind them: the capacity CLI, the benchmarks), on the model's blocks without padding
    (``pools.model_geometry``), with cpu_mem the run's budget within what the machine's RAM gives
    (:func:`_ram_budget`), which is also the memory the ``auto`` rooms take half of. A run prices its own plan
    (`run_plan.plan_run` on the engine's geometry) with :func:`plan_capacity`."""
    budget = _ram_budget(hw)
    limit = min(cpu_mem, budget) if cpu_mem and budget else (cpu_mem or budget)
    ecfg = pools.pool_config(compute_dtype, micro_batches, prefetch_depth, max_inflight, slots=slots,
                             clip=keep_grads, resident_mem=resident_mem, cpu_mem=limit, readahead_mem=readahead_mem,
                             clip_mode=clip_mode, mode=mode, opt_chunk_bytes=opt_chunk_bytes)
    ecfg = ecfg.with_overrides(state_format=state_format, act_compress=act_compress, persist_every=persist_every)
    return plan_run(ecfg, pools.model_geometry(cfg, compute_dtype, slots, state_format=state_format),
                    free=budget, host_device=host_device)


def capacity(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, compute_dtype: str = "bf16",
             micro_batches: int = 1, prefetch_depth: int = 2, max_inflight: int = 3, slots: int = 2,
             keep_grads: bool = False, resident_mem: int | str = 0, cpu_mem: int | None = None,
             readahead_mem: int | str = "auto", clip_mode: str = "auto", state_format: str = "exact",
             act_compress: str = "none", host_device: bool = False, persist_every: int | str = 1,
             mode: str = "optimized", opt_chunk_bytes: int = OPT_CHUNK_BYTES) -> Capacity:
    """LoHan: states on SSD (``slots`` copies: 2 for crash-consistent steps), activations in main memory
    and overflowing to SSD, gradients consumed per block by active gradient offloading (only two block
    buffers in main memory). With ``keep_grads`` (gradient clipping; the engine keeps them with ``slots=1`` too)
    the step's gradients are also kept, in fp32 unless bf16 with one micro-batch (``pools.grad_dtype``): in the
    main memory ``cpu_mem`` leaves after the pools (``grad_stash``), the rest on the SSDs (the engine's stash).

    The main-memory parts are ``pools.plan_host_memory``'s, the engine's own function; activations get what the
    RAM budget leaves after them. ``resident_mem`` (the engine's setting: bytes, ``all`` or ``auto``, then
    bounded by ``cpu_mem`` as the engine bounds it) keeps optimizer records in memory across steps: they are
    written each step but not read (``Profile.resident_params``). 0 (the default, and the paper's method) keeps
    only what the record pool holds beside its streaming buffers. ``readahead_mem`` (bytes or ``auto``, the
    engine's setting) is the room for records read during backward ahead of an update that waits for the norm,
    planned in optimized mode (``pools.reads_ahead``); the
    records it holds are ``Profile.readahead_params``, and the estimate's ``t_deferred`` prices them.
    ``state_format`` (`lohan.plan.formats`) prices the SSD bytes at rest and moved per step of a compressed
    format, and the main-memory pools of its records.
    ``act_compress`` (``int8``: the engine's setting) plans activation records that leave the device compressed:
    the tiers hold, and the links move, their int8 bytes, and the GPU pays their quantization; the GPU memory plan
    keeps counting them as the device makes them (an upper bound). ``host_device``: the CPU computes (its
    gradients are in main memory: the pools' ``auto`` rooms leave them out, ``gpu_need`` prices them as it holds
    them). ``persist_every`` (the engine's setting: steps, or ``auto``) writes the records once in that many
    steps where every one is resident (`lohan.plan.durability`); the plan's ``persist_every`` is the interval in
    force (``auto``: the least that keeps the writes under a tenth of the predicted step's time). ``mode`` and
    ``opt_chunk_bytes``: the engine's settings, which size the grads and record pools."""
    return plan_capacity(cfg, hw, batch, seq, design_plan(
        cfg, hw, compute_dtype, micro_batches, prefetch_depth, max_inflight, slots, keep_grads, resident_mem, cpu_mem,
        readahead_mem, clip_mode, state_format, act_compress, host_device, persist_every, mode, opt_chunk_bytes))


def plan_capacity(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, run: RunPlan) -> Capacity:
    """:func:`capacity` of a run plan (`run_plan.plan_run`): its main-memory pools, as the engine allocates them
    (a run's own plan: on the engine's geometry, with the whole EngineConfig), every setting from ``run.engine``,
    and, where the pools exceed cpu_mem, the engine's refusal among the reasons, in its words. ``batch``: this
    process's (one rank's: ``hw`` then the rank's share of the machine, `app.fit.data_parallel_machine`)."""
    e, host = run.engine, run.host
    parts = {k: v for k, v in host.parts().items() if v or k != "resident"}
    # The plan is made on the whole batch: micro-batches interleave per block, so all their records coexist.
    reserved = dataclasses.replace(hw, mem_avail=max(0, _ram_budget(hw) - host.total))
    profile = analytic_profile(cfg, batch, seq, reserved, e.execution.compute_dtype)
    resident = min(run.resident_params, profile.param_count)
    # the room holds whole records (P32, m, v, P16) of parameters not resident
    fmt = formats.state_format(e.store.state_format)
    ahead = min(run.readahead_params, profile.param_count - resident)
    kept = round(profile.param_count * run.kept_p16)  # (in place nothing is kept)
    profile = dataclasses.replace(profile, resident_params=resident, readahead_params=ahead, kept_p16_params=kept,
                                  write_behind=run.write_behind, record_bytes=fmt.record(),
                                  separate_p16=fmt.keeps_p16(profile.p16_itemsize), update_cost=fmt.update_cost,
                                  act_compress=e.activations.act_compress)
    plan = algorithm1(profile)
    every, why_not = _persist_every(e.execution.persist_every, profile, plan, e.store.slots, host.has_stash,
                                    in_place=e.stability.max_grad_norm <= 0 and e.execution.compute_dtype != "fp16")
    if every > 1:
        plan = algorithm1(dataclasses.replace(profile, persist_every=every))
    gpu = gpu_need(cfg, batch, seq, hw, e.execution.compute_dtype, e.execution.micro_batches, e.memory.prefetch_depth, plan.swap, run.world,
                   host=run.host_device)
    states = round(e.store.slots * fmt.at_rest(_itemsize(e.execution.compute_dtype)) * cfg.param_count())
    if host.has_stash:  # the gradients the stash cannot keep in main memory go to the SSDs
        states += max(0, host.grad_itemsize * cfg.param_count() - (host.stash_ram or 0))
    judged = _judge("LoHan (activations to main memory, overflow to SSD)", cfg, batch, seq, hw, plan, gpu,
                    {**parts, "activations": plan.cpu_bytes}, states, plan.ssd_bytes)
    if run.refusal is not None:  # the engine would refuse its pools: the same words
        judged = dataclasses.replace(judged, fits=False, reasons=(run.refusal, *judged.reasons),
                                     over_cpu_mem=run.over_cpu_mem)
    return dataclasses.replace(judged, persist_every=every, persist_note=why_not)


def _persist_every(asked: int | str, profile: Profile, plan: Plan, slots: int, has_stash: bool,
                   in_place: bool = False) -> tuple[int, str]:
    """The durability interval a run of `profile` keeps and, where it is 1 against what was asked, why
    (`durability.eligible`, `durability.persist_interval`; ``auto`` from the plan's step, every step durable)."""
    if asked == 1:
        return 1, ""
    why = durability.eligible(profile.resident_params >= profile.param_count, slots, True, has_stash, in_place)
    if why is not None:
        return 1, why
    if asked == "auto":
        n = durability.persist_interval(profile.states, profile.hardware.bw_m2s, plan.estimate.t_iter)
        return n, "" if n > 1 else "the writes take under a tenth of the step"
    return int(asked), ""


def activations_in_ram_capacity(cfg: ModelConfig, hw: Hardware, batch: int, seq: int,
                                compute_dtype: str = "bf16", micro_batches: int = 1, prefetch_depth: int = 2,
                                max_inflight: int = 3, grad_bytes_per_param: int | None = None) -> Capacity:
    """ZeRO-Infinity-style design: block-input checkpoints of every block held in main memory (no SSD tier
    for activations) and, because its CPU optimizer runs as a separate stage after backward, the whole
    model's gradients too (``grad_bytes_per_param * P``): by default the half-precision gradients (2P)
    plus the fp32 copy that DeepSpeed's CPU Adam consumes (4P), i.e. 6 bytes per parameter in bf16.
    That reproduces the paper's estimate of ~1.1 TB of main memory for 175B (§I) and its Fig. 2a
    (175B does not fit in 768 GB); counting only the 2P would contradict both.
    """
    s = _itemsize(compute_dtype)
    grads = (s + 4 if grad_bytes_per_param is None else grad_bytes_per_param) * cfg.param_count()
    engine = engine_pools(cfg, compute_dtype, prefetch_depth, max_inflight, micro_batches, block_grads=False,
                          resident=False)
    profile = analytic_profile(cfg, batch, seq, hw, compute_dtype)
    # Activations never go to SSD in this design: plan as if main memory held them, then check it does.
    everything = dataclasses.replace(hw, mem_avail=cfg.n_layer * profile.input_bytes)
    plan = forced_plan(dataclasses.replace(profile, hardware=everything), "interblock")
    gpu = gpu_need(cfg, batch, seq, hw, compute_dtype, micro_batches, prefetch_depth, ())
    return _judge("activations in main memory (ZeRO-Infinity style)", cfg, batch, seq, hw, plan, gpu,
                  {**engine, "gradients": grads, "checkpoints": plan.cpu_bytes}, 2 * (12 + s) * cfg.param_count(), 0)


def max_batch(cfg: ModelConfig, hw: Hardware, seq: int, compute_dtype: str = "bf16", micro_batches: int = 1,
              prefetch_depth: int = 2, max_inflight: int = 3, limit: int = 1 << 16) -> int:
    """Largest batch (a multiple of ``micro_batches``) that :func:`capacity` accepts; 0 if none."""
    def fits(k: int) -> bool:
        return capacity(cfg, hw, k * micro_batches, seq, compute_dtype, micro_batches,
                        prefetch_depth, max_inflight).fits
    if not fits(1):
        return 0
    lo = 1
    while 2 * lo <= limit and fits(2 * lo):
        lo *= 2
    hi = min(2 * lo, limit + 1)  # first size known (or assumed) not to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * micro_batches


def max_model(hw: Hardware, seq: int, batch: int = 1, presets: Mapping[str, Mapping[str, Any]] | None = None,
              compute_dtype: str = "bf16", prefetch_depth: int = 2, max_inflight: int = 3) -> str | None:
    """Name of the largest preset (by parameter count) that fits at this batch and sequence length.

    A preset with fewer position embeddings than ``seq`` is sized with ``seq`` of them.
    """
    table = PRESETS if presets is None else presets
    cfgs = [ModelConfig(name=name, **dims) for name, dims in table.items()]
    cfgs = [c.with_overrides(seq_len=max(c.seq_len, seq)) for c in cfgs]
    for cfg in sorted(cfgs, key=ModelConfig.param_count, reverse=True):
        if capacity(cfg, hw, batch, seq, compute_dtype, prefetch_depth=prefetch_depth,
                    max_inflight=max_inflight).fits:
            return cfg.name
    return None



# ------------------------------------------------------------------------------ lanes of a run

def predict_lanes(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, mode: str = "optimized",
                  **capacity_args: Any) -> dict[str, float]:
    """Seconds each lane (:data:`LANES_B`) is busy in one step of a run, as the cost model predicts them: the
    plan :func:`capacity` makes for (``cfg``, ``hw``, ``batch``, ``seq`` and ``capacity_args``: compute dtype,
    state format, resident records, ...), its forward and backward added (`Estimate.step_lanes`), in the
    vocabulary the engine measures (`runtime.step.StepStats.lanes`). ``hw.cpu_adam_params_per_s`` is the rate of
    the optimizer's CPU work as it runs: with checksums on, the records' hashing included (`fit.measure_cpu_adam`)."""
    return capacity(cfg, hw, batch, seq, **capacity_args).plan.estimate.step_lanes(mode)


@dataclass(frozen=True)
class SsdCost:
    """What the SSDs cost a run whose ``ssd`` lane is its slowest (:func:`ssd_cost`)."""

    lanes: dict[str, float]
    """The run's lanes per step (seconds): predicted, or measured by its first step."""
    step_s: float
    """The run's step (seconds): predicted, or measured."""
    state_format: str
    """The run's state format."""
    suggested: str
    """Of the state formats with fewer SSD bytes per step, the one whose step the cost model prices shortest."""
    priced: dict[str, tuple[float, str]]
    """Each of those formats' (step seconds, binding lane), predicted (scaled from a measured step by the cost
    model's ratio); the binding lane is ``cpu`` where an update's decoding outweighs the bytes it saves."""
    eval_loss_gap: float | None
    """``suggested``'s measured quality cost (`formats.EVAL_LOSS_GAP`); None: not measured."""
    tokens: int
    """Tokens per step of the run."""
    hide_tokens: int
    """Tokens per step (a larger batch at this sequence length) at which the ``gpu`` lane is as long as the
    ``ssd`` lane: compute would hide the SSDs on this box."""

    def format(self, source: str = "predicted") -> str:
        """One line: the lanes, the suggested format's step and quality cost, the others', and the tokens."""
        step, binds = self.priced[self.suggested]
        gap = (f"measured quality cost: eval loss +{self.eval_loss_gap:.4f} against exact "
               "(benchmarks/results/compressed_states.md)" if self.eval_loss_gap is not None else
               "quality cost not measured")
        def quality(f: str) -> str:
            return f", eval loss +{formats.EVAL_LOSS_GAP[f]:.4f}" if f in formats.EVAL_LOSS_GAP else ""
        others = "; ".join(f"{f} {t:.3g} s ({b} binds{quality(f)})" for f, (t, b) in self.priced.items()
                           if f != self.suggested)
        return (f"the SSDs bind ({source}: ssd {self.lanes['ssd']:.3g} s of a {self.step_s:.3g} s step, gpu "
                f"{self.lanes.get('gpu', 0.0):.3g} s, cpu {self.lanes.get('cpu', 0.0):.3g} s): "
                f"--state-format {self.suggested} would take {step:.3g} s per step (predicted, {binds} binds; {gap})"
                + (f"; {others}" if others else "")
                + f"; at {self.hide_tokens:,} tokens per step (now {self.tokens:,}) compute would hide the SSDs on "
                "this box")


def ssd_cost(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, mode: str = "optimized",
             measured: tuple[Mapping[str, float], float] | None = None, **capacity_args: Any) -> SsdCost | None:
    """What the SSDs cost the run, where its ``ssd`` lane is the slowest of :data:`LANES_B` (else None): the
    cost model's lanes (`predict_lanes`), or ``measured`` (a step's lanes and seconds) where a step ran. The
    formats with fewer SSD bytes per step (`formats.StateFormat.per_step`) are priced by the same model, and a
    measured step scaled by the model's ratio; the fastest is suggested. Where the compute
    dtype is not bf16, ``bf16-master`` (bf16 weights only) is not offered."""
    dtype = capacity_args.get("compute_dtype", "bf16")
    current = capacity_args.get("state_format", "exact")
    est = capacity(cfg, hw, batch, seq, mode=mode, **capacity_args).plan.estimate
    lanes, step_s = est.step_lanes(mode), (est.t_serial if mode == "serial" else est.t_iter)
    if measured is not None:
        lanes, step_s = upgrade_lanes(measured[0]), measured[1]
    work = {k: lanes.get(k, 0.0) for k in LANES_B}
    if max(work, key=work.__getitem__) != "ssd" or work["ssd"] <= 0:
        return None
    s = _itemsize(dtype)
    smaller = sorted((f for f in formats.FORMATS if (f != "bf16-master" or dtype == "bf16")
                      and formats.state_format(f).per_step(s) < formats.state_format(current).per_step(s)),
                     key=lambda f: -formats.state_format(f).per_step(s))
    if not smaller:
        return None
    scale = step_s / (est.t_serial if mode == "serial" else est.t_iter)
    priced = {}
    for name in smaller:
        other = capacity(cfg, hw, batch, seq, mode=mode, **{**capacity_args, "state_format": name}).plan.estimate
        ol = other.step_lanes(mode)
        priced[name] = ((other.t_serial if mode == "serial" else other.t_iter) * scale, max(ol, key=ol.__getitem__))
    best = min(priced, key=lambda f: priced[f][0])
    gpu = work["gpu"]
    tokens = batch * seq
    hide = math.ceil(tokens * work["ssd"] / gpu / seq) * seq if gpu > 0 else 0
    return SsdCost(work, step_s, current, best, priced, formats.EVAL_LOSS_GAP.get(best), tokens, hide)
