"""Environment facts every benchmark report records (STYLE 14: hardware and versions in the report)."""

from __future__ import annotations

import importlib.metadata
import json
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
