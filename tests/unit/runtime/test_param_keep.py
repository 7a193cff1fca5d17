"""Kept blocks (lohan/runtime/params.py): a released block's P16 stays in the parameter pool while there is room, so
backward does not read again what forward read, and the next forward uses what the optimizer provided.
Exactness under every condition is the equivalence tests' job; here: the reads it saves, and exactness
when the pool is too small to keep everything (kept blocks give way to prefetches)."""

from __future__ import annotations

import time

import pytest

import lohan
from lohan.data import synthetic_batches
from tests.integration.test_engine_equivalence import assert_params_equal, batches, reference_run, tiny_cfg
from tests.integration.test_engine_equivalence import engine_config as _engine_config


def engine_config(dirs, **kw):
    """Records streamed (resident_mem 0): on the CPU a resident record's block computes on the record itself (zero
    copy) and no P16 is read or kept, which is what these tests count."""
    return _engine_config(dirs, **{"resident_mem": 0, **kw})


def _p16_read_per_step(engine, steps, follow: bool) -> list[int]:
    data = synthetic_batches(256, 4, 32, seed=1)
    bs = [next(data) for _ in range(steps + 1)]
    out = []
    for s in range(steps):
        before = engine.streamer.bytes_read
        engine.step(bs[s], next_batch=bs[s + 1] if follow else None)
        out.append(engine.streamer.bytes_read - before)
    return out


def test_backward_reads_no_p16_that_forward_read(make_dirs):
    mcfg = tiny_cfg(n_layer=3)
    with lohan.init(mcfg, engine_config(make_dirs(1), max_grad_norm=0.0, mode="serial")) as engine:
        # forward reads every block but the head, backward only the head (which forward does not visit)
        once = sum(b.p16_bytes for b in engine.store.layout.blocks)
        assert _p16_read_per_step(engine, 3, follow=False) == [once] * 3
    # in place (one slot) nothing is kept: backward reads the blocks again
    with lohan.init(mcfg, engine_config(make_dirs(1, "inplace"), max_grad_norm=0.0, slots=1)) as engine:
        assert all(r > once for r in _p16_read_per_step(engine, 2, follow=False))


def test_a_deferred_step_with_the_next_batch_reads_no_p16_after_the_first(make_dirs):
    """Clipping deferred (clip_mode defer): the next forward runs on the P16 the optimizer provides, and
    backward on the blocks kept from it, so from the second step on no P16 comes from the SSDs."""
    mcfg = tiny_cfg(n_layer=3)
    with lohan.init(mcfg, engine_config(make_dirs(1), max_grad_norm=1.0, clip_mode="defer")) as engine:
        reads = _p16_read_per_step(engine, 4, follow=True)
    assert reads[0] > 0 and reads[1:] == [0, 0, 0]


@pytest.mark.parametrize("mode", ["naive", "optimized"])
def test_an_update_during_backward_hands_its_p16_to_the_next_forward(make_dirs, mode):
    """Clipping off: each block's new P16 is kept from its update during backward, so after the first step no
    P16 comes from the SSDs (serial mode, the ablation's baseline, reads it back: above)."""
    mcfg = tiny_cfg(n_layer=3)
    with lohan.init(mcfg, engine_config(make_dirs(1), max_grad_norm=0.0, mode=mode)) as engine:
        reads = _p16_read_per_step(engine, 4, follow=False)
        assert engine.streamer.handed_over == 4 * len(engine.store.layout.blocks)
    assert reads[0] > 0 and reads[1:] == [0, 0, 0]


def test_the_hand_over_does_not_race_the_release(make_dirs):
    """A block is released before its gradient goes to the optimizer: an update that reaches the block before
    backward lets go of it would find no buffer to keep its P16 in (slow releases make that race certain)."""
    mcfg = tiny_cfg(n_layer=3)
    with lohan.init(mcfg, engine_config(make_dirs(1), max_grad_norm=0.0, mode="optimized")) as engine:
        release = engine.streamer.release

        def slow_release(i: int) -> None:
            time.sleep(0.05)
            release(i)

        engine.streamer.release = slow_release
        reads = _p16_read_per_step(engine, 3, follow=False)
        assert engine.streamer.handed_over == 3 * len(engine.store.layout.blocks)
    assert reads[1:] == [0, 0]


@pytest.mark.parametrize("follow", [False, True])
def test_a_redone_step_does_not_leave_its_speculated_p16_kept(make_dirs, follow):
    """Speculated steps that all clip: the speculative pass hands its coefficient-1 P16 over, the redo rewrites
    the slot; the next step must run on the redo's parameters (with the next batch, the redo provides them;
    without, they are read from the SSDs)."""
    mcfg = tiny_cfg(n_layer=3)
    ecfg = engine_config(make_dirs(1), max_grad_norm=1e-3, clip_mode="speculate")
    data = list(batches(4, 4, 32, 256))
    ref_losses, ref_params = reference_run(mcfg, ecfg, data)
    with lohan.init(mcfg, ecfg) as engine:
        losses = [engine.step(b, next_batch=data[s + 1] if follow and s + 1 < len(data) else None)
                  for s, b in enumerate(data)]
        assert engine.last_stats.redone
        assert engine.streamer.handed_over > 0
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    assert_params_equal(params, ref_params)


def test_bit_exact_when_the_pool_cannot_keep_every_block(make_dirs):
    mcfg = tiny_cfg(n_layer=6)
    ecfg = engine_config(make_dirs(1), prefetch_depth=1, max_grad_norm=1.0)
    with lohan.init(mcfg, ecfg.with_overrides(name="probe")) as engine:
        total = sum(b.p16_bytes for b in engine.store.layout.blocks)
        assert engine.params_pool.budget_bytes < total  # kept blocks must give way
    ref_losses, ref_params = reference_run(mcfg, ecfg, batches(5, 4, 32, 256))
    losses = []
    with lohan.init(mcfg, ecfg) as engine:
        data = list(batches(5, 4, 32, 256))
        for s, b in enumerate(data):
            losses.append(engine.step(b, next_batch=data[s + 1] if s + 1 < len(data) else None))
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    assert_params_equal(params, ref_params)
