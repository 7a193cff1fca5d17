"""State formats (issue "Compressed tiers"): what one parameter's optimizer states weigh at rest and per step.

The planner prices a format by these bytes; the arithmetic of the compressed formats is in
`lohan.runtime.quant`. Per parameter:

| format | master | m | v | separate P16 |
|---|---|---|---|---|
| ``exact`` | fp32 | fp32 | fp32 | yes (the compute dtype) |
| ``bf16-moments`` | fp32 | bf16 | bf16 | yes |
| ``8bit-moments`` | fp32 | 8-bit, block-wise | 8-bit, block-wise | yes |
| ``bf16-master`` | bf16, stochastically rounded | 8-bit, block-wise | 8-bit, block-wise | no: the master is the P16 |
| ``frozen`` | none | none | none | yes: the only section (a LoRA run's base, read, never written) |

A step reads the master and both moments and writes them back, with the P16 copy where there is one; the forward
(and backward) read the P16, unless the update hands it over (`p16_read=False`: the next forward beside the
optimizer pass takes every block's new P16 from it). 8-bit moments carry one fp32 absmax per `QBLOCK` values.
"""

from __future__ import annotations

from dataclasses import dataclass

from lohan.config import STATE_FORMATS

QBLOCK = 256
"""Values per quantization block (`lohan.runtime.quant.QBLOCK`, which the tests keep equal)."""

FORMATS = STATE_FORMATS  # (named in the config layer, which validates them)


@dataclass(frozen=True)
class StateFormat:
    """The bytes of one parameter's states in a format."""

    name: str
    master: float
    """Bytes of the master weight."""
    moment: float
    """Bytes of each of m and v (8-bit: the code and its share of the block's absmax)."""
    separate_p16: bool
    """Whether the compute-dtype copy (P16) is stored beside the master (False: the master is it)."""
    update_cost: float = 1.0
    """CPU time of the update per parameter relative to ``exact``'s fused AdamW: the decode and encode (8-bit
    codes, stochastic rounding; `lohan.runtime.format_kernel`) cost more than the AdamW arithmetic. Measured by
    ``benchmarks/compressed_states.py`` (``update_cost``) on this project's 2-core test machine; the planner
    prices the CPU lane with it."""

    @property
    def master_itemsize(self) -> int:
        """Bytes per element of the stored master: 4 (fp32) or 2 (bf16)."""
        return int(self.master)

    @property
    def moment_itemsize(self) -> int:
        """Bytes per element of each stored moment: 4 (fp32), 2 (bf16) or 1 (an 8-bit code)."""
        return int(self.moment)

    @property
    def quantized(self) -> bool:
        """Whether m and v are 8-bit codes with one fp32 absmax per `QBLOCK` values of each parameter."""
        return self.moment_itemsize == 1

    def keeps_p16(self, p16_bytes: int = 2) -> bool:
        """Whether a record stores a P16 of `p16_bytes` bytes a parameter beside the master: not where the master
        is what the compute reads (``bf16-master``), nor for ``exact`` states computed in fp32, whose P16 would be
        the fp32 master bit for bit (a store laid out before that keeps its copy: `records.BlockLayout.shared_p16`)."""
        return self.separate_p16 and not (self.name == "exact" and p16_bytes == 4)

    def at_rest(self, p16_bytes: int = 2) -> float:
        """Bytes per parameter on the SSDs (one slot)."""
        return self.master + 2 * self.moment + (p16_bytes if self.keeps_p16(p16_bytes) else 0)

    def record(self) -> float:
        """Bytes per parameter of the optimizer record the update reads and writes (master, m, v)."""
        return self.master + 2 * self.moment

    def per_step(self, p16_bytes: int = 2, p16_read: bool = True) -> float:
        """Bytes per parameter read plus written by one optimizer step: the record both ways, the P16 written
        (a separate copy) and read for the compute (unless the update hands it over)."""
        p16 = p16_bytes if self.separate_p16 else self.master
        written = self.record() + (p16_bytes if self.keeps_p16(p16_bytes) else 0)
        return self.record() + written + (p16 if p16_read else 0)


EVAL_LOSS_GAP = {"exact": 0.0, "bf16-moments": 0.0006, "8bit-moments": 0.0006, "bf16-master": 0.0008}
"""Each format's measured quality cost: the gap of its final eval loss to ``exact``'s, from
``benchmarks/results/compressed_states/cpu2-epyc.md`` (a 110M Llama, 300 steps, batch 2 x 256, lr 3e-4; rerun that
benchmark to measure it again). What the run header quotes when it suggests a format (`planner.ssd_cost`)."""


_Q8 = 1 + 4 / QBLOCK
_TABLE = {
    "exact": StateFormat("exact", 4, 4, True),
    "bf16-moments": StateFormat("bf16-moments", 4, 2, True, update_cost=1.2),
    "8bit-moments": StateFormat("8bit-moments", 4, _Q8, True, update_cost=12.6),
    "bf16-master": StateFormat("bf16-master", 2, _Q8, False, update_cost=13.6),
    # a LoRA run's base weights (`lohan.runtime.lora_engine`): the P16 alone, never updated; not a choice of
    # `--state-format` (FORMATS), which names the formats of a full fine-tuning's states
    "frozen": StateFormat("frozen", 0, 0, True, update_cost=0.0),
}


def state_format(name: str) -> StateFormat:
    """The format called `name` (one of `FORMATS`); ValueError names the choices. (A lookup in a table built once:
    the planner's capacity search asks it ~10^6 times.)"""
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"state format {name!r}: choose one of {', '.join(FORMATS)}") from None
