"""A block's gradient as autograd left it: one tensor per parameter, handed to the optimizer without being copied
into a flat host buffer (issue 39: on a CPU compute device the copy moved 4 bytes per parameter a step in fp32, and
the gradient pool it needs held every block's buffer while idle, at the LM head's backward peak too).

The optimizer reads a block's gradient as a flat vector, but only ever a piece of one parameter at a time (AdamW
per parameter, a chunk cut at parameter bounds, a format's pieces); where it takes a run of several parameters at
once (the fp32 scratch of `offload.GradOffloader._fp32`) it copies them one by one. So `ParamGrads` answers a slice
within one parameter with a view of that parameter's own tensor, and a slice across parameters with a
`ParamGrads` of the parts (no copy either way); `copy_into` gathers one into a flat tensor.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


class ParamGrads:
    """Elements ``0..numel()`` of a block's flat gradient held as per-parameter flat tensors (`parts`, each starting
    at its element in `starts`, tiling the range). `release` lets go of them (the buffer protocol of the optimizer's
    gradients: `io_engine.AlignedBuffer.release`)."""

    def __init__(self, parts: Sequence[torch.Tensor], starts: Sequence[int]) -> None:
        if len(parts) != len(starts) or not parts:
            raise ValueError(f"{len(parts)} gradient tensors for {len(starts)} parameters")
        self.parts: list[torch.Tensor] | None = [p.reshape(-1) for p in parts]  # (views: they are contiguous)
        self.starts = list(starts)
        self.dtype = self.parts[0].dtype
        self._numel = self.starts[-1] + self.parts[-1].numel() - self.starts[0]
        if self.starts[0] != 0:
            raise ValueError(f"the first gradient tensor starts at element {self.starts[0]}, not 0")

    @classmethod
    def of(cls, grads: Sequence[torch.Tensor], offsets: Sequence[int], dtype: torch.dtype) -> tuple[ParamGrads, int]:
        """A block's gradient from autograd's per-parameter gradients (`offsets`: each parameter's first element in
        the block), and the bytes copied to make it: none, unless a gradient is not contiguous or not of `dtype`."""
        copied, out = 0, []
        for g in grads:
            if g.dtype != dtype or not g.is_contiguous():
                g = g.to(dtype=dtype, memory_format=torch.contiguous_format)
                copied += g.numel() * g.element_size()
            out.append(g)
        return cls(out, offsets), copied

    @property
    def tensor(self) -> ParamGrads:
        """Itself: what a stashed gradient's `tensor` gives (`store.gradstash.StashedGrad`)."""
        return self

    def numel(self) -> int:
        return self._numel

    def _live(self) -> list[torch.Tensor]:
        if self.parts is None:
            raise RuntimeError("the gradient was used after it was released")
        return self.parts

    def __getitem__(self, s: slice) -> torch.Tensor | ParamGrads:
        """Elements ``s.start..s.stop`` (step 1): a view of one parameter's tensor where they lie in one, else a
        `ParamGrads` of the parts they cover, counted from ``s.start``."""
        lo, hi, step = s.indices(self._numel)
        if step != 1 or hi < lo:
            raise ValueError(f"a gradient is sliced by a range of elements, not {s}")
        parts = self._live()
        k = bisect.bisect_right(self.starts, lo) - 1
        end = self.starts[k] + parts[k].numel()
        if hi <= end:
            return parts[k][lo - self.starts[k]:hi - self.starts[k]]
        out, at = [], []
        while k < len(parts) and self.starts[k] < hi:
            a, z = max(lo, self.starts[k]), min(hi, self.starts[k] + parts[k].numel())
            out.append(parts[k][a - self.starts[k]:z - self.starts[k]])
            at.append(a - lo)
            k += 1
        return ParamGrads(out, at)

    def copy_into(self, out: torch.Tensor) -> None:
        """Copy every element into the flat tensor `out` (same numel; cast to its dtype as `Tensor.copy_` does)."""
        for a, p in zip(self.starts, self._live(), strict=True):
            out[a:a + p.numel()].copy_(p)

    def release(self) -> None:
        """Let go of the tensors (their memory goes back once nothing else holds them)."""
        self.parts = None
