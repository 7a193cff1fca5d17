"""Record geometry, defined once: how a block's optimizer states are laid out on the SSDs and in a host buffer.

A block's parameters are flattened into one vector of `n` elements; its record holds the fp32 master weights,
Adam's m and v, and the compute-dtype copy the forward reads (DESIGN.md §4.2):

    record(n) = [ P32: 4n | m: 4n | v: 4n | P16: c*n ]      each section padded to ALIGN (4 KiB)

That is the ``exact`` state format. The compressed ones (`lohan.plan.formats`) store the master and the moments
narrower and, with 8-bit moments, each moment's fp32 absmax per `QBLOCK` values of each parameter (q blocks):

    record(n) = [ master: a*n | m: b*n | v: b*n | m absmax: 4q | v absmax: 4q | P16: c*n ]

(``bf16-master`` has no separate P16: its master is what the compute reads; nor have ``exact`` records computed
in fp32, whose P16 would be the P32 bit for bit: `BlockLayout.shared_p16`.) `Sections` gives the offsets of
any unit, a whole record or a chunk of one; everything before the P16 is what the optimizer reads.

A chunk of a record (the optimizer updates blocks bigger than `opt_chunk_bytes` chunk by chunk) is laid out the
same way in its buffer, so `record_bytes` sizes both. The store (`lohan.store.states`) writes records at these
offsets, the optimizer (`lohan.runtime.offload`) reads and writes them, and the host-memory model
(`lohan.plan.pools`) sizes its buffers from them: one definition, so the three cannot drift. Torch-free; `align`
is a parameter so the capacity planner can price a model's pools without padding (`align=1`).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import asdict, dataclass

from io_engine.align import ALIGN, align_up
from lohan.plan.formats import QBLOCK, state_format


def state_bytes(n: int, align: int = ALIGN) -> int:
    """Padded size of each fp32 section (P32, m, v) of a record or chunk of `n` elements."""
    return align_up(4 * n, align)


def record_bytes(n: int, p16_itemsize: int, align: int = ALIGN) -> int:
    """Bytes of a record, or of a chunk's buffer, of `n` elements: P32 | m | v | P16, each section aligned."""
    return 3 * state_bytes(n, align) + align_up(p16_itemsize * n, align)


chunk_record_bytes = record_bytes
"""Buffer bytes of an optimizer chunk of n elements: the same sections as a whole record (the old name)."""


@dataclass(frozen=True)
class Sections:
    """Byte offsets of a unit's sections (a whole record, or a chunk of one: laid out alike in its buffer and
    in the record, each section padded) for `n` elements and `q` quantization blocks."""

    n: int
    q: int
    master: int
    m: int
    v: int
    m_scale: int
    v_scale: int
    p16: int
    """Where the P16 starts (``bf16-master``: 0, the master is the P16)."""
    state_end: int
    """Bytes the optimizer READs: every section but a separate P16."""
    total: int


@functools.lru_cache(maxsize=4096)  # (pure; the capacity search prices the same few units ~10^5 times)
def sections(n: int, q: int, fmt: str, p16_itemsize: int, align: int = ALIGN, shared_p16: bool = False) -> Sections:
    """The sections of a unit of `n` elements and `q` quantization blocks in state format `fmt`; `shared_p16`:
    the master is the P16 (no section of its own: `BlockLayout.shared_p16`)."""
    f = state_format(fmt)
    master = align_up(f.master_itemsize * n, align)
    moment = align_up(f.moment_itemsize * n, align)
    scale = align_up(4 * q, align) if f.quantized else 0
    end = master + 2 * moment + 2 * scale
    p16, total = (end, end + align_up(p16_itemsize * n, align)) if f.separate_p16 and not shared_p16 else (0, end)
    return Sections(n, q, 0, master, master + moment, master + 2 * moment, master + 2 * moment + scale, p16, end,
                    total)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter inside a block's flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int  # elements from the start of the block vector
    numel: int


@dataclass(frozen=True)
class BlockLayout:
    """Where one block's record lives and how its flat vector maps to parameters."""

    index: int
    name: str
    params: tuple[ParamSpec, ...]
    numel: int
    p16_itemsize: int
    offset: int  # bytes from the start of a slot
    fmt: str = "exact"  # the state format (`lohan.plan.formats`)
    shared_p16: bool = False
    """The master is the P16 the compute reads: no P16 section of its own (``exact`` states computed in fp32, whose
    P16 was a bit-for-bit copy of the master: 4 bytes a parameter less in RAM, on the SSDs and written per step;
    `StateFormat.keeps_p16`). False in a store laid out before it, which keeps its copy (`has_p16` says which)."""

    @property
    def has_p16(self) -> bool:
        """Whether the record has a P16 section of its own (else the master is read as the P16)."""
        return state_format(self.fmt).separate_p16 and not self.shared_p16

    @property
    def quantized(self) -> bool:
        return state_format(self.fmt).quantized

    def _qstarts(self) -> list[int]:
        """Index of each parameter's first quantization block (blocks counted per parameter), and the total."""
        out = [0]
        for p in self.params:
            out.append(out[-1] + -(-p.numel // QBLOCK))
        return out

    def qrange(self, lo: int, hi: int) -> tuple[int, int]:
        """The quantization blocks (first, end) holding elements lo..hi (none when the moments are not 8-bit)."""
        if not self.quantized or lo >= hi:
            return 0, 0
        starts, offsets = self._qstarts(), [p.offset for p in self.params]

        def block_of(at: int, up: bool) -> int:
            k = bisect.bisect_right(offsets, at) - 1
            d = at - self.params[k].offset
            return starts[k] + (-(-d // QBLOCK) if up else d // QBLOCK)
        end = starts[-1] if hi == self.numel else block_of(hi - 1, False) + 1
        return block_of(lo, False), end

    def cut_ok(self, at: int) -> bool:
        """Whether a unit may start or end at element `at`: anywhere with unquantized moments; with 8-bit ones
        only where no quantization block is split (a multiple of QBLOCK from its parameter's start)."""
        if not self.quantized or at in (0, self.numel):
            return True
        k = bisect.bisect_right([p.offset for p in self.params], at) - 1
        return (at - self.params[k].offset) % QBLOCK == 0

    def unit(self, lo: int, hi: int, align: int = ALIGN) -> Sections:
        """The sections of the unit lo..hi (the whole record when lo, hi = 0, numel)."""
        q0, q1 = self.qrange(lo, hi)
        return sections(hi - lo, q1 - q0, self.fmt, self.p16_itemsize, align, self.shared_p16)

    @property
    def sections(self) -> Sections:
        return self.unit(0, self.numel)

    @property
    def state_bytes(self) -> int:
        """Padded size of each fp32 region (P32, m, v) of an ``exact`` record."""
        return state_bytes(self.numel)

    @property
    def p16_bytes(self) -> int:
        return align_up(self.p16_itemsize * self.numel)

    @property
    def record_bytes(self) -> int:
        return self.sections.total

    @property
    def p16_start(self) -> int:
        """Offset of P16 inside the record."""
        return self.sections.p16

    def max_unit_bytes(self, chunk_elems: int, align: int = ALIGN) -> int:
        """Buffer bytes of this block's largest pipeline unit (whole, or chunks of `chunk_elems`)."""
        return max(self._unit_totals(chunk_elems, align))

    def units_bytes(self, chunk_elems: int, align: int = ALIGN) -> int:
        """Buffer bytes of all of this block's pipeline units at once."""
        return sum(self._unit_totals(chunk_elems, align))

    def _unit_totals(self, chunk_elems: int, align: int) -> list[int]:
        """Each pipeline unit's buffer bytes, in order. Without quantization blocks every full chunk is laid out
        alike: one is priced for all (a 175B block holds thousands)."""
        lows = range(0, self.numel, chunk_elems)
        if self.quantized or len(lows) < 3:
            return [self.unit(lo, min(lo + chunk_elems, self.numel), align).total for lo in lows]
        full, last = self.unit(0, chunk_elems, align).total, self.unit(lows[-1], self.numel, align).total
        return [full] * (len(lows) - 1) + [last]


@dataclass(frozen=True)
class StoreLayout:
    """The whole store: blocks, P16 dtype and slot count; serializable to JSON."""

    blocks: tuple[BlockLayout, ...]
    p16_dtype: str
    slots: int

    @property
    def slot_bytes(self) -> int:
        last = self.blocks[-1]
        return last.offset + last.record_bytes

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def param_count(self) -> int:
        return sum(b.numel for b in self.blocks)

    @property
    def state_format(self) -> str:
        return self.blocks[0].fmt if self.blocks else "exact"

    def record_offset(self, block: int, slot: int) -> int:
        if not 0 <= slot < self.slots:  # (a RAM slot's states are nowhere on the volume: store.states.RAM_SLOTS)
            raise ValueError(f"slot {slot} of block {block} is not on the SSDs (the store has {self.slots})")
        return slot * self.slot_bytes + self.blocks[block].offset

    def p16_offset(self, block: int, slot: int) -> int:
        return self.record_offset(block, slot) + self.blocks[block].p16_start

    def to_json(self) -> dict:
        return {"p16_dtype": self.p16_dtype, "slots": self.slots,
                "blocks": [{**asdict(b), "params": [asdict(p) for p in b.params]} for b in self.blocks]}

    @staticmethod
    def from_json(data: dict) -> StoreLayout:
        blocks = tuple(
            BlockLayout(index=b["index"], name=b["name"], numel=b["numel"], p16_itemsize=b["p16_itemsize"],
                        offset=b["offset"], fmt=b.get("fmt", "exact"),  # (stores from before the formats)
                        shared_p16=b.get("shared_p16", False),  # (stores from before it: a P16 section each)
                        params=tuple(ParamSpec(p["name"], tuple(p["shape"]), p["offset"], p["numel"])
                                     for p in b["params"]))
            for b in data["blocks"])
        return StoreLayout(blocks, data["p16_dtype"], data["slots"])


P16_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the compute-dtype copy (P16) by compute dtype (`store.states.DTYPES` holds the torch ones)."""
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Each compute dtype's name in ``torch``: the one table the torch dtypes are made from (`store.states.DTYPES`,
`models.hf_checkpoint.EXPORT_DTYPES`), kept here, torch-free, beside their itemsizes."""


def shares_p16(state_format_name: str, p16_dtype: str) -> bool:
    """Whether a store laid out now for `state_format_name` states and `p16_dtype` compute has the master as its
    P16 (`BlockLayout.shared_p16`): a format that keeps a separate P16, but not of this compute dtype."""
    f = state_format(state_format_name)
    return f.separate_p16 and not f.keeps_p16(P16_ITEMSIZE[p16_dtype])


def layout_of(numels: list[int] | tuple[int, ...], p16_dtype: str, slots: int = 2,
              names: list[str] | tuple[str, ...] | None = None, state_format: str = "exact") -> StoreLayout:
    """A layout of blocks of the given element counts, each one flat parameter: the geometry the planners price
    when they know a model's shape but not its modules (`store.states.plan_layout` lays out real ones)."""
    blocks, offset = [], 0
    shared = shares_p16(state_format, p16_dtype)
    for i, n in enumerate(numels):
        name = names[i] if names else f"block{i}"
        b = BlockLayout(i, name, (ParamSpec("flat", (n,), 0, n),), n, P16_ITEMSIZE[p16_dtype], offset, state_format,
                        shared)
        blocks.append(b)
        offset += b.record_bytes
    return StoreLayout(tuple(blocks), p16_dtype, slots)


def chunk_refusal(blocks: list, chunk_elems: int) -> str | None:
    """Why records of `blocks` (`BlockLayout`s) cannot be updated in chunks of `chunk_elems` elements: a chunk would
    split an 8-bit moment's quantization block; None where every cut is allowed (`BlockLayout.cut_ok`)."""
    for b in blocks:
        bad = [lo for lo in range(chunk_elems, b.numel, chunk_elems) if not b.cut_ok(lo)]
        if bad:
            return (f"block {b.index} ({b.name}) is updated in chunks of {chunk_elems} elements, and the chunk at "
                    f"element {bad[0]} would split an 8-bit quantization block (a parameter starts off a multiple of "
                    f"{QBLOCK} elements); raise engine.opt_chunk_bytes so the block is updated whole")
    return None
