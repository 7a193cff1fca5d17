"""int8 activation records (``act_compress: int8``) train exactly like an in-memory reference of the same algorithm.

The engine runs each transformer block without grad in forward, keeps a record of its input and of the outputs of
the ops the plan swaps, and recomputes the block from that record in backward (DESIGN.md §4.4). With int8 records,
every record that leaves the device (all blocks but the last, which is kept) has its floating tensors quantized on
the way out and dequantized before the recompute. The reference is plain PyTorch: the same model, optimizer and
schedule as `test_engine_equivalence.reference_run`, with every block but the last run as a checkpoint
(`_Checkpoint`) whose saved input, and whose swapped Linears' outputs, go through `quantize_rows` and
`dequantize_rows`. With fp32 compute the two must agree bit for bit: losses and weights, on the CPU and the
simulated device, through main memory and through the SSDs.
"""

from __future__ import annotations

import pytest
import torch

import lohan
import tests.integration.test_engine_equivalence as eq
from lohan.models.gpt import Block
from lohan.runtime.act_quant import compressible, dequantize_rows, quantize_rows
from tests.integration.test_engine_equivalence import assert_params_equal, batches, engine_config, tiny_cfg
from tests.unit.runtime.test_activations import run_engine


def _round_trip(t: torch.Tensor) -> torch.Tensor:
    assert compressible(t), f"the reference expects {tuple(t.shape)} to be compressed"
    return dequantize_rows(*quantize_rows(t), t.dtype)


class _Replace(torch.autograd.Function):
    """``value`` in forward; the gradient goes to ``computed`` (the engine's replay: the op's backward node is
    recorded as usual, the value it returns is the record's)."""

    @staticmethod
    def forward(ctx, computed, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Checkpoint(torch.autograd.Function):
    """A block run without grad in forward and recomputed in backward from its input quantized and dequantized; the
    outputs of the sub-modules named in ``swap`` (Linears: one recorded op each, whose output is the module's) are
    taken from the forward, quantized and dequantized too, instead of recomputed."""

    @staticmethod
    def forward(ctx, x, block, swap):
        outs = {}
        hooks = [getattr(block, n).register_forward_hook(lambda m, a, o, n=n: outs.__setitem__(n, o)) for n in swap]
        try:
            y = Block.forward(block, x)
        finally:
            for h in hooks:
                h.remove()
        ctx.block, ctx.x = block, _round_trip(x)
        ctx.outs = {n: _round_trip(o) for n, o in outs.items()}
        return y

    @staticmethod
    def backward(ctx, grad):
        x = ctx.x.detach().requires_grad_()
        hooks = [getattr(ctx.block, n).register_forward_hook(lambda m, a, o, n=n: _Replace.apply(o, ctx.outs[n]))
                 for n in ctx.outs]
        try:
            with torch.enable_grad():
                y = Block.forward(ctx.block, x)
        finally:
            for h in hooks:
                h.remove()
        torch.autograd.backward(y, grad)  # the block's parameters' gradients accumulate as autograd's own would
        return x.grad, None, None


def compressed_reference(monkeypatch, mcfg, ecfg, data, swap=()):
    """`eq.reference_run` with every block but the last checkpointed through int8 (see the module docstring)."""
    real = eq.build_model

    def build(*args, **kwargs):
        model = real(*args, **kwargs)
        for block in model.blocks[:-1]:
            block.forward = lambda x, block=block: _Checkpoint.apply(x, block, tuple(swap))
        return model

    monkeypatch.setattr(eq, "build_model", build)
    try:
        return eq.reference_run(mcfg, ecfg, data)
    finally:
        monkeypatch.setattr(eq, "build_model", real)


def _check(monkeypatch, mcfg, ecfg, steps, swap, tiers):
    ref_losses, ref_params = compressed_reference(monkeypatch, mcfg, ecfg, batches(steps, 4, 32, 256), swap)
    losses, params, metrics, plan = run_engine(mcfg, ecfg, batches(steps, 4, 32, 256))
    assert plan.block_tiers == tiers
    assert losses == ref_losses
    assert_params_equal(params, ref_params)
    return losses, params, metrics, plan


@pytest.mark.parametrize("policy, swap, micro", [("interblock", (), 1), ("ops:fc,fc_proj", ("fc", "fc_proj"), 2)])
def test_int8_records_equal_the_reference_bit_for_bit(monkeypatch, make_dirs, policy, swap, micro):
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), act_policy=policy, act_compress="int8", micro_batches=micro)
    losses, params, metrics, plan = _check(monkeypatch, mcfg, ecfg, 4, swap, ("cpu", "cpu", "keep"))
    assert set(plan.swap) == set(swap)
    for m in metrics:  # the CPU tier holds the codes and scales: a bit over a quarter of the fp32 records
        assert m["compress"] == "int8" and m["bytes"]["keep"] == m["raw_bytes"]["keep"]
        assert 0.25 < m["bytes"]["cpu"] / m["raw_bytes"]["cpu"] < 0.3
    # the quantization is there to be seen: plain training (no compression) takes another path
    plain_losses, plain_params = eq.reference_run(mcfg, ecfg, batches(4, 4, 32, 256))
    assert plain_losses[0] == losses[0] and plain_losses[1:] != losses[1:]
    assert any(not torch.equal(params[k], plain_params[eq.ref_name(k)]) for k in params)


def test_int8_records_through_the_ssds_equal_the_reference(monkeypatch, make_dirs):
    """act_mem holds less than one record: every block but the last is written to the SSDs compressed."""
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(2), act_policy="ops:fc", act_compress="int8", act_mem=4096)
    _, _, metrics, plan = _check(monkeypatch, mcfg, ecfg, 3, ("fc",), ("ssd", "ssd", "keep"))
    assert all(m["bytes"]["cpu"] == 0 and 0 < m["bytes"]["ssd"] < m["raw_bytes"]["ssd"] / 3 for m in metrics)
    assert all(m["ssd_write_bytes"] >= m["bytes"]["ssd"] for m in metrics)


@pytest.mark.parametrize("tier", ["cpu", "ssd"])
def test_int8_records_on_the_simulated_device(monkeypatch, make_dirs, tier):
    """Quantized on the device before the copy to the host, dequantized there after the copy back: the simulated
    device fails on a missing wait or a host tensor mixed into device compute."""
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), act_policy="ops:fc", act_compress="int8", device="sim",
                         act_mem=4096 if tier == "ssd" else None)
    _, _, metrics, _ = _check(monkeypatch, mcfg, ecfg, 3, ("fc",), (tier, tier, "keep"))
    assert all(m["bytes"][tier] < m["raw_bytes"][tier] / 3 for m in metrics)


def test_records_as_they_are_without_compression(make_dirs):
    """The default stores records as the device made them, so every policy's bit-exactness holds
    (tests/unit/runtime/test_activations.py); the stats say so."""
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), act_policy="swap-all")
    assert ecfg.act_compress == "none"
    _, _, metrics, plan = run_engine(mcfg, ecfg, batches(1, 4, 32, 256))
    assert metrics[0]["compress"] == "none" and metrics[0]["bytes"] == metrics[0]["raw_bytes"]
    assert metrics[0]["bytes"]["cpu"] == plan.cpu_bytes


def test_the_plan_sizes_the_tiers_with_the_compressed_records(make_dirs):
    """The profile measures each op's bytes as they are and int8; the plan's record is the compressed one, exactly
    what the store packs, and the CPU tier's budget is sized from it."""
    mcfg = tiny_cfg(n_layer=4)
    ecfg = engine_config(make_dirs(1), act_policy="swap-all", act_compress="int8")
    with lohan.init(mcfg, ecfg) as engine:
        engine.step(next(batches(1, 4, 32, 256)))
        stats = engine.last_stats.activations
        profile, plan = engine.activations.profile, engine.activations.plan
        budget = engine.activations.store.cpu_pool.budget_bytes
    assert profile.act_compress == "int8" and profile.hardware.act_quant_bps > 0
    assert all(op.bytes_int8 < op.bytes for op in profile.ops if op.name in ("qkv", "fc", "act"))
    assert plan.block_bytes == profile.input_bytes_int8 + sum(op.bytes_int8 for op in profile.ops)
    assert stats["bytes"]["cpu"] == plan.cpu_bytes == 3 * plan.block_bytes
    assert budget < stats["raw_bytes"]["cpu"]  # uncompressed records would not fit the pool
    assert plan.estimate.a_g2m < plan.estimate.a_g2m_raw and plan.estimate.quant_s > 0


def test_bf16_records_take_about_half_and_train_close_to_uncompressed(make_dirs):
    mcfg = tiny_cfg(n_layer=3)
    runs = {}
    for mode in ("none", "int8"):
        ecfg = engine_config(make_dirs(1, mode), act_policy="swap-all", compute_dtype="bf16", act_compress=mode,
                             name=f"bf16-{mode}")
        runs[mode] = run_engine(mcfg, ecfg, batches(4, 4, 32, 256))
    (plain, _, _, _), (losses, _, metrics, _) = runs["none"], runs["int8"]
    assert plain[0] == losses[0] and plain != losses
    assert max(abs(a - b) for a, b in zip(plain, losses)) < 2e-3 * plain[0]  # 1e-4 measured
    assert 0.5 < metrics[-1]["bytes"]["cpu"] / metrics[-1]["raw_bytes"]["cpu"] < 0.6


def test_a_run_with_int8_records_resumes_bit_identically_and_a_changed_setting_is_noted(tmp_path, capsys):
    """The setting is part of the run config (header, run state). A resume continues an int8 run bit for bit; like
    act_policy, a resume may change it (no state outlives a step), and the run says that the numerics change."""
    from lohan.app.cli import main
    from tests.integration.test_cli import args, losses

    flags = ("--act-compress", "int8", "--act-policy", "interblock")
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(args(a, "--steps", "4", *flags)) == 0
    assert main(args(b, "--steps", "2", *flags)) == 0
    capsys.readouterr()
    assert main(args(b, "--steps", "4", "--resume", *flags)) == 0
    out = capsys.readouterr().out
    assert "activations interblock (int8 on the CPU and SSD tiers)" in out and "act_compress" not in out
    assert losses(b / "m.jsonl") == losses(a / "m.jsonl")
    assert main(args(b, "--steps", "5", "--resume", "--act-policy", "interblock")) == 0
    assert "note: act_compress int8 -> none" in capsys.readouterr().out


def test_the_dry_run_plans_and_shows_int8_records(tmp_path, capsys):
    from lohan.app.cli import main
    from tests.integration.test_cli import args

    assert main(args(tmp_path, "--dry-run", "--act-policy", "swap-all", "--act-compress", "int8")) == 0
    out = capsys.readouterr().out
    assert "int8 records:" in out and "leave the device per step instead of" in out and "not priced" not in out
    assert "int8 activations" in out  # the rate, measured on this machine's device
    assert main(args(tmp_path, "--dry-run", "--act-policy", "swap-all")) == 0
    assert "int8 records:" not in capsys.readouterr().out
