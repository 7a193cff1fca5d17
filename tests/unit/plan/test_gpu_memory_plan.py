"""The GPU memory plan (lohan.plan.planner.gpu_need, check_gpu_budget) and the free memory it is held to
(lohan.app.fit.detect_hardware). CPU-only: CUDA is monkeypatched where the code asks it something.

Each part of the plan is checked against what the engine allocates for it (the brief of the plan is in
`gpu_need`'s comments): parameters, gradient accumulators, autograd's gradients, the tied embedding's borrowed
gradients, activations, the loss's peak, cuBLAS workspaces and the allocator's margin.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lohan.config import get_model_config
from lohan.models.lm_head import head_loss
from lohan.plan.planner import (
    CUBLAS_STREAMS,
    CUBLAS_WORKSPACE_BYTES,
    FRAGMENTATION,
    GpuMemoryPlanError,
    Hardware,
    analytic_profile,
    capacity,
    check_gpu_budget,
    gpu_need,
)
from lohan.plan.vocab import head_loss_bytes, loss_chunk_tokens

HW = Hardware("bytes-only", thp_g=1e12, bw_g=1e10, bw_s2m=1e9, bw_m2s=1e9, mem_avail=10**12)
MiB, GiB = 2**20, 2**30


def tiny(**over):
    return get_model_config("tiny").with_overrides(**over)


def need(cfg=None, batch: int = 4, seq: int = 64, dtype: str = "bf16", micro_batches: int = 1, depth: int = 2,
         swap: tuple[str, ...] = (), world: int = 1) -> dict[str, int]:
    return gpu_need(cfg or tiny(), batch, seq, HW, dtype, micro_batches, depth, swap, world)


def biggest_block(cfg) -> int:
    return max(cfg.block_param_count(), cfg.embed_param_count(), cfg.head_param_count())


# ---------------------------------------------------------------------------------------------- parts

def test_every_part_is_counted_and_the_total_is_their_sum() -> None:
    parts = need(micro_batches=2)
    assert list(parts) == ["params", "gradient accumulators", "block gradients", "borrowed gradients",
                           "block activations", "last block kept", "next block's records", "logits",
                           "cuBLAS workspace", "fragmentation"]
    assert "gradient accumulators" not in need()  # one micro-batch in bf16: nothing is summed
    assert all(v > 0 for v in parts.values())
    cap = capacity(tiny(), HW, 4, 64)
    assert cap.gpu_parts == need(swap=cap.plan.swap) and cap.gpu_bytes == sum(cap.gpu_parts.values())


def test_params_hold_the_prefetch_window_and_the_tied_embedding() -> None:
    tied, untied = tiny(), tiny(tie_embeddings=False)
    for cfg in (tied, untied):
        step = need(cfg, depth=3)["params"] - need(cfg, depth=2)["params"]
        assert step == 2 * biggest_block(cfg)  # one more bf16 block per prefetch step
    assert need(tied, depth=1)["params"] == 3 * 2 * biggest_block(tied) + 2 * tied.embed_param_count()
    assert need(untied, depth=1)["params"] == 3 * 2 * biggest_block(untied)
    assert need(tied, dtype="fp32", depth=1)["params"] == 2 * need(tied, depth=1)["params"]


def test_borrowed_gradients_are_one_embedding_per_micro_batch_and_only_when_tied() -> None:
    cfg = tiny()
    emb = cfg.vocab_size * cfg.d_model
    assert need(cfg, micro_batches=1)["borrowed gradients"] == 2 * emb
    assert need(cfg, batch=8, micro_batches=4)["borrowed gradients"] == 4 * 2 * emb
    assert need(cfg, dtype="fp32")["borrowed gradients"] == 4 * emb
    assert "borrowed gradients" not in need(tiny(tie_embeddings=False))


@pytest.mark.parametrize("dtype,micro_batches,world,g", [
    ("bf16", 1, 1, None),  # kept in bf16, nothing summed: autograd's gradients go to the host as they are
    ("fp32", 1, 1, None),
    ("bf16", 2, 1, 4),  # accumulated over micro-batches: fp32
    ("bf16", 1, 2, 4),  # summed over ranks: fp32
    ("fp16", 1, 1, 4),  # scaled: fp32
    ("fp32", 2, 1, 4),
])
def test_gradient_accumulators_follow_the_engines_gradient_dtype(dtype: str, micro_batches: int, world: int,
                                                                 g: int | None) -> None:
    """engine._direct: a flat accumulator per block only where gradients are summed or change dtype; else two
    blocks' autograd gradients (one computing, one on its way to the host)."""
    cfg = tiny()
    parts = need(cfg, batch=4, dtype=dtype, micro_batches=micro_batches, world=world)
    s = 4 if dtype == "fp32" else 2
    if g is None:
        assert "gradient accumulators" not in parts and parts["block gradients"] == 2 * s * biggest_block(cfg)
    else:
        assert parts["gradient accumulators"] == 2 * g * biggest_block(cfg)  # one filling, one copied to the host
        assert parts["block gradients"] == s * biggest_block(cfg)


def test_activations_count_a_micro_batch_being_recomputed_and_two_whole_batch_records() -> None:
    cfg = tiny()
    parts = need(cfg, batch=8, micro_batches=2, swap=("fc",))
    micro, full = analytic_profile(cfg, 4, 64, HW), analytic_profile(cfg, 8, 64, HW)
    assert parts["block activations"] == 2 * (micro.input_bytes + sum(op.bytes for op in micro.ops))
    record = full.input_bytes + next(op.bytes for op in full.ops if op.name == "fc")
    assert parts["last block kept"] == parts["next block's records"] == record


def test_logits_count_the_losss_peak_of_one_micro_batch() -> None:
    cfg = tiny()
    vp, pad = 50304, 64 * 160  # the padded vocabulary; the weight's last rows padded to 64
    # bf16: 2 + 3 fp32 per logit (one chunk), and 24 bytes per token
    assert need(cfg, batch=4, seq=64)["logits"] == 4 * 64 * (vp * 14 + 24) + 2 * pad + 256
    assert need(cfg, batch=4, seq=64, dtype="fp32")["logits"] == 4 * 64 * (vp * 16 + 24) + 4 * pad + 256
    assert need(cfg, batch=8, seq=64, micro_batches=2)["logits"] == need(cfg, batch=4, seq=64)["logits"]


def test_the_chunked_loss_never_plans_the_whole_fp32_logits() -> None:
    """Issue 38: the loss held 14 bytes per logit in bf16 (16 in fp32) for every token of a micro-batch; chunked,
    it holds the logits' gradient in the compute dtype and one chunk's fp32 temporaries."""
    cfg = get_model_config("350m", seq_len=2048)
    tokens = 8 * 2048
    for dtype, s in (("bf16", 2), ("fp32", 4)):
        logits = need(cfg, batch=8, seq=2048, dtype=dtype)["logits"]
        assert logits < tokens * cfg.vocab_size * (s + 4)  # not even one fp32 tensor of every logit beside it
        chunk = loss_chunk_tokens(cfg.vocab_size)
        assert chunk == 1280 and logits == tokens * (50304 * s + 24) + chunk * 50304 * (s + 12) + s * 64 * cfg.d_model + 256


@pytest.mark.parametrize("dtype,itemsize", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("vocab,chunk", [(4096, None), (4000, None), (4000, 64)])
def test_the_logits_part_is_the_traced_peak_of_the_head_loss(dtype: torch.dtype, itemsize: int, vocab: int,
                                                            chunk: int | None) -> None:
    """Trace every tensor `head_loss` makes, forward and backward, and compare the peak of live bytes with the
    plan's logits part (a thin head: its weight and input are small), in one chunk and in four, with a padded
    vocabulary and without."""
    tokens, d = 256, 8
    x = torch.randn(tokens, d, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, d, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with _PeakBytes() as trace:
        grads = torch.autograd.grad(head_loss(x, w, targets, chunk_tokens=chunk), [x, w])
    planned = head_loss_bytes(vocab, tokens, itemsize, d, chunk_tokens=chunk)
    extra = sum(g.nbytes for g in grads)
    assert 0.95 * planned <= trace.peak - extra <= planned, (trace.peak - extra, planned)
    cfg = tiny(vocab_size=vocab)
    assert gpu_need(cfg, 1, tokens, HW, "bf16" if itemsize == 2 else "fp32", 1, 2, ())["logits"] == \
        head_loss_bytes(vocab, tokens, itemsize, cfg.d_model)


class _PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages the ops under it allocate, alive at once (freed ones found by weakref)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                if storage.nbytes():
                    self.live[storage.data_ptr()] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, storage.data_ptr())
        return out


def test_fixed_parts_are_the_cublas_workspaces_and_a_fragmentation_margin() -> None:
    parts = need()
    assert parts["cuBLAS workspace"] == CUBLAS_STREAMS * CUBLAS_WORKSPACE_BYTES == 64 * MiB
    rest = sum(v for k, v in parts.items() if k != "fragmentation")
    assert parts["fragmentation"] == int(FRAGMENTATION * rest)


def test_the_plan_grows_with_the_batch_and_shrinks_with_micro_batches() -> None:
    cfg = get_model_config("1b")
    one, four = sum(need(cfg, 1, 1024).values()), sum(need(cfg, 4, 1024).values())
    assert four > one
    split = need(cfg, 4, 1024, micro_batches=4)
    assert split["logits"] == need(cfg, 1, 1024)["logits"]
    assert split["block activations"] == need(cfg, 1, 1024)["block activations"]


# ---------------------------------------------------------------------------------------- the check

def test_check_gpu_budget_passes_what_fits() -> None:
    parts = need()
    check_gpu_budget(parts, sum(parts.values()), "tiny")  # exactly full is fine


def test_check_gpu_budget_refuses_with_every_part_the_total_the_budget_and_the_fixes() -> None:
    parts = {"params": 3 * GiB, "gradient accumulators": GiB // 2, "logits": 100 * MiB, "cuBLAS workspace": 64 * MiB}
    with pytest.raises(GpuMemoryPlanError) as err:
        check_gpu_budget(parts, 2 * GiB, "13b at batch 4 x seq 1024")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    for text in ("13b at batch 4 x seq 1024", "needs 3.66 GiB", "2.00 GiB is available", "params 3.00 GiB",
                 "gradient accumulators 512.0 MiB", "logits 100.0 MiB", "cuBLAS workspace 64.0 MiB",
                 "micro_batches", "shorter sequence", "prefetch_depth", "act_policy", "gpu_mem"):
        assert text in msg, (text, msg)


def test_capacity_refuses_a_model_that_does_not_fit_a_small_gpu_mem() -> None:
    cfg = get_model_config("1b")
    roomy = capacity(cfg, HW.__class__(**{**HW.to_dict(), "gpu_mem": 80 * GiB}), 1, 1024)
    small = capacity(cfg, HW.__class__(**{**HW.to_dict(), "gpu_mem": 2 * GiB}), 1, 1024)
    assert roomy.fits, roomy.format()
    assert not small.fits
    (reason,) = [r for r in small.reasons if r.startswith("GPU memory")]
    assert all(part in reason for part in small.gpu_parts) and "micro_batches" in reason
    with pytest.raises(GpuMemoryPlanError):
        check_gpu_budget(small.gpu_parts, 2 * GiB)


# ------------------------------------------------------------------- the budget: free memory (lohan.app.fit)

@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA as detect_hardware sees it: current device 1 of 2, 30 GiB free of 80 GiB; no device-0 look-ups."""
    import lohan.app.fit as fit

    asked: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        asked.append(index)
        return 30 * GiB, 80 * GiB

    def no_device_0(*_a, **_k):
        raise AssertionError("detect_hardware must not read device 0's properties")

    monkeypatch.delenv("LOHAN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device_0)
    monkeypatch.setattr(fit, "_matmul_flops", lambda *_a, **_k: 1e14)
    monkeypatch.setattr(fit, "measure_cpu_adam", lambda *_a, **_k: 1e9)
    return asked


def test_detect_hardware_plans_with_the_free_memory_of_the_current_device(tmp_path, fake_cuda) -> None:
    from lohan.app.fit import detect_hardware

    m = detect_hardware((str(tmp_path),), device="cuda")
    assert m.hardware.gpu_mem == 30 * GiB and fake_cuda == [1]
    assert not m.device_is_host and m.hardware.name.startswith("Fake_GPU")
    assert any("30.00 GiB free of 80.00 GiB on cuda:1" in n for n in m.notes), m.notes


def test_a_smaller_gpu_mem_wins_and_a_larger_one_cannot_widen_the_free_memory(tmp_path, fake_cuda) -> None:
    from lohan.app.fit import detect_hardware

    small = detect_hardware((str(tmp_path),), device="cuda", gpu_mem=12 * GiB)
    assert small.hardware.gpu_mem == 12 * GiB
    big = detect_hardware((str(tmp_path),), device="cuda", gpu_mem=40 * GiB)
    assert big.hardware.gpu_mem == 30 * GiB
    assert any("more than is free" in n for n in big.notes), big.notes
