"""AdamW on compressed states (issue "Compressed tiers"): decode a slice of a block's states to fp32, run the
engine's own AdamW kernel on it (`optim.adamw_chunk_`: torch's fused kernel), encode the result back.

A block's states in a format (`lohan.plan.formats`) are flat vectors: the master (fp32, or bf16 for
``bf16-master``), m and v (fp32, bf16, or 8-bit codes with one fp32 absmax per `quant.QBLOCK` values). Every
step of the update works per element or per quantization block, and the rounding noise of ``bf16-master`` is a
function of the element's index, so updating a block in chunks whose bounds are multiples of `QBLOCK` gives the
bits of updating it whole: the engine (chunks, from the SSDs) and `FormatAdamW` (whole blocks, in memory) agree
bit for bit, the equivalence discipline of every other mode. Rounding: bf16 moments to nearest (as ``.to``
rounds), 8-bit moments to the nearest code, a bf16 master stochastically (unbiased: tiny updates are not lost).

The engine (`offload.py`) calls `adamw_unit_` on a unit's buffer, `FormatAdamW` is the in-memory reference.

A known hazard of 8-bit second moments (bitsandbytes and torchao share it): the unsigned map's smallest
non-zero entry is about 3e-7 of a block's absmax, so a v further below its block's largest is stored as 0, and
AdamW's m / (sqrt(v) + eps) then divides by eps. Blocks counted per parameter keep a block within one tensor
(whose gradients share a scale, as the tests' per-parameter scales do); gradients whose squares span more than
six decades within 256 neighbours would need v's map without 0 (Li et al. 2023, "Memory Efficient Optimizers
with 4-bit States", §4) or v stored as sqrt(v).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lohan.plan.formats import FORMATS, QBLOCK
from lohan.runtime import format_kernel
from lohan.runtime.optim import AdamWHyper, ParamRange, _adamw
from lohan.runtime.quant import (
    _key,
    _midpoints,
    compact_code_table,
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
    stochastic_round_bf16,
)


def qstarts(params: Sequence[ParamRange]) -> list[int]:
    """Index of each parameter's first quantization block (blocks counted per parameter, from its start)."""
    out = [0]
    for p in params:
        out.append(out[-1] + -(-p.numel // QBLOCK))
    return out[:-1]


def _pieces(params: Sequence[ParamRange], lo: int, hi: int, quantized: bool,
            limit: int | None = None) -> list[tuple[int, int, int]]:
    """(parameter index, start, end) of each parameter's part of elements lo..hi, cut at multiples of `limit` from
    the parameter's start (None: not cut); with 8-bit moments a cut inside a quantization block is refused."""
    out = []
    for k, p in enumerate(params):
        a, end = max(lo, p.offset), min(hi, p.offset + p.numel)
        if a >= end:
            continue
        if quantized and ((a - p.offset) % QBLOCK or (end != p.offset + p.numel and (end - p.offset) % QBLOCK)):
            raise ValueError(f"an update of compressed states must cut parameter {k} at multiples of {QBLOCK} from "
                             f"its start, not at {a - p.offset}..{end - p.offset}")
        while a < end:
            z = end if limit is None else min(end, p.offset + ((a - p.offset) // limit + 1) * limit)
            out.append((k, a, z))
            a = z
    return out


def _piece_(master: Tensor, m: tuple[Tensor, Tensor | None], v: tuple[Tensor, Tensor | None], p16: Tensor | None,
            g32: Tensor, step: int, hp: AdamWHyper, decay: bool, *, seed: int, block: int, at: int) -> None:
    """AdamW on one piece of one parameter whose states are in their format: `master` (fp32 or bf16), each moment as
    (values or 8-bit codes, the piece's absmax per quantization block or None); `g32` its fp32 clipped gradient;
    `at` the piece's first element in the block's vector (the rounding noise's index). Writes the new P16 into
    `p16` if given. Compiled (`format_kernel`) where it could be built, torch ops otherwise."""
    # the kernel where torch ops are slow (8-bit codes, stochastic rounding: 2-3x faster on 2 cores); fp32 and bf16
    # moments with an fp32 master are a few casts around torch's fused AdamW, which runs them faster
    slow = master.dtype == torch.bfloat16 or m[1] is not None
    mod = format_kernel.kernel() if slow else None
    if mod is None:
        _piece_torch(master, m, v, p16, g32, step, hp, decay, seed=seed, block=block, at=at)
        return
    key = _key(seed, block, step) if master.dtype == torch.bfloat16 else 0
    books = [t for sg in (True, False) for t in (dynamic_map(sg), _midpoints(sg), compact_code_table(sg))]
    mod.adamw_piece(master, m[0], m[1], v[0], v[1], p16 if p16 is not None else _NONE, g32.contiguous(), hp.lr,
                    hp.beta1, hp.beta2, hp.eps, hp.weight_decay if decay else 0.0, step, at, key, *books)


_NONE = torch.empty(0)


def _piece_torch(master: Tensor, m: tuple[Tensor, Tensor | None], v: tuple[Tensor, Tensor | None],
                 p16: Tensor | None, g32: Tensor, step: int, hp: AdamWHyper, decay: bool, *, seed: int, block: int,
                 at: int) -> None:
    """`_piece_` in torch ops: decode, the engine's fused AdamW kernel (`optim._adamw`), encode."""
    p32 = master.float()  # (an fp32 master: itself, updated in place)
    mv = [dequantize_blockwise(x, scale, signed) if scale is not None else x.float()
          for (x, scale), signed in ((m, True), (v, False))]
    _adamw([p32], [g32], [mv[0]], [mv[1]], [decay], step, hp)
    for (x, scale), new, signed in ((m, mv[0], True), (v, mv[1], False)):
        if scale is None:
            if x.data_ptr() != new.data_ptr():
                x.copy_(new)  # bf16 moments: to nearest
        else:
            codes, absmax = quantize_blockwise(new, signed)
            x.copy_(codes)
            scale.copy_(absmax)
    if master.dtype == torch.bfloat16:
        master.copy_(stochastic_round_bf16(p32, seed, block, step, offset=at))
    if p16 is not None:
        p16.copy_(p32)


def adamw_unit_(views, grad: Tensor, step: int, hp: AdamWHyper, params: Sequence[ParamRange], lo: int, *,
                seed: int, block: int, fp32: Callable[[Tensor], Tensor], limit: int, origin: int = 0) -> None:
    """The engine's update of a unit lo..hi of block `block` (a whole record or a chunk) in its buffer: `views` are
    its `store.states.UnitViews` (master, m, v, their scales, P16), `grad` the unit's gradient in any dtype, `fp32`
    makes a piece of it fp32 and clipped (a scratch of `limit` elements). Each parameter is cut at multiples of
    `limit` from its start, which keeps both the fused kernel's vector lanes and the quantization blocks where a
    whole-parameter update has them: the result is `adamw_format_`'s bit for bit. `origin`: where this vector starts
    in the whole block's (a data-parallel rank's shard), so the rounding noise is the whole block's."""
    starts = qstarts(params)
    first = None
    for k, a, z in _pieces(params, lo, lo + grad.numel(), views.m_scale is not None, limit):
        p = params[k]
        q = starts[k] + (a - p.offset) // QBLOCK  # the piece's first quantization block in the block
        first = q if first is None else first
        qa, qz = q - first, q - first + -(-(z - a) // QBLOCK)
        sl = slice(a - lo, z - lo)
        m, v = ((x[sl], None if scale is None else scale[qa:qz])
                for x, scale in ((views.m, views.m_scale), (views.v, views.v_scale)))
        sep = views.p16.data_ptr() != views.master.data_ptr()
        _piece_(views.master[sl], m, v, views.p16[sl] if sep else None, fp32(grad[sl]), step, hp, p.decay,
                seed=seed, block=block, at=origin + a)


@dataclass
class Moment:
    """One moment of a block, as stored: `value` (fp32 or bf16), or 8-bit `codes` with one `absmax` per block of
    QBLOCK values of each parameter (counted from the parameter's start, as torchao and bitsandbytes quantize
    per tensor)."""

    value: Tensor | None = None
    codes: Tensor | None = None
    absmax: Tensor | None = None

    def piece(self, q: int, a: int, z: int) -> tuple[Tensor, Tensor | None]:
        """Elements a..z, whose first quantization block is `q`: (values or codes, absmax or None)."""
        if self.codes is None:
            return self.value[a:z], None
        return self.codes[a:z], self.absmax[q:q + -(-(z - a) // QBLOCK)]


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
        blocks = sum(-(-p.numel // QBLOCK) for p in params)

        def moment() -> Moment:
            if fmt in ("8bit-moments", "bf16-master"):
                return Moment(codes=torch.zeros(numel, dtype=torch.uint8), absmax=torch.zeros(blocks))
            return Moment(value=torch.zeros(numel, dtype=torch.bfloat16 if fmt == "bf16-moments" else torch.float32))
        return BlockStates(master, moment(), moment())


def adamw_format_(states: BlockStates, grad: Tensor, step: int, hp: AdamWHyper, params: Sequence[ParamRange],
                  lo: int, *, seed: int, block: int) -> Tensor:
    """AdamW at 1-based `step` on elements lo..lo+len of block `block`, whose states `states` are in their
    format; `grad` is that slice's fp32 gradient, clipped. The slice cuts each parameter at multiples of
    QBLOCK from its start. Updates `states` in place and returns the slice's new weights in bf16 (the P16 the
    compute reads; for ``bf16-master`` the master itself)."""
    starts = qstarts(params)
    out = torch.empty(grad.numel(), dtype=torch.bfloat16)
    for k, a, z in _pieces(params, lo, lo + grad.numel(), states.m.codes is not None):
        p = params[k]
        q = starts[k] + (a - p.offset) // QBLOCK
        _piece_(states.master[a:z], states.m.piece(q, a, z), states.v.piece(q, a, z), None,
                grad[a - lo:z - lo], step, hp, p.decay, seed=seed, block=block, at=a)
        out[a - lo:z - lo].copy_(states.master[a:z])
    return out


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
