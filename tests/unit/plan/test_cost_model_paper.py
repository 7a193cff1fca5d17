"""The cost model against what the LoHan paper reports for its own testbed (seed 004, §V).

The testbed (Table III): one RTX 4090, 12 x 3.84 TB Intel P5510, 768 GB DDR4, dual Xeon Gold 5320; GPT-like
models of Table IV (``lohan.config`` presets), sequence 1024, mixed precision. Everything here is the pure
planner (``capacity`` -> Algorithm 1 -> the lanes), so the test is fast and needs no GPU.

What is compared, and how far apart the two may be:

- "Fraction of peak" is model FLOPs per second (``3 FLOP_f / T_iter``, recomputation not counted) over the
  GPU's peak. The paper's peak is a transformer block measured alone on the 4090 (Fig. 5c's green line, no
  number in the text); the model's is the 165.2 TFLOPS datasheet figure. Both are each side's own peak, so the
  fractions compare; the absolute TFLOPS of a GPU-bound point do not quite: 135 TFLOPS at 90-95 % puts the
  paper's measured peak at 142-150 TFLOPS, 0.86-0.91 of the datasheet, so the model reads GPU-bound points up to
  ~16 % high. Hence +-20 % on the paper's 135 TFLOPS points (figure reading adds a little).
- Batches are fitted with the fewest micro-batches the capacity planner accepts (the engine interleaves
  micro-batches per block; the paper's implementation runs the whole batch through each layer).

Where the honest model and the paper differ, the tests below assert what the model says and the module
``benchmarks/paper_testbed.py`` prints both side by side. The largest difference is the GPU: the engine's GPU
memory plan (``planner.gpu_need``: prefetched blocks, autograd's gradients of the widest block and of the block
before it on their way to the host (or two fp32 accumulators when micro-batches are summed), the tied
embedding's borrowed gradients, the loss's ~4 logit-sized tensors, a 10 % allocator margin) leaves the 4090
smaller batches than the paper ran, and 175B only at prefetch depth 1 and batch 1.
"""

from __future__ import annotations

import pytest

from lohan.config import get_model_config
from lohan.plan.planner import Capacity, Hardware, capacity, max_batch, max_model, parse_hardware

SEQ = 1024


def paper_box(n_ssd: int = 12, ram: str = "768GB") -> Hardware:
    """LoHan's evaluation server (Table III) with ``n_ssd`` of its P5510s."""
    return parse_hardware(f"rtx4090,{n_ssd}xP5510,{ram},2xGold5320")


def fit(model: str, batch: int, n_ssd: int = 12, **kw) -> Capacity:
    """The plan with the fewest micro-batches that fit the 4090 (the last one tried if none does)."""
    cfg, hw = get_model_config(model), paper_box(n_ssd)
    for mb in (d for d in range(1, batch + 1) if batch % d == 0):
        cap = capacity(cfg, hw, batch, SEQ, micro_batches=mb, **kw)
        if cap.fits:
            return cap
    return cap


def tflops(model: str, cap: Capacity) -> float:
    cfg = get_model_config(model)
    return 3 * cfg.flops_per_token(SEQ) * cap.batch * SEQ / cap.plan.estimate.t_iter / 1e12


def fraction(model: str, cap: Capacity) -> float:
    return tflops(model, cap) * 1e12 / paper_box().thp_g


@pytest.mark.parametrize("model", ["6b", "13b"])
def test_models_below_70b_run_near_peak(model: str) -> None:
    """§V-C: "90%~95% of peak FLOPS when the model size is smaller than 70B" (batch 32 here)."""
    cap = fit(model, 32)
    assert cap.fits, cap.format()
    assert 0.85 <= fraction(model, cap) <= 1.0, cap.plan.estimate.format_lanes()
    assert cap.plan.estimate.bottleneck_b == "gpu"  # the optimizer and the SSDs hide under backward


def test_30b_at_the_largest_batch_the_4090_holds_stays_below_the_papers_fraction() -> None:
    """The paper's 90-95 % at 30B needs batch 32; the GPU memory plan holds 20 at most (4 micro-batches), where
    the CPU AdamW of 30 B parameters still bounds backward: about three quarters of peak."""
    assert not fit("30b", 32).fits and not fit("30b", 24).fits
    cap = fit("30b", 20)
    assert cap.fits, cap.format()
    assert cap.plan.estimate.bottleneck_b == "cpu"
    assert 0.65 <= fraction("30b", cap) < 0.85


def test_175b_fits_a_4090_only_at_prefetch_depth_1_and_batch_1() -> None:
    """§V-C reports 53 % of peak at 175B on the 4090. This engine's working set of a 175B block (3.6 GB of bf16
    parameters per copy, three copies at prefetch depth 1, and autograd's gradients of two blocks: ~22 GiB with
    the margin) leaves the card's 24 GiB room for batch 1 only; the CPU AdamW of 175 B parameters then bounds
    every step, far below the paper's fraction."""
    cfg, hw = get_model_config("175b"), paper_box()
    assert max_batch(cfg, hw, SEQ, prefetch_depth=1) == 1
    assert all(max_batch(cfg, hw, SEQ, micro_batches=mb, prefetch_depth=2) == 0 for mb in (1, 2, 4, 8))
    refused = capacity(cfg, hw, 1, SEQ)
    assert not refused.fits and all(r.startswith("GPU memory") for r in refused.reasons), refused.reasons
    cap = fit("175b", 1, prefetch_depth=1)
    assert cap.plan.estimate.bottleneck_b == "cpu"
    assert fraction("175b", cap) < 0.53 / 4


def test_batch_8_backward_costs_less_than_the_cpu_optimizer() -> None:
    """§V-D: the gain of active gradient offloading over running the optimizer after backward "drops when
    the batch size is too small (e.g., 8), because GPU backward propagation costs significantly less time
    than CPU optimizer"; and it is 1.33x at batch 64 on 13B."""
    e8 = fit("13b", 8).plan.estimate
    assert e8.bottleneck_b == "cpu"
    assert e8.lanes_b["cpu"] > 2 * e8.lanes_b["gpu"]  # "significantly less"
    gain = {b: (lambda e: e.t_serial / e.t_iter)(fit("13b", b).plan.estimate) for b in (8, 16, 24, 32, 64)}
    assert gain[8] < max(gain[b] for b in (16, 24, 32)) - 0.15
    # The model's gain peaks where backward and the optimizer take as long, and falls on both sides; the paper
    # reports only 64 besides the drop at 8. Its LoHan+ZeRO keeps other overlaps the model's serial one drops.
    assert gain[64] == pytest.approx(1.33, rel=0.15)


def test_ssd_count_reaching_135_tflops() -> None:
    """§V-F (13B): "It requires 12 SSDs to achieve 135 TFLOPS with a batch size of 32, while requiring 6 and 3
    SSDs for batch sizes 48 and 64 respectively." Tolerance +-20 %: see the module docstring. Batch 48 does not fit
    the 4090 under the GPU memory plan (no micro-batch count of it does); 64 does, in 8 micro-batches, since the
    head's loss is taken in chunks (models/lm_head.py: it held 14 bytes per logit of a micro-batch before)."""
    for batch, n_ssd in ((32, 12), (64, 3)):
        cap = fit("13b", batch, n_ssd)
        assert cap.fits, cap.format()
        assert tflops("13b", cap) == pytest.approx(135, rel=0.20)
    assert not fit("13b", 48, 6).fits


def test_fewer_ssds_fall_short_at_the_smaller_batches() -> None:
    """The other half of §V-F's sentence: with half the SSDs, each of those batches falls below its point."""
    for n_ssd, batch in [(6, 32), (3, 48)]:
        short, enough = fit("13b", batch, n_ssd), fit("13b", batch, 2 * n_ssd)
        assert tflops("13b", short) < tflops("13b", enough)
        assert short.plan.estimate.t_iter > enough.plan.estimate.t_iter
    assert fit("13b", 32, 3).plan.estimate.bottleneck_b == "ssd"


def test_near_linear_ssd_scaling_from_1_to_3() -> None:
    """§V-F (135B at "the largest batch size the two systems can fine-tune": under the GPU memory plan that is
    batch 5 at prefetch depth 1 with the head's loss in chunks, 1 at depth 2): "near linear scalability when the
    SSD number increases from 1 to 3, indicating that SSD I/O is the training bottleneck". (Its "small gain from
    6 to 12 SSDs" is not reproduced: see benchmarks/paper_testbed.py.)"""
    batch = 5
    assert fit("135b", batch, prefetch_depth=1).fits and not fit("135b", 6, prefetch_depth=1).fits
    assert not fit("135b", 2).fits
    t = {n: tflops("135b", fit("135b", batch, n, prefetch_depth=1)) for n in (1, 2, 3)}
    assert fit("135b", batch, 1, prefetch_depth=1).plan.estimate.bottleneck_b == "ssd"
    assert t[2] / t[1] >= 1.8 and t[3] / t[1] >= 2.6


def test_175b_at_batch_32_does_not_fit_a_4090() -> None:
    """§V-C: at 175B "the allowable batch size is small to fit in limited GPU memory". The paper's design runs
    the whole batch through a layer (micro_batches=1); no micro-batch count helps either (nor any batch:
    `test_175b_does_not_fit_a_4090_at_any_batch`)."""
    cfg, hw = get_model_config("175b"), paper_box()
    whole = capacity(cfg, hw, 32, SEQ)
    assert not whole.fits and any(r.startswith("GPU memory") for r in whole.reasons)
    for mb in (2, 4, 8, 16, 32):
        assert not capacity(cfg, hw, 32, SEQ, micro_batches=mb).fits


def test_largest_model_with_768gb() -> None:
    """§V-B: "LoHan enables the fine-tuning of a 276B model under 768 GB main memory on RTX 4090" (batch 1).
    Under the GPU memory plan the 4090 holds 175B's blocks at prefetch depth 1 and 135B's at the default 2; main
    memory is not what stops the bigger ones."""
    assert max_model(paper_box(), SEQ, prefetch_depth=1) == "175b"
    assert max_model(paper_box(), SEQ) == "135b"
    big = capacity(get_model_config("276b"), paper_box(), 1, SEQ, prefetch_depth=1)
    assert not big.fits and all(r.startswith("GPU memory") for r in big.reasons), big.reasons
