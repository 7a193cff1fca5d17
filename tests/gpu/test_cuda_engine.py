"""The engine on CUDA: exactness against a plain PyTorch loop, bf16/fp16, activation tiers, the GPU memory plan.

Exactness (STYLE.md 11): with fp32 compute, a step on CUDA must equal a plain PyTorch loop that runs the same
model on the same GPU (whole-model forward and backward) and updates fp32 master weights with torch's fused
AdamW on the CPU, as the engine does: bit for bit. Both use SDPA's math backend, because the memory-efficient
and flash backward kernels may split the key sequence over thread blocks and sum with atomics (run-to-run
noise of a few ulps that Adam then amplifies to +-lr on near-zero gradients); every other kernel of the model
is deterministic for a given shape. Against the CPU engine only the loss curve is compared (different
kernels round differently).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import lohan
from lohan.models.gpt import build_model
from lohan.runtime.optim import lr_factor, param_groups
from tests.integration.test_engine_equivalence import (
    assert_params_equal,
    batches,
    engine_config,
    engine_run,
    tiny_cfg,
)

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def cuda_reference_run(mcfg, ecfg, data, autocast: torch.dtype | None = None):
    """Plain PyTorch on the GPU, updated like the engine: clip_grad_norm_ on the GPU (where the engine takes the
    norms), fp32 master weights and AdamW(fused) on the CPU (tests/integration/test_engine_equivalence.reference_run, with
    forward, backward and the norm on the GPU).

    Returns the per-step losses and the final master weights (CPU, fp32) by model name.
    """
    master = build_model(mcfg, device="cpu", seed=ecfg.seed)
    model = copy.deepcopy(master).to("cuda")
    opt = torch.optim.AdamW(param_groups(master, ecfg.weight_decay, ecfg.no_decay), lr=ecfg.lr, betas=ecfg.betas,
                            eps=ecfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, ecfg.warmup_steps, ecfg.total_steps, ecfg.min_lr_ratio))
    losses = []
    for idx, tgt in data:
        total = 0.0
        for x, y in zip(idx.chunk(ecfg.micro_batches), tgt.chunk(ecfg.micro_batches)):
            with torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext():
                loss = model(x.to("cuda"), y.to("cuda"))[1] / ecfg.micro_batches
            loss.backward()
            total += float(loss.detach())
        if ecfg.max_grad_norm > 0:  # on the GPU, as a plain GPU loop clips (and the engine takes the norm there)
            torch.nn.utils.clip_grad_norm_(model.parameters(), ecfg.max_grad_norm)
        for pm, pd in zip(master.parameters(), model.parameters()):
            pm.grad = pd.grad.float().cpu()
            pd.grad = None
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pm, pd in zip(master.parameters(), model.parameters()):
                pd.copy_(pm)
        losses.append(total)
    return losses, {n: p.detach() for n, p in master.named_parameters()}


def _math_sdpa():
    return sdpa_kernel(SDPBackend.MATH)


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("mode,micro_batches", [("optimized", 1), ("serial", 2)])
def test_fp32_on_cuda_is_bit_exact_with_a_torch_loop(make_dirs, mode, micro_batches):
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(2), device="cuda", mode=mode, micro_batches=micro_batches)
    with _math_sdpa():
        ref_losses, ref_params = cuda_reference_run(mcfg, ecfg, batches(5, 4, 32, 256))
        losses, params = [], None
        with lohan.init(mcfg, ecfg) as engine:
            assert engine.device.is_cuda
            for batch in batches(5, 4, 32, 256):
                losses.append(engine.step(batch))
                assert engine.last_stats.gpu_mem_gib > 0
            params = engine.state_dict_fp32()
    assert losses == ref_losses, [a - b for a, b in zip(losses, ref_losses)]
    assert_params_equal(params, ref_params)


def test_fp32_on_cuda_follows_the_cpu_engine(make_dirs):
    """Same model, data and settings on the two devices: the loss curves agree to rounding (GPU and CPU
    kernels differ in summation order, so the bits do not)."""
    mcfg = tiny_cfg(n_layer=2)
    runs = {}
    for device in ("cpu", "cuda"):
        ecfg = engine_config(make_dirs(1, device), device=device, lr=1e-3, name=f"dev-{device}")
        runs[device], _ = engine_run(mcfg, ecfg, batches(4, 4, 32, 256))
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert math.isclose(gpu[0], cpu[0], rel_tol=1e-5), (gpu, cpu)  # same weights: forward rounding only
    for a, b in zip(gpu, cpu):
        assert math.isclose(a, b, rel_tol=1e-3), (gpu, cpu)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_on_cuda_trains(make_dirs, dtype):
    """bf16 (and fp16 with its loss scale) on CUDA, default attention kernels: one repeated batch is learnt,
    and the curve follows a plain torch autocast loop on the GPU within rounding noise."""
    mcfg = tiny_cfg()
    ecfg = engine_config(make_dirs(1), device="cuda", compute_dtype=dtype, lr=3e-3)
    batch = next(batches(1, 4, 32, 256))
    losses, params = engine_run(mcfg, ecfg, [batch] * 10)
    assert all(math.isfinite(v) for v in losses), losses
    # fp16's first steps may overflow at the initial loss scale and be skipped (GradScaler's behaviour)
    assert losses[-1] < losses[0] - (0.5 if dtype == "bf16" else 0.3), losses
    assert all(torch.isfinite(p).all() for p in params.values())
    if dtype == "bf16":
        ref, _ = cuda_reference_run(mcfg, ecfg, [batch] * 10, autocast=torch.bfloat16)
        diffs = [abs(a - b) for a, b in zip(losses, ref)]
        assert max(diffs) < 2e-2, f"loss curves diverge: {diffs}"


# ------------------------------------------------------------------------------------ activation tiers
def _run_tiers(mcfg, ecfg, data):
    losses = []
    with lohan.init(mcfg, ecfg) as engine:
        for batch in data:
            losses.append(engine.step(batch))
        store, plan = engine.activations.store, engine.activations.plan
        pinned = {}
        for tier, pool in (("cpu", store.cpu_pool), ("ssd", store.staging_pool)):
            if pool is not None:
                with pool.acquire(4096) as buf:
                    pinned[tier] = buf.tensor.is_pinned()
        params = engine.state_dict_fp32()
    return losses, params, plan, pinned


@pytest.mark.parametrize("policy,act_mem,tiers", [
    ("swap-all", "256MiB", ("cpu", "cpu", "cpu", "keep")),
    ("swap-all", 4096, ("ssd", "ssd", "ssd", "keep")),
    ("interblock", 4096, ("ssd", "ssd", "ssd", "keep")),
])
def test_swapped_activations_on_cuda_equal_no_swap(make_dirs, policy, act_mem, tiers):
    """Records that leave the GPU (to pinned main memory, or through pinned staging to the SSDs) and come
    back one block ahead give the very gradients of keeping everything on the device."""
    mcfg = tiny_cfg(n_layer=4)
    data = list(batches(3, 4, 32, 256))
    with _math_sdpa():
        keep = _run_tiers(mcfg, engine_config(make_dirs(1, "keep"), device="cuda", act_policy="recompute-all",
                                              name="keep"), data)
        swap = _run_tiers(mcfg, engine_config(make_dirs(2, "swap"), device="cuda", act_policy=policy,
                                              act_mem=act_mem, name="swap"), data)
    assert keep[2].block_tiers == ("keep",) * 4
    assert swap[2].block_tiers == tiers
    assert swap[3] and all(swap[3].values()), f"activation buffers not page-locked: {swap[3]}"
    assert swap[0] == keep[0]
    for k in keep[1]:
        assert torch.equal(swap[1][k], keep[1][k]), k


# ------------------------------------------------------------------------------------------ memory plan
PLAN_TOLERANCE = (0.25, 1.0)
"""The measured peak of a step's allocated GPU bytes over the plan's (less its fragmentation margin) must lie
in this range. Above 1: the plan under-counts, and a run it admits can run out of GPU memory; far below 1: the
plan is so loose that it refuses models that fit. What the caching allocator reserves must stay within the
whole plan, fragmentation margin included (the plan is budgeted against the free memory)."""


def test_gpu_memory_plan_bounds_the_measured_peak(make_dirs):
    from lohan.plan.planner import gpu_need

    mcfg = tiny_cfg(vocab_size=1024, n_layer=4, d_model=512, n_head=8, seq_len=256)
    batch, seq = 8, 256
    ecfg = engine_config(make_dirs(1), device="cuda", compute_dtype="bf16", cpu_mem="4GiB", act_mem="1GiB",
                         lr=1e-4)
    data = list(batches(2, batch, seq, mcfg.vocab_size))
    with lohan.init(mcfg, ecfg) as engine:
        engine.step(data[0])  # profiling and bandwidth probes: not part of a step's peak
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what the first step cached and no longer holds
        torch.cuda.reset_peak_memory_stats()
        engine.step(data[1])
        torch.cuda.synchronize()
        # absolute, not above what stays between steps: the plan counts what is kept (cuBLAS workspaces,
        # buffers the engine keeps on the device) as well as what a step makes
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        plan, hw = engine.activations.plan, engine.activations.profile.hardware
    need = gpu_need(mcfg, batch, seq, hw, "bf16", ecfg.micro_batches, ecfg.prefetch_depth, plan.swap)
    predicted = sum(need.values())
    ratio = peak / (predicted - need["fragmentation"])
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in need.items())
    report = (f"gpu memory plan: predicted {predicted / 2**20:.1f} MiB ({parts}), measured peak {peak / 2**20:.1f} "
              f"MiB allocated, {reserved / 2**20:.1f} MiB reserved; ratio {ratio:.2f} of the plan without its "
              f"fragmentation margin; swap {plan.swap or 'block inputs'}")
    print(report)
    lo, hi = PLAN_TOLERANCE
    assert lo <= ratio <= hi, report
    assert reserved <= predicted, report


# --------------------------------------------------------------------------------------------- hardware
def test_detect_hardware_reports_the_gpu(tmp_path, monkeypatch):
    from lohan.app.fit import detect_hardware

    props = torch.cuda.get_device_properties(0)
    m = detect_hardware((str(tmp_path),), device="cuda", compute_dtype="bf16")
    assert not m.device_is_host
    free, total = torch.cuda.mem_get_info()
    assert 0 < m.hardware.gpu_mem <= total == props.total_memory  # what is free: the context holds some
    assert m.hardware.name.startswith(torch.cuda.get_device_name().replace(" ", "_"))
    # a rate, so not under the stream sanitizer (gpu_suite's cuda-sanitizer step), which checks every kernel
    # launch on the host (0.78 TFLOPS on an H100 there, 724 without)
    if not os.environ.get("TORCH_CUDA_SANITIZER"):
        assert m.hardware.thp_g > 1e12, f"bf16 matmul measured at {m.hardware.thp_g / 1e12:.3g} TFLOPS"
    monkeypatch.delenv("LOHAN_DEVICE", raising=False)  # the suite pins 'auto' to the CPU (conftest.py)
    auto = detect_hardware((str(tmp_path),), device="auto", gpu_mem=12 << 30)
    assert not auto.device_is_host and auto.hardware.gpu_mem == 12 << 30  # a smaller budget than the device's


def test_capacity_check_uses_the_gpu_memory(make_dirs):
    """The capacity check before a run measures this GPU and holds the plan to its memory, or to the smaller
    gpu_mem a user gives (a tiny model fits the device, not 64 KiB)."""
    from lohan.app.fit import detect_hardware, fit_report

    mcfg = tiny_cfg()
    big = detect_hardware((make_dirs(1)[0],), device="cuda", compute_dtype="bf16")
    small = detect_hardware((make_dirs(1, "small")[0],), device="cuda", compute_dtype="bf16", gpu_mem=1 << 16)
    assert fit_report(mcfg, big, 4, 32).fits
    report = fit_report(mcfg, small, 4, 32)
    assert not report.fits and any(r.startswith("GPU memory") for r in report.capacity.reasons), report.format()
