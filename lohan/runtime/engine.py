"""The engine: a block program trained with its states on NVMe (`lohan.init` builds one).

`Engine.step(batch)` runs one step in phases (DESIGN.md §4.2-4.4):

1. Plan (`step.StepPlan`): the slots read and written, whether the update runs during backward at coefficient 1
   (clipping off, or speculated) or waits for the global gradient norm (deferred), and whether the next step's
   forward and the last writes run beside the optimizer pass (follow, write-behind).
2. Forward, block by block under no_grad (`passes.BlockPasses`): each block's P16 is streamed in ahead of use;
   the activation plan keeps block inputs and swapped ops' outputs on the device, in main memory or on the
   SSDs (`activations.ActivationManager`).
3. Backward, block by block in reverse: each block is recomputed with grad, its gradient summed over the
   micro-batches on the device, copied to a host buffer and handed to the optimizer pipeline
   (`offload.GradOffloader`), which updates the block on the CPU while the device goes on with the blocks
   before it (active gradient offloading).
4. Settlement (`step.settle`): the global norm as `clip_grad_norm_` takes it gives the clip coefficient; a
   deferred update runs now, a speculated one that clipped is redone from the previous slot, a step whose loss
   or gradients are not finite is skipped.
5. Commit (or the skip's): the new slot becomes current once its writes are durable; with write-behind the
   commit is staged and made durable during the next step, once the pass's last writes complete.

A failure in any phase takes one abort path (`Engine._abort`), which leaves the last commit current.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import psutil
import torch
from torch import Tensor

from lohan.config import EngineConfig, ModelConfig, get_model_config
from lohan.models.adapter import BlockProgram, GPTBlocks
from lohan.models.gpt import GPT, block_generator, build_model, init_block_
from lohan.plan import durability, pools
from lohan.plan.formats import state_format
from lohan.plan.pools import PoolGeometry
from lohan.plan.run_plan import RunPlan, plan_run
from lohan.runtime.activations import ActivationManager
from lohan.runtime.clip_schedule import ClipSchedule
from lohan.runtime.device import Device, compute_dtype_choice
from lohan.runtime.gc_policy import StepGc
from lohan.runtime.heap import release_free_memory, reuse_heap
from lohan.runtime.held import HeldSteps, Outcome, finish_before_interrupts
from lohan.runtime.offload import GradOffloader, Provide
from lohan.runtime.optim import decay_mask
from lohan.runtime.parallel import (
    Group,
    current_group,
    shard_bounds,
    shard_decays,
    shard_layout,
)
from lohan.runtime.params import ParamStreamer, record_params
from lohan.runtime.passes import BlockPasses, visit_order
from lohan.runtime.step import (
    Counters,
    LossScale,
    NextForward,
    Phase,
    Settlement,
    StepPlan,
    StepRun,
    StepStats,
    commit_note,
    measure,
    rank_batch,
    settle,
    skip_outcome,
    stats_from_note,
)
from lohan.runtime.summary import EngineSummary, engine_summary
from lohan.store.dirlock import DirLock
from lohan.store.gradstash import GradStash
from lohan.store.opening import open_or_create, stored_compute_dtype
from lohan.store.states import DTYPES, StateStore, StoreLayout, plan_layout, unit_views

log = logging.getLogger(__name__)


def grad_dtype(cfg: EngineConfig, world: int = 1) -> torch.dtype:
    """dtype of the host gradient buffers: the planning layer's rule (`lohan.plan.pools.grad_dtype`: bf16 kept
    as it is with one micro-batch and one rank, fp32 otherwise) as a torch dtype."""
    return DTYPES[pools.grad_dtype(cfg.execution.compute_dtype, cfg.execution.micro_batches, world)]


def pool_geometry(program: BlockProgram, layout: StoreLayout, local: StoreLayout | None = None,
                  bounds: list[tuple[int, ...] | None] | None = None, world: int = 1) -> PoolGeometry:
    """What the host pools of a program's engine are sized from (`lohan.plan.pools`): its blocks' records, the
    tied weights its blocks borrow and, data parallel, the rank's shards (`local`, cut at `bounds`) with each
    block's P16 gathered from every rank's shard."""
    n = len(program.modules)
    borrowed = [(o, p) for i in range(n) for o, p in program.external_params(i)]
    return PoolGeometry(
        layout, local,
        p16_bytes=tuple(b.p16_bytes if bd is None else world * (bd[1] - bd[0]) * b.p16_itemsize
                        for b, bd in zip(layout.blocks, bounds or [None] * n)),
        tied=tuple(layout.blocks[o].params[p].numel for o, p in borrowed), owners=len({o for o, _ in borrowed}))


def engine_geometry(program: BlockProgram, cfg: EngineConfig, world: int = 1, rank: int = 0,
                    shared: bool | None = None) -> tuple[StoreLayout, list[tuple[int, ...] | None], StoreLayout,
                                                         PoolGeometry]:
    """The store an engine lays out for `program` (whole blocks), each block's shard bounds over `world` ranks,
    this rank's store (its shards; one process: the whole blocks) and the pools' geometry. Shapes only: a meta
    program gives the engine's figures without allocating (`cfg.compute_dtype` resolved; `shared`: a resumed
    store's P16 sharing, `StateStore.stored_p16_sharing`)."""
    layout = plan_layout(program.modules, program.names, cfg.execution.compute_dtype, cfg.store.slots, cfg.store.state_format, shared)
    bounds = [shard_bounds(b, world) for b in layout.blocks]
    local = shard_layout(layout, bounds, rank) if world > 1 else layout
    return layout, bounds, local, pool_geometry(program, layout, local if world > 1 else None, bounds, world)


def available_memory(local_world: int = 1) -> int:
    """Main memory available to this process now: the machine's, shared by the ranks on this host (what the
    plan's ``auto`` rooms take half of)."""
    return psutil.virtual_memory().available // local_world


def preset_program(mcfg: ModelConfig) -> GPTBlocks:
    """The block program `init` trains for a preset's config, on the meta device (shapes only, nothing
    allocated): what a pre-flight plans a preset's run from (`plan_engine`)."""
    return GPTBlocks(build_model(mcfg, device="meta"))


def plan_engine(program: BlockProgram, cfg: EngineConfig, world: int = 1, rank: int = 0, free: int | None = None,
                host_device: bool = False, shared: bool | None = None) -> RunPlan:
    """The run plan an engine of `program` executes (`lohan.plan.run_plan.plan_run` on `engine_geometry`), made
    without opening anything: the pre-flight's and the dry run's, handed to the engine (`Engine(plan=...)`)."""
    return plan_run(cfg, engine_geometry(program, cfg, world, rank, shared)[3], world, free, host_device)


class Engine:
    """Trains a block program whose states live in a StateStore on NVMe. Build with `lohan.init`."""

    def __init__(self, program: BlockProgram, cfg: EngineConfig, model_meta: dict,
                 init_block: Callable[[int], list[Tensor]],
                 flops_per_token: Callable[[int], float] | None = None,
                 resume: bool = False, overwrite: bool = False,
                 progress: Callable[[int, int], None] | None = None, dp: Group | None = None,
                 plan: RunPlan | None = None) -> None:
        """`plan`: the run plan the pre-flight made (`plan_engine`) and priced; the engine checks that its own
        inputs give the same figures (a disagreement is a bug, refused before anything is written) and executes
        it. None: the engine makes it, with the memory available now."""
        # data parallel (torchrun): the rank's own directories and share of the machine (parallel.py)
        self.dp = current_group(dp)
        self.world = self.dp.world
        self._base_dirs = tuple(cfg.store.nvme)
        self.cfg = cfg = self.dp.rank_config(cfg)
        self.program, self.flops_per_token = program, flops_per_token
        if cfg.memory.heap_reuse:  # before the store is built: its temporaries are trimmed after the first step
            reuse_heap()
        self.device = Device(self.dp.device_name(cfg.execution.device), sim_gpu=cfg.execution.sim_gpu)
        # compute_dtype auto, resolved once for this machine (a resume keeps the dtype the store was laid out in)
        stored = stored_compute_dtype(cfg.store.nvme, cfg.store.name) if resume and cfg.execution.compute_dtype == "auto" else None
        self.dtype_choice = compute_dtype_choice(cfg.execution.compute_dtype, self.device.type, cfg.store.state_format, stored)
        self.cfg = cfg = cfg.with_overrides(compute_dtype=self.dtype_choice.dtype)
        self.compute_dtype = DTYPES[cfg.execution.compute_dtype]
        # a store resumed keeps the records it was laid out with (a P16 section of its own or not: shared_p16)
        shared = StateStore.stored_p16_sharing(list(cfg.store.nvme), cfg.store.name) if resume else None
        # the whole blocks, their shard bounds and this rank's store
        self.layout, self.bounds, local_layout, geometry = engine_geometry(program, cfg, self.world, self.dp.rank,
                                                                           shared)
        self.grad_dtype = grad_dtype(cfg, self.world)
        self.run_plan = _executed_plan(plan, cfg, geometry, self.world, self.device.is_host,
                                       self.dp.local_world, self.grad_dtype.itemsize)
        self.run_plan.check()  # pools over cpu_mem: refused before anything is written
        # every pool is budgeted at the plan's figure (lohan.plan.pools: the one model of host memory)
        self.host_memory = self.run_plan.host
        self.memory_plan = self.host_memory.parts()
        init_block = _shard_init(init_block, self.layout, local_layout, self.bounds, self.dp.rank)
        self.store, self._lock = _open_store(cfg, local_layout, model_meta, init_block, resume, overwrite, progress,
                                             self.dp, self._base_dirs, self.run_plan.chunk_elems)
        # what building the store freed (a block's fp32 init, its records' chunks) goes back before the pools and
        # the first step take their memory: kept in the heap (reuse_heap), it added GBs to that step's peak RSS
        release_free_memory()
        try:
            self._build(local_layout, str(model_meta.get("config", {}).get("name", model_meta.get("kind", "model"))))
        except BaseException:
            self.store.close()
            self._lock.release()
            raise
        self.last_stats: StepStats | None = None  # what the last step measured
        self._broken: str | None = None
        self.clip_schedule = ClipSchedule(self.cfg, by_cost=self.dp.alone,  # speculate or defer (clip_mode)
                                          defer_unclipped=self.run_plan.defer_unclipped)
        # the model's own parameter order, in which clip_grad_norm_ takes the global norm (None: block order)
        self._norm_order = program.param_order() if hasattr(program, "param_order") else None
        self._closed = False
        self._trimmed = False  # memory.release_free_memory after the first step
        self._gc = StepGc(cfg.execution.gc_every)  # Python's collections at step ends, not mid-step (gc_policy.py)
        self._cpu_lanes: deque[float] = deque(maxlen=5)  # the optimizer's CPU lane in recent steps (`_refine_cpu_rate`)
        self._cpu_steps = 0

    def _build(self, layout: StoreLayout, label: str) -> None:
        """The components, on the store just opened: the host pools (at the memory plan's figures), the parameter
        streamer, the gradient stash, the optimizer pipeline, the activation manager and the block passes."""
        cfg, run_plan, program, volume = self.cfg, self.run_plan, self.program, self.store.volume
        # page-locked only where buffers cross to or from a GPU (P16 in, gradients out): the optimizer records
        # never leave main memory, and page-locked memory is scarce
        pin, sizes, plan = self.device.is_cuda, run_plan.pools(), run_plan.host
        self.params_pool = volume.buffer_pool(sizes["params"], pin=pin)
        self.grads_pool = volume.buffer_pool(sizes["grads"], pin=pin)
        # the optimizer's share of the plan also holds the fp32 upcast scratch (plan.upcast), which the offloader
        # allocates itself: the record pool gets the records, the resident room and the read-ahead room
        self.records_pool = volume.buffer_pool(sizes["records"])
        self.streamer = ParamStreamer(self.store, self.params_pool, self.device, program.modules, self.layout,
                                      self.dp, self.bounds)
        self.streamer.before_read = self._await_tail
        self.decays = [shard_decays(full, own, decay_mask(m, cfg.schedule.no_decay))
                       for full, own, m in zip(self.layout.blocks, layout.blocks, program.modules)]
        grad_bytes = [self.grad_dtype.itemsize * b.numel for b in layout.blocks]
        # serial mode holds every gradient in its pool already: the stash keeps those very buffers (plan.stash_ram)
        self.stash = (GradStash(list(cfg.store.nvme), grad_bytes, self.grads_pool, plan.stash_ram, cfg.store.name, cfg.store.backend,
                                cfg.store.stripe_bytes, cfg.store.emulate_ssd_gbps) if run_plan.stash else None)
        # (planned on the pool without the read-ahead room: that room is for one backward, not from step to step;
        # at the plan's chunk, whose units a resumed store must share: store.opening refuses others)
        resident = list(run_plan.resident_blocks)
        # the worker's torch ops take the cores the compute thread leaves (all of them beside a GPU)
        worker_init = functools.partial(self.device.bind_thread, self.device.worker_threads())
        self.offloader = GradOffloader(self.store, self.records_pool, cfg.execution.mode, self.grad_dtype, self.decays,
                                       self.stash, resident, thread_init=worker_init, seed=cfg.execution.seed,
                                       origins=[bd[self.dp.rank] if bd else 0 for bd in self.bounds])
        self.activations = ActivationManager(
            cfg, program, self.device, lambda: self.device.autocast(self.compute_dtype),
            engine_pool_bytes=plan.total, model_label=label, param_count=self.layout.param_count,
            p16_itemsize=self.store.p16_dtype.itemsize, flops_per_token=self.flops_per_token,
            # the shares of the states kept in memory and held by the read-ahead room (a rank's of its shards:
            # the same share of the model), and of the P16 kept over a turn
            resident_params=run_plan.resident_params, kept_p16_fraction=run_plan.kept_p16,
            readahead_params=run_plan.readahead_params)
        self.passes = BlockPasses(cfg, program, self.layout, self.device, self.compute_dtype, self.streamer,
                                  self.activations, self.offloader, self.grads_pool, self.grad_dtype, self.stash,
                                  self.dp, self.bounds, direct=(not self.device.is_host and cfg.execution.micro_batches == 1
                                                                and self.store.p16_dtype == self.grad_dtype),
                                  hand_over=plan.grads_handed)
        # the next step's forward, run while this step's optimizer pass finished (`step(next_batch=...)`)
        self._next = NextForward(self.device, self.streamer, self.activations)
        # the durability interval (engine.persist_every, lohan.plan.durability): why it cannot exceed 1 here
        self.persist_refusal = run_plan.persist_refusal
        if self.persist_refusal is not None and cfg.execution.persist_every not in ("auto", 1):
            log.warning("persist_every=%s lowered to 1: %s", cfg.execution.persist_every, self.persist_refusal)
        self._auto_persist = 1  # auto: priced after each step (`_observe_persist`)
        # the steps since the last durable commit, which a step that updates RAM-only states in place and turns
        # out not finite, or clips, replays (lohan.runtime.held); `_replayed`: how the failed step then runs again
        # (None: as planned; "skip": known to skip; a tensor: known to clip at that coefficient)
        self._held: HeldSteps = HeldSteps()
        self._replayed: Outcome = None
        self.streamer.ram_p16, self.streamer.ram_current = self._ram_p16, self._record_current
        self._ram_update: int | None = None  # `_ram_p16`: the update a following forward reads (None: the commit's)
        if run_plan.zero_copy:  # the CPU computes on these blocks' records (no P16 buffer: `load_records`)
            self.streamer.use_records(record_params(self.layout, self.offloader.resident_records,
                                                    self.store.p16_dtype, run_plan.zero_copy), self._record_current)

    # ------------------------------------------------------------ durability
    @property
    def persist_every(self) -> int:
        """The durability interval in force (`engine.persist_every`): 1 where records stream (or it cannot apply,
        `persist_refusal`); `auto`: what the last step priced (`_observe_persist`; 1 before the first step)."""
        if self.persist_refusal is not None:
            return 1
        return self._auto_persist if self.cfg.execution.persist_every == "auto" else int(self.cfg.execution.persist_every)

    def _ram_p16(self, block: int, slot: int) -> list[tuple[int, Tensor]]:
        """Block `block`'s P16 of slot `slot` from its resident record: a RAM slot's (a step between durable
        commits), or a durable slot's that the record holds (`_record_current`), as (first element, P16) of each of
        its units (one, or one per chunk of a block updated in chunks)."""
        if not self._record_current(block, slot):
            raise RuntimeError(f"block {block}'s parameters of slot {slot} are not in memory (a discarded update "
                               "lost them); resume from the last durable step")
        b = self.store.layout.blocks[block]
        return [(lo, unit_views(rb.buf.tensor, b, lo, hi, self.store.p16_dtype).p16)
                for rb in self.offloader.resident_records.of_block(block) for _, lo, hi in [rb.unit]]

    def load_records(self) -> None:
        """Between steps, where the CPU computes on resident records (`RunPlan.zero_copy`): read those that do not
        hold the current slot back from it (none before the first step: it loads them all; a skipped, redone or
        rolled-back step, or a failed write, leaves some with other bytes). The params pool has no buffer for their P16: a
        forward or an evaluation must find them current. A staged commit is made durable first (`flush`: the slot
        must be the one that stands; a write of it that failed drops that step and raises, as a step would)."""
        if not self.run_plan.zero_copy or not self._stale_records():
            return
        self.flush()
        stale = self._stale_records()
        if stale and not self.store.in_ram(self.store.slot):  # (a RAM slot's bytes are nowhere else: `_replay`)
            self.offloader.load_resident(self.store.slot, self.store.commit_state.applied, stale)

    def _stale_records(self) -> list[tuple[int, int, int]]:
        """The units of the zero-copy blocks' records that do not hold the current slot."""
        res, slot, applied = self.offloader.resident_records, self.store.slot, self.store.commit_state.applied
        return [rb.unit for i in self.run_plan.zero_copy for rb in res.of_block(i)
                if not res.holds(rb.unit, slot, applied)]

    def _record_current(self, block: int, slot: int) -> bool:
        """Whether block `block`'s resident record holds the P16 of `slot` at the update a forward reads
        (`_applied`)."""
        res, applied = self.offloader.resident_records, self._applied()
        rbs = res.of_block(block)
        return bool(rbs) and all(res.holds(rb.unit, slot, applied) for rb in rbs)

    def _applied(self) -> int:
        """The update the RAM states a forward reads hold: the last commit's, or the step's own while the next
        forward follows its tail (`_finish_updates`)."""
        return self.store.commit_state.applied if self._ram_update is None else self._ram_update

    def _observe_persist(self, stats: StepStats) -> None:
        """auto, after every step: the least interval that keeps the persist writes under ~10% of the run's time.
        A persist writes a slot of records at the SSDs' write rate the profile measured (the first step's probe);
        before a profile, at the rate a durable step's own writes show. The time they are weighed against is the
        step's without its own writes. (A durable step's writes measured in its window mislead: with write-behind
        most of them fall into the next step, and 16 KB of a 2.7 MB persist priced them 100x too slow.)"""
        if self.cfg.execution.persist_every != "auto" or self.persist_refusal is not None:
            return
        slot_bytes, write_s = self.store.layout.slot_bytes, stats.lanes.get("ssd_write", 0.0)
        profile = self.activations.profile
        rate = profile.hardware.bw_m2s if profile is not None else 0.0
        if rate <= 0:
            if write_s <= 0 or stats.ssd_write_bytes < slot_bytes / 2:
                return
            rate = stats.ssd_write_bytes / write_s
        step_s = max(stats.step_s - write_s, slot_bytes / rate / 10)
        n = durability.persist_interval(slot_bytes, rate, step_s)
        if n != self._auto_persist:
            log.info("persist_every auto: %d (a persist writes %.2f GB at %.2f GB/s against a %.2f s step); %s", n,
                     slot_bytes / 1e9, rate / 1e9, step_s, durability.loss_text(n, step_s))
        self._auto_persist = n

    def persist(self) -> None:
        """Make the current state durable: the staged commit (write-behind, `flush`), or the steps held in RAM
        since the last durable commit (the durability interval): every resident record is written to the real
        slot the durable commit does not name, then committed. Evaluations, exports, checkpoints, Ctrl-C and
        `close` call it."""
        self.flush()
        store = self.store
        if not store.volatile:
            return
        c = store.commit_state
        slot = store.next_slot()
        self.streamer.invalidate(slot)  # its kept blocks are of an older step
        sums = self.offloader.persist_resident(slot, c.applied)
        store.commit(c.step, slot, sums=sums, updates=c.applied, bad_streak=c.bad_streak, loss_scale=c.loss_scale,
                     growth_tracker=c.growth_tracker, note=c.note)
        self._held.clear()
        # blocks kept for the next forward under the RAM slot (an update during backward handed them over): the
        # next step reads `slot` now, so nothing would take them, and they would hold the pool's room for good
        self.streamer.drop_kept()
        log.info("step %d persisted (its states were held in RAM)", c.step)

    # ------------------------------------------------------------------ step
    @property
    def step_count(self) -> int:
        """Optimizer steps completed and committed (with write-behind, the last one's commit may not be durable
        yet: see `committed_step` and `flush`)."""
        return self.store.step

    @property
    def committed_step(self) -> int:
        """The step a process killed now would resume from."""
        return self.store.durable_step

    @property
    def committed_stats(self) -> StepStats | None:
        """What the committed step measured, as committed with it (None before the first step, or for a store
        written by an older lohan): a process that was killed before it wrote the step's metrics finds them
        here. Its `step_s` leaves out the commit's own time, which `last_stats` includes."""
        return stats_from_note(self.store.commit_state.note)

    def describe(self) -> EngineSummary:
        """What the run header prints of this engine (`runtime.summary`): store, pools, device, durability."""
        return engine_summary(self)

    @property
    def gpu_plan(self) -> dict[str, int] | None:
        """The GPU memory plan checked at the first step (planner.gpu_need), where one was checked."""
        return self.passes.gpu_plan

    def flush(self) -> None:
        """Make the last step durable: with write-behind its last writes and its commit may still be pending
        (they complete during the next step's backward otherwise). If one of those writes failed, the step is
        dropped (the one before it stays current and durable) and the error raised."""
        if not self.store.staged:
            return
        lost = self.store.step
        try:
            self.offloader.drain_tail()
            self.store.persist()
        except BaseException:
            self.store.discard_staged()
            self.offloader.forget_tail_error()
            self._next.drop()
            log.error("step %d could not be made durable; the state committed at step %d stands", lost,
                      self.store.step)
            raise

    def drop_staged(self) -> None:
        """Take the last step's staged commit back (write-behind) instead of making it durable: a caller that could
        not record what that step's predecessor did (its metrics) stops here, and the resumed run runs the step
        again. The engine takes no more steps."""
        if not self.store.staged:
            return
        with contextlib.suppress(Exception):  # its writes go to the slot no commit names: done or not, no matter
            self.offloader.drain_tail()
        self.store.discard_staged()
        self.offloader.forget_tail_error()
        self._next.drop()
        self._broken = f"step {self.store.step + 1}'s commit was taken back (drop_staged); resume the run"

    def _await_tail(self, slot: int, block: int | None = None) -> None:
        """Before the SSDs are read (`block`'s P16; None: any block): a staged slot's last writes may still be in
        flight (write-behind)."""
        if not self.store.staged or slot != self.store.slot or self.offloader.tail_done.is_set():
            if self.offloader.tail_error is not None and self.store.staged and slot == self.store.slot:
                raise RuntimeError("a write of the last step's optimizer pass failed") from self.offloader.tail_error
            return
        if self.offloader.busy:  # the worker retires the tail as its pass goes: wait for this block's writes only
            try:
                self.offloader.wait_tail(block)
            except Exception as e:
                raise RuntimeError("a write of the last step's optimizer pass failed") from e
        else:
            self.flush()

    def step(self, batch: tuple[Tensor, Tensor], next_batch: tuple[Tensor, Tensor] | None = None) -> float:
        """One training step on `batch` = (token ids, targets), both [batch, seq]; returns the mean loss.

        Phases: plan (`StepPlan`), forward (block inputs and swapped activations kept), backward (each block's
        gradient goes to the optimizer pipeline as soon as it is complete, and its norm is taken), settlement
        (the global norm gives the clip coefficient; a speculative update that guessed wrong is redone from the
        previous slot, a step with a non-finite loss or gradient is skipped), the end of the optimizer pass,
        then commit (or skip). On any failure, one abort path (`_abort`) restores the last commit, which the
        step never touched with two slots. `last_stats` then holds what the step measured.

        `next_batch`, the batch of the following step where the caller knows it: when this step's optimizer
        pass runs after backward (an update deferred until the gradient norm was known, or a redone one), it
        runs in forward order, and the next step's forward runs meanwhile on each block's new parameters as
        soon as its update is done; `step(next_batch)` then starts at its backward (not in serial mode, the
        ablation's baseline). The same bits either way, and this step is committed before `step` returns; with
        `write_behind` (such a pass, two slots, one process) the commit is staged and becomes durable during the
        next step's backward, once the pass's last writes are complete (or at `flush` / `close`).
        """
        if self._broken:
            raise RuntimeError(self._broken)
        run = self._begin(batch, next_batch)
        replay = None
        try:
            # a stop halfway through an update in place of RAM-only states would lose them; so would one while such
            # a step is rolled back for its replay (its pass may still run: a signal then stopped the rollback)
            with finish_before_interrupts(run.plan.in_place or run.plan.known is not None) as held_signals:
                try:
                    loss = self._train(run)
                    # measured before the commit too, to be committed with it (`committed_stats`): the time of the
                    # commit itself is in `last_stats` only
                    self._conclude(run, loss, commit_note(measure(self, run, loss, overlapped=self._next.held)))
                    self._held.after_commit(self.store.volatile, batch, next_batch, _outcome(run.settlement))
                    self.last_stats = measure(self, run, loss, overlapped=self._next.held)
                    self.clip_schedule.observe(self.last_stats)
                    self._refine_cpu_rate(self.last_stats)
                    self._observe_persist(self.last_stats)
                    self.activations.refine_persist(self.persist_every)
                except _InPlaceLost as lost:
                    held = self._held.take()
                    self._abort(run)
                    self._drop_volatile()  # (whatever the rollback found updated: the replay starts at the durable commit)
                    replay = (held, lost.coef, list(held_signals))
                    held_signals.clear()  # (delivered once the replay is over: `_replay`)
        except BaseException:
            self._abort(run)
            raise
        finally:  # after the abort: a failed pass may still read the kept gradients until it is stopped
            self.offloader.release_kept()
        if replay is not None:
            return self._replay(*replay, batch, next_batch)
        if not self._trimmed:  # store building and the first step's profiling leave freed memory resident
            release_free_memory()
            self._trimmed = True
        self._gc.step_done()
        return loss

    def _begin(self, batch: tuple[Tensor, Tensor], next_batch: tuple[Tensor, Tensor] | None) -> StepRun:
        """Plan the step (`StepPlan.make`) and start its optimizer pipeline; nothing is written yet."""
        idx, targets = self._check_batch(batch)
        start_s, counters = time.perf_counter(), Counters.read(self)
        self.offloader.reset_stats()
        prepared = self._next.take(idx)
        self.device.reset_peak_memory()
        idx, targets = self.device.put(idx), self.device.put(targets)
        store, n = self.store, len(self.program.modules)
        commit = store.commit_state
        scaler = None
        if self.cfg.execution.compute_dtype == "fp16":
            # its tensors live where the gradients are unscaled: the device, or the host buffers a group sums
            scaler = LossScale(self.cfg, commit, self.device.put if self.dp.alone else (lambda t: t))
        estimate = self.activations.plan.estimate if self.activations.plan is not None else None
        # the durability interval: a step is durable every persist_every steps after the last durable one
        durable = store.step + 1 - (store.durable_step if store.volatile else store.step) >= self.persist_every
        # a clip of a step whose states are in RAM only replays the steps since the last durable one, then it
        replay_s = (len(self._held) + 1) * self.last_stats.step_s if store.volatile and self.last_stats else 0.0
        speculate = self.clip_schedule.speculate(estimate, replay_s)
        next_host = self._overlappable(idx, next_batch)
        plan = StepPlan.make(self.cfg, commit, store.slot, store.next_slot(durable), n, speculate,
                             None if next_host is None else self.device.put(next_host), one_process=self.dp.alone,
                             durable=durable, ram_read=store.in_ram(store.slot), replayable=True,
                             skip=isinstance(self._replayed, str), known=self._replayed if isinstance(
                                 self._replayed, Tensor) else None, separate_device=not self.device.is_host)
        run = StepRun(plan, idx, targets, commit, visit_order(n), start_s, counters, prepared, scaler, next_host)
        self.load_records()  # (before its pass takes the records)
        store.begin_step()
        self.streamer.invalidate(plan.write_slot)  # this step rewrites that slot: its kept blocks go stale
        # the last step's staged commit is made durable on the worker, after its writes and before this pass's
        self.offloader.begin_step(plan.update, plan.hyper, list(plan.order), plan.read_slot, plan.write_slot,
                                  gate=plan.gate, keep=plan.speculated, provide=self._provide(plan), lazy=plan.lazy,
                                  before=store.persist if store.staged else None, persist=plan.durable)
        return run

    def _provide(self, plan: StepPlan) -> Provide | None:
        """Where the pass's new P16 goes besides the SSDs: to the next forward running beside a deferred pass
        (`offer`), or kept for the next step's forward by a pass during backward (`handover`). Not in serial
        mode, the ablation's baseline: ZeRO-Infinity reads the parameters back."""
        if plan.follow:
            return self.streamer.offer
        if plan.deferred or self.cfg.execution.mode == "serial":
            return None
        return self.streamer.handover(plan.read_slot, plan.write_slot)

    def _train(self, run: StepRun) -> float:
        """Forward (unless the previous step ran it), backward, settlement and the end of the optimizer pass;
        returns the loss."""
        plan, n = run.plan, len(self.program.modules)
        if run.prepared is not None:
            acts = run.prepared.acts
        else:
            acts, run.fwd_timer = self.passes.forward(run.visits, plan.read_slot, run.idx)
        norms = self.passes.backward(run, acts, run.targets.chunk(self.cfg.execution.micro_batches))
        loss = self.dp.sum(self.passes.host_sum(run.losses))
        t_tail = time.perf_counter()
        run.activations = self.passes.end_backward(plan.read_slot)
        if plan.follow:
            self.streamer.expect(list(range(n)), lambda: self.offloader.failure)
        run.settlement = settle(self.cfg, self.device, loss, norms, self._norm_order, plan, run.scaler)
        settled = run.settlement
        if (settled.skipped or settled.redone) and plan.in_place and self.store.in_ram(plan.read_slot):
            # what it updated was in RAM only: nothing to skip back to or redo from (`_replay`)
            raise _InPlaceLost(None if settled.skipped else settled.coef_t)
        if (plan.skip and not settled.skipped) or (plan.known is not None and (
                settled.skipped or not torch.equal(settled.coef_t, plan.known))):
            raise RuntimeError(f"step {plan.step + 1}, replayed from the same batch, did not come out as it did (norm "
                               f"{settled.grad_norm}): the model's compute is not deterministic here, so the steps held "
                               "in RAM cannot be replayed; resume from the last durable step")
        self._finish_updates(run)
        run.tail_s = max(0.0, time.perf_counter() - t_tail - run.next_fwd_s)
        if not self._next.held:
            self.streamer.release_all()
        return loss

    def _finish_updates(self, run: StepRun) -> None:
        """End the step's optimizer pass: discarded (skipped step), completed (its updates ran during backward,
        or were deferred until now), or redone from the previous slot (speculated wrongly). A pass that runs
        now, in forward order, has the next batch's forward run beside it, on the blocks it provides."""
        plan, settled, n = run.plan, run.settlement, len(self.program.modules)
        if settled.skipped:
            self.offloader.abort()
            self.streamer.release_all()  # cancels what a deferred pass would have provided
            self.streamer.end_handover()
            return
        self.offloader.backward_done()
        follow = plan.follow
        if settled.redone:
            self.offloader.finish()  # the speculative pass (coefficient 1) ends; its slot is rewritten below
            self.streamer.end_handover()
            self.streamer.invalidate(plan.write_slot)  # what it handed over is not the step's update
            follow = plan.next_idx is not None
            order = list(range(n)) if follow else list(range(n - 1, -1, -1))
            if follow:
                self.streamer.expect(order, lambda: self.offloader.failure)
            self.offloader.begin_redo(plan.update, plan.hyper, order, plan.read_slot, plan.write_slot,
                                      settled.coef_t, provide=self.streamer.offer if follow else None,
                                      persist=plan.durable)
        elif plan.tail_follows:  # the rest of the pass in forward order, the next forward following it
            blocks = self.offloader.follow(functools.partial(self._expect_tail, plan))
            # ([]: the pass was over before it turned; a durable step's slot is on no SSD until its commit, and no
            # block of it was taken to reach the forward from memory: that forward waits for the next step)
            follow = blocks is not None and (bool(blocks) or not plan.durable)
        fwd_t = None
        if follow:
            # (a block it reads again, or one updated before the tail and not handed over, comes from its record, at this
            # step's update; a durable step's were all taken as provisions, `_expect_tail`)
            self._ram_update = plan.update
            try:
                acts, fwd_t = self.passes.forward(run.visits, plan.write_slot, plan.next_idx)
            finally:
                self._ram_update = None
            self._next.keep(plan.next_idx, acts, run.next_host)
        self.offloader.finish()
        self.streamer.end_handover()
        run.next_fwd_s = fwd_t.seconds() if fwd_t else 0.0

    def _expect_tail(self, plan: StepPlan, blocks: list[int]) -> Provide | None:
        """`GradOffloader.follow`'s callback (on the worker, at a block boundary): the next forward waits for
        `blocks`' new P16 from the pass; the blocks updated before it kept theirs (`handover`) or are read from
        their resident records, updated already. A durable step's slot is on no SSD before its commit, so there
        each of those blocks must be in memory: its record resident, or its P16 kept, taken now out of the pool's
        reach (`ParamStreamer.take_handed_over`); else None, and the forward waits for the whole pass."""
        if plan.durable:
            if self.device.is_host:  # (the forward would share the cores with the update: it runs after the pass)
                return None
            before = [i for i in range(len(self.program.modules))
                      if i not in blocks and i not in self.offloader.resident_records]
            if not self.streamer.take_handed_over(before, plan.write_slot):
                return None
        self.streamer.expect(blocks, lambda: self.offloader.failure)
        return self.streamer.offer

    def _conclude(self, run: StepRun, loss: float, note: dict) -> None:
        """Commit the step, or (not finite) its skip, with `note` (what it measured); fp16: the loss scale's update
        goes with either."""
        plan = run.plan
        run.phase = Phase.COMMITTING
        scaler = run.scaler.update(self.device) if run.scaler else {}
        if run.settlement.skipped:
            self._skip(run, loss, {**scaler, "note": note})
        elif not plan.durable:  # its states stay in RAM (the durability interval): nothing on the SSDs changes
            self.store.commit_volatile(plan.step + 1, plan.write_slot, updates=plan.update, note=note, **scaler)
        else:
            self._commit(plan.step + 1, plan.write_slot, sums=self.offloader.sums_written(), updates=plan.update,
                         durable=not plan.lazy, note=note, **scaler)
        run.phase = Phase.COMMITTED

    def _refine_cpu_rate(self, stats: StepStats) -> None:
        """Price the cost model's CPU lane at the rate this run's steps measure (`ActivationManager.refine_cpu`):
        the median of the last few steps, the first one left out once others exist (it also profiles and faults
        the pools in). Only where the device computes apart from the host's cores (CUDA, or the simulated device
        with a timing model): on a CPU device the compute and the update share the cores, so the lanes the model
        overlaps are not independent, and the measured step times of each schedule (`ClipSchedule`) decide."""
        lane = stats.lanes.get("cpu", 0.0)
        if not (self.device.is_cuda or self.device.timing is not None) or lane <= 0 or stats.skipped:
            return
        self._cpu_steps += 1
        if self._cpu_steps == 2:  # the first step profiled and faulted its pools in: only a prior until now
            self._cpu_lanes.clear()
        self._cpu_lanes.append(lane)
        profile = self.activations.profile
        if profile is not None:
            cost = state_format(self.cfg.store.state_format).update_cost
            self.activations.refine_cpu(cost * profile.param_count / statistics.median(self._cpu_lanes))

    def _abort(self, run: StepRun) -> None:
        """The one failure path of a step, by how far it got: before its commit, the pipeline stops and the last
        commit stands (`_rollback`); a failed commit drops the next step's forward (it ran on this slot's
        parameters, not to be used uncommitted); after a staged commit (a Ctrl-C while it was measured), the
        staged commit is taken back: a step that raises is not committed."""
        if run.phase is Phase.RUNNING:
            self._rollback(run.plan.step)
        elif run.phase is Phase.COMMITTING:
            self._next.drop()
        elif run.plan.lazy and self.store.staged:
            self.store.discard_staged()
            self._next.drop()

    def _check_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return rank_batch(batch, self.cfg.execution.micro_batches, self.world, self.dp.rank)

    def _commit(self, step: int, slot: int, **kw: Any) -> None:
        """Commit `step` (data parallel: locally, keeping the previous commit, then the group decides); a RAM
        slot's (a skipped step between durable commits) in this process only."""
        if self.store.in_ram(slot):
            kw.pop("sums", None)
            self.store.commit_volatile(step, slot, **kw)
            return
        self.dp.commit(self.store, self._base_dirs, self.cfg.store.name, step, slot, **kw)

    def _overlappable(self, idx: Tensor, next_batch: tuple[Tensor, Tensor] | None) -> Tensor | None:
        """The next batch's ids (on the host) when its forward may run during this step's optimizer pass: the
        same shape (no new activation profile). In place (slots=1) too: that forward takes every block's new P16
        from the pass, never from the slot being rewritten. Not in serial mode: the baseline of the ablation is
        ZeRO-Infinity's schedule, the optimizer after backward with nothing beside it (the next step starts once
        it is done), whether or not the step clips."""
        if next_batch is None or self.cfg.execution.mode == "serial":
            return None
        nxt, _ = self._check_batch(next_batch)
        # (a snapshot: the next step compares its ids with these, and a loader may refill the caller's tensor)
        return nxt.clone() if nxt.shape == idx.shape else None

    def _skip(self, run: StepRun, loss: float, scaler: dict[str, Any]) -> None:
        """A step with a non-finite loss or gradient: its batch is consumed, the states stay as they were
        (`step.skip_outcome`: what is committed, and whether the run must stop)."""
        self.flush()  # the last step's staged commit (its pass ran, or failed, on the worker before this one)
        commit, fatal = skip_outcome(run, loss, scaler, self.cfg.stability.max_bad_steps)
        self._commit(run.plan.step + 1, run.commit.slot, **commit)
        if fatal is not None:
            raise fatal

    def _replay(self, held: list, coef: Tensor | None, signals: list[int], batch: tuple[Tensor, Tensor],
                next_batch: tuple[Tensor, Tensor] | None) -> float:
        """A step that updated RAM-only states in place turned out not finite, or clipped after a speculated update
        (`StepPlan.in_place`): the rollback went back to the last durable commit; the steps since are run again from
        their batches (the same bits), then this one as it now is known to end: skipped (`coef` None: its optimizer
        pass lets each gradient go, no stash needed, and it commits the skip as any non-finite step) or clipped at
        `coef` (its update during backward at that coefficient) (lohan.runtime.held)."""
        what = "is not finite" if coef is None else f"clips (coefficient {float(coef):.4g})"
        log.warning("step %d %s and had updated in place the states held in RAM since step %d: replaying %d step(s) "
                    "from their batches, then running it again", self.store.step + len(held) + 1, what,
                    self.store.step, len(held))
        # each replayed step runs as it ended (skipped, clipped at its coefficient): none replays again; and the
        # replay is part of this call, which an interrupt (one the failed step held too) must not leave halfway
        with finish_before_interrupts(True, pending=signals):
            for b, nb, outcome in [*held, (batch, next_batch, "skip" if coef is None else coef)]:
                self._replayed = outcome
                try:
                    loss = self.step(b, nb)
                finally:
                    self._replayed = None
        return loss

    def _drop_volatile(self) -> None:
        """Forget the steps held in RAM since the last durable commit (their states, the batches to replay them,
        the blocks kept for the next forward): the durable commit is current again."""
        if self.store.volatile:
            self.store.drop_volatile()
            self.offloader.resident_records.forget()
            self.streamer.drop_kept()
        self._held.clear()

    def _rollback(self, step: int) -> None:
        """After a failure inside a step: stop the pipeline and keep (re-commit) the last committed state."""
        self._next.forget()
        self.streamer.release_all()  # first: a pass providing the next forward's blocks may wait for room
        self.offloader.abort()
        self.streamer.release_all()
        self.streamer.drop_kept()
        self.activations.end_step()
        try:  # the last step's staged commit: durable if its writes completed, else dropped
            self.flush()
        except BaseException as e:
            log.warning("the step before the failed one was dropped too: %s", e)
        if self.store.volatile:  # the steps since the last durable commit are in RAM only
            self._rollback_volatile()
            return
        if self.store.layout.slots == 1 and self.offloader.blocks_written:
            self._broken = (f"step {step + 1} failed after rewriting {self.offloader.blocks_written} block(s) "
                            "in place (slots=1), so the states on NVMe are mixed; restore a checkpoint")
            return
        try:  # nothing current was touched: the last commit stands (the other ranks may be gone: no decision)
            self.dp.recommit(self.store)
        except BaseException as e:  # e.g. the disk that failed the step fails the fsync too
            log.warning("could not re-commit step %d after the failure (%s); the commit record on disk still "
                        "points at it", self.store.step, e)

    def _rollback_volatile(self) -> None:
        """After a failed step while the current state is in RAM only: it stands if the failed step updated none of
        its records (its update waits for the gradient norm); otherwise those steps are lost, and the last durable
        commit is current again (a resume replays the steps after it)."""
        c, res = self.store.commit_state, self.offloader.resident_records
        if res.all_hold(c.slot, c.applied):
            return
        lost = c.step
        self._drop_volatile()
        log.warning("steps %d..%d were held in RAM and the step after them had updated them in place when it failed "
                    "or turned out not to stand; the state committed at step %d is current again", self.store.step + 1,
                    lost, self.store.step)

    def evaluate(self, batch: tuple[Tensor, Tensor]) -> float:
        """Mean loss of `batch` = (token ids, targets) under the committed weights, forward only.

        Micro-batched like `step` (the mean of the micro-batches' mean losses, so with one micro-batch the
        mean over the batch's targets): each block's P16 is streamed from the committed slot (prefetched
        like a step's forward) and run under no_grad, the head included. Nothing is saved for backward,
        no gradient is taken, the optimizer, the activation manager and the store are not touched and
        nothing is committed; every block is released at the end, so the next `step` starts as it would
        have without the evaluation.
        """
        if self._broken:
            raise RuntimeError(self._broken)
        self.persist()  # it reads the committed slot: durable first (its last writes, the steps held in RAM)
        self.load_records()
        idx, targets = self._check_batch(batch)
        loss = self.passes.evaluate(self.store.slot, self.device.put(idx), self.device.put(targets))
        return self.dp.sum(loss)

    # -------------------------------------------------------------- access
    def state_dict_fp32(self) -> dict[str, Tensor]:
        """The current fp32 master weights as `{block_name.param_name: tensor}` (reads every block; data
        parallel: every rank calls it, and gets the whole model from the ranks' shards)."""
        self.persist()
        out = {}
        for b in self.layout.blocks:
            for spec, t in zip(b.params, self.read_params(b.index)):
                out[f"{b.name}.{spec.name}"] = t
        return out

    def read_params(self, block: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Block `block`'s fp32 master weights of the committed slot, whole (data parallel: gathered from
        the ranks' shards; every rank calls it for the same blocks in the same order)."""
        self.persist()
        own = self.store.read_params(block)
        if self.bounds[block] is not None:
            own = self.dp.gather_block(own, self.bounds[block], self.layout.blocks[block])
        return [t.to(dtype) for t in own]

    @property
    def whole(self) -> Engine:
        """What the exporters read (`.layout`, `.read_params(i)`, `.step_count`: the whole model, data parallel
        gathered from the ranks' shards), made durable first."""
        self.persist()
        return self

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._broken is None:
                self.persist()
            else:
                self.flush()
        finally:
            self._close()

    def _close(self) -> None:
        self._closed = True
        self._gc.close()
        self._next.forget()
        self.offloader.close()  # its worker thread lives as long as the engine
        self.streamer.close()  # (and its hash thread)
        self.activations.close()
        if self.stash is not None:
            self.stash.close()
        for pool in (self.params_pool, self.grads_pool, self.records_pool):
            pool.clear()
        self.device.close()
        try:
            self.store.close()
        finally:
            self._lock.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(settled: Settlement) -> Outcome:
    """How a committed step ended, for its replay (`held.Outcome`)."""
    if settled.skipped:
        return "skip"
    return settled.coef_t if settled.clip_coef is not None and settled.clip_coef < 1.0 else None


class _InPlaceLost(Exception):
    """A step that updated RAM-only states in place is not finite (`coef` None) or clipped at `coef`
    (`Engine._replay` recovers it)."""

    def __init__(self, coef: Tensor | None) -> None:
        super().__init__()
        self.coef = coef


def _open_store(cfg: EngineConfig, layout: StoreLayout, model_meta: dict, init_block: Callable[[int], list[Tensor]],
                resume: bool, overwrite: bool, progress: Callable[[int, int], None] | None, dp: Group,
                base_dirs: tuple[str, ...], chunk_elems: int) -> tuple[StateStore, DirLock]:
    """Lock the run's directories, refuse what they cannot give this run (`check_request`; data parallel, alike
    on every rank), then open the store, continue its creation or create it (`open_or_create`); a rank is brought
    to its group's committed step. Returns the store and the held lock."""
    dirs = list(cfg.store.nvme)
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    lock = DirLock(dirs)  # before anything in the directories is read or written
    store = None
    try:
        decision = dp.check_store(base_dirs, cfg.store.name, resume, overwrite)
        store = open_or_create(dirs, cfg, layout, model_meta, init_block, resume, overwrite, progress, chunk_elems)
        dp.join(store, decision, base_dirs, cfg.store.name, dirs)
    except BaseException:
        if store is not None:
            store.close()
        lock.release()
        raise
    return store, lock


def _executed_plan(plan: RunPlan | None, cfg: EngineConfig, geometry: PoolGeometry, world: int, host_device: bool,
                   local_world: int, grad_size: int) -> RunPlan:
    """The plan the engine runs: the one given, where its own inputs (with the memory the plan assumed available)
    give the same figures, or its own with the memory available now. `grad_size`: its gradient buffers' itemsize
    (`grad_dtype`)."""
    if plan is None:
        return plan_run(cfg, geometry, world, available_memory(local_world), host_device, grad_size)
    mine = plan_run(cfg, geometry, world, plan.free, host_device, grad_size)
    if mine != plan:
        raise ValueError(f"the run plan given to the engine is not the one its settings and model give (given: "
                         f"{plan.pools()}, {plan.resident_blocks} resident; the engine's: {mine.pools()}, "
                         f"{mine.resident_blocks} resident): plan with lohan.runtime.engine.plan_engine on the same "
                         "config and model")
    return plan


def _shard_init(init_block: Callable[[int], list[Tensor]], full: StoreLayout, local: StoreLayout,
                bounds: list[tuple[int, ...] | None], rank: int) -> Callable[[int], list[Tensor]]:
    """`init_block` for a rank's store: the pieces of block i's parameters inside the rank's shard."""
    def init(i: int) -> list[Tensor]:
        params = init_block(i)
        if bounds[i] is None:
            return params
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        lo = bounds[i][rank]
        return [flat[lo + s.offset:lo + s.offset + s.numel].clone() for s in local.blocks[i].params]
    return init


def init(model: str | ModelConfig | GPT, config: EngineConfig | dict | None = None, *, resume: bool = False,
         overwrite: bool = False, progress: Callable[[int, int], None] | None = None, plan: RunPlan | None = None,
         **overrides: Any) -> Engine:
    """Build an Engine for a preset name, a ModelConfig, or a GPT (meta or initialized); with `lora_r` > 0, a
    `LoraEngine` (LoRA adapters over the frozen weights).

    The model's states are laid out on the NVMe directories of `config` and initialized block by
    block (an initialized GPT's own weights are used; a preset or config is initialized from
    `config.seed`). Nothing else changes in the training loop: `loss = engine.step(batch)`. `plan`: the run
    plan a pre-flight made for it (`plan_engine`), which the engine executes (`Engine`).
    """
    cfg = config if isinstance(config, EngineConfig) else EngineConfig(**(config or {}))
    if overrides:
        cfg = cfg.with_overrides(**overrides)
    if isinstance(model, str):
        model = get_model_config(model)
    if isinstance(model, ModelConfig):
        model = build_model(model, device="meta")
    if not isinstance(model, GPT):
        raise TypeError(f"lohan.init takes a preset name, a ModelConfig or a lohan GPT, not {type(model).__name__}")
    mcfg = model.cfg
    program = GPTBlocks(model)
    materialized = any(not p.is_meta for p in model.parameters())

    def init_block(i: int) -> list[Tensor]:
        block = program.modules[i]
        if materialized:
            return [p.detach().float() for p in block.parameters()]
        tmp = copy.deepcopy(block).to_empty(device="cpu")
        init_block_(tmp, mcfg, block_generator(cfg.execution.seed, i))
        return [p.detach() for p in tmp.parameters()]

    meta = {"kind": "gpt", "config": asdict(mcfg), "seed": None if materialized else cfg.execution.seed}
    if cfg.lora.lora_r:  # --lora R: a frozen base, adapters trained (lohan.runtime.lora_engine)
        from lohan.runtime.lora_engine import LoraEngine

        engine: Any = LoraEngine(program, cfg, meta, init_block, flops_per_token=mcfg.flops_per_token,
                                 resume=resume, overwrite=overwrite, progress=progress)
    else:
        engine = Engine(program, cfg, meta, init_block, flops_per_token=mcfg.flops_per_token, resume=resume,
                        overwrite=overwrite, progress=progress, plan=plan)
    if materialized:  # the weights now live in the store; free the caller's copy
        model.to_empty(device="meta")
    return engine
