"""A build lock left by a killed extension build must not hang every later aio load."""

from __future__ import annotations

import os

from io_engine.aio import _extension_build_guard


def test_stale_build_lock_removed_held_lock_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "py311_cpu" / "async_io" / "lock"
    held = tmp_path / "py311_cpu" / "pin_memory" / "lock"
    for p in (stale, held):
        p.parent.mkdir(parents=True)
        p.touch()
    fd = os.open(held, os.O_RDONLY)  # a live builder keeps its lock file open
    try:
        with _extension_build_guard():
            assert not stale.exists()
            assert held.exists()
    finally:
        os.close(fd)
