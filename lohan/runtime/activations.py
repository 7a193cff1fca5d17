"""ActivationManager: profile -> plan -> tiers, and the per-block record / replay calls of a step.

The engine (`runtime/engine.py`) drives it in this order each step:

- forward: `needs_prepare` / `prepare` once the first transformer block's input exists (that is when the
  shapes are known and the block's parameters are resident: it profiles that block, plans, and sets up
  the tiers; again only when the batch shape or the policy changes), `forward_block` for each
  transformer block and micro-batch (records the block's input and its swapped ops' outputs on the
  block's tier), then `end_forward`;
- backward, block by block from the last: around block i's backward, `prefetch(i - 1)` (the next
  block's SSD records read back ahead of use) and `stage(i - 1)` (its records copied back to the
  device beside block i's compute); per micro-batch, `backward_block` (the block input and a `run` that
  replays the swapped ops while recomputing the others) and `release` once the block's gradients are
  computed;
- `end_step` after the step (or on failure), `stats` for the step's metrics, `close` with the engine.

The records themselves live in an `ActivationStore` (`runtime/activation_store.py`), which also defines
the `SelectiveMode` that records and replays the ops. Program blocks are [embed, transformer blocks...,
head]; the plan covers the transformer blocks, so plan block j is program block j + 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import psutil
from torch import Tensor

from io_engine import BufferPool, aligned_empty, open_volume
from io_engine.base import align_up
from lohan.config import EngineConfig
from lohan.crashpoints import crashpoint
from lohan.plan.formats import state_format
from lohan.plan.planner import POLICIES, Hardware, OpProfile, Plan, Profile, ProfileError, make_plan, reprice
from lohan.runtime.activation_store import ActivationStore, OpTracker, ReadWatch, SelectiveMode
from lohan.runtime.device import Device
from lohan.runtime.profiler import measure_hardware, measure_quant_rate, profile_block
from lohan.store.files import remove_volume

log = logging.getLogger(__name__)


class ActivationManager:
    """The activation plan carried out block by block: where each (block, micro-batch) record waits between
    forward and backward (``keep`` on the device, ``cpu`` main memory, ``ssd``), and which ops are replayed
    from it rather than recomputed (see the module docstring for the calls of a step)."""

    def __init__(self, cfg: EngineConfig, program: Any, device: Device, autocast: Callable[[], Any],
                 engine_pool_bytes: int, model_label: str, param_count: int, p16_itemsize: int,
                 flops_per_token: Callable[[int], float] | None, resident_params: int = 0,
                 readahead_params: int = 0, kept_p16_fraction: float = 0.0) -> None:
        self.cfg = cfg
        self.program = program
        self.device = device
        self.autocast = autocast
        self.engine_pool_bytes = engine_pool_bytes
        self.model_label = model_label
        self.param_count = param_count
        self.p16_itemsize = p16_itemsize
        self.flops_per_token = flops_per_token
        self.resident_params = resident_params  # whose records are not read each step (the planner's SSD lane)
        # whose records the read-ahead room holds: read during backward ahead of a deferred update (t_deferred)
        self.readahead_params = readahead_params
        self.kept_p16_fraction = kept_p16_fraction  # of the P16 the parameter pool keeps over a turn
        n = len(program.modules)
        self.inner = range(1, n - 1)
        self.tracker = OpTracker(program.modules[i] for i in self.inner)
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.store: ActivationStore | None = None
        self._shape: tuple[int, int] | None = None
        self._volume = None
        self._swap: frozenset[str] = frozenset()
        # per transformer block: the positions of the recorded outputs its recompute does not read (learned on
        # its first replay under the plan in force, `ReadWatch`), which later records leave out
        self._unread: dict[int, frozenset[int]] = {}
        self._hardware = None
        self._quant_bps: tuple[float, float] | None = None
        self.policy = cfg.activations.act_policy
        self._io0: dict | None = None

    def set_policy(self, policy: str) -> None:
        """Use another activation policy from the next step on (re-planned on the profile measured then)."""
        if not (policy in POLICIES or policy.startswith("ops:")):
            raise ValueError(f"unknown activation policy {policy!r}; choose one of {', '.join(POLICIES)} "
                             "or ops:NAME,NAME")
        self.policy = policy
        self._shape = None

    @property
    def act_name(self) -> str:
        return f"{self.cfg.store.name}-act"

    # ------------------------------------------------------------------ planning
    def mem_avail(self) -> int:
        """Main memory for the CPU tier: act_mem if set, else what cpu_mem and free memory leave."""
        if self.cfg.activations.act_mem is not None:
            return int(self.cfg.activations.act_mem)
        free = psutil.virtual_memory().available
        return max(0, min(int(self.cfg.memory.cpu_mem), free) - self.engine_pool_bytes)

    def _optimizer_fields(self, param_count: int) -> dict[str, Any]:
        """The profile's fields on the optimizer's records: resident ones, those read ahead (never more than the
        parameters not resident: the profile checks it), and whether a deferred update's last writes complete
        during the next backward (write-behind: two slots)."""
        resident = min(self.resident_params, param_count)
        fmt = state_format(self.cfg.store.state_format)  # the records' bytes and the update's CPU cost in the format
        return {"resident_params": resident, "readahead_params": min(self.readahead_params, param_count - resident),
                "kept_p16_params": round(param_count * self.kept_p16_fraction),
                "write_behind": self.cfg.store.slots == 2 and self.cfg.execution.write_behind, "record_bytes": fmt.record(),
                "separate_p16": fmt.keeps_p16(self.p16_itemsize), "update_cost": fmt.update_cost}

    def needs_prepare(self, batch: int, seq: int) -> bool:
        return len(self.inner) > 0 and self._shape != (batch, seq)

    def prepare(self, x: Tensor, batch: int, seq: int) -> Plan:
        """Profile block 1 on its real input x (one micro-batch), plan, and set up the tiers."""
        m = self.cfg.execution.micro_batches
        first = self.inner[0]
        ops, (in_bytes, in_int8), blk_flops, secs = profile_block(
            lambda z: self.program.run(first, z, None), self.program.modules[first], x, self.tracker,
            self.device, self.autocast)
        mem = self.mem_avail()
        # the bytes the tiers hold are the ones just measured, as they are and int8 (for every micro-batch)
        measured = {"input_bytes": in_bytes * m, "input_bytes_int8": in_int8 * m,
                    "act_compress": self.cfg.activations.act_compress}
        if self.cfg.activations.profile_from:
            try:
                profile = Profile.load(self.cfg.activations.profile_from)
            except ProfileError as e:
                raise ValueError(f"engine.profile_from: {e}. Profile this run instead (leave profile_from unset; "
                                 f"the run saves what it measures as <nvme>/{self.cfg.store.name}.profile.json)") from None
            if (profile.batch, profile.seq, profile.n_blocks) != (batch, seq, len(self.inner)):
                raise ValueError(
                    f"profile {self.cfg.activations.profile_from} is for batch {profile.batch}, seq {profile.seq}, "
                    f"{profile.n_blocks} blocks; this run has batch {batch}, seq {seq}, {len(self.inner)} blocks. "
                    "Profile this run instead (leave profile_from unset)")
            if [o.name for o in profile.ops] != [o.name for o in ops]:
                raise ValueError(f"profile {self.cfg.activations.profile_from} describes ops {[o.name for o in profile.ops]}; "
                                 f"this model's blocks have {[o.name for o in ops]}")
            # Its costs and hardware are kept; the bytes the tiers must hold are the ones just measured.
            profile = dataclasses.replace(
                profile, ops=tuple(dataclasses.replace(p, bytes=o.bytes * m, bytes_int8=o.bytes_int8 * m)
                                   for p, o in zip(profile.ops, ops)),
                hardware=self._quant_rate(dataclasses.replace(profile.hardware, mem_avail=mem), x),
                **measured, **self._optimizer_fields(profile.param_count))
        else:
            if self._hardware is None:
                self._hardware = measure_hardware(self.device, list(self.cfg.store.nvme), self.cfg.store.backend,
                                                  self.cfg.store.name, thp_g=blk_flops / secs, mem_avail=mem,
                                                  emulate_ssd_gbps=self.cfg.store.emulate_ssd_gbps)
            hw = self._quant_rate(dataclasses.replace(self._hardware, mem_avail=mem), x)
            tokens = batch * seq
            flop_f = (self.flops_per_token(seq) * tokens if self.flops_per_token
                      else blk_flops * m * len(self.inner))
            profile = Profile(model=self.model_label, batch=batch, seq=seq, n_blocks=len(self.inner),
                              ops=tuple(OpProfile(o.name, o.flops * m, o.bytes * m, o.bytes_int8 * m) for o in ops),
                              param_count=self.param_count, p16_itemsize=self.p16_itemsize, flop_f=float(flop_f),
                              hardware=hw, source="measured", **measured, **self._optimizer_fields(self.param_count))
            crashpoint("profile.measured")
            with contextlib.suppress(OSError):
                profile.save(os.path.join(self.cfg.store.nvme[0], f"{self.cfg.store.name}.profile.json"))
        plan = make_plan(profile, self.policy)
        self._setup(plan, record_bytes=plan.block_bytes // m)
        self.profile, self.plan, self._shape = profile, plan, (batch, seq)
        self._swap = frozenset(plan.swap)
        log.info("activation plan (%s): swap %s; %s", plan.policy, ", ".join(plan.swap) or "block inputs only",
                 " ".join(f"{t}={plan.block_tiers.count(t)}" for t in ("keep", "cpu", "ssd")))
        return plan

    def refine_cpu(self, params_per_s: float) -> None:
        """Price the optimizer's CPU lane at the rate the run's steps measured (exact's update rate: the lane over
        the format's `update_cost`). The hardware measured at the plan has no CPU rate (timing the kernel alone
        would take a second and, on a box whose cores the I/O and hashing also need, ran 2.5x faster than in a
        step), so its estimate priced the update at nothing; the schedule's choice of updating during backward
        or beside the next forward (`clip_schedule`) reads this estimate. The swap set stays as planned."""
        if self.plan is None or self.profile is None or not params_per_s > 0:
            return
        hw = dataclasses.replace(self.profile.hardware, cpu_adam_params_per_s=params_per_s)
        self.profile = dataclasses.replace(self.profile, hardware=hw)
        self.plan = dataclasses.replace(self.plan, estimate=reprice(self.plan.estimate, self.profile))

    def refine_persist(self, every: int) -> None:
        """Price the plan at the durability interval in force (`Engine.persist_every`, which ``auto`` sets from the
        steps it measures): a step's share of the record writes, and the steps held in RAM whose next forward
        follows the optimizer's tail (`planner._held_iter`), which the schedule's choice reads. The swap set stays."""
        if self.plan is None or self.profile is None or self.profile.persist_every == every:
            return
        self.profile = dataclasses.replace(self.profile, persist_every=every)
        self.plan = dataclasses.replace(self.plan, estimate=reprice(self.plan.estimate, self.profile))

    def _quant_rate(self, hw: Hardware, x: Tensor) -> Hardware:
        """`hw` with the device's int8 quantization rate (measured once, in the activations' dtype) when records are
        compressed and it lacks one (a profile saved by a run without compression)."""
        if self.cfg.activations.act_compress == "none" or hw.act_quant_bps:
            return hw
        if self._quant_bps is None:
            self._quant_bps = measure_quant_rate(self.device, x.dtype)
        return dataclasses.replace(hw, act_quant_bps=self._quant_bps[0], act_dequant_bps=self._quant_bps[1])

    def _setup(self, plan: Plan, record_bytes: int) -> None:
        self.close_tiers()
        m = self.cfg.execution.micro_batches
        cap = align_up(max(record_bytes, 1))
        n_cpu, n_ssd = plan.block_tiers.count("cpu"), plan.block_tiers.count("ssd")
        cpu_pool = None
        if n_cpu:
            pin = self.device.is_cuda
            cpu_pool = BufferPool(n_cpu * m * cap, alloc=lambda n: aligned_empty(n, pin=pin))
        staging = None
        if n_ssd:
            dirs = list(self.cfg.store.nvme)
            remove_volume(dirs, self.act_name)
            self._volume = open_volume(dirs, n_ssd * m * cap, self.cfg.store.stripe_bytes, backend=self.cfg.store.backend,
                                       name=self.act_name, emulate_ssd_gbps=self.cfg.store.emulate_ssd_gbps)
            staging = self._volume.buffer_pool(2 * m * cap, pin=self.device.is_cuda)
        self._io0 = self._io_snapshot()
        self._unread = {}  # another swap set records other outputs
        self.store = ActivationStore(self.device, cpu_pool, staging, self._volume, compress=self.cfg.activations.act_compress)

    # ------------------------------------------------------------------ step
    def tier(self, i: int) -> str:
        return self.plan.block_tiers[i - self.inner[0]]

    def forward_block(self, i: int, m: int, x: Tensor) -> Tensor:
        """Run transformer block i on x (no grad), store its record on its tier, return the output."""
        mode = SelectiveMode(self.tracker, self._swap, drop=self._unread.get(i, frozenset()))
        with mode.scoped():
            out = self.program.run(i, x, None)
        self.store.put((i, m), x, mode.records, self.tier(i))
        return out

    def prefetch(self, i: int) -> None:
        """Start reading block i's records back from the SSDs (one block ahead of its backward)."""
        if i in self.inner:
            self.store.prefetch((i, m) for m in range(self.cfg.execution.micro_batches))

    def stage(self, i: int) -> None:
        """Start copying block i's records to the device (once the block after it is queued)."""
        if i in self.inner:
            self.store.stage((i, m) for m in range(self.cfg.execution.micro_batches))

    def end_forward(self) -> None:
        if self.store is not None:
            self.store.end_forward()

    def backward_block(self, i: int, m: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """(block input, run) for the recompute of block i; `run(x)` replays the swapped ops.

        Call `release(i, m)` once the block's gradients are computed: the input and the replayed
        outputs are views of the record's buffer.
        """
        x, records = self.store.take((i, m))

        def run(z: Tensor) -> Tensor:
            if i in self._unread or not self._swap:
                mode = SelectiveMode(self.tracker, self._swap, replay=records)
                with mode.scoped():
                    out = self.program.run(i, z, None)
                mode.check_done()
                return out
            watch = ReadWatch()  # the block's first replay: learn what it reads
            mode = SelectiveMode(self.tracker, self._swap, replay=records, watch=watch)
            with watch.saved(), mode:
                out = self.program.run(i, z, None)
            mode.check_done()
            watch.mark(out)
            self._unread[i] = watch.unread(records)
            return out

        return x, run

    def release(self, i: int, m: int) -> None:
        self.store.release((i, m))

    def end_step(self) -> None:
        if self.store is not None:
            self.store.end_step()

    def _io_snapshot(self) -> dict | None:
        return self._volume.stats() if self._volume is not None else None

    def stats(self) -> dict[str, Any]:
        """This step's plan, bytes per tier, and SSD time of the activation volume (busy seconds per direction)."""
        if self.plan is None:
            return {}
        io = {}
        now = self._io_snapshot()
        if now is not None:
            before = self._io0 or {"devices": [{"read": {"busy_s": 0.0}, "write": {"busy_s": 0.0}}] * len(now["devices"]),
                                   "read_bytes": 0, "write_bytes": 0}
            for d in ("read", "write"):
                io[f"ssd_{d}_s"] = max(b1[d]["busy_s"] - b0[d]["busy_s"]
                                       for b0, b1 in zip(before["devices"], now["devices"]))
                io[f"ssd_{d}_bytes"] = now[f"{d}_bytes"] - before[f"{d}_bytes"]
        self._io0 = now
        return {"policy": self.plan.policy, "swap": list(self.plan.swap), **io,
                "tiers": {t: self.plan.block_tiers.count(t) for t in ("keep", "cpu", "ssd")},
                "bytes": dict(self.store.bytes), "raw_bytes": dict(self.store.raw_bytes),
                "compress": self.store.compress, "peak_cpu_bytes": self.store.peak_cpu_bytes,
                "predicted_s": self.plan.estimate.t_iter}

    def close_tiers(self) -> None:
        if self.store is not None:
            self.store.end_step()
            for pool in (self.store.cpu_pool, self.store.staging_pool):
                if pool is not None:
                    pool.clear()
            self.store = None
        if self._volume is not None:
            self._volume.close()
            self._volume = None
            remove_volume(list(self.cfg.store.nvme), self.act_name)

    def close(self) -> None:
        self.close_tiers()
        self.tracker.remove()

