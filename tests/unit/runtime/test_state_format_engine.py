"""Compressed state formats in the engine (issue "Compressed tiers"): the offloaded optimizer, its records on the
SSDs, chunks, slots, clipping and resume, against the in-memory reference of the same algorithm (`FormatAdamW`),
bit for bit; and, with fp32 compute, the whole training loop against plain PyTorch with that reference as its
optimizer."""

from __future__ import annotations

import math

import pytest
import torch

import lohan
from lohan.models.gpt import build_model
from lohan.plan.formats import FORMATS
from lohan.runtime.format_adamw import FormatAdamW
from lohan.runtime.offload import GradOffloader
from lohan.runtime.optim import AdamWHyper, ParamRange, decay_mask, lr_factor
from lohan.runtime.param_grads import ParamGrads
from lohan.store.states import StateStore
from tests.unit.runtime.test_clipping import batches, config, same_weights, tiny_cfg

COMPRESSED = [f for f in FORMATS if f != "exact"]


pytestmark = pytest.mark.usefixtures("update_path")  # both update paths (conftest.py)


def _fmt_config(dirs, fmt: str, **kw):
    # bf16-master needs bf16 compute; the others are tested in fp32, where the forward is bit-exact with PyTorch
    return config(dirs, state_format=fmt, compute_dtype="bf16" if fmt == "bf16-master" else "fp32", **kw)


class Recorder:
    """What the engine hands its optimizer each step: every block's gradient (copied at `submit`) and the step's
    hyper-parameters; the reference replays them through `FormatAdamW`."""

    def __init__(self, monkeypatch) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self.hyper: AdamWHyper | None = None
        real_submit, real_begin = GradOffloader.submit, GradOffloader.begin_step
        rec = self

        def submit(ago, block, grad):
            n = ago.store.layout.blocks[block].numel
            if isinstance(grad.tensor, ParamGrads):  # autograd's own gradients (the CPU hands them over as they are)
                rec.grads[block] = torch.empty(n, dtype=ago.grad_dtype)
                grad.tensor.copy_into(rec.grads[block])
            else:
                rec.grads[block] = grad.tensor[:ago.grad_dtype.itemsize * n].view(ago.grad_dtype).clone()
            return real_submit(ago, block, grad)

        def begin_step(ago, step, hyper, *args, **kw):
            rec.hyper = hyper
            return real_begin(ago, step, hyper, *args, **kw)
        monkeypatch.setattr(GradOffloader, "submit", submit)
        monkeypatch.setattr(GradOffloader, "begin_step", begin_step)


def _reference(engine, fmt: str) -> FormatAdamW:
    blocks = []
    for i in range(len(engine.layout.blocks)):
        flat = torch.cat([t.reshape(-1) for t in engine.read_params(i)])
        blocks.append((flat, engine.offloader.params[i]))
    return FormatAdamW(fmt, blocks, AdamWHyper(1.0, 0.9, 0.95, 1e-8, 0.0), seed=engine.cfg.seed)


def _replay(ref: FormatAdamW, rec: Recorder, coef: float) -> None:
    """One reference step on the recorded gradients, clipped as the engine clips (fp32 times the coefficient)."""
    c = torch.tensor(coef, dtype=torch.float32)
    grads = [rec.grads[i].float() * c if coef != 1.0 else rec.grads[i].float() for i in range(len(rec.grads))]
    ref.step(grads, rec.hyper)
    rec.grads.clear()


def _check_weights(engine, ref: FormatAdamW) -> None:
    for i in range(len(engine.layout.blocks)):
        ours = torch.cat([t.reshape(-1) for t in engine.read_params(i)])
        want = ref.weights(i)
        assert torch.equal(ours, want), f"block {i}: max |diff| {(ours - want).abs().max():.3e}"


def _train_against_reference(engine, ref: FormatAdamW, rec: Recorder, data, lookahead: bool = False) -> list:
    metrics = []
    for k, batch in enumerate(data):
        nxt = data[k + 1] if lookahead and k + 1 < len(data) else None
        engine.step(batch, next_batch=nxt)
        m = engine.last_stats.to_dict()
        metrics.append(m)
        _replay(ref, rec, m["clip_coef"])
    _check_weights(engine, ref)
    return metrics


@pytest.mark.parametrize("fmt", COMPRESSED)
@pytest.mark.parametrize("mode", ["serial", "optimized"])
def test_the_offloaded_update_is_the_in_memory_reference_bit_for_bit(make_dirs, monkeypatch, fmt, mode):
    """Every step clipped or not (max_grad_norm 0.5: most are), deferred or speculated and redone (auto)."""
    rec = Recorder(monkeypatch)
    data = list(batches(6))
    with lohan.init(tiny_cfg(), _fmt_config(make_dirs(2), fmt, mode=mode, max_grad_norm=0.5)) as engine:
        ref = _reference(engine, fmt)
        metrics = _train_against_reference(engine, ref, rec, data, lookahead=True)
    coefs = [m["clip_coef"] for m in metrics]
    assert any(c < 1 for c in coefs), coefs


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_one_slot_and_several_directories(make_dirs, monkeypatch, fmt):
    rec = Recorder(monkeypatch)
    with lohan.init(tiny_cfg(), _fmt_config(make_dirs(3), fmt, slots=1)) as engine:
        _train_against_reference(engine, _reference(engine, fmt), rec, list(batches(4)))


def test_chunked_blocks_and_a_refused_chunking(make_dirs, monkeypatch):
    """Blocks updated in chunks: bf16 moments anywhere; 8-bit moments only where no chunk splits a quantization
    block, which is refused with the fix (the tiny model's layer norms put its matrices off the 256 grid)."""
    rec = Recorder(monkeypatch)
    ecfg = _fmt_config(make_dirs(1, "bf16m"), "bf16-moments", opt_chunk_bytes=4096 * 10, name="bf16m")
    with lohan.init(tiny_cfg(), ecfg) as engine:
        assert any(len(engine.offloader.units(i)) > 1 for i in range(len(engine.layout.blocks)))
        _train_against_reference(engine, _reference(engine, "bf16-moments"), rec, list(batches(3)))
    with pytest.raises(ValueError, match="would split an 8-bit quantization block.*opt_chunk_bytes"):
        lohan.init(tiny_cfg(), _fmt_config(make_dirs(1, "q8"), "8bit-moments", opt_chunk_bytes=4096 * 10))


def test_the_dry_run_refuses_a_chunking_that_splits_8bit_blocks_in_the_engines_words(tmp_path, capsys):
    """The plan (`RunPlan.refusal`) holds the engine's refusal of such a chunking, so the dry run says it too (it
    priced the run as fitting), and the run stops at its pre-flight with the same line."""
    from lohan.app.cli import main

    args = ["--model", "tiny", "--data", "synthetic", "--state-format", "8bit-moments", "--compute-dtype", "fp32",
            "--set", "engine.opt_chunk_bytes=40KiB", "--nvme", str(tmp_path / "nvme"), "--steps", "1"]
    main([*args, "--dry-run"])
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "would split an 8-bit quantization block" in out, out
    assert main(args) == 2
    assert "error: block 1 (block0) is updated in chunks" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["8bit-moments", "bf16-master"])
def test_a_resumed_run_is_the_straight_run(make_dirs, fmt):
    """The rounding noise is a hash of (seed, block, step, element): a resume draws what the straight run drew."""
    data = list(batches(6))
    straight, split = make_dirs(1, "straight"), make_dirs(1, "split")
    with lohan.init(tiny_cfg(), _fmt_config(straight, fmt)) as engine:
        losses = [engine.step(b) for b in data]
        want = engine.state_dict_fp32()
    with lohan.init(tiny_cfg(), _fmt_config(split, fmt)) as engine:
        got = [engine.step(b) for b in data[:3]]
    with lohan.init(tiny_cfg(), _fmt_config(split, fmt), resume=True) as engine:
        assert engine.step_count == 3
        got += [engine.step(b) for b in data[3:]]
        assert engine.store.layout.state_format == fmt
        assert not engine.store.verify()
        have = engine.state_dict_fp32()
    assert got == losses
    for k in want:
        assert torch.equal(have[k], want[k]), k


def test_a_resume_in_another_format_is_refused_with_the_reason(make_dirs):
    dirs = make_dirs(1)
    with lohan.init(tiny_cfg(), _fmt_config(dirs, "8bit-moments")) as engine:
        engine.step(next(batches(1)))
    with pytest.raises(ValueError, match=r"8bit-moments format and this run asks for exact.*--state-format "
                                         r"8bit-moments"):
        lohan.init(tiny_cfg(), _fmt_config(dirs, "exact"), resume=True)
    with lohan.init(tiny_cfg(), _fmt_config(dirs, "8bit-moments"), resume=True) as engine:
        assert engine.step_count == 1  # the refusal changed nothing


@pytest.mark.parametrize("fmt", ["bf16-moments", "8bit-moments"])
def test_fp32_training_is_pytorch_with_the_reference_optimizer(make_dirs, fmt):
    """fp32 compute: losses and weights equal a plain PyTorch loop (clip_grad_norm_) whose optimizer is the
    in-memory reference of the format, block by block as the engine groups the parameters."""
    ecfg = _fmt_config(make_dirs(1), fmt, max_grad_norm=0.5)
    mcfg, data = tiny_cfg(), list(batches(5))
    with lohan.init(mcfg, ecfg) as engine:
        losses = [engine.step(b) for b in data]
        ours = engine.state_dict_fp32()
        names = [[f"{b.name}.{p.name}" for p in b.params] for b in engine.layout.blocks]
    model = build_model(mcfg, device="cpu", seed=ecfg.seed)
    decays = dict(zip((n for n, _ in model.named_parameters()), decay_mask(model, ecfg.no_decay)))

    def ref_name(k: str) -> str:
        block, _, rest = k.partition(".")
        return f"blocks.{block[5:]}.{rest}" if block.startswith("block") else k
    by_name = dict(model.named_parameters())
    params, blocks = [], []
    for block in names:  # the model's parameters grouped as the engine's blocks, each block one flat vector
        ranges, off = [], 0
        for k in block:
            p = by_name[ref_name(k)]
            ranges.append(ParamRange(off, p.numel(), tuple(p.shape), decays[ref_name(k)]))
            off += p.numel()
        params.append([by_name[ref_name(k)] for k in block])
        blocks.append((torch.cat([p.detach().reshape(-1) for p in params[-1]]), ranges))
    opt = FormatAdamW(fmt, blocks, AdamWHyper(1.0, 0.9, 0.95, 1e-8, 0.0), seed=ecfg.seed)
    ref_losses = []
    for step, (x, y) in enumerate(data):
        loss = model(x, y)[1]
        loss.backward()
        ref_losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), ecfg.max_grad_norm)
        lr = ecfg.lr * lr_factor(step, ecfg.warmup_steps, ecfg.total_steps, ecfg.min_lr_ratio)
        hp = AdamWHyper(lr, *ecfg.betas, ecfg.eps, ecfg.weight_decay)
        opt.step([torch.cat([p.grad.reshape(-1) for p in block]) for block in params], hp)
        with torch.no_grad():
            for k, block in enumerate(params):
                flat = opt.weights(k)
                for p, r in zip(block, blocks[k][1]):
                    p.copy_(flat[r.offset:r.offset + r.numel].view(p.shape))
                    p.grad = None
    assert [str(x) for x in losses] == [str(x) for x in ref_losses]
    assert all(math.isfinite(x) for x in losses)
    same_weights(ours, {n: p.detach() for n, p in model.named_parameters()})


def test_the_store_keeps_a_quarter_of_the_bytes(make_dirs):
    """bf16-master's records: 2 + 2 x (1 + 4/256) bytes per parameter and padding, against exact's 14."""
    sizes = {}
    for fmt in ("exact", "bf16-master"):
        dirs = make_dirs(1, fmt)
        with lohan.init(tiny_cfg(d_model=256, n_layer=1), config(dirs, state_format=fmt, compute_dtype="bf16",
                                                                  name=fmt)) as engine:
            sizes[fmt] = engine.layout.slot_bytes
            params = engine.layout.param_count
        store = StateStore.open(dirs, name=fmt, backend="threads")
        try:
            assert store.layout.state_format == fmt and not store.verify()
        finally:
            store.close()
    assert sizes["exact"] >= 14 * params
    assert sizes["bf16-master"] < 4.1 * params + 4096 * 5 * 4  # (each section of each of 4 blocks padded)


@pytest.mark.parametrize("fmt", ["bf16-moments", "8bit-moments"])
def test_fp16_loss_scaling_feeds_the_format_what_it_feeds_exact(make_dirs, monkeypatch, fmt):
    """fp16: the gradients reach the optimizer unscaled (a step whose scaled gradients overflow is skipped before
    any update), so the format's update is the reference's on what was handed over."""
    rec = Recorder(monkeypatch)
    ecfg = config(make_dirs(1), state_format=fmt, compute_dtype="fp16", max_grad_norm=0.5)
    with lohan.init(tiny_cfg(), ecfg) as engine:
        ref = _reference(engine, fmt)
        for batch in batches(6):
            engine.step(batch)
            m = engine.last_stats.to_dict()
            if m["skipped"]:
                rec.grads.clear()
                continue
            _replay(ref, rec, m["clip_coef"])
        _check_weights(engine, ref)
    assert ref.step_count >= 3  # updates were made, not only skipped


def test_a_block_bigger_than_the_staging_room_initializes_in_every_format(tmp_path):
    """Records bigger than the staging budget are written in pieces; with 8-bit moments a block whose pieces would
    split a quantization block (a parameter off the 256 grid) is written whole instead, and both read back."""
    from torch import nn

    from lohan.store.states import StateStore, plan_layout

    blocks = [nn.Sequential(nn.Linear(100, 300), nn.Linear(300, 90))]  # offsets 30000, 30300, 57300: off the grid
    weights = [p.detach().clone() for p in blocks[0].parameters()]
    for fmt in FORMATS:
        layout = plan_layout(blocks, ["b"], "bf16", 1, fmt)
        (tmp_path / fmt).mkdir()
        store = StateStore.create([str(tmp_path / fmt)], layout, {"kind": "t"}, lambda i: weights,
                                  staging_budget=16 << 10, backend="threads")
        try:
            assert not store.verify()
            got = store.read_params(0)
            for a, b in zip(got, weights):
                assert torch.equal(a, b.to(torch.bfloat16).float() if fmt == "bf16-master" else b), fmt
        finally:
            store.close()
