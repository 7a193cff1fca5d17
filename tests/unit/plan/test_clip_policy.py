"""Tests for lohan.plan.clipping: the probability that the next step clips, and whether to speculate its update.

Pure and fast: no torch, no engine."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lohan.plan.clipping import SIGMA_MIN, STEP_KINDS, ClipCosts, clip_probability, should_speculate

MAX = 1.0


def test_steady_clipping_defers() -> None:
    """Norms well above the maximum: the next step clips almost surely, and a redo dearer than deferring loses."""
    norms = [3.0, 3.2, 2.9, 3.1, 3.0, 3.05]
    p = clip_probability(norms, MAX)
    assert p > 0.99
    assert not should_speculate(p, defer_cost_s=1.0, redo_cost_s=2.0)


def test_norms_far_below_the_maximum_speculate() -> None:
    norms = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10]
    p = clip_probability(norms, MAX)
    assert p < 1e-6
    assert should_speculate(p, defer_cost_s=0.5, redo_cost_s=5.0)


def test_norms_just_below_the_maximum_with_large_variance_depend_on_the_costs() -> None:
    """Noisy norms near the maximum clip about as often as not: cheap redos speculate, dear ones defer."""
    norms = [0.5, 1.6, 0.7, 1.3, 0.6, 0.95]
    p = clip_probability(norms, MAX)
    assert 0.3 < p < 0.6
    assert should_speculate(p, defer_cost_s=1.0, redo_cost_s=1.2)
    assert not should_speculate(p, defer_cost_s=1.0, redo_cost_s=5.0)


def test_no_history_falls_back_to_the_costs() -> None:
    for history in ([], [math.inf, math.nan], [0.0]):  # skipped steps and zero norms say nothing
        assert clip_probability(history, MAX) == 0.5
    assert should_speculate(0.5, defer_cost_s=1.0, redo_cost_s=1.5)  # expected 0.75 s < a sure 1 s
    assert not should_speculate(0.5, defer_cost_s=1.0, redo_cost_s=2.5)


def test_one_norm_is_not_certainty_and_the_floor_holds() -> None:
    """The prior keeps a single norm at half the maximum from giving certainty; more evidence makes it surer; a
    long run of identical norms leaves sigma at its floor."""
    assert 0.02 < clip_probability([0.5], MAX) < 0.2
    assert 0.0 < clip_probability([0.99] * 100, MAX) < 0.5
    assert clip_probability([0.5] * 2, MAX) > clip_probability([0.5] * 16, MAX)
    assert 0.49 < clip_probability([1.0 - 1e-9] * 16, MAX) < 0.5
    floor = 0.5 * math.erfc(math.log(1 / 0.9) / SIGMA_MIN / math.sqrt(2))
    assert clip_probability([0.9] * 10_000, MAX, window=10_000) == pytest.approx(floor)


def test_probability_is_monotone_in_the_last_norm_and_off_without_clipping() -> None:
    ps = [clip_probability([0.5, 0.6, x], MAX) for x in (0.2, 0.5, 0.9, 1.0, 1.5, 4.0)]
    assert ps == sorted(ps) and ps[3] == pytest.approx(0.5)
    assert clip_probability([5.0], 0.0) == 0.0


def test_deferring_cheaper_always_defers_a_tie_defers_only_where_a_step_may_be_redone() -> None:
    """A deferred step cheaper than a speculated one (the SSDs bind: its forward reads no P16) never speculates. A
    tie speculates where nothing can be redone (p_clip 0: one lane binds either way, and a deferred step's next
    forward waits for each block's update), and defers where a speculation might have to be redone."""
    assert not should_speculate(0.0, defer_cost_s=-0.3, redo_cost_s=1.0)
    assert not should_speculate(0.0, defer_cost_s=-0.3, redo_cost_s=1.0, tie_s=0.2)
    assert should_speculate(0.0, defer_cost_s=-0.1, redo_cost_s=1.0, tie_s=0.2)
    assert should_speculate(0.0, defer_cost_s=0.0, redo_cost_s=1.0)
    assert not should_speculate(0.01, defer_cost_s=0.0, redo_cost_s=1.0)


def test_costs_start_from_the_estimate_and_follow_the_measurements() -> None:
    est = SimpleNamespace(t_iter=10.0, t_deferred=12.0, t_redo=18.0)
    costs = ClipCosts.from_estimate(est, weight=0.5)
    assert costs.costs() == pytest.approx((2.0, 8.0))
    # measured speculated steps twice as slow as predicted: the unmeasured kinds scale with them
    costs.observe("speculated", 20.0)
    assert costs.costs() == pytest.approx((4.0, 16.0))
    # a measured deferred step replaces its scaled estimate; the average moves by `weight` per step
    costs.observe("deferred", 21.0)
    assert costs.time("deferred") == 21.0 and costs.costs()[0] == pytest.approx(1.0)
    costs.observe("deferred", 23.0)
    assert costs.time("deferred") == pytest.approx(22.0)
    # the redone step's estimate scales by the mean ratio of the measured kinds: (20/10 + 22/12) / 2
    assert costs.time("redone") == pytest.approx(18.0 * (2.0 + 22.0 / 12.0) / 2)
    costs.observe("redone", math.inf)  # an interrupted step is not a measurement
    assert "redone" not in costs.measured
    with pytest.raises(ValueError, match="step kind"):
        costs.observe("clipped", 1.0)


def test_speculate_combines_the_norms_and_the_costs() -> None:
    costs = ClipCosts({"speculated": 10.0, "deferred": 11.0, "redone": 20.0})
    assert costs.speculate([0.1, 0.1, 0.1], MAX)      # p ~ 0: a redo is unlikely
    assert not costs.speculate([3.0, 3.0, 3.0], MAX)  # p ~ 1: 10 s of redo against 1 s of deferral
    assert not costs.speculate([], MAX)               # p = 0.5: 5 s expected against 1 s


def test_costs_need_every_kind() -> None:
    with pytest.raises(ValueError, match="deferred"):
        ClipCosts({"speculated": 1.0, "redone": 2.0})
    with pytest.raises(ValueError, match="weight"):
        ClipCosts(dict.fromkeys(STEP_KINDS, 1.0), weight=0.0)
