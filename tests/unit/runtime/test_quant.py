"""The arithmetic of compressed optimizer states (lohan/runtime/quant.py): the dynamic map, block-wise 8-bit
codes, stochastic rounding to bfloat16."""

from __future__ import annotations

import math

import pytest
import torch

from lohan.runtime.quant import (
    QBLOCK,
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
    stochastic_round_bf16,
)


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_map_has_256_sorted_values_with_relative_precision_near_zero(signed):
    m = dynamic_map(signed)
    assert m.numel() == 256 and torch.all(m[1:] > m[:-1]) and m[-1] == 1.0 and (m == 0).sum() == 1
    assert bool(m.min() < 0) == signed
    pos = m[m > 0].double()
    assert pos.min() < 1e-6  # the smallest exponent, 10^-6
    # every decade from 1e-6 to 1 has entries, and near zero the gaps are small relative to the values
    for k in range(-6, 0):
        assert ((pos >= 10.0**k) & (pos < 10.0 ** (k + 1))).any(), k
    # the point of the map: small values keep relative precision that a linear 8-bit map (step 1/127) has not
    gaps = (pos[1:] - pos[:-1]) / pos[1:]
    assert gaps[(pos[1:] > 1e-4) & (pos[1:] < 1e-2)].max() < 0.5 and pos[(pos > 1e-4) & (pos < 1 / 127)].numel() >= 20
    if signed:
        assert torch.equal(m[m < 0].abs().sort().values, m[(m > 0) & (m < 1)])  # symmetric but for the 1


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_map_entry_of_each_value_over_its_block_absmax(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5 * QBLOCK + 77, generator=g) * torch.logspace(-8, 0, 5 * QBLOCK + 77)
    x = x if signed else x.square()
    codes, absmax = quantize_blockwise(x, signed)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() and absmax.numel() == 6  # a partial last block
    blocks = [x[i:i + QBLOCK] for i in range(0, x.numel(), QBLOCK)]
    assert torch.equal(absmax, torch.stack([b.abs().max() for b in blocks]))
    qmap = dynamic_map(signed)
    scaled = torch.cat([b / b.abs().max() for b in blocks])
    brute = (qmap.view(1, -1) - scaled.view(-1, 1)).abs().argmin(1)
    assert torch.equal(codes.long(), brute)
    back = dequantize_blockwise(codes, absmax, signed)
    gap = (qmap[1:] - qmap[:-1]).max()
    bound = torch.cat([torch.full((b.numel(),), float(b.abs().max())) for b in blocks]) * gap / 2
    assert torch.all((back - x).abs() <= bound * (1 + 1e-4))  # half the widest gap (the absmax itself: -1, signed)


def test_a_zero_block_stays_zero_and_absmax_is_kept_exact():
    x = torch.zeros(2 * QBLOCK)
    x[QBLOCK + 3] = -2.5
    codes, absmax = quantize_blockwise(x, True)
    back = dequantize_blockwise(codes, absmax, True)
    assert torch.equal(absmax, torch.tensor([0.0, 2.5]))
    assert torch.all(back[:QBLOCK] == 0) and back[QBLOCK + 3] == dynamic_map(True)[0] * 2.5  # -1: the map's lowest
    with pytest.raises(ValueError, match="flat fp32"):
        quantize_blockwise(x.view(2, -1), True)


def test_stochastic_rounding_is_unbiased_repeatable_and_keeps_what_bf16_holds():
    ulp = 2.0**-7  # bfloat16's spacing in [1, 2)
    for frac in (0.125, 0.5, 0.9):
        x = torch.full((200_000,), 1.0 + frac * ulp)
        r = stochastic_round_bf16(x, seed=1, block=2, step=3).float()
        assert set(r.unique().tolist()) == {1.0, 1.0 + ulp}
        assert math.isclose(r.mean().item(), 1.0 + frac * ulp, rel_tol=0, abs_tol=ulp * 0.01)
        neg = stochastic_round_bf16(-x, seed=1, block=2, step=3).float()
        assert torch.equal(neg, -r)  # the same draws round the magnitude the same way
    x = torch.randn(10_000)
    a, b = stochastic_round_bf16(x, 7, 0, 1), stochastic_round_bf16(x, 7, 0, 1)
    assert torch.equal(a, b) and not torch.equal(a, stochastic_round_bf16(x, 7, 0, 2))  # per step
    assert not torch.equal(a, stochastic_round_bf16(x, 7, 1, 1))  # per block
    exact = x.bfloat16().float()
    assert torch.equal(stochastic_round_bf16(exact, 7, 0, 1).float(), exact)  # representable: unchanged
    assert torch.all((a.float() - x).abs() < x.abs() * 2.0**-7 + 1e-30)  # within one ulp
    top = torch.finfo(torch.bfloat16).max
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), top * (1 + 2.0**-9)] * 64)
    whole = stochastic_round_bf16(x, 7, 3, 9)
    parts = [stochastic_round_bf16(x[lo:lo + 4096], 7, 3, 9, offset=lo) for lo in range(0, x.numel(), 4096)]
    assert torch.equal(torch.cat(parts), whole)  # a chunked update rounds as the whole block does
    out = stochastic_round_bf16(special, 0, 0, 0).float().view(64, 4)
    assert torch.all(out[:, 0] == float("inf")) and torch.all(out[:, 1] == -float("inf"))
    assert torch.all(out[:, 2].isnan()) and torch.all(out[:, 3] == top)  # rounding up would overflow: nearest instead
