"""AdamW on compressed states (lohan/runtime/format_adamw.py): exact is torch's AdamW, a chunked update is the
whole block's bit for bit in every format, and the compressed formats track fp32 AdamW."""

from __future__ import annotations

import pytest
import torch

from lohan.plan.formats import FORMATS
from lohan.runtime import format_kernel
from lohan.runtime.format_adamw import BlockStates, FormatAdamW, adamw_format_
from lohan.runtime.optim import AdamWHyper, ParamRange

HP = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SHAPES = [(64, 100), (100,), (37, 64)]  # 6400 + 100 + 2368: not a multiple of the 256-value blocks


pytestmark = pytest.mark.usefixtures("update_path")  # both update paths (conftest.py)


def block(seed: int = 0) -> tuple[torch.Tensor, list[ParamRange]]:
    g = torch.Generator().manual_seed(seed)
    ranges, offset = [], 0
    for k, shape in enumerate(SHAPES):
        n = int(torch.tensor(shape).prod())
        ranges.append(ParamRange(offset, n, shape, decay=k != 1))  # the vector (a bias) is not decayed
        offset += n
    return torch.randn(offset, generator=g) * 0.05, ranges


def grads(n: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """Gradients of a different scale per parameter (1e-3, 1, 1e-2), as a model's layers have."""
    g = torch.Generator().manual_seed(seed)
    _, ranges = block()
    scale = torch.cat([torch.full((r.numel,), s) for r, s in zip(ranges, (1e-3, 1.0, 1e-2))])
    return [torch.randn(n, generator=g) * scale for _ in range(steps)]


def test_exact_is_torch_adamw_bit_for_bit():
    flat, ranges = block()
    params = [torch.nn.Parameter(flat[r.offset:r.offset + r.numel].view(r.shape).clone()) for r in ranges]
    opt = torch.optim.AdamW([{"params": [params[0], params[2]], "weight_decay": HP.weight_decay},
                             {"params": [params[1]], "weight_decay": 0.0}], lr=HP.lr, betas=(HP.beta1, HP.beta2),
                            eps=HP.eps, fused=True)
    ours = FormatAdamW("exact", [(flat, ranges)], HP)
    for g in grads(flat.numel(), 5):
        for p, r in zip(params, ranges):
            p.grad = g[r.offset:r.offset + r.numel].view(r.shape).clone()
        opt.step()
        ours.step([g])
    assert torch.equal(ours.weights(0), torch.cat([p.detach().reshape(-1) for p in params]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_chunked_update_is_the_whole_blocks_bit_for_bit(fmt):
    flat, ranges = block()
    whole = FormatAdamW(fmt, [(flat, ranges)], HP, seed=5)
    chunked = FormatAdamW(fmt, [(flat, ranges)], HP, seed=5)
    for step, g in enumerate(grads(flat.numel(), 4), start=1):
        want = whole.step([g])[0]
        st = chunked.states[0]
        # the engine's chunks: each parameter cut at multiples of the chunk from its own start
        cuts = [(r.offset + a, r.offset + min(r.numel, a + 1024)) for r in ranges for a in range(0, r.numel, 1024)]
        got = [adamw_format_(st, g[a:b], step, HP, ranges, a, seed=5, block=0) for a, b in cuts]
        assert torch.equal(torch.cat(got), want), step
        assert torch.equal(chunked.weights(0), whole.weights(0))
        for name in ("m", "v"):
            a, b = getattr(whole.states[0], name), getattr(st, name)
            for field in ("value", "codes", "absmax"):
                if getattr(a, field) is not None:
                    assert torch.equal(getattr(a, field), getattr(b, field)), (step, name, field)
    if fmt in ("8bit-moments", "bf16-master"):
        with pytest.raises(ValueError, match="multiples of 256 from its start"):
            adamw_format_(chunked.states[0], g[100:300], 5, HP, ranges, 100, seed=5, block=0)


@pytest.mark.parametrize("fmt,tolerance", [("bf16-moments", 0.01), ("8bit-moments", 0.05), ("bf16-master", 0.08)])
def test_compressed_formats_track_fp32_adamw(fmt, tolerance):
    """After 30 steps the weights' change differs from fp32 AdamW's by a small share of that change."""
    flat, ranges = block()
    exact, ours = FormatAdamW("exact", [(flat, ranges)], HP), FormatAdamW(fmt, [(flat, ranges)], HP)
    for g in grads(flat.numel(), 30):
        exact.step([g])
        ours.step([g])
    moved = exact.weights(0) - flat
    gap = (ours.weights(0) - exact.weights(0)).norm() / moved.norm()
    assert 0 < gap < tolerance, gap


def test_a_bf16_master_keeps_updates_below_its_rounding_step_on_average():
    """Updates of 1/10 of a bf16 ulp: rounded to nearest the weights never move; rounded stochastically they
    move by the sum of the updates, on average."""
    n = 50_000
    flat = torch.ones(n)
    ranges = [ParamRange(0, n, (n,), decay=False)]
    tiny = AdamWHyper(lr=2.0**-7 / 10, beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0)  # a step of lr each
    opt = FormatAdamW("bf16-master", [(flat, ranges)], tiny, seed=3)
    for _ in range(20):
        opt.step([-torch.ones(n)])  # AdamW with beta 0: each step adds lr
    mean = opt.weights(0).mean().item()
    assert abs(mean - (1 + 20 * tiny.lr)) < 0.01 * 20 * tiny.lr
    assert BlockStates.zeros("bf16-master", ranges).master.dtype == torch.bfloat16


def test_8bit_moments_are_torchaos_adamw8bit():
    """torchao's AdamW8bit (block-wise 8-bit m and v, the same dynamic maps, blocks of 256 per tensor) on a
    tensor it quantizes (4096+ values): the weights agree to float rounding, while both are ~1.6% of the
    movement away from fp32 AdamW (the quantization itself)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    from torchao.optim.quant_utils import create_dynamic_map

    from lohan.runtime.quant import dynamic_map

    for signed in (True, False):
        assert torch.equal(torch.tensor(create_dynamic_map(signed=signed)), dynamic_map(signed))
    n, shape = 64 * 128, (64, 128)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(n, generator=g) * 0.05
    ranges = [ParamRange(0, n, shape, decay=True)]
    p = torch.nn.Parameter(flat.view(shape).clone())
    theirs = torchao_optim.AdamW8bit([p], lr=HP.lr, betas=(HP.beta1, HP.beta2), eps=HP.eps,
                                     weight_decay=HP.weight_decay, block_size=256)
    ours, exact = FormatAdamW("8bit-moments", [(flat, ranges)], HP), FormatAdamW("exact", [(flat, ranges)], HP)
    for _ in range(20):
        grad = torch.randn(n, generator=g) * 0.01
        p.grad = grad.view(shape).clone()
        theirs.step()
        ours.step([grad])
        exact.step([grad])
    moved = (exact.weights(0) - flat).norm()
    assert (ours.weights(0) - p.detach().reshape(-1)).norm() / moved < 1e-5
    assert (ours.weights(0) - exact.weights(0)).norm() / moved > 1e-3


@pytest.mark.parametrize("fmt", ["8bit-moments", "bf16-master"])  # (the formats the kernel updates)
def test_the_compiled_update_is_the_torch_update_up_to_rounding(monkeypatch, fmt):
    """The kernel computes the same algorithm as the torch ops: after 20 steps the weights differ by float rounding
    (and the rare 8-bit code or bf16 rounding it flips), far less than the formats differ from fp32 AdamW."""
    monkeypatch.setenv("LOHAN_FORMAT_KERNEL", "1")
    if format_kernel.kernel() is None:
        pytest.skip("the format kernel could not be built here (no compiler)")
    flat, ranges = block()
    runs = {}
    for path in ("1", "0"):
        monkeypatch.setenv("LOHAN_FORMAT_KERNEL", path)
        opt = FormatAdamW(fmt, [(flat, ranges)], HP, seed=3)
        for g in grads(flat.numel(), 20):
            opt.step([g])
        runs[path] = opt.weights(0)
    exact = FormatAdamW("exact", [(flat, ranges)], HP)
    for g in grads(flat.numel(), 20):
        exact.step([g])
    moved = (exact.weights(0) - flat).norm()
    assert (runs["1"] - runs["0"]).norm() / moved < 0.25 * max(1e-3, (runs["0"] - exact.weights(0)).norm() / moved)


def test_the_compiled_update_picks_the_nearest_8bit_codes(monkeypatch):
    """After a first step from zero, m = (1 - beta1) g on both paths: the kernel's codes and scales (its cache-sized
    code table) are exactly quantize_blockwise's, over magnitudes from 1e-12 to 1 of the block's absmax."""
    monkeypatch.setenv("LOHAN_FORMAT_KERNEL", "1")
    if format_kernel.kernel() is None:
        pytest.skip("the format kernel could not be built here (no compiler)")
    g = torch.Generator().manual_seed(7)
    n = 256 * 40
    grad = torch.randn(n, generator=g) * 10.0 ** -torch.randint(0, 13, (n,), generator=g).float()
    ranges = [ParamRange(0, n, (n,), True)]
    flat = torch.zeros(n)
    states = {}
    for path in ("1", "0"):
        monkeypatch.setenv("LOHAN_FORMAT_KERNEL", path)
        opt = FormatAdamW("8bit-moments", [(flat, ranges)], HP)
        opt.step([grad])
        states[path] = opt.states[0].m
    assert torch.equal(states["1"].absmax, states["0"].absmax)
    assert torch.equal(states["1"].codes, states["0"].codes)


def test_the_compiled_update_releases_the_gil(monkeypatch):
    """The compute thread issues many small ops, each taking the GIL for a moment, while the optimizer's thread
    runs the kernel: a kernel that held the GIL made every one of them wait for a whole piece's update (the
    emulated GPU's backward ran 5-10x slower beside AdamW). 400 GIL hand-offs beside back-to-back updates take about
    as long as alone."""
    import threading
    import time

    monkeypatch.setenv("LOHAN_FORMAT_KERNEL", "1")
    if format_kernel.kernel() is None:
        pytest.skip("the format kernel could not be built here (no compiler)")
    n = 1 << 21
    flat = torch.zeros(n)
    opt = FormatAdamW("8bit-moments", [(flat, [ParamRange(0, n, (n,), True)])], HP)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1))
    opt.step([grad])
    stop = threading.Event()

    def updates() -> None:
        while not stop.is_set():
            opt.step([grad])

    def handoffs() -> float:
        t0 = time.perf_counter()
        for _ in range(400):
            time.sleep(0)  # gives the GIL up and takes it back, as each small op of the compute thread does
        return time.perf_counter() - t0

    worker = threading.Thread(target=updates)
    worker.start()
    try:
        time.sleep(0.05)
        beside = handoffs()
    finally:
        stop.set()
        worker.join()
    # (measured: 0.03-0.04 s with the GIL released, 0.65-0.75 s with it held)
    assert beside < 0.2, f"400 GIL hand-offs took {beside:.2f} s beside the kernel"
