"""`StepPlan.make`: every decision of a step's schedule in one place, from the config, the commit and the last
step's clip coefficient (pure: no engine, no store)."""

from __future__ import annotations

import pytest
import torch

from lohan.config import EngineConfig
from lohan.runtime.step import StepPlan
from lohan.store.states import Commit

N = 4


def plan(speculate=False, next_idx=True, one_process=True, separate_device=False, **over):
    cfg = EngineConfig(nvme=["/nonexistent"], cpu_mem="1GiB", **over)
    commit = Commit(step=5, slot=0, updates=4)
    nxt = torch.zeros(1, 8, dtype=torch.long) if next_idx else None
    return StepPlan.make(cfg, commit, 0, 1, N, speculate, nxt, one_process, separate_device=separate_device)


def test_counts_and_slots_come_from_the_commit():
    p = plan()
    assert (p.step, p.update, p.read_slot, p.write_slot) == (5, 5, 0, 1)  # one skipped step: 4 updates in 5 steps
    assert p.hyper.lr > 0


@pytest.mark.parametrize("next_idx", [True, False])
def test_clipping_off_updates_at_once_in_backward_order(next_idx):
    p = plan(speculate=True, max_grad_norm=0.0, next_idx=next_idx)
    assert not p.deferred and not p.speculated and not p.follow and not p.lazy
    assert not p.gate.deferred and p.order == (3, 2, 1, 0)


def test_clipping_off_defers_only_a_step_the_next_forward_follows():
    p = plan(speculate=False, max_grad_norm=0.0)
    assert p.deferred and p.follow and p.lazy and not p.speculated and p.order == (0, 1, 2, 3)
    p = plan(speculate=False, max_grad_norm=0.0, next_idx=False)
    assert not p.deferred and not p.gate.deferred and p.order == (3, 2, 1, 0)


@pytest.mark.parametrize("speculate", [True, False])
def test_the_schedule_decides_deferral(speculate):
    p = plan(speculate=speculate, max_grad_norm=1.0)
    deferred = not speculate
    assert p.deferred is deferred and p.speculated is (not deferred)
    assert p.follow is deferred and p.order == ((0, 1, 2, 3) if deferred else (3, 2, 1, 0))


def test_a_deferred_pass_follows_only_with_the_next_batch_and_is_lazy_only_in_one_process():
    assert not plan(next_idx=False).follow
    assert plan().lazy
    assert not plan(write_behind=False).lazy
    assert not plan(one_process=False).lazy
    assert plan(one_process=False).follow


def test_in_place_slots_always_defer():
    p = plan(slots=1, max_grad_norm=0.0, speculate=True)
    assert p.deferred and not p.speculated and p.gate.deferred


def test_in_place_the_next_forward_follows_the_pass_but_nothing_is_written_behind():
    p = plan(slots=1, write_behind=True)
    assert p.follow and p.order == (0, 1, 2, 3) and not p.lazy  # no previous commit would stand meanwhile


def test_a_speculated_step_keeps_the_next_batch_for_its_redo():
    p = plan(speculate=True)
    assert not p.follow and p.next_idx is not None  # a redone pass runs in forward order beside the next forward


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_durable_tail_the_next_forward_may_follow_only_on_a_separate_device(clip):
    """On a separate device, a durable step updating during backward may turn to forward order with the next
    forward beside it; clipping off (nothing can redo the pass) its last writes and commit complete beside the next
    backward (write-behind). On the CPU the tail is offered (the engine declines it and runs the next forward once
    the pass is done) but never written behind; without the next batch, in serial mode or data parallel: never."""
    p = plan(speculate=True, max_grad_norm=clip, separate_device=True)
    assert p.tail_follows and not p.deferred and p.order == (3, 2, 1, 0) and p.lazy == (clip == 0.0)
    cpu = plan(speculate=True, max_grad_norm=clip)
    assert cpu.tail_follows and not cpu.lazy
    for other in (plan(speculate=True, max_grad_norm=clip, separate_device=True, next_idx=False),
                  plan(speculate=True, max_grad_norm=clip, separate_device=True, mode="serial"),
                  plan(speculate=True, max_grad_norm=clip, separate_device=True, one_process=False)):
        assert not other.tail_follows and not other.lazy
