"""The forward's graphs kept for backward, as a PEFT run keeps them: a LoRA step with no recomputation.

The engines run every decoder block twice, forward under no_grad and again with grad in backward (the activation
plan, `lohan.runtime.activations`), because full fine-tuning's activations rarely fit beside the streamed states.
A LoRA run on a host device whose main memory holds the whole frozen base and the step's activations has no reason
to: it runs each decoder block once, with grad, and backward asks autograd for the gradients of the graph forward
left, as plain PyTorch + PEFT does (the same ops on the same values: its bits).

What that needs, checked by `GraphKeeper.decide` once per batch shape (`lohan.plan.lora.keeps_graphs`):

- the device is main memory (the graphs live where the compute does; on a separate device the activation plan
  decides what the device keeps);
- the activation policy is the planner's choice (``plan``) and records are not compressed (a forced policy, or int8
  records, is the user's request for the recomputing path);
- the parameter pool holds every block at once: a graph saves views of its block's parameters, which are views of
  the block's host buffer, so each decoder block is held (IN_USE, never given back for another block's read) from
  its forward until its backward;
- the bytes a block's graph saves (measured on the first micro-batch of block 1, with
  `torch.autograd.graph.saved_tensors_hooks`), for every decoder block and micro-batch, fit what main memory
  leaves for activations (`ActivationManager.mem_avail`).

The measurement runs the embedding and block 1 once more on the first step of a shape (a probe, its graph
dropped). Otherwise the recomputing path runs, planned by Algorithm 1 on a LoRA step's profile (`LoraActivations`:
no optimizer records read or written, no CPU update, no weight gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from io_engine.base import align_up
from lohan.config import EngineConfig
from lohan.crashpoints import crashpoint
from lohan.models.adapter import BlockProgram
from lohan.plan.lora import keeps_graphs
from lohan.plan.planner import Plan
from lohan.runtime.activations import ActivationManager
from lohan.runtime.device import Device, Timer
from lohan.runtime.params import ParamStreamer
from lohan.runtime.passes import Acts, BlockPasses

Graphs = dict[tuple[int, int], tuple[Tensor, Tensor]]
"""(block, micro-batch) -> (the block's input, a leaf requiring grad; its output, with the graph between them)."""


class GraphKeeper:
    """Decides whether a LoRA step keeps its forward's graphs (module docstring) and runs that forward."""

    def __init__(self, cfg: EngineConfig, program: BlockProgram, device: Device, compute_dtype: torch.dtype,
                 streamer: ParamStreamer, passes: BlockPasses, activations: ActivationManager) -> None:
        self.cfg, self.program, self.device, self.compute_dtype = cfg, program, device, compute_dtype
        self.streamer, self.passes, self.activations = streamer, passes, activations
        self.shape: tuple[int, int] | None = None
        self.keep = False
        self.block_bytes = 0  # what one block's graph saves, one micro-batch (0: not measured)
        self.why = ""
        self.micro_batch: Callable[[int], None] = lambda m: None  # told which micro-batch a block runs on (dropout)

    def holds_base(self) -> bool:
        """Whether the parameter pool has room for every block's buffer at once."""
        need = sum(align_up(self.streamer.buffer_bytes(i)) for i in range(len(self.program.modules)))
        return self.streamer.pool.budget_bytes >= need

    def decide(self, idx: Tensor, adapters: list[Tensor]) -> bool:
        """Whether steps of `idx`'s shape keep their graphs; measured once per shape (a probe of block 1, whose
        `adapters` are not counted)."""
        shape = (int(idx.shape[0]), int(idx.shape[1]))
        if shape == self.shape:
            return self.keep
        cfg = self.cfg
        eligible = (self.device.is_host and cfg.activations.act_policy == "plan" and cfg.activations.act_compress == "none"
                    and len(self.program.modules) > 2 and self.holds_base())
        self.block_bytes = self._probe(idx, adapters) if eligible else 0
        n_blocks = len(self.program.modules) - 2
        self.keep, self.why = keeps_graphs(eligible, self.block_bytes, n_blocks, cfg.execution.micro_batches,
                                           self.activations.mem_avail())
        self.shape = shape
        return self.keep

    def _probe(self, idx: Tensor, adapters: list[Tensor]) -> int:
        """Bytes block 1's graph saves on the first micro-batch (its output included, the next block's input;
        not its parameters nor the adapters, which are there anyway)."""
        x0 = idx.chunk(self.cfg.execution.micro_batches)[0]
        owned = {p.untyped_storage().data_ptr() for p in adapters}
        seen: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
            return t

        self.micro_batch(0)
        try:
            with torch.no_grad(), self.device.autocast(self.compute_dtype):
                self.streamer.acquire(0, 0)
                x = self.program.run(0, x0, None)
            owned |= {p.untyped_storage().data_ptr() for p in self.streamer.acquire(1, 0)}
            with torch.enable_grad(), self.device.autocast(self.compute_dtype), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.program.run(1, x.detach().requires_grad_(), None)
            pack(out)
            return sum(n for ptr, n in seen.items() if ptr not in owned)
        finally:
            self.streamer.release_all()

    def forward(self, visits: list[int], idx: Tensor) -> tuple[Acts, Graphs, Timer]:
        """Blocks 0..n-2: the embedding under no_grad, each decoder block with grad on a leaf input, its graph kept
        and the block held until its backward (`GraphKeeper` docstring); returns the last block's output (the
        head's input) in ``acts``, the graphs, and the compute time."""
        m_count = self.cfg.execution.micro_batches
        n = len(self.program.modules)
        acts: Acts = [[None] * m_count for _ in range(n)]
        acts[0] = list(idx.chunk(m_count))
        graphs: Graphs = {}
        timer = self.device.timer()
        for p in range(n - 1):
            i = visits[p]
            self.passes.visit(visits, p, 0)
            with timer, torch.set_grad_enabled(i > 0), self.device.autocast(self.compute_dtype):
                for m in range(m_count):
                    x = acts[i][m]
                    acts[i][m] = None
                    if i > 0:
                        x = x.detach().requires_grad_()
                    self.micro_batch(m)
                    out = self.program.run(i, x, None)
                    if i > 0:
                        graphs[(i, m)] = (x, out)
                        out = out.detach()
                    acts[i + 1][m] = out
            crashpoint("engine.forward")
            if i == 0:
                self.passes.leave(visits, p, 0)
            # a decoder block stays IN_USE: its graph saved views of its parameters, i.e. of its host buffer
        return acts, graphs, timer

    def stats(self) -> dict[str, Any]:
        """The step's activation counters, in the shape `ActivationManager.stats` gives them."""
        n_blocks = len(self.program.modules) - 2
        kept = self.block_bytes * n_blocks * self.cfg.execution.micro_batches
        return {"policy": "graphs kept (no recompute)", "swap": [], "tiers": {"keep": n_blocks, "cpu": 0, "ssd": 0},
                "bytes": {"keep": kept}, "raw_bytes": {"keep": kept}, "compress": "none", "peak_cpu_bytes": kept}


class LoraActivations(ActivationManager):
    """The activation plan of a LoRA step: Algorithm 1 on a profile with no optimizer traffic (no records read or
    written, no CPU update) and no weight gradient (`Profile.frozen`), the base's P16 kept as the pool keeps it.
    (`ActivationManager` prices a full fine-tuning's step in the config's state format: for a LoRA run it saw an
    SSD lane of 14 bytes a parameter that does not exist, and recomputed what it could have swapped.)"""

    micro_batch: Callable[[int], None] = staticmethod(lambda m: None)
    """Told which micro-batch a block runs on (the dropout masks are drawn for it)."""

    def prepare(self, x: Tensor, batch: int, seq: int) -> Plan:
        self.micro_batch(0)  # (the profile runs block 1 on the first micro-batch)
        return super().prepare(x, batch, seq)

    def forward_block(self, i: int, m: int, x: Tensor) -> Tensor:
        self.micro_batch(m)
        return super().forward_block(i, m, x)

    def _optimizer_fields(self, param_count: int) -> dict[str, Any]:
        return {"resident_params": 0, "readahead_params": 0,
                "kept_p16_params": round(param_count * self.kept_p16_fraction), "write_behind": False,
                "record_bytes": 0.0, "separate_p16": False, "update_cost": 0.0, "frozen": True}
