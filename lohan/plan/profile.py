"""The activation profile: what the cost model needs to know of one (model, batch, seq, machine) (:class:`Profile`,
its ops' FLOPs and bytes), measured by the engine or counted by formula (:func:`analytic_profile`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from io_engine import durable
from lohan.config import ACT_COMPRESSIONS, ModelConfig
from lohan.plan.hardware import Hardware
from lohan.plan.units import itemsize


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
    s = itemsize(compute_dtype)
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
