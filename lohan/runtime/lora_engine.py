"""LoRA on frozen weights streamed from the SSDs (issue 41): `LoraEngine`, the engine of a ``--lora R`` run.

How a LoRA run maps onto lohan's engine
---------------------------------------
*Base weights.* The store holds the model once, in the ``frozen`` state format (`lohan.plan.formats`): a record
is the P16 alone (the compute dtype's copy: bf16, or fp32 in an fp32 run), no master, no moments, one slot. It is
written by the import (`StateStore.create`, block by block, checksummed, resumable as today) and never again: the
engine never begins, commits or writes a step in it. Its checksums, in its commit record, are verified on every
read as in full fine-tuning (`ParamStreamer`), and a resume checks that the adapters were trained on this very
base (its identity and checksums are committed with them).

*Streaming.* The blocks are the full fine-tuning's ([embed, layer 0..L-1, head]) and are streamed by the same
`ParamStreamer` (prefetch `prefetch_depth` ahead, copy to the device beside the previous block's compute),
forward then backward with recomputation, with the same activation plan (`ActivationManager`: block inputs and
swapped ops on the device, in RAM or on the SSDs; int8 records), made on a LoRA step's profile (`LoraActivations`:
no optimizer traffic, no weight gradient). On a host device whose memory holds the whole base and the step's
activations, nothing is recomputed: the forward keeps its graphs for backward as a PEFT run does
(`lohan.runtime.lora_graphs`). As the slot is never rewritten, a released block
is *kept* in the parameter pool across forward, backward and the next step while the pool has room (`cpu_mem`):
a base that fits it is read from the SSDs once. The backward skips the embedding (it has no adapter and takes no
gradient); the head's backward only carries the gradient down.

*Adapters.* `lohan.models.lora.LoraAdapters` hooks the targeted projections of the decoder layers with PEFT's
ops; the adapters (fp32 A and B) and their AdamW states live on the compute device (they are small: rank r
over the projections' widths, ~0.1-1% of the model). Backward asks autograd for the block input's and the block's
adapters' gradients only: no gradient of a base weight is ever computed or copied (its parameters are bound with
``requires_grad=False``). Each block's adapter gradients are summed over the micro-batches as autograd sums a leaf's
(`p.grad`), then `torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW` — the very classes a PEFT run calls,
on the same tensors in the same order — update them: bit-exact with PEFT + `torch.optim.AdamW` in fp32 (tested).
No CPU AdamW over the base, no gradient offloading, no optimizer traffic to the SSDs.

*Crash consistency.* After every step the adapters, their AdamW states, the step count and the settings are
written beside the store's records into the slot of the step (`lohan.runtime.lora_commit`: two slot files
written alternately in place, each record checksummed, one fsync a step): the commit of a LoRA step. A kill at any
moment leaves the last committed step (a slot torn by it is known by its checksum, and the other one holds the
step before); `--resume` reloads it and continues bit-identically (the data position is the run's, `.run.json`,
keyed by the step).

LoRA dropout (``lora_dropout`` > 0): PEFT's, each mask drawn from a generator seeded by (seed, step, micro-batch,
block, target) (`lohan.models.lora.mask_seed`), so a recomputed block draws its forward's masks again and a resumed
run those of the run it continues; off in `evaluate`.

fp16 runs with GradScaler's dynamic loss scale (`step.LossScale`, the full engine's), committed with the adapters.

Data parallel (torchrun): every rank keeps a whole base in its own directories and the same adapters; the
adapters' gradients are summed over the ranks (one flat buffer) before the identical updates; each rank commits
its own adapters, keeping the commit before, and a resume takes the group's latest common step.

The dry run and the pre-flight price a LoRA step with `lohan.plan.lora`. Not yet: adapters kept in main memory
when they do not fit the device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import psutil
import torch
from torch import Tensor

from io_engine.base import align_up
from lohan.config import EngineConfig
from lohan.crashpoints import crashpoint
from lohan.models.adapter import BlockProgram
from lohan.models.lora import LoraAdapters
from lohan.plan.pools import optimizer_chunk_elems
from lohan.runtime.device import Device, compute_dtype_choice
from lohan.runtime.gc_policy import StepGc
from lohan.runtime.lora_commit import base_identity, commits, latest_commit, read_commit, write_commit
from lohan.runtime.lora_graphs import GraphKeeper, Graphs, LoraActivations
from lohan.runtime.optim import lr_at
from lohan.runtime.parallel import current_group
from lohan.runtime.params import ParamStreamer
from lohan.runtime.passes import Acts, BlockPasses
from lohan.runtime.step import LossScale, NonFiniteError, StepStats, commit_note, rank_batch, stats_from_note
from lohan.runtime.summary import EngineSummary, engine_summary
from lohan.store.integrity import StoreCorruptError
from lohan.store.opening import stored_compute_dtype
from lohan.store.states import DTYPES, plan_layout

log = logging.getLogger(__name__)

def lora_settings(cfg: EngineConfig) -> dict[str, Any]:
    """What fixes a LoRA run's adapters (committed with them; a resume must ask for the same)."""
    return {"r": int(cfg.lora.lora_r), "alpha": float(cfg.lora.lora_alpha), "dropout": float(cfg.lora.lora_dropout),
            "targets": list(cfg.lora.lora_targets)}


class LoraEngine:
    """Trains LoRA adapters over a frozen base streamed from the SSDs (module docstring). Built like `Engine`, with
    `cfg.lora_r` > 0; `step(batch)` returns the mean loss."""

    def __init__(self, program: BlockProgram, cfg: EngineConfig, model_meta: dict,
                 init_block: Callable[[int], list[Tensor]],
                 flops_per_token: Callable[[int], float] | None = None,
                 resume: bool = False, overwrite: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> None:
        from lohan.runtime.engine import _open_store  # (the full engine's: lock, refusals, open or create)

        _refuse(cfg)
        self.program, self.flops_per_token = program, flops_per_token
        # data parallel (torchrun): every rank streams a whole base of its own (its rank<r> directories) and keeps
        # the same adapters; their gradients are summed over the ranks before the update
        self.dp = current_group()
        self.world = self.dp.world
        base_dirs = tuple(cfg.store.nvme)
        cfg = self.dp.rank_config(cfg)
        self.device = Device(self.dp.device_name(cfg.execution.device), sim_gpu=cfg.execution.sim_gpu)
        stored = stored_compute_dtype(cfg.store.nvme, cfg.store.name) if resume and cfg.execution.compute_dtype == "auto" else None
        self.dtype_choice = compute_dtype_choice(cfg.execution.compute_dtype, self.device.type, "exact", stored)
        self.cfg = cfg = cfg.with_overrides(compute_dtype=self.dtype_choice.dtype, slots=1)
        self.compute_dtype = DTYPES[cfg.execution.compute_dtype]
        self.layout = plan_layout(program.modules, program.names, cfg.execution.compute_dtype, 1, "frozen")
        n = len(program.modules)
        self.bounds: list[tuple[int, ...] | None] = [None] * n
        self.store, self._lock = _open_store(cfg, self.layout, model_meta, init_block, resume, overwrite, progress,
                                             self.dp, base_dirs, optimizer_chunk_elems(self.layout, cfg))
        self._closed = False
        try:
            self._build(str(model_meta.get("config", {}).get("name", model_meta.get("kind", "model"))))
            self._fresh()
            if resume:
                self._resume()
        except BaseException:
            self._close()
            raise
        self.last_stats: StepStats | None = None
        self._gc = StepGc(cfg.execution.gc_every)  # Python's collections at step ends, not mid-step (gc_policy.py)

    def _fresh(self) -> None:
        """The adapters as initialized (PEFT's init, seeded), hooked; a new AdamW over them; the counters at 0."""
        if hasattr(self, "lora"):
            self.lora.detach()
        cfg = self.cfg
        self.lora = LoraAdapters(self.program.modules, cfg.lora.lora_r, cfg.lora.lora_alpha, cfg.lora.lora_targets, cfg.execution.seed,
                                 self.device.put, cfg.lora.lora_dropout)
        self.lora.attach()
        self.optimizer = torch.optim.AdamW(self.lora.params, lr=cfg.schedule.lr, betas=tuple(cfg.schedule.betas), eps=cfg.schedule.eps,
                                           weight_decay=cfg.schedule.weight_decay)
        self._step, self._bad_streak, self._note, self._committed = 0, 0, None, 0
        self._scale: dict[str, Any] = {}  # fp16: the loss scale and growth tracker of the last commit

    def _build(self, label: str) -> None:
        """The parameter pool (the whole base where `cpu_mem` holds it, so it is read once; at least the blocks in
        flight), the streamer, the activation manager and the block passes."""
        cfg, layout = self.cfg, self.layout
        biggest = align_up(max(b.p16_bytes for b in layout.blocks))
        in_flight = (cfg.memory.prefetch_depth + 3) * biggest  # the block computing, the tied owner, the prefetched ones
        # (buffers are aligned: the whole base takes its blocks' aligned sizes)
        whole = sum(align_up(b.p16_bytes) for b in layout.blocks)
        pool_bytes = max(in_flight, min(int(cfg.memory.cpu_mem), whole + biggest))
        self.params_pool = self.store.volume.buffer_pool(pool_bytes, pin=self.device.is_cuda)
        self.streamer = ParamStreamer(self.store, self.params_pool, self.device, self.program.modules, layout)
        self.streamer.frozen = self.streamer.keeps = True
        total = sum(b.p16_bytes for b in layout.blocks)
        self.activations = LoraActivations(
            cfg, self.program, self.device, lambda: self.device.autocast(self.compute_dtype),
            engine_pool_bytes=pool_bytes, model_label=label, param_count=layout.param_count,
            p16_itemsize=self.store.p16_dtype.itemsize, flops_per_token=self.flops_per_token,
            kept_p16_fraction=min(1.0, pool_bytes / max(1, total)))
        self.passes = BlockPasses(cfg, self.program, layout, self.device, self.compute_dtype, self.streamer,
                                  self.activations, None, None, torch.float32, None, self.dp, self.bounds,
                                  direct=False)
        self.graphs = GraphKeeper(cfg, self.program, self.device, self.compute_dtype, self.streamer, self.passes,
                                  self.activations)
        # dropout: the masks are drawn for the micro-batch each block runs on (`LoraAdapters.micro_batch`)
        self.activations.micro_batch = self.graphs.micro_batch = self._micro_batch

    def _micro_batch(self, m: int) -> None:
        """Block runs from now on are on micro-batch `m` of this rank (of the step's over every rank: masks)."""
        self.lora.micro_batch = self.dp.rank * self.cfg.execution.micro_batches + m

    # ------------------------------------------------------------------ step
    @property
    def step_count(self) -> int:
        """Optimizer steps completed and committed."""
        return self._step

    @property
    def committed_step(self) -> int:
        """The step a process killed now would resume from (every step is committed before `step` returns, unless
        its commit failed)."""
        return self._committed

    def step(self, batch: tuple[Tensor, Tensor], next_batch: tuple[Tensor, Tensor] | None = None) -> float:
        """One step on `batch` = (token ids, targets) [batch, seq]: forward, backward (adapter gradients only),
        clipping and AdamW on the adapters, then the commit. Returns the mean loss. A step whose loss or adapter
        gradients are not finite is skipped (the adapters stay as they were); `max_bad_steps` in a row stop the
        run. fp16: the loss is scaled as `torch.amp.GradScaler` scales it, a step whose scaled gradients overflow is
        skipped and the scale lowered (not a bad step). `next_batch` is accepted for `Engine`'s signature; nothing
        overlaps the tiny update."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        t0, io0, wait0 = time.perf_counter(), self.store.volume.stats(), self.streamer.wait_s
        hash0 = self.streamer.hash_s
        idx, targets = self._rank_batch(batch)
        idx, targets = self.device.put(idx), self.device.put(targets)
        n = len(self.program.modules)
        self.lora.step, self.lora.training = self._step, True  # (what the dropout masks are drawn for)
        # the embedding's backward would compute nothing (no adapter, no gradient to pass on): not visited
        visits = list(range(n - 1)) + list(range(n - 1, 0, -1))
        self.optimizer.zero_grad(set_to_none=True)
        self.device.reset_peak_memory()
        scaler = None
        if self.cfg.execution.compute_dtype == "fp16":  # GradScaler's state, from the last commit (`LossScale`)
            scaler = LossScale(self.cfg, SimpleNamespace(loss_scale=self._scale.get("loss_scale"),
                                                         growth_tracker=self._scale.get("growth_tracker", 0)),
                               self.device.put)
        try:
            graphs: Graphs = {}
            if self.graphs.decide(idx, self.lora.params):  # PEFT's way where everything fits: no block recomputed (`lora_graphs`)
                acts, graphs, fwd_timer = self.graphs.forward(visits, idx)
            else:
                acts, fwd_timer = self.passes.forward(visits, 0, idx)
            self._bwd_timer = self.device.timer()
            losses = self._backward(visits, acts, graphs, targets.chunk(self.cfg.execution.micro_batches), scaler)
            # the mean over every rank's micro-batches, and the adapters' gradients summed (one process: as they are)
            loss = self.dp.sum(self.passes.host_sum(losses))
            self.dp.sum_gradients(self.lora.params, self.device)
            acts_stats = self.graphs.stats() if self.graphs.keep else self.activations.stats()
        finally:
            self.streamer.release_all()
            self.activations.end_step()
        lr = lr_at(self.cfg, self._step)
        t_opt = time.perf_counter()
        ran_with = float(self.device.fetch(scaler.scale)) if scaler is not None else None
        try:  # from the update on, a failure takes the engine back to the last commit (`_restore`)
            norm, coef, skipped, overflow = self._update(loss, scaler)
            if scaler is not None:
                self._scale = scaler.update(self.device)
            lanes = {"gpu": fwd_timer.seconds() + self._bwd_timer.seconds(), "adam": time.perf_counter() - t_opt,
                     "param_wait": self.streamer.wait_s - wait0, "checksum": self.streamer.hash_s - hash0}
            stats = dataclasses.replace(self._stats(idx, loss, lr, t0, io0, lanes, acts_stats, norm, coef, skipped),
                                        overflow=overflow, loss_scale=ran_with)
            self._commit(commit_note(stats))
        except BaseException:
            self._restore()
            raise
        self.last_stats = dataclasses.replace(stats, step_s=time.perf_counter() - t0)
        if self._bad_streak >= self.cfg.stability.max_bad_steps:  # (the skip is committed first, as `Engine` commits it)
            raise NonFiniteError(f"{self._bad_streak} steps in a row had a non-finite loss or gradient (the last at "
                                 f"step {self._step}); the adapters of step {self._step - self._bad_streak} stand. "
                                 "Lower --lr or check the data")
        self._gc.step_done()
        return loss

    def _stats(self, idx: Tensor, loss: float, lr: float, t0: float, io0: dict, lanes: dict[str, float],
               acts: dict[str, Any], norm: float | None, coef: float | None, skipped: bool) -> StepStats:
        """The step's `StepStats` (what the run's metrics and log line read), from the counters now and at its
        start. The SSDs only read (the base's P16); nothing is written to them but the adapters' commit."""
        io1 = self.store.volume.stats()
        read_s = max((d1["read"]["busy_s"] - d0["read"]["busy_s"] for d0, d1 in zip(io0["devices"], io1["devices"])),
                     default=0.0)
        tokens, fpt = idx.numel() * self.world, self.flops_per_token  # (every rank's)
        return StepStats(
            step=self._step, loss=loss, lr=lr, tokens=tokens, step_s=time.perf_counter() - t0,
            flops=3 * fpt(idx.shape[1]) * tokens if fpt else None,
            ssd_read_bytes=io1["read_bytes"] - io0["read_bytes"], ssd_write_bytes=0,
            lanes={**lanes, "ssd": read_s, "ssd_read": read_s, "ssd_write": 0.0, "cpu": 0.0},
            cpu_mem_bytes=psutil.Process().memory_info().rss,
            gpu_mem_bytes=self.device.max_memory_allocated() if self.device.is_cuda else None,
            max_resident_blocks=self.streamer.max_resident, resident_records=0, resident_record_hits=0,
            activations=acts, next_forward_overlapped=False, deferred=False, grad_norm=norm, clip_coef=coef,
            skipped=skipped)

    def _backward(self, visits: list[int], acts: Acts, graphs: Graphs, tgt_mb: tuple[Tensor, ...],
                  scaler: LossScale | None) -> list[Tensor]:
        """Blocks n-1..1, each recomputed with grad per micro-batch (or its forward's graph taken from `graphs`);
        autograd is asked for the block input's gradient and the block's adapters' (summed into their `.grad` as
        autograd sums a leaf's, micro-batch after micro-batch; fp16: of the loss x scale, as GradScaler.scale).
        Returns the micro-batches' losses (on the device, unscaled)."""
        m_count, last = self.cfg.execution.micro_batches, len(self.program.modules) - 1
        grad_out: list[Tensor | None] = [None] * m_count
        losses: list[Tensor] = []
        acts_mgr = self.activations
        for p in range(last, len(visits)):
            i = visits[p]
            self.passes.visit(visits, p, 0)
            for o, _ in self.program.external_params(i):  # a tied head: its owner's weight must be resident
                self.streamer.acquire(o, 0)
            adapters = self.lora.block_params(i)
            inner = i in acts_mgr.inner and not graphs
            if inner:
                acts_mgr.prefetch(i - 1)
            for m in range(m_count):
                kept = graphs.pop((i, m), None)
                if inner:
                    x, fn = acts_mgr.backward_block(i, m)
                elif kept is not None:  # its forward's own graph: nothing to recompute
                    x, fn = kept[0], lambda _, out=kept[1]: out
                else:
                    x, fn = acts[i][m], lambda z, i=i, m=m: self.program.run(i, z, tgt_mb[m] if i == last else None)
                x = x if kept is not None else x.detach().requires_grad_()
                self._micro_batch(m)  # (a recomputation draws its forward's dropout masks)
                with self._bwd_timer, torch.enable_grad(), self.device.autocast(self.compute_dtype):
                    out = fn(x)
                    if i == last:  # the mean over every micro-batch of every rank
                        out = out / (m_count * self.world)
                    target = out * scaler.scale if i == last and scaler is not None else out
                    grads = torch.autograd.grad(target, [x, *adapters],
                                                grad_outputs=None if i == last else grad_out[m], allow_unused=True)
                if i == last:
                    losses.append(out.detach())
                for a, g in zip(adapters, grads[1:]):
                    if g is not None:
                        a.grad = g if a.grad is None else a.grad.add_(g)
                grad_out[m] = grads[0]
                acts[i][m] = None
                if inner:
                    del x, out, grads
                    acts_mgr.release(i, m)
            if inner:
                acts_mgr.stage(i - 1)
            crashpoint("lora.backward")
            self.passes.leave(visits, p, 0)
        return losses

    def _rank_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return rank_batch(batch, self.cfg.execution.micro_batches, self.world, self.dp.rank)

    def _update(self, loss: float, scaler: LossScale | None) -> tuple[float | None, float | None, bool, bool]:
        """fp16: unscale (GradScaler.unscale_'s op and inf check); clip (as `clip_grad_norm_` over PEFT's trainable
        parameters) and step AdamW at the schedule's rate. A non-finite loss or norm skips the update (`step` raises
        `NonFiniteError` after `max_bad_steps` in a row); so does an fp16 overflow, GradScaler's ordinary skip, which
        is not a bad step. Returns the gradient norm taken and the clip coefficient (None: clipping off), whether the
        update was skipped and whether for an overflow."""
        params = [p for p in self.lora.params if p.grad is not None]
        norm = coef = None
        overflow = False
        if scaler is not None:
            scaler.unscale_([p.grad for p in params])
            overflow = bool(self.device.fetch(scaler.found_inf).item())
        if self.cfg.stability.max_grad_norm > 0 and not overflow:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.stability.max_grad_norm))
            coef = min(1.0, self.cfg.stability.max_grad_norm / (norm + 1e-6))  # (clip_grad_norm_'s own coefficient)
        finite = math.isfinite(loss) and not overflow and (norm is None or math.isfinite(norm))
        if finite and norm is None and params:  # (one synchronization, not one per adapter)
            finite = bool(torch.stack([torch.isfinite(p.grad).all() for p in params]).all())
        self._step += 1
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            if overflow and math.isfinite(loss):
                log.info("step %d: fp16 gradients overflowed; skipped, the loss scale lowered", self._step)
                return None, None, True, True
            self._bad_streak += 1
            log.warning("step %d: non-finite loss or gradient, skipped", self._step)
            return norm, coef, True, False
        self._bad_streak = 0
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.cfg, self._step - 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, coef, False, False

    # ---------------------------------------------------------------- commit
    def _commit(self, note: dict[str, Any]) -> None:
        """The step's commit: adapters, AdamW states, step count and what the step measured (`note`,
        `committed_stats`) in the slot of its step, durably (`lohan.runtime.lora_commit`: one fsync)."""
        state = {"step": self._step, "bad_streak": self._bad_streak, "note": json.dumps(note),
                 "scale": dict(self._scale), "lora": lora_settings(self.cfg), "base": repr(base_identity(self.store)),
                 "adapters": list(self.lora.params), "optimizer": self.optimizer.state_dict()}
        write_commit(self.cfg.store.nvme, self.cfg.store.name, state)
        self._note, self._committed = note, self._step

    def _restore(self) -> None:
        """After a step failed between its update and its commit (a full disk, an interrupt): the adapters, AdamW
        states and counters of the last commit, or the initial ones before the first, so that memory and the commit
        agree again."""
        latest = latest_commit(self.cfg.store.nvme, self.cfg.store.name, self.store)
        if latest is not None:
            self._load(*latest)
        else:
            self._fresh()
        self.optimizer.zero_grad(set_to_none=True)

    def _resume(self) -> None:
        """The commit a resume continues from: the latest of this rank's (the other slot holds the one before it,
        which a kill while a slot is written leaves whole); data parallel, the group's latest step every rank has
        (a rank killed before its commit of step k makes the group resume at k - 1: the others take their commit
        before it). None at step 0: the adapters as initialized."""
        found = commits(self.cfg.store.nvme, self.cfg.store.name, self.store)
        target = max(found, default=0)
        target = self.dp.least(target)
        if target in found:
            self._load(found[target], read_commit(found[target], self.store))
        elif target:
            raise StoreCorruptError(f"rank {self.dp.rank}: no LoRA commit of step {target} in "
                                    f"{self.cfg.store.nvme[0]} (the group resumes there); restore the directories together, "
                                    "or start over with --overwrite")

    def _load(self, path: str, state: dict[str, Any]) -> None:
        """The adapters and AdamW states committed in `state` (read from `path`), after checking they belong to this
        run and base."""
        if len(state["adapters"]) != len(self.lora.params):
            raise StoreCorruptError(f"{path} is not a LoRA commit of this model ({len(self.lora.params)} "
                                    "adapter matrices); start over with --overwrite")
        if state["lora"] != lora_settings(self.cfg):
            raise ValueError(f"the run in {self.cfg.store.nvme[0]} trains LoRA adapters with {state['lora']} and this run "
                             f"asks for {lora_settings(self.cfg)}; resume with the settings it was started with")
        with torch.no_grad():
            for p, t in zip(self.lora.params, state["adapters"]):
                if p.shape != t.shape:
                    raise StoreCorruptError(f"{path}: an adapter of shape {tuple(t.shape)} where this model "
                                            f"has {tuple(p.shape)}; start over with --overwrite")
                p.copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])  # (moves the states to the parameters' device)
        self._step, self._bad_streak = int(state["step"]), int(state["bad_streak"])
        self._committed = self._step
        self._note = json.loads(state["note"])
        self._scale = dict(state.get("scale") or {})

    @property
    def committed_stats(self) -> StepStats | None:
        """What the committed step measured, as committed with it (None before the first step)."""
        return stats_from_note(self._note)

    # what the run driver (lohan.app.train) asks of an engine: every step is durable when `step` returns
    persist_every = 1
    persist_refusal = "a LoRA step commits its adapters every step"

    def describe(self) -> EngineSummary:
        """What the run header prints of this engine (`runtime.summary`): the adapters, the base, the device."""
        return engine_summary(self)

    def persist(self) -> None:
        """Nothing to do: every step is committed before `step` returns."""

    def flush(self) -> None:
        """Nothing to do (no write-behind)."""

    def drop_staged(self) -> None:
        """Nothing is ever staged."""

    # ---------------------------------------------------------------- access
    def evaluate(self, batch: tuple[Tensor, Tensor]) -> float:
        """Mean loss of `batch` under the committed adapters, forward only (as `Engine.evaluate`)."""
        idx, targets = self._rank_batch(batch)
        self.lora.training = False  # no dropout (PEFT's model.eval())
        try:
            loss = self.passes.evaluate(0, self.device.put(idx), self.device.put(targets))
        finally:
            self.lora.training = True
        return self.dp.sum(loss)

    def read_params(self, block: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Block `block`'s base weights (the frozen P16, checksums verified) as `dtype`."""
        return [t.to(dtype) for t in self.store.read_params(block)]

    @property
    def whole(self) -> LoraEngine:
        """What the exporters read: the engine (its `lora` adapters for a PEFT adapter folder; `merged()` for the
        merged weights)."""
        return self

    def merged(self) -> _Merged:
        """The base with the adapters merged in, as the Hugging Face exporters read a store."""
        return _Merged(self)

    def close(self) -> None:
        if not self._closed:
            self._close()

    def _close(self) -> None:
        self._closed = True
        if hasattr(self, "_gc"):
            self._gc.close()
        for part in ("streamer", "activations"):
            if hasattr(self, part):
                getattr(self, part).close()
        if hasattr(self, "lora"):
            self.lora.detach()
        if hasattr(self, "params_pool"):
            self.params_pool.clear()
        self.device.close()
        try:
            self.store.close()
        finally:
            self._lock.release()

    def __enter__(self) -> LoraEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Merged:
    """The weights PEFT's ``merge_and_unload`` gives (each adapted weight plus its update B @ A x scaling, in fp32),
    with what `lohan.models.hf.export_hf` and `export_gpt2` read: ``.layout``, ``.read_params(i)`` and
    ``.step_count``."""

    def __init__(self, engine: LoraEngine) -> None:
        self.layout, self.step_count, self._engine = engine.layout, engine.step_count, engine

    def read_params(self, block: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        params = self._engine.read_params(block)
        names = [s.name for s in self.layout.blocks[block].params]
        lora = self._engine.lora
        for k, t in enumerate(lora.targets):
            if t.block == block:
                j = names.index(f"{t.path}.weight")
                params[j] = params[j] + lora.delta(k).cpu()  # (PEFT: base_layer.weight.data += delta_weight)
        return [p.to(dtype) for p in params]


def _refuse(cfg: EngineConfig) -> None:
    """What a LoRA run cannot do yet, refused before anything is written."""
    problems = []
    if cfg.lora.lora_r < 1:
        problems.append("lora_r must be >= 1 for a LoRA run (--lora R)")
    if problems:
        raise ValueError("LoRA run refused:\n  - " + "\n  - ".join(problems))
