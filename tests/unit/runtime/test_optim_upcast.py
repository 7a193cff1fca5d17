"""The optimizer upcasts bf16 (and scales clipped) gradients through a bounded fp32 scratch, piece by piece;
the update must be the one torch's fused AdamW makes on whole parameters, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.optim.adamw import adamw

import lohan
import lohan.runtime.offload
from lohan.runtime.optim import AdamWHyper, adamw_upcast_
from lohan.runtime.record_buffers import param_ranges
from lohan.store.states import BlockLayout, ParamSpec, block_views
from tests.unit.runtime.test_clipping import batches, config, tiny_cfg

HP = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def layout(sizes: list[int]) -> BlockLayout:
    specs, off = [], 0
    for k, n in enumerate(sizes):
        specs.append(ParamSpec(f"p{k}", (n,), off, n))
        off += n
    return BlockLayout(0, "block", tuple(specs), off, 2, 0)


@pytest.mark.parametrize("lo,hi", [(0, None), (4096, None), (4096, 3 * 4096)])
def test_pieces_update_like_whole_parameters(lo, hi):
    """Parameters at offsets that are not multiples of 16, cut into pieces of 4096 elements from their own
    starts, runs of pieces batched into one scratch: the same bits as torch's fused AdamW on each whole
    parameter (on each parameter's part of a chunk, for a chunk) with the fp32 gradient scaled by the clip
    coefficient."""
    torch.manual_seed(0)
    b = layout([771, 9000, 13, 12289, 4096, 5])
    decays = [True, False, True, True, False, True]
    hi = b.numel if hi is None else hi
    p32, m, v = (torch.randn(b.numel) for _ in range(3))
    v = v.abs()
    g16 = torch.randn(b.numel).to(torch.bfloat16)
    coef = torch.tensor(0.37)

    ref_p, ref_m, ref_v = p32.clone(), m.clone(), v.clone()
    g32 = g16.float().mul_(coef)
    for spec, d, p, mm, vv, g in zip(b.params, decays, *(block_views(t, b) for t in (ref_p, ref_m, ref_v, g32))):
        s, e = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
        if s >= e:
            continue
        a, z = s - spec.offset, e - spec.offset
        adamw([p[a:z]], [g[a:z]], [mm[a:z]], [vv[a:z]], [], [torch.tensor(2.0)], foreach=False,
              fused=True, amsgrad=False, maximize=False, lr=HP.lr, beta1=HP.beta1, beta2=HP.beta2,
              weight_decay=HP.weight_decay if d else 0.0, eps=HP.eps)

    scratch = torch.empty(4096)
    calls = []

    def upcast(piece: torch.Tensor) -> torch.Tensor:
        assert piece.numel() <= scratch.numel()
        calls.append(piece.numel())
        out = scratch[:piece.numel()]
        out.copy_(piece)
        return out.mul_(coef)

    p16 = torch.empty(hi - lo, dtype=torch.bfloat16)
    ours = [t[lo:hi].clone() for t in (p32, m, v)]
    adamw_upcast_(ours[0], g16[lo:hi], ours[1], ours[2], p16, 3, HP, param_ranges(b, decays), lo, upcast, 4096)
    for got, want in zip(ours, (ref_p[lo:hi], ref_m[lo:hi], ref_v[lo:hi])):
        assert torch.equal(got, want)
    assert torch.equal(p16, ours[0].to(torch.bfloat16))
    assert sum(calls) == hi - lo and len(calls) > 1


def test_limit_must_keep_pieces_aligned():
    b = layout([8192])
    t = torch.zeros(8192)
    with pytest.raises(ValueError, match="multiple of 4096"):
        adamw_upcast_(t, t, t, t, t.to(torch.bfloat16), 1, HP, param_ranges(b, [True]), 0, lambda g: g, 1000)


def run(ecfg, data):
    losses = []
    with lohan.init(tiny_cfg(), ecfg) as engine:
        scratch = lohan.runtime.offload.upcast_bytes(engine.store.layout, None, torch.bfloat16)
        for batch in data:
            losses.append(engine.step(batch))
        return losses, engine.state_dict_fp32(), scratch


@pytest.mark.parametrize("compute_dtype", ["bf16", "fp32"])
def test_a_small_scratch_changes_no_bit_of_training(make_dirs, monkeypatch, compute_dtype):
    """bf16 gradients (upcast) and clipped fp32 ones (scaled) through a 4096-element scratch: the same
    training as through one that holds the largest block."""
    ecfg = config(make_dirs(1), compute_dtype=compute_dtype, max_grad_norm=0.5, clip_mode="defer")
    whole = run(ecfg.with_overrides(name="whole"), batches(4))
    monkeypatch.setattr(lohan.runtime.offload, "UPCAST_ELEMS", 4096)
    small = run(ecfg.with_overrides(name="small"), batches(4))
    assert small[2] == 4 * 4096 < whole[2]
    assert small[0] == whole[0]
    for k in whole[1]:
        assert torch.equal(small[1][k], whole[1][k]), k
