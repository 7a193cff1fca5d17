"""CPU AdamW on a block's flat P32 / m / v / P16 vectors, and the learning-rate schedule.

The update runs torch's fused AdamW kernel (`torch.optim.adamw.adamw(..., fused=True)`) on
per-parameter views of the block's flat P32/m/v vectors. Using the same functional as
`torch.optim.AdamW(fused=True)`, on tensors of the same shapes, makes the result bit-identical to
plain PyTorch training. The kernel releases the GIL, so it overlaps I/O and the compute thread;
it is 1.2-1.4x DeepSpeedCPUAdam on this kind of machine, which also holds the GIL (DESIGN.md §4.3).

The optimizer knows nothing of the store's record format: the offloader cuts a record buffer into its flat
sections and describes the block's parameters as `ParamRange`s (where each sits in the flat vector, its shape,
whether it decays), so the record layout can change without touching the update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adamw import adamw

from lohan.config import EngineConfig, steps_share


@dataclass(frozen=True)
class ParamRange:
    """One parameter of a block, as the optimizer sees it: elements offset..offset+numel of the block's flat
    vectors, the parameter's shape (the fused kernel must see the shapes torch.optim.AdamW sees) and whether
    weight decay applies to it."""

    offset: int
    numel: int
    shape: tuple[int, ...]
    decay: bool = True


def _views(flat: torch.Tensor, params: Sequence[ParamRange]) -> list[torch.Tensor]:
    return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in params]


@dataclass(frozen=True)
class AdamWHyper:
    """Hyper-parameters of one AdamW update."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @staticmethod
    def from_config(cfg: EngineConfig, lr: float) -> AdamWHyper:
        return AdamWHyper(lr, cfg.schedule.betas[0], cfg.schedule.betas[1], cfg.schedule.eps, cfg.schedule.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int | None, min_lr_ratio: float,
              scheduler: str = "cosine", decay_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then `scheduler`
    (`EngineConfig.lr_scheduler`) down to `min_lr_ratio` at step `total_steps` (the step after the last).

    After the warm-up, `progress` runs from 0 at step `warmup_steps` to 1 at `total_steps`: ``cosine`` is
    ``r + (1 - r)·(1 + cos(π·progress))/2``, ``linear`` ``r + (1 - r)·(1 - progress)``, ``constant`` 1. ``wsd``
    stays at 1 until the last ``ceil(decay_ratio·total_steps)`` steps (`wsd_decay_steps`), then decays as
    ``r + (1 - r)·(1 - sqrt(p))`` with `p` running from 0 to 1 over them (the 1-sqrt cooldown). Without
    `total_steps`, or with no steps after the warm-up, the lr stays at its peak.

    Written as a plain function so a reference loop can use it through `torch.optim.lr_scheduler.LambdaLR`
    and get bit-identical learning rates (lr = base_lr * factor in both).
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant" or total_steps is None or total_steps <= warmup_steps:
        return 1.0
    if scheduler == "wsd":
        decay = wsd_decay_steps(warmup_steps, total_steps, decay_ratio)
        start = total_steps - decay
        if step < start:
            return 1.0
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - math.sqrt(min(1.0, (step - start) / decay)))
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if scheduler == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    if scheduler != "cosine":
        raise ValueError(f"lr scheduler {scheduler!r}: choose one of cosine, linear, constant, wsd")
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_decay_steps(warmup_steps: int, total_steps: int, decay_ratio: float) -> int:
    """The steps of a WSD schedule's final decay: `decay_ratio` of the total, rounded up, at least one and at
    most the steps after the warm-up."""
    return max(1, min(total_steps - warmup_steps, steps_share(decay_ratio, total_steps)))


def lr_at(cfg: EngineConfig, step: int) -> float:
    """The learning rate of 0-based optimizer step `step` under `cfg`'s schedule."""
    return cfg.schedule.lr * lr_factor(step, cfg.schedule.warmup, cfg.schedule.total_steps, cfg.schedule.floor_ratio, cfg.schedule.lr_scheduler, cfg.schedule.decay_ratio)


def _kinds(owner: nn.Module, leaf: str) -> set[str]:
    kinds = set()
    if leaf == "bias":
        kinds.add("bias")
    if "norm" in type(owner).__name__.lower():  # LayerNorm, RMSNorm, LlamaRMSNorm, Qwen2RMSNorm, ...
        kinds.add("norm")
    if isinstance(owner, nn.Embedding):
        kinds.add("embedding")
    return kinds


def decay_mask(module: nn.Module, no_decay: Sequence[str]) -> list[bool]:
    """Per parameter of `module` (in `named_parameters()` order): True if AdamW decays it. Parameters are
    classified by their own module (works on meta modules: only types and names are read)."""
    out = []
    for name, _ in module.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        out.append(not (_kinds(owner, leaf) & set(no_decay)))
    return out


def param_groups(model: nn.Module, weight_decay: float, no_decay: Sequence[str]) -> list[dict]:
    """`torch.optim` parameter groups with lohan's decay rule, for a model held in memory (reference loops
    in tests and benchmarks use these to train exactly as the engine does)."""
    decay, keep = [], []
    for p, d in zip(model.parameters(), decay_mask(model, no_decay)):
        (decay if d else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def _adamw(p32: list[torch.Tensor], grads: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
           decays: list[bool], step: int, hp: AdamWHyper) -> None:
    """torch's fused AdamW on parallel lists of views, the decayed ones and the others in two calls (as
    torch.optim.AdamW runs two parameter groups; the kernel is elementwise, so grouping changes no bit)."""
    for decayed in (True, False):
        idx = [k for k, d in enumerate(decays) if d is decayed]
        if not idx:
            continue
        # The fused kernel increments every state step in place, so each parameter needs its own tensor.
        steps = [torch.tensor(float(step - 1)) for _ in idx]
        adamw([p32[k] for k in idx], [grads[k] for k in idx], [m[k] for k in idx], [v[k] for k in idx], [], steps,
              foreach=False, fused=True, amsgrad=False, maximize=False, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
              weight_decay=hp.weight_decay if decayed else 0.0, eps=hp.eps)


def adamw_block_(p32: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p16: torch.Tensor,
                 step: int, hp: AdamWHyper, params: Sequence[ParamRange]) -> None:
    """Update one whole block in place: P32, m, v by AdamW at 1-based step `step`, then P16 = P32.

    Args:
        p32, m, v, p16: The block's flat vectors (views into its record buffer, read from the SSD).
        grad: The block's flat fp32 gradient (same numel), already clipped.
        step: The optimizer step this update makes (1 for the first update), for bias correction.
        params: The block's parameters, tiling the flat vectors.
    """
    _adamw(_views(p32, params), _views(grad, params), _views(m, params), _views(v, params),
           [p.decay for p in params], step, hp)
    p16.copy_(p32)


def adamw_chunk_(p32: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p16: torch.Tensor,
                 step: int, hp: AdamWHyper, params: Sequence[ParamRange] | None = None, lo: int = 0) -> None:
    """AdamW on the flat slice [lo, lo + len) of a block, then P16 = P32. The update is elementwise, so the
    slice is cut only where the decay differs: into the pieces of the parameters it overlaps (`params`, the
    block's; None: one decayed vector). `grad` may be autograd's per-parameter gradients (`param_grads.ParamGrads`):
    then it is cut at every parameter's bounds."""
    if isinstance(grad, torch.Tensor) and (params is None or all(p.decay for p in params)):
        _adamw([p32], [grad], [m], [v], [True], step, hp)
    else:
        hi = lo + p32.numel()
        cuts = [(max(lo, p.offset) - lo, min(hi, p.offset + p.numel) - lo, p.decay) for p in params
                if p.offset < hi and p.offset + p.numel > lo]
        _adamw([p32[a:z] for a, z, _ in cuts], [grad[a:z] for a, z, _ in cuts], [m[a:z] for a, z, _ in cuts],
               [v[a:z] for a, z, _ in cuts], [d for _, _, d in cuts], step, hp)
    p16.copy_(p32)


def adamw_upcast_(p32: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p16: torch.Tensor,
                  step: int, hp: AdamWHyper, params: Sequence[ParamRange], lo: int,
                  upcast: Callable[[torch.Tensor], torch.Tensor], limit: int) -> None:
    """AdamW on the flat slice [lo, lo + len) of a block whose gradient `grad` (same slice, any dtype) is made
    fp32 by `upcast` (a copy into a scratch of `limit` elements, scaled when clipping), then P16 = P32.

    The gradient goes through the scratch in runs of whole pieces: each parameter is cut at multiples of
    `limit` from its own start (`limit` a multiple of 4096), so the fused kernel sees every element at the
    offset from a tensor's start that a whole-parameter update gives it (its vector lanes, and the tail
    after them, fall on the same elements) and the result is bit-identical. The scratch, not the block,
    bounds the memory: a 24.6M-element tied embedding needs 16 MiB instead of 94 MiB.
    """
    if limit % 4096:
        raise ValueError(f"limit={limit} must be a multiple of 4096")
    hi = lo + p32.numel()
    pieces: list[tuple[int, int, bool]] = []  # [a, z) relative to lo, and whether it is decayed
    for spec in params:
        a, end = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
        while a < end:
            z = min(end, spec.offset + ((a - spec.offset) // limit + 1) * limit)
            pieces.append((a - lo, z - lo, spec.decay))
            a = z
    run: list[tuple[int, int, bool]] = []
    for piece in pieces + [None]:
        if run and (piece is None or piece[1] - run[0][0] > limit):
            first = run[0][0]  # the run is one contiguous range of the slice: parameters tile a block
            g32 = upcast(grad[first:run[-1][1]])
            _adamw([p32[a:z] for a, z, _ in run], [g32[a - first:z - first] for a, z, _ in run],
                   [m[a:z] for a, z, _ in run], [v[a:z] for a, z, _ in run], [d for _, _, d in run], step, hp)
            run = []
        if piece is not None:
            run.append(piece)
    p16.copy_(p32)
