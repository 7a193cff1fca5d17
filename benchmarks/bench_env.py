"""Environment facts every benchmark report records (STYLE 14: hardware and versions in the report)."""

from __future__ import annotations

import importlib.metadata


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
