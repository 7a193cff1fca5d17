"""AdamW on compressed states (issue "Compressed tiers"): decode a slice of a block's states to fp32, run the
engine's own AdamW kernel on it (`optim.adamw_chunk_`: torch's fused kernel), encode the result back.

A block's states in a format (`lohan.plan.formats`) are flat vectors: the master (fp32, or bf16 for
``bf16-master``), m and v (fp32, bf16, or 8-bit codes with one fp32 absmax per `quant.QBLOCK` values). Every
step of the update works per element or per quantization block, and the rounding noise of ``bf16-master`` is a
function of the element's index, so updating a block in chunks whose bounds are multiples of `QBLOCK` gives the
bits of updating it whole: the engine (chunks, from the SSDs) and `FormatAdamW` (whole blocks, in memory) agree
bit for bit, the equivalence discipline of every other mode. Rounding: bf16 moments to nearest (as ``.to``
rounds), 8-bit moments to the nearest code, a bf16 master stochastically (unbiased: tiny updates are not lost).

A known hazard of 8-bit second moments, weighed before this goes into the engine: the unsigned map's smallest
non-zero entry is about 3e-7 of a block's absmax, so a v further below its block's largest is stored as 0, and
AdamW's m / (sqrt(v) + eps) then divides by eps. Blocks counted per parameter keep a block within one tensor
(whose gradients share a scale, as the tests' per-parameter scales do); gradients whose squares span more than
six decades within 256 neighbours would need v's map without 0 (Li et al. 2023, "Memory Efficient Optimizers
with 4-bit States", §4) or v stored as sqrt(v).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lohan.plan.formats import FORMATS, QBLOCK
from lohan.runtime.optim import AdamWHyper, ParamRange, adamw_chunk_
from lohan.runtime.quant import dequantize_blockwise, quantize_blockwise, stochastic_round_bf16


def _pieces(params: Sequence[ParamRange], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(parameter index, start, end) of each parameter's part of elements lo..hi."""
    return [(k, max(lo, p.offset), min(hi, p.offset + p.numel)) for k, p in enumerate(params)
            if p.offset < hi and p.offset + p.numel > lo]


@dataclass
class Moment:
    """One moment of a block, as stored: `value` (fp32 or bf16), or 8-bit `codes` with one `absmax` per block of
    QBLOCK values of each parameter (counted from the parameter's start, as torchao and bitsandbytes quantize
    per tensor; `starts[k]`: where parameter k's blocks begin in `absmax`)."""

    value: Tensor | None = None
    codes: Tensor | None = None
    absmax: Tensor | None = None
    starts: list[int] | None = None

    def decode(self, params: Sequence[ParamRange], lo: int, hi: int, signed: bool) -> Tensor:
        """Elements lo..hi as fp32."""
        if self.codes is None:
            return self.value[lo:hi].float()
        return torch.cat([dequantize_blockwise(self.codes[a:b], self._absmax(params, k, a, b), signed)
                          for k, a, b in _pieces(params, lo, hi)])

    def encode_(self, x: Tensor, params: Sequence[ParamRange], lo: int, signed: bool) -> None:
        """Store `x` as elements lo..lo+len (fp32: as is; bf16: rounded to nearest; 8-bit: per block)."""
        if self.codes is None:
            self.value[lo:lo + x.numel()].copy_(x)
            return
        for k, a, b in _pieces(params, lo, lo + x.numel()):
            codes, absmax = quantize_blockwise(x[a - lo:b - lo].contiguous(), signed)
            self.codes[a:b].copy_(codes)
            self._absmax(params, k, a, b).copy_(absmax)

    def _absmax(self, params: Sequence[ParamRange], k: int, a: int, b: int) -> Tensor:
        p = params[k]
        if (a - p.offset) % QBLOCK or (b != p.offset + p.numel and (b - p.offset) % QBLOCK):
            raise ValueError(f"an update of 8-bit states must cut parameter {k} at multiples of {QBLOCK} from its "
                             f"start, not at {a - p.offset}..{b - p.offset}")
        first = self.starts[k] + (a - p.offset) // QBLOCK
        return self.absmax[first:first + -(-(b - a) // QBLOCK)]


@dataclass
class BlockStates:
    """A block's states in a format: master, m, v (flat, the block's parameters one after the other)."""

    master: Tensor
    m: Moment
    v: Moment

    @staticmethod
    def zeros(fmt: str, params: Sequence[ParamRange]) -> BlockStates:
        """The states of a block with parameters `params` in `fmt`, moments zero, master to be filled."""
        if fmt not in FORMATS:
            raise ValueError(f"state format {fmt!r}: choose one of {', '.join(FORMATS)}")
        numel = max(p.offset + p.numel for p in params)
        master = torch.zeros(numel, dtype=torch.bfloat16 if fmt == "bf16-master" else torch.float32)
        blocks = [-(-p.numel // QBLOCK) for p in params]
        starts = [sum(blocks[:k]) for k in range(len(params))]

        def moment() -> Moment:
            if fmt in ("8bit-moments", "bf16-master"):
                return Moment(codes=torch.zeros(numel, dtype=torch.uint8), absmax=torch.zeros(sum(blocks)),
                              starts=starts)
            return Moment(value=torch.zeros(numel, dtype=torch.bfloat16 if fmt == "bf16-moments" else torch.float32))
        return BlockStates(master, moment(), moment())


def adamw_format_(states: BlockStates, grad: Tensor, step: int, hp: AdamWHyper, params: Sequence[ParamRange],
                  lo: int, *, seed: int, block: int) -> Tensor:
    """AdamW at 1-based `step` on elements lo..lo+len of block `block`, whose states `states` are in their
    format; `grad` is that slice's fp32 gradient, clipped. The slice cuts each parameter at multiples of QBLOCK
    from its start (the engine's chunks cut them at multiples of 4096, which also keeps the fused kernel's
    vector lanes where a whole-parameter update has them). Updates `states` in place and returns the slice's
    new weights in bf16 (the P16 the compute reads; for ``bf16-master`` the master itself)."""
    hi = lo + grad.numel()
    p32 = states.master[lo:hi].float()
    m, v = states.m.decode(params, lo, hi, signed=True), states.v.decode(params, lo, hi, signed=False)
    p16 = torch.empty(p32.numel(), dtype=torch.bfloat16)
    adamw_chunk_(p32, grad, m, v, p16, step, hp, params, lo)
    states.m.encode_(m, params, lo, signed=True)
    states.v.encode_(v, params, lo, signed=False)
    if states.master.dtype == torch.bfloat16:
        states.master[lo:hi].copy_(stochastic_round_bf16(p32, seed, block, step, offset=lo))
        return states.master[lo:hi]
    states.master[lo:hi].copy_(p32)
    return p16


class FormatAdamW:
    """AdamW over a model's blocks held in memory in a state format: the reference the offloaded engine is
    tested against (same kernel, whole blocks instead of chunks). `blocks`: each block's flat fp32 initial
    weights with its parameters' ranges."""

    def __init__(self, fmt: str, blocks: Sequence[tuple[Tensor, Sequence[ParamRange]]], hp: AdamWHyper,
                 seed: int = 0) -> None:
        self.fmt, self.hp, self.seed, self.step_count = fmt, hp, seed, 0
        self.params = [list(ranges) for _, ranges in blocks]
        self.states = []
        for flat, ranges in blocks:
            st = BlockStates.zeros(fmt, ranges)
            # the first bf16 master: the fp32 weights rounded to nearest (no step has drawn noise yet)
            st.master.copy_(flat)
            self.states.append(st)

    def step(self, grads: Sequence[Tensor], hp: AdamWHyper | None = None) -> list[Tensor]:
        """One update of every block with its flat fp32 gradient; returns each block's new bf16 weights."""
        self.step_count += 1
        return [adamw_format_(st, g, self.step_count, hp or self.hp, ranges, 0, seed=self.seed, block=b)
                for b, (st, g, ranges) in enumerate(zip(self.states, grads, self.params, strict=True))]

    def weights(self, block: int) -> Tensor:
        """Block `block`'s master weights as fp32."""
        return self.states[block].master.float()
