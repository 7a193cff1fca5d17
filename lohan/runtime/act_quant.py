"""Activation compression (issue "Compressed tiers", ``act_compress: int8``): symmetric int8 per row.

PyAO (seed 000, §4.3 and §5.3) quantizes each saved activation symmetrically right before it is offloaded, moves
and keeps it quantized, and dequantizes it right before the computation that consumes it. Here the unit is an
activation *record* (`runtime/activation_store.py`): when a record leaves the device for the CPU or SSD tier, each
of its floating tensors worth it (`compressible`) is replaced by two, made on the device before the copy:

- codes: int8, the tensor's shape (and, for a dense tensor, its memory layout), ``round(x / scale)`` with
  round-half-to-even (``torch.round``), so every value lands in [-127, 127];
- scales: fp32, one per row of the last dim (``x.shape[:-1]``), ``absmax(row) / 127``. A row of zeros gets scale 1
  (its codes are 0 whatever the scale; 1 keeps the division finite). A scale never goes below the smallest normal
  fp32 (`_MIN_SCALE`): ``absmax / 127`` of a row of subnormals would round with a large relative error and could
  put a code past 127. A row holding inf or NaN gets scale NaN (and codes 0), so the whole row comes back NaN: a
  non-finite activation stays non-finite, and a step the fp16 loss scaler must skip is still skipped.

Dequantization is ``codes * scale`` in fp32, cast to the tensor's own dtype, on the device just after the record
comes back and before the block's recompute uses it. The error per element is at most ``scale / 2`` (plus fp32
rounding, a few parts in 10^7 of the scale) before that cast, and the cast to bf16/fp16 adds its own rounding.

Everything here is elementwise or per row, deterministic, and the same kernels run for the engine and for any
reference that applies `quantize_rows` / `dequantize_rows` to the same tensors: the bits agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lohan.config import ACT_COMPRESSIONS

MODES = ACT_COMPRESSIONS
"""The values of ``EngineConfig.act_compress``."""

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes compressed; integer and bool outputs (indices, masks, RNG states) must come back exactly."""

MIN_ROW = 16
"""Shorter rows are kept as they are: each row's 4-byte scale eats the saving (LayerNorm's per-token mean and rstd,
one fp32 value per row, would grow from 4 bytes to 5)."""

MIN_NUMEL = 1024
"""Smaller tensors are kept as they are: the second stored tensor (the scales) costs a 64-byte aligned slot and two
more kernels, for at most ~3 KiB saved."""

_MIN_SCALE = torch.finfo(torch.float32).tiny


def compressible(t: Tensor) -> bool:
    """Whether a record stores `t` as int8 codes and row scales (see `MIN_ROW`, `MIN_NUMEL`, `FLOATS`)."""
    return t.dtype in FLOATS and t.dim() >= 1 and t.shape[-1] >= MIN_ROW and t.numel() >= MIN_NUMEL


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 codes shaped and laid out like `x`, fp32 scales of shape ``x.shape[:-1]``), see the module docstring."""
    lo, hi = torch.aminmax(x, dim=-1)
    absmax = torch.maximum(hi, -lo).float()  # NaN anywhere in a row makes its absmax NaN
    finite = torch.isfinite(absmax)
    scale = torch.where(absmax > 0, absmax / 127, 1.0).clamp_min_(_MIN_SCALE)
    divisor = torch.where(finite, scale, torch.inf)  # a non-finite row: finite values / inf -> 0, the rest NaN
    codes = torch.div(x, divisor.unsqueeze(-1))  # fp32: a tensor of a wider dtype promotes x
    codes.round_()
    codes.nan_to_num_(0.0)  # NaN only in non-finite rows, whose scale is NaN below (their codes do not matter)
    return codes.to(torch.int8), torch.where(finite, scale, torch.nan)


def dequantize_rows(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``codes * scale`` in fp32, cast to `dtype`; laid out like `codes`."""
    out = codes * scale.unsqueeze(-1)  # int8 x fp32 tensor -> fp32
    return out if dtype == torch.float32 else out.to(dtype)


def stored_nbytes(t: Tensor, align: int) -> int:
    """Bytes `t` takes in a compressed record whose tensors each start on an `align`-byte boundary."""
    def up(n: int) -> int:
        return -(-n // align) * align

    if compressible(t):
        return up(t.numel()) + up(math.prod(t.shape[:-1]) * 4)
    return up(t.numel() * t.element_size())


def _dense(t: Tensor) -> bool:
    """Whether `t` covers its memory without gaps or overlap, in any dim order (its layout is then kept)."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _same_layout(t: Tensor, stride: tuple[int, ...]) -> bool:
    """Whether `t` has `stride` where it matters (a dim of size 1 may have any stride)."""
    return all(a == b for a, b, n in zip(t.stride(), stride, t.shape) if n != 1)


@dataclass(frozen=True)
class Int8Rows:
    """How one tensor of a record was stored: as two (codes, scales); it comes back in `dtype` with `stride`."""

    dtype: torch.dtype
    stride: tuple[int, ...] | None
    """The layout to restore (a dense tensor's; a view op in the recompute must meet the layout forward made);
    None: not dense, any layout will do, as for an uncompressed record."""


def encode(tensors: list[Tensor]) -> tuple[list[Tensor], list[Int8Rows | None]]:
    """The tensors a compressed record stores in place of `tensors` (codes and scales for each compressible one,
    the others as they are), and per input tensor how to get it back (None: stored as it is)."""
    stored: list[Tensor] = []
    codes: list[Int8Rows | None] = []
    for t in tensors:
        if compressible(t):
            stored.extend(quantize_rows(t))
            codes.append(Int8Rows(t.dtype, tuple(t.stride()) if _dense(t) else None))
        else:
            stored.append(t)
            codes.append(None)
    return stored, codes


def decode(stored: list[Tensor], codes: list[Int8Rows | None]) -> list[Tensor]:
    """The record's tensors from what `encode` stored (dequantized on the device `stored` is on)."""
    out: list[Tensor] = []
    it = iter(stored)
    for c in codes:
        if c is None:
            out.append(next(it))
            continue
        q, scale = next(it), next(it)
        t = dequantize_rows(q, scale, c.dtype)
        if c.stride is not None and not _same_layout(t, c.stride):
            fixed = t.new_empty_strided(t.shape, c.stride)
            fixed.copy_(t)
            t = fixed
        out.append(t)
    if next(it, None) is not None:
        raise ValueError("a compressed record holds more tensors than its codes describe")
    return out
