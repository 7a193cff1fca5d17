"""The GPU memory plan (:func:`gpu_need`): what the engine allocates on the device at a step's peak, part by part.

The capacity planner (`lohan.plan.capacity.capacity`) holds it to ``Hardware.gpu_mem`` (the free memory, on a
detected machine) and :func:`check_gpu_budget` lets the engine refuse a run with it at run time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lohan.config import ModelConfig
from lohan.plan import pools, vocab
from lohan.plan.hardware import Hardware
from lohan.plan.profile import Profile, analytic_profile
from lohan.plan.units import GiB, itemsize

CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS workspace per (handle, stream) pair, taken from the caching allocator: PyTorch's default
``CUBLAS_WORKSPACE_CONFIG`` on Hopper is ``:4096:8`` (8 chunks of 4096 KiB); older GPUs get less
(``:4096:2:16:8``, ~8 MiB), so this bounds them too (PyTorch ``aten/src/ATen/cuda/CublasHandlePool.cpp``)."""
CUBLAS_STREAMS = 2
"""The engine's streams (compute and copy). PyTorch keys workspaces by (handle, stream), so each stream that
runs a matmul gets its own; the copy stream normally runs none, so counting both is a bound."""
FRAGMENTATION = 0.10
"""Margin for the caching allocator, as a fraction of everything else the plan counts. It rounds each
request up (to 512 B; requests over 10 MiB to 2 MiB multiples) and carves requests of 1-10 MiB out of
20 MiB segments, and a cached block split for a smaller tensor cannot serve a bigger one, so what it
reserves exceeds what tensors hold (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``; the "reserved" vs
"allocated" of ``torch.cuda.memory_stats``). The plan's big tensors recur with the same sizes every block
and step, which keeps the gap small; 10% is a round margin above that, not a measurement."""
HOST_SHARED_PARTS = ("params", "gradient accumulators", "cuBLAS workspace", "fragmentation")
"""Parts of :func:`gpu_need` that add nothing to main memory when the CPU is the device: its parameters and
gradient accumulators are the host pools' own buffers, cuBLAS does not run, and the C allocator's slack
is ``plan.memory.SLACK_BYTES``'s to count."""
GPU_FIXES = ("a smaller batch or more engine.micro_batches (activations and logits are per micro-batch), "
             "a shorter sequence, a lower engine.prefetch_depth (fewer blocks held), an act_policy that "
             "swaps more (interblock or the planner's plan instead of recompute-all), or, if the memory "
             "really is there, a larger engine.gpu_mem")
"""What to change where the plan does not fit, in the words of every refusal (here and the capacity planner's)."""


class GpuMemoryPlanError(ValueError):
    """A run's GPU memory plan does not fit the memory the device has free (:func:`check_gpu_budget`)."""


def _size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (the plan's parts span KiB to tens of GiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def format_gpu_parts(need: Mapping[str, int]) -> str:
    """``params 1.50 GiB, logits 96.0 MiB, ...``: every part of a GPU memory plan, for plans and errors."""
    return ", ".join(f"{k} {_size(v)}" for k, v in need.items())


def check_gpu_budget(need: Mapping[str, int], budget: int, what: str = "this run") -> None:
    """Refuse a run whose GPU memory plan (:func:`gpu_need`) exceeds ``budget`` bytes.

    The engine calls it at its first step with the bytes ``torch.cuda.mem_get_info`` reports free, so a run
    that would run out of memory hours in, at its biggest block or its longest batch, stops before it writes.
    What this process's caching allocator already reserved is not free but is the run's: called after the
    engine has allocated on the device, add ``torch.cuda.memory_reserved()`` to the free bytes.

    Raises:
        GpuMemoryPlanError: The plan needs more than ``budget``; the message lists every part, the total,
            the budget and what to change.
    """
    total = sum(need.values())
    if total <= budget:
        return
    raise GpuMemoryPlanError(
        f"GPU memory: {what} needs {_size(total)} but {_size(budget)} is available ({_size(total - budget)} "
        f"short). Parts: {format_gpu_parts(need)}. To fit, try {GPU_FIXES}")


def gpu_need(cfg: ModelConfig, batch: int, seq: int, hw: Hardware, compute_dtype: str, micro_batches: int,
             prefetch_depth: int, swap: Sequence[str], world: int = 1,
             measured: Profile | None = None, host: bool = False) -> dict[str, int]:
    """Bytes the engine allocates on the GPU at a step's peak, by part (the keys are printed in plans and
    errors). The CUDA context lies outside the caching allocator: budget this against the *free* memory.

    ``batch`` is this process's (one rank's) batch; ``world`` the data-parallel ranks, which make the
    gradients fp32 as micro-batches do (``engine.grad_dtype``). ``swap``: the ops the plan swaps, named as in
    ``measured`` when given (the run's profile of ``batch`` x ``seq``, which sizes the activations: an HF
    block's ops are its own sub-modules, not the analytic GPT block's), else as in :func:`analytic_profile`.
    ``host``: the CPU is the device; it sums autograd's gradients into the host buffer at once (no accumulator, no
    copy in flight), so it holds one block's of them, or after them the fp32 upcast of the largest parameter
    that the norms take (``pools.device_grad_bytes``), not two blocks'.
    """
    s = itemsize(compute_dtype)
    big = max(cfg.block_param_count(), cfg.embed_param_count(), cfg.head_param_count())
    g = pools.grad_itemsize(compute_dtype, micro_batches, world)  # the host gradient buffers' dtype
    mb = math.ceil(batch / micro_batches)
    full = measured if measured is not None else analytic_profile(cfg, batch, seq, hw, compute_dtype)
    sizes = {op.name: op.bytes for op in full.ops}
    unknown = sorted(set(swap) - set(sizes))
    if unknown:
        raise ValueError(f"gpu_need: the swap set names ops {unknown} that the {full.source} profile of "
                         f"{full.model!r} does not have (its ops: {list(sizes)})")
    record = full.input_bytes + sum(sizes[n] for n in swap)  # one block's record, every micro-batch
    if measured is not None:  # measured for the whole batch; a micro-batch's share, rounded up
        block_acts = math.ceil((full.input_bytes + sum(sizes.values())) / micro_batches)
    else:
        micro = analytic_profile(cfg, mb, seq, hw, compute_dtype)
        block_acts = micro.input_bytes + sum(op.bytes for op in micro.ops)
    tied = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    need = {
        # the block computing, the next one copied in, up to k kept over the forward/backward turn, and a
        # tied embedding, which its borrower (the head) needs at both ends of the step, kept all step
        "params": (prefetch_depth + 2) * s * big + (s * cfg.embed_param_count() if tied else 0),
    }
    if host:
        largest = pools.model_geometry(cfg, compute_dtype).largest_param
        need["block gradients"] = max(s * big, 4 * largest if g < 4 else 0)
    elif micro_batches == 1 and g == s:  # engine._direct: nothing to sum, autograd's gradients go to the host
        # this block's, and the block after's until its copy to the host has completed
        need["block gradients"] = 2 * s * big
    else:
        # a flat buffer per block: one filling while the previous one is copied to the host
        need["gradient accumulators"] = 2 * g * big
        # autograd's own gradients of one micro-batch, before they are added to the accumulator
        need["block gradients"] = s * big
    if tied:  # the head's gradient of the embedding, one per micro-batch, held until the embedding's backward
        need["borrowed gradients"] = micro_batches * s * tied
    need.update({
        # recomputing a block materializes every op of one micro-batch, and backward as many gradients
        "block activations": 2 * block_acts,
        # micro-batches are interleaved per block, so the last block keeps the whole batch's record
        "last block kept": record,
        # and the records of the block before, brought back ahead of its backward
        "next block's records": record,
        "logits": _logits_bytes(cfg, mb * seq, s),
        "cuBLAS workspace": CUBLAS_STREAMS * CUBLAS_WORKSPACE_BYTES,
    })
    need["fragmentation"] = int(FRAGMENTATION * sum(need.values()))
    return need


def _logits_bytes(cfg: ModelConfig, tokens: int, s: int) -> int:
    """The head's loss at its peak, one micro-batch of ``tokens`` (``models.lm_head.head_loss``:
    ``vocab.head_loss_bytes``). It never holds the micro-batch's fp32 logits: the gradient of the padded logits
    in the compute dtype (``s`` bytes per logit) and one chunk's fp32 temporaries, where the unchunked
    ``lm_loss`` held ``s + 12`` bytes per logit of every token."""
    return vocab.head_loss_bytes(cfg.vocab_size, tokens, s, cfg.d_model)
