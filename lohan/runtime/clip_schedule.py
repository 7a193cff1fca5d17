"""`clip_mode: auto`, step by step: speculate or defer, from the running gradient norm and what each costs.

With exact global-norm clipping the coefficient is known only at the end of backward. A step either
*speculates* (updates each block at coefficient 1 during backward, and redoes the whole optimizer pass from the
previous slot if the step clips after all) or *defers* (reads ahead during backward and updates once the norm is
known, in forward order with the next step's forward beside it). Both give the same bits; they differ in time:

- a deferred step costs ``defer`` seconds more than a speculated step that was right, clipped or not;
- a speculated step that clips costs ``redo`` seconds more (the optimizer pass runs twice, its I/O included).

With clipping off (``max_grad_norm`` 0) nothing is redone (``p_clip`` is 0): a step updates during backward unless
deferring measures cheaper (``defer < 0`` by more than `lohan.plan.clipping.DEFER_TIE` of a step, below: a tie
speculates), where the memory plan kept the step's gradients in main memory (`lohan.plan.pools.may_defer_unclipped`);
`step.clip_gate` then defers only a step the next forward follows.

So speculating pays when ``p_clip * redo < defer`` (`lohan.plan.clipping.should_speculate`), with ``p_clip`` the
probability that this step clips, estimated from the recent norms (`lohan.plan.clipping.clip_probability`).
Steady clipping (early fine-tuning) then defers every step and never redoes; norms well below the limit speculate;
and where deferring costs less than a right speculation (``defer < 0``: a CPU device that shares its
cores with the optimizer, where the update beside the next forward hides better than under backward) the schedule
defers whatever the norm.

The costs are measured: the step time of each kind, in steady state only (a step that holds one forward: a step
that runs the next one's forward, deferred or a speculated one whose tail that forward follows, after another that
ran its own; a speculated step that runs none of the next one's after another such; mixed neighbours would count
one forward twice or not at all), as moving
averages (`lohan.plan.clipping.ClipCosts`). A kind not measured yet is the cost model's figure (`planner.Estimate`:
``t_iter``, ``t_deferred``, ``t_redo``, priced on the profile of the first step) scaled by what the measured kinds
say of the model's accuracy; before that plan exists, the rule of old: speculate after a step that did not clip. Data parallel ranks keep to that rule (their choices must
agree, and their step times do not).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from lohan.config import EngineConfig
from lohan.plan.clipping import DEFER_TIE, ClipCosts, clip_probability, should_speculate

if TYPE_CHECKING:
    from lohan.plan.planner import Estimate
    from lohan.runtime.step import StepStats

HISTORY = 16
"""Recent gradient norms the clip probability is estimated from."""

PROBE_EVERY = 50
"""Steps after which a schedule never measured is tried for two steps (the second one is timed), where trying it
is cheap: deferring (its modeled cost), or speculating while a clip is unlikely (`PROBE_P_CLIP`). Otherwise a run
that always makes one choice would price the other from the model alone."""

PROBE_P_CLIP = 0.1


class ClipSchedule:
    """The speculate-or-defer choice of `clip_mode` (module docstring), fed each step's `StepStats`."""

    def __init__(self, cfg: EngineConfig, by_cost: bool = True, defer_unclipped: bool = False) -> None:
        self.cfg = cfg
        # clipping off: whether an update may run after backward at all (`pools.may_defer_unclipped`, and the
        # memory plan kept room for the gradients meanwhile)
        self.defer_unclipped = defer_unclipped
        # data parallel: every rank must choose alike (a deferred pass gathers the next forward's blocks from
        # the other ranks), and their step times differ; the coefficient, a global figure, is the same on all
        self.by_cost = by_cost
        self.norms: deque[float] = deque(maxlen=HISTORY)
        self.last_coef: float | None = None
        self._costs: ClipCosts | None = None  # made from the first estimate (the plan of the first step)
        self._early: list[tuple[str, float]] = []  # steady step times measured before that
        self._prev: bool | None = None  # whether the last step ran the next forward (None: no step, or skipped)
        self._since_probe = 0  # steps since the last probe (or the start)
        self._probe_left = 0  # steps of the probe still to run
        self.last_choice: dict[str, float | str | None] = {}  # why the last step was scheduled as it was

    def speculate(self, estimate: Estimate | None = None, replay_s: float = 0.0) -> bool:
        """Whether the next step speculates: updates during backward (`step.clip_gate` decides the rest).
        `replay_s`: what a clip costs at least when the step's states are in RAM only (no previous slot to redo
        from: the steps since the last durable commit are replayed, lohan.runtime.held)."""
        mode = self.cfg.stability.clip_mode
        if self.cfg.stability.max_grad_norm <= 0 and not self.defer_unclipped:
            self.last_choice = {"rule": "clipping off"}
            return True
        if mode != "auto":
            return mode == "speculate"
        if not self.norms:  # the first step: nothing known of the norm
            self.last_choice = {"rule": "first step"}
            return False
        costs = self.costs(estimate) if self.by_cost else None
        if costs is None:
            self.last_choice = {"rule": "last step", "last_coef": self.last_coef}
            return self.last_coef == 1.0 or self.cfg.stability.max_grad_norm <= 0
        defer, redo = costs
        redo = max(redo, replay_s)
        p = clip_probability(list(self.norms), self.cfg.stability.max_grad_norm, HISTORY)
        choice = should_speculate(p, defer, redo, DEFER_TIE * self._costs.time("speculated"))
        self.last_choice = {"rule": "cost", "p_clip": p, "defer_s": defer, "redo_s": redo}
        if self._probe(choice, p):
            self.last_choice["rule"] = "probe"
            return not choice
        return choice

    def _probe(self, choice: bool, p_clip: float) -> bool:
        """Whether this step tries the other schedule (`PROBE_EVERY`)."""
        if self._probe_left:
            self._probe_left -= 1
            return True
        other = "deferred" if choice else "speculated"
        cheap = other == "deferred" or p_clip < PROBE_P_CLIP
        if other in self._costs.measured or not cheap or self._since_probe < PROBE_EVERY:
            return False
        self._since_probe, self._probe_left = 0, 1
        return True

    def costs(self, estimate: Estimate | None) -> tuple[float, float] | None:
        """(defer, redo): seconds a deferred step, and a redone one, take beyond a right speculation
        (`lohan.plan.clipping.ClipCosts`: measured where known, else the cost model's, scaled); None before the
        cost model has priced them."""
        if self._costs is None and estimate is not None and estimate.t_deferred > 0 and estimate.t_redo > 0:
            self._costs = ClipCosts.from_estimate(estimate)
            for kind, step_s in self._early:
                self._costs.observe(kind, step_s)
            self._early.clear()
        elif self._costs is not None and estimate is not None:  # the engine re-prices it (`refine_cpu`)
            self._costs.reprice(estimate)
        return self._costs.costs() if self._costs is not None else None

    def observe(self, stats: StepStats) -> None:
        """A committed step's outcome: its norm, its coefficient and, in steady state, its time."""
        self._since_probe += 1
        if stats.skipped:
            self._prev = None
            return
        if stats.grad_norm is not None and math.isfinite(stats.grad_norm):
            self.norms.append(stats.grad_norm)
        if stats.clip_coef is not None:
            self.last_coef = stats.clip_coef
        kind = "redone" if stats.redone else "deferred" if stats.deferred else "speculated"
        # whether the step ran the next step's forward: a deferred one always did (when told the next batch); a
        # redone one, and a speculated one whose tail the next forward followed, where that forward overlapped
        ran_next = kind == "deferred" or bool(stats.next_forward_overlapped)
        # steady (module docstring): the step holds one forward, its own or the next one's; a redo is priced as a
        # speculated step's own forward plus the redo with the next forward beside it
        if self._prev is not None and self._prev == (False if kind == "redone" else ran_next):
            if self._costs is not None:
                self._costs.observe(kind, stats.step_s)
            else:
                self._early.append((kind, stats.step_s))
        self._prev = ran_next
