"""Clipping off, an update may still run after backward, in forward order with the next step's forward beside it
(`clip_mode` defer, or auto where that measures faster; `lohan.plan.pools.may_defer_unclipped`): the same bits as
plain PyTorch either way, the gradients kept meanwhile, and no P16 read from the SSDs after the first step."""

from __future__ import annotations

import dataclasses

import pytest

import lohan
from lohan.plan.pools import plan_host_memory
from lohan.runtime.engine import pool_geometry
from tests.integration.test_engine_equivalence import assert_params_equal, batches, reference_run, tiny_cfg
from tests.integration.test_engine_equivalence import engine_config as _engine_config


def engine_config(dirs, **kw):
    """Records streamed (resident_mem 0), so P16 is read and provided as the schedule tests count (on the CPU a
    resident record's block computes on the record itself: zero copy)."""
    return _engine_config(dirs, **{"resident_mem": 0, **kw})


def run(mcfg, ecfg, data, follow: bool = True):
    losses, deferred, reads = [], [], []
    with lohan.init(mcfg, ecfg) as engine:
        for s, b in enumerate(data):
            before = engine.streamer.bytes_read
            nxt = data[s + 1] if follow and s + 1 < len(data) else None
            losses.append(engine.step(b, next_batch=nxt))
            deferred.append(engine.last_stats.deferred)
            reads.append(engine.streamer.bytes_read - before)
        has_stash = engine.stash is not None
        params = engine.state_dict_fp32()
    return losses, params, deferred, reads, has_stash


@pytest.mark.parametrize("mode", ["naive", "optimized"])
def test_a_deferred_unclipped_update_equals_pytorch(make_dirs, mode):
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), max_grad_norm=0.0, clip_mode="defer", mode=mode)
    data = list(batches(4, 4, 32, 256))
    ref_losses, ref_params = reference_run(mcfg, ecfg, data)
    losses, params, deferred, reads, has_stash = run(mcfg, ecfg, data)
    assert losses == ref_losses
    assert_params_equal(params, ref_params)
    # every step the next forward follows defers; the last (no next batch) updates during backward
    assert deferred == [True, True, True, False] and has_stash
    assert reads[0] > 0 and reads[1:] == [0, 0, 0]


def test_without_the_next_batch_nothing_is_deferred(make_dirs):
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), max_grad_norm=0.0, clip_mode="defer")
    data = list(batches(3, 4, 32, 256))
    ref_losses, ref_params = reference_run(mcfg, ecfg, data)
    losses, params, deferred, _, _ = run(mcfg, ecfg, data, follow=False)
    assert losses == ref_losses and deferred == [False] * 3
    assert_params_equal(params, ref_params)


@pytest.mark.parametrize("over", [dict(clip_mode="speculate"), dict(mode="serial", clip_mode="defer")])
def test_clipping_off_keeps_no_gradients_where_it_never_defers(make_dirs, over):
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), max_grad_norm=0.0, **over)
    data = list(batches(3, 4, 32, 256))
    ref_losses, ref_params = reference_run(mcfg, ecfg, data)
    losses, params, deferred, _, has_stash = run(mcfg, ecfg, data)
    assert losses == ref_losses and deferred == [False] * 3
    assert_params_equal(params, ref_params)
    assert has_stash == (over.get("mode") == "serial")  # serial's grads pool is its stash


def test_auto_plans_room_for_the_gradients_only_where_they_all_fit_in_main_memory(make_dirs):
    from io_engine.align import align_up
    from lohan.models.adapter import GPTBlocks
    from lohan.models.gpt import build_model
    from lohan.store.states import plan_layout

    mcfg = tiny_cfg(n_layer=3)
    program = GPTBlocks(build_model(mcfg, device="meta"))
    ecfg = engine_config(make_dirs(1), max_grad_norm=0.0)
    geom = pool_geometry(program, plan_layout(program.modules, program.names, ecfg.compute_dtype, ecfg.slots))
    roomy = plan_host_memory(geom, ecfg)
    assert roomy.has_stash and roomy.stash_ram == sum(align_up(4 * b.numel) for b in geom.layout.blocks)
    # just below what the stash takes: auto gives up deferring; clip_mode defer keeps it, spilling the rest
    tight = dataclasses.replace(ecfg, cpu_mem=roomy.total - roomy.resident - roomy.readahead - 4096)
    assert not plan_host_memory(geom, tight).has_stash
    assert plan_host_memory(geom, dataclasses.replace(tight, clip_mode="defer")).has_stash
    assert not plan_host_memory(geom, ecfg, world=2).has_stash  # data parallel ranks update during backward


@pytest.mark.parametrize("kept", [True, False])
def test_a_durable_steps_tail_goes_in_forward_order_with_the_next_forward_beside_it(make_dirs, monkeypatch, kept):
    """On a separate device (the simulated one), the update during backward (clipping off): where the optimizer is
    still at it when backward ends, the blocks not begun go in forward order and the next forward follows them.
    The blocks updated before reach that forward from memory (their P16 handed over, taken out of the pool's reach):
    their slot is on no SSD before the commit. Where one of them was not kept (given way here), the forward waits
    for the whole pass, as before. The same bits as plain PyTorch either way."""
    import time

    import lohan.runtime.offload as offload
    from lohan.runtime.params import ParamStreamer

    for name in ("adamw_block_", "adamw_chunk_", "adamw_upcast_", "adamw_unit_"):  # an optimizer behind backward
        real = getattr(offload, name)
        monkeypatch.setattr(offload, name, lambda *a, _real=real, **k: (time.sleep(0.03), _real(*a, **k))[1])
    took: list[bool] = []
    real_take = ParamStreamer.take_handed_over

    def take(self, blocks, slot):
        if not kept:
            self.pool.forget()  # every kept buffer gives way, as a request for room may make it
        took.append(real_take(self, blocks, slot))
        return took[-1]

    monkeypatch.setattr(ParamStreamer, "take_handed_over", take)
    mcfg = tiny_cfg(n_layer=4)
    ecfg = engine_config(make_dirs(1), max_grad_norm=0.0, clip_mode="speculate", device="sim", cpu_mem="1GiB")
    data = list(batches(4, 4, 32, 256))
    ref_losses, ref_params = reference_run(mcfg, ecfg, data)
    losses, overlapped = [], []
    with lohan.init(mcfg, ecfg) as engine:
        for s, b in enumerate(data):
            losses.append(engine.step(b, next_batch=data[s + 1] if s + 1 < len(data) else None))
            overlapped.append(engine.last_stats.next_forward_overlapped)
            assert not engine.last_stats.deferred
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    assert_params_equal(params, ref_params)
    assert took and all(t == kept for t in took)  # every step with a next batch turned (the optimizer was behind)
    assert overlapped == ([True] * 3 if kept else [False] * 3) + [False]
