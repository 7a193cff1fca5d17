"""`ParamGrads`: a block's gradient as autograd's per-parameter tensors, read as the flat vector the optimizer
slices (a view of one parameter's tensor, or the parts of several), and gathered without a flat buffer between."""

from __future__ import annotations

import pytest
import torch

from lohan.runtime.optim import AdamWHyper, ParamRange, adamw_chunk_
from lohan.runtime.param_grads import ParamGrads


def _grads():
    parts = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
    return parts, torch.cat([p.reshape(-1) for p in parts]), [0, 12, 17]


def test_slices_are_views_of_the_parameters_own_tensors_or_their_parts():
    parts, flat, starts = _grads()
    g = ParamGrads(parts, starts)
    assert g.numel() == flat.numel() == 21 and g.tensor is g
    one = g[13:16]
    assert isinstance(one, torch.Tensor) and one.data_ptr() == parts[1].data_ptr() + 4  # a view, not a copy
    assert torch.equal(one, flat[13:16])
    for lo, hi in [(10, 14), (0, 21), (11, 20), (12, 21)]:
        some = g[lo:hi]
        out = torch.empty(hi - lo)
        some.copy_into(out) if isinstance(some, ParamGrads) else out.copy_(some)
        assert torch.equal(out, flat[lo:hi]), (lo, hi)
    assert torch.equal(g[10:20][2:5], flat[12:15])  # a slice of a slice counts from its own start
    with pytest.raises(ValueError, match="range of elements"):
        g[0:10:2]
    g.release()
    with pytest.raises(RuntimeError, match="released"):
        g[0:3]


def test_a_gradient_not_contiguous_or_of_another_dtype_is_copied_and_counted():
    t = torch.randn(4, 3)
    g, copied = ParamGrads.of([t, t.t(), t.to(torch.bfloat16)], [0, 12, 24], torch.float32)
    assert copied == 2 * 12 * 4 and g.parts[0].data_ptr() == t.data_ptr()
    assert ParamGrads.of([t], [0], torch.float32)[1] == 0


def test_a_chunk_across_parameters_updates_as_the_flat_gradient_does():
    parts, flat, starts = _grads()
    params = [ParamRange(s, p.numel(), tuple(p.shape)) for s, p in zip(starts, parts)]
    hp = AdamWHyper(1e-2, 0.9, 0.95, 1e-8, 0.1)
    out = []
    for g in (flat[4:19], ParamGrads(parts, starts)[4:19]):
        p32, m, v = torch.linspace(-1, 1, 15), torch.full((15,), 0.1), torch.full((15,), 0.2)
        adamw_chunk_(p32, g, m, v, torch.empty(15), 3, hp, params, 4)
        out.append((p32, m, v))
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["cpu", "sim or cuda", "micro-batches", "fp16", "a pool of two"])
def test_the_plan_hands_autograds_gradients_over_only_where_it_counts_every_one_on_the_cpu(case):
    from lohan.config import EngineConfig, get_model_config
    from lohan.plan.pools import model_geometry, plan_host_memory

    mcfg = get_model_config("tiny", vocab_size=256, n_layer=2, d_model=64, n_head=4, seq_len=32)
    kw = dict(compute_dtype="fp16" if case == "fp16" else "fp32", cpu_mem="512MiB", max_grad_norm=0.0,
              micro_batches=2 if case == "micro-batches" else 1)
    ecfg = EngineConfig(**kw)
    geom = model_geometry(mcfg, ecfg.compute_dtype)
    every = sum(geom.store.blocks[i].numel * 4 for i in range(len(geom.store.blocks)))
    if case == "a pool of two":  # naive mode, no stash: the grads pool bounds the gradients in flight (two blocks)
        ecfg = ecfg.with_overrides(mode="naive", clip_mode="speculate")
    plan = plan_host_memory(geom, ecfg, host_device=case != "sim or cuda", check=False)
    assert plan.grads_handed == (case == "cpu")
    if plan.grads_handed:  # the plan still counts them (autograd's now), and says whose they are
        assert plan.grads + plan.grad_stash >= every and "autograd's" in plan.describe()
