"""Compressed optimizer states, the arithmetic (issue "Compressed tiers"): block-wise 8-bit quantization with the
dynamic map, and stochastic rounding to bfloat16.

- **Block-wise dynamic 8-bit quantization** (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
  ICLR 2022, §2; the scheme of bitsandbytes' and torchao's 8-bit Adam): a tensor is cut into blocks of
  `QBLOCK` elements; each block is divided by its absolute maximum (kept in fp32) and each value is stored as the
  index of the nearest entry of a 256-entry *dynamic* map (Dettmers 2016, "8-Bit Approximations for
  Parallelism in Deep Learning"): a sign, a run of zero bits that sets a power-of-ten exponent, an indicator
  bit, and a linear fraction in the bits left, so small magnitudes keep relative precision. The first moment
  uses the signed map, the second (never negative) the unsigned one, which spends the sign bit on precision.
- **Stochastic rounding to bfloat16** (as in Zamirai et al. 2020, "Revisiting BFloat16 Training", and
  torchao's bf16 optimizers): an fp32 value rounds up to the next bfloat16 with probability equal to its
  distance from the one below, so updates far smaller than a bf16 ulp still move the weights on average. The
  random bits are a hash of (seed, block, step, element index): a run and its resume draw the same bits, and
  so do a chunked update and a whole-block one.

Everything here is elementwise or per block, deterministic for a given input and seed, and exact-repeatable
on any thread count: the engine and an in-memory reference get the same bits.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

QBLOCK = 256
"""Elements per quantization block: one fp32 absmax per 256 values (1/64 of a byte per value)."""


@functools.cache
def dynamic_map(signed: bool) -> Tensor:
    """The 256 values of the dynamic quantization map, sorted, in [-1, 1] (signed) or [0, 1] (unsigned).

    Seven exponents, 10^-6 .. 10^0; at exponent 10^(i-6) the fraction takes 2^i values (signed, each with both
    signs) or 2^(i+1) (unsigned: the sign bit's place), the midpoints of an even split of [0.1, 1]; then 0 and
    1: 2 x 127 + 2 = 256 entries either way. The arithmetic is float32, as bitsandbytes and torchao compute
    their maps, so the codes can be compared with theirs."""
    values: list[float] = []
    for i in range(7):
        count = 2 ** (i + (0 if signed else 1))
        edges = torch.linspace(0.1, 1.0, count + 1)
        mids = (10.0 ** (i - 6) * ((edges[:-1] + edges[1:]) / 2.0)).tolist()
        values += mids + ([-x for x in mids] if signed else [])
    values += [0.0, 1.0]
    out = torch.tensor(sorted(values), dtype=torch.float32)
    if out.numel() != 256 or out.unique().numel() != 256:
        raise AssertionError(f"the dynamic map has {out.unique().numel()} distinct values of {out.numel()}, not 256")
    return out


_BUCKET_SHIFT = 12
"""Floats sharing their top 20 bits form a bucket (a relative width of 2^-11); no bucket holds two midpoints of
either map (adjacent entries are at least 0.35% apart), so a table of 2^20 entries finds the nearest code."""


@functools.cache
def _midpoints(signed: bool) -> Tensor:
    """The 255 midpoints between adjacent map entries (fp32), and +inf after them."""
    q = dynamic_map(signed)
    return torch.cat([(q[:-1] + q[1:]) / 2, torch.tensor([float("inf")])])


@functools.cache
def _code_table(signed: bool) -> tuple[Tensor, Tensor]:
    """Per bucket of float bit patterns (`_BUCKET_SHIFT`): how many midpoints lie at or below its smallest value
    (int32), and the midpoint inside it, if any (fp32; +inf if none). A value's code is the first, plus one if
    the second is at or below it."""
    mids = _midpoints(signed)
    top = torch.arange(1 << (32 - _BUCKET_SHIFT), dtype=torch.int64)
    low = top << _BUCKET_SHIFT
    high = low | ((1 << _BUCKET_SHIFT) - 1)
    negative = top >= 1 << (31 - _BUCKET_SHIFT)  # sign bit set: the largest pattern is the smallest value

    def as_float(bits: Tensor) -> Tensor:
        return (bits - (1 << 32) * (bits >= 1 << 31)).to(torch.int32).view(torch.float32)
    lo_val, hi_val = as_float(torch.where(negative, high, low)), as_float(torch.where(negative, low, high))
    first = torch.searchsorted(mids[:-1], lo_val, right=True)
    last = torch.searchsorted(mids[:-1], hi_val, right=True)
    finite = torch.isfinite(lo_val) & torch.isfinite(hi_val) & (lo_val.abs() <= 1) & (hi_val.abs() <= 1)
    if bool(((last - first > 1) & finite).any()):
        raise AssertionError("a bucket of the code table holds two midpoints of the dynamic map")
    return first.to(torch.int32), mids[first]


_TINY_BUCKET = 0x322BC
"""The bucket of 1e-8 (`_BUCKET_SHIFT`): every value of smaller magnitude has the code of 0 (the midpoints nearest 0
are ~3e-7 away), so the compiled update's table (`compact_code_table`) starts there."""
_ONE_BUCKET = 0x3F800  # the bucket of 1.0, the largest magnitude a scaled value has


@functools.cache
def compact_code_table(signed: bool) -> Tensor:
    """`_code_table`'s counts (uint8) for the buckets of magnitudes 1e-8 .. 1, positive ones then negative ones: the
    compiled update looks codes up in this (109 KB, cache-resident) and corrects by one against `_midpoints`."""
    table, _ = _code_table(signed)
    span = torch.arange(_TINY_BUCKET, _ONE_BUCKET + 1)
    return torch.cat([table[span], table[span + (1 << (31 - _BUCKET_SHIFT))]]).to(torch.uint8)


def _nearest_codes(scaled: Tensor, signed: bool) -> Tensor:
    """The index of the nearest map entry of each value of `scaled` (fp32 in [-1, 1]); a value exactly between two
    entries takes the larger. The same as ``searchsorted(midpoints, x, right=True)``, without the binary search
    (`index_select`: twice as fast as indexing on the CPU)."""
    table, inside = _code_table(signed)
    bucket = (scaled.view(torch.int32) >> _BUCKET_SHIFT) & ((1 << (32 - _BUCKET_SHIFT)) - 1)
    code = torch.index_select(table, 0, bucket)
    code += (torch.index_select(inside, 0, bucket) <= scaled).to(torch.int32)
    return code.to(torch.uint8)


def quantize_blockwise(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """Codes (uint8, ``x``'s numel) and per-block absmax (fp32, ``ceil(numel / QBLOCK)``) of a flat fp32 ``x``.

    Each value is divided by its block's absmax (an all-zero block by 1) and coded as the nearest map entry
    (ties to the larger). A trailing partial block is its own block."""
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize_blockwise takes a flat fp32 tensor, not {x.dtype} of shape {tuple(x.shape)}")
    n = x.numel()
    full = n // QBLOCK * QBLOCK
    parts = [x[:full].view(-1, QBLOCK)] if full else []
    if full < n:  # (the tail is its own block: padded with zeros, which change no absmax)
        tail = torch.zeros(QBLOCK, dtype=torch.float32)
        tail[:n - full] = x[full:]
        parts.append(tail.view(1, QBLOCK))
    codes, absmax = [], []
    for view in parts:
        amax = view.abs().amax(1)
        scaled = view / torch.where(amax > 0, amax, torch.ones_like(amax)).unsqueeze(1)
        codes.append(_nearest_codes(scaled.reshape(-1), signed))
        absmax.append(amax)
    return torch.cat(codes)[:n] if len(codes) > 1 else codes[0][:n], torch.cat(absmax)


def dequantize_blockwise(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """The fp32 values of `quantize_blockwise`'s codes and absmax."""
    qmap = dynamic_map(signed)
    n = codes.numel()
    values = torch.index_select(qmap, 0, codes.to(torch.int32))
    full = n // QBLOCK * QBLOCK
    out = torch.empty(n, dtype=torch.float32)
    if full:
        torch.mul(values[:full].view(-1, QBLOCK), absmax[:full // QBLOCK].unsqueeze(1), out=out[:full].view(-1, QBLOCK))
    if full < n:
        torch.mul(values[full:], absmax[-1], out=out[full:])
    return out


_M32 = 0xFFFF_FFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 tensors holding values below 2^32: each product
    stays below 2^63, so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def _key(seed: int, block: int, step: int) -> int:
    k = torch.tensor([seed & _M32], dtype=torch.int64)
    for part in (block, step):
        k = _mix32(k ^ (part & _M32))
    return int(_mix32(k))


def rounding_noise(n: int, seed: int, block: int, step: int, offset: int = 0) -> Tensor:
    """16 random bits (int32 in [0, 2^16)) for elements ``offset .. offset + n`` of a block's flat vector at a
    step: a hash of (seed, block, step, element index), so any slice of the vector draws the same bits as the
    whole (the engine updates a block in chunks; a reference updates it at once). The per-element hash is two
    multiply-xorshift rounds on 32-bit values held in int64, with multipliers below 2^31 so that no product
    overflows (the bits are the same on every platform)."""
    key = _key(seed, block, step)
    x = ((torch.arange(offset, offset + n, dtype=torch.int64) & _M32) * 0x5BD1E995 + key) & _M32
    x ^= x >> 15
    x = (x * 0x27D4EB2D) & _M32
    x ^= x >> 13
    return (x & 0xFFFF).to(torch.int32)


def stochastic_round_bf16(x: Tensor, seed: int, block: int, step: int, offset: int = 0) -> Tensor:
    """``x`` (flat fp32, elements ``offset ..`` of block ``block``'s vector) rounded to bfloat16 stochastically:
    up to the next bf16 value with probability equal to the dropped fraction of an ulp. The 16 dropped mantissa
    bits get `rounding_noise` added before they are cut; a carry into bit 16 is the round-up. Non-finite values,
    and values whose rounding would overflow to inf, round to nearest instead."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"stochastic_round_bf16 takes a flat fp32 tensor, not {x.dtype} of shape {tuple(x.shape)}")
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + rounding_noise(x.numel(), seed, block, step, offset)) & ~0xFFFF).view(torch.float32)
    safe = torch.isfinite(rounded) & torch.isfinite(x)
    return torch.where(safe, rounded, x).to(torch.bfloat16)
