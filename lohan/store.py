"""NVMe model-state store: per block, one record `P32 | m | v | P16` on an io_engine volume.

Layout (DESIGN.md §4.2). The unit is a block (embeddings and head are blocks too). A block's
parameters are flattened in `named_parameters()` order into one vector of `n` elements; its record
holds the fp32 master weights, Adam's m and v, and the compute-dtype copy the forward reads:

    record(b) = [ P32: 4n | m: 4n | v: 4n | P16: c*n ]      each region padded to 4 KiB

so the optimizer reads `P32, m, v` of a block in one sequential request, writes the whole record
back in one, and parameter streaming reads just `P16`. Records are laid out block after block
(layer-major) inside a *slot*; with `slots=2` there are two complete slots.

Crash consistency. With two slots, step t reads slot `s` and writes every updated record into
slot `1 - s`; only when all writes are durable (fsync) does an atomic commit record
(`<name>.commit.json`, written to a temp file, fsynced, renamed) switch the current slot. A process
killed mid-step leaves the previous commit pointing at an untouched slot. This costs 2x the SSD
capacity of the states and no extra traffic. With `slots=1` updates are in place; the commit
record is marked dirty during a step, so a crash is detected and recovery needs a checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from io_engine import ALIGN, Volume, open_volume
from io_engine.base import align_up

FORMAT_VERSION = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
        return align_up(4 * self.numel)

    @property
    def p16_bytes(self) -> int:
        return align_up(self.p16_itemsize * self.numel)

    @property
    def record_bytes(self) -> int:
        return 3 * self.state_bytes + self.p16_bytes

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


def plan_layout(blocks: Sequence[nn.Module], names: Sequence[str], p16_dtype: str, slots: int) -> StoreLayout:
    """Lay out the records of `blocks` (modules, typically on the meta device: only shapes are read)."""
    out = []
    offset = 0
    itemsize = torch.empty(0, dtype=DTYPES[p16_dtype]).element_size()
    for i, (block, name) in enumerate(zip(blocks, names)):
        specs, n = [], 0
        for pname, p in block.named_parameters():
            specs.append(ParamSpec(pname, tuple(p.shape), n, p.numel()))
            n += p.numel()
        if n == 0:
            raise ValueError(f"block {i} ({name}) has no parameters; merge it into a neighbour")
        layout = BlockLayout(i, name, tuple(specs), n, itemsize, offset)
        out.append(layout)
        offset += layout.record_bytes
    return StoreLayout(tuple(out), p16_dtype, slots)


def block_views(flat: torch.Tensor, block: BlockLayout) -> list[torch.Tensor]:
    """Per-parameter views (original shapes) into a block's flat vector."""
    return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in block.params]


class RecordView:
    """Typed views into a host buffer holding one block's record."""

    def __init__(self, buf: torch.Tensor, block: BlockLayout, p16_dtype: torch.dtype) -> None:
        n, sb = block.numel, block.state_bytes
        self.p32 = buf[0:4 * n].view(torch.float32)
        self.m = buf[sb:sb + 4 * n].view(torch.float32)
        self.v = buf[2 * sb:2 * sb + 4 * n].view(torch.float32)
        start = block.p16_start
        self.p16 = buf[start:start + block.p16_itemsize * n].view(p16_dtype)


def _atomic_write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the rename itself durable
    finally:
        os.close(dfd)


@dataclass
class Commit:
    """The durable pointer to the current states: optimizer step and slot."""

    step: int
    slot: int
    dirty: bool = False
    time: float = 0.0


class StateStore:
    """Model states of every block on a striped NVMe volume, with versioned commits.

    Build with `StateStore.create(...)` (lays out and initializes block by block) or
    `StateStore.open(...)` (an existing store, resumed from its last commit).
    """

    def __init__(self, volume: Volume, layout: StoreLayout, meta_dir: str, name: str, commit: Commit) -> None:
        self.volume = volume
        self.layout = layout
        self.name = name
        self.meta_path = os.path.join(meta_dir, f"{name}.store.json")
        self.commit_path = os.path.join(meta_dir, f"{name}.commit.json")
        self.commit_state = commit
        self.p16_dtype = DTYPES[layout.p16_dtype]

    # ------------------------------------------------------------------ build
    @classmethod
    def create(cls, dirs: Sequence[str], layout: StoreLayout, model_meta: dict,
               init_block: Callable[[int], list[torch.Tensor]], staging_budget: int,
               backend: str = "auto", chunk_bytes: int = 1 << 20, name: str = "lohan",
               progress: Callable[[int, int], None] | None = None,
               emulate_ssd_gbps: float | None = None) -> StateStore:
        """Create the volume and write every block's initial record into slot 0, one block at a time.

        `init_block(i)` returns block i's initialized parameters (in layout order, any float dtype);
        only one block is ever materialized, so models larger than main memory initialize.
        """
        volume = open_volume(list(dirs), layout.total_bytes, chunk_bytes=chunk_bytes, backend=backend, name=name,
                             emulate_ssd_gbps=emulate_ssd_gbps)
        try:
            store = cls(volume, layout, dirs[0], name, Commit(step=0, slot=0, dirty=True))
            # Whole records up to the staging budget; bigger ones (a 175B layer's is 25 GB) section by
            # section in pieces, so initialization needs the block's parameters plus one piece.
            piece = max(ALIGN, staging_budget // 4 // ALIGN * ALIGN)
            biggest = max((b.record_bytes for b in layout.blocks if b.record_bytes <= staging_budget), default=0)
            pool = volume.buffer_pool(max(staging_budget, biggest))
            for b in layout.blocks:
                params = init_block(b.index)
                if [tuple(p.shape) for p in params] != [s.shape for s in b.params]:
                    raise ValueError(f"init_block({b.index}) returned shapes that do not match the layout")
                if b.record_bytes <= staging_budget:
                    with pool.acquire(b.record_bytes) as buf:
                        rec = RecordView(buf.tensor, b, store.p16_dtype)
                        for view, p in zip(block_views(rec.p32, b), params):
                            view.copy_(p)
                        rec.m.zero_()
                        rec.v.zero_()
                        rec.p16.copy_(rec.p32)
                        volume.write(buf.tensor, layout.record_offset(b.index, 0)).wait()
                else:
                    store._write_record_in_pieces(b, params, pool, piece)
                del params
                if progress:
                    progress(b.index + 1, len(layout.blocks))
            pool.clear()
            volume.sync()
            _atomic_write_json(store.meta_path, {"format": FORMAT_VERSION, "model": model_meta,
                                                 "volume_id": volume.volume_id, "layout": layout.to_json()})
            store.commit(step=0, slot=0)
            return store
        except BaseException:
            volume.close()
            raise

    def _write_record_in_pieces(self, b: BlockLayout, params: list[torch.Tensor], pool, piece: int) -> None:
        """Slot 0 record of block b from its parameters: P32 and P16 copied, m and v zeroed, `piece` elements
        (a multiple of 4096, so every write but a section's last is aligned) at a time."""
        flats = [p.detach().reshape(-1) for p in params]  # views: no second copy of a multi-GB block
        base = self.layout.record_offset(b.index, 0)
        elems = max(4096, piece // 4 // 4096 * 4096)
        itemsize = b.p16_itemsize
        for lo in range(0, b.numel, elems):
            n = min(elems, b.numel - lo)
            with pool.acquire(4 * n) as buf:
                src = buf.tensor.view(torch.float32)
                for spec, flat in zip(b.params, flats):  # the parameters overlapping [lo, lo + n)
                    a, z = max(lo, spec.offset), min(lo + n, spec.offset + spec.numel)
                    if a < z:
                        src[a - lo:z - lo].copy_(flat[a - spec.offset:z - spec.offset])
                self.volume.write(buf.tensor, base + 4 * lo).wait()
                with pool.acquire(itemsize * n) as half:
                    half.tensor.view(self.p16_dtype).copy_(src)
                    self.volume.write(half.tensor, base + b.p16_start + itemsize * lo).wait()
                buf.tensor.zero_()
                for k in (1, 2):  # m, v
                    self.volume.write(buf.tensor, base + k * b.state_bytes + 4 * lo).wait()

    @classmethod
    def open(cls, dirs: Sequence[str], backend: str = "auto", chunk_bytes: int = 1 << 20,
             name: str = "lohan", emulate_ssd_gbps: float | None = None) -> StateStore:
        """Open an existing store at its last commit."""
        meta_path = os.path.join(dirs[0], f"{name}.store.json")
        commit_path = os.path.join(dirs[0], f"{name}.commit.json")
        if not os.path.exists(meta_path) or not os.path.exists(commit_path):
            raise FileNotFoundError(f"no committed store named {name!r} in {dirs[0]}")
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: store format {meta.get('format')} is not {FORMAT_VERSION}")
        with open(commit_path) as f:
            commit = Commit(**json.load(f))
        if commit.dirty:
            raise RuntimeError(f"{commit_path}: the store was being updated in place when its process stopped "
                               "(slots=1), so its states are mixed; restore a checkpoint or start over")
        layout = StoreLayout.from_json(meta["layout"])
        volume = open_volume(list(dirs), layout.total_bytes, chunk_bytes=chunk_bytes, backend=backend, name=name,
                             emulate_ssd_gbps=emulate_ssd_gbps)
        if volume.volume_id != meta["volume_id"]:
            volume.close()
            raise ValueError(f"{meta_path} describes another volume than the slab files in {list(dirs)}")
        return cls(volume, layout, dirs[0], name, commit)

    @staticmethod
    def read_model_meta(dirs: Sequence[str], name: str = "lohan") -> dict | None:
        """The model description of an existing committed store, or None."""
        path = os.path.join(dirs[0], f"{name}.store.json")
        if not os.path.exists(path) or not os.path.exists(os.path.join(dirs[0], f"{name}.commit.json")):
            return None
        with open(path) as f:
            return json.load(f).get("model")

    # --------------------------------------------------------------- commits
    @property
    def step(self) -> int:
        return self.commit_state.step

    @property
    def slot(self) -> int:
        return self.commit_state.slot

    def next_slot(self) -> int:
        return (self.slot + 1) % self.layout.slots

    def begin_step(self) -> None:
        """In-place stores mark the commit dirty before the first write of a step."""
        if self.layout.slots == 1:
            self.commit_state = Commit(self.step, self.slot, dirty=True, time=time.time())
            _atomic_write_json(self.commit_path, asdict(self.commit_state))

    def commit(self, step: int, slot: int) -> None:
        """Make `slot` current at optimizer step `step`, durably (all writes must be complete)."""
        self.volume.sync()
        self.commit_state = Commit(step, slot, dirty=False, time=time.time())
        _atomic_write_json(self.commit_path, asdict(self.commit_state))

    # ---------------------------------------------------------------- access
    def read_params(self, block: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Synchronously read block `block`'s fp32 master weights of the current slot (for export/tests)."""
        b = self.layout.blocks[block]
        buf = torch.empty(b.state_bytes, dtype=torch.uint8)
        self.volume.read_into(buf, self.layout.record_offset(block, self.slot)).wait()
        p32 = buf[:4 * b.numel].view(torch.float32)
        return [v.to(dtype).clone() for v in block_views(p32, b)]

    def close(self) -> None:
        self.volume.close()


__all__ = ["ALIGN", "BlockLayout", "Commit", "ParamSpec", "RecordView", "StateStore", "StoreLayout",
           "block_views", "plan_layout"]
