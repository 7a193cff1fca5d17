"""Engine.step(batch): one synchronous training step with states on NVMe.

Per step (DESIGN.md §4.2-4.3):
1. Forward, block by block, under no_grad: each block's P16 is streamed in ahead of use. Of each
   transformer block the activation plan keeps the input and the outputs of its swapped ops, on
   the device, in main memory or on the SSDs (`swap.ActivationManager`, DESIGN.md §4.4).
2. Backward, block by block in reverse: recompute the block with grad (swapped ops replay their
   recorded outputs; the rest is recomputed), take the gradients of
   its parameters and input with `torch.autograd.grad`, accumulate over micro-batches into a host
   fp32 buffer, and hand the buffer to the optimizer pipeline, which updates that block on the CPU
   while the device goes on with the blocks before it (active gradient offloading).
3. Wait for the pipeline, fsync, commit: the next step reads the new slot.

Micro-batches are interleaved per block (all micro-batches of block i, then block i+1), so a
block's parameters are streamed once per step whatever the accumulation factor, and its gradient
is complete as soon as its backward finishes. The result equals a plain PyTorch loop that runs the
micro-batches one after the other (the accumulation order per parameter is the same).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import Tensor

from io_engine import AlignedBuffer
from lohan.config import EngineConfig, ModelConfig, get_model_config
from lohan.crashpoints import crashpoint
from lohan.models.adapter import BlockProgram, GPTBlocks
from lohan.models.gpt import GPT, block_generator, build_model, init_block_
from lohan.plan import pools
from lohan.plan.planner import check_gpu_budget, gpu_need
from lohan.plan.pools import (  # noqa: F401  (MemoryPlanError, resident_extra: importable from here as before)
    MemoryPlanError,
    PoolGeometry,
    keeps_all_grads,
    optimizer_chunk_elems,
    plan_host_memory,
    plan_resident,
    resident_extra,
)
from lohan.runtime.activations import ActivationManager
from lohan.runtime.device import Device, Timer, resolve_device
from lohan.runtime.heap import release_free_memory, reuse_heap
from lohan.runtime.offload import ClipGate, GradOffloader
from lohan.runtime.optim import AdamWHyper, decay_mask, lr_at
from lohan.runtime.parallel import (
    DataParallel,
    local_cuda_index,
    read_decision,
    shard_bounds,
    shard_decays,
    shard_layout,
)
from lohan.runtime.params import ParamStreamer
from lohan.store.dirlock import DirLock
from lohan.store.gradstash import GradStash
from lohan.store.integrity import StoreCorruptError, unit_bounds
from lohan.store.states import DTYPES, StateStore, StoreLayout, StoreStatus, block_views, plan_layout

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradients; the last good state is committed."""


def grad_dtype(cfg: EngineConfig, world: int = 1) -> torch.dtype:
    """dtype of the host gradient buffers: the planning layer's rule (`lohan.plan.pools.grad_dtype`: bf16 kept
    as it is with one micro-batch and one rank, fp32 otherwise) as a torch dtype."""
    return DTYPES[pools.grad_dtype(cfg.compute_dtype, cfg.micro_batches, world)]


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


class Engine:
    """Trains a block program whose states live in a StateStore on NVMe. Build with `lohan.init`."""

    def __init__(self, program: BlockProgram, cfg: EngineConfig, model_meta: dict,
                 init_block: Callable[[int], list[Tensor]],
                 flops_per_token: Callable[[int], float] | None = None,
                 resume: bool = False, overwrite: bool = False,
                 progress: Callable[[int, int], None] | None = None, dp: DataParallel | None = None) -> None:
        # data parallel (torchrun): the rank's own directories and share of the machine (parallel.py)
        self.dp = dp if dp is not None else DataParallel.detect()
        self.world = self.dp.world if self.dp else 1
        self._base_dirs = tuple(cfg.nvme)
        if self.dp:
            local = self.dp.local_world
            cfg = cfg.with_overrides(
                nvme=self.dp.rank_dirs(cfg.nvme), cpu_mem=cfg.cpu_mem // local,
                emulate_ssd_gbps=cfg.emulate_ssd_gbps / local if cfg.emulate_ssd_gbps else None)
        self.cfg = cfg
        self.program = program
        if cfg.heap_reuse:  # before the store is built: its temporaries are trimmed after the first step
            reuse_heap()
        gpu = self.dp is not None and resolve_device(cfg.device) == "cuda"
        # a rank's own GPU (the one parallel.init_from_env selected: by LOCAL_RANK, or the only one it sees)
        self.device = Device(f"cuda:{local_cuda_index(self.dp.local_rank, torch.cuda.device_count())}" if gpu
                             else cfg.device)
        self.compute_dtype = DTYPES[cfg.compute_dtype]
        self.flops_per_token = flops_per_token
        n = len(program.modules)
        self._owners = sorted({owner for i in range(n) for owner, _ in program.external_params(i)})
        self.layout = plan_layout(program.modules, program.names, cfg.compute_dtype, cfg.slots)  # whole blocks
        self.bounds = [shard_bounds(b, self.world) for b in self.layout.blocks]
        layout = shard_layout(self.layout, self.bounds, self.dp.rank) if self.dp else self.layout  # the store's
        self.grad_dtype = grad_dtype(cfg, self.world)
        geometry = pool_geometry(program, self.layout, layout if self.dp else None, self.bounds, self.world)
        # the machine's available memory, shared by the ranks on this host (resident_mem: auto)
        free = psutil.virtual_memory().available // (self.dp.local_world if self.dp else 1)
        # every pool below is budgeted at the plan's figure (lohan.plan.pools: the one model of host memory)
        self.host_memory = plan_host_memory(geometry, cfg, self.world, free, grad_size=self.grad_dtype.itemsize)
        self.memory_plan = self.host_memory.parts()
        dirs = list(cfg.nvme)
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        self._lock = DirLock(dirs)  # before anything in the directories is read or written
        try:
            if self.dp:
                init_block = _shard_init(init_block, self.layout, layout, self.bounds, self.dp.rank)
                decision = self._check_group(resume)
            self.store = _open_or_create(dirs, cfg, layout, model_meta, init_block, resume, overwrite, progress)
            if self.dp:
                self._join_group(decision)
        except BaseException:
            if hasattr(self, "store"):
                self.store.close()
            self._lock.release()
            raise
        volume = self.store.volume
        # page-locked only where buffers cross to or from a GPU (P16 in, gradients out): the optimizer records
        # never leave main memory, and page-locked memory is scarce
        pin = self.device.is_cuda
        plan = self.host_memory
        self.params_pool = volume.buffer_pool(plan.params, pin=pin)
        self.grads_pool = volume.buffer_pool(plan.grads + plan.tied_grads + plan.grad_stash, pin=pin)
        # the optimizer's share of the plan also holds the fp32 upcast scratch (plan.upcast), which the offloader
        # allocates itself: the record pool gets the records and the resident room
        self.records_pool = volume.buffer_pool(plan.records + plan.resident)
        self.streamer = ParamStreamer(self.store, self.params_pool, self.device, program.modules, self.layout,
                                      self.dp, self.bounds)
        self.decays = [shard_decays(full, own, decay_mask(m, cfg.no_decay))
                       for full, own, m in zip(self.layout.blocks, layout.blocks, program.modules)]
        grad_bytes = [self.grad_dtype.itemsize * b.numel for b in layout.blocks]
        # serial mode holds every gradient in its pool already: the stash keeps those very buffers (plan.stash_ram)
        self.stash = (GradStash(dirs, grad_bytes, self.grads_pool, plan.stash_ram, cfg.name, cfg.backend,
                                cfg.chunk_bytes, cfg.emulate_ssd_gbps) if keeps_all_grads(cfg) else None)
        resident = (plan_resident(layout, self.records_pool.budget_bytes, cfg.max_inflight_blocks,
                                  self.store.check_elems) if cfg.resident_records else [])
        self.offloader = GradOffloader(self.store, self.records_pool, cfg.mode, None, self.grad_dtype, self.decays,
                                       self.stash, resident, thread_init=self.device.bind_thread)
        self.streamer.before_read = self._await_tail
        self.activations = ActivationManager(
            cfg, program, self.device, lambda: self.device.autocast(self.compute_dtype),
            engine_pool_bytes=plan.total,
            model_label=str(model_meta.get("config", {}).get("name", model_meta.get("kind", "model"))),
            param_count=self.layout.param_count, p16_itemsize=self.store.p16_dtype.itemsize,
            flops_per_token=flops_per_token,
            # the share of the states kept in memory (a rank's of its shards: the same share of the model)
            resident_params=self.layout.param_count * sum(layout.blocks[i].numel for i in resident)
            // max(1, sum(b.numel for b in layout.blocks)))
        self.last_metrics: dict[str, Any] = {}
        self.gpu_plan: dict[str, int] | None = None  # the GPU memory plan checked at the first step
        self._broken: str | None = None
        self._last_coef: float | None = None  # the previous step's clip coefficient (clip_mode=auto guesses by it)
        self._deferred = False
        # the next step's forward, run while this step's optimizer pass finished (`step(next_batch=...)`)
        self._prepared: _Prepared | None = None
        self._scale: Tensor | None = None
        # the model's own parameter order, in which clip_grad_norm_ takes the global norm (None: block order)
        self._norm_order = program.param_order() if hasattr(program, "param_order") else None
        # a separate device, one micro-batch, gradients in their own dtype: nothing to sum, so no accumulator;
        # autograd's gradients go to the host as they are (GPU memory: gpu_need's "gradient accumulators")
        self._direct = (not self.device.is_host and cfg.micro_batches == 1
                        and self.store.p16_dtype == self.grad_dtype)
        self._closed = False
        self._trimmed = False  # memory.release_free_memory after the first step

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
            self._drop_prepared()
            log.error("step %d could not be made durable; the state committed at step %d stands", lost,
                      self.store.step)
            raise

    def _await_tail(self, slot: int) -> None:
        """Before the SSDs are read: a staged slot's last writes may still be in flight (write-behind)."""
        if not self.store.staged or slot != self.store.slot or self.offloader.tail_done.is_set():
            if self.offloader.tail_error is not None and self.store.staged and slot == self.store.slot:
                raise RuntimeError("a write of the last step's optimizer pass failed") from self.offloader.tail_error
            return
        if self.offloader.busy:  # the worker completes the tail before its pass
            self.offloader.tail_done.wait()
            if self.offloader.tail_error is not None:
                raise RuntimeError("a write of the last step's optimizer pass failed") from self.offloader.tail_error
        else:
            self.flush()

    def step(self, batch: tuple[Tensor, Tensor], next_batch: tuple[Tensor, Tensor] | None = None) -> float:
        """One training step on `batch` = (token ids, targets), both [batch, seq]; returns the mean loss.

        Phases: forward (block inputs and swapped activations kept), backward (each block's gradient
        goes to the optimizer pipeline as soon as it is complete, and its norm is taken), then the
        settlement: the global norm gives the clip coefficient (a speculative update that guessed wrong is
        redone from the previous slot), a step with a non-finite loss or gradient is skipped, the optimizer
        pass ends and the new slot is committed; on any failure, rollback to the last commit (which the step
        never touched with two slots).

        `next_batch`, the batch of the following step where the caller knows it: when this step's optimizer
        pass runs after backward (an update deferred until the gradient norm was known, or a redone one), it
        runs in forward order, and the next step's forward runs meanwhile on each block's new parameters as
        soon as its update is done; `step(next_batch)` then starts at its backward. The same bits either
        way, and this step is committed before `step` returns; with `write_behind` (such a pass, one process)
        the commit is staged and becomes durable during the next step's backward, once the pass's last
        writes are complete (or at `flush` / `close`).
        """
        if self._broken:
            raise RuntimeError(self._broken)
        idx, targets = self._check_batch(batch)
        t_start = time.perf_counter()
        io0 = self.store.volume.stats()
        wait0, hash0, gather0 = self.streamer.wait_s, self.streamer.hash_s, self.streamer.gather_s
        net0 = (self.dp.reduced_bytes, self.dp.gathered_bytes) if self.dp else (0, 0)
        self._reduce_wait_s = 0.0
        self.offloader.reset_stats()
        prepared = self._take_prepared(idx)
        self.device.reset_peak_memory()
        idx = self.device.put(idx)
        targets = self.device.put(targets)

        n = len(self.program.modules)
        step = self.store.step
        commit = self.store.commit_state
        hyper = AdamWHyper.from_config(self.cfg, lr_at(self.cfg, step))
        read_slot, write_slot = self.store.slot, self.store.next_slot()
        # forward visits blocks 0..n-2 (the head runs in backward), backward n-1..0
        visits = list(range(n - 1)) + list(range(n - 1, -1, -1))
        self._begin_loss_scale(commit)
        gate = self._gate()
        speculated = not gate.deferred and self.cfg.max_grad_norm > 0
        self._deferred = gate.deferred
        nxt = self._overlappable(idx, next_batch)
        follow = gate.deferred and nxt is not None  # the deferred pass in forward order, the next forward after it
        order = list(range(n)) if follow else list(range(n - 1, -1, -1))
        # write-behind: this step's last writes and commit complete during the next step's backward
        lazy = follow and self.cfg.write_behind and self.dp is None
        self.store.begin_step()
        self.streamer.invalidate(write_slot)  # this step rewrites that slot: its kept blocks go stale
        # the last step's staged commit is made durable on the worker, after its writes and before this pass's
        self.offloader.begin_step(commit.applied + 1, hyper, order, read_slot, write_slot, gate=gate,
                                  keep=speculated, provide=self.streamer.offer if follow else None, lazy=lazy,
                                  before=self.store.persist if self.store.staged else None)
        settle: dict[str, Any] = {}
        next_fwd_s = 0.0
        try:
            if prepared is not None:
                acts, fwd_t = prepared.acts, None
            else:
                acts, fwd_t = self._forward(visits, read_slot, idx)
            loss, bwd_t, norms = self._backward(visits, read_slot, acts, targets.chunk(self.cfg.micro_batches))
            t_tail = time.perf_counter()
            act_stats = self._end_backward(read_slot)
            if follow:
                self.streamer.expect(list(range(n)), lambda: self.offloader.failure)
            settle = self._settle(loss, norms, gate, speculated)
            next_fwd_s = self._finish_updates(settle, commit.applied + 1, hyper, read_slot, write_slot, follow, nxt)
            tail_s = max(0.0, time.perf_counter() - t_tail - next_fwd_s)
        except BaseException:
            self._rollback(step, read_slot)
            raise
        finally:
            self.offloader.release_kept()
        if self._prepared is None:
            self.streamer.release_all()
        scaler = self._end_loss_scale()
        if settle["skipped"]:
            self._skip(step, commit, loss, settle, scaler)
        else:
            try:
                self._commit(step + 1, write_slot, sums=self.offloader.sums_written(), updates=commit.applied + 1,
                             durable=not lazy, **scaler)
            except BaseException:  # the next forward ran on this slot's parameters: not to be used uncommitted
                self._drop_prepared()
                raise
        try:
            compute_s = (fwd_t.seconds() if fwd_t else 0.0) + bwd_t.seconds() + next_fwd_s
            self._record_metrics(step + 1, loss, idx.numel() * self.world, time.perf_counter() - t_start,
                                 compute_s, tail_s, io0, wait0, hash0, gather0, hyper.lr,
                                 idx.shape[1])
            self.last_metrics.update({k: v for k, v in settle.items() if k != "coef_t"})
            self.last_metrics["activations"] = act_stats
            if self.dp:  # what the ring collectives sent this step (and received as much)
                self.last_metrics["network_bytes"] = self.dp.network_bytes(self.dp.reduced_bytes - net0[0],
                                                                           self.dp.gathered_bytes - net0[1])
            self.last_metrics["next_forward_overlapped"] = self._prepared is not None
            if not self._trimmed:  # store building and the first step's profiling leave freed memory resident
                release_free_memory()
                self._trimmed = True
        except BaseException:  # (a Ctrl-C) a step that raises is not committed: a staged commit is taken back
            if lazy and self.store.staged:
                self.store.discard_staged()
                self._drop_prepared()
            raise
        return loss

    def _check_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """The rank's part of a batch: all of it in one process; data parallel, every rank is given the same
        (global) batch and takes its slice, rows [r*B/N, (r+1)*B/N), as one process's micro-batches are cut."""
        idx, targets = batch
        m_count = self.cfg.micro_batches
        if idx.shape != targets.shape or idx.dim() != 2:
            raise ValueError(f"batch must be (ids, targets) of equal shape [batch, seq]; got {tuple(idx.shape)} "
                             f"and {tuple(targets.shape)}")
        if self.world > 1 and idx.shape[0] % (m_count * self.world):
            raise ValueError(f"batch size {idx.shape[0]} is not divisible by micro_batches={m_count} x "
                             f"{self.world} ranks; every rank gets batch / {self.world} sequences")
        if idx.shape[0] % m_count:
            raise ValueError(f"batch size {idx.shape[0]} is not divisible by micro_batches={m_count}")
        if self.world > 1:
            rows = idx.shape[0] // self.world
            idx, targets = (t[self.dp.rank * rows:(self.dp.rank + 1) * rows] for t in (idx, targets))
        return idx, targets

    def _commit(self, step: int, slot: int, **kw: Any) -> None:
        """Commit `step` (data parallel: locally, keeping the previous commit, then the group decides)."""
        self.store.commit(step, slot, keep_prev=self.dp is not None, **kw)
        if self.dp:
            crashpoint("engine.dp_local_commit")
            self.dp.decide(self._base_dirs, self.cfg.name, step)

    def _overlappable(self, idx: Tensor, next_batch: tuple[Tensor, Tensor] | None) -> Tensor | None:
        """The next batch's ids on the device when its forward may run during this step's optimizer pass:
        two slots (the pass writes the other one), and the same shape (no new activation profile)."""
        if next_batch is None or self.cfg.slots < 2:
            return None
        nxt, _ = self._check_batch(next_batch)
        return self.device.put(nxt) if nxt.shape == idx.shape else None

    def _take_prepared(self, idx: Tensor) -> _Prepared | None:
        """The forward the previous step ran for this batch, if it ran one for these very ids. Another batch
        discards it (the resident parameters are the committed ones either way and stay)."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        if prepared.idx.shape == idx.shape and torch.equal(self.device.fetch(prepared.idx), idx):
            return prepared
        self.activations.end_step()
        return None

    def _drop_prepared(self) -> None:
        """Forget the next step's forward and what it holds (blocks, activations)."""
        if self._prepared is not None:
            self._prepared = None
            self.streamer.release_all()
            self.streamer.drop_kept()
            self.activations.end_step()

    def _end_backward(self, read_slot: int) -> dict[str, Any]:
        """After backward: the blocks of the slot read this step and the step's activations are done with
        (that slot is the next one written, so its blocks are not kept: they would take the room of the
        blocks the optimizer provides for the next forward)."""
        self.streamer.release_all()
        self.streamer.invalidate(read_slot)
        act_stats = self.activations.stats()
        self.activations.end_step()
        return act_stats

    def _finish_updates(self, settle: dict[str, Any], update: int, hyper: AdamWHyper, read_slot: int,
                        write_slot: int, follow: bool, nxt: Tensor | None) -> float:
        """End the step's optimizer pass: discarded (skipped step), completed (its updates ran during
        backward, or were deferred until now), or redone from the previous slot (speculated wrongly). A pass
        that runs now, in forward order, has the next batch's forward (`nxt`) run beside it, on the blocks
        it provides; returns that forward's compute seconds."""
        n = len(self.program.modules)
        if settle["skipped"]:
            self.offloader.abort()
            self.streamer.release_all()  # cancels what a deferred pass would have provided
            return 0.0
        self.offloader.backward_done()
        if settle["redone"]:
            self.offloader.finish()  # the speculative pass (coefficient 1) ends; its slot is rewritten below
            follow = nxt is not None
            order = list(range(n)) if follow else list(range(n - 1, -1, -1))
            if follow:
                self.streamer.expect(order, lambda: self.offloader.failure)
            self.offloader.begin_redo(update, hyper, order, read_slot, write_slot, settle["coef_t"],
                                      provide=self.streamer.offer if follow else None)
        fwd_t = None
        if follow:
            visits = list(range(n - 1)) + list(range(n - 1, -1, -1))
            acts, fwd_t = self._forward(visits, write_slot, nxt)
            self._prepared = _Prepared(nxt, acts)
        self.offloader.finish()
        return fwd_t.seconds() if fwd_t else 0.0

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
        self.flush()  # it reads the committed slot, whose last writes may still be in flight
        idx, targets = self._check_batch(batch)
        m_count = self.cfg.micro_batches
        xs = list(self.device.put(idx).chunk(m_count))
        tgt_mb = self.device.put(targets).chunk(m_count)
        slot, last = self.store.slot, len(self.program.modules) - 1
        visits = list(range(last + 1))
        losses = []
        try:
            with torch.no_grad(), self.device.autocast(self.compute_dtype):
                for p, i in enumerate(visits):
                    self._visit(visits, p, slot)
                    for o, _ in self.program.external_params(i):  # tied weights: the owner must be resident
                        self.streamer.acquire(o, slot)
                    for m in range(m_count):
                        if i == last:  # as step sums the loss: each micro-batch's mean / their count
                            losses.append(self.program.run(i, xs[m], tgt_mb[m]) / (m_count * self.world))
                        else:
                            xs[m] = self.program.run(i, xs[m], None)
                    self._leave(visits, p, slot)
            loss = self._host_sum(losses)
        finally:
            self.streamer.release_all()
        return self.dp.sum(loss) if self.dp else loss

    def _gate(self) -> ClipGate:
        """The step's coefficient gate: open at 1 (no clipping, or a speculated update), or deferred until
        the norm is known. In place (slots=1) nothing may be written before the step is known good."""
        cfg = self.cfg
        if cfg.slots == 1:
            return ClipGate(None)
        if cfg.max_grad_norm <= 0:
            return ClipGate(1.0)
        if cfg.clip_mode == "speculate" or (cfg.clip_mode == "auto" and self._last_coef == 1.0):
            return ClipGate(1.0)
        return ClipGate(None)

    def _settle(self, loss: float, norms: list[list[Tensor]], gate: ClipGate, speculated: bool) -> dict[str, Any]:
        """The step's global gradient norm, exactly as `clip_grad_norm_` computes it (per-parameter norms in
        the model's parameter order, then the norm of those), and what follows from it."""
        order = self._norm_order
        flat = [norms[i][k] for i, k in order] if order else [t for block in norms for t in block]
        # on the device, where the norms are (one synchronization a step: the host needs the norm)
        total = torch.linalg.vector_norm(torch.stack(flat), 2.0)
        coef_t = torch.tensor(1.0)
        if self.cfg.max_grad_norm > 0:
            coef_t = torch.clamp(self.cfg.max_grad_norm / (total + 1e-6), max=1.0)
        total, coef_t = (self.device.fetch(t) for t in (total, coef_t))  # the CPU optimizer takes a host tensor
        norm = float(total)
        scaled = {"loss_scale": float(self.device.fetch(self._scale))} if self._scale is not None else {}
        if not (math.isfinite(loss) and math.isfinite(norm)):
            overflow = (math.isfinite(loss) and self._scale is not None
                        and bool(self.device.fetch(self._found_inf).item()))
            return {"skipped": True, "overflow": overflow, "redone": False, "grad_norm": norm, "clip_coef": None,
                    "coef_t": None, **scaled}
        coef = float(coef_t)
        self._last_coef = coef
        if gate.deferred:
            gate.open(coef_t)
        return {"skipped": False, "overflow": False, "redone": speculated and coef != 1.0, "grad_norm": norm,
                "clip_coef": coef if self.cfg.max_grad_norm > 0 else None, "coef_t": coef_t, **scaled}

    def _begin_loss_scale(self, commit: Any) -> None:
        """fp16: the dynamic loss scale of this step, as GradScaler keeps it (0-d fp32 tensor), from the commit."""
        if self.cfg.compute_dtype != "fp16":
            self._scale = None
            return
        scale = torch.tensor(commit.loss_scale or self.cfg.loss_scale, dtype=torch.float32)
        # on the device where the gradients are unscaled: the device (one process), or the host (data parallel
        # reduces host buffers, then unscales them)
        put = self.device.put if self.dp is None else (lambda t: t)
        self._scale = put(scale)
        self._tracker = put(torch.tensor(commit.growth_tracker, dtype=torch.int32))
        self._inv_scale = put(scale.double().reciprocal().float())  # as GradScaler.unscale_ computes it
        self._found_inf = put(torch.zeros(1))

    def _end_loss_scale(self) -> dict[str, Any]:
        """fp16: GradScaler.update (halve after an overflow, double after growth_interval clean steps)."""
        if self._scale is None:
            return {}
        torch._amp_update_scale_(self._scale, self._tracker, self._found_inf, 2.0, 0.5,
                                 self.cfg.loss_scale_growth_interval)
        return {"loss_scale": float(self.device.fetch(self._scale)),
                "growth_tracker": int(self.device.fetch(self._tracker))}

    def _skip(self, step: int, commit: Any, loss: float, settle: dict[str, Any], scaler: dict[str, Any]) -> None:
        """A step with a non-finite loss or gradient: its batch is consumed, the states stay as they were. An
        fp16 overflow (finite loss, gradients too large for the scale) is GradScaler's ordinary skip: the
        scale was lowered, and it does not count as a bad step."""
        self.flush()  # the last step's staged commit (its pass ran, or failed, on the worker before this one)
        if settle.get("overflow"):
            self._commit(step + 1, commit.slot, sums=commit.sums, updates=commit.applied,
                         bad_streak=commit.bad_streak, **scaler)
            log.info("step %d: fp16 gradients overflowed; skipped, loss scale lowered to %s", step + 1,
                     scaler["loss_scale"])
            return
        streak = commit.bad_streak + 1
        self._commit(step + 1, commit.slot, sums=commit.sums, updates=commit.applied, bad_streak=streak, **scaler)
        log.warning("step %d skipped: loss %s, gradient norm %s are not finite (%d in a row); the states of the "
                    "last good update stand", step + 1, loss, settle["grad_norm"], streak)
        if streak >= self.cfg.max_bad_steps:
            raise NonFiniteError(
                f"{streak} steps in a row (up to step {step + 1}) had a non-finite loss or gradients (last: loss "
                f"{loss}, gradient norm {settle['grad_norm']}); stopping. The states of the last good update "
                f"({commit.applied} updates) are committed and intact. Lower the learning rate, check the data, or "
                "raise engine.max_bad_steps")

    def _forward(self, visits: list[int], read_slot: int, idx: Tensor) -> tuple[list[list[Tensor | None]], Timer]:
        """Blocks 0..n-2 under no_grad; returns what backward needs (block inputs, or nothing for blocks whose
        activations the manager holds) and the compute time (read at the end of the step)."""
        m_count = self.cfg.micro_batches
        n = len(self.program.modules)
        acts: list[list[Tensor | None]] = [[None] * m_count for _ in range(n)]
        acts[0] = list(idx.chunk(m_count))
        acts_mgr = self.activations
        timer = self.device.timer()
        for p in range(n - 1):
            i = visits[p]
            self._visit(visits, p, read_slot)
            with timer, torch.no_grad(), self.device.autocast(self.compute_dtype):
                if i == 1 and acts_mgr.needs_prepare(idx.shape[0], idx.shape[1]):
                    acts_mgr.prepare(acts[1][0], idx.shape[0], idx.shape[1])
                    self._check_gpu_memory(idx.shape[0], idx.shape[1])
                for m in range(m_count):
                    if i in acts_mgr.inner:
                        acts[i + 1][m] = acts_mgr.forward_block(i, m, acts[i][m])
                        acts[i][m] = None
                    else:
                        acts[i + 1][m] = self.program.run(i, acts[i][m], None)
            crashpoint("engine.forward")
            self._leave(visits, p, read_slot)
        acts_mgr.end_forward()
        return acts, timer

    def _check_gpu_memory(self, batch: int, seq: int) -> None:
        """Once the activation plan is known (the first step, or a new batch shape): refuse a run whose GPU memory
        plan (planner.gpu_need) exceeds what it may use, with the plan, before it runs out of memory at its
        biggest block hours in. What it may use: the device's free memory plus what this process's allocator
        holds already, or engine.gpu_mem if smaller; on the CPU or the simulated device, engine.gpu_mem when
        set (an emulated GPU)."""
        shape = getattr(self.program, "planning_config", None)
        budget = self.cfg.gpu_mem
        if self.device.is_cuda:
            free, _ = torch.cuda.mem_get_info(self.device.torch)
            usable = free + torch.cuda.memory_reserved(self.device.torch)
            budget = usable if budget is None else min(budget, usable)
        if shape is None or budget is None or self.activations.plan is None:
            return
        mcfg = shape()
        hw = self.activations.profile.hardware
        self.gpu_plan = gpu_need(mcfg, batch, seq, hw, self.cfg.compute_dtype, self.cfg.micro_batches,
                                 self.cfg.prefetch_depth, self.activations.plan.swap, self.world)
        check_gpu_budget(self.gpu_plan, budget, f"{mcfg.name} at batch {batch} x seq {seq} on {self.device.type}")

    def _backward(self, visits: list[int], read_slot: int, acts: list[list[Tensor | None]],
                  tgt_mb: tuple[Tensor, ...]) -> tuple[float, Timer, list[list[Tensor]]]:
        """Blocks n-1..0: recompute each with grad, accumulate its gradient over micro-batches on the device,
        copy it to a host buffer and hand it to the optimizer pipeline. Returns the mean loss, the compute
        time and each block's per-parameter gradient norms (block order; on the device in one process)."""
        last = len(self.program.modules) - 1
        grad_out: list[Tensor | None] = [None] * self.cfg.micro_batches
        borrowed: dict[tuple[int, int, int], Tensor] = {}
        self._timer = self.device.timer()
        self._losses: list[Tensor] = []
        norms: list[list[Tensor]] = [[] for _ in range(last + 1)]
        # gradients on their way to the optimizer: (block, host buffer, views, event or reduction) in order
        pending: list[tuple[int, AlignedBuffer, list[Tensor], Any]] = []
        try:
            for p in range(last, len(visits)):
                self._backward_block(visits, p, read_slot, acts, tgt_mb, grad_out, borrowed, norms, pending)
            while pending:
                self._hand_over(*pending.pop(0), norms)
        except BaseException:
            for _, gbuf, _, work in pending:  # copies and reductions still use them
                try:
                    work.wait() if self.dp else work.synchronize()
                finally:
                    gbuf.release()
            raise
        loss = self._host_sum(self._losses)
        if self.dp:
            loss = self.dp.sum(loss)
        return loss, self._timer, norms

    def _host_sum(self, losses: list[Tensor]) -> float:
        """The micro-batches' losses summed as Python floats, in order (one synchronization)."""
        if not losses:
            return 0.0
        return sum(self.device.fetch(torch.stack([t.detach().float() for t in losses])).tolist(), 0.0)

    def _backward_block(self, visits: list[int], p: int, read_slot: int, acts: list[list[Tensor | None]],
                        tgt_mb: tuple[Tensor, ...], grad_out: list[Tensor | None],
                        borrowed: dict[tuple[int, int, int], Tensor], norms: list[list[Tensor]],
                        pending: list) -> None:
        """Backward of the block at visit position p over the micro-batches. Its gradient is summed on the device
        (a flat accumulator, copied to the host buffer in one piece; or, with one micro-batch in the gradient's
        own dtype, autograd's gradients themselves, copied parameter by parameter), on the copy stream, and
        goes to the optimizer once the copy has completed (data parallel: once summed over the ranks), beside
        the next blocks' backward. The CPU device sums straight into the host buffer."""
        i = visits[p]
        params = self._visit(visits, p, read_slot)
        layout = self.layout.blocks[i]
        gsize = self.grad_dtype.itemsize
        gbuf = self.grads_pool.acquire(gsize * layout.numel)
        host = gbuf.tensor[:gsize * layout.numel].view(self.grad_dtype)
        flat = host if self.device.is_host else None if self._direct else self.device.empty(layout.numel,
                                                                                             self.grad_dtype)
        try:
            self.activations.prefetch(i - 1)
            with self._timer:
                grads = self._accumulate(i, params, None if flat is None else block_views(flat, layout), read_slot,
                                         acts, tgt_mb, grad_out, borrowed)
            self.activations.stage(i - 1)  # its records' copy to the device runs beside this block's compute
            if self.dp is None:
                self._unscale_and_norm(i, grads, norms)
            event = self.device.to_host(flat, host) if flat is not None else None
            for g, view in zip(grads if flat is None else (), block_views(host, layout)):
                event = self.device.to_host(g, view)  # in order on the copy stream: the last event covers all
        except BaseException:
            gbuf.release()
            raise
        if self.dp:  # the sum over the ranks runs on the host buffer, beside the next blocks' backward
            event.synchronize()
            pending.append((i, gbuf, block_views(host, layout), self.dp.all_reduce_async(host)))
        else:
            pending.append((i, gbuf, block_views(host, layout), event))
        # hand over every gradient whose copy (or sum) is complete, and never keep more than one waiting
        while pending and (len(pending) > 1 or (self.dp is None and pending[0][3].query())):
            self._hand_over(*pending.pop(0), norms)
        crashpoint("engine.backward")
        self._leave(visits, p, read_slot)

    def _accumulate(self, i: int, params: list[torch.nn.Parameter], acc: list[Tensor] | None, read_slot: int,
                    acts: list[list[Tensor | None]], tgt_mb: tuple[Tensor, ...], grad_out: list[Tensor | None],
                    borrowed: dict[tuple[int, int, int], Tensor]) -> list[Tensor]:
        """Recompute block i with grad for each micro-batch and sum its parameters' gradients into `acc`, in the
        order autograd sums a leaf's inputs (a tied user's contribution first, then micro-batch after
        micro-batch); returns `acc`. Without `acc` (one micro-batch): returns the gradients themselves, a tied
        user's contribution added. The micro-batches' losses (last block) stay on the device until the
        step's end."""
        final: list[Tensor] = acc if acc is not None else [None] * len(params)
        m_count = self.cfg.micro_batches
        last = len(self.program.modules) - 1
        ext = self.program.external_params(i)
        ext_params = [self.streamer.acquire(o, read_slot)[k] for o, k in ext]
        inner = i in self.activations.inner
        for m in range(m_count):
            if inner:
                x, run = self.activations.backward_block(i, m)
            else:
                x, run = acts[i][m], lambda z, i=i, m=m: self.program.run(i, z, tgt_mb[m] if i == last else None)
            if i > 0:
                x = x.detach().requires_grad_()
            with torch.enable_grad(), self.device.autocast(self.compute_dtype):
                out = run(x)
                if i == last:  # the mean over every micro-batch of every rank
                    out = out / (m_count * self.world)
            inputs = ([x] if i > 0 else []) + list(params) + ext_params
            # fp16: backward runs on loss x scale (GradScaler.scale), the gradients are unscaled below
            target = out * self._scale if i == last and self._scale is not None else out
            grads = torch.autograd.grad(target, inputs, grad_outputs=None if i == last else grad_out[m],
                                        allow_unused=True)
            if i == last:
                self._losses.append(out.detach())
            off = 1 if i > 0 else 0
            for k, g in enumerate(grads[off:off + len(params)]):
                other = borrowed.pop((i, k, m), None)
                if acc is not None:
                    _add_grad(acc[k], g, other, m)
                    continue
                g = torch.zeros_like(params[k]) if g is None else g.detach()
                # g + other, in the borrowed gradient's memory (IEEE addition commutes: the same bits)
                final[k] = g if other is None else other.add_(g)
            for (o, k), g in zip(ext, grads[off + len(params):]):
                if g is not None:
                    borrowed[(o, k, m)] = g.detach()
            grad_out[m] = grads[0] if i > 0 else None
            acts[i][m] = None
            if inner:
                del x, out, grads
                self.activations.release(i, m)
        return final

    def _unscale_and_norm(self, i: int, acc: list[Tensor], norms: list[list[Tensor]]) -> None:
        """fp16: unscale block i's gradient (GradScaler.unscale_: the same op, so the same bits and inf check);
        then its per-parameter norms, where the gradient is (no host synchronization)."""
        if self._scale is not None:
            torch._amp_foreach_non_finite_check_and_unscale_(acc, self._found_inf, self._inv_scale)
        norms[i] = _param_norms(acc)

    def _hand_over(self, i: int, gbuf: AlignedBuffer, acc: list[Tensor], work: Any,
                   norms: list[list[Tensor]]) -> None:
        """Block i's complete gradient in its host buffer (once its copy from the device is done; data parallel:
        once summed over the ranks, then unscaled (fp16) and normed here) goes to the optimizer pipeline: the
        rank's shard of it, or all of it for a replicated block."""
        t0 = time.perf_counter()
        try:
            work.wait() if self.dp else work.synchronize()
        except BaseException:
            gbuf.release()
            raise
        if self.dp:
            self._reduce_wait_s += time.perf_counter() - t0
            self._unscale_and_norm(i, acc, norms)
        bd = self.bounds[i]
        if bd is not None:
            gsize, lo, hi = self.grad_dtype.itemsize, bd[self.dp.rank], bd[self.dp.rank + 1]
            try:
                shard = self.grads_pool.acquire(gsize * (hi - lo))
                shard.tensor[:gsize * (hi - lo)].copy_(gbuf.tensor[gsize * lo:gsize * hi])
            finally:
                gbuf.release()
            gbuf = shard
        # a deferred update keeps the gradient in the stash (RAM, or the SSDs past the budget)
        self.offloader.submit(i, self.stash.put(i, gbuf) if self._deferred and self.stash else gbuf)

    def _rollback(self, step: int, read_slot: int) -> None:
        """After a failure inside a step: stop the pipeline and keep (re-commit) the last committed state."""
        self._prepared = None
        self.streamer.release_all()  # first: a pass providing the next forward's blocks may wait for room
        self.offloader.abort()
        self.streamer.release_all()
        self.streamer.drop_kept()
        self.activations.end_step()
        try:  # the last step's staged commit: durable if its writes completed, else dropped
            self.flush()
        except BaseException as e:
            log.warning("the step before the failed one was dropped too: %s", e)
        if self.store.layout.slots == 1 and self.offloader.blocks_written:
            self._broken = (f"step {step + 1} failed after rewriting {self.offloader.blocks_written} block(s) "
                            "in place (slots=1), so the states on NVMe are mixed; restore a checkpoint")
            return
        try:  # nothing current was touched: the last commit stands
            c = self.store.commit_state
            self.store.commit(c.step, c.slot, sums=c.sums, updates=c.applied, bad_streak=c.bad_streak,
                              loss_scale=c.loss_scale, growth_tracker=c.growth_tracker,  # fp16: as committed
                              keep_prev=self.dp is not None)  # (the other ranks may be gone: no decision)
        except BaseException as e:  # e.g. the disk that failed the step fails the fsync too
            log.warning("could not re-commit step %d after the failure (%s); the commit record on disk still "
                        "points at it", self.store.step, e)

    def _visit(self, visits: list[int], p: int, slot: int) -> list[torch.nn.Parameter]:
        """Acquire the block at visit position p and prefetch the next `prefetch_depth` visits."""
        params = self.streamer.acquire(visits[p], slot)
        for nxt in visits[p + 1:p + 1 + self.cfg.prefetch_depth]:
            self.streamer.prefetch(nxt, slot)
        # data parallel: the next block's shards gather beside this block's compute (it was prefetched just
        # now, so its buffer exists: without prefetching, taking one could wait for this block's)
        if self.dp and self.cfg.prefetch_depth and p + 1 < len(visits):
            self.streamer.gather_ahead(visits[p + 1], slot)
        return params

    def _leave(self, visits: list[int], p: int, slot: int) -> None:
        """Release the block just used unless it is borrowed from or needed again within the prefetch window,
        and start the next block's copy to the device: its compute was queued just now, so the copy runs
        beside it."""
        i = visits[p]
        if p + 1 < len(visits) and self.cfg.prefetch_depth:
            self.streamer.stage(visits[p + 1], slot)
        if i in self._owners and p < len(visits) - 1:
            return
        if i in visits[p + 1:p + 1 + self.cfg.prefetch_depth]:
            return
        self.streamer.release(i)

    def _record_metrics(self, step: int, loss: float, tokens: int, step_s: float, compute_s: float, tail_s: float,
                        io0: dict, wait0: float, hash0: float, gather0: float, lr: float, seq_len: int) -> None:
        io1 = self.store.volume.stats()

        def lane(direction: str) -> tuple[float, int]:
            busy = max(d1[direction]["busy_s"] - d0[direction]["busy_s"] for d0, d1 in zip(io0["devices"], io1["devices"]))
            return busy, io1[f"{direction}_bytes"] - io0[f"{direction}_bytes"]

        (read_s, read_b), (write_s, write_b) = lane("read"), lane("write")
        ago = self.offloader
        lanes = {"compute": compute_s, "ssd_read": read_s, "ssd_write": write_s, "cpu_adam": ago.adam_s,
                 "param_wait": self.streamer.wait_s - wait0, "optimizer_tail": tail_s,
                 # checksums: hashing on the optimizer thread (reads and writes) and of streamed P16
                 "checksum": ago.hash_s + self.streamer.hash_s - hash0}
        if self.dp:  # waits on the other ranks: P16 all-gathers, and gradient sums not done when needed
            lanes.update(gather=self.streamer.gather_s - gather0, reduce_wait=self._reduce_wait_s)
        bottleneck = max(lanes["compute"], lanes["ssd_read"], lanes["ssd_write"], lanes["cpu_adam"])
        # Model FLOPs (forward + backward = 3x forward); the recomputation is extra work, not counted.
        flops = 3 * self.flops_per_token(seq_len) * tokens if self.flops_per_token else None
        self.last_metrics = {
            "step": step, "loss": loss, "lr": lr, "tokens": tokens, "step_s": step_s,
            "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12 if flops else None,
            "ssd_read_gbps": read_b / step_s / 1e9, "ssd_write_gbps": write_b / step_s / 1e9,
            "ssd_read_bytes": read_b, "ssd_write_bytes": write_b,
            "overlap_efficiency": bottleneck / step_s, "lanes": lanes,
            "cpu_mem_gib": psutil.Process().memory_info().rss / 2**30,
            "gpu_mem_gib": self.device.max_memory_allocated() / 2**30 if self.device.is_cuda else None,  # the peak
            "max_resident_blocks": self.streamer.max_resident,
            # optimizer records kept in memory across steps, and the READs they saved this step
            "resident_records": len(ago.resident), "resident_record_hits": ago.resident_hits,
        }

    # -------------------------------------------------------------- access
    def state_dict_fp32(self) -> dict[str, Tensor]:
        """The current fp32 master weights as `{block_name.param_name: tensor}` (reads every block; data
        parallel: every rank calls it, and gets the whole model from the ranks' shards)."""
        self.flush()
        out = {}
        for b in self.layout.blocks:
            for spec, t in zip(b.params, self.read_params(b.index)):
                out[f"{b.name}.{spec.name}"] = t
        return out

    def read_params(self, block: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Block `block`'s fp32 master weights of the committed slot, whole (data parallel: gathered from
        the ranks' shards; every rank calls it for the same blocks in the same order)."""
        self.flush()
        own = self.store.read_params(block)
        bd = self.bounds[block]
        if bd is not None:
            size = bd[1] - bd[0]
            whole = torch.zeros(self.world * size, dtype=torch.float32)
            whole[self.dp.rank * size:self.dp.rank * size + sum(t.numel() for t in own)] = torch.cat(own)
            self.dp.all_gather_(whole, size)
            own = block_views(whole, self.layout.blocks[block])
        return [t.to(dtype) for t in own]

    @property
    def whole(self) -> Any:
        """What the exporters read (`.store.layout`, `.store.read_params(i)`, `.step_count`): the store
        itself in one process, the whole model gathered from the ranks' shards under data parallelism."""
        self.flush()
        return self if self.dp is None else _Whole(self)

    # -------------------------------------------------------- data parallel
    def _check_group(self, resume: bool) -> dict | None:
        """Before the rank opens its store: the group's commit decision (rank 0 reads it, every rank gets
        it), and what cannot be resumed by this group refused alike on every rank."""
        dp, base, name = self.dp, self._base_dirs, self.cfg.name
        problem, decision = None, None
        if dp.is_main:
            try:
                decision = read_decision(base, name)
                single = StateStore.status(list(base), name).state != "none"
            except (StoreCorruptError, ValueError, OSError) as e:
                problem = str(e)
            else:
                if resume and decision is not None and decision["world"] != dp.world:
                    problem = (f"{base[0]} holds the states of a run on {decision['world']} ranks, and this run has "
                               f"{dp.world}: resume it with {decision['world']} ranks in all (torchrun "
                               f"--nproc-per-node ...). Another world size would need the optimizer states re-sharded, "
                               "which lohan does not do; export the model and start a new run to change it")
                elif resume and decision is None and single:
                    problem = (f"{base[0]} holds the states of a single-process run; resume it without torchrun (one "
                               "process), or start a new run in another directory")
        problem, decision = dp.broadcast((problem, decision))
        if problem:
            raise ValueError(problem)
        return decision if resume else None

    def _join_group(self, decision: dict | None) -> None:
        """After the rank opened (or created) its store: bring it to the group's decided step, then record
        the decision for this group. A rank killed between the two phases of a commit is one step ahead:
        it goes back to its previous commit (that slot was not written since). Anything else is refused on
        every rank."""
        dp, commit = self.dp, self.store.commit_state
        target = decision["step"] if decision else 0
        problem = None
        if commit.step == target + 1 and commit.prev is not None and commit.prev["step"] == target:
            log.info("rank %d: going back from step %d to the group's committed step %d", dp.rank, commit.step, target)
            self.store.revert()
        elif commit.step != target:
            problem = (f"rank {dp.rank}'s store in {self.cfg.nvme[0]} is committed at step {commit.step}, the group's "
                       f"commit record ({self._base_dirs[0]}) at step {target}: the directories do not belong to "
                       "one run (another run's rank directories, or restored from different backups). Restore them "
                       "together, or start over with --overwrite")
        problems = [None] * dp.world
        dist.all_gather_object(problems, problem, group=dp.group)
        bad = [p for p in problems if p]
        if bad:
            raise StoreCorruptError("; ".join(bad))
        dp.decide(self._base_dirs, self.cfg.name, target)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._close()

    def _close(self) -> None:
        self._closed = True
        self._prepared = None
        self.offloader.close()  # its worker thread lives as long as the engine
        self.streamer.release_all()
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


class _Whole:
    """A data-parallel engine seen as one store of the whole model (for export: collective reads)."""

    def __init__(self, engine: Engine) -> None:
        self.store = self
        self.layout = engine.layout
        self.read_params = engine.read_params
        self.step_count = engine.step_count


@dataclass
class _Prepared:
    """A step's forward, run during the previous step's optimizer pass: the ids and what backward needs."""

    idx: Tensor
    acts: list[list[Tensor | None]]


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


def _add_grad(view: Tensor, g: Tensor | None, other: Tensor | None, m: int) -> None:
    """Sum micro-batch m's gradient `g` of one parameter (and `other`, a tied user's contribution to it, added
    first, as autograd sums a leaf's inputs) into the accumulator `view`, on the device."""
    if g is None:
        g = torch.zeros_like(view)
    if other is not None and m == 0 and g.dtype == other.dtype == view.dtype != torch.float16:
        torch.add(g, other, out=view)  # the same sum, without a temporary the size of the embedding
        return
    if other is not None:
        # fp16 gradients carry the loss scale: summed in fp32, as autograd sums the fp32 .grad
        # of an autocast model (an fp16 sum could overflow where GradScaler's does not)
        g = g.float() + other.float() if g.dtype == torch.float16 else g + other
    if m == 0:
        view.copy_(g)
    else:
        view.add_(g)


def _param_norms(grads: list[Tensor]) -> list[Tensor]:
    """Per-parameter L2 norms, as clip_grad_norm_ takes them (torch._foreach_norm on fp32 gradients; bf16
    ones are upcast first, so a bf16 buffer gives the same norms as an fp32 buffer of the same values)."""
    return list(torch._foreach_norm([g if g.dtype == torch.float32 else g.float() for g in grads], 2.0))


class StoreExistsError(FileExistsError):
    """The directories already hold a store (complete or half-built) and neither resume nor overwrite was asked."""

    def __init__(self, directory: str, status: StoreStatus) -> None:
        self.directory, self.status = directory, status
        what = "continue it" if status.state == "complete" else "continue its initialization"
        super().__init__(f"{directory} already holds {status.describe()}; pass resume=True to {what}, or "
                         "overwrite=True to start over (its contents are lost), or use another name/directory")


def _open_or_create(dirs: list[str], cfg: EngineConfig, layout: StoreLayout, model_meta: dict,
                    init_block: Callable[[int], list[Tensor]], resume: bool, overwrite: bool,
                    progress: Callable[[int, int], None] | None) -> StateStore:
    """Open the store in `dirs` (resume), continue its interrupted initialization (resume), or create it
    (nothing there, or overwrite). Anything else is refused: a store is never discarded silently."""
    status = StateStore.status(dirs, cfg.name)
    check_elems = optimizer_chunk_elems(layout, cfg)
    if status.state != "none" and not resume and not overwrite:
        raise StoreExistsError(dirs[0], status)
    if status.state in ("complete", "partial") and resume and status.model != model_meta:
        raise ValueError(f"the store in {dirs[0]} holds another model ({status.model}); cannot resume it with "
                         f"{model_meta}")
    if status.state == "complete" and resume:
        store = StateStore.open(dirs, cfg.backend, cfg.chunk_bytes, cfg.name, emulate_ssd_gbps=cfg.emulate_ssd_gbps)
        problem = None
        if store.layout != layout:
            problem = "was laid out for other settings (slots or compute_dtype differ)"
        elif any(unit_bounds(b.numel, store.check_elems) != unit_bounds(b.numel, check_elems) for b in layout.blocks):
            per_elem = 12 + layout.blocks[0].p16_itemsize
            problem = (f"was created with other optimizer chunks (resume with --set "
                       f"engine.opt_chunk_bytes={store.check_elems * per_elem})")
        if problem:
            store.close()
            raise ValueError(f"the store in {dirs[0]} {problem}; resume with the settings it was created with")
        return store
    if status.state == "partial" and resume:
        return StateStore.create(dirs, layout, model_meta, init_block, staging_budget=64 << 20, backend=cfg.backend,
                                 chunk_bytes=cfg.chunk_bytes, name=cfg.name, progress=progress,
                                 emulate_ssd_gbps=cfg.emulate_ssd_gbps, check_elems=check_elems,
                                 checksums=cfg.checksums)
    if status.state != "none":  # overwrite, or the slab files of a creation that stopped before its first block
        _remove_store(dirs, cfg.name)
    return StateStore.create(dirs, layout, model_meta, init_block, staging_budget=64 << 20, backend=cfg.backend,
                             chunk_bytes=cfg.chunk_bytes, name=cfg.name, progress=progress,
                             emulate_ssd_gbps=cfg.emulate_ssd_gbps, check_elems=check_elems, checksums=cfg.checksums)


STORE_SUFFIXES = (".dp.json", ".dp.json.tmp", ".slab", ".volume.json", ".volume.json.tmp", ".store.json", ".store.json.tmp", ".commit.json",
                  ".commit.json.tmp", ".init.json", ".init.json.tmp", ".run.json", ".run.json.tmp", ".profile.json",
                  "-act.slab", "-act.volume.json", "-grad.slab", "-grad.volume.json")


def _remove_store(dirs: list[str], name: str) -> None:
    for d in dirs:
        for suffix in STORE_SUFFIXES:
            path = os.path.join(d, f"{name}{suffix}")
            if os.path.exists(path):
                os.unlink(path)


def init(model: str | ModelConfig | GPT, config: EngineConfig | dict | None = None, *, resume: bool = False,
         overwrite: bool = False, progress: Callable[[int, int], None] | None = None, **overrides: Any) -> Engine:
    """Build an Engine for a preset name, a ModelConfig, or a GPT (meta or initialized).

    The model's states are laid out on the NVMe directories of `config` and initialized block by
    block (an initialized GPT's own weights are used; a preset or config is initialized from
    `config.seed`). Nothing else changes in the training loop: `loss = engine.step(batch)`.
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
        init_block_(tmp, mcfg, block_generator(cfg.seed, i))
        return [p.detach() for p in tmp.parameters()]

    meta = {"kind": "gpt", "config": asdict(mcfg), "seed": None if materialized else cfg.seed}
    engine = Engine(program, cfg, meta, init_block, flops_per_token=mcfg.flops_per_token, resume=resume,
                    overwrite=overwrite, progress=progress)
    if materialized:  # the weights now live in the store; free the caller's copy
        model.to_empty(device="meta")
    return engine
