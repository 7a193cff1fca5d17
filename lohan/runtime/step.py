"""One training step's decisions and state, apart from the engine that carries them out.

- `StepPlan`: what a step will do, decided in one place before it starts (`StepPlan.make`): the slots it reads and
  writes, the clip gate (the update runs at once at coefficient 1, or is deferred until the global norm is known),
  whether a speculated update may be redone, whether the deferred pass runs in forward order with the next
  step's forward beside it (`follow`), and whether its last writes complete during the next step (`lazy`,
  write-behind).
- `StepRun`: the state of the step in progress (its phase, the loss scale, losses, timers, the counters read at
  its start); the engine keeps none of it in its own attributes, so a step that fails leaves nothing behind.
- `Settlement`: what the global gradient norm decides (`settle`): the clip coefficient, a redo, a skip.
- `StepStats`: what a step measured, typed (the run driver, the metrics file and the benchmarks read it).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import Tensor

from lohan.config import EngineConfig
from lohan.plan.planner import LANES_B, upgrade_lanes
from lohan.runtime.device import Device, Timer
from lohan.runtime.offload import ClipGate
from lohan.runtime.optim import AdamWHyper, lr_at
from lohan.store.states import Commit

if TYPE_CHECKING:
    from lohan.runtime.activations import ActivationManager
    from lohan.runtime.engine import Engine
    from lohan.runtime.params import ParamStreamer
    from lohan.runtime.passes import Acts

log = logging.getLogger("lohan.runtime.engine")  # (a step's messages, as the engine's)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradients; the last good state is committed."""


class Phase(enum.Enum):
    """Where a step is; the abort path (`Engine._abort`) undoes what the phase implies."""

    RUNNING = "running"        # forward, backward, settlement, the optimizer pass: nothing committed
    COMMITTING = "committing"  # the commit (or the skip's) is being written
    COMMITTED = "committed"    # committed (with write-behind: staged, durable once the tail is written)


@dataclass(frozen=True)
class StepPlan:
    """A step's schedule (module docstring), made before anything runs."""

    step: int             # steps committed before this one
    update: int           # the optimizer update this step applies (1-based; skipped steps apply none)
    hyper: AdamWHyper
    read_slot: int
    write_slot: int
    gate: ClipGate        # opens at once (clipping off, speculated, in place) or when the norm is known
    deferred: bool        # the update waits for the gate, gradients stashed meanwhile
    speculated: bool      # the update runs at coefficient 1 and is redone if the step clips
    follow: bool          # the deferred pass runs in forward order and the next forward beside it
    lazy: bool            # write-behind: the pass's last writes and the commit complete in the next step
    order: tuple[int, ...]
    durable: bool         # written and committed to the SSDs; else its states stay in RAM (engine.persist_every)
    next_idx: Tensor | None  # the next batch's ids on the device, when its forward may run beside this step's
    #                          optimizer pass (a deferred one, or a redone one)
    in_place: bool = False  # updates during backward states held in RAM only: nothing to skip back to if the step
    #                         turns out not finite (the engine replays from the last durable commit instead)
    skip: bool = False      # known not finite (a replayed failure): its optimizer pass discards every gradient
    known: Tensor | None = None  # the coefficient a replayed step that clipped is known to take (its gate's)
    tail_follows: bool = False  # updates during backward, the next batch known: the blocks still to update once
    #                             backward ends go in forward order, the next forward beside them (in RAM; durable:
    #                             optimized mode, one process, a separate device, where every block updated before
    #                             reaches the forward from memory, `Engine._expect_tail`)

    @staticmethod
    def make(cfg: EngineConfig, commit: Commit, read_slot: int, write_slot: int, n_blocks: int,
             speculate: bool, next_idx: Tensor | None, one_process: bool, durable: bool = True,
             ram_read: bool = False, replayable: bool = False, skip: bool = False,
             known: Tensor | None = None, separate_device: bool = False) -> StepPlan:
        # A step whose read states are in RAM only, or whose states will be, updates them in place with no copy
        # on the SSDs to redo or skip from. Where the engine can rebuild the RAM states by replaying its steps
        # since the last durable commit (`replayable`, lohan.runtime.held), the update may still run during
        # backward, as on the SSDs: clipping off, or speculated (the schedule prices the replay a clip costs).
        # A replayed step runs again known to be skipped (`skip`: its gate discards from the start) or known to
        # clip at `known` (its gate open at that coefficient from the start). fp16 (an overflow skips often) waits
        # for the norm (deferred), as where nothing can be replayed.
        hold = not durable or ram_read
        strict = hold and not (replayable and one_process and cfg.execution.compute_dtype != "fp16")
        if skip or known is not None:
            gate = ClipGate.discarded() if skip else ClipGate.known(known)
        else:
            gate = clip_gate(cfg, speculate and not strict, next_idx is not None, hold=strict)
        deferred = gate.deferred
        replayed = skip or known is not None
        follow = deferred and next_idx is not None
        speculated = not deferred and cfg.stability.max_grad_norm > 0 and not replayed
        # a durable step's tail is offered in one process, optimized mode; on the CPU (no separate device) the engine
        # declines it (`Engine._expect_tail`: the forward would share the cores with the update) and the next forward
        # runs once the pass is done, still in this step: ~0.2 s a step faster on the CPU (110M Llama, 1 x 512, bf16,
        # same minutes: 1.59-1.62 against 1.79-1.80 s) than leaving that forward to the next step
        tail_follows = not deferred and not replayed and next_idx is not None and (
            not durable or one_process and cfg.execution.mode == "optimized")
        return StepPlan(
            step=commit.step, update=commit.applied + 1, hyper=AdamWHyper.from_config(cfg, lr_at(cfg, commit.step)),
            read_slot=read_slot, write_slot=write_slot, gate=gate, deferred=deferred,
            speculated=speculated, follow=follow,
            # (write-behind stages a commit whose last writes are still in flight: with two slots the previous
            # commit stands meanwhile; in place there is none. A durable tail the next forward may follow too,
            # where nothing can redo the pass: its last writes and the commit then complete beside the next
            # backward instead of holding the next step back)
            lazy=(follow or tail_follows and not speculated and separate_device) and cfg.execution.write_behind and one_process
            and cfg.store.slots == 2 and not hold,
            order=tuple(range(n_blocks)) if follow else tuple(range(n_blocks - 1, -1, -1)),
            durable=durable, next_idx=next_idx, in_place=hold and not deferred and not replayed, skip=skip,
            known=known, tail_follows=tail_follows)


def clip_gate(cfg: EngineConfig, speculate: bool, follow: bool = False, hold: bool = False) -> ClipGate:
    """The step's coefficient gate: open at 1 (no clipping, or a speculated update), or deferred until the norm
    is known. In place (slots=1) nothing may be written before the step is known good. `speculate` is the
    schedule's choice (`clip_schedule.ClipSchedule`: `clip_mode`, and for `auto` the running norm and what each
    way costs); clipping off, not speculating means updating after backward beside the next forward, so only
    where one `follow`s."""
    if cfg.store.slots == 1 or hold:  # (`hold`: states in RAM only, see StepPlan.make)
        return ClipGate(None)
    if speculate or (cfg.stability.max_grad_norm <= 0 and not follow):
        return ClipGate(1.0)
    return ClipGate(None)


class LossScale:
    """fp16: the step's dynamic loss scale, as GradScaler keeps it (0-d fp32 tensor), from the commit; on the
    device where the gradients are unscaled (`put`: the device in one process; data parallel reduces host
    buffers, then unscales them on the host)."""

    def __init__(self, cfg: EngineConfig, commit: Commit, put: Any) -> None:
        scale = torch.tensor(commit.loss_scale or cfg.stability.loss_scale, dtype=torch.float32)
        self.scale = put(scale)
        self.tracker = put(torch.tensor(commit.growth_tracker, dtype=torch.int32))
        self.inv_scale = put(scale.double().reciprocal().float())  # as GradScaler.unscale_ computes it
        self.found_inf = put(torch.zeros(1))
        self.growth_interval = cfg.stability.loss_scale_growth_interval

    def unscale_(self, grads: list[Tensor]) -> None:
        """GradScaler.unscale_: the same op, so the same bits and the same inf check."""
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.inv_scale)

    def update(self, device: Device) -> dict[str, Any]:
        """GradScaler.update (halve after an overflow, double after growth_interval clean steps); the commit's
        fields."""
        torch._amp_update_scale_(self.scale, self.tracker, self.found_inf, 2.0, 0.5, self.growth_interval)
        return {"loss_scale": float(device.fetch(self.scale)), "growth_tracker": int(device.fetch(self.tracker))}


@dataclass(frozen=True)
class Settlement:
    """What the step's global gradient norm decided."""

    skipped: bool               # the loss or the norm is not finite: nothing is applied
    overflow: bool              # fp16: skipped because the scaled gradients overflowed (GradScaler's skip)
    redone: bool                # a speculated update clipped after all: redone from the previous slot
    grad_norm: float
    clip_coef: float | None     # the coefficient applied (None: clipping off, or skipped)
    coef: float | None          # the coefficient as computed (1.0 with clipping off; None: skipped)
    coef_t: Tensor | None       # the same as the host tensor the CPU optimizer multiplies by
    loss_scale: float | None    # fp16: the scale the step ran with


def settle(cfg: EngineConfig, device: Device, loss: float, norms: list[list[Tensor]],
           norm_order: list[tuple[int, int]] | None, plan: StepPlan, scaler: LossScale | None) -> Settlement:
    """The step's global gradient norm, exactly as `clip_grad_norm_` computes it (per-parameter norms in the
    model's parameter order, then the norm of those), and what follows from it; a deferred gate opens."""
    flat = [norms[i][k] for i, k in norm_order] if norm_order else [t for block in norms for t in block]
    # on the device, where the norms are (one synchronization a step: the host needs the norm)
    total = torch.linalg.vector_norm(torch.stack(flat), 2.0)
    coef_t = torch.tensor(1.0)
    if cfg.stability.max_grad_norm > 0:
        coef_t = torch.clamp(cfg.stability.max_grad_norm / (total + 1e-6), max=1.0)
    total, coef_t = (device.fetch(t) for t in (total, coef_t))  # the CPU optimizer takes a host tensor
    norm = float(total)
    scale = float(device.fetch(scaler.scale)) if scaler is not None else None
    if not (math.isfinite(loss) and math.isfinite(norm)):
        overflow = math.isfinite(loss) and scaler is not None and bool(device.fetch(scaler.found_inf).item())
        return Settlement(True, overflow, False, norm, None, None, None, scale)
    coef = float(coef_t)
    if plan.gate.deferred:
        plan.gate.open(coef_t)
    return Settlement(False, False, plan.speculated and coef != 1.0, norm,
                      coef if cfg.stability.max_grad_norm > 0 else None, coef, coef_t, scale)


def skip_outcome(run: StepRun, loss: float, scaler: dict[str, Any],
                 max_bad_steps: int) -> tuple[dict[str, Any], NonFiniteError | None]:
    """A skipped step's commit (the previous states, its batch consumed) and whether the run must stop. An fp16
    overflow (finite loss, gradients too large for the scale) is GradScaler's ordinary skip: the scale was
    lowered, and it does not count as a bad step; `max_bad_steps` non-finite steps in a row stop the run."""
    step, commit, settled = run.plan.step, run.commit, run.settlement
    kept = {"sums": commit.sums, "updates": commit.applied, **scaler}
    if settled.overflow:
        log.info("step %d: fp16 gradients overflowed; skipped, loss scale lowered to %s", step + 1,
                 scaler["loss_scale"])
        return {**kept, "bad_streak": commit.bad_streak}, None
    streak = commit.bad_streak + 1
    log.warning("step %d skipped: loss %s, gradient norm %s are not finite (%d in a row); the states of the "
                "last good update stand", step + 1, loss, settled.grad_norm, streak)
    fatal = None
    if streak >= max_bad_steps:
        fatal = NonFiniteError(
            f"{streak} steps in a row (up to step {step + 1}) had a non-finite loss or gradients (last: loss "
            f"{loss}, gradient norm {settled.grad_norm}); stopping. The states of the last good update "
            f"({commit.applied} updates) are committed and intact. Lower the learning rate, check the data, or "
            "raise engine.max_bad_steps")
    return {**kept, "bad_streak": streak}, fatal


def rank_batch(batch: tuple[Tensor, Tensor], micro_batches: int, world: int, rank: int) -> tuple[Tensor, Tensor]:
    """The rank's part of a batch: all of it in one process; data parallel, every rank is given the same
    (global) batch and takes its slice, rows [r*B/N, (r+1)*B/N), as one process's micro-batches are cut."""
    idx, targets = batch
    if idx.shape != targets.shape or idx.dim() != 2:
        raise ValueError(f"batch must be (ids, targets) of equal shape [batch, seq]; got {tuple(idx.shape)} "
                         f"and {tuple(targets.shape)}")
    if world > 1 and idx.shape[0] % (micro_batches * world):
        raise ValueError(f"batch size {idx.shape[0]} is not divisible by micro_batches={micro_batches} x "
                         f"{world} ranks; every rank gets batch / {world} sequences")
    if idx.shape[0] % micro_batches:
        raise ValueError(f"batch size {idx.shape[0]} is not divisible by micro_batches={micro_batches}")
    if world > 1:
        rows = idx.shape[0] // world
        idx, targets = (t[rank * rows:(rank + 1) * rows] for t in (idx, targets))
    return idx, targets


@dataclass
class Prepared:
    """A step's forward, run during the previous step's optimizer pass: the ids (on the device, and as given on the
    host) and what backward needs."""

    idx: Tensor
    acts: Acts
    host_idx: Tensor


class NextForward:
    """The next step's forward, run beside this step's optimizer pass (`step(next_batch=...)`): kept until the next
    step takes it for the very same ids, or dropped with what it holds (blocks, activations)."""

    def __init__(self, device: Device, streamer: ParamStreamer, activations: ActivationManager) -> None:
        self.device, self.streamer, self.activations = device, streamer, activations
        self._prepared: Prepared | None = None

    @property
    def held(self) -> bool:
        return self._prepared is not None

    def keep(self, idx: Tensor, acts: Acts, host_idx: Tensor) -> None:
        self._prepared = Prepared(idx, acts, host_idx)

    def take(self, idx: Tensor) -> Prepared | None:
        """The forward run for these ids (on the host), if one was. Another batch discards it (the resident
        parameters are the committed ones either way and stay). Compared on the host: fetching the device's copy
        would wait for all the compute queued before it, that forward's included, at every step's start."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        if prepared.host_idx.shape == idx.shape and torch.equal(prepared.host_idx, idx):
            return prepared
        self.activations.end_step()
        return None

    def drop(self) -> None:
        """Forget it and release what it holds (it ran on parameters that are not to be used uncommitted)."""
        if self._prepared is not None:
            self._prepared = None
            self.streamer.release_all()
            self.streamer.drop_kept()
            self.activations.end_step()

    def forget(self) -> None:
        """Forget it; the caller releases the blocks and activations itself (a rollback, closing)."""
        self._prepared = None


@dataclass(frozen=True)
class Counters:
    """The engine's cumulative counters at a step's start; a step's figures are the differences."""

    io: dict
    param_wait_s: float
    provision_wait_s: float
    param_hash_s: float
    gather_s: float
    reduced_bytes: int
    gathered_bytes: int
    device_busy: dict[str, float] | None = None  # a timed simulated device's busy seconds (`device_lanes`)

    @staticmethod
    def read(engine: Engine) -> Counters:
        s, dp = engine.streamer, engine.dp
        return Counters(engine.store.volume.stats(), s.wait_s, s.provision_wait_s, s.hash_s, s.gather_s,
                        dp.reduced_bytes, dp.gathered_bytes, device_lanes(engine.device))


def device_lanes(device: Device) -> dict[str, float] | None:
    """Cumulative busy seconds of the device's modeled lanes (``gpu``: the compute stream, ``m2g`` and ``g2m``: the
    upload and download copy engines), where the device models them (the simulated device with a timing model,
    `Device.lane_busy`); None where it does not (the CPU, CUDA): there the compute timers give ``gpu``."""
    busy = getattr(device, "lane_busy", None)
    return busy() if callable(busy) else None


@dataclass
class StepRun:
    """The state of the step in progress (module docstring)."""

    plan: StepPlan
    idx: Tensor
    targets: Tensor
    commit: Commit                  # the commit the step started from
    visits: list[int]
    start_s: float
    counters: Counters
    prepared: Prepared | None = None
    scaler: LossScale | None = None
    next_host: Tensor | None = None  # the next batch's ids on the host, where `plan.next_idx` holds them on the device
    phase: Phase = Phase.RUNNING
    losses: list[Tensor] = field(default_factory=list)
    fwd_timer: Timer | None = None
    bwd_timer: Timer | None = None
    reduce_wait_s: float = 0.0      # data parallel: waits for gradient sums not done when needed
    next_fwd_s: float = 0.0         # compute seconds of the next step's forward run beside this step's pass
    tail_s: float = 0.0             # from the end of backward to the end of the optimizer pass, less next_fwd_s
    activations: dict[str, Any] = field(default_factory=dict)
    settlement: Settlement | None = None

    def compute_s(self) -> float:
        return ((self.fwd_timer.seconds() if self.fwd_timer else 0.0)
                + (self.bwd_timer.seconds() if self.bwd_timer else 0.0) + self.next_fwd_s)


@dataclass(frozen=True)
class StepStats:
    """What one step measured. Rates are derived (properties); `to_dict` gives both, JSON-ready."""

    step: int
    loss: float
    lr: float
    tokens: int                    # every rank's tokens
    step_s: float
    flops: float | None            # model FLOPs (forward + backward = 3x forward; recomputation not counted)
    ssd_read_bytes: int
    ssd_write_bytes: int
    lanes: dict[str, float]        # seconds: the cost model's lanes and the waits (`measure`)
    cpu_mem_bytes: int             # RSS at the step's end
    gpu_mem_bytes: int | None      # peak device memory allocated (CUDA only)
    max_resident_blocks: int
    resident_records: int          # optimizer records kept in memory across steps
    resident_record_hits: int      # READs they saved this step
    activations: dict[str, Any]    # the activation plan and its tier counters
    next_forward_overlapped: bool  # the next step's forward ran beside this step's optimizer pass
    deferred: bool                 # the update waited for the global norm (clipping: defer, or in place)
    durable: bool = True           # written and committed to the SSDs (else held in RAM: engine.persist_every)
    grad_norm: float | None = None
    clip_coef: float | None = None
    redone: bool = False
    skipped: bool = False
    overflow: bool = False
    loss_scale: float | None = None
    network_bytes: int | None = None  # data parallel: bytes this rank sent (and received as many)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def tflops(self) -> float | None:
        return self.flops / self.step_s / 1e12 if self.flops else None

    @property
    def ssd_read_gbps(self) -> float:
        return self.ssd_read_bytes / self.step_s / 1e9

    @property
    def ssd_write_gbps(self) -> float:
        return self.ssd_write_bytes / self.step_s / 1e9

    @property
    def overlap_efficiency(self) -> float:
        """The busiest of the cost model's lanes over the step's time (1: the step takes no longer than it)."""
        lanes = upgrade_lanes(self.lanes)
        return max(lanes.get(k, 0.0) for k in LANES_B) / self.step_s

    @property
    def cpu_mem_gib(self) -> float:
        return self.cpu_mem_bytes / 2**30

    @property
    def gpu_mem_gib(self) -> float | None:
        return None if self.gpu_mem_bytes is None else self.gpu_mem_bytes / 2**30

    def to_dict(self) -> dict[str, Any]:
        derived = ("tokens_per_s", "tflops", "ssd_read_gbps", "ssd_write_gbps", "overlap_efficiency", "cpu_mem_gib",
                   "gpu_mem_gib")
        return {**dataclasses.asdict(self), **{k: getattr(self, k) for k in derived}}


def commit_note(stats: StepStats) -> dict[str, Any]:
    """What a commit keeps of its step's `StepStats` (`Commit.note`): every field but the activation plan's
    counters (the bulk of it, and not part of the run's metrics)."""
    return {k: v for k, v in dataclasses.asdict(stats).items() if k != "activations"}


def stats_from_note(note: dict[str, Any] | None) -> StepStats | None:
    """The `StepStats` a commit kept (`commit_note`), or None (no note: before the first step, an older store)."""
    if not note:
        return None
    fields = {f.name for f in dataclasses.fields(StepStats)}
    kept = {k: v for k, v in note.items() if k in fields}
    kept["lanes"] = upgrade_lanes(kept.get("lanes") or {})  # a note of an older lohan names them otherwise
    return StepStats(**kept, activations={})


def _device_lanes(engine: Engine, run: StepRun) -> dict[str, float]:
    """The step's ``gpu`` lane, and ``m2g``, ``g2m`` where the device models its copy engines: its modeled busy
    seconds (`device_lanes`), else the compute timers (forward, backward, the next forward beside the pass)."""
    b0, b1 = run.counters.device_busy, device_lanes(engine.device)
    if b0 is None or b1 is None:
        return {"gpu": run.compute_s()}
    return {k: b1[k] - b0.get(k, 0.0) for k in ("gpu", "m2g", "g2m") if k in b1}


def measure(engine: Engine, run: StepRun, loss: float, overlapped: bool) -> StepStats:
    """The step's `StepStats` from the engine's counters now and at the step's start (`overlapped`: the next
    step's forward ran beside this step's optimizer pass)."""
    io0, io1, c0 = run.counters.io, engine.store.volume.stats(), run.counters
    streamer, ago, dp, settled = engine.streamer, engine.offloader, engine.dp, run.settlement

    def lane(direction: str) -> tuple[float, int]:
        busy = max(d1[direction]["busy_s"] - d0[direction]["busy_s"] for d0, d1 in zip(io0["devices"], io1["devices"]))
        return busy, io1[f"{direction}_bytes"] - io0[f"{direction}_bytes"]

    (read_s, read_b), (write_s, write_b) = lane("read"), lane("write")
    # the SSDs are simplex: a device is busy while a read or a write is in flight (`io_engine.base.device_lanes`:
    # the sum of the two would count twice a read queued on the device behind a write); the busiest sets the lane
    ssd_s = max(d1["any"]["busy_s"] - d0["any"]["busy_s"] for d0, d1 in zip(io0["devices"], io1["devices"]))
    lanes = {**_device_lanes(engine, run), "ssd": ssd_s,
             # the optimizer's CPU work, as the cost model's cpu lane prices it: AdamW and its records' hashing (the
             # hash threads' CPU seconds: a job waiting for a core taken by the I/O copies is not hashing, hasher.py)
             "cpu": ago.adam_s + ago.hash_s,
             # the parts and the waits
             "ssd_read": read_s, "ssd_write": write_s, "adam": ago.adam_s,
             "param_wait": streamer.wait_s - c0.param_wait_s, "optimizer_tail": run.tail_s,
             # the forward following a pass (deferred, redone, or a held step's tail) waiting for its updates
             "provision_wait": streamer.provision_wait_s - c0.provision_wait_s,
             # checksums: hashing on the optimizer thread (reads and writes) and of streamed P16
             "checksum": ago.hash_s + streamer.hash_s - c0.param_hash_s}
    # waits on the other ranks: P16 all-gathers, and gradient sums not done when needed (none in one process)
    lanes.update(dp.wait_lanes(streamer.gather_s - c0.gather_s, run.reduce_wait_s))
    tokens = run.idx.numel() * engine.world
    fpt = engine.flops_per_token
    return StepStats(
        step=run.plan.step + 1, loss=loss, lr=run.plan.hyper.lr, tokens=tokens,
        step_s=time.perf_counter() - run.start_s, flops=3 * fpt(run.idx.shape[1]) * tokens if fpt else None,
        ssd_read_bytes=read_b, ssd_write_bytes=write_b, lanes=lanes,
        cpu_mem_bytes=psutil.Process().memory_info().rss,
        gpu_mem_bytes=engine.device.max_memory_allocated() if engine.device.is_cuda else None,
        max_resident_blocks=streamer.max_resident, resident_records=len(ago.resident),
        resident_record_hits=ago.resident_hits, activations=run.activations,
        next_forward_overlapped=overlapped, deferred=run.plan.deferred, durable=run.plan.durable,
        grad_norm=settled.grad_norm, clip_coef=settled.clip_coef, redone=settled.redone, skipped=settled.skipped,
        overflow=settled.overflow, loss_scale=settled.loss_scale,
        network_bytes=dp.network_bytes(dp.reduced_bytes - c0.reduced_bytes, dp.gathered_bytes - c0.gathered_bytes))
