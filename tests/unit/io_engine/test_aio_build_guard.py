"""Building the aio op never hangs a run: stale build locks are cleared, `auto` never compiles, a build says so."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch.utils.cpp_extension as cpp

import io_engine.aio as aio
import io_engine.volume as volume
from io_engine import open_volume
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


# ------------------------------------------------------------------ never build silently
def test_auto_uses_threads_at_once_when_the_op_is_not_built(make_dirs, monkeypatch, caplog):
    """`auto` must not start an ~8-minute compile: with the op not built it takes threads and says how to build."""
    asked: list[bool] = []

    def not_built(build: bool = True):
        asked.append(build)
        if build:
            pytest.fail("backend='auto' asked to build the aio op")
        raise aio.AioNotBuilt(aio._not_built_message())

    monkeypatch.setattr(aio, "load_aio_op", not_built)
    monkeypatch.setattr(volume, "_fallbacks_said", set())
    with caplog.at_level(logging.WARNING, logger="io_engine"):
        with open_volume(make_dirs(1, "a"), 1 << 20, backend="auto") as vol:
            assert vol.backend.name == "threads"
        with open_volume(make_dirs(1, "b"), 1 << 20, backend="auto") as vol:  # a second volume: no repeat
            assert vol.backend.name == "threads"
    assert asked == [False, False]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "async_io op is not built" in lines[0] and "make aio-op" in lines[0]
    assert "python -m io_engine build-aio" in lines[0] and "uses threads" in lines[0]


def _ninja_dir(tmp_path, built: bool) -> str:
    d = tmp_path / ("built" if built else "fresh")
    d.mkdir()
    (d / "build.ninja").write_text("rule touch\n  command = touch $out\nbuild out.so: touch\n")
    if built:
        subprocess.run(["ninja"], cwd=d, check=True, capture_output=True)
    return str(d)


needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")


@needs_ninja
def test_ninja_gate_refuses_to_build_when_not_allowed(tmp_path, monkeypatch):
    ran: list[str] = []
    monkeypatch.setattr(cpp, "_run_ninja_build", lambda d, verbose, error_prefix: ran.append(d))
    monkeypatch.setattr(cpp.JIT_EXTENSION_VERSIONER, "entries", {"fresh": (0, 0), "other": (0, 0)})
    built, fresh = _ninja_dir(tmp_path, True), _ninja_dir(tmp_path, False)
    with aio._ninja_gate(allow_build=False):
        cpp._run_ninja_build(built, False, error_prefix="x")  # up to date: loads
    assert ran == [built]
    with pytest.raises(aio.AioNotBuilt, match="not built.*make aio-op"):
        with aio._ninja_gate(allow_build=False):
            cpp._run_ninja_build(fresh, False, error_prefix="x")
    assert ran == [built], "nothing may be built"
    assert "fresh" not in cpp.JIT_EXTENSION_VERSIONER.entries, "a later real build must not be skipped"
    assert cpp._run_ninja_build.__name__ == "<lambda>", "the gate restores torch's function"


@needs_ninja
def test_explicit_build_is_announced_before_it_starts(tmp_path, monkeypatch, caplog):
    events: list[str] = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def build(d, verbose, error_prefix):
        assert aio._build_in_progress(str(tmp_path)), "a build in progress is announced to other processes"
        events.append("build")

    monkeypatch.setattr(cpp, "_run_ninja_build", build)
    fresh = _ninja_dir(tmp_path, False)

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            events.append(record.getMessage())

    rec = Recorder(logging.WARNING)
    logging.getLogger("io_engine").addHandler(rec)
    try:
        with aio._ninja_gate(allow_build=True):
            cpp._run_ninja_build(fresh, False, error_prefix="x")
            cpp._run_ninja_build(fresh, False, error_prefix="x")  # a second op of the same load: said once
    finally:
        logging.getLogger("io_engine").removeHandler(rec)
    assert events[1:] == ["build", "build"]
    assert events[0].startswith("building DeepSpeed's async_io op: this takes several minutes "
                                "(about 8 on 2 cores) the first time")
    assert not aio._build_in_progress(str(tmp_path))


def test_auto_waits_for_a_load_but_not_for_a_build(tmp_path, monkeypatch):
    """Another process holding the build lock: a load (seconds) is waited for, a build (minutes) is not."""
    import threading
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fd = os.open(tmp_path / ".io_engine-build.flock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process loading the op
        threading.Timer(0.3, fcntl.flock, args=(fd, fcntl.LOCK_UN)).start()
        start = time.monotonic()
        with aio._extension_build_guard(blocking=False):
            assert time.monotonic() - start >= 0.25
        fcntl.flock(fd, fcntl.LOCK_EX)  # ... and now compiling it
        (tmp_path / aio._BUILDING).write_text(str(os.getpid()))
        start = time.monotonic()
        with pytest.raises(aio.AioNotBuilt, match="another process is building"):
            with aio._extension_build_guard(blocking=False):
                pass
        assert time.monotonic() - start < 1
        (tmp_path / aio._BUILDING).write_text("999999999")  # a builder that died: its lock is gone too
        assert not aio._build_in_progress(str(tmp_path))
    finally:
        os.close(fd)


@pytest.mark.aio
def test_built_op_loads_without_building_in_a_fresh_process():
    """After `make aio-op` (python -m io_engine info), `auto` finds the op built: what the Makefile relies on."""
    ok, reason = aio.aio_available()
    if not ok:
        pytest.skip(f"aio backend unavailable: {reason}")
    libs = [os.path.join(aio._extensions_root(), n, f"{n}.so") for n in aio._OP_DIRS]
    before = [os.stat(p).st_mtime_ns for p in libs]
    code = "import io_engine.aio as a; a.load_aio_op(build=False); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]
    assert [os.stat(p).st_mtime_ns for p in libs] == before, "nothing may be rebuilt"
