"""NVMe model-state store: per block, one record `P32 | m | v | P16` on an io_engine volume.

Layout (DESIGN.md §4.2). The unit is a block (embeddings and head are blocks too). A block's
parameters are flattened in `named_parameters()` order into one vector of `n` elements; its record
holds the fp32 master weights, Adam's m and v, and the compute-dtype copy the forward reads:

    record(b) = [ P32: 4n | m: 4n | v: 4n | P16: c*n ]      each region padded to 4 KiB

so the optimizer reads `P32, m, v` of a block in one sequential request, writes the whole record
back in one, and parameter streaming reads just `P16`. That is the ``exact`` state format; the compressed ones
(`--state-format`, `lohan.plan.formats`) store a narrower master and moments, 8-bit moments with their block
scales, and ``bf16-master`` no separate P16 (`lohan.plan.records.Sections`; `UnitViews` are the typed views). Records are laid out block after block
(layer-major) inside a *slot*; with `slots=2` there are two complete slots.

Crash consistency. With two slots, step t reads slot `s` and writes every updated record into
slot `1 - s`; only when all writes are durable (fsync) does an atomic commit record
(`<name>.commit.json`, written to a temp file, fsynced, renamed) switch the current slot. A process
killed mid-step leaves the previous commit pointing at an untouched slot. This costs 2x the SSD
capacity of the states and no extra traffic. With `slots=1` updates are in place; the commit
record is marked dirty during a step, so a crash is detected and recovery needs a checkpoint.

Integrity (`integrity.py`). The commit record also carries the checksums of every record of its slot,
computed where the bytes are produced (initialization, the optimizer) and checked wherever they are
read back (the optimizer's READ, parameter streaming, export), so damaged bytes stop the step before
they reach the states. Creation is resumable: each block's initial record is made durable and noted
in `<name>.init.json` before the next one starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from io_engine import ALIGN, Volume, open_volume
from io_engine.base import align_up
from lohan.crashpoints import crashpoint
from lohan.plan.formats import state_format as state_format_of
from lohan.plan.records import (  # the record geometry (re-exported)
    TORCH_NAMES,
    BlockLayout,
    ParamSpec,
    StoreLayout,
    shares_p16,
)
from lohan.store.files import VOLUME_SUFFIXES, check_name
from lohan.store.integrity import (
    StoreCorruptError,
    Sums,
    check_record,
    describe_range,
    read_json_checked,
    tensor_hash,
    unit_bounds,
    write_json_atomic,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
RAM_SLOTS = (2, 3)
"""Slot numbers of states held only in RAM (the resident records of steps between durable commits,
`StateStore.commit_volatile`); the SSDs hold slots 0 and 1. Nothing reads or writes them on the volume."""
DTYPES = {name: getattr(torch, t) for name, t in TORCH_NAMES.items()}


def plan_layout(blocks: Sequence[nn.Module], names: Sequence[str], p16_dtype: str, slots: int,
                state_format: str = "exact", shared_p16: bool | None = None) -> StoreLayout:
    """Lay out the records of `blocks` (modules, typically on the meta device: only shapes are read) in
    `state_format` (`lohan.plan.formats`). `shared_p16`: whether the master is the P16 (`BlockLayout.shared_p16`);
    None: as a store is laid out now (`records.shares_p16`), a bool: as the store being resumed was."""
    fmt = state_format_of(state_format)
    shared = shares_p16(state_format, p16_dtype) if shared_p16 is None else shared_p16
    if not fmt.separate_p16 and p16_dtype != "bf16":
        raise ValueError(f"state format {state_format!r} keeps bf16 weights only, which the compute reads as they "
                         f"are; it needs compute_dtype bf16, not {p16_dtype} (--compute-dtype bf16)")
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
        layout = BlockLayout(i, name, tuple(specs), n, itemsize, offset, state_format, shared)
        out.append(layout)
        offset += layout.record_bytes
    return StoreLayout(tuple(out), p16_dtype, slots)


def block_views(flat: torch.Tensor, block: BlockLayout) -> list[torch.Tensor]:
    """Per-parameter views (original shapes) into a block's flat vector."""
    return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in block.params]


_MOMENT_DTYPES = {4: torch.float32, 2: torch.bfloat16, 1: torch.uint8, 0: torch.uint8}
"""(0: the ``frozen`` format, whose records hold no moments)"""


@dataclass
class UnitViews:
    """Typed views of a unit's sections (a whole record, or a chunk lo..hi of one) in a host buffer laid out
    as `BlockLayout.unit` says: the master (fp32, or bf16), m and v (fp32, bf16 or 8-bit codes), each moment's
    fp32 absmax per quantization block (8-bit moments only) and the P16 (``bf16-master``: the master itself)."""

    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    m_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    p16: torch.Tensor

    @property
    def p32(self) -> torch.Tensor:
        """The master (the name of the ``exact`` format's fp32 one)."""
        return self.master

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """What the optimizer reads, in record order: the sections the unit's "state" checksum covers."""
        return tuple(t for t in (self.master, self.m, self.v, self.m_scale, self.v_scale) if t is not None)

    def fill_initial(self, weights: torch.Tensor | None = None) -> None:
        """Moments (and their scales) zero, P16 = master; the master from fp32 `weights` if given (a bf16 master
        rounds to nearest: no step has drawn rounding noise yet). A ``frozen`` record has no master: `weights`
        go to its P16, rounded to its dtype."""
        if self.master.numel() == 0 and self.p16.numel():
            if weights is not None:
                self.p16.copy_(weights)
            return
        if weights is not None:
            self.master.copy_(weights)
        for t in self.state[1:]:
            t.zero_()
        if self.p16.data_ptr() != self.master.data_ptr():
            self.p16.copy_(self.master)


def unit_views(buf: torch.Tensor, b: BlockLayout, lo: int, hi: int, p16_dtype: torch.dtype) -> UnitViews:
    """The `UnitViews` of unit lo..hi of block `b` in `buf` (uint8, laid out as `b.unit(lo, hi)`)."""
    f, sec = state_format_of(b.fmt), b.unit(lo, hi)
    n = hi - lo
    master = buf[sec.master:sec.master + f.master_itemsize * n].view(
        torch.float32 if f.master_itemsize == 4 else torch.bfloat16)
    mom = _MOMENT_DTYPES[f.moment_itemsize]
    m = buf[sec.m:sec.m + f.moment_itemsize * n].view(mom)
    v = buf[sec.v:sec.v + f.moment_itemsize * n].view(mom)
    ms = vs = None
    if f.quantized:
        ms = buf[sec.m_scale:sec.m_scale + 4 * sec.q].view(torch.float32)
        vs = buf[sec.v_scale:sec.v_scale + 4 * sec.q].view(torch.float32)
    p16 = buf[sec.p16:sec.p16 + b.p16_itemsize * n].view(p16_dtype) if b.has_p16 else master
    return UnitViews(master, m, v, ms, vs, p16)


def RecordView(buf: torch.Tensor, block: BlockLayout, p16_dtype: torch.dtype) -> UnitViews:  # noqa: N802
    """Typed views into a host buffer holding one block's whole record."""
    return unit_views(buf, block, 0, block.numel, p16_dtype)


def unit_sections(layout: StoreLayout, unit: tuple[int, int, int], slot: int,
                  with_p16: bool) -> list[tuple[int, int, int]]:
    """(buffer offset, volume offset, bytes) of each section of unit (block, lo, hi) in its buffer and in the
    record of `slot`: the optimizer's READ (without the P16) or WRITE (with it)."""
    i, lo, hi = unit
    b = layout.blocks[i]
    f, whole, sec = state_format_of(b.fmt), b.sections, b.unit(lo, hi)
    q0, _ = b.qrange(lo, hi)
    rec = layout.record_offset(i, slot)
    n = hi - lo
    out = [(sec.master, rec + whole.master + f.master_itemsize * lo, f.master_itemsize * n),
           (sec.m, rec + whole.m + f.moment_itemsize * lo, f.moment_itemsize * n),
           (sec.v, rec + whole.v + f.moment_itemsize * lo, f.moment_itemsize * n)]
    if f.quantized:
        out += [(sec.m_scale, rec + whole.m_scale + 4 * q0, 4 * sec.q),
                (sec.v_scale, rec + whole.v_scale + 4 * q0, 4 * sec.q)]
    if with_p16 and b.has_p16:
        out.append((sec.p16, rec + whole.p16 + b.p16_itemsize * lo, b.p16_itemsize * n))
    return [s for s in out if s[2]]  # (a ``frozen`` record has no state sections)


def _piece_elems(piece: int) -> int:
    """Elements per piece of a record initialized in pieces of `piece` bytes of fp32 (a multiple of 4096)."""
    return max(4096, piece // 4 // 4096 * 4096)


def _pieces_ok(b: BlockLayout, piece: int) -> bool:
    """Whether initializing block b in pieces splits no quantization block (always, unless 8-bit moments)."""
    return all(b.cut_ok(lo) for lo in range(0, b.numel, _piece_elems(piece)))


def sub_views(rec: UnitViews, b: BlockLayout, lo: int, hi: int) -> UnitViews:
    """The views of elements lo..hi (and their quantization blocks) of a whole record's views."""
    q0, q1 = b.qrange(lo, hi)

    def sc(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[q0:q1]
    return UnitViews(rec.master[lo:hi], rec.m[lo:hi], rec.v[lo:hi], sc(rec.m_scale), sc(rec.v_scale), rec.p16[lo:hi])


def unit_sums(views: UnitViews) -> list[int]:
    """A unit's [state, p16] checksums: what the optimizer reads, and what the compute reads."""
    return [tensor_hash(*views.state), tensor_hash(views.p16)]


def _gather(b: BlockLayout, flats: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Elements lo..hi of a block's flat vector, as fp32, from its parameters' flat views."""
    out = torch.empty(hi - lo, dtype=torch.float32)
    for spec, flat in zip(b.params, flats):
        a, z = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
        if a < z:
            out[a - lo:z - lo].copy_(flat[a - spec.offset:z - spec.offset])
    return out


@dataclass
class Commit:
    """The durable pointer to the current states: optimizer step, slot and the slot's checksums."""

    step: int
    slot: int
    dirty: bool = False
    time: float = 0.0
    sums: Sums | None = None
    updates: int | None = None   # optimizer updates applied (None: as many as steps); a skipped step adds none
    bad_streak: int = 0          # consecutive steps skipped for non-finite loss or gradients
    loss_scale: float | None = None   # fp16: the dynamic loss scale and its growth tracker (GradScaler's state)
    growth_tracker: int = 0
    prev: dict | None = None   # data parallel: the commit before this one, until the group has decided (runtime/parallel.py)
    note: dict | None = None   # what the step measured (its loss, lr, ...), committed with it: the run's record of the
    #                            step survives a kill between the commit and the record's write (app.train)

    @property
    def applied(self) -> int:
        return self.step if self.updates is None else self.updates


MAX_LINEAGE = 64
"""How many replaced stores a store remembers (`StoreStatus.replaces`)."""


@dataclass(frozen=True)
class StoreStatus:
    """What a directory holds under a store name, read without opening the volume."""

    state: str  # "none" | "partial" (initialization stopped) | "complete" | "stray" (slab files only) | "damaged"
    model: dict | None = None
    step: int = 0
    blocks_done: int = 0
    n_blocks: int = 0
    volume_id: str | None = None  # the store's identity: new with each creation, the same across resumes
    replaces: tuple[str, ...] = ()  # the identities of the stores this one replaced (--overwrite), latest first

    def describe(self) -> str:
        label = (self.model or {}).get("config", {}).get("name") or (self.model or {}).get("kind", "a model")
        if self.state == "complete":
            return f"a store of {label} committed at step {self.step}"
        if self.state == "partial":
            return (f"a store of {label} whose initialization stopped after {self.blocks_done} of "
                    f"{self.n_blocks} blocks")
        if self.state == "stray":
            return "the slab files of a store whose creation stopped before its first block"
        if self.state == "damaged":
            return "a store whose metadata is damaged"
        return "no store"


_FIX_META = ("The store's metadata cannot be trusted: restore the directory from a backup, or start over "
             "with --overwrite (its states are lost)")


class StateStore:
    """Model states of every block on a striped NVMe volume, with versioned, checksummed commits.

    Build with `StateStore.create(...)` (lays out and initializes block by block, and continues an
    initialization that was interrupted) or `StateStore.open(...)` (an existing store, at its last commit).
    """

    def __init__(self, volume: Volume, layout: StoreLayout, meta_dir: str, name: str, commit: Commit,
                 chunk_elems: int, checksums: bool) -> None:
        self.volume = volume
        self.layout = layout
        self.name = name
        self.meta_path = os.path.join(meta_dir, f"{name}.store.json")
        self.commit_path = os.path.join(meta_dir, f"{name}.commit.json")
        self.init_path = os.path.join(meta_dir, f"{name}.init.json")
        self.commit_state = commit
        self._staged: Commit | None = None  # the durable commit while a newer one is staged
        self._volatile_base: Commit | None = None  # the durable commit while newer ones are in RAM only
        self.p16_dtype = DTYPES[layout.p16_dtype]
        self.chunk_elems = chunk_elems
        self.checksums = checksums

    # ------------------------------------------------------------------ build
    @classmethod
    def create(cls, dirs: Sequence[str], layout: StoreLayout, model_meta: dict,
               init_block: Callable[[int], list[torch.Tensor]], staging_budget: int,
               backend: str = "auto", stripe_bytes: int = 1 << 20, name: str = "lohan",
               progress: Callable[[int, int], None] | None = None,
               emulate_ssd_gbps: float | None = None, chunk_elems: int | None = None,
               checksums: bool = True, replaces: Sequence[str] = ()) -> StateStore:
        """Create the volume and write every block's initial record into slot 0, one block at a time.

        `replaces`: the identities (volume ids) of the stores this one replaces in these directories, kept in its
        description (`StoreStatus.replaces`): the run's outputs stamped with them are its own to replace.

        `init_block(i)` returns block i's initialized parameters (in layout order, any float dtype);
        only one block is ever materialized, so models larger than main memory initialize. Each block
        is made durable and recorded in `<name>.init.json` before the next starts, so a store whose
        creation was interrupted (killed, disk full, Ctrl-C) continues from the first missing block
        when `create` is called again with the same layout and model.
        """
        check_name(name)
        check = chunk_elems or align_up(max(b.numel for b in layout.blocks), 4096)
        meta_path = os.path.join(dirs[0], f"{name}.store.json")
        init_path = os.path.join(dirs[0], f"{name}.init.json")
        start, sums = 0, []
        if os.path.exists(meta_path):  # an interrupted creation: continue it if it is this store
            meta = _read_meta(meta_path)
            if (meta["model"], StoreLayout.from_json(meta["layout"]), meta["check_elems"], meta["checksums"]) != \
                    (model_meta, layout, check, checksums):
                raise ValueError(f"{dirs[0]} holds the unfinished initialization of another store (other model or "
                                 "settings); start over with --overwrite, or use another directory")
            if os.path.exists(init_path):
                done = _read_init(init_path)
                if done["volume_id"] == meta["volume_id"]:
                    start, sums = int(done["blocks_done"]), list(done["sums"])
        volume = open_volume(list(dirs), layout.total_bytes, chunk_bytes=stripe_bytes, backend=backend, name=name,
                             emulate_ssd_gbps=emulate_ssd_gbps)
        try:
            if os.path.exists(meta_path) and _read_meta(meta_path)["volume_id"] != volume.volume_id:
                raise ValueError(f"{meta_path} describes another volume than the slab files in {list(dirs)}; "
                                 "start over with --overwrite")
            store = cls(volume, layout, dirs[0], name, Commit(step=0, slot=0, dirty=True), check, checksums)
            if not os.path.exists(meta_path):
                write_json_atomic(meta_path, {"format": FORMAT_VERSION, "model": model_meta,
                                              "volume_id": volume.volume_id, "layout": layout.to_json(),
                                              "check_elems": check, "checksums": checksums,
                                              "replaces": list(replaces)[:MAX_LINEAGE]})
            if start:
                log.info("continuing the initialization of %s at block %d of %d", dirs[0], start, len(layout.blocks))
                if progress:
                    progress(start, len(layout.blocks))
            # Whole records up to the staging budget; bigger ones (a 175B layer's is 25 GB) section by
            # section in pieces, so initialization needs the block's parameters plus one piece.
            piece = max(ALIGN, staging_budget // 4 // ALIGN * ALIGN)
            # (8-bit moments: a block whose pieces would split a quantization block is written whole instead)
            whole = [b.record_bytes <= staging_budget or not _pieces_ok(b, piece) for b in layout.blocks]
            biggest = max((b.record_bytes for b, w in zip(layout.blocks, whole) if w), default=0)
            least = max((b.unit(0, 4096).total for b, w in zip(layout.blocks, whole) if not w), default=0)
            pool = volume.buffer_pool(max(staging_budget, biggest, least))  # (a piece is 4096 elements or more)
            for b in layout.blocks[start:]:
                params = init_block(b.index)
                if [tuple(p.shape) for p in params] != [s.shape for s in b.params]:
                    raise ValueError(f"init_block({b.index}) returned shapes that do not match the layout")
                if whole[b.index]:
                    with pool.acquire(b.record_bytes) as buf:
                        rec = RecordView(buf.tensor, b, store.p16_dtype)
                        # (a ``frozen`` record has no master: its P16 is the weights)
                        for view, p in zip(block_views(rec.master if rec.master.numel() else rec.p16, b), params):
                            view.copy_(p)
                        rec.fill_initial()
                        volume.write(buf.tensor, layout.record_offset(b.index, 0)).wait()
                        sums.append(store.record_sums(b, rec) if checksums else None)
                else:
                    store._write_record_in_pieces(b, params, pool, piece)
                    sums.append(store._initial_sums(b, params) if checksums else None)
                del params
                volume.sync()
                crashpoint("store.init.block_written")
                write_json_atomic(init_path, {"volume_id": volume.volume_id, "blocks_done": b.index + 1,
                                              "sums": sums})
                if progress:
                    progress(b.index + 1, len(layout.blocks))
            pool.clear()
            store.commit(step=0, slot=0, sums=sums if checksums else None)
            os.unlink(init_path)
            return store
        except BaseException:
            volume.close()
            raise

    def record_sums(self, b: BlockLayout, rec: UnitViews) -> list[list[int]]:
        """Per-unit [state, p16] checksums of a whole block's record (`RecordView`)."""
        return [unit_sums(sub_views(rec, b, lo, hi)) for lo, hi in unit_bounds(b.numel, self.chunk_elems)]

    def _initial_sums(self, b: BlockLayout, params: list[torch.Tensor]) -> list[list[int]]:
        """Checksums of a block's initial record computed from its parameters, unit by unit (one unit's
        copy in memory at a time: a big block is never assembled)."""
        flats = [p.detach().reshape(-1) for p in params]
        out = []
        for lo, hi in unit_bounds(b.numel, self.chunk_elems):
            buf = torch.zeros(b.unit(lo, hi).total, dtype=torch.uint8)
            views = unit_views(buf, b, lo, hi, self.p16_dtype)
            views.fill_initial(_gather(b, flats, lo, hi))
            out.append(unit_sums(views))
        return out

    def _write_record_in_pieces(self, b: BlockLayout, params: list[torch.Tensor], pool, piece: int) -> None:
        """Slot 0 record of block b from its parameters: master and P16 copied, m and v (and their scales)
        zeroed, `piece` bytes of fp32 at a time (a multiple of 4096 elements, so every write but a section's
        last is aligned)."""
        flats = [p.detach().reshape(-1) for p in params]  # views: no second copy of a multi-GB block
        elems = _piece_elems(piece)
        for lo in range(0, b.numel, elems):
            hi = min(lo + elems, b.numel)
            with pool.acquire(b.unit(lo, hi).total) as buf:
                buf.tensor.zero_()
                views = unit_views(buf.tensor, b, lo, hi, self.p16_dtype)
                views.fill_initial(_gather(b, flats, lo, hi))
                for at, off, n in unit_sections(self.layout, (b.index, lo, hi), 0, with_p16=True):
                    self.volume.write(buf.tensor[at:at + n], off).wait()

    @staticmethod
    def status(dirs: Sequence[str], name: str = "lohan") -> StoreStatus:
        """What `dirs` hold under `name` (reads the metadata only; StoreCorruptError if it is damaged)."""
        check_name(name)
        d = dirs[0]
        meta_path, commit_path = os.path.join(d, f"{name}.store.json"), os.path.join(d, f"{name}.commit.json")
        if not os.path.exists(meta_path):
            if os.path.exists(commit_path):  # a store that committed has its description: it was removed
                raise StoreCorruptError(f"{meta_path} (store description) is missing beside its commit record. "
                                        f"{_FIX_META}")
            stray = any(os.path.exists(os.path.join(x, f"{name}{suffix}")) for x in dirs
                        for suffix in VOLUME_SUFFIXES)
            return StoreStatus("stray" if stray else "none")
        meta = _read_meta(meta_path)
        n_blocks = len(meta["layout"]["blocks"])
        if os.path.exists(commit_path):
            commit = _read_commit(commit_path)
            if not commit.dirty or commit.step > 0 or not os.path.exists(os.path.join(d, f"{name}.init.json")):
                return StoreStatus("complete", meta["model"], commit.step, n_blocks, n_blocks, meta["volume_id"],
                                   tuple(meta.get("replaces", ())))
        done = 0
        init_path = os.path.join(d, f"{name}.init.json")
        if os.path.exists(init_path):
            done = _read_init(init_path)["blocks_done"]
        return StoreStatus("partial", meta["model"], 0, done, n_blocks, meta["volume_id"], tuple(meta.get("replaces", ())))

    @staticmethod
    def identity(dirs: Sequence[str], name: str = "lohan") -> tuple[str | None, tuple[str, ...]]:
        """(the store's volume id, those of the stores it replaced), from its description alone (a damaged commit
        record does not hide whose the store is); (None, ()) where there is none. StoreCorruptError if the
        description is damaged."""
        check_name(name)
        meta_path = os.path.join(dirs[0], f"{name}.store.json")
        if not os.path.exists(meta_path):
            return None, ()
        meta = _read_meta(meta_path)
        return meta["volume_id"], tuple(meta.get("replaces", ()))

    @staticmethod
    def stored_p16_sharing(dirs: Sequence[str], name: str = "lohan") -> bool | None:
        """Whether the store described in `dirs` (complete, or its creation interrupted) has the master as its P16
        (`BlockLayout.shared_p16`); None where no description can be read (no store: a new one is laid out as
        stores are now; a damaged one is refused when it is opened)."""
        meta_path = os.path.join(dirs[0], f"{name}.store.json")
        try:
            layout = StoreLayout.from_json(_read_meta(meta_path)["layout"])
        except (OSError, ValueError, KeyError, TypeError, StoreCorruptError):
            return None
        return bool(layout.blocks) and layout.blocks[0].shared_p16

    @classmethod
    def open(cls, dirs: Sequence[str], backend: str = "auto", stripe_bytes: int = 1 << 20,
             name: str = "lohan", emulate_ssd_gbps: float | None = None) -> StateStore:
        """Open an existing store at its last commit."""
        check_name(name)
        meta_path = os.path.join(dirs[0], f"{name}.store.json")
        commit_path = os.path.join(dirs[0], f"{name}.commit.json")
        if not os.path.exists(meta_path) or not os.path.exists(commit_path):
            raise FileNotFoundError(f"no committed store named {name!r} in {dirs[0]}")
        meta = _read_meta(meta_path)
        commit = _read_commit(commit_path)
        if commit.dirty:
            raise RuntimeError(f"{commit_path}: the store was being updated in place when its process stopped "
                               "(slots=1), so its states are mixed; restore a checkpoint or start over")
        layout = StoreLayout.from_json(meta["layout"])
        volume = open_volume(list(dirs), layout.total_bytes, chunk_bytes=stripe_bytes, backend=backend, name=name,
                             emulate_ssd_gbps=emulate_ssd_gbps)
        if volume.volume_id != meta["volume_id"]:
            volume.close()
            raise StoreCorruptError(f"{meta_path} describes another volume than the slab files in {list(dirs)} "
                                    "(a stale or foreign store): pass the directories it was created with, or "
                                    "start over with --overwrite")
        if meta["checksums"] and commit.sums is None:
            volume.close()
            raise StoreCorruptError(f"{commit_path} carries no checksums for a checksummed store. {_FIX_META}")
        return cls(volume, layout, dirs[0], name, commit, meta["check_elems"], meta["checksums"])

    # --------------------------------------------------------------- commits
    @property
    def step(self) -> int:
        return self.commit_state.step

    @property
    def slot(self) -> int:
        return self.commit_state.slot

    @property
    def sums(self) -> Sums | None:
        """Checksums of the current slot (None: the store keeps none)."""
        return self.commit_state.sums

    def next_slot(self, durable: bool = True) -> int:
        """The slot a step writes: the real slot the durable commit does not name (`durable`), or the RAM slot
        the current commit does not name (a step that writes nothing to the SSDs, `commit_volatile`)."""
        if not durable:
            return RAM_SLOTS[1] if self.slot == RAM_SLOTS[0] else RAM_SLOTS[0]
        base = self._volatile_base or self.commit_state
        return (base.slot + 1) % self.layout.slots

    @staticmethod
    def in_ram(slot: int) -> bool:
        """Whether `slot` names states held only in RAM (the resident records), none on the SSDs."""
        return slot in RAM_SLOTS

    @property
    def volatile(self) -> bool:
        """The current commit is in RAM only (`commit_volatile`): the record on disk names an earlier step."""
        return self._volatile_base is not None

    def commit_volatile(self, step: int, slot: int, updates: int | None = None, bad_streak: int = 0,
                        loss_scale: float | None = None, growth_tracker: int = 0, note: dict | None = None) -> None:
        """Make RAM slot `slot` current at `step` in this process only: nothing is written (the durability
        interval, `engine.persist_every`). The commit record on disk keeps naming the last durable step, which a
        kill resumes from; `commit` of a real slot (a durable step, or persisting) ends the volatile stretch."""
        if not self.in_ram(slot):
            raise ValueError(f"commit_volatile of step {step} to slot {slot}, which is on the SSDs; use commit")
        if self._staged is not None:
            raise RuntimeError(f"commit_volatile of step {step} while the commit of step {self.commit_state.step} "
                               "is staged: persist it first")
        if self._volatile_base is None:
            self._volatile_base = self.commit_state
        base = self._volatile_base
        # the sums stay the durable slot's: nothing reads a RAM slot from the SSDs
        self.commit_state = Commit(step, slot, dirty=False, time=time.time(), sums=base.sums,
                                   updates=None if updates == step else updates, bad_streak=bad_streak,
                                   loss_scale=loss_scale, growth_tracker=growth_tracker, note=note)

    def drop_volatile(self) -> None:
        """Forget the steps since the last durable commit (their states in RAM are lost): it is current again."""
        if self._volatile_base is not None:
            self.commit_state, self._volatile_base = self._volatile_base, None

    def begin_step(self) -> None:
        """In-place stores mark the commit dirty before the first write of a step."""
        if self.layout.slots == 1:
            self.commit_state = dataclasses.replace(self.commit_state, dirty=True, time=time.time())
            write_json_atomic(self.commit_path, asdict(self.commit_state))

    def recommit(self, keep_prev: bool = False) -> None:
        """Write the current commit again, as it is (after a failed step: the commit record, which a step in place
        marked dirty, names the last good state once more). fp16's loss scale and tracker stay as committed."""
        c = self.commit_state if self._volatile_base is None else self._volatile_base
        self.commit(c.step, c.slot, sums=c.sums, updates=c.applied, bad_streak=c.bad_streak,
                    loss_scale=c.loss_scale, growth_tracker=c.growth_tracker, keep_prev=keep_prev, note=c.note)

    def commit(self, step: int, slot: int, sums: Sums | None = None, updates: int | None = None,
               bad_streak: int = 0, loss_scale: float | None = None, growth_tracker: int = 0,
               keep_prev: bool = False, durable: bool = True, note: dict | None = None) -> None:
        """Make `slot` current at training step `step`, durably (all writes must be complete).
        `sums` are the checksums of every record in `slot` (required when the store keeps checksums);
        `updates` the optimizer updates the slot's states have seen (default: `step`). `keep_prev` keeps the
        last commit of an earlier step in the record, so `revert` can go back to it (data parallel). `note`, a
        JSON-ready dict the store keeps with the commit and does not read (`Commit.note`).

        `durable=False` stages the commit: it is current for this process at once (reads of `slot` check
        against its checksums), while the record on disk still names the previous one until `persist`, which
        is called once the slot's last writes are complete (or `discard_staged` if they failed)."""
        if self.checksums and (sums is None or len(sums) != len(self.layout.blocks)):
            raise RuntimeError(f"commit of step {step} without the checksums of every block")
        if self._staged is not None:
            raise RuntimeError(f"commit of step {step} while the commit of step {self.commit_state.step} is "
                               "staged: persist or discard it first")
        if self.in_ram(slot):
            raise ValueError(f"commit of step {step} to RAM slot {slot}: use commit_volatile")
        if self._volatile_base is not None and not durable:
            raise RuntimeError(f"commit of step {step} staged while steps since {self._volatile_base.step} are in "
                               "RAM only: a commit after them must be durable")
        if durable:
            self.volume.sync()
            crashpoint("store.commit.synced")
        old = self.commit_state if self._volatile_base is None else self._volatile_base
        self._volatile_base = None
        prev = None
        if keep_prev:
            prev = {**asdict(old), "prev": None} if old.step < step else old.prev
        self.commit_state = Commit(step, slot, dirty=False, time=time.time(), sums=sums,
                                   updates=None if updates == step else updates, bad_streak=bad_streak,
                                   loss_scale=loss_scale, growth_tracker=growth_tracker, prev=prev, note=note)
        if durable:
            write_json_atomic(self.commit_path, asdict(self.commit_state))
        else:
            self._staged = old

    @property
    def staged(self) -> bool:
        """A commit is current in this process but not yet durable (see `commit(durable=False)`)."""
        return self._staged is not None

    @property
    def durable_step(self) -> int:
        """The step the commit record on disk names (a staged commit's step once it is persisted)."""
        if self._volatile_base is not None:
            return self._volatile_base.step
        return self._staged.step if self._staged is not None else self.step

    def persist(self) -> None:
        """Make the staged commit durable: every write to its slot must be complete."""
        if self._staged is None:
            return
        self.volume.sync()
        crashpoint("store.commit.synced")
        write_json_atomic(self.commit_path, asdict(self.commit_state))
        self._staged = None

    def discard_staged(self) -> None:
        """Forget the staged commit (its slot's writes failed): the durable one is current again."""
        if self._staged is not None:
            self.commit_state, self._staged = self._staged, None

    def revert(self) -> None:
        """Make the commit before the current one current again (its slot must be untouched since: the
        data-parallel group never decided the current one, so no step after it ran)."""
        if self.commit_state.prev is None:
            raise RuntimeError(f"{self.commit_path} keeps no previous commit to go back to")
        self.volume.sync()
        self.commit_state = Commit(**self.commit_state.prev)
        write_json_atomic(self.commit_path, asdict(self.commit_state))

    # ------------------------------------------------------------ integrity
    def check_unit(self, block: int, lo: int, what: str, got: int, slot: int | None = None) -> None:
        """Raise StoreCorruptError if unit [lo, ...) of `block`'s `what` ('state' or 'p16') hashed to `got`
        but the commit says otherwise."""
        if self.sums is None:
            return
        k = lo // self.chunk_elems
        want = self.sums[block][k][0 if what == "state" else 1]
        if got == want:
            return
        b = self.layout.blocks[block]
        slot = self.slot if slot is None else slot
        hi = min(lo + self.chunk_elems, b.numel)
        parts = unit_sections(self.layout, (block, lo, hi), slot, with_p16=what != "state")
        if what != "state":
            parts = parts[-1:] if b.sections.p16 else parts[:1]  # (bf16-master: the P16 is the master)
        off, nbytes = parts[0][1], parts[-1][1] + parts[-1][2] - parts[0][1]
        sections = ("P32/m/v" if b.fmt == "exact" else "master/m/v") if what == "state" else \
            ("P32 (read as the P16: the master is what the compute reads)" if b.shared_p16 else "P16")
        raise StoreCorruptError(
            f"checksum mismatch in block {block} ({b.name}), {sections} elements {lo}..{hi} of slot {slot} at "
            f"step {self.step}: the bytes read back from {describe_range(self.volume.dirs, off, nbytes)} are not "
            f"what was written. The SSD returned damaged data; check the drive (smartctl, dmesg), then restore the "
            f"directory from a backup or start over with --overwrite. `python finetune.py --verify --nvme "
            f"{' '.join(self.volume.dirs)}` checks every block")

    def _read_unit(self, block: int, lo: int, hi: int, with_p16: bool) -> UnitViews:
        """Unit lo..hi of `block` of the current slot, read synchronously into a buffer of its own."""
        b = self.layout.blocks[block]
        buf = torch.empty(b.unit(lo, hi).total, dtype=torch.uint8)
        handles = [self.volume.read_into(buf[at:at + n], off)
                   for at, off, n in unit_sections(self.layout, (block, lo, hi), self.slot, with_p16)]
        for h in handles:
            h.wait()
        return unit_views(buf, b, lo, hi, self.p16_dtype)

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Read every record of the current slot and check it against the committed checksums; returns
        one line per damaged unit (empty: the store is intact). Reads unit by unit (bounded memory)."""
        if self.sums is None:
            return ["this store keeps no checksums (created with checksums off): nothing to verify"]
        self._check_not_staged("verify")
        problems = []
        for b in self.layout.blocks:
            for lo, hi in unit_bounds(b.numel, self.chunk_elems):
                state, p16 = unit_sums(self._read_unit(b.index, lo, hi, with_p16=True))
                # (a record without a P16 section of its own: its P16 is the master, which "state" covers)
                for what, got in (("state", state), ("p16", p16))[:2 if b.has_p16 else 1]:
                    try:
                        self.check_unit(b.index, lo, what, got)
                    except StoreCorruptError as e:
                        problems.append(str(e).split(": the bytes")[0])
            if progress:
                progress(b.index + 1, len(self.layout.blocks))
        return problems

    # ---------------------------------------------------------------- access
    def read_params(self, block: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Synchronously read block `block`'s master weights of the current slot as `dtype` (for export/tests);
        every state section is read, unit by unit, so its checksums can be verified. A ``frozen`` record (a LoRA
        run's base) has no master: its P16, the weights the run computes with, is read."""
        self._check_not_staged("read_params")
        b = self.layout.blocks[block]
        frozen = state_format_of(b.fmt).master_itemsize == 0
        flat = torch.empty(b.numel, dtype=dtype)
        for lo, hi in unit_bounds(b.numel, self.chunk_elems):
            views = self._read_unit(block, lo, hi, with_p16=frozen)
            if frozen:
                self.check_unit(block, lo, "p16", tensor_hash(views.p16))
            else:
                self.check_unit(block, lo, "state", tensor_hash(*views.state))
            flat[lo:hi].copy_(views.p16 if frozen else views.master)
        return [t.clone() for t in block_views(flat, b)]

    def _check_not_staged(self, what: str) -> None:
        if self._staged is not None:  # the staged slot's last writes may still be in flight
            raise RuntimeError(f"{what}: the commit of step {self.step} is staged, not yet durable; the engine's "
                               "flush() makes it durable first")

    def close(self) -> None:
        self.volume.close()


# The keys and value types of each metadata record: any other record is refused as damage (check_record). A
# commit's fields after `sums` came later, so a store committed before them lacks them.
_META_FIELDS = {"format": int, "model": dict, "volume_id": str, "layout": dict, "check_elems": int, "checksums": bool}
_META_LATER = {"replaces": list}
_INIT_FIELDS = {"volume_id": str, "blocks_done": int, "sums": list}
_COMMIT_FIELDS = {"step": int, "slot": int, "dirty": bool, "time": float, "sums": (list, type(None))}
_COMMIT_LATER = {"updates": (int, type(None)), "bad_streak": int, "loss_scale": (float, type(None)),
                 "growth_tracker": int, "prev": (dict, type(None)), "note": (dict, type(None))}


def _read_meta(path: str) -> dict:
    meta = read_json_checked(path, "store description", _FIX_META)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: store format {meta.get('format')} is not {FORMAT_VERSION} (written by another "
                         "lohan version); start over with --overwrite or use that version")
    check_record(path, meta, "store description", _FIX_META, _META_FIELDS, _META_LATER)
    if not all(isinstance(r, str) for r in meta.get("replaces", ())):
        raise StoreCorruptError(f"{path} (store description) is damaged: `replaces` is not a list of store ids. "
                                f"{_FIX_META}")
    try:
        StoreLayout.from_json(meta["layout"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreCorruptError(f"{path} (store description) is damaged: its layout cannot be read ({e!r}). "
                                f"{_FIX_META}") from None
    return meta


def _read_init(path: str) -> dict:
    done = read_json_checked(path, "initialization progress", _FIX_META, _INIT_FIELDS)
    _check_sums(path, "initialization progress", done["sums"], allow_none=True)
    return done


def _read_commit(path: str) -> Commit:
    data = read_json_checked(path, "commit record", _FIX_META, _COMMIT_FIELDS, _COMMIT_LATER)
    if data.get("prev") is not None:  # the commit before (data parallel), kept whole for `revert`
        check_record(path, data["prev"], "commit record", _FIX_META, _COMMIT_FIELDS, _COMMIT_LATER)
    for record in (data, data.get("prev") or {}):
        if record.get("sums") is not None:
            _check_sums(path, "commit record", record["sums"])
    data.pop("checksum")
    return Commit(**data)


def _check_sums(path: str, what: str, sums: list, allow_none: bool = False) -> None:
    """Checksums as `Sums` holds them: per block (None in the init progress of a store without checksums), per
    unit, two integers."""
    def unit_ok(u: object) -> bool:
        return isinstance(u, list) and len(u) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in u)

    for i, block in enumerate(sums):
        if (block is None and allow_none) or (isinstance(block, list) and all(map(unit_ok, block))):
            continue
        raise StoreCorruptError(f"{path} ({what}) is damaged: the checksums of block {i} are not a list of "
                                f"[state, p16] integer pairs. {_FIX_META}")


__all__ = ["ALIGN", "BlockLayout", "Commit", "StoreCorruptError", "StoreStatus", "ParamSpec", "RecordView", "StateStore",
           "StoreLayout", "UnitViews", "block_views", "plan_layout", "sub_views", "unit_sections", "unit_sums",
           "unit_views"]
