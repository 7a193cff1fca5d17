"""Record geometry, defined once: how a block's optimizer states are laid out on the SSDs and in a host buffer.

A block's parameters are flattened into one vector of `n` elements; its record holds the fp32 master weights,
Adam's m and v, and the compute-dtype copy the forward reads (DESIGN.md §4.2):

    record(n) = [ P32: 4n | m: 4n | v: 4n | P16: c*n ]      each section padded to ALIGN (4 KiB)

A chunk of a record (the optimizer updates blocks bigger than `opt_chunk_bytes` chunk by chunk) is laid out the
same way in its buffer, so `record_bytes` sizes both. The store (`lohan.store.states`) writes records at these
offsets, the optimizer (`lohan.runtime.offload`) reads and writes them, and the host-memory model
(`lohan.plan.pools`) sizes its buffers from them: one definition, so the three cannot drift. Torch-free; `align`
is a parameter so the capacity planner can price a model's pools without padding (`align=1`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from io_engine.align import ALIGN, align_up


def state_bytes(n: int, align: int = ALIGN) -> int:
    """Padded size of each fp32 section (P32, m, v) of a record or chunk of `n` elements."""
    return align_up(4 * n, align)


def record_bytes(n: int, p16_itemsize: int, align: int = ALIGN) -> int:
    """Bytes of a record, or of a chunk's buffer, of `n` elements: P32 | m | v | P16, each section aligned."""
    return 3 * state_bytes(n, align) + align_up(p16_itemsize * n, align)


chunk_record_bytes = record_bytes
"""Buffer bytes of an optimizer chunk of n elements: the same sections as a whole record (the old name)."""


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

    @property
    def state_bytes(self) -> int:
        """Padded size of each fp32 region (P32, m, v)."""
        return state_bytes(self.numel)

    @property
    def p16_bytes(self) -> int:
        return align_up(self.p16_itemsize * self.numel)

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.numel, self.p16_itemsize)

    @property
    def p16_start(self) -> int:
        """Offset of P16 inside the record."""
        return 3 * self.state_bytes


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

    def record_offset(self, block: int, slot: int) -> int:
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
                        offset=b["offset"],
                        params=tuple(ParamSpec(p["name"], tuple(p["shape"]), p["offset"], p["numel"])
                                     for p in b["params"]))
            for b in data["blocks"])
        return StoreLayout(blocks, data["p16_dtype"], data["slots"])


P16_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the compute-dtype copy (P16) by compute dtype (`store.states.DTYPES` holds the torch ones)."""


def layout_of(numels: list[int] | tuple[int, ...], p16_dtype: str, slots: int = 2,
              names: list[str] | tuple[str, ...] | None = None) -> StoreLayout:
    """A layout of blocks of the given element counts, each one flat parameter: the geometry the planners price
    when they know a model's shape but not its modules (`store.states.plan_layout` lays out real ones)."""
    blocks, offset = [], 0
    for i, n in enumerate(numels):
        name = names[i] if names else f"block{i}"
        b = BlockLayout(i, name, (ParamSpec("flat", (n,), 0, n),), n, P16_ITEMSIZE[p16_dtype], offset)
        blocks.append(b)
        offset += b.record_bytes
    return StoreLayout(tuple(blocks), p16_dtype, slots)
