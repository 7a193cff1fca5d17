"""The lanes of a run as the cost model predicts them (:func:`predict_lanes`), and, where the SSDs bind, what they
cost and which state format would cost less (:func:`ssd_cost`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lohan.config import ModelConfig
from lohan.plan import formats
from lohan.plan.capacity import design_plan, plan_capacity
from lohan.plan.clipping import DEFER_TIE
from lohan.plan.cost_model import Estimate
from lohan.plan.hardware import Hardware
from lohan.plan.lanes import LANES_B, upgrade_lanes
from lohan.plan.run_plan import RunPlan
from lohan.plan.units import itemsize


def predict_lanes(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, mode: str = "optimized",
                  deferred: bool | None = None, **capacity_args: Any) -> dict[str, float]:
    """Seconds each lane (:data:`LANES_B`) is busy in one step of a run, as the cost model predicts them: the
    plan `capacity.capacity` makes for (``cfg``, ``hw``, ``batch``, ``seq``, ``mode`` and ``capacity_args``: compute
    dtype, state format, resident records, ...), its forward and backward added (`Estimate.step_lanes`) for the
    schedule the run takes (:func:`defers`; ``deferred`` given: that one, e.g. the one a run's measurements chose),
    in the vocabulary the engine measures (`runtime.step.StepStats.lanes`).
    ``hw.cpu_adam_params_per_s`` is the rate of the optimizer's CPU work as it runs: with checksums on, the records'
    hashing included (`fit.measure_cpu_adam`)."""
    return scheduled(cfg, hw, batch, seq, mode, deferred, **capacity_args)[0]


def scheduled(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, mode: str = "optimized",
              deferred: bool | None = None, **capacity_args: Any) -> tuple[dict[str, float], float]:
    """(lanes, step seconds) of the schedule a run's steady steps take (:func:`defers`, or ``deferred`` where
    given): the serial step's (``t_serial``), a deferred one's (``t_deferred``) or a speculated one's (``T_iter``)."""
    run = design_plan(cfg, hw, mode=mode, **capacity_args)
    est = plan_capacity(cfg, hw, batch, seq, run).plan.estimate
    later = defers(run, est) if deferred is None else deferred and mode != "serial" and est.t_deferred > 0
    step_s = est.t_serial if mode == "serial" else est.t_deferred if later else est.t_iter
    return est.step_lanes(mode, deferred=later), step_s


def defers(run: RunPlan, est: Estimate) -> bool:
    """Whether a run's steady steps update after backward (`runtime.clip_schedule.ClipSchedule`), with clipping
    off: where the plan lets an unclipped update wait (``run.defer_unclipped``), ``clip_mode`` defer always, auto
    where the cost model prices that step shorter by more than `clipping.DEFER_TIE` of a step (its prior, which the
    engine's measurements then confirm or overturn; a tie updates during backward). A clipping run's choice follows its gradient norms, which no plan knows: priced as speculating."""
    clip_mode = run.engine.stability.clip_mode
    if not run.defer_unclipped or clip_mode == "speculate":
        return False
    return clip_mode == "defer" or 0 < est.t_deferred < est.t_iter * (1 - DEFER_TIE)


@dataclass(frozen=True)
class SsdCost:
    """What the SSDs cost a run whose ``ssd`` lane is its slowest (:func:`ssd_cost`)."""

    lanes: dict[str, float]
    """The run's lanes per step (seconds): predicted, or measured by its first step."""
    step_s: float
    """The run's step (seconds): predicted, or measured."""
    state_format: str
    """The run's state format."""
    suggested: str
    """Of the state formats with fewer SSD bytes per step, the one whose step the cost model prices shortest."""
    priced: dict[str, tuple[float, str]]
    """Each of those formats' (step seconds, binding lane), predicted (scaled from a measured step by the cost
    model's ratio); the binding lane is ``cpu`` where an update's decoding outweighs the bytes it saves."""
    eval_loss_gap: float | None
    """``suggested``'s measured quality cost (`formats.EVAL_LOSS_GAP`); None: not measured."""
    tokens: int
    """Tokens per step of the run."""
    hide_tokens: int
    """Tokens per step (a larger batch at this sequence length) at which the ``gpu`` lane is as long as the
    ``ssd`` lane: compute would hide the SSDs on this box."""

    def format(self, source: str = "predicted") -> str:
        """One line: the lanes, the suggested format's step and quality cost, the others', and the tokens."""
        step, binds = self.priced[self.suggested]
        gap = (f"measured quality cost: eval loss +{self.eval_loss_gap:.4f} against exact "
               "(benchmarks/results/compressed_states/cpu2-epyc.md)" if self.eval_loss_gap is not None else
               "quality cost not measured")
        def quality(f: str) -> str:
            return f", eval loss +{formats.EVAL_LOSS_GAP[f]:.4f}" if f in formats.EVAL_LOSS_GAP else ""
        others = "; ".join(f"{f} {t:.3g} s ({b} binds{quality(f)})" for f, (t, b) in self.priced.items()
                           if f != self.suggested)
        return (f"the SSDs bind ({source}: ssd {self.lanes['ssd']:.3g} s of a {self.step_s:.3g} s step, gpu "
                f"{self.lanes.get('gpu', 0.0):.3g} s, cpu {self.lanes.get('cpu', 0.0):.3g} s): "
                f"--state-format {self.suggested} would take {step:.3g} s per step (predicted, {binds} binds; {gap})"
                + (f"; {others}" if others else "")
                + f"; at {self.hide_tokens:,} tokens per step (now {self.tokens:,}) compute would hide the SSDs on "
                "this box")


def ssd_cost(cfg: ModelConfig, hw: Hardware, batch: int, seq: int, mode: str = "optimized",
             measured: tuple[Mapping[str, float], float] | None = None, **capacity_args: Any) -> SsdCost | None:
    """What the SSDs cost the run, where its ``ssd`` lane is the slowest of :data:`LANES_B` (else None): the
    cost model's lanes and step (:func:`scheduled`), or ``measured`` (a step's lanes and seconds) where a step ran. The
    formats with fewer SSD bytes per step (`formats.StateFormat.per_step`) are priced by the same model, and a
    measured step scaled by the model's ratio; the fastest is suggested. Where the compute
    dtype is not bf16, ``bf16-master`` (bf16 weights only) is not offered."""
    dtype = capacity_args.get("compute_dtype", "bf16")
    current = capacity_args.get("state_format", "exact")
    lanes, step_s = predicted = scheduled(cfg, hw, batch, seq, mode, **capacity_args)
    if measured is not None:
        lanes, step_s = upgrade_lanes(measured[0]), measured[1]
    work = {k: lanes.get(k, 0.0) for k in LANES_B}
    if max(work, key=work.__getitem__) != "ssd" or work["ssd"] <= 0:
        return None
    s = itemsize(dtype)
    smaller = sorted((f for f in formats.FORMATS if (f != "bf16-master" or dtype == "bf16")
                      and formats.state_format(f).per_step(s) < formats.state_format(current).per_step(s)),
                     key=lambda f: -formats.state_format(f).per_step(s))
    if not smaller:
        return None
    scale = step_s / predicted[1]
    priced = {}
    for name in smaller:
        ol, other_s = scheduled(cfg, hw, batch, seq, mode, **{**capacity_args, "state_format": name})
        priced[name] = (other_s * scale, max(ol, key=ol.__getitem__))
    best = min(priced, key=lambda f: priced[f][0])
    gpu = work["gpu"]
    tokens = batch * seq
    hide = math.ceil(tokens * work["ssd"] / gpu / seq) * seq if gpu > 0 else 0
    return SsdCost(work, step_s, current, best, priced, formats.EVAL_LOSS_GAP.get(best), tokens, hide)
