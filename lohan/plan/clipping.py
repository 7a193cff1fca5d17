"""When to speculate a clipped step's update (pure policy: no torch, no I/O).

With exact global-norm clipping the norm is known only when backward ends. A step can either

- *speculate*: update every block at coefficient 1 under backward (the cost model's ``t_iter``); if the norm
  then exceeds ``max_grad_norm``, the optimizer pass is redone from the previous slot (``Estimate.t_redo``);
- *defer*: read ahead during backward and update once the norm is known (``Estimate.t_deferred``).

Measured against a speculated step that does not clip, speculating costs ``redo`` seconds more with the
probability ``p`` that the step clips, and deferring costs ``defer`` seconds more for sure. So speculate when
``p * redo < defer`` (:func:`should_speculate`). ``defer`` can be negative: where the SSDs bind, a deferred step's
next forward takes its P16 from the update instead of the SSDs, and deferring is then always chosen.

:func:`clip_probability` gives ``p`` from the recent norms; :class:`ClipCosts` gives ``defer`` and ``redo``, from
the cost model's estimate at first and from measured step times as they come. The engine is to call it (nothing
imports it yet).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["clip_probability", "should_speculate", "ClipCosts", "STEP_KINDS", "SIGMA_PRIOR", "PRIOR_WEIGHT",
           "SIGMA_MIN"]

SIGMA_PRIOR = 0.5
"""Prior standard deviation of the step-to-step change of log(norm), worth ``PRIOR_WEIGHT`` observed changes: with
one or two norms seen the next one is still uncertain (a norm half the maximum clips with probability ~0.08)."""
PRIOR_WEIGHT = 2.0
"""How many observed changes of log(norm) the prior is worth."""
SIGMA_MIN = 0.02
"""Floor on that standard deviation: a run of identical norms never makes the next one certain."""
STEP_KINDS = ("speculated", "deferred", "redone")
"""What :meth:`ClipCosts.observe` is told a step was: speculated and not clipped (or clipping off), deferred, or
speculated and redone."""


def clip_probability(norms: Sequence[float], max_norm: float, window: int = 16) -> float:
    """The probability that the next step's global gradient norm exceeds ``max_norm``.

    A random walk on log(norm): the next log-norm is Normal(the last one, sigma), sigma from the step-to-step
    changes of the last ``window`` norms, shrunk towards :data:`SIGMA_PRIOR` (worth ``PRIOR_WEIGHT`` changes) and
    at least :data:`SIGMA_MIN`. Norms that are not finite (skipped steps) or not positive (nothing to clip, no
    scale) are left out. No norm left: 0.5, so the choice falls to the costs. ``max_norm <= 0`` (clipping off): 0.
    """
    if max_norm <= 0:
        return 0.0
    logs = [math.log(x) for x in norms[-window:] if math.isfinite(x) and x > 0]
    if not logs:
        return 0.5
    steps = [b - a for a, b in zip(logs, logs[1:])]
    var = (PRIOR_WEIGHT * SIGMA_PRIOR**2 + sum(d * d for d in steps)) / (PRIOR_WEIGHT + len(steps))
    sigma = max(SIGMA_MIN, math.sqrt(var))
    z = (math.log(max_norm) - logs[-1]) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2))  # P(Normal > z)


DEFER_TIE = 0.01
"""Where no step can be redone, deferring is chosen only where it is cheaper than updating during backward by more
than this share of a step (`should_speculate`): closer than that, the cost model cannot tell them apart."""


def should_speculate(p_clip: float, defer_cost_s: float, redo_cost_s: float, tie_s: float = 0.0) -> bool:
    """Speculate when a wrong guess's expected cost, ``p_clip * redo_cost_s``, is below the sure cost of deferring,
    ``defer_cost_s`` (both in seconds beyond a speculated step that does not clip). Ties defer: a deferred step is
    never redone. Where nothing can be redone (``p_clip`` 0: clipping off, or norms far below the limit) a tie
    speculates instead, deferring only where it is cheaper by more than ``tie_s``: where one lane binds, the cost
    model prices both schedules alike, and a deferred step's next forward then waits for each block's update
    (on the emulated GPU box of benchmarks/lane_bench.py, ~5% slower where the two were priced level)."""
    if p_clip == 0:
        return defer_cost_s >= -tie_s
    return p_clip * redo_cost_s < defer_cost_s


class _Times(Protocol):
    """What :meth:`ClipCosts.from_estimate` reads of a ``planner.Estimate``."""

    t_iter: float
    t_deferred: float
    t_redo: float


@dataclass
class ClipCosts:
    """Seconds a deferred and a redone step cost beyond a speculated step that does not clip.

    Holds an exponential moving average of the measured time of each step kind (:data:`STEP_KINDS`), weight
    ``weight`` for each new step. A kind not measured yet is the estimate's time scaled by how the measured kinds
    compare with their estimates (the mean ratio; 1 before any), so the estimate stays the prior for the costs'
    proportions while the measurements fix their scale. Mutable: the engine keeps one and calls :meth:`observe`
    once per step (leave out steps that do not repeat, such as the first one, which profiles).
    """

    estimate: dict[str, float]
    """Predicted seconds of each kind: ``speculated`` (t_iter), ``deferred`` (t_deferred), ``redone`` (t_redo)."""
    weight: float = 0.2
    measured: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [k for k in STEP_KINDS if not self.estimate.get(k, 0) > 0]
        if missing or not 0 < self.weight <= 1:
            raise ValueError(f"ClipCosts needs a positive estimate of {', '.join(STEP_KINDS)} (missing or <= 0: "
                             f"{', '.join(missing) or 'none'}) and 0 < weight <= 1 (weight={self.weight})")

    @staticmethod
    def from_estimate(est: _Times, weight: float = 0.2) -> ClipCosts:
        """The cost model's prior: ``t_iter``, ``t_deferred``, ``t_redo`` of a ``planner.Estimate``."""
        return ClipCosts({"speculated": est.t_iter, "deferred": est.t_deferred, "redone": est.t_redo}, weight)

    def reprice(self, est: _Times) -> None:
        """Take a re-priced estimate (a profile refined by the run's measurements): new proportions for the kinds
        not measured yet; the measured ones keep their averages."""
        if est.t_iter > 0 and est.t_deferred > 0 and est.t_redo > 0:
            self.estimate = {"speculated": est.t_iter, "deferred": est.t_deferred, "redone": est.t_redo}

    def observe(self, kind: str, step_s: float) -> None:
        """Take a measured step time of ``kind`` (one of :data:`STEP_KINDS`); non-finite or negative times are
        ignored (an interrupted step)."""
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind {kind!r}: choose one of {', '.join(STEP_KINDS)}")
        if not (math.isfinite(step_s) and step_s >= 0):
            return
        old = self.measured.get(kind)
        self.measured[kind] = step_s if old is None else old + self.weight * (step_s - old)

    def time(self, kind: str) -> float:
        """Seconds a step of ``kind`` takes: measured (moving average), else the scaled estimate."""
        if kind in self.measured:
            return self.measured[kind]
        ratios = [self.measured[k] / self.estimate[k] for k in self.measured]
        return self.estimate[kind] * (sum(ratios) / len(ratios) if ratios else 1.0)

    def costs(self) -> tuple[float, float]:
        """(defer_cost_s, redo_cost_s): a deferred and a redone step's seconds beyond a speculated unclipped one."""
        base = self.time("speculated")
        return self.time("deferred") - base, self.time("redone") - base

    def speculate(self, norms: Sequence[float], max_norm: float) -> bool:
        """Whether the next step should speculate, from the recent norms and these costs."""
        return should_speculate(clip_probability(norms, max_norm), *self.costs())
