"""Every activation policy trains exactly like plain PyTorch, on every tier.

The plan only decides where a block's activations wait between forward and backward (device,
main memory, SSD) and which are recomputed; with fp32 compute the result must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch

import lohan
from lohan.models.gpt import build_model
from lohan.runtime.activation_store import ActivationReplayError, OpTracker, SelectiveMode, record_nbytes
from tests.integration.test_engine_equivalence import (
    assert_params_equal,
    batches,
    engine_config,
    reference_run,
    tiny_cfg,
)

POLICIES = ["recompute-all", "interblock", "swap-all", "plan"]


def run_engine(mcfg, ecfg, data):
    losses, metrics = [], []
    with lohan.init(mcfg, ecfg) as engine:
        for batch in data:
            losses.append(engine.step(batch))
            metrics.append(engine.last_stats.activations)
        params = engine.state_dict_fp32()
        plan = engine.activations.plan
    return losses, params, metrics, plan


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_bit_exact_fp32(make_dirs, policy):
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(2), act_policy=policy, micro_batches=2)
    ref_losses, ref_params = reference_run(mcfg, ecfg, batches(5, 4, 32, 256))
    losses, params, metrics, plan = run_engine(mcfg, ecfg, batches(5, 4, 32, 256))
    assert losses == ref_losses
    assert_params_equal(params, ref_params)
    assert plan.policy == policy
    assert plan.block_tiers[-1] == "keep"
    if policy == "swap-all":
        assert set(plan.swap) == {"ln1", "qkv", "attn", "proj", "ln2", "fc", "act", "fc_proj"}
    if policy in ("interblock", "recompute-all"):
        assert plan.swap == ()


@pytest.mark.parametrize("policy", ["interblock", "swap-all"])
def test_activations_beyond_memory_budget_go_through_ssd(make_dirs, policy, backend):
    """act_mem holds less than one block's record: every block but the last is written to the
    SSDs in forward and read back in backward, and training stays exact."""
    mcfg = tiny_cfg(n_layer=4)
    ecfg = engine_config(make_dirs(3), act_policy=policy, act_mem=4096, backend=backend)
    ref_losses, ref_params = reference_run(mcfg, ecfg, batches(4, 4, 32, 256))
    losses, params, metrics, plan = run_engine(mcfg, ecfg, batches(4, 4, 32, 256))
    assert plan.block_tiers == ("ssd", "ssd", "ssd", "keep")
    assert all(m["bytes"]["ssd"] > 0 and m["bytes"]["cpu"] == 0 for m in metrics)
    assert losses == ref_losses
    assert_params_equal(params, ref_params)


def test_memory_budget_split_between_cpu_and_ssd(make_dirs):
    """With room for two records in main memory, the earliest blocks go to SSD and the rest stay in RAM."""
    mcfg = tiny_cfg(n_layer=5)
    probe = engine_config(make_dirs(1, "probe"), act_policy="swap-all")
    with lohan.init(mcfg, probe) as engine:
        engine.step(next(batches(1, 4, 32, 256)))
        block_bytes = engine.activations.plan.block_bytes
    ecfg = engine_config(make_dirs(2), act_policy="swap-all", act_mem=2 * block_bytes + 100)
    ref_losses, ref_params = reference_run(mcfg, ecfg, batches(3, 4, 32, 256))
    losses, params, metrics, plan = run_engine(mcfg, ecfg, batches(3, 4, 32, 256))
    assert plan.block_tiers == ("ssd", "ssd", "cpu", "cpu", "keep")
    assert metrics[-1]["peak_cpu_bytes"] <= 2 * block_bytes + 2 * 4096
    assert losses == ref_losses
    assert_params_equal(params, ref_params)


def test_bf16_swap_all_matches_recompute_all(make_dirs):
    """Under bf16 autocast, replayed outputs equal the recomputed ones: the policies agree exactly."""
    mcfg = tiny_cfg(n_layer=2)
    runs = []
    for policy in ("recompute-all", "swap-all"):
        ecfg = engine_config(make_dirs(1), act_policy=policy, compute_dtype="bf16", name=f"bf16-{policy}")
        losses, params, _, _ = run_engine(mcfg, ecfg, batches(3, 4, 32, 256))
        runs.append((losses, params))
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k]), k


def test_replay_of_a_different_op_sequence_is_an_error():
    mcfg = tiny_cfg(n_layer=1)
    model = build_model(mcfg, device="cpu", seed=0)
    block = model.blocks[0]
    tracker = OpTracker([block])
    x = torch.randn(2, 8, mcfg.d_model)
    rec = SelectiveMode(tracker, frozenset({"fc"}))
    with torch.no_grad(), rec:
        block(x)
    assert [r.op for r in rec.records] == ["fc"]
    assert record_nbytes([r.leaves[0] for r in rec.records]) >= 2 * 8 * mcfg.mlp_hidden * 4
    wrong = SelectiveMode(tracker, frozenset({"fc", "qkv"}), replay=rec.records)
    with pytest.raises(ActivationReplayError, match="not deterministic"), wrong:
        block(x)
    tracker.remove()


def test_records_keep_values_and_memory_layout_on_every_tier(make_dirs):
    """Packed records come back with the same values, and dense tensors with the same strides (a view
    op in the recompute must see the layout forward saw)."""
    from io_engine import BufferPool, open_volume
    from lohan.runtime.activation_store import ActivationStore, OpRecord
    from lohan.runtime.device import Device

    base = torch.randn(4, 6, 8)
    outs = [base.transpose(0, 1), base[:, ::2], torch.tensor(3.5), torch.arange(5, dtype=torch.int64)]
    dirs = make_dirs(2)
    vol = open_volume(dirs, 1 << 20, backend="threads", name="acts")
    store = ActivationStore(Device("cpu"), BufferPool(1 << 20), vol.buffer_pool(1 << 20), vol)
    x = torch.randn(2, 3)
    for tier in ("keep", "cpu", "ssd"):
        rec = OpRecord("op", "aten.fake", None, [t.clone() if t.dim() == 0 else t for t in outs] + [7])
        store.put((1, 0), x, [rec], tier)
        store.prefetch([(1, 0)])
        got_x, (got,) = store.take((1, 0))
        assert torch.equal(got_x, x)
        assert got.leaves[-1] == 7
        for want, t in zip(outs, got.leaves):
            assert torch.equal(t, want) and t.dtype == want.dtype
        assert got.leaves[0].stride() == outs[0].stride()  # transposed but dense: layout kept
        store.release((1, 0))
    store.end_step()
    vol.close()


def test_profile_from_a_saved_profile_trains_exactly(make_dirs, tmp_path):
    """A run planned from a saved profile (no measurement of the machine) is still exact; a profile
    for another shape is refused."""
    import shutil

    mcfg = tiny_cfg(n_layer=3)
    first = engine_config(make_dirs(1, "first"), act_policy="plan")
    run_engine(mcfg, first, batches(1, 4, 32, 256))
    saved = tmp_path / "profile.json"
    shutil.copy(f"{first.nvme[0]}/lohan.profile.json", saved)
    ecfg = engine_config(make_dirs(2), act_policy="plan", profile_from=str(saved), act_mem=4096)
    ref_losses, ref_params = reference_run(mcfg, ecfg, batches(3, 4, 32, 256))
    losses, params, _, plan = run_engine(mcfg, ecfg, batches(3, 4, 32, 256))
    assert losses == ref_losses and plan.block_tiers[0] == "ssd"
    assert_params_equal(params, ref_params)
    with pytest.raises(ValueError, match="is for batch 4"), lohan.init(mcfg, ecfg.with_overrides(name="b8")) as e:
        e.step(next(batches(1, 8, 32, 256)))


def test_attention_flops_count_the_query_heads_on_every_fused_kernel():
    """Grouped-query attention (fewer key/value heads): the profile counts Q·K^T and P·V over the query heads,
    and does so itself for every fused kernel (torch 2.11's table refused these shapes on CUDA)."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from lohan.runtime.profiler import _EXTRA_FLOPS

    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
               aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu):
        assert op in _EXTRA_FLOPS
    b, hq, hkv, t, d = 2, 4, 2, 16, 8
    q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as fc:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert fc.get_total_flops() == 2 * (2 * b * hq * t * t * d)
