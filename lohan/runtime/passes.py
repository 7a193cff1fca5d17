"""The passes over a block program that a step and an evaluation run: forward, backward and evaluation, block by
block, with the P16 blocks streamed in ahead of use and each block's gradient handed to the optimizer pipeline as
soon as it is complete (active gradient offloading, DESIGN.md §4.3).

Micro-batches are interleaved per block (all micro-batches of block i, then block i+1), so a block's parameters
are streamed once per step whatever the accumulation factor, and its gradient is complete as soon as its backward
finishes. The result equals a plain PyTorch loop that runs the micro-batches one after the other (the
accumulation order per parameter is the same).

`BlockPasses` holds the engine's components (it owns none of them) and no state across steps: what one step's
passes share (the loss scale, the gradients on their way, the compute timers) is in the step's `StepRun`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from io_engine import AlignedBuffer, BufferPool
from lohan.config import EngineConfig
from lohan.crashpoints import crashpoint
from lohan.models.adapter import BlockProgram
from lohan.plan.planner import check_gpu_budget, gpu_need
from lohan.runtime.activations import ActivationManager
from lohan.runtime.device import Device, Timer
from lohan.runtime.offload import GradOffloader
from lohan.runtime.parallel import Group
from lohan.runtime.param_grads import ParamGrads
from lohan.runtime.params import ParamStreamer
from lohan.store.gradstash import GradStash
from lohan.store.states import StoreLayout, block_views

if TYPE_CHECKING:
    from lohan.runtime.step import StepRun

Acts = list[list[Tensor | None]]
"""Per block, per micro-batch: the block's input kept for its backward (None: the activation manager holds what
the block needs, or it was used)."""


@dataclass
class Pending:
    """A block's gradient on its way to the optimizer: its host buffer, the buffer's per-parameter views, and what
    completes it (the copy's event from the device, or the all-reduce over the ranks)."""

    block: int
    buf: AlignedBuffer
    views: list[Tensor]
    work: Any  # its `wait()` and `query()` (`Group.reduce_gradient`)


def visit_order(n: int) -> list[int]:
    """A step's block visits: forward 0..n-2 (the head runs in backward), then backward n-1..0."""
    return list(range(n - 1)) + list(range(n - 1, -1, -1))


class BlockPasses:
    """Forward, backward and evaluation passes over a block program (module docstring)."""

    def __init__(self, cfg: EngineConfig, program: BlockProgram, layout: StoreLayout, device: Device,
                 compute_dtype: torch.dtype, streamer: ParamStreamer, activations: ActivationManager,
                 offloader: GradOffloader, grads_pool: BufferPool, grad_dtype: torch.dtype,
                 stash: GradStash | None, dp: Group, bounds: list[tuple[int, ...] | None],
                 direct: bool, hand_over: bool = False) -> None:
        self.cfg, self.program, self.layout, self.device = cfg, program, layout, device
        self.compute_dtype = compute_dtype
        self.streamer, self.activations, self.offloader = streamer, activations, offloader
        self.grads_pool, self.grad_dtype, self.stash = grads_pool, grad_dtype, stash
        self.dp, self.world, self.bounds = dp, dp.world, bounds
        # a separate device, one micro-batch, gradients in their own dtype: nothing to sum, so no accumulator;
        # autograd's gradients go to the host as they are (GPU memory: gpu_need's "gradient accumulators")
        self.direct = direct
        # the CPU computes: autograd's gradients go to the optimizer as they are, no host buffer and no copy into
        # one (`lohan.plan.pools.hands_over_grads`; the plan counts them where it counted the grads pool's buffers)
        self.hand_over = hand_over
        self.grad_copy_bytes = 0  # bytes of gradient copied into host gradient buffers (this engine's life)
        n = len(program.modules)
        self.owners = sorted({owner for i in range(n) for owner, _ in program.external_params(i)})
        self.gpu_plan: dict[str, int] | None = None  # the GPU memory plan checked at the first step

    # ---------------------------------------------------------------- forward
    def forward(self, visits: list[int], read_slot: int, idx: Tensor) -> tuple[Acts, Timer]:
        """Blocks 0..n-2 under no_grad; returns what backward needs (block inputs, or nothing for blocks whose
        activations the manager holds) and the compute time (read at the end of the step)."""
        m_count = self.cfg.execution.micro_batches
        n = len(self.program.modules)
        acts: Acts = [[None] * m_count for _ in range(n)]
        acts[0] = list(idx.chunk(m_count))
        acts_mgr = self.activations
        timer = self.device.timer()
        for p in range(n - 1):
            i = visits[p]
            self.visit(visits, p, read_slot)
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
            self.leave(visits, p, read_slot)
        acts_mgr.end_forward()
        return acts, timer

    def evaluate(self, slot: int, idx: Tensor, targets: Tensor) -> float:
        """Every block forward under no_grad on the slot's weights, the head included; returns the sum of the
        micro-batches' losses, each scaled as a step scales them (its mean / the micro-batch count / the world
        size). Every block is released at the end, whatever happens."""
        try:
            return self.host_sum(self._evaluate(slot, idx, targets))
        finally:
            self.streamer.release_all()

    def _evaluate(self, slot: int, idx: Tensor, targets: Tensor) -> list[Tensor]:
        m_count = self.cfg.execution.micro_batches
        xs = list(idx.chunk(m_count))
        tgt_mb = targets.chunk(m_count)
        last = len(self.program.modules) - 1
        visits = list(range(last + 1))
        losses = []
        with torch.no_grad(), self.device.autocast(self.compute_dtype):
            for p, i in enumerate(visits):
                self.visit(visits, p, slot)
                for o, _ in self.program.external_params(i):  # tied weights: the owner must be resident
                    self.streamer.acquire(o, slot)
                for m in range(m_count):
                    if i == last:
                        losses.append(self.program.run(i, xs[m], tgt_mb[m]) / (m_count * self.world))
                    else:
                        xs[m] = self.program.run(i, xs[m], None)
                self.leave(visits, p, slot)
        return losses

    def _check_gpu_memory(self, batch: int, seq: int) -> None:
        """Once the activation plan is known (the first step, or a new batch shape): refuse a run whose GPU memory
        plan (planner.gpu_need) exceeds what it may use, with the plan, before it runs out of memory at its
        biggest block hours in. What it may use: the device's free memory plus what this process's allocator
        holds already, or engine.gpu_mem if smaller; on the CPU or the simulated device, engine.gpu_mem when
        set (an emulated GPU)."""
        shape = getattr(self.program, "planning_config", None)
        budget = self.cfg.memory.gpu_mem
        if self.device.is_cuda:
            free, _ = torch.cuda.mem_get_info(self.device.torch)
            usable = free + torch.cuda.memory_reserved(self.device.torch)
            budget = usable if budget is None else min(budget, usable)
        if shape is None or budget is None or self.activations.plan is None:
            return
        mcfg = shape()
        hw = self.activations.profile.hardware
        self.gpu_plan = gpu_need(mcfg, batch, seq, hw, self.cfg.execution.compute_dtype, self.cfg.execution.micro_batches,
                                 self.cfg.memory.prefetch_depth, self.activations.plan.swap, self.world,
                                 measured=self.activations.profile)
        check_gpu_budget(self.gpu_plan, budget, f"{mcfg.name} at batch {batch} x seq {seq} on {self.device.type}")

    def end_backward(self, read_slot: int) -> dict[str, Any]:
        """After backward: the blocks of the slot read this step and the step's activations are done with
        (that slot is the next one written, so its blocks are not kept: they would take the room of the
        blocks the optimizer provides for the next forward). Returns the activation counters."""
        self.streamer.release_all()
        self.streamer.invalidate(read_slot)
        stats = self.activations.stats()
        self.activations.end_step()
        return stats

    # --------------------------------------------------------------- backward
    def backward(self, run: StepRun, acts: Acts, tgt_mb: tuple[Tensor, ...]) -> list[list[Tensor]]:
        """Blocks n-1..0: recompute each with grad, accumulate its gradient over micro-batches on the device,
        copy it to a host buffer and hand it to the optimizer pipeline. Keeps the micro-batches' losses and the
        compute time in `run`; returns each block's per-parameter gradient norms (block order; on the device in
        one process)."""
        visits, last = run.visits, len(self.program.modules) - 1
        grad_out: list[Tensor | None] = [None] * self.cfg.execution.micro_batches
        borrowed: dict[tuple[int, int, int], Tensor] = {}
        run.bwd_timer = self.device.timer()
        norms: list[list[Tensor]] = [[] for _ in range(last + 1)]
        pending: list[Pending] = []  # in block order
        try:
            for p in range(last, len(visits)):
                self._backward_block(run, p, acts, tgt_mb, grad_out, borrowed, norms, pending)
            while pending:
                self._hand_over(run, pending.pop(0), norms)
        except BaseException:
            for g in pending:  # copies and reductions still use them
                try:
                    g.work.wait()
                finally:
                    g.buf.release()
            raise
        return norms

    def _backward_block(self, run: StepRun, p: int, acts: Acts, tgt_mb: tuple[Tensor, ...],
                        grad_out: list[Tensor | None], borrowed: dict[tuple[int, int, int], Tensor],
                        norms: list[list[Tensor]], pending: list[Pending]) -> None:
        """Backward of the block at visit position p over the micro-batches. Its gradient is summed on the device
        (a flat accumulator, copied to the host buffer in one piece; or, with one micro-batch in the gradient's
        own dtype, autograd's gradients themselves, copied parameter by parameter), on the copy stream, and
        goes to the optimizer once the copy has completed (data parallel: once summed over the ranks), beside
        the next blocks' backward. The CPU device sums straight into the host buffer, or, where it hands autograd's
        gradients over as they are (`hand_over`), keeps none (`_hand_over_own`)."""
        i, slot = run.visits[p], run.plan.read_slot
        params = self.visit(run.visits, p, slot)
        if self.hand_over:
            self._hand_over_own(run, p, acts, tgt_mb, grad_out, borrowed, norms, params)
            return
        layout = self.layout.blocks[i]
        gsize = self.grad_dtype.itemsize
        gbuf = self.grads_pool.acquire(gsize * layout.numel)
        host = gbuf.tensor[:gsize * layout.numel].view(self.grad_dtype)
        flat = host if self.device.is_host else None if self.direct else self.device.empty(layout.numel,
                                                                                            self.grad_dtype)
        try:
            self.activations.prefetch(i - 1)
            with run.bwd_timer:
                grads = self._accumulate(run, i, params, None if flat is None else block_views(flat, layout),
                                         acts, tgt_mb, grad_out, borrowed)
            self.activations.stage(i - 1)  # its records' copy to the device runs beside this block's compute
            if self.dp.alone:  # the gradient is the group's sum already: normed where it is
                self._unscale_and_norm(run, i, grads, norms)
            event = self.device.to_host(flat, host) if flat is not None else None
            for g, view in zip(grads if flat is None else (), block_views(host, layout)):
                event = self.device.to_host(g, view)  # in order on the copy stream: the last event covers all
        except BaseException:
            gbuf.release()
            raise
        self.grad_copy_bytes += gsize * layout.numel
        # data parallel: the sum over the ranks runs on the host buffer, beside the next blocks' backward
        pending.append(Pending(i, gbuf, block_views(host, layout), self.dp.reduce_gradient(host, event)))
        # released before its gradient goes to the optimizer: an update during backward hands the block's new
        # P16 over in the buffer this frees (ParamStreamer.handover), and may reach block i at once
        self.leave(run.visits, p, slot)
        # hand over every gradient whose copy (or sum) is complete, and never keep more than one waiting
        while pending and (len(pending) > 1 or pending[0].work.query()):
            self._hand_over(run, pending.pop(0), norms)
        crashpoint("engine.backward")

    def _hand_over_own(self, run: StepRun, p: int, acts: Acts, tgt_mb: tuple[Tensor, ...],
                       grad_out: list[Tensor | None], borrowed: dict[tuple[int, int, int], Tensor],
                       norms: list[list[Tensor]], params: list[torch.nn.Parameter]) -> None:
        """`_backward_block` where the CPU computes and hands autograd's gradients over as they are (`hand_over`):
        the block's gradient goes to the optimizer at once, with no host buffer between (one micro-batch, one
        process)."""
        i, slot = run.visits[p], run.plan.read_slot
        self.activations.prefetch(i - 1)
        with run.bwd_timer:
            grads = self._accumulate(run, i, params, None, acts, tgt_mb, grad_out, borrowed)
        self.activations.stage(i - 1)
        self._unscale_and_norm(run, i, grads, norms)
        own, copied = ParamGrads.of(grads, [q.offset for q in self.layout.blocks[i].params], self.grad_dtype)
        del grads
        self.grad_copy_bytes += copied
        self.leave(run.visits, p, slot)  # (before the hand-over, as `_backward_block`'s: its P16 buffer is free)
        self.offloader.submit(i, self.stash.put(i, own) if run.plan.deferred and self.stash else own)
        crashpoint("engine.backward")

    def _accumulate(self, run: StepRun, i: int, params: list[torch.nn.Parameter], acc: list[Tensor] | None,
                    acts: Acts, tgt_mb: tuple[Tensor, ...], grad_out: list[Tensor | None],
                    borrowed: dict[tuple[int, int, int], Tensor]) -> list[Tensor]:
        """Recompute block i with grad for each micro-batch and sum its parameters' gradients into `acc`, in the
        order autograd sums a leaf's inputs (a tied user's contribution first, then micro-batch after
        micro-batch); returns `acc`. Without `acc` (one micro-batch): returns the gradients themselves, a tied
        user's contribution added. The micro-batches' losses (last block) stay on the device until the
        step's end."""
        final: list[Tensor] = acc if acc is not None else [None] * len(params)
        m_count = self.cfg.execution.micro_batches
        last = len(self.program.modules) - 1
        ext = self.program.external_params(i)
        ext_params = [self.streamer.acquire(o, run.plan.read_slot)[k] for o, k in ext]
        inner = i in self.activations.inner
        scale = run.scaler.scale if run.scaler else None
        for m in range(m_count):
            if inner:
                x, fn = self.activations.backward_block(i, m)
            else:
                x, fn = acts[i][m], lambda z, i=i, m=m: self.program.run(i, z, tgt_mb[m] if i == last else None)
            if i > 0:
                x = x.detach().requires_grad_()
            with torch.enable_grad(), self.device.autocast(self.compute_dtype):
                out = fn(x)
                if i == last:  # the mean over every micro-batch of every rank
                    out = out / (m_count * self.world)
            inputs = ([x] if i > 0 else []) + list(params) + ext_params
            # fp16: backward runs on loss x scale (GradScaler.scale), the gradients are unscaled below
            target = out * scale if i == last and scale is not None else out
            grads = torch.autograd.grad(target, inputs, grad_outputs=None if i == last else grad_out[m],
                                        allow_unused=True)
            if i == last:
                run.losses.append(out.detach())
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

    def _unscale_and_norm(self, run: StepRun, i: int, acc: list[Tensor], norms: list[list[Tensor]]) -> None:
        """fp16: unscale block i's gradient (GradScaler.unscale_: the same op, so the same bits and inf check);
        then its per-parameter norms, where the gradient is (no host synchronization)."""
        if run.scaler is not None:
            run.scaler.unscale_(acc)
        norms[i] = _param_norms(acc)

    def _hand_over(self, run: StepRun, g: Pending, norms: list[list[Tensor]]) -> None:
        """Block i's complete gradient in its host buffer (once its copy from the device is done; data parallel:
        once summed over the ranks, then unscaled (fp16) and normed here) goes to the optimizer pipeline: the
        rank's shard of it, or all of it for a replicated block."""
        t0 = time.perf_counter()
        gbuf = g.buf
        try:
            g.work.wait()
        except BaseException:
            gbuf.release()
            raise
        if not self.dp.alone:  # summed over the ranks just now: unscaled and normed here
            run.reduce_wait_s += time.perf_counter() - t0
            self._unscale_and_norm(run, g.block, g.views, norms)
        bd = self.bounds[g.block]
        if bd is not None:
            gsize, lo, hi = self.grad_dtype.itemsize, bd[self.dp.rank], bd[self.dp.rank + 1]
            try:
                shard = self.grads_pool.acquire(gsize * (hi - lo))
                shard.tensor[:gsize * (hi - lo)].copy_(gbuf.tensor[gsize * lo:gsize * hi])
            finally:
                gbuf.release()
            gbuf = shard
        # a deferred update keeps the gradient in the stash (RAM, or the SSDs past the budget)
        self.offloader.submit(g.block, self.stash.put(g.block, gbuf) if run.plan.deferred and self.stash else gbuf)

    # --------------------------------------------------------------- streaming
    def visit(self, visits: list[int], p: int, slot: int) -> list[torch.nn.Parameter]:
        """Acquire the block at visit position p and prefetch the next `prefetch_depth` visits."""
        params = self.streamer.acquire(visits[p], slot)
        for nxt in visits[p + 1:p + 1 + self.cfg.memory.prefetch_depth]:
            self.streamer.prefetch(nxt, slot)
        # data parallel: the next block's shards gather beside this block's compute (it was prefetched just
        # now, so its buffer exists: without prefetching, taking one could wait for this block's)
        if self.cfg.memory.prefetch_depth and p + 1 < len(visits):
            self.streamer.gather_ahead(visits[p + 1], slot)
        return params

    def leave(self, visits: list[int], p: int, slot: int) -> None:
        """Release the block just used unless it is borrowed from or needed again within the prefetch window,
        and start the next block's copy to the device: its compute was queued just now, so the copy runs
        beside it."""
        i = visits[p]
        if p + 1 < len(visits) and self.cfg.memory.prefetch_depth:
            self.streamer.stage(visits[p + 1], slot)
        if i in self.owners and p < len(visits) - 1:
            return
        if i in visits[p + 1:p + 1 + self.cfg.memory.prefetch_depth]:
            return
        self.streamer.release(i)

    def host_sum(self, losses: list[Tensor]) -> float:
        """The micro-batches' losses summed as Python floats, in order (one synchronization)."""
        if not losses:
            return 0.0
        return sum(self.device.fetch(torch.stack([t.detach().float() for t in losses])).tolist(), 0.0)


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
    ones are taken in fp32, so a bf16 buffer gives the same norms as an fp32 buffer of the same values).
    ``dtype=float32`` gives the bits of an upcast list without making one: upcasting the whole block first held
    4 bytes per parameter of it at once (7.25 GB for a 175b-shaped layer); on the CPU at most its largest
    parameter is upcast at a time (`plan.pools.device_grad_bytes`), on CUDA none."""
    return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))

