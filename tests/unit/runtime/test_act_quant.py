"""int8 activation compression, the arithmetic (lohan/runtime/act_quant.py): the error bound, the round trip on every
floating dtype, zero and non-finite rows, layouts, and what a record stores."""

from __future__ import annotations

import pytest
import torch

from lohan.runtime.act_quant import (
    MIN_NUMEL,
    MIN_ROW,
    compressible,
    decode,
    dequantize_rows,
    encode,
    quantize_rows,
    stored_nbytes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _data(dtype: torch.dtype, shape=(6, 40, 96)) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    # rows of very different magnitudes: each row's scale must follow its own absmax
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-2]).unsqueeze(-1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_is_at_most_half_a_step_of_the_rows_scale(dtype):
    x = _data(dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == x.shape[:-1]
    assert int(q.abs().max()) == 127  # each row's absmax maps to +-127
    absmax = x.float().abs().amax(-1)
    assert torch.equal(scale, absmax / 127)
    err = (x.float() - dequantize_rows(q, scale, torch.float32)).abs()
    # half a quantization step, plus the fp32 rounding of x / scale and of q * scale (2 x 127 x 2^-24 of the scale)
    assert bool((err <= scale.unsqueeze(-1) * (0.5 + 2e-5)).all()), float((err / scale.unsqueeze(-1)).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_returns_the_dtype_and_only_casts_the_fp32_result(dtype):
    x = _data(dtype)
    q, scale = quantize_rows(x)
    out = dequantize_rows(q, scale, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, dequantize_rows(q, scale, torch.float32).to(dtype))
    rel = ((out.float() - x.float()).abs().amax(-1) / x.float().abs().amax(-1)).max()
    assert float(rel) < 1 / 127  # at most one step of 1/127 of the row's absmax, the cast included
    # a value exactly on a code comes back exactly: the absmax of every row
    idx = x.float().abs().argmax(-1, keepdim=True)
    if dtype == torch.float32:
        assert torch.equal(out.gather(-1, idx).abs(), x.gather(-1, idx).abs())


def test_rounding_is_half_to_even_and_deterministic():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26])
    q, scale = quantize_rows(x)
    assert float(scale) == 1.0
    assert q[0, :6].tolist() == [127, 0, 2, 2, 0, -2]
    again = quantize_rows(x.clone())
    assert torch.equal(q, again[0]) and torch.equal(scale, again[1])


def test_zero_rows_get_scale_one_and_non_finite_rows_come_back_nan():
    x = torch.randn(4, 32)
    x[0] = 0.0
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    x[3, 7] = 1e-42  # a subnormal row absmax: the scale stays a normal number, codes stay in range
    x[3, :7] = 0.0
    x[3, 8:] = -3e-43
    q, scale = quantize_rows(x)
    assert float(scale[0]) == 1.0 and bool((q[0] == 0).all())
    assert bool(scale[1:3].isnan().all()) and bool((q[1:3] == 0).all())
    out = dequantize_rows(q, scale, torch.float32)
    assert bool(out[:3].eq(0).logical_or(out[:3].isnan()).all()) and bool(out[1:3].isnan().all())
    assert bool((out[0] == 0).all())
    assert int(q[3].abs().max()) <= 127 and float(scale[3]) == torch.finfo(torch.float32).tiny
    assert bool(((out[3] - x[3]).abs() <= scale[3] / 2).all())


def test_what_is_compressed():
    assert compressible(torch.zeros(8, 128))
    assert compressible(torch.zeros(8, 128, dtype=torch.bfloat16))
    assert not compressible(torch.zeros(8, 128, dtype=torch.int64))  # indices must come back exactly
    assert not compressible(torch.zeros(8, 128, dtype=torch.bool))
    assert not compressible(torch.zeros(4096, 1))  # LayerNorm's mean and rstd: one value per row
    assert not compressible(torch.zeros(2, MIN_ROW * 2)[:, :MIN_ROW - 1])
    assert not compressible(torch.zeros(MIN_NUMEL - 1))
    assert not compressible(torch.tensor(3.0))
    assert compressible(torch.zeros(MIN_NUMEL))  # a 1-D tensor is one row


def test_a_record_keeps_values_layouts_and_the_tensors_it_does_not_compress():
    base = torch.randn(8, 16, 24)
    tensors = [base, base.transpose(0, 1), base[:, ::2], torch.arange(2000), torch.randn(2048, 1),
               base.to(torch.bfloat16).permute(2, 0, 1)]
    stored, codes = encode(tensors)
    assert [c is not None for c in codes] == [True, True, True, False, False, True]
    assert len(stored) == 2 * 4 + 2
    assert stored[6] is tensors[3] and stored[7] is tensors[4]  # kept as they are, not copied
    out = decode(stored, codes)
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
    assert out[1].stride() == tensors[1].stride()  # transposed but dense: the layout is kept
    assert out[5].stride() == tensors[5].stride()
    assert torch.equal(out[3], tensors[3]) and torch.equal(out[4], tensors[4])
    for t, o in zip(tensors[:3], out[:3]):
        q, scale = quantize_rows(t.contiguous())
        assert torch.equal(o, dequantize_rows(q, scale, t.dtype))  # the layout does not change a value
    with pytest.raises(ValueError, match="more tensors"):
        decode(stored + [torch.zeros(1)], codes)


def test_stored_bytes_are_what_the_codes_and_scales_take():
    x = torch.randn(4, 32, 256)
    assert stored_nbytes(x, 64) == 4 * 32 * 256 + 4 * 32 * 4  # a quarter of fp32, plus a scale per row
    assert stored_nbytes(x.to(torch.bfloat16), 64) == stored_nbytes(x, 64)
    assert stored_nbytes(torch.randn(2048, 1), 64) == 2048 * 4  # kept
    assert stored_nbytes(torch.randn(3, 100), 64) == 1216  # below MIN_NUMEL: 1200 bytes, aligned up
    q, scale = quantize_rows(x)
    assert stored_nbytes(x, 1) == q.numel() * q.element_size() + scale.numel() * scale.element_size()
