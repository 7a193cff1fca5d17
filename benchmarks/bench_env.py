"""Environment facts every benchmark report records (STYLE 14: hardware and versions in the report)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def package_version(pkg: str) -> str | None:
    """Installed version of `pkg`, or None."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def git_state(paths: tuple[str, ...] = ("lohan", "io_engine", "benchmarks")) -> dict[str, Any]:
    """The commit the run imported and the uncommitted changes under `paths` (None where git cannot tell)."""
    def git(*a: str) -> str | None:
        r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--", *paths)
    return {"git_commit": (commit.strip() or None) if commit is not None else None,
            "git_dirty_paths": None if dirty is None else [line for line in dirty.splitlines() if line]}


def shared_environment(packages: tuple[str, ...] = ("torch",), hardware: dict[str, Any] | None = None,
                versions: dict[str, Any] | None = None,
                dirty_paths: tuple[str, ...] = ("lohan", "io_engine", "benchmarks")) -> dict[str, Any]:
    """What every report records of the machine and the code (STYLE 14): ``hardware`` (cores, CPU model, RAM,
    kernel, platform, plus `hardware`) and ``versions`` (python, each of `packages`, torch's thread counts where
    torch is imported, the git commit and dirty paths, plus `versions`). Call it at the start of a run: the commit
    and the tree the run actually imported."""
    torch = sys.modules.get("torch")
    hw = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
          "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
          "kernel": platform.release(), "platform": platform.platform(), "machine": platform.machine(),
          "libc": " ".join(platform.libc_ver())}
    if torch is not None:
        hw["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    ver: dict[str, Any] = {"python": platform.python_version(), **{p: package_version(p) for p in packages}}
    if torch is not None:
        ver.update(torch_num_threads=torch.get_num_threads(), torch_num_interop_threads=torch.get_num_interop_threads())
    return {"hardware": {**hw, **(hardware or {})}, "versions": {**ver, **(versions or {}), **git_state(dirty_paths)}}


def device_environment(device: Any) -> dict[str, Any]:
    """The flat environment of a report about one device's compute (gpu_block_tflops, gpu_timeline): when, the
    command, python, torch and the CPU, and on a GPU its name, CUDA, capability, SMs, memory and whether flash
    attention is on. `device`: a torch.device (torch is imported by the caller)."""
    import datetime as dt
    import shlex

    import torch

    env = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": shlex.join(sys.argv),
           "python": platform.python_version(), "torch": package_version("torch") or torch.__version__,
           "cpu": cpu_model(), "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   gpu_mem_gib=props.total_memory / 2**30,
                   flash_sdp=torch.backends.cuda.flash_sdp_enabled())
    return env


def portable(value: Any) -> Any:
    """`value` (a report: nested dicts, lists, strings) with the interpreter's path written `python` and
    the repository's prefix dropped, so a committed report names no path of the machine that made it."""
    if isinstance(value, str):
        return value.replace(sys.executable, "python").replace(f"{REPO}/", "").replace(str(REPO), ".")
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    return value


# ------------------------------------------------------------------- where a report goes
RESULTS = REPO / "benchmarks" / "results"


def _cpu_slug(cpu_model: str | None) -> str:
    """`cpu_model`'s family and model number, e.g. "AMD EPYC 7763 64-Core Processor" -> "epyc7763",
    "Intel(R) Xeon(R) Processor" -> "xeon" ("" where the model is not known)."""
    words = [w for w in re.sub(r"\((R|TM)\)|@.*$", " ", cpu_model or "", flags=re.I).split()
             if w.lower() not in ("intel", "amd", "cpu", "processor") and "core" not in w.lower()]
    number = next((w for w in words[1:] if any(c.isdigit() for c in w)), "")
    return re.sub(r"[^a-z0-9]", "", (words[0] + number).lower()) if words else ""


def machine_id(hardware: dict[str, Any] | None = None) -> str:
    """A short stable id of the box a run was on, the file name of its results: the GPU's model where
    there is one (``h100``), else ``cpu<cores>-<family+model>`` (``cpu2-epyc``, ``cpu16-xeon8480c``).
    `hardware`: a report's ``hardware`` (`shared_environment`: cpu_count, cpu_model, gpu); None: this box."""
    hw = hardware if hardware is not None else shared_environment()["hardware"]
    if hw.get("gpu"):
        words = [w for w in str(hw["gpu"]).split() if w.lower() not in ("nvidia", "geforce", "amd", "radeon")]
        model = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)
                      and not w.lower().endswith("gb")), None)
        if model is not None:  # "RTX 4090": the series word joins a bare number
            name = (words[model - 1] if model and words[model].isdigit() else "") + words[model]
            return re.sub(r"[^a-z0-9]", "", name.lower())
    slug = _cpu_slug(hw.get("cpu_model"))
    return f"cpu{hw.get('cpu_count') or ''}" + (f"-{slug}" if slug else "")


def variant_name(variant: dict[str, Any] | None) -> str:
    """The folder of a variant: its set fields joined by "-", a flag that is on by its key, a number after its key,
    a word by itself (e.g. {"quick": True, "seq": 256, "compare": "resident_mem"} -> "quick-seq256-resident_mem");
    "" for the default run (no field set)."""
    parts = [k if v is True else f"{k}{v}" if isinstance(v, int | float) else str(v)
             for k, v in (variant or {}).items() if v not in (None, False, "", 0)]
    return "-".join(re.sub(r"[^A-Za-z0-9_.=]+", "_", p) for p in parts)


def result_path(benchmark: str, variant: dict[str, Any] | None = None, out: str | Path | None = None,
                hardware: dict[str, Any] | None = None, root: str | Path = RESULTS) -> Path:
    """Where a report goes (benchmarks/README.md "Result files"): `out` where given, else
    ``results/<benchmark>/<machine>.json`` for the default run and ``results/<benchmark>/<variant>/<machine>.json``
    for a variant (quick, a tag, a setting compared), so runs on two boxes or of two variants never overwrite each
    other; the report itself carries ``variant`` and ``machine`` (`result_fields`). `root`: the results folder."""
    if out is not None:
        return Path(out)
    folder = Path(root) / benchmark
    name = variant_name(variant)
    return (folder / name if name else folder) / f"{machine_id(hardware)}.json"


def result_fields(benchmark: str, variant: dict[str, Any] | None = None,
                  hardware: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields a report records of where it belongs: the benchmark, the machine id and the variant."""
    return {"benchmark": benchmark, "machine": machine_id(hardware), "variant": dict(variant or {})}


def save_report(report: dict, out: Path, markdown: Callable[[dict, Path], Any],
                plot: Callable[[dict, Path], Any]) -> dict:
    """Write `report` made portable as `out` (JSON), with its markdown summary and plot beside it (same
    stem, .md and .png); returns the portable report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no path of this machine in a committed report
    out.write_text(json.dumps(report, indent=2) + "\n")
    markdown(report, out.with_suffix(".md"))
    plot(report, out.with_suffix(".png"))
    return report


# ------------------------------------------------------------------- the box's CPU taken by others
def cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """The machine's (stolen, all) CPU ticks since boot (proc(5): the "cpu" line; steal is the 8th field), or
    None where there is no such file. On a virtual machine, steal is time a vCPU wanted to run and the hypervisor
    ran someone else: wall-clock lanes stretch by it while the work in them does not change."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    return ticks[7], sum(ticks[:8])  # (guest time, fields 9-10, is already counted in user and nice)


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time stolen between two `cpu_ticks` readings (None without both, or where
    no tick passed)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


# ------------------------------------------------------------------- a child process's memory and data
def status_bytes(key: str) -> int:
    """A /proc/self/status size field (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (proc(5), clear_refs "5")."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def batches(vocab: int, batch: int, seq: int, seed: int):
    """Batch k: (ids, targets) [batch, seq], targets shifted by one; depends only on (seed, k)."""
    import torch

    k = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        w = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield w[:, :-1].contiguous(), w[:, 1:].contiguous()
        k += 1
