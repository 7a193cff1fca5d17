"""I/O benchmark of io_engine against fio on the same directory, sizes and block size.

What it measures, per configuration (backend x SSD count x chunk size x queue depth x request size):
a sustained sequential write of a fresh `--size-gib` volume, then a sequential read of the same bytes
(everything read was written first: preallocated-but-unwritten extents read back as zeros without
touching the disk, which would inflate read speed). Each request of `--request-mib` is stamped with
its index and the stamps are checked on read, so a read that moved nothing fails the run. The
benchmark keeps a bounded window of requests in flight, from one buffer pool of the volume.

In the same run, interleaved with the engine (fio, engine, engine, fio, engine, ...), a reference
measurement with `fio --ioengine=libaio --direct=1` (`--rw=write`, then `--rw=read` on the same
file) on the directory of the first SSD, with the same total size, `bs` = the engine's I/O unit
(`--block-mib`, the size of the pieces the engine cuts requests into) and `iodepth` = the engine's
queue depth x N (the I/Os it may have in flight on this one disk). Without fio (and no way to
install it) `dd oflag=direct / iflag=direct` is used, which has an I/O depth of 1 and is labelled
as such. All I/O is O_DIRECT (io_engine, fio, dd), so
the page cache is neither used nor dropped. Each number is the median of `--repeats`. The best
configuration per direction is then measured again against fio (`--confirm-repeats`, interleaved),
and the headline ratios come from that confirmation: the maximum over many noisy medians would
overstate the engine.

`--emulate-ssd-gbps X` (default `auto`: X = 0.6 * min(fio read, fio write) / 4) throttles every
directory to X GB/s, so N directories on one disk behave like N independent X GB/s SSDs; with
it, N in {1, 2, 4} are measured and `scaling_efficiency` = min over N and direction of
aggregate / (N * single-SSD). These records are labelled `"emulated": true`.

Run (from the repository root):
    .venv/bin/python benchmarks/io_bench.py --quick
    .venv/bin/python benchmarks/io_bench.py    # full, ~20 min
    .venv/bin/python benchmarks/io_bench.py --dry-run                                 # plan only
Keys of the JSON report: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import errno
import json
import math
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench_env import (  # sibling module (the script's own directory)
    portable,
    result_fields,
    result_path,
    shared_environment,
)

if TYPE_CHECKING:
    import torch

    from io_engine import Volume

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a checkout, without installing the package

MiB = 1 << 20
GiB = 1 << 30
SLAB_NAME = "io_bench"  # volume name: the slab files are <dir>/ssd<i>/io_bench.slab (+ io_bench.volume.json)
FIO_FILE, DD_FILE = "io_bench.fio.dat", "io_bench.dd.dat"  # reference files, in <dir>/ssd0

# The sweeps, declared as data. `scaling_backends`: "first" = the first available of --backends
# (the one `auto` picks), "all" = every available backend.
PRESETS: dict[str, dict] = {
    "full": dict(size_gib=4.0, ssds=[1, 2, 4], chunk_mib=[1, 4], queue_depth=[4, 16], request_mib=[4],
                 block_mib=[1], repeats=3, confirm_repeats=5, scaling_repeats=3, scaling_ssds=[1, 2, 4],
                 scaling_backends="all"),
    "quick": dict(size_gib=1.0, ssds=[1], chunk_mib=[4], queue_depth=[4, 16], request_mib=[4],
                  block_mib=[1], repeats=3, confirm_repeats=5, scaling_repeats=2, scaling_ssds=[1, 2, 4],
                  scaling_backends="first"),
}
AUTO_EMULATION_FRACTION = 0.6  # 4 emulated SSDs together use at most this fraction of the disk's fio bandwidth


@dataclass(frozen=True)
class EngineConfig:
    """One engine configuration; sizes in bytes."""

    backend: str
    n_ssds: int
    chunk_bytes: int
    queue_depth: int
    request_bytes: int
    block_bytes: int
    emulate_gbps: float | None = None
    window_requests: int | None = None

    @property
    def window(self) -> int:
        """Requests the benchmark keeps in flight (`--window`); by default enough to give every device
        `queue_depth` blocks twice over, so the engine's queues never run dry while the benchmark refills."""
        if self.window_requests:
            return self.window_requests
        need = 2 * self.queue_depth * self.n_ssds * self.block_bytes
        return max(2, math.ceil(need / self.request_bytes))

    def label(self) -> str:
        emu = f" emu={self.emulate_gbps:.3f}GB/s" if self.emulate_gbps else ""
        return (f"{self.backend:<7} N={self.n_ssds} chunk={_mib(self.chunk_bytes)} qd={self.queue_depth:<2} "
                f"req={_mib(self.request_bytes)} blk={_mib(self.block_bytes)}{emu}")


@dataclass(frozen=True)
class FioConfig:
    """The reference job matching an engine configuration: bs = the engine's block, iodepth = the I/Os
    the engine may have in flight on the disk, queue depth x N (all N directories share one disk here)."""

    block_bytes: int
    iodepth: int

    @classmethod
    def matching(cls, c: EngineConfig) -> FioConfig:
        return cls(c.block_bytes, c.queue_depth * c.n_ssds)


@dataclass
class Plan:
    size_bytes: int
    repeats: int
    confirm_repeats: int
    scaling_repeats: int
    base_dir: Path
    backends: list[str]
    skipped_backends: dict[str, str]
    sweep: list[EngineConfig]
    scaling: list[EngineConfig]  # emulate_gbps filled in once fio has run when `auto`
    emulate: str  # "auto", "off" or a number as text
    tool: str  # "fio" or "dd"
    notes: list[str] = field(default_factory=list)

    def fio_configs(self) -> list[FioConfig]:
        return list(dict.fromkeys(FioConfig.matching(c) for c in self.sweep))


# ---------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "scratch",
                   help="base directory; SSD i is the subdirectory ssd<i> (all on this one disk)")
    p.add_argument("--size-gib", type=float, help="bytes moved per measurement and direction (full: 4, quick: 1)")
    p.add_argument("--backends", nargs="+", default=["aio", "threads"], choices=["aio", "threads"])
    p.add_argument("--ssds", nargs="+", type=int, help="SSD counts of the unthrottled sweep (full: 1 2 4)")
    p.add_argument("--chunk-mib", nargs="+", type=int, help="stripe chunk sizes (full: 1 4)")
    p.add_argument("--queue-depth", nargs="+", type=int, help="engine queue depths = fio iodepths (full: 4 16)")
    p.add_argument("--request-mib", nargs="+", type=int, help="size of each benchmark request (default 4)")
    p.add_argument("--block-mib", nargs="+", type=float,
                   help="engine I/O unit (block_bytes) = fio bs (default 1; may be fractional, 4 KiB multiple)")
    p.add_argument("--window", type=int, default=None,
                   help="requests in flight from the benchmark (default: 2 x queue depth x SSDs x block / request, >= 2)")
    p.add_argument("--scaling-ssds", nargs="+", type=int, help="SSD counts of the emulated scaling (1 2 4)")
    p.add_argument("--emulate-ssd-gbps", default="auto", type=_emulation,
                   help="per-directory emulated bandwidth in GB/s for the scaling part; 'auto' = "
                        f"{AUTO_EMULATION_FRACTION} * min(fio read, fio write) / 4; 'off' skips it")
    p.add_argument("--repeats", type=int, help="repeats per measurement; medians are reported (3)")
    p.add_argument("--confirm-repeats", type=int,
                   help="repeats of the confirmation of the best configuration per direction (5)")
    p.add_argument("--scaling-repeats", type=int,
                   help="repeats of the emulated measurements, which vary by < 1 %% (full: 3, quick: 2)")
    p.add_argument("--quick", action="store_true", help="small sweep that finishes in under 3 minutes")
    p.add_argument("--out", type=Path,
                   help="JSON report (+ a .md summary next to it); default benchmarks/results/io_bench[/quick]/<machine>.json")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _emulation(value: str) -> str:
    """argparse type of --emulate-ssd-gbps: 'auto', 'off' or a positive number (kept as text)."""
    if value in ("auto", "off"):
        return value
    try:
        if float(value) > 0:
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected 'auto', 'off' or a positive number of GB/s, got {value!r}")


def build_plan(args: argparse.Namespace, aio_reason: str | None) -> Plan:
    """The sweep as a list of configurations; `aio_reason` is why aio is unavailable (None: it is)."""
    skipped = {}
    backends = []
    for b in dict.fromkeys(args.backends):
        if b == "aio" and aio_reason is not None:
            skipped[b] = aio_reason
        else:
            backends.append(b)
    size = int(args.size_gib * GiB)
    sweep = [EngineConfig(b, n, c * MiB, q, r * MiB, int(blk * MiB), None, args.window)
             for b in backends for n in args.ssds for c in args.chunk_mib for q in args.queue_depth
             for r in args.request_mib for blk in args.block_mib]
    scaling: list[EngineConfig] = []
    if args.emulate_ssd_gbps != "off" and backends:
        sb = backends if args.scaling_backends == "all" else backends[:1]
        # One configuration per backend: the first chunk, request and block; the largest queue depth.
        c, r, blk, q = args.chunk_mib[0] * MiB, args.request_mib[0] * MiB, int(args.block_mib[0] * MiB), \
            max(args.queue_depth)
        gbps = None if args.emulate_ssd_gbps == "auto" else float(args.emulate_ssd_gbps)
        scaling = [EngineConfig(b, n, c, q, r, blk, gbps, args.window) for b in sb for n in args.scaling_ssds]
    tool = "fio" if shutil.which("fio") else "dd"
    return Plan(size, args.repeats, args.confirm_repeats, args.scaling_repeats, args.dir.resolve(), backends, skipped, sweep, scaling,
                args.emulate_ssd_gbps, tool)


def check_plan(plan: Plan) -> list[str]:
    """Every problem that would make the run fail or lie, each with how to fix it."""
    problems = []
    configs = plan.sweep + plan.scaling
    n_max = max([c.n_ssds for c in configs], default=1)
    for name, attr in (("--chunk-mib", "chunk_bytes"), ("--request-mib", "request_bytes"), ("--block-mib", "block_bytes")):
        for value in sorted({getattr(c, attr) for c in configs}):
            if value <= 0 or value % 4096:
                problems.append(f"{name}: {value} B is not a positive multiple of 4 KiB")
            elif plan.size_bytes % value:
                problems.append(f"--size-gib ({plan.size_bytes} B) is not a multiple of {name} ({value} B)")
    if plan.repeats < 1 or plan.scaling_repeats < 1 or plan.confirm_repeats < 0:
        problems.append("--repeats and --scaling-repeats must be at least 1, --confirm-repeats at least 0")
    if any(c.n_ssds < 1 or c.queue_depth < 1 or (c.window_requests is not None and c.window_requests < 1)
           for c in configs):
        problems.append("--ssds, --scaling-ssds, --queue-depth and --window must be at least 1")
    if not plan.backends:
        problems.append("no backend left to measure: " + "; ".join(f"{b}: {r}" for b, r in plan.skipped_backends.items()))
    try:
        plan.base_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return problems + [f"{plan.base_dir}: cannot create it ({e.strerror}); pass another --dir"]
    probe = plan.base_dir / f".io_bench-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            problems.append(f"{plan.base_dir}: the filesystem refuses O_DIRECT, so every number would measure the "
                            "page cache; pass a --dir on an ext4/xfs filesystem")
        else:
            problems.append(f"{plan.base_dir}: not writable ({e.strerror}); fix its permissions or pass another --dir")
    finally:
        probe.unlink(missing_ok=True)
    # At most one volume (size, over N files, rounded up to a chunk each) or one fio file exists at a time.
    chunk_max = max([c.chunk_bytes for c in configs], default=MiB)
    need = plan.size_bytes + n_max * chunk_max + 256 * MiB
    free = shutil.disk_usage(plan.base_dir).free
    if need > free:
        problems.append(f"{plan.base_dir}: the test needs {need / GiB:.2f} GiB free, {free / GiB:.2f} GiB are; "
                        "lower --size-gib, free space, or pass another --dir")
    return problems


# ------------------------------------------------------------------------------------ measurements
Record = dict  # one measurement of one direction; keys listed in benchmarks/README.md


def _record(kind: str, direction: str, nbytes: int, seconds: float, repeat: int, **extra: object) -> Record:
    return {"kind": kind, "direction": direction, "bytes": nbytes, "seconds": round(seconds, 6),
            "gbps": round(nbytes / seconds / 1e9, 4), "repeat": repeat, **extra}


class Meter:
    """What else the machine did during one measurement, so that runs on a shared box can be judged.

    `cpu_busy`: fraction of all CPUs busy machine-wide (/proc/stat; includes kernel work done in
    kworkers, e.g. ext4 converting unwritten extents after O_DIRECT writes). `cpu_own`: the part
    used by this process and its children (fio, dd). `foreign_io_bytes`: bytes the disk of `--dir`
    moved beyond the measurement's own (/proc/diskstats), i.e. other users' I/O plus metadata.
    """

    device: str | None = None  # block device name of --dir in /proc/diskstats, e.g. "vda"

    def __init__(self) -> None:
        self._cpu, self._disk, self._own = self._stat(), self._diskstats(), self._own_cpu()
        self._t0 = time.perf_counter()

    @staticmethod
    def _stat() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                # user nice system idle iowait irq softirq steal (guest time is already in user)
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields) - idle, sum(fields)

    @classmethod
    def _diskstats(cls) -> int | None:
        if cls.device is None:
            return None
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    x = line.split()
                    if x[2] == cls.device:
                        return (int(x[5]) + int(x[9])) * 512  # sectors read + written
        except (OSError, ValueError, IndexError):
            pass
        return None

    @staticmethod
    def _own_cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def result(self, nbytes: int) -> dict[str, float | int | None]:
        cpu, disk, own, wall = self._stat(), self._diskstats(), self._own_cpu(), time.perf_counter() - self._t0
        out: dict[str, float | int | None] = {"cpu_busy": None, "cpu_own": None, "foreign_io_bytes": None}
        if cpu and self._cpu and cpu[1] > self._cpu[1]:
            out["cpu_busy"] = round((cpu[0] - self._cpu[0]) / (cpu[1] - self._cpu[1]), 3)
        if wall > 0:  # over the same window as cpu_busy (for fio and dd: the whole process)
            out["cpu_own"] = round((own - self._own) / wall / (os.cpu_count() or 1), 3)
        if disk is not None and self._disk is not None:
            out["foreign_io_bytes"] = max(0, disk - self._disk - nbytes)
        return out


def _block_device(path: Path) -> str | None:
    """The /proc/diskstats name of the disk holding `path` (partitions map to their own entry)."""
    try:
        dev = os.stat(path).st_dev
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
        return name or None
    except OSError:
        return None


def _ssd_dirs(base: Path, n: int) -> list[Path]:
    dirs = [base / f"ssd{i}" for i in range(n)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    return dirs


def _remove_volume(dirs: list[Path]) -> None:
    for d in dirs:
        for name in (f"{SLAB_NAME}.slab", f"{SLAB_NAME}.volume.json", f"{SLAB_NAME}.volume.json.tmp"):
            (d / name).unlink(missing_ok=True)


def measure_engine(cfg: EngineConfig, size: int, base: Path, repeat: int) -> list[Record]:
    """Write a fresh volume sequentially, then read it back; one record per direction."""
    import torch

    from io_engine import open_volume

    dirs = _ssd_dirs(base, cfg.n_ssds)
    _remove_volume(dirs)  # a leftover volume would be reopened with its extents already written
    vol = open_volume([str(d) for d in dirs], size, chunk_bytes=cfg.chunk_bytes, backend=cfg.backend,
                      name=SLAB_NAME, queue_depth=cfg.queue_depth, block_bytes=cfg.block_bytes,
                      emulate_ssd_gbps=cfg.emulate_gbps)
    pool = vol.buffer_pool(cfg.window * cfg.request_bytes)
    bufs = []
    try:
        # Buffers are allocated (page-locked for aio) and filled before the clock starts.
        gen = torch.Generator().manual_seed(repeat)
        for _ in range(cfg.window):
            b = pool.acquire(cfg.request_bytes)
            b.tensor.copy_(torch.randint(0, 256, (cfg.request_bytes,), dtype=torch.uint8, generator=gen))
            bufs.append(b)
        if not vol.backend.is_direct(bufs[0].tensor):
            raise RuntimeError("pool buffers would be staged through copies; the benchmark would not measure I/O")
        records = []
        for direction in ("write", "read"):
            meter = Meter()
            seconds = _stream(vol, [b.tensor for b in bufs], size, cfg.request_bytes, write=direction == "write")
            records.append(_record("engine", direction, size, seconds, repeat, **meter.result(size),
                                   **_config_fields(cfg)))
        return records
    finally:
        for b in bufs:
            b.release()
        vol.close()
        pool.clear()
        _remove_volume(dirs)


def _stream(vol: Volume, bufs: list[torch.Tensor], size: int, request: int, write: bool) -> float:
    """Issue size/request sequential requests with len(bufs) in flight; returns the seconds taken.

    Each request carries its index in its first and last 8 bytes; reads check them, so a read
    that moved nothing (or the wrong bytes) fails instead of looking fast.
    """
    import torch

    i64 = torch.int64
    free = list(range(len(bufs)))
    inflight: collections.deque = collections.deque()
    n_requests = size // request

    def check(k: int, i: int) -> None:
        t = bufs[i]
        head, tail = int(t[:8].view(i64)[0]), int(t[-8:].view(i64)[0])
        if head != k or tail != k:
            raise RuntimeError(f"request {k} read back stamps ({head}, {tail}): the data read is not the data written")

    t0 = time.perf_counter()
    for k in range(n_requests):
        if not free:
            kk, i, h = inflight.popleft()
            h.wait()
            if not write:
                check(kk, i)
            free.append(i)
        i = free.pop()
        t = bufs[i]
        if write:
            t[:8].view(i64).fill_(k)
            t[-8:].view(i64).fill_(k)
            h = vol.write(t, k * request)
        else:
            t[:8].zero_()
            t[-8:].zero_()
            h = vol.read_into(t, k * request)
        inflight.append((k, i, h))
    while inflight:
        kk, i, h = inflight.popleft()
        h.wait()
        if not write:
            check(kk, i)
    return time.perf_counter() - t0


def _config_fields(cfg: EngineConfig) -> dict:
    return {"backend": cfg.backend, "n_ssds": cfg.n_ssds, "chunk_bytes": cfg.chunk_bytes,
            "queue_depth": cfg.queue_depth, "request_bytes": cfg.request_bytes, "block_bytes": cfg.block_bytes,
            "window_requests": cfg.window, "emulated": cfg.emulate_gbps is not None,
            "emulate_gbps": cfg.emulate_gbps}


def measure_fio(fc: FioConfig, size: int, base: Path, repeat: int) -> list[Record]:
    """fio write then read of one fresh file in the first SSD directory (same file, same sizes)."""
    path = _ssd_dirs(base, 1)[0] / FIO_FILE
    path.unlink(missing_ok=True)
    records = []
    try:
        for direction in ("write", "read"):
            # fallocate=posix: preallocate like the volume does (posix_fallocate), then overwrite.
            cmd = ["fio", "--name=io_bench", f"--filename={path}", f"--size={size}", f"--bs={fc.block_bytes}",
                   f"--iodepth={fc.iodepth}", "--ioengine=libaio", "--direct=1", f"--rw={direction}",
                   "--fallocate=posix", "--numjobs=1", "--output-format=json"]
            meter = Meter()
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            job = json.loads(out[out.index("{"):])["jobs"][0][direction]
            if job["io_bytes"] != size:
                raise RuntimeError(f"fio moved {job['io_bytes']} of {size} bytes: {shlex.join(cmd)}")
            seconds = job["io_bytes"] / job["bw_bytes"]
            records.append(_record("fio", direction, size, seconds, repeat, **meter.result(size),
                                   block_bytes=fc.block_bytes,
                                   queue_depth=fc.iodepth, n_ssds=1, emulated=False, command=shlex.join(cmd)))
    finally:
        path.unlink(missing_ok=True)
    return records


def measure_dd(fc: FioConfig, size: int, base: Path, repeat: int) -> list[Record]:
    """The fallback reference: dd with direct I/O (I/O depth 1), timed around the process."""
    path = _ssd_dirs(base, 1)[0] / DD_FILE
    path.unlink(missing_ok=True)
    count = size // fc.block_bytes
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    cmds = {"write": ["dd", "if=/dev/zero", f"of={path}", f"bs={fc.block_bytes}", f"count={count}",
                      "oflag=direct", "conv=notrunc", "status=none"],
            "read": ["dd", f"if={path}", "of=/dev/null", f"bs={fc.block_bytes}", f"count={count}",
                     "iflag=direct", "status=none"]}
    records = []
    try:
        for direction, cmd in cmds.items():
            meter, t0 = Meter(), time.perf_counter()
            subprocess.run(cmd, check=True)
            seconds = time.perf_counter() - t0
            records.append(_record("dd", direction, size, seconds, repeat, **meter.result(size),
                                   block_bytes=fc.block_bytes, queue_depth=1, n_ssds=1, emulated=False,
                                   command=shlex.join(cmd)))
    finally:
        path.unlink(missing_ok=True)
    return records


def ensure_fio() -> tuple[str, str]:
    """("fio", version) when fio is or can be installed (apt, as root), else ("dd", why)."""
    if not shutil.which("fio") and os.geteuid() == 0 and shutil.which("apt-get"):
        print("fio not found; installing it with apt-get ...", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], capture_output=True, env=env)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
            subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], capture_output=True, env=env)
    if shutil.which("fio"):
        return "fio", subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    return "dd", "fio is not installed and could not be installed; dd (direct I/O, depth 1) is the reference"


# --------------------------------------------------------------------------------------- analysis
def _key(r: Record) -> tuple:
    return (r["phase"], r["kind"], r.get("backend"), r["n_ssds"], r.get("chunk_bytes"), r["queue_depth"],
            r.get("request_bytes"), r["block_bytes"], r.get("window_requests"), r["emulated"], r["direction"])


def medians(records: list[Record]) -> list[dict]:
    """One row per phase, configuration and direction: median GB/s over repeats, and every raw value."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault(_key(r), []).append(r)
    rows = []
    for rs in groups.values():
        row = {k: v for k, v in rs[0].items() if k not in ("bytes", "seconds", "gbps", "repeat", "command")}
        row["gbps_median"] = round(statistics.median(r["gbps"] for r in rs), 4)
        row["gbps_all"] = [r["gbps"] for r in rs]
        rows.append(row)
    return rows


def _is(row: dict, cfg: EngineConfig) -> bool:
    return row["kind"] == "engine" and all(row[k] == v for k, v in _config_fields(cfg).items())


def _ref(rows: list[dict], phase: str, block: int, qd: int, direction: str) -> dict | None:
    """The reference row (fio, or dd at depth 1) for an engine row of the same phase and direction."""
    for r in rows:
        if r["phase"] == phase and r["kind"] in ("fio", "dd") and r["block_bytes"] == block \
                and r["direction"] == direction and (r["queue_depth"] == qd or r["kind"] == "dd"):
            return r
    return None


def best_configs(records: list[Record], sweep: list[EngineConfig]) -> dict[str, EngineConfig]:
    """Per direction, the unthrottled configuration with the highest median in the sweep."""
    rows = medians([r for r in records if r["phase"] == "sweep"])
    out = {}
    for direction in ("write", "read"):
        scored = [(row["gbps_median"], c) for c in sweep for row in rows if row["direction"] == direction and _is(row, c)]
        if scored:
            out[direction] = max(scored, key=lambda x: x[0])[1]
    return out


def analyze(rows: list[dict], chosen: dict[str, EngineConfig]) -> dict:
    """The headline numbers: best engine configuration vs fio (confirmed), and the emulated scaling."""
    out: dict = {"best": {}, "best_n1_sweep": {}, "scaling": {}}
    for r in rows:  # per-configuration ratios, same phase
        if r["kind"] == "engine" and not r["emulated"]:
            ref = _ref(rows, r["phase"], r["block_bytes"], r["queue_depth"] * r["n_ssds"], r["direction"])
            r["ratio_vs_fio"] = round(r["gbps_median"] / ref["gbps_median"], 4) if ref else None
    for direction, cfg in chosen.items():
        entry: dict = {"config": asdict(cfg)}
        for phase in ("sweep", "confirm"):
            row = next((r for r in rows if r["phase"] == phase and r["direction"] == direction and _is(r, cfg)), None)
            ref = row and _ref(rows, phase, cfg.block_bytes, FioConfig.matching(cfg).iodepth, direction)
            if row and ref:
                entry[phase] = {"gbps": row["gbps_median"], "gbps_all": row["gbps_all"],
                                "reference_gbps": ref["gbps_median"], "reference_gbps_all": ref["gbps_all"],
                                "ratio_vs_fio": row["ratio_vs_fio"]}
            if row and ref and len(row["gbps_all"]) == len(ref["gbps_all"]):
                # Each engine measurement ran right after its reference: the median of per-pair ratios
                # is a second estimate, less sensitive to slow drifts of the disk.
                pairs = [e / f for e, f in zip(row["gbps_all"], ref["gbps_all"])]
                entry[phase]["paired_ratio_median"] = round(statistics.median(pairs), 4)
        entry["ratio_vs_fio"] = entry.get("confirm", entry.get("sweep", {})).get("ratio_vs_fio")
        out["best"][direction] = entry
    sweep_n1 = [r for r in rows if r["phase"] == "sweep" and r["kind"] == "engine" and not r["emulated"]
                and r["n_ssds"] == 1]
    for direction in ("write", "read"):
        cands = [r for r in sweep_n1 if r["direction"] == direction]
        if cands:
            out["best_n1_sweep"][direction] = max(cands, key=lambda r: r["gbps_median"])
    emulated = [r for r in rows if r["kind"] == "engine" and r["emulated"]]
    for backend in dict.fromkeys(r["backend"] for r in emulated):
        per_n: dict = {}
        effs = []
        for direction in ("write", "read"):
            rs = {r["n_ssds"]: r for r in emulated if r["backend"] == backend and r["direction"] == direction}
            if 1 not in rs:
                continue
            single = rs[1]["gbps_median"]
            for n, r in sorted(rs.items()):
                eff = r["gbps_median"] / (n * single)
                r["scaling_efficiency"] = round(eff, 4)
                per_n.setdefault(str(n), {})[direction] = {"gbps": r["gbps_median"], "efficiency": round(eff, 4),
                                                           "ideal_gbps": round(n * single, 4)}
                effs.append(eff)
        out["scaling"][backend] = {"per_n": per_n, "efficiency": round(min(effs), 4) if effs else None,
                                   "emulate_gbps": next(r["emulate_gbps"] for r in emulated if r["backend"] == backend)}
    return out


# ----------------------------------------------------------------------------------------- report
def environment(base: Path, tool_version: str) -> dict:
    mounts = []
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        pass
    real = os.path.realpath(base)
    mount = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                key=lambda m: len(m[1]), default=None)
    usage = shutil.disk_usage(base)
    return shared_environment(("torch", "deepspeed"), versions={"reference_tool": tool_version}, hardware={
        "disk_total_bytes": usage.total, "disk_free_bytes": usage.free,
        "device": mount[0] if mount else None, "filesystem": mount[2] if mount else None,
        "mount_point": mount[1] if mount else None}, dirty_paths=("io_engine", "benchmarks"))


def _fmt_cfg(r: dict) -> str:
    if r["kind"] != "engine":
        return f"{r['kind']} bs={_mib(r['block_bytes'])} iodepth={r['queue_depth']}"
    return (f"{r['backend']} N={r['n_ssds']} chunk={_mib(r['chunk_bytes'])} qd={r['queue_depth']} "
            f"req={_mib(r['request_bytes'])} blk={_mib(r['block_bytes'])} win={r['window_requests']}")


def _mib(n: int) -> str:
    return f"{n / MiB:g}MiB"


def tables(rows: list[dict]) -> str:
    """Markdown tables (also printed to the console), one per phase: sweep, confirmation, scaling."""
    phases = [("sweep", "Sweep (unthrottled; ratio = engine / reference with bs = block, iodepth = qd x N):", "/ fio"),
              ("confirm", "Confirmation of the best configuration per direction (fresh, interleaved):", "/ fio"),
              ("scaling", "Emulated SSDs (every directory throttled; efficiency = aggregate / (N x N=1)):", "efficiency")]
    lines: list[str] = []
    for phase, title, what in phases:
        by_cfg: dict[str, dict] = {}
        for r in rows:
            if r["phase"] == phase:
                name = _fmt_cfg(r) + (f" emulated {r['emulate_gbps']:.3f} GB/s" if r["emulated"] else "")
                by_cfg.setdefault(name, {})[r["direction"]] = r
        if not by_cfg:
            continue
        key = "scaling_efficiency" if phase == "scaling" else "ratio_vs_fio"
        lines += ["", title, "",
                  f"| configuration | write GB/s | read GB/s | write {what} | read {what} | raw write GB/s | raw read GB/s |",
                  "|---|---:|---:|---:|---:|---|---|"]
        for name, d in by_cfg.items():
            w, rd = d.get("write", {}), d.get("read", {})
            lines.append(f"| {name} | {_num(w.get('gbps_median'))} | {_num(rd.get('gbps_median'))} "
                         f"| {_num(w.get(key))} | {_num(rd.get(key))} | {_raw(w)} | {_raw(rd)} |")
    return "\n".join(lines).strip("\n")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _raw(r: dict) -> str:
    return " ".join(f"{g:.2f}" for g in r.get("gbps_all", []))


def markdown(report: dict) -> str:
    s = report["settings"]
    hw, ver = report["hardware"], report["versions"]
    lines = [f"# io_bench — {report['timestamp']}", "",
             f"Command: `{report['command']}` (in `{report['cwd']}`)", "",
             f"- **write_ratio_vs_fio**: {report['write_ratio_vs_fio']}",
             f"- **read_ratio_vs_fio**: {report['read_ratio_vs_fio']}",
             f"- **scaling_efficiency** (emulated, {s['scaling_backend']} backend, "
             f"{s['emulate_ssd_gbps']} GB/s per directory): {report['scaling_efficiency']}", ""]
    if report["notes"]:
        lines += ["Notes:", *[f"- {n}" for n in report["notes"]], ""]
    for direction in ("write", "read"):
        b = report["best"].get(direction)
        if b and "confirm" in b:
            c, conf = b["config"], b["confirm"]
            lines.append(f"- Best {direction} configuration (sweep): {_fmt_cfg({'kind': 'engine', **_cfg_row(c)})}; "
                         f"confirmed at {conf['gbps']:.3f} GB/s vs {s['reference_tool']} {conf['reference_gbps']:.3f} GB/s "
                         f"(bs={_mib(c['block_bytes'])}, iodepth={c['queue_depth'] * c['n_ssds']}).")
    lines += ["", f"Each number is the median of the repeats ({s['repeats']} per measurement, {s['confirm_repeats']} "
              f"in the confirmation, {s['scaling_repeats']} emulated) of {s['size_bytes'] / GiB:g} GiB per direction, GB = 1e9 bytes; the raw values "
              "follow. All I/O uses O_DIRECT, so the page cache is neither used nor dropped. The disk is noisy: "
              "compare numbers measured in the same run.", "",
              tables(report["summary"]), "",
              f"Hardware: {hw['cpu_count']} CPUs ({hw['cpu_model']}), {hw['ram_bytes'] / GiB:.1f} GiB RAM, "
              f"{hw['device']} ({hw['filesystem']}) with {hw['disk_free_bytes'] / GiB:.0f} GiB free, "
              f"kernel {hw['kernel']}.",
              f"Versions: python {ver['python']}, torch {ver['torch']}, deepspeed {ver['deepspeed']}, "
              f"{ver['reference_tool']}, commit {ver['git_commit']}.",
              f"Wall time: {report['wall_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def _cfg_row(c: dict) -> dict:
    """An EngineConfig as a dict, with the field names of the records."""
    return {**c, "window_requests": EngineConfig(**c).window}


# ------------------------------------------------------------------------------------------- main
def run(plan: Plan, log: Callable[[str], None]) -> tuple[list[Record], dict[str, EngineConfig]]:
    """Unthrottled sweep interleaved with the reference tool, a confirmation of the best configuration
    per direction (fresh, again interleaved, so its ratio is not inflated by picking the maximum of
    noisy medians), then the emulated scaling. Returns every record and the best configurations."""
    measure_ref = measure_fio if plan.tool == "fio" else measure_dd
    records: list[Record] = []

    def emit(rs: list[Record], phase: str, what: str, r: int, of: int) -> None:
        for x in rs:
            x["phase"] = phase
            records.append(x)
            log(f"{phase:<7} {what:<58} rep {r + 1}/{of}  {x['direction']:<5} {x['gbps']:6.3f} GB/s "
                f"{x['seconds']:6.2f} s  {_load(x)}")

    def reference(fc: FioConfig, phase: str, r: int, of: int) -> None:
        depth = fc.iodepth if plan.tool == "fio" else 1
        emit(measure_ref(fc, plan.size_bytes, plan.base_dir, r), phase,
             f"{plan.tool} bs={_mib(fc.block_bytes)} iodepth={depth}", r, of)

    groups: dict[FioConfig, list[EngineConfig]] = {}
    for c in plan.sweep:
        groups.setdefault(FioConfig.matching(c), []).append(c)
    # Interleave: per repeat, each reference job is followed by the engine configurations it serves.
    for r in range(plan.repeats):
        for fc, configs in groups.items():
            reference(fc, "sweep", r, plan.repeats)
            for c in configs:
                emit(measure_engine(c, plan.size_bytes, plan.base_dir, r), "sweep", c.label(), r, plan.repeats)
    chosen = best_configs(records, plan.sweep)
    confirm: dict[FioConfig, list[EngineConfig]] = {}
    for c in dict.fromkeys(chosen.values()):
        confirm.setdefault(FioConfig.matching(c), []).append(c)
    for r in range(plan.confirm_repeats):
        for fc, configs in confirm.items():
            reference(fc, "confirm", r, plan.confirm_repeats)
            for c in configs:
                emit(measure_engine(c, plan.size_bytes, plan.base_dir, r), "confirm", c.label(), r,
                     plan.confirm_repeats)
    if plan.scaling:
        if plan.emulate == "auto":
            ref = [x for x in medians(records) if x["kind"] in ("fio", "dd")]
            fio_min = min(x["gbps_median"] for x in ref)
            gbps = round(AUTO_EMULATION_FRACTION * fio_min / 4, 3)
            plan.notes.append(f"emulated bandwidth auto-chosen: {AUTO_EMULATION_FRACTION} x min {plan.tool} median "
                              f"({fio_min:.3f} GB/s) / 4 = {gbps} GB/s per directory")
            plan.scaling = [replace(c, emulate_gbps=gbps) for c in plan.scaling]
        log(f"emulated scaling at {plan.scaling[0].emulate_gbps} GB/s per directory")
        for r in range(plan.scaling_repeats):
            for c in plan.scaling:
                emit(measure_engine(c, plan.size_bytes, plan.base_dir, r), "scaling", c.label(), r,
                     plan.scaling_repeats)
    return records, chosen


def _load(x: Record) -> str:
    """CPU busy (all / own) and foreign disk traffic of one measurement, for the log line."""
    parts = []
    if x.get("cpu_busy") is not None and x.get("cpu_own") is not None:
        parts.append(f"cpu {x['cpu_busy'] * 100:3.0f}% (own {x['cpu_own'] * 100:3.0f}%)")
    if x.get("foreign_io_bytes") is not None:
        parts.append(f"other disk I/O {x['foreign_io_bytes'] / GiB:5.2f} GiB")
    return "  ".join(parts)


def contention_notes(records: list[Record]) -> list[str]:
    """Flag measurements that shared the machine, per phase: other disk traffic over 5 % of their own
    bytes, or more than half a core busy outside the benchmark (which includes some of our own kernel
    work in kworkers). The emulated (throttled) ones are barely affected; the others are."""
    def contended(r: Record) -> bool:
        other_cpu = (r["cpu_busy"] - r["cpu_own"]) * (os.cpu_count() or 1) \
            if r.get("cpu_busy") is not None and r.get("cpu_own") is not None else 0.0
        return (r.get("foreign_io_bytes") or 0) > 0.05 * r["bytes"] or other_cpu > 0.5

    counts = []
    for phase in ("sweep", "confirm", "scaling"):
        rs = [r for r in records if r["phase"] == phase]
        n = sum(contended(r) for r in rs)
        if n:
            counts.append(f"{phase} {n} of {len(rs)}")
    if not counts:
        return []
    return ["measurements that shared the machine with other work (other disk I/O > 5 % of their bytes, or "
            "> 0.5 core busy outside the benchmark; see cpu_busy, cpu_own, foreign_io_bytes in the records): "
            + ", ".join(counts) + ". CPU contention slows the Python engine more than fio."]


def warm_up(plan: Plan) -> None:
    """Load the backends, start their threads and touch the disk once, outside any measurement."""
    size = 64 * MiB
    for b in plan.backends:
        measure_engine(EngineConfig(b, 1, MiB, 4, 4 * MiB, MiB), size, plan.base_dir, 0)
    (measure_fio if plan.tool == "fio" else measure_dd)(FioConfig(MiB, 4), size, plan.base_dir, 0)


def print_plan(plan: Plan) -> None:
    for b, why in plan.skipped_backends.items():
        print(f"skipping backend {b}: {why}")
    print(f"plan: {len(plan.sweep)} engine configurations + {len(plan.fio_configs())} {plan.tool} reference job(s), "
          f"{plan.repeats} repeats, best per direction confirmed {plan.confirm_repeats} times, "
          f"{len(plan.scaling)} emulated; {plan.size_bytes / GiB:g} GiB per measurement and direction "
          f"in {plan.base_dir}/ssd<i>")
    for c in plan.sweep:
        print(f"  {c.label()}  window={c.window}")
    for c in plan.scaling:
        print(f"  {c.label()}  window={c.window}  emulated ({plan.emulate} GB/s per directory)")


def cleanup(plan: Plan) -> None:
    """Remove every data file the run may have left, and the ssd<i> directories if now empty."""
    for i in range(max([c.n_ssds for c in plan.sweep + plan.scaling], default=1)):
        d = plan.base_dir / f"ssd{i}"
        _remove_volume([d])
        for leftover in (FIO_FILE, DD_FILE):
            (d / leftover).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass


def build_report(args: argparse.Namespace, plan: Plan, records: list[Record], chosen: dict[str, EngineConfig],
                 env: dict, wall_seconds: float) -> dict:
    rows = medians(records)
    result = analyze(rows, chosen)
    scaling_backend = plan.scaling[0].backend if plan.scaling else None
    return {
        "benchmark": "io_bench",
        "timestamp": dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "cwd": os.getcwd(),
        "read_ratio_vs_fio": result["best"].get("read", {}).get("ratio_vs_fio"),
        "write_ratio_vs_fio": result["best"].get("write", {}).get("ratio_vs_fio"),
        "scaling_efficiency": result["scaling"].get(scaling_backend, {}).get("efficiency"),
        "best": result["best"],
        "best_n1_sweep": result["best_n1_sweep"],
        "scaling": result["scaling"],
        "settings": {"quick": args.quick, "size_bytes": plan.size_bytes, "repeats": plan.repeats,
                     "confirm_repeats": plan.confirm_repeats, "scaling_repeats": plan.scaling_repeats, "dir": str(plan.base_dir), "backends": plan.backends,
                     "skipped_backends": plan.skipped_backends,
                     "emulate_ssd_gbps": plan.scaling[0].emulate_gbps if plan.scaling else None,
                     "emulate_mode": plan.emulate, "scaling_backend": scaling_backend,
                     "reference_tool": plan.tool, "sweep": [asdict(c) for c in plan.sweep],
                     "scaling_configs": [asdict(c) for c in plan.scaling]},
        "fio": [r for r in rows if r["kind"] in ("fio", "dd")],
        "summary": rows,
        "records": records,
        **env,
        "notes": plan.notes + contention_notes(records),
        "wall_seconds": round(wall_seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    aio_reason = None
    if "aio" in args.backends and not args.dry_run:
        from io_engine.aio import aio_available

        ok, why = aio_available()
        aio_reason = None if ok else why
    tool, tool_version = ensure_fio() if not args.dry_run else ("fio" if shutil.which("fio") else "dd", "")
    plan = build_plan(args, aio_reason)
    plan.tool = tool
    if tool == "dd":
        plan.notes.append(tool_version)
    print_plan(plan)
    problems = check_plan(plan)
    if problems:
        print("io_bench cannot run:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    if args.dry_run:
        return 0

    env = environment(plan.base_dir, tool_version)  # disk free space before the run
    Meter.device = _block_device(plan.base_dir)
    # Let `kill` (SIGTERM) unwind through the `finally` below, so no multi-GB file is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        log("warm-up (not measured)")
        warm_up(plan)
        records, chosen = run(plan, log)
    finally:
        cleanup(plan)
    report = build_report(args, plan, records, chosen, env, time.perf_counter() - t_start)
    print()
    print(tables(report["summary"]))
    print()
    for k in ("write_ratio_vs_fio", "read_ratio_vs_fio", "scaling_efficiency"):
        print(f"{k:<20} {report[k]}")
    for note in report["notes"]:
        print(f"note: {note}")
    report.update(result_fields("io_bench", {"quick": args.quick}))
    out = result_path("io_bench", {"quick": args.quick}, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
