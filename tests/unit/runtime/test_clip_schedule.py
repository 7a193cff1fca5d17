"""`ClipSchedule`: `clip_mode: auto` speculates or defers each step from the running norm and what each way costs
(measured in steady state, else the cost model's figures, else the rule of old: speculate after an unclipped
step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lohan.config import EngineConfig
from lohan.plan.clipping import should_speculate
from lohan.runtime.clip_schedule import ClipSchedule


def cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"nvme": ["/nonexistent"], "cpu_mem": "1GiB", "max_grad_norm": 1.0, **kw})


def stats(norm: float, step_s: float = 1.0, deferred: bool = False, redone: bool = False, skipped: bool = False,
          overlapped: bool | None = None) -> SimpleNamespace:
    """A step's outcome; `overlapped` (the next forward ran beside its pass): by default a deferred or redone
    step's, not a speculated one's (whose tail the next forward follows only where it was still running)."""
    coef = min(1.0, 1.0 / (norm + 1e-6))
    return SimpleNamespace(grad_norm=norm, clip_coef=None if skipped else coef, deferred=deferred, redone=redone,
                           skipped=skipped, step_s=step_s,
                           next_forward_overlapped=deferred or redone if overlapped is None else overlapped)


def estimate(t_iter=4.0, t_deferred=5.0, t_redo=7.0) -> SimpleNamespace:
    return SimpleNamespace(t_iter=t_iter, t_deferred=t_deferred, t_redo=t_redo)


@pytest.mark.parametrize("mode,expected", [("speculate", True), ("defer", False)])
def test_a_fixed_clip_mode_is_obeyed(mode, expected):
    s = ClipSchedule(cfg(clip_mode=mode))
    assert s.speculate(estimate()) is expected
    s.observe(stats(0.1))
    assert s.speculate(estimate()) is expected


def test_the_first_step_defers_then_steady_clipping_keeps_deferring():
    s = ClipSchedule(cfg())
    assert s.speculate(estimate()) is False
    for _ in range(5):
        s.observe(stats(3.0, deferred=True))
        assert s.speculate(estimate()) is False
    assert s.last_choice["rule"] == "cost" and s.last_choice["p_clip"] > 0.9


def test_norms_far_below_the_limit_speculate():
    s = ClipSchedule(cfg())
    for _ in range(5):
        s.observe(stats(0.05))
    assert s.speculate(estimate()) is True


def test_without_costs_the_rule_of_old_speculates_after_an_unclipped_step():
    s = ClipSchedule(cfg())
    s.observe(stats(0.5))
    assert s.speculate(None) is True
    s.observe(stats(2.0))
    assert s.speculate(None) is False
    assert s.last_choice["rule"] == "last step"


def test_data_parallel_keeps_to_the_rule_of_old_whatever_the_costs():
    s = ClipSchedule(cfg(), by_cost=False)
    s.observe(stats(0.05))
    assert s.speculate(estimate(t_deferred=1.0)) is True  # (by cost it would defer: deferring is cheaper)
    s.observe(stats(5.0))
    assert s.speculate(estimate(t_deferred=1.0)) is False


def test_measured_steady_costs_replace_the_model_and_a_cheaper_deferral_wins_even_far_below_the_limit():
    s = ClipSchedule(cfg())
    for _ in range(3):  # speculated steps after speculated ones: steady, 5 s each
        s.observe(stats(0.05, step_s=5.0))
    for _ in range(3):  # deferred after deferred: 4 s (the next forward hidden beside the update)
        s.observe(stats(0.05, step_s=4.0, deferred=True))
    defer, redo = s.costs(estimate())
    assert defer == pytest.approx(-1.0)
    assert s.speculate(estimate()) is False  # deferring costs less than a right speculation


def test_only_steady_steps_are_timed():
    s = ClipSchedule(cfg())
    s.observe(stats(0.05, step_s=9.0, deferred=True))  # the first: nothing before it
    s.observe(stats(0.05, step_s=3.0))  # after a deferred one: its forward ran in that step
    assert s.costs(estimate()) == pytest.approx((1.0, 3.0))  # nothing measured: the model's
    s.observe(stats(0.05, step_s=5.0))
    s.observe(stats(2.0, step_s=8.0, redone=True))  # a redo after a speculated step: its own forward, timed
    s.observe(stats(0.05, step_s=1.0, skipped=True))  # a skipped step breaks the run
    s.observe(stats(0.05, step_s=7.0))
    assert s._costs.measured == {"speculated": 5.0, "redone": 8.0}


def test_a_speculated_step_the_next_forward_followed_is_timed_after_a_step_that_ran_its_forward():
    """A speculated step whose tail the next forward followed (`StepPlan.tail_follows`) ran that forward, as a
    deferred step does: after a deferred step (or another such) its time holds one forward, the next one's, and is
    timed; after a plain speculated step it would hold two. A deferred step after it is timed as well."""
    s = ClipSchedule(cfg())
    s.observe(stats(0.05, step_s=9.0, deferred=True))  # the first: nothing before it
    s.observe(stats(0.05, step_s=3.0, overlapped=True))  # one forward (the next one's): timed
    s.observe(stats(0.05, step_s=4.0, deferred=True))  # after a step that ran its forward: timed
    s.observe(stats(0.05, step_s=2.5, overlapped=False))  # its own forward was run before it: not timed
    s.observe(stats(0.05, step_s=6.0, overlapped=True))  # its own forward and the next one: not timed
    assert s._costs is None and s._early == [("speculated", 3.0), ("deferred", 4.0)]


def test_the_model_is_scaled_by_what_the_measured_kind_says_of_it():
    s = ClipSchedule(cfg())
    for _ in range(3):
        s.observe(stats(0.9, step_s=8.0))  # measured 2x the model's t_iter
    defer, redo = s.costs(estimate(t_iter=4.0, t_deferred=5.0, t_redo=7.0))
    assert defer == pytest.approx(2.0) and redo == pytest.approx(6.0)


def test_a_schedule_never_measured_is_tried_for_two_steps_where_that_is_cheap():
    s = ClipSchedule(cfg())
    s.observe(stats(0.05, deferred=True))
    choices = []
    for _ in range(120):  # deferring is priced cheaper by the model: every step defers, but speculation is tried
        sp = s.speculate(estimate(t_deferred=3.0))
        choices.append(sp)
        s.observe(stats(0.05, step_s=5.0 if sp else 4.0, deferred=not sp))
    assert choices.count(True) == 2 and choices[choices.index(True) + 1]  # two in a row: the second is timed
    assert s._costs.measured["speculated"] == 5.0  # measured now: no more probes
    s2 = ClipSchedule(cfg())
    for _ in range(120):  # every step clips: speculating would redo, so it is never tried
        assert s2.speculate(estimate()) is False
        s2.observe(stats(3.0, deferred=True))


def unclipped(norm: float, step_s: float = 1.0, deferred: bool = False) -> SimpleNamespace:
    return SimpleNamespace(grad_norm=norm, clip_coef=None, deferred=deferred, redone=False, skipped=False,
                           step_s=step_s, next_forward_overlapped=deferred)


def test_clipping_off_without_room_for_the_gradients_always_updates_during_backward():
    s = ClipSchedule(cfg(max_grad_norm=0.0, clip_mode="defer"), defer_unclipped=False)
    for _ in range(3):
        assert s.speculate(estimate(t_deferred=1.0)) is True
        s.observe(unclipped(2.0))
    assert s.last_choice["rule"] == "clipping off"


def test_clipping_off_defers_only_where_deferring_measures_cheaper():
    s = ClipSchedule(cfg(max_grad_norm=0.0), defer_unclipped=True)
    s.observe(unclipped(2.0))
    assert s.speculate(None) is True  # no cost known yet: during backward, the classic schedule
    assert s.speculate(estimate(t_iter=4.0, t_deferred=5.0)) is True  # the model: deferring costs 1 s
    for _ in range(3):
        s.observe(unclipped(2.0, step_s=5.0))
    for _ in range(3):
        s.observe(unclipped(2.0, step_s=4.5, deferred=True))
    assert s.speculate(estimate(t_iter=4.0, t_deferred=5.0)) is False  # measured: 0.5 s less
    assert s.last_choice["p_clip"] == 0.0


@pytest.mark.parametrize("mode,expected", [("speculate", True), ("defer", False)])
def test_clipping_off_obeys_a_fixed_clip_mode(mode, expected):
    s = ClipSchedule(cfg(max_grad_norm=0.0, clip_mode=mode), defer_unclipped=True)
    s.observe(unclipped(2.0))
    assert s.speculate(estimate()) is expected


def test_a_re_priced_model_moves_the_choice_the_measured_kind_keeps_its_scale():
    """The engine re-prices its estimate once its steps have measured the optimizer's CPU rate
    (`Engine._refine_cpu_rate`): the kinds not measured yet take the new proportions. Priced without the CPU lane,
    deferring looked 0.5 s cheaper; priced with it, updating during backward is."""
    s = ClipSchedule(cfg(max_grad_norm=0.0), defer_unclipped=True)
    s.observe(unclipped(2.0, deferred=True))
    assert s.speculate(estimate(t_iter=2.0, t_deferred=1.5, t_redo=3.0)) is False
    for _ in range(2):
        s.observe(unclipped(2.0, step_s=3.0, deferred=True))  # measured: 2x the model's t_deferred
    assert s.speculate(estimate(t_iter=2.0, t_deferred=2.5, t_redo=3.5)) is True
    defer, _ = s.costs(estimate(t_iter=2.0, t_deferred=2.5, t_redo=3.5))
    assert defer == pytest.approx(3.0 - 2.0 * 3.0 / 2.5)


def test_clipping_off_a_tie_updates_during_backward():
    """Where the model prices both schedules alike (one lane binds either way), the update runs during backward:
    deferring must be cheaper by more than DEFER_TIE of a step (with clipping on, a tie still defers)."""
    s = ClipSchedule(cfg(max_grad_norm=0.0), defer_unclipped=True)
    s.observe(unclipped(2.0))
    assert s.speculate(estimate(t_iter=4.0, t_deferred=4.0)) is True
    assert s.speculate(estimate(t_iter=4.0, t_deferred=3.98)) is True  # 0.5%: within the tie
    assert s.speculate(estimate(t_iter=4.0, t_deferred=3.9)) is False  # 2.5% cheaper: deferred
    assert should_speculate(0.0, 0.0, 1.0) is True and should_speculate(0.01, 0.0, 1.0) is False
