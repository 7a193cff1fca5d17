"""Data parallelism on torch.distributed: each rank trains its slice of every batch, stores and updates
1/N of every block's optimizer record, and the ranks commit each step together.

Launch with `torchrun --nproc-per-node N finetune.py ...` (or build an Engine in a process group of your
own). Per step and block:

- Forward and backward need the whole block's P16. Rank r holds only its piece of it (its shard of the
  block's flat vector, elements [r*S, (r+1)*S)); the pieces are read from each rank's own SSD directories
  and all-gathered into a padded buffer of N*S elements before the block runs (`ParamStreamer`).
- A block's gradient, accumulated over the rank's micro-batches, is all-reduced (summed) asynchronously
  while backward goes on with the blocks before it. Every rank then holds the complete gradient, takes
  the per-parameter norms from it exactly as one process would (clipping's global norm is bit-identical),
  and hands its own shard of it to its CPU optimizer, which updates the shard's P32, m, v and P16 on its
  own SSDs. SSD traffic and CPU AdamW work per rank fall by N.
- Why all-reduce and not reduce-scatter (half the bytes): `clip_grad_norm_` takes each parameter's norm
  over its whole gradient, and a parameter straddles shards; with shards only, the norm would have to be
  assembled from partial sums in another order, and clipped training would no longer match one process
  bit for bit. The extra bytes buy exactness (the cost model counts them: `network_bytes_per_step`).
- Blocks too small to split (fewer than N*N*4096 elements: norms, biases) are replicated: every rank
  updates the whole block, identically, and nothing of them is gathered.

Consistent checkpoints (two-phase): each rank makes its step durable and commits it locally, keeping the
previous commit beside it (`Commit.prev`); after a barrier rank 0 writes the group's decision
(`<name>.dp.json`: world size and step) and a second barrier lets the ranks go on. On resume the decision
is the truth: a rank whose local commit is one step ahead (killed between the two phases) goes back to
its previous commit, whose slot nothing has written since.

Host buffers are reduced and gathered over gloo (a gloo group is created when the default group is NCCL).

A single process is a group of one (`Group`: rank 0 of 1, identity collectives, no process group): the engine and
the run driver always hold a group and call it where a rank would; `DataParallel` answers those calls over
torch.distributed. Nothing outside this module asks which one it holds.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from io_engine.base import align_up
from lohan.config import EngineConfig
from lohan.crashpoints import crashpoint
from lohan.plan.formats import QBLOCK
from lohan.runtime.device import resolve_device
from lohan.store.group import decision_path, rank_dir, read_decision
from lohan.store.integrity import StoreCorruptError, write_json_atomic
from lohan.store.opening import check_request
from lohan.store.states import BlockLayout, ParamSpec, StateStore, StoreLayout

log = logging.getLogger(__name__)

SHARD_ALIGN = 4096  # elements: every shard starts 4 KiB-aligned in fp32, bf16 and fp16 buffers alike
PIECE_GRID = 64  # elements: where a shard may cut a parameter (see shard_bounds)

def shard_bounds(block: BlockLayout, world: int) -> tuple[int, ...] | None:
    """Element boundaries [0, S, 2S, ..., numel] of the ranks' shards of a block (S a multiple of
    SHARD_ALIGN), or None when the block is replicated:
    - too small for every rank to get a non-empty shard (numel >= N^2 * SHARD_ALIGN guarantees (N - 1) * S
      < numel), or
    - a boundary would cut a parameter off its 64-element grid: torch's fused AdamW runs each tensor as
      64-byte units with a vector loop and a scalar tail, which round differently, so a piece starting
      off the grid would not update bit for bit as the whole parameter does (hidden sizes that are
      multiples of 64 never hit this)."""
    numel = block.numel
    if world == 1 or numel < world * world * SHARD_ALIGN:
        return None
    s = align_up(math.ceil(numel / world), SHARD_ALIGN)
    bounds = tuple(min(r * s, numel) for r in range(world)) + (numel,)
    grid = max(PIECE_GRID, QBLOCK) if block.quantized else PIECE_GRID  # (8-bit moments: whole blocks per shard)
    for cut in bounds[1:-1]:
        if any(p.offset < cut < p.offset + p.numel and (cut - p.offset) % grid for p in block.params):
            return None
    return bounds


def shard_layout(full: StoreLayout, bounds: Sequence[tuple[int, ...] | None], rank: int) -> StoreLayout:
    """The layout of rank `rank`'s store: per block its shard [lo, hi) as a block of its own, whose
    parameters are the pieces of the block's parameters inside the shard (flat, named `name[a:z]`)."""
    blocks, offset = [], 0
    for b, bd in zip(full.blocks, bounds):
        if bd is None:
            shard = replace(b, offset=offset)
        else:
            lo, hi = bd[rank], bd[rank + 1]
            specs = []
            for s in b.params:
                a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < z:
                    specs.append(ParamSpec(f"{s.name}[{a - s.offset}:{z - s.offset}]", (z - a,), a - lo, z - a))
            shard = BlockLayout(b.index, b.name, tuple(specs), hi - lo, b.p16_itemsize, offset, b.fmt, b.shared_p16)
        blocks.append(shard)
        offset += shard.record_bytes
    return StoreLayout(tuple(blocks), full.p16_dtype, full.slots)


def shard_decays(full: BlockLayout, shard: BlockLayout, decays: Sequence[bool]) -> list[bool]:
    """Weight-decay flags of a shard's parameter pieces (each piece decays as its parameter does)."""
    by_name = {s.name: d for s, d in zip(full.params, decays)}
    return [by_name[s.name] if s.name in by_name else by_name[s.name.rpartition("[")[0]] for s in shard.params]


def network_bytes_per_step(param_count: int, world: int, p16_itemsize: int, gathers: float = 2.0,
                           grad_itemsize: int = 4) -> int:
    """Bytes each rank sends (and as many it receives) per step, with ring collectives (what gloo and NCCL
    run for large buffers): the gradient all-reduce moves 2 (N - 1) / N of the gradient (fp32 whenever
    N > 1), and each all-gather of the P16 (N - 1) / N of it, `gathers` times per step (forward and
    backward: 2; blocks that stay in memory from forward to backward are still gathered again)."""
    if world <= 1:
        return 0
    share = (world - 1) / world
    return int(2 * share * grad_itemsize * param_count + gathers * share * p16_itemsize * param_count)


def launched_world() -> int:
    """The world size torchrun (or another launcher) set for this process (1: not launched as a group)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def local_cuda_index(local_rank: int, device_count: int) -> int:
    """The CUDA device of the rank that is `local_rank` on its machine: one GPU per rank, in order. With
    one visible device every rank takes it (a launcher that sets CUDA_VISIBLE_DEVICES per rank, or ranks
    that share the GPU)."""
    if device_count < 1:
        raise ValueError("torch sees no CUDA device; run with --device cpu, or check the driver and "
                         "CUDA_VISIBLE_DEVICES")
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise ValueError(f"LOCAL_RANK={local_rank} but torch sees {device_count} CUDA devices: launch at most "
                         f"{device_count} processes per machine (torchrun --nproc-per-node {device_count}), or "
                         "make more devices visible (CUDA_VISIBLE_DEVICES)")
    return local_rank


def select_local_device(device: str) -> int | None:
    """Make this rank's GPU (LOCAL_RANK's) the current CUDA device when `device` resolves to cuda and a
    launcher set LOCAL_RANK; returns its index, or None when nothing was selected (CPU, or not launched).

    It must run before anything touches CUDA: until then every rank's current device is 0, so the hardware
    probe (`fit.detect_hardware`: the free memory, the matmul rate) and any tensor made before the engine
    binds its device would all land on GPU 0 of a multi-GPU machine."""
    local = os.environ.get("LOCAL_RANK")
    if local is None or resolve_device(device.partition(":")[0]) != "cuda":
        return None
    try:
        rank = int(local)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local!r} is not an integer; launch with torchrun, which sets it") from None
    index = local_cuda_index(rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


def init_from_env(device: str = "cpu") -> bool:
    """Join the process group a launcher described in the environment (torchrun: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); returns whether this call created it. gloo: lohan reduces host buffers.

    `device` is the run's (``auto``, ``cpu`` or ``cuda``: `EngineConfig.device`): when it resolves to CUDA,
    the rank's own GPU becomes the current device first (`select_local_device`). The default, ``cpu``,
    selects nothing."""
    select_local_device(device)
    if launched_world() <= 1 or dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True


def leave_group(done: bool) -> None:
    """Destroy the process group `init_from_env` joined. After a run that ended well on this rank, the ranks
    leave together (a barrier that gives up after a minute): a rank tearing its gloo connections down while
    another still finishes its last collective was seen to abort (std::terminate) at exit now and then."""
    if done:
        with contextlib.suppress(RuntimeError):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    dist.destroy_process_group()


@dataclass
class Group:
    """This process's place in its data-parallel group, and the payload bytes it has reduced and gathered.

    This class is the group of one a single process is (rank 0 of 1): its collectives are identities that touch
    no tensor, create no process group and need no gloo or NCCL, its store is the whole model in the run's own
    directories, and its commits are its own. `DataParallel` is a group of several ranks over torch.distributed.
    The engine, its passes and the run driver hold one or the other and never ask which: where the two differ
    in what they do (not only in a collective), the choice is a method here, the single process's behaviour
    its size-one case."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    group: Any = None  # the gloo group host buffers are reduced over (None: the default group)
    reduced_bytes: int = 0
    gathered_bytes: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def alone(self) -> bool:
        """No other rank: what this process chooses from its own timings (clip speculation by cost, a lazy
        commit, handing a gradient over as soon as its copy is done) needs no rank to choose alike, and a
        gradient is the group's sum where backward leaves it (its norms and unscaling are taken there)."""
        return self.world == 1

    @property
    def store_rank(self) -> int | None:
        """The rank whose shards this process's store holds (None: one process's store, the whole model)."""
        return None

    def rank_dirs(self, dirs: Sequence[str]) -> tuple[str, ...]:
        """This process's own NVMe directories (one process: the run's)."""
        return tuple(dirs)

    def main_dirs(self, dirs: Sequence[str]) -> tuple[str, ...]:
        """The directories of rank 0's store, the one that writes the run's outputs (one process: the run's)."""
        return tuple(dirs)

    def rank_config(self, cfg: EngineConfig) -> EngineConfig:
        """The process's own settings (one process: the run's)."""
        return cfg

    def device_name(self, device: str) -> str:
        """The process's device (one process: as configured)."""
        return device

    # ------------------------------------------------------------ collectives
    def network_bytes(self, reduced: int, gathered: int) -> int | None:
        """What ring collectives send for these payloads (see network_bytes_per_step); None: no network."""
        return None

    def wait_lanes(self, gather_s: float, reduce_wait_s: float) -> dict[str, float]:
        """A step's lanes of waits on the other ranks (P16 all-gathers, gradient sums not done when needed): none
        without other ranks."""
        return {}

    def reduce_gradient(self, host: torch.Tensor, copied: Any) -> Any:
        """A block's gradient on its way into `host` (`copied`: its copy's event) summed over the ranks: returns
        what completes it, with `wait()` and `query()`. One process: the copy itself."""
        return _Copy(copied)

    def sum_gradients(self, params: list[torch.nn.Parameter], device: Any) -> None:
        """The parameters' gradients summed over the ranks, in place (one process: already the sum)."""

    def sum(self, x: float) -> float:
        return x

    def least(self, x: int) -> int:
        """The least of the ranks' `x` (every rank calls it at the same point)."""
        return x

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return obj

    def from_main(self, data_state: Any) -> Any:
        """Rank 0's `data_state` (a resumed run's data position) and torch RNG state on every rank, so that every
        rank cuts the same global batches (one process: its own)."""
        return data_state

    # ----------------------------------------------------------------- commits
    def check_store(self, base_dirs: Sequence[str], name: str, resume: bool, overwrite: bool) -> dict | None:
        """Before the process opens its store (`dirs`): what it cannot give this run refused (`check_request`);
        returns the group's commit decision the store is brought to (`join`; one process: none)."""
        check_request(list(base_dirs), name, resume=resume, overwrite=overwrite)
        return None

    def join(self, store: StateStore, decision: dict | None, base_dirs: Sequence[str], name: str,
             rank_dirs: Sequence[str]) -> None:
        """After the process opened (or created) its store: bring it to the group's decided step (one process:
        its own commit is the run's)."""

    def commit(self, store: StateStore, base_dirs: Sequence[str], name: str, step: int, slot: int, **kw: Any) -> None:
        """Commit `step` in `slot` (one process: the store's commit is the run's)."""
        store.commit(step, slot, keep_prev=False, **kw)

    def recommit(self, store: StateStore) -> None:
        """Write the last commit again after a failed step (one process: no previous commit to keep)."""
        store.recommit(keep_prev=False)


class _Done:
    """The work of a collective a group of one completes at once."""

    def wait(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Copy:
    """A gradient's copy to the host as the work that completes it (a group of one sums nothing)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


class _Sum:
    """A gradient's all-reduce over the ranks: polled by no rank (each hands a gradient over when the next one is
    pending, at the same point on every rank)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()

    def query(self) -> bool:
        return False


class DataParallel(Group):
    """A group of several ranks over torch.distributed (module docstring): real collectives over gloo, each
    rank's store in its own `DIR/rank<r>` directories, commits in two phases."""

    @property
    def alone(self) -> bool:
        return False

    @property
    def store_rank(self) -> int | None:
        return self.rank

    @staticmethod
    def detect() -> Group:
        """The group torch.distributed was initialized with (torchrun sets the environment), or a group of one
        (`Group`) for a single process, which creates no process group. A default group of another backend than
        gloo gets a gloo group for host buffers."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return Group()
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return DataParallel(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                            int(os.environ.get("LOCAL_WORLD_SIZE", 1)), group)

    def rank_dirs(self, dirs: Sequence[str]) -> tuple[str, ...]:
        """The rank's own NVMe directories: `DIR/rank<r>` under each of the run's."""
        return tuple(rank_dir(d, self.rank) for d in dirs)

    def main_dirs(self, dirs: Sequence[str]) -> tuple[str, ...]:
        return tuple(rank_dir(d, 0) for d in dirs)

    def rank_config(self, cfg: EngineConfig) -> EngineConfig:
        """The rank's own settings: its directories (`DIR/rank<r>`) and its share of the host's memory and
        emulated disk speed (the ranks on a host share them)."""
        local = self.local_world
        return cfg.with_overrides(nvme=self.rank_dirs(cfg.store.nvme), cpu_mem=cfg.memory.cpu_mem // local,
                                  emulate_ssd_gbps=cfg.store.emulate_ssd_gbps / local if cfg.store.emulate_ssd_gbps else None)

    def device_name(self, device: str) -> str:
        """The rank's device: on CUDA its own GPU (the one `init_from_env` selected: by LOCAL_RANK, or the only
        one it sees); otherwise `device` as configured."""
        if resolve_device(device) != "cuda":
            return device
        return f"cuda:{local_cuda_index(self.local_rank, torch.cuda.device_count())}"

    # ------------------------------------------------------------ collectives
    def network_bytes(self, reduced: int, gathered: int) -> int | None:
        share = (self.world - 1) / self.world
        return int(2 * share * reduced + share * gathered)

    def wait_lanes(self, gather_s: float, reduce_wait_s: float) -> dict[str, float]:
        return {"gather": gather_s, "reduce_wait": reduce_wait_s}

    def all_reduce_async(self, t: torch.Tensor) -> Any:
        """Start summing `t` over the ranks in place; returns the work to `wait()` on."""
        self.reduced_bytes += t.numel() * t.element_size()
        return dist.all_reduce(t, group=self.group, async_op=True)

    def reduce_gradient(self, host: torch.Tensor, copied: Any) -> Any:
        """The sum over the ranks runs on the host buffer, once the copy is complete, beside the next blocks'
        backward."""
        copied.synchronize()
        return _Sum(self.all_reduce_async(host))

    def sum_gradients(self, params: list[torch.nn.Parameter], device: Any) -> None:
        """One flat host buffer (two ranks' sum is one addition, so it equals one process summing two
        micro-batches bit for bit)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([device.fetch(p.grad).reshape(-1) for p in params])
        self.all_reduce_async(flat).wait()
        at = 0
        for p in params:
            p.grad.copy_(device.put(flat[at:at + p.numel()].view(p.shape)))
            at += p.numel()

    def all_gather_(self, padded: torch.Tensor, shard: int, async_op: bool = False) -> Any:
        """In place: rank q's `shard` elements at [q*shard, (q+1)*shard) of `padded` go to every rank (a
        copy: no arithmetic touches the bits). With `async_op`, returns the work to `wait()` on."""
        flat = padded[:self.world * shard]
        self.gathered_bytes += flat.numel() * flat.element_size()
        return dist.all_gather_into_tensor(flat, flat[self.rank * shard:(self.rank + 1) * shard], group=self.group,
                                           async_op=async_op)

    def gather_block(self, own: list[torch.Tensor], bounds: tuple[int, ...], block: BlockLayout) -> list[torch.Tensor]:
        """A sharded block's whole fp32 parameters from every rank's shard (`own`: this rank's pieces; every rank
        calls it for the same blocks in the same order)."""
        size = bounds[1] - bounds[0]
        whole = torch.zeros(self.world * size, dtype=torch.float32)
        whole[self.rank * size:self.rank * size + sum(t.numel() for t in own)] = torch.cat(own)
        self.all_gather_(whole, size)
        return [whole[p.offset:p.offset + p.numel].view(p.shape) for p in block.params]

    def sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t)

    def least(self, x: int) -> int:
        values = [0] * self.world
        dist.all_gather_object(values, x, group=self.group)
        return min(values)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def from_main(self, data_state: Any) -> Any:
        data_state, rng = self.broadcast((data_state, torch.get_rng_state()))
        torch.set_rng_state(rng)
        return data_state

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    # ----------------------------------------------------------------- commits
    def check_store(self, base_dirs: Sequence[str], name: str, resume: bool, overwrite: bool) -> dict | None:
        """Alike on every rank: the group's commit decision, and what this group cannot resume (`check_group`)."""
        return check_group(self, base_dirs, name, resume)

    def join(self, store: StateStore, decision: dict | None, base_dirs: Sequence[str], name: str,
             rank_dirs: Sequence[str]) -> None:
        join_group(self, store, decision, base_dirs, name, rank_dirs)

    def commit(self, store: StateStore, base_dirs: Sequence[str], name: str, step: int, slot: int, **kw: Any) -> None:
        """Locally, keeping the previous commit beside it, then the group decides (module docstring)."""
        store.commit(step, slot, keep_prev=True, **kw)
        crashpoint("engine.dp_local_commit")
        self.decide(base_dirs, name, step)

    def recommit(self, store: StateStore) -> None:
        store.recommit(keep_prev=True)

    def decide(self, base_dirs: Sequence[str], name: str, step: int) -> None:
        """Second phase of a step's commit: every rank has committed `step` locally; rank 0 records the
        group's decision, and no rank goes on (to write the slot the previous step lives in) before it is
        durable."""
        self.barrier()
        if self.is_main:
            write_json_atomic(decision_path(base_dirs, name), {"world": self.world, "step": step})
        self.barrier()


def current_group(dp: Group | None = None) -> Group:
    """`dp`, or the group this process was launched in (`DataParallel.detect`: a group of one when none)."""
    return dp if dp is not None else DataParallel.detect()


def check_group(dp: DataParallel, base_dirs: Sequence[str], name: str, resume: bool) -> dict | None:
    """Before a rank opens its store: the group's commit decision (rank 0 reads it, every rank gets it), and
    what cannot be resumed by this group (`check_request`) refused alike on every rank."""
    problem, decision = None, None
    if dp.is_main:
        try:
            check_request(base_dirs, name, resume=resume, overwrite=True, world=dp.world, rank=dp.rank)
            decision = read_decision(base_dirs, name)
        except (StoreCorruptError, ValueError, OSError) as e:
            problem = str(e)
    problem, decision = dp.broadcast((problem, decision))
    if problem:
        raise ValueError(problem)
    return decision if resume else None


def join_group(dp: DataParallel, store: StateStore, decision: dict | None, base_dirs: Sequence[str], name: str,
               rank_dirs: Sequence[str]) -> None:
    """After a rank opened (or created) its store: bring it to the group's decided step, then record the decision
    for this group. A rank killed between the two phases of a commit is one step ahead: it goes back to its
    previous commit (that slot was not written since). Anything else is refused on every rank."""
    commit = store.commit_state
    target = decision["step"] if decision else 0
    problem = None
    if commit.step == target + 1 and commit.prev is not None and commit.prev["step"] == target:
        log.info("rank %d: going back from step %d to the group's committed step %d", dp.rank, commit.step, target)
        store.revert()
    elif commit.step != target:
        problem = (f"rank {dp.rank}'s store in {rank_dirs[0]} is committed at step {commit.step}, the group's "
                   f"commit record ({base_dirs[0]}) at step {target}: the directories do not belong to "
                   "one run (another run's rank directories, or restored from different backups). Restore them "
                   "together, or start over with --overwrite")
    problems = [None] * dp.world
    dist.all_gather_object(problems, problem, group=dp.group)
    bad = [p for p in problems if p]
    if bad:
        raise StoreCorruptError("; ".join(bad))
    dp.decide(base_dirs, name, target)
