"""The LM head as the engine runs it (lohan/models/lm_head.py, issue 38 cause 5): the vocabulary padded to a
multiple of 64 for the GEMMs and the softmax in token chunks, bit-exact against the unpadded, unchunked loss
(`lm_loss(F.linear(h, w), targets)`) in fp32 and bf16 autocast on the CPU; the engine against plain PyTorch with
a padded vocabulary over several chunks; an HF family; the export keeps the real vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

import lohan
import lohan.models.lm_head as lm_head
from lohan.models.adapter import GPTBlocks
from lohan.models.gpt import build_model, lm_loss
from lohan.models.gpt_export import export_gpt2
from lohan.plan.vocab import loss_chunk_tokens, padded_vocab
from tests.integration.test_engine_equivalence import (
    assert_params_equal,
    batches,
    engine_config,
    engine_run,
    reference_run,
    tiny_cfg,
)

aten = torch.ops.aten


class _Record(TorchDispatchMode):
    """Every matmul's output shape, and the largest fp32 tensor made, under it (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm: list[tuple[int, ...]] = []
        self.largest_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten.mm.default, aten.addmm.default, aten.mm.out, aten.bmm.default):
            self.mm.append(tuple(out.shape))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.largest_fp32 = max(self.largest_fp32, out.numel())
        return out


def _both(h, w, y, chunk=None, autocast=False):
    """(loss, grads) of the reference lm_loss and of head_loss on the same leaves."""
    out = []
    for loss_fn in (lambda: lm_loss(F.linear(h, w), y), lambda: lm_head.head_loss(h, w, y, chunk_tokens=chunk)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn()
        out.append((loss, torch.autograd.grad(loss, [h, w])))
    return out


@pytest.mark.parametrize("vocab", [1000, 4096, 50257])
@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("autocast", [False, True])
def test_head_loss_equals_the_unpadded_unchunked_loss_bit_for_bit(vocab, chunk, autocast):
    g = torch.Generator().manual_seed(vocab)
    h = torch.randn(3, 50, 48, generator=g, requires_grad=True)
    w = (torch.randn(vocab, 48, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, vocab, (3, 50), generator=g)
    y[0, :7] = -100  # prompt tokens: ignored
    y[2, 40:] = -100
    (ref, ref_grads), (got, got_grads) = _both(h, w, y, chunk, autocast)
    assert got.dtype == ref.dtype == torch.float32 and torch.equal(got, ref)
    for a, b in zip(got_grads, ref_grads):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


def test_a_window_without_targets_gives_zero_loss_and_zero_gradients():
    h = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(100, 16, requires_grad=True)
    y = torch.full((2, 8), -100)
    loss = lm_head.head_loss(h, w, y, chunk_tokens=4)
    assert loss.item() == 0.0
    assert all(not g.any() for g in torch.autograd.grad(loss, [h, w]))


def test_soft_capping_applies_per_chunk_as_on_the_whole_logits():
    """Gemma's final soft-capping (HFBlocks._cap) is elementwise: applied to each chunk's logits it gives the
    bits it gives on the whole logits."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(64, 16, generator=g, requires_grad=True)
    w = torch.randn(150, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 150, (64,), generator=g)

    def cap(z):
        return torch.tanh(z / 30.0) * 30.0

    ref = lm_loss(cap(F.linear(h, w)), y)
    got = lm_head.head_loss(h, w, y, post=cap, chunk_tokens=16)
    assert torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(got, [h, w]), torch.autograd.grad(ref, [h, w])):
        assert torch.equal(a, b)


def test_the_engine_head_runs_padded_gemms_and_never_holds_the_whole_fp32_logits(monkeypatch):
    """Issue 38: vocab 50257 made the head's GEMMs misaligned (cuBLAS align1 kernels) and the loss upcast every
    logit of the micro-batch to fp32. The engine's head (GPTBlocks.run on the last block) now makes no GEMM
    output with the real vocabulary as a dimension, and in bf16 no fp32 tensor bigger than a chunk's logits (the
    logits' gradient is kept whole in the compute dtype, for the weight's gradient in one GEMM: lm_head.py)."""
    monkeypatch.setattr(lm_head, "loss_chunk_tokens", lambda vocab: 64)
    cfg = tiny_cfg(vocab_size=1000)
    program = GPTBlocks(build_model(cfg, device="cpu", seed=1))
    x = torch.randn(4, 32, cfg.d_model, requires_grad=True)
    y = torch.randint(0, 1000, (4, 32))
    with _Record() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = program.run(len(program.modules) - 1, x, y)
        torch.autograd.grad(loss, [x, program.model.embed.wte.weight])
    assert rec.mm and not [s for s in rec.mm if 1000 in s], rec.mm
    vp = padded_vocab(1000)
    assert vp == 1024 and {s[1] for s in rec.mm if s[0] == 64} == {1024 - 64, 64}  # the weight's rows, then its tail
    assert rec.largest_fp32 <= 64 * vp < 4 * 32 * 1000


def test_the_cuda_reduction_over_the_padded_vocabulary_is_close():
    """On CUDA the hidden states' gradient sums over the padded vocabulary (aligned GEMMs; on the CPU it sums
    over the real one, for the unpadded bits): the padded columns are zeros, so only the rounding differs."""
    g = torch.Generator().manual_seed(0)
    wc = torch.randn(1000, 32, generator=g)
    dz = F.pad(torch.randn(128, 1000, generator=g), (0, 24))
    split = lm_head._split(wc)
    padded = lm_head._hidden_grad(dz, split, wc, padded=True)
    real = lm_head._hidden_grad(dz, split, wc, padded=False)
    assert torch.equal(real, dz[:, :1000].mm(wc))
    torch.testing.assert_close(padded, real, rtol=1e-5, atol=1e-4)  # sums of 1000 products of N(0, 1) values


@pytest.mark.parametrize("mode,micro_batches", [("serial", 1), ("optimized", 2)])
def test_engine_with_a_padded_vocabulary_in_chunks_equals_plain_pytorch(make_dirs, monkeypatch, mode, micro_batches):
    """Vocab 1000 (padded to 1024) and 64-token chunks (two per micro-batch): the engine's losses and weights equal
    the plain PyTorch loop's (unpadded head, lm_loss) bit for bit, and the export holds the real vocabulary."""
    monkeypatch.setattr(lm_head, "loss_chunk_tokens", lambda vocab: 64)
    mcfg = tiny_cfg(vocab_size=1000)
    ecfg = engine_config(make_dirs(1), mode=mode, micro_batches=micro_batches, total_steps=3)
    ref_losses, ref_params = reference_run(mcfg, ecfg, batches(3, 4, 32, 1000))
    losses, params = engine_run(mcfg, ecfg, batches(3, 4, 32, 1000))
    assert losses == ref_losses
    assert_params_equal(params, ref_params)
    assert params["embed.wte.weight"].shape == (1000, mcfg.d_model)


def test_export_of_a_padded_run_keeps_the_real_vocabulary(make_dirs, tmp_path):
    mcfg = tiny_cfg(vocab_size=1000)
    ecfg = engine_config(make_dirs(1), total_steps=2)
    out = tmp_path / "export"
    with lohan.init(mcfg, ecfg) as engine:
        for batch in batches(2, 4, 32, 1000):
            engine.step(batch)
        wte = engine.state_dict_fp32()["embed.wte.weight"]
        export_gpt2(engine, mcfg, out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1000
    shard = next(p for p in Path(out).glob("*.safetensors")
                 if "transformer.wte.weight" in safe_open(str(p), "pt").keys())
    with safe_open(str(shard), "pt") as f:
        assert torch.equal(f.get_tensor("transformer.wte.weight"), wte)


def test_an_hf_head_pads_its_vocabulary_and_equals_the_hf_loss(tmp_path):
    """An HF model's vocabulary that is no multiple of 64 (150 here, OPT's 50272 in life) is padded for the head's
    GEMMs; HFBlocks' loss and gradients equal lm_loss on the HF forward's logits bit for bit."""
    from tests.integration.test_hf_families import family_config, loaded_program, save_model

    program = loaded_program(save_model(tmp_path / "m", family_config("gemma2")))  # soft-capped, tied
    assert program.vocab_size % 64 and program.softcap
    ids = torch.randint(3, program.vocab_size, (2, 16))
    y = torch.randint(0, program.vocab_size, (2, 16))
    x = program.run(0, ids, None)
    for i in range(1, len(program.modules) - 1):
        x = program.run(i, x, None)
    x = x.detach().requires_grad_()
    weight = program._head_weight()
    ref = lm_loss(program.logits(x), y)
    with _Record() as rec:
        got = program.run(len(program.modules) - 1, x, y)
    assert torch.equal(got, ref) and not [s for s in rec.mm if program.vocab_size in s], rec.mm
    for a, b in zip(torch.autograd.grad(got, [x, weight]), torch.autograd.grad(ref, [x, weight])):
        assert torch.equal(a, b)


def test_chunk_sizes():
    assert padded_vocab(50257) == 50304 and padded_vocab(4096) == 4096 and padded_vocab(1) == 64
    assert loss_chunk_tokens(50257) == 1280  # 256 MiB of fp32 logits at GPT-2's padded vocabulary
    assert loss_chunk_tokens(10**7) == 64  # at least 64 tokens
    assert loss_chunk_tokens(128256) % 64 == 0


@pytest.mark.parametrize("vocab", [1000, 4096])
def test_a_head_run_with_grad_computes_its_logits_once_and_no_frozen_weight_gradient(vocab):
    """Issue 41: the head run with grad just before its backward (every engine's last block) computed its logits
    twice (backward recomputed the one chunk forward had made) and the weight's gradient even for a frozen weight
    (LoRA's head): 4 GEMMs of the vocabulary's width where PEFT's run makes 2. With one chunk, forward's graph is
    kept; backward makes only the gradients asked for. The bits stay the reference's."""
    g = torch.Generator().manual_seed(vocab)
    h = torch.randn(2, 32, 48, generator=g, requires_grad=True)
    w = torch.randn(vocab, 48, generator=g) * 0.3  # frozen
    y = torch.randint(0, vocab, (2, 32), generator=g)
    parts = 1 if vocab % 64 == 0 else 2  # (a GEMM on the weight's aligned rows, one on its padded tail)
    with _Record() as rec:
        loss = lm_head.head_loss(h, w, y)
        (dh,) = torch.autograd.grad(loss, [h])
    assert len(rec.mm) == parts + 1, rec.mm  # the logits, then the hidden states' gradient (on the real rows)
    ref = lm_loss(F.linear(h, w), y)
    assert torch.equal(loss, ref) and torch.equal(dh, torch.autograd.grad(ref, [h])[0])
    with _Record() as rec:  # a weight that takes a gradient: one GEMM (per part) more
        wg = w.clone().requires_grad_()
        torch.autograd.grad(lm_head.head_loss(h, wg, y), [h, wg])
    assert len(rec.mm) == 2 * parts + 1, rec.mm
