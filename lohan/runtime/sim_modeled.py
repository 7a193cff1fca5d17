"""The simulated device's ``compute=modeled`` (`SimGpu.arithmetic` False): each op's result without its arithmetic.

A lane benchmark on a small CPU box wants the host's cores for what a GPU box's host runs (dispatch, the CPU AdamW,
hashing, I/O), not for the emulated GPU's math. So an op that makes a new tensor yields zeros of the shape, strides
and dtype its meta kernel gives, and an op that writes in place leaves what it writes as it was: no device memory is
ever written. Every zero result is then a view of one shared zero buffer per dtype (no allocation, no memset), and
the meta kernel's answer is cached per signature (the op, its tensors' shapes, strides and dtypes, its other
arguments; floats by type only): the meta kernels of pointwise ops are Python reference code, slower per call than
the small ops they stand for. The results are not the model's, so the losses are not either: benchmarks only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

REAL = object()
"""`ModeledCompute.result`: this op has no meta kernel (or an unusual schema) and must run for real."""

_CACHE_LIMIT = 1 << 14  # signatures kept; a run's distinct op signatures are a few hundred


class ModeledCompute:
    """Zeros of each op's result shape, from one shared buffer per dtype."""

    def __init__(self) -> None:
        self._zeros: dict[torch.dtype, Tensor] = {}
        self._specs: dict[Any, Any] = {}
        self.meta_calls = 0  # ops whose result shape a meta kernel computed (the rest came from the cache)

    def zeros(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
              stride: tuple[int, ...] | None = None) -> Tensor:
        """A view of `shape` (and `stride`; contiguous by default) into the shared zeros of `dtype`."""
        shape = tuple(shape)
        if stride is None:
            stride, step = [], 1
            for n in reversed(shape):
                stride.append(step)
                step *= max(n, 1)
            stride = tuple(reversed(stride))
        span = 0 if any(n == 0 for n in shape) else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        buf = self._zeros.get(dtype)
        if buf is None or buf.numel() < max(span, 1):
            buf = self._zeros[dtype] = torch.zeros(max(span, 1, 2 * (0 if buf is None else buf.numel())), dtype=dtype)
        return buf.as_strided(shape, stride)

    def result(self, func: Any, args: tuple, kwargs: dict, writes: list[int],
               price: Callable[[Any], float]) -> tuple[Any, float]:
        """`func`'s result on plain (host) tensors without its arithmetic, and its modeled seconds: the written
        arguments (`writes`: their positions in the schema) as they were, or zeros of the result's shape; (`REAL`,
        0) where it must run. ``price(result)`` gives the seconds the first time a signature is met; they are
        cached with it (an op's FLOPs and bytes follow from its signature, as its result's shape does, and
        pricing was a third of the emulator's time per op)."""
        try:
            key = (func, _signature(args), _signature(kwargs))
        except TypeError:  # an unhashable argument: not cached
            key = None
        entry = self._specs.get(key) if key is not None else None
        if writes:
            out = _written(func, args, kwargs, writes)
            if out is REAL:
                return REAL, 0.0
            if entry is None:
                entry = self._keep(key, (None, price(out)))
            return out, entry[1]
        if entry is None:
            spec = self._meta_spec(func, args, kwargs)
            if spec is REAL:
                return REAL, 0.0
            out = _build(spec, self.zeros)
            return out, self._keep(key, (spec, price(out)))[1]
        return _build(entry[0], self.zeros), entry[1]

    def _keep(self, key: Any, entry: tuple[Any, float]) -> tuple[Any, float]:
        if key is not None:
            if len(self._specs) >= _CACHE_LIMIT:
                self._specs.clear()
            self._specs[key] = entry
        return entry

    def _meta_spec(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The result's structure with each tensor as ("T", shape, stride, dtype), from the meta kernel."""
        self.meta_calls += 1
        try:
            meta = func(*_on_meta(args), **_on_meta(kwargs))
        except (NotImplementedError, RuntimeError):
            return REAL
        return _spec(meta)


def _written(func: Any, args: tuple, kwargs: dict, writes: list[int]) -> Any:
    """An in-place or out= op's result: the arguments it writes, as they were (`REAL`: an unusual schema)."""
    outs = [args[k] if k < len(args) else kwargs.get(func._schema.arguments[k].name) for k in writes]
    returns = len(func._schema.returns)
    if returns == 0:
        return None
    if returns == len(outs) and all(isinstance(t, Tensor) for t in outs):
        return outs[0] if returns == 1 else tuple(outs)
    return REAL


def _signature(tree: Any) -> Any:
    """A hashable stand-in for an op's arguments: tensors by shape, stride and dtype, floats by type (no result
    shape depends on a float's value), the rest as they are (TypeError if unhashable)."""
    if isinstance(tree, Tensor):
        return ("T", tuple(tree.shape), tree.stride(), tree.dtype)
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(_signature(x) for x in tree))
    if isinstance(tree, dict):
        return ("D", tuple((k, _signature(v)) for k, v in tree.items()))
    if isinstance(tree, float):
        return float
    hash(tree)
    return tree


def _on_meta(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return torch.empty_strided(tree.size(), tree.stride(), dtype=tree.dtype, device="meta")
    if isinstance(tree, (list, tuple)):
        return type(tree)(_on_meta(x) for x in tree) if type(tree) in (list, tuple) else tree
    if isinstance(tree, dict):
        return {k: _on_meta(v) for k, v in tree.items()}
    return tree


def _spec(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return ("T", tuple(tree.shape), tree.stride(), tree.dtype)
    if type(tree) in (list, tuple):
        return (type(tree), [_spec(x) for x in tree])
    if isinstance(tree, tuple):  # a structseq (torch.return_types): rebuilt as a plain tuple, as aten returns
        return (tuple, [_spec(x) for x in tree])
    return ("V", tree)


def _build(spec: Any, zeros: Any) -> Any:
    if spec[0] == "T":
        return zeros(spec[1], spec[3], spec[2])
    if spec[0] == "V":
        return spec[1]
    return spec[0](_build(x, zeros) for x in spec[1])
