"""CPU AdamW on a block's record, and the learning-rate schedule.

The update runs torch's fused AdamW kernel (`torch.optim.adamw.adamw(..., fused=True)`) on
per-parameter views of the block's flat P32/m/v vectors. Using the same functional as
`torch.optim.AdamW(fused=True)`, on tensors of the same shapes, makes the result bit-identical to
plain PyTorch training. The kernel releases the GIL, so it overlaps I/O and the compute thread;
it is 1.2-1.4x DeepSpeedCPUAdam on this kind of machine, which also holds the GIL (DESIGN.md §4.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from .config import EngineConfig
from .store import BlockLayout, RecordView, block_views


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
        return AdamWHyper(lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then cosine.

    Written as a plain function so a reference loop can use it through `torch.optim.lr_scheduler.LambdaLR`
    and get bit-identical learning rates (lr = base_lr * factor in both).
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(cfg: EngineConfig, step: int) -> float:
    return cfg.lr * lr_factor(step, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)


def adamw_block_(rec: RecordView, grad: torch.Tensor, block: BlockLayout, step: int, hp: AdamWHyper) -> None:
    """Update one block's record in place: P32, m, v by AdamW at 1-based step `step`, then P16 = P32.

    Args:
        rec: Views into the block's record buffer (read from the SSD).
        grad: The block's flat fp32 gradient (numel = block.numel).
        step: The optimizer step this update makes (1 for the first update), for bias correction.
    """
    params = block_views(rec.p32, block)
    # The fused kernel increments every state step in place, so each parameter needs its own tensor.
    steps = [torch.tensor(float(step - 1)) for _ in params]
    adamw(params, block_views(grad, block), block_views(rec.m, block), block_views(rec.v, block), [], steps,
          foreach=False, fused=True, amsgrad=False, maximize=False, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
          weight_decay=hp.weight_decay, eps=hp.eps)
    rec.p16.copy_(rec.p32)


def adamw_chunk_(p32: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p16: torch.Tensor,
                 step: int, hp: AdamWHyper) -> None:
    """AdamW on a flat slice of a block (parameter boundaries do not matter: the update is elementwise
    and every parameter shares the step and hyperparameters), then P16 = P32."""
    adamw([p32], [grad], [m], [v], [], [torch.tensor(float(step - 1))], foreach=False, fused=True,
          amsgrad=False, maximize=False, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
          weight_decay=hp.weight_decay, eps=hp.eps)
    p16.copy_(p32)
