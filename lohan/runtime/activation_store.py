"""Activation records: carries out a Plan's per-op swap / recompute decisions (DESIGN.md §4.4) for the
`ActivationManager` (`runtime/activations.py`), which calls it block by block.

The engine runs each transformer block twice: forward under no_grad, and again with grad in
backward. Between the two, a block needs its input plus whatever the plan swaps:

- Forward: `SelectiveMode(tracker, swap)` (no ``replay``) watches the aten ops of the block. Ops
  issued inside a swapped sub-module (tracked by `OpTracker`'s module hooks) have their outputs
  recorded; `ActivationStore.put` makes the block input and these outputs one *record*, packed into
  one contiguous buffer and placed on its tier: ``keep`` (left on the device), ``cpu`` (a budgeted
  host pool; on a CPU device the tensors themselves, within that budget, instead of a packed copy)
  or ``ssd`` (written through io_engine and read back one block ahead in backward, `prefetch`). With
  ``act_compress: int8`` a ``cpu`` or ``ssd`` record's floating tensors are int8 codes and row scales from the
  moment they leave the device (`act_quant`); `take` dequantizes them on the device.
- Backward: `ActivationStore.take` hands the record back (`stage` started its copy to the device),
  and `SelectiveMode(tracker, swap, replay=records)` re-runs the block with grad; a swapped op
  returns its recorded output instead of computing, so only the other ops are recomputed. The
  dispatch mode sits below autograd, so the op's backward node is recorded as usual and saves what
  it needs (e.g. attention saves its recorded output and logsumexp; kernels that compute the logsumexp only
  under grad are asked for it when recording, `_with_logsumexp`).
- What a record holds: a block's first replay learns which recorded outputs its backward reads (`ReadWatch`:
  what autograd saves and what a recomputed op takes); later records keep only those, and the others come
  back as uninitialized memory of their shape (`Dropped`), which only replayed ops take. In a step the mode is
  entered only while a swapped sub-module runs (`SelectiveMode.scoped`; a replay that learns sees every op),
  so the block's other ops cost what they cost without it.

Why not torch's selective checkpoint (`create_selective_checkpoint_contexts`) plus
`saved_tensors_hooks`: the checkpoint keeps the outputs of MUST_SAVE ops in a private cache as
plain references, and its own saved-tensor hooks shadow any outer ones, so neither the bytes it
keeps nor their tier can be controlled from outside. Recording and replaying at the same aten
level does the same thing with the storage in our hands.

Replayed values are the very values recomputation would give (same kernels, same inputs), so
every plan yields bit-identical gradients (int8 records: those of a recompute from the dequantized values,
`tests/unit/runtime/test_act_compress.py`); a replay that does not meet the op it recorded (a
block whose op sequence is not deterministic) is an error, not a silent mismatch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from io_engine import AlignedBuffer, BufferPool, Handle
from io_engine.base import BudgetExceededError, align_up
from io_engine.priority import Priority
from lohan.runtime import act_quant
from lohan.runtime.device import Device, Transfer

log = logging.getLogger(__name__)

TENSOR_ALIGN = 64  # each tensor of a packed record starts on a cache line


class _Packed:
    """Marks a record leaf whose value lives in the packed buffer. A sentinel, not None: ops return None among
    their outputs too (CUDA's attention kernels do), and those must come back as None."""

    def __repr__(self) -> str:
        return "<packed>"


PACKED = _Packed()


class ActivationReplayError(RuntimeError):
    """The recompute did not issue the ops that were recorded in forward."""


def block_ops(block: nn.Module) -> list[str]:
    """The ops of a block a plan can swap: its direct sub-modules, in registration order."""
    return [name for name, _ in block.named_children()]


class OpTracker:
    """Knows which named op (direct sub-module of a block) is running, through module hooks; and enters the
    `SelectiveMode` it is given (`SelectiveMode.scoped`) only while one of that mode's swapped ops runs."""

    def __init__(self, blocks: Iterable[nn.Module]) -> None:
        self.current: str | None = None
        self.mode: SelectiveMode | None = None
        self._entered = False
        self._handles = []
        for block in blocks:
            for name, child in block.named_children():
                self._handles.append(child.register_forward_pre_hook(self._enter(name)))
                self._handles.append(child.register_forward_hook(self._leave(name), always_call=True))

    def _enter(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.current = name
            if self.mode is not None and name in self.mode.swap:
                self.mode.__enter__()
                self._entered = True
        return hook

    def _leave(self, name: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self.current = None
            if self._entered:
                self._entered = False
                self.mode.__exit__(None, None, None)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


_ALIASING: dict[Any, tuple[bool, bool]] = {}
# Ops whose output is a view of their input although their schema does not say so: recorded, the view would be
# a second copy of the output it views (a Linear on a 3-d input is mm, then _unsafe_view to the input's shape).
_UNANNOTATED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


def _aliasing(func: Any) -> tuple[bool, bool]:
    """(alias, view) of an op: its outputs alias its inputs (views, in-place and out= ops: free to redo, and
    recording them saves nothing); and it is a view that writes nothing, so running it reads no values."""
    hit = _ALIASING.get(func)
    if hit is None:
        alias = func in _UNANNOTATED_VIEWS or any(r.alias_info is not None for r in func._schema.returns)
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        hit = _ALIASING[func] = (alias, alias and not writes)
    return hit


def _is_alias(func: Any) -> bool:
    return _aliasing(func)[0]


@dataclass(frozen=True)
class Dropped:
    """A recorded output that the block's recompute never reads (`ReadWatch`): the record keeps its shape only,
    and the replay hands back uninitialized memory of that shape (`blank`), so the ops after it (replayed too)
    see the tensor they expect."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: Tensor) -> Dropped:
        return Dropped(tuple(t.shape), tuple(t.stride()), t.dtype)

    def blank(self, like: Tensor) -> Tensor:
        """Memory for it, on the device of `like` (an input of the op it came from)."""
        return like.new_empty_strided(self.size, self.stride, dtype=self.dtype)


def _memory(t: Tensor) -> Tensor:
    """The tensor whose memory `t` is: itself, or a simulated device's CPU tensor (`simdevice.SimTensor._inner`)."""
    return getattr(t, "_inner", t)


class ReadWatch:
    """Learns which recorded outputs a block's recompute reads, on its first replay: those autograd saves for
    the backward (`saved_tensors_hooks`), those a recomputed op reads (an op outside the swapped sub-modules, or
    one that writes), and the block's output. The others are only inputs of replayed ops (whose outputs come
    from the record): a Llama block's q and k projections, the rotary embedding's products, halves and
    concatenations, ~30% of its record. Memory is what counts, so a view of a recorded output reads it.

    Records hold the same ops in every step (a replay that does not meet them is an error), so what the first
    replay reads is what every replay reads; later records leave the rest out (`Dropped`)."""

    def __init__(self) -> None:
        self._spans: list[tuple[torch.device, int, int]] = []

    def mark(self, tree: Any) -> None:
        """Every tensor in `tree` is read."""
        for t in tree_flatten(tree)[0]:
            if isinstance(t, Tensor):
                self._spans.append(_span(t))

    def saved(self) -> Any:
        """The context under which the recompute's saved tensors are marked (they are kept as they are)."""
        def pack(t: Tensor) -> Tensor:
            self._spans.append(_span(t))
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def unread(self, records: list[OpRecord]) -> frozenset[int]:
        """Positions (over all records' leaves, in order) of the recorded tensors nothing read."""
        out, pos = set(), 0
        for r in records:
            for x in r.leaves:
                if isinstance(x, Tensor) and x.numel() and not any(_overlap(_span(x), s) for s in self._spans):
                    out.add(pos)
                pos += 1
        return frozenset(out)


def _span(t: Tensor) -> tuple[torch.device, int, int]:
    """The bytes [lo, hi) a tensor's elements occupy (its device: addresses of two devices never overlap)."""
    m = _memory(t)
    if m.numel() == 0:
        return (m.device, 0, 0)
    lo = hi = 0
    for n, st in zip(m.shape, m.stride()):
        lo, hi = lo + min(0, (n - 1) * st), hi + max(0, (n - 1) * st)
    base, size = m.data_ptr(), m.element_size()
    return (m.device, base + lo * size, base + (hi + 1) * size)


def _overlap(a: tuple[torch.device, int, int], b: tuple[torch.device, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


@dataclass
class OpRecord:
    op: str              # the sub-module the aten op ran in
    func: Any            # the aten op (OpOverload; compared by identity on replay, not by name)
    spec: Any            # pytree spec of its outputs
    leaves: list[Any]    # outputs, tensors recorded (and later packed) as they are


# Attention kernels that compute the logsumexp their backward needs only when asked, and are asked only
# when grad is enabled (CUDA's memory-efficient and cuDNN SDPA; position of `compute_log_sumexp`). Records
# are taken in a no_grad forward, so a recorded output would lack it and the replayed backward would fail
# ("LSE is not correctly aligned") or be wrong. Flash attention always returns it.
_LSE_FLAG = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default: 4,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: 4,
}


def _with_logsumexp(func: Any, args: tuple) -> tuple:
    """`args` asking an attention kernel for its logsumexp, as the recompute with grad will (the output is the
    same; the record then holds what the backward needs, and its bytes are priced with it)."""
    at = _LSE_FLAG.get(func)
    if at is None or len(args) <= at or args[at]:
        return args
    return (*args[:at], True, *args[at + 1:])


class SelectiveMode(TorchDispatchMode):
    """Records (forward) or replays (backward recompute) the outputs of ops in swapped sub-modules.

    Recording leaves out the outputs at the positions in `drop` (what a `ReadWatch` found unread: a `Dropped`
    stands in). A replay with `watch` tells it what the ops it recomputes read."""

    def __init__(self, tracker: OpTracker, swap: frozenset[str], replay: list[OpRecord] | None = None,
                 drop: frozenset[int] = frozenset(), watch: ReadWatch | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.swap = swap
        self.records: list[OpRecord] = []
        self._replay = replay
        self._next = 0
        self._drop = drop
        self._leaf = 0  # position of the next recorded leaf (over all records), for `drop`
        self._watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = self.tracker.current
        alias, view = _aliasing(func)
        if op is None or op not in self.swap or alias:
            if self._watch is not None and not view:
                self._watch.mark((args, kwargs))
            return func(*args, **kwargs)
        if self._replay is None:
            out = func(*_with_logsumexp(func, args), **kwargs)
            leaves, spec = tree_flatten(out)
            self.records.append(OpRecord(op, func, spec, [self._keep(x, args) for x in leaves]))
            return out
        rec = self._replay[self._next] if self._next < len(self._replay) else None
        if rec is None or (rec.op, rec.func) != (op, func):
            want = f"{rec.func} in op {rec.op!r}" if rec else "nothing"
            raise ActivationReplayError(
                f"recompute issued {func} in op {op!r} where forward recorded {want} (record {self._next}); "
                "the block's op sequence is not deterministic, so it cannot be swapped: use "
                "activation policy 'interblock' for this model")
        self._next += 1
        like = next((a for a in tree_flatten(args)[0] if isinstance(a, Tensor)), None)
        return tree_unflatten([x.detach() if isinstance(x, Tensor) else x.blank(like) if isinstance(x, Dropped)
                               else x for x in rec.leaves], rec.spec)

    def _keep(self, x: Any, args: tuple) -> Any:
        """What the record keeps of output leaf `x`: the tensor, or only its shape when no replay reads it (and
        the op has a tensor input on its device, which the replay makes the blank like)."""
        pos, self._leaf = self._leaf, self._leaf + 1
        if not isinstance(x, Tensor):
            return x
        if pos in self._drop:
            like = next((a for a in tree_flatten(args)[0] if isinstance(a, Tensor)), None)
            if like is not None and like.device == x.device:
                return Dropped.of(x)
        return x.detach()

    @contextlib.contextmanager
    def scoped(self) -> Iterator[SelectiveMode]:
        """The mode in force only inside its swapped ops (the tracker enters and leaves it): every other op of
        the block runs without a call into Python, as it would without the mode (`with mode:` instead sees
        every op, as a `ReadWatch` must)."""
        if self.tracker.mode is not None:
            raise RuntimeError("another SelectiveMode is scoped on this tracker")
        self.tracker.mode = self
        try:
            yield self
        finally:
            self.tracker.mode = None

    def check_done(self) -> None:
        if self._replay is not None and self._next != len(self._replay):
            raise ActivationReplayError(f"recompute used {self._next} of {len(self._replay)} recorded op outputs")


# ---------------------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class _Slot:
    offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    span: int  # elements the strided view covers


def _dense_span(t: Tensor) -> int | None:
    """numel if the tensor covers its memory without gaps or overlap (any dim order), else None."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return t.numel()


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _layout(tensors: list[Tensor]) -> tuple[list[_Slot], int]:
    slots, off = [], 0
    for t in tensors:
        span = _dense_span(t)
        size, stride = tuple(t.shape), tuple(t.stride())
        if span is None:  # stored contiguous: the values matter, not the memory layout
            span, stride = t.numel(), _contiguous_strides(size)
        slots.append(_Slot(off, t.dtype, size, stride, span))
        off = align_up(off + span * t.element_size(), TENSOR_ALIGN)
    return slots, off


def record_nbytes(tensors: list[Tensor]) -> int:
    """Bytes a record of these tensors occupies when packed."""
    return _layout(tensors)[1]


def _views(buf: Tensor, slots: list[_Slot]) -> list[Tensor]:
    out = []
    for s in slots:
        nbytes = s.span * torch.empty(0, dtype=s.dtype).element_size()
        region = buf[s.offset:s.offset + nbytes].view(s.dtype)
        out.append(torch.as_strided(region, s.size, s.stride) if s.size else region.view(()))
    return out


# ---------------------------------------------------------------------------------------------- store
@dataclass
class _Entry:
    tier: str
    records: list[OpRecord]
    tensors: list[Tensor] | None = None  # held as they are: keep tier, or cpu on a CPU device
    slots: list[_Slot] | None = None
    nbytes: int = 0
    buf: AlignedBuffer | None = None
    offset: int = -1
    handle: Handle | None = None
    event: Any = None  # a separate device: the copy from the device into `buf` (until it is written to the SSDs)
    transfer: Transfer | None = None  # a separate device: the record's copy back to the device (stage)
    codes: list[act_quant.Int8Rows | None] | None = None  # compressed: how to get each tensor back (act_quant.decode)


class ActivationStore:
    """Holds each (block, micro-batch) record on its tier between forward and backward.

    `keep` records stay on the device as they are. `cpu` records live in `cpu_pool`, a hard-budgeted
    host pool (on a CPU device the tensors are held as they are, counted against that budget). `ssd`
    records are packed into a staging buffer and written to `volume` at the next free offset; the
    staging buffer goes back to `staging_pool` when the write completes, and `prefetch` reads records
    back into it ahead of use. Forward: `put` per record, `end_forward` after the last. Backward:
    `prefetch`, `stage` (the copy back to the device), `take`, `release`; `end_step` drops the rest.

    With ``compress="int8"`` a `cpu` or `ssd` record is quantized on the device before it leaves
    (`act_quant.encode`: int8 codes and fp32 row scales), so the copies and the tiers carry those, and `take`
    dequantizes it on the device (`act_quant.decode`). `keep` records never leave the device and stay as they are.
    """

    def __init__(self, device: Device, cpu_pool: BufferPool | None = None, staging_pool: BufferPool | None = None,
                 volume: Any = None, compress: str = "none") -> None:
        if compress not in act_quant.MODES:
            raise ValueError(f"compress={compress!r}: choose one of {', '.join(act_quant.MODES)}")
        self.device = device
        self.compress = compress
        self.cpu_pool = cpu_pool
        self.staging_pool = staging_pool
        self.volume = volume
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._writes: list[tuple[AlignedBuffer, Handle]] = []
        self._outgoing: list[_Entry] = []  # ssd records whose copy from the device is not yet known complete
        self._draining: list[tuple[AlignedBuffer, Any]] = []  # host buffers a device copy may still use
        self._ssd_next = 0
        self.bytes = {"keep": 0, "cpu": 0, "ssd": 0}  # as stored (compressed records: their codes and scales)
        self.raw_bytes = {"keep": 0, "cpu": 0, "ssd": 0}  # the same records as the device made them
        self.peak_cpu_bytes = 0
        self._cpu_bytes = 0

    # -- forward
    def put(self, key: tuple[int, int], x: Tensor, records: list[OpRecord], tier: str) -> None:
        """Store block input `x` and the recorded op outputs of one block and micro-batch on `tier`."""
        # Only device tensors are packed and copied. An op may also return host tensors (CUDA's flash and
        # memory-efficient attention return their RNG seed and offset on the CPU): those stay as they are.
        packs = self.device.holds
        tensors = [x.detach()] + [t for r in records for t in r.leaves if packs(t)]
        entry = _Entry(tier, records)
        if tier not in ("keep", "cpu", "ssd"):
            raise ValueError(f"unknown activation tier {tier!r} (keep, cpu or ssd)")
        raw = record_nbytes(tensors)
        if self.compress == "int8" and tier != "keep":  # on the device, so the copy carries the codes
            tensors, entry.codes = act_quant.encode(tensors)
        held = tier == "keep" or (tier == "cpu" and self.device.is_host)
        if held:
            # On a CPU device the tensors already are in main memory: a `cpu` record holds them as they are
            # (within the pool's budget) instead of packing a copy (~0.3 GB a step for a 110M Llama)
            entry.tensors = tensors
            entry.nbytes = record_nbytes(tensors)
            if tier == "cpu":
                self._count_cpu(entry.nbytes)
        else:
            entry.slots, entry.nbytes = _layout(tensors)
            if tier == "cpu":
                if self.cpu_pool is None:
                    raise RuntimeError("no CPU activation pool was set up for a 'cpu' record")
                entry.buf = self.cpu_pool.acquire(max(entry.nbytes, 1), block=False)
                self._count_cpu(entry.buf.tensor.numel())
            else:
                entry.buf = self._staging(entry.nbytes)
            # on the download stream, in order: the last copy's event completes them all
            for view, t in zip(_views(entry.buf.tensor, entry.slots), tensors):
                entry.event = self.device.to_host(t, view)
            if tier == "ssd":
                size = align_up(entry.nbytes)
                if self.volume is None or self._ssd_next + size > self.volume.capacity_bytes:
                    cap = 0 if self.volume is None else self.volume.capacity_bytes
                    raise RuntimeError(f"activation volume full: {self._ssd_next + size} bytes needed, capacity "
                                       f"{cap}; the plan under-estimated this step's SSD bytes")
                entry.offset = self._ssd_next
                self._ssd_next += size
                self._outgoing.append(entry)  # written once its copy from the device is complete
                self._write_out(wait=False)
        if not held or entry.codes is not None:  # the record keeps metadata only; values live in the stored tensors
            for r in records:
                r.leaves = [PACKED if packs(t) else t for t in r.leaves]
        self.bytes[tier] += entry.nbytes
        self.raw_bytes[tier] += raw
        self._entries[key] = entry

    def _count_cpu(self, nbytes: int) -> None:
        """Account a `cpu` record's bytes; one held as tensors is checked against the pool's budget as the
        pool would check a buffer."""
        if self.cpu_pool is None:
            raise RuntimeError("no CPU activation pool was set up for a 'cpu' record")
        if not self.device.is_host or self._cpu_bytes + nbytes <= self.cpu_pool.budget_bytes:
            self._cpu_bytes += nbytes
            self.peak_cpu_bytes = max(self.peak_cpu_bytes, self._cpu_bytes)
            return
        raise BudgetExceededError(f"activation records need {self._cpu_bytes + nbytes} bytes of main memory, over "
                                  f"the {self.cpu_pool.budget_bytes} budgeted for them")

    def _write_out(self, wait: bool) -> None:
        """Issue the SSD writes of the records whose copies from the device are complete (all, with `wait`)."""
        while self._outgoing and (wait or self._outgoing[0].event.query()):
            entry = self._outgoing.pop(0)
            entry.event.synchronize()
            size = align_up(entry.nbytes)
            self._writes.append((entry.buf, self.volume.write(entry.buf.tensor[:size], entry.offset, priority=Priority.WRITE)))
            entry.buf, entry.event = None, None

    def _staging(self, nbytes: int) -> AlignedBuffer:
        """A staging buffer; frees the buffers of finished writes and copies first, waits for the oldest if
        needed."""
        self._reap(wait=False)
        while True:
            try:
                return self.staging_pool.acquire(align_up(nbytes), block=False)
            except BudgetExceededError:
                if self._outgoing:
                    self._write_out(wait=True)
                elif self._draining:
                    self._reap_copies(wait=True)
                elif self._writes:
                    self._reap(wait=True, first_only=True)
                else:
                    raise

    def _reap(self, wait: bool, first_only: bool = False) -> None:
        self._reap_copies(wait=False)
        keep = []
        for n, (buf, h) in enumerate(self._writes):
            if (wait and (not first_only or n == 0)) or h.done():
                h.wait(expedite=Priority.URGENT)  # the compute waits on it: not behind background READs
                buf.release()
            else:
                keep.append((buf, h))
        self._writes = keep

    def _reap_copies(self, wait: bool) -> None:
        """Give back the host buffers whose copies to the device have completed (all of them, with `wait`)."""
        pending = []
        for buf, event in self._draining:
            if wait:
                event.synchronize()
            if wait or event.query():
                buf.release()
            else:
                pending.append((buf, event))
        self._draining = pending

    def end_forward(self) -> None:
        """After the forward: every record leaving for the SSDs is written (or on its way)."""
        self._write_out(wait=True)

    # -- backward
    def prefetch(self, keys: Iterable[tuple[int, int]]) -> None:
        """Start reading the SSD records among `keys` back into staging buffers."""
        for key in keys:
            e = self._entries.get(key)
            if e is not None and e.event is not None:  # still on its way out: its write goes first
                self._write_out(wait=True)
            if e is None or e.tier != "ssd" or e.buf is not None:
                continue
            size = align_up(e.nbytes)
            e.buf = self._staging(size)
            self._reap(wait=True)  # a read must not overtake the write of the same bytes
            e.handle = self.volume.read_into(e.buf.tensor[:size], e.offset, priority=Priority.URGENT)  # backward waits

    def stage(self, keys: Iterable[tuple[int, int]]) -> None:
        """Start copying the packed records among `keys` back to the device (waiting for their SSD reads), so
        the copies run beside the compute queued before; `take` then orders the compute stream after them."""
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.tensors is not None or e.transfer is not None:
                continue
            if e.tier == "ssd":
                if e.buf is None:
                    self.prefetch([key])
                e.handle.wait()
            # a `cpu` record's copy from the device may still be writing the buffer, on the other copy engine
            e.transfer = self.device.to_device(e.buf.tensor[:e.nbytes], after=e.event)

    def take(self, key: tuple[int, int]) -> tuple[Tensor, list[OpRecord]]:
        """The block input (on the device) and the records to replay; call `release(key)` after backward."""
        e = self._entries[key]
        unpack = e.tensors is None or e.codes is not None  # the records' leaves were replaced by PACKED
        if e.tensors is not None:  # held as they are (keep, or cpu on a CPU device)
            tensors = e.tensors
        else:
            if e.transfer is None:
                self.stage([key])
            self.device.wait(e.transfer.event)
            tensors = _views(e.transfer.tensor, e.slots)
            if not self.device.is_host:  # the device copy is independent of the host buffer once complete
                self._free(e)
        if e.codes is not None:  # dequantized on the device, just before the recompute uses them
            tensors = act_quant.decode(tensors, e.codes)
        if unpack:
            it = iter(tensors[1:])
            for r in e.records:
                r.leaves = [next(it) if t is PACKED else t for t in r.leaves]
        return tensors[0], e.records

    def release(self, key: tuple[int, int]) -> None:
        """Drop a record after its block's backward (its buffer goes back to its pool)."""
        e = self._entries.pop(key, None)
        if e is not None:
            self._free(e)

    def _free(self, e: _Entry) -> None:
        if e.tensors is not None:
            if e.tier == "cpu":
                self._cpu_bytes -= e.nbytes
            e.tensors = None
            return
        if e.buf is None:
            return
        if e.tier == "cpu":
            self._cpu_bytes -= e.buf.tensor.numel()
        if e.transfer is not None:  # its copy to the device may still read it
            self._draining.append((e.buf, e.transfer.event))
        elif e.event is not None:  # its copy from the device may still write it
            self._draining.append((e.buf, e.event))
        else:
            e.buf.release()
        e.buf, e.transfer, e.event = None, None, None

    def end_step(self) -> None:
        """Drop every record (after a step or on failure) and wait for writes still in flight."""
        for key in list(self._entries):
            e = self._entries[key]
            if e.handle is not None:
                try:
                    e.handle.wait()
                except Exception:  # the step is being abandoned; its buffer is all that matters now
                    pass
            self.release(key)
        self._outgoing = [e for e in self._outgoing if e.buf is not None]  # released above: nothing to write
        self._reap(wait=True)
        self._reap_copies(wait=True)
        self._ssd_next = 0
        self._cpu_bytes = 0
        self.bytes = {"keep": 0, "cpu": 0, "ssd": 0}
        self.raw_bytes = {"keep": 0, "cpu": 0, "ssd": 0}
