"""What a LoRA step costs (issue 41, item 5): the dry run's and the pre-flight's plan for ``--lora R``.

A LoRA run (`lohan.runtime.lora_engine`) keeps the base as read-only P16 on the SSDs and streams it block by block,
forward, then backward with recomputation; the adapters and their AdamW states stay on the device. Per step, with
`k` the share of the base the parameter pool keeps across passes (``min(1, cpu_mem / base)``: the slot is never
rewritten, so a block released stays valid):

    forward:   GPU  FLOP_f                          PCIe up   P16            SSD read (1 - k) P16
    backward:  GPU  2 FLOP_f (recompute + input     PCIe up   P16            SSD read (1 - k) P16
               gradients; no weight gradient of the base)  + the block inputs   PCIe down the block inputs (forward)

plus the adapters' own FLOPs (2 per adapter parameter and token forward, 4 backward, 2 more for the recomputation).
Nothing is written to the SSDs but the adapters' commit (a few MB), and no optimizer lane exists: the step is the
sum over the two passes of their slowest lane (the pipeline's fill left out). The GPU hides the base's reads once
a step has at least ``hide_tokens`` tokens.

Where the engine keeps the forward's autograd graphs instead (`lohan.runtime.lora_graphs`: a host device, the
planner's activation policy, records not compressed, the whole base in the parameter pool, and every decoder block's
graph in what main memory leaves: `keeps_graphs`), nothing is recomputed: backward is FLOP_f (the input gradients)
plus the adapters' 4 per parameter and token, and main memory holds the graphs instead of the block inputs. A host
device moves nothing over PCIe (the parameters are views of the pool's buffers, the activations stay where they are).

Memory: main memory holds the parameter pool (``min(cpu_mem, base + a block)``, at least the blocks in flight)
and the block inputs swapped to it; the device holds the blocks in flight, the adapters with their gradients and
moments (16 bytes each), and one block's recomputed activations (Korthikanti et al. 2022's s·b·h·(34 + 5·a·s/h)
bytes per layer in 16-bit) beside the head's logits. Estimates for planning; the engine's own pools are what a run
measures. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lohan.config import ModelConfig
from lohan.plan.planner import Hardware
from lohan.plan.pools import ram_budget

RUNTIME_BYTES = 2**30
"""The process itself (Python, torch, allocator), counted in main memory."""


def adapter_params(mcfg: ModelConfig, r: int, projections: Sequence[tuple[int, int]] | None = None) -> int:
    """LoRA parameters of rank `r`: r x (in + out) for each adapted projection. `projections`: the (in, out) widths
    of every adapted projection of the model (`lohan.models.lora.projections`: a Hugging Face model's own, e.g. the
    narrower k and v of grouped-query attention, and only the targets asked for); None: those of the in-house GPT
    block of `mcfg` (the presets), q, k and v fused (d -> 3d), the output projection (d -> d), the MLP's two
    (d -> m·d -> d)."""
    if projections is not None:
        return r * sum(i + o for i, o in projections)
    d, md = mcfg.d_model, mcfg.mlp_ratio * mcfg.d_model
    return mcfg.n_layer * r * ((d + 3 * d) + (d + d) + 2 * (d + md))


@dataclass(frozen=True)
class Reasons:
    """What does not fit (`FitReport.capacity.reasons`' shape, for the run driver)."""

    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoraPlan:
    """The plan of a LoRA run on a machine (module docstring); `format` is what the dry run prints."""

    model: ModelConfig
    hw: Hardware
    notes: tuple[str, ...]
    batch: int
    seq: int
    rank: int
    p16_itemsize: int
    base_bytes: int
    adapters: int
    pool_bytes: int
    kept: float
    act_host_bytes: int
    ram_bytes: int
    gpu_bytes: dict[str, int]
    lanes: dict[str, tuple[float, float]] = field(default_factory=dict)
    epoch_s: float | None = None
    graphs_kept: bool = False
    """Backward takes the forward's graphs (no block recomputed; ``act_host_bytes`` are the graphs)."""
    graphs: str = ""
    """Whether backward recomputes the blocks or takes the forward's graphs, and why (`keeps_graphs`; "" on a GPU)."""

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def step_s(self) -> float:
        """Each pass as long as its slowest lane, the two passes in a row."""
        return sum(max(v[p] for v in self.lanes.values()) for p in (0, 1))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def ssd_read_bytes(self) -> float:
        """Bytes the SSDs read per step (the base's P16 not kept, both passes)."""
        return 2 * (1 - self.kept) * self.base_bytes

    @property
    def bytes_per_param_step(self) -> float:
        """SSD bytes moved per parameter per step (reads; nothing of the base is written)."""
        return self.ssd_read_bytes / max(1, self.model.param_count())

    @property
    def hide_tokens(self) -> int:
        """Tokens per step from which the GPU lane is the slowest of each pass (the reads hidden behind compute)."""
        gpu_per_token = [self.lanes["gpu"][p] / self.tokens for p in (0, 1)]
        need = max(max(v[p] for k, v in self.lanes.items() if k != "gpu") / gpu_per_token[p] for p in (0, 1))
        return int(need) + 1

    @property
    def capacity(self) -> Reasons:
        hw, out = self.hw, []
        if hw.ssd_bytes and self.base_bytes > hw.ssd_bytes:
            out.append(f"SSD: the base needs {self.base_bytes / 1e9:.2f} GB but the SSDs hold {hw.ssd_bytes / 1e9:.2f} GB")
        if hw.ram and self.ram_bytes > hw.ram:
            out.append(f"main memory: needs {self.ram_bytes / 1e9:.2f} GB but {hw.ram / 1e9:.2f} GB is usable; lower "
                       "--cpu-mem (the parameter pool), or swap fewer activations")
        gpu = sum(self.gpu_bytes.values())
        if hw.gpu_mem and gpu > hw.gpu_mem:
            out.append(f"GPU: needs {gpu / 1e9:.2f} GB but it has {hw.gpu_mem / 1e9:.2f} GB; lower --batch-size or "
                       "--seq-len, or use more micro-batches")
        return Reasons(tuple(out))

    @property
    def fits(self) -> bool:
        return not self.capacity.reasons

    def measured_ssd(self, lanes: dict[str, float], step_s: float, mode: str = "optimized") -> None:
        """(The full fine-tuning's SSD advice has no LoRA counterpart: the base is only read.)"""
        return None

    def format(self) -> str:
        gpu = sum(self.gpu_bytes.values())
        lines = [
            f"LoRA rank {self.rank}: {self.adapters / 1e6:,.2f}M adapter parameters "
            f"({self.adapters / max(1, self.model.param_count()):.3%} of {self.model.param_count() / 1e9:.3g}B), "
            "the base frozen",
            f"  ssd   {self.base_bytes / 1e9:10.2f} GB of {self.hw.ssd_bytes / 1e9 if self.hw.ssd_bytes else 0:10.2f} GB  "
            f"the base as read-only P16 ({self.p16_itemsize} B/param, one slot, never written)",
            f"  cpu   {self.ram_bytes / 1e9:10.2f} GB of {self.hw.ram / 1e9 if self.hw.ram else 0:10.2f} GB  parameter "
            f"pool {self.pool_bytes / 1e9:.2f} GB (keeps {self.kept:.0%} of the base across passes), "
            f"{'graphs' if self.graphs_kept else 'block inputs'} {self.act_host_bytes / 1e9:.2f} GB, process "
            f"{RUNTIME_BYTES / 1e9:.2f} GB",
            *([f"  backward: {self.graphs}"] if self.graphs else []),
            f"  gpu   {gpu / 1e9:10.2f} GB of {self.hw.gpu_mem / 1e9 if self.hw.gpu_mem else 0:10.2f} GB  "
            + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in self.gpu_bytes.items()),
            "  lane     forward  backward",
            *(f"  {k:<5} {f:10.4g}s {b:9.4g}s" for k, (f, b) in self.lanes.items()),
            f"predicted step {self.step_s:.4g} s | {self.tokens_per_s:,.3g} tokens/s | SSD reads "
            f"{self.ssd_read_bytes / 1e9:.3g} GB a step ({self.bytes_per_param_step:.2f} B/param) | the GPU hides the "
            f"base's reads from {self.hide_tokens:,} tokens a step (this run: {self.tokens:,})",
            f"rates: {self.hw.describe()}",
        ]
        lines += [f"  fits: no: {r}" for r in self.capacity.reasons]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def keeps_graphs(eligible: bool, block_bytes: int, n_blocks: int, micro_batches: int,
                 mem_avail: int) -> tuple[bool, str]:
    """Whether a LoRA step keeps its forward's graphs instead of recomputing its blocks in backward
    (`lohan.runtime.lora_graphs`), and why: where it is `eligible` (a host device, the planner's policy, the whole
    base in the parameter pool) and every decoder block's graph (`block_bytes` a micro-batch, measured) fits the
    main memory left for activations. A LoRA step has no optimizer traffic and reads the base only, so once both fit
    nothing is gained by recomputing: the recompute costs a forward of every block (a third of the step's FLOPs)."""
    if not eligible:
        return False, "recomputed: not a host device holding the whole base under the planner's policy"
    need = block_bytes * n_blocks * micro_batches
    if need > mem_avail:
        return False, (f"recomputed: the step's graphs would take {need / 1e9:.3g} GB, main memory leaves "
                       f"{mem_avail / 1e9:.3g} GB for activations")
    return True, f"graphs kept: {need / 1e9:.3g} GB of activations, no block recomputed"


def lora_plan(mcfg: ModelConfig, hw: Hardware, batch: int, seq: int, rank: int, compute_dtype: str = "bf16",
              cpu_mem: int | None = 8 << 30, prefetch_depth: int = 2, notes: tuple[str, ...] = (),
              steps_per_epoch: int | None = None, projections: Sequence[tuple[int, int]] | None = None,
              host_device: bool = False, micro_batches: int = 1, act_mem: int | None = None) -> LoraPlan:
    """The `LoraPlan` of `mcfg` at `batch` x `seq` with rank-`rank` adapters on `projections` (`adapter_params`) on
    `hw` (module docstring). `cpu_mem` None: what `hw`'s main memory leaves beside the activations and the process
    (`pools.ram_budget`). `host_device`: the CPU computes, under the planner's activation policy with records not
    compressed, so the graphs are kept where they fit what `act_mem` (None: what `cpu_mem` leaves beside the pool,
    as the engine's `ActivationManager.mem_avail`) holds, `micro_batches` of them per block."""
    item = 4 if compute_dtype == "fp32" else 2
    params = mcfg.param_count()
    base = params * item
    biggest = max(mcfg.block_param_count(), mcfg.embed_param_count(), mcfg.head_param_count()) * item
    d, tokens = mcfg.d_model, batch * seq
    acts = (mcfg.n_layer + 1) * tokens * d * item  # the block inputs, swapped to main memory
    if cpu_mem is None:
        cpu_mem = max(0, ram_budget(hw.ram) - acts - RUNTIME_BYTES) if hw.ram else base + biggest
    pool = max((prefetch_depth + 3) * biggest, min(cpu_mem, base + biggest))
    kept = min(1.0, pool / base)
    adapters = adapter_params(mcfg, rank, projections)
    layer_acts = seq * batch * d * (34 + 5 * mcfg.n_head * seq / d) * item / 2
    # the graphs: every decoder block's saved activations (a block's, one micro-batch at a time, as the engine measures)
    mb_acts = int(layer_acts / max(1, micro_batches))
    avail = int(act_mem) if act_mem is not None else max(0, int(cpu_mem) - pool)
    keep, why = keeps_graphs(host_device and pool >= base, mb_acts, mcfg.n_layer, max(1, micro_batches), avail)
    graph_bytes = mcfg.n_layer * max(1, micro_batches) * mb_acts if keep else 0
    gpu = {"blocks in flight": (prefetch_depth + 2) * biggest, "adapters (weights, grads, AdamW)": 16 * adapters,
           "one block's activations": int(layer_acts), "logits": tokens * mcfg.vocab_size * 4}
    flops = mcfg.flops_per_token(seq) * tokens
    lora_flops = 2 * adapters * tokens
    ssd = (1 - kept) * base / hw.bw_s2m
    backward = flops + 2 * lora_flops if keep else 2 * flops + 3 * lora_flops  # (the recomputation: a forward more)
    up, down = (0.0, 0.0) if host_device else (base / hw.bw_g, acts / hw.bw_g)
    lanes = {"gpu": ((flops + lora_flops) / hw.thp_g, backward / hw.thp_g),
             "m2g": (up, 0.0 if host_device else (base + acts) / hw.bw_g),
             "g2m": (down, 0.0),
             "ssd": (ssd, ssd)}
    host_acts = graph_bytes if keep else acts
    plan = LoraPlan(mcfg, hw, notes, batch, seq, rank, item, base, adapters, pool, kept, host_acts,
                    pool + host_acts + RUNTIME_BYTES, gpu, lanes, graphs_kept=keep, graphs=why if host_device else "")
    if steps_per_epoch:
        plan = LoraPlan(**{**plan.__dict__, "epoch_s": plan.step_s * steps_per_epoch})
    return plan
