"""Injected I/O faults (io_engine/faults.py): every failure is an IOEngineError that says what failed where,
short transfers are retried byte-exact or refused, and the volume stays usable and closable."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch

import io_engine.base as base
from io_engine import (
    FaultPlan,
    FaultyBackend,
    Handle,
    IOEngineError,
    VolumeConfigError,
    inject_faults,
    open_volume,
)
from io_engine.faults import FAULTS_ENV

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


def _io_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("io_engine")}


@pytest.fixture
def no_thread_leak():
    """Every io_engine thread a test starts is gone once its volume is closed."""
    before = _io_threads()
    yield
    assert _io_threads() <= before, f"threads left running: {sorted(t.name for t in _io_threads() - before)}"


def _payload(vol, n: int, seed: int) -> torch.Tensor:
    """Random bytes in a buffer the backend transfers directly (page-locked for aio), so requests map
    one-to-one onto device requests."""
    buf = vol.backend.alloc(n)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def _open(dirs, backend, **kw):
    return open_volume(dirs, 4 * MiB, chunk_bytes=CHUNK, backend=backend, **kw)


# ------------------------------------------------------------------------- spec language
def test_spec_parses_and_round_trips():
    plan = FaultPlan.parse("write#5:ENOSPC, dev1:read#3:short,write#11+:EIO,fsync#1:EIO,vol=acts:read#2:zero")
    assert [str(r) for r in plan.rules] == ["write#5:ENOSPC", "dev1:read#3:short", "write#11+:EIO",
                                            "fsync#1:EIO", "vol=acts:read#2:zero"]
    assert plan.rules[0].errno == errno.ENOSPC and plan.rules[1].device == 1 and plan.rules[2].onwards
    assert [str(r) for r in plan.for_volume("lohan").rules] == ["write#5:ENOSPC", "dev1:read#3:short",
                                                                "write#11+:EIO", "fsync#1:EIO"]


@pytest.mark.parametrize("spec", ["write#0:EIO", "write:EIO", "erase#1:EIO", "write#1:EBOGUS", "fsync#1:short",
                                  "disk1:write#1:EIO", "write#1"])
def test_malformed_spec_is_refused(spec):
    with pytest.raises(ValueError, match="bad fault spec.*expected rules like"):
        FaultPlan.parse(spec)


def test_counting_per_rule_and_device():
    plan = FaultPlan.parse("write#2:EIO,dev1:write#1:ENOSPC,read#3+:EIO")
    got = [plan.take("write", d) for d in (0, 1, 0, 1)]
    assert [f and f.kind for f in got] == [None, "EIO", None, None]  # write#2 wins over dev1:write#1
    assert [bool(plan.take("read", 0)) for _ in range(5)] == [False, False, True, True, True]
    assert plan.fired[0] == ("write#2:EIO", 1, 2)


# ------------------------------------------------------------------------- errno faults
@pytest.mark.parametrize("n_dirs", [1, 2])
@pytest.mark.parametrize("kind", ["EIO", "ENOSPC"])
def test_write_error_names_op_device_dir_file_offset(backend, make_dirs, n_dirs, kind, no_thread_leak):
    dirs = make_dirs(n_dirs)
    with _open(dirs, backend) as vol:
        dev = n_dirs - 1  # the last device: counted there only
        faulty = inject_faults(vol, f"dev{dev}:write#2:{kind}")
        a, b = _payload(vol, 2 * CHUNK, 1), _payload(vol, 2 * CHUNK, 2)
        vol.write(a, 0).wait()  # device `dev`'s first write
        with pytest.raises(IOEngineError) as e:
            vol.write(b, 2 * CHUNK).wait()  # its second one fails
        err = e.value
        code = getattr(errno, kind)
        local = CHUNK if n_dirs == 2 else 2 * CHUNK  # where logical 2*CHUNK lands on that device
        size = CHUNK if n_dirs == 2 else 2 * CHUNK
        assert (err.op, err.device, err.directory, err.errno) == ("write", dev, dirs[dev], code)
        assert (err.path, err.offset, err.size) == (vol.paths[dev], local, size)
        assert str(err) == (f"write failed on device {dev} ({dirs[dev]}): {os.strerror(code)} [{kind}] "
                            f"(path={vol.paths[dev]}, offset={local}, size={size})")
        assert faulty.plan.fired == [(f"dev{dev}:write#2:{kind}", dev, 2)]
        # Everything else is unaffected: the first write is intact, later requests work.
        vol.write(b, 2 * CHUNK).wait()
        out = vol.backend.alloc(4 * CHUNK)
        vol.read_into(out, 0).wait()
        assert torch.equal(out[:2 * CHUNK], a) and torch.equal(out[2 * CHUNK:], b)
        vol.sync()


@pytest.mark.parametrize("n_dirs", [1, 2])
def test_read_error_then_volume_still_reads(backend, make_dirs, n_dirs, no_thread_leak):
    dirs = make_dirs(n_dirs)
    with _open(dirs, backend) as vol:
        data = _payload(vol, 2 * CHUNK, 3)
        vol.write(data, 0).wait()
        inject_faults(vol, "read#1:EIO")
        out = vol.backend.alloc(2 * CHUNK)
        with pytest.raises(IOEngineError, match=r"read failed on device 0 \(.*\): Input/output error \[EIO\]") as e:
            vol.read_into(out, 0).wait()
        assert e.value.path == vol.paths[0] and e.value.offset == 0
        out.zero_()
        vol.read_into(out, 0).wait()
        assert torch.equal(out, data)


def test_every_write_from_the_nth_fails(backend, make_dirs, no_thread_leak):
    with _open(make_dirs(1), backend) as vol:
        inject_faults(vol, "write#3+:ENOSPC")
        buf = _payload(vol, CHUNK, 4)
        vol.write(buf, 0).wait()
        vol.write(buf, CHUNK).wait()
        for i in range(2, 5):
            with pytest.raises(IOEngineError, match=r"\[ENOSPC\]"):
                vol.write(buf, i * CHUNK).wait()
        out = vol.backend.alloc(2 * CHUNK)
        vol.read_into(out, 0).wait()  # reads are not writes
        assert torch.equal(out[CHUNK:], buf)


def test_failed_unaligned_write_through_staging(backend, make_dirs, no_thread_leak):
    """Staged requests (unaligned: read-modify-write of the edge blocks) fail the same way."""
    with _open(make_dirs(2), backend) as vol:
        inject_faults(vol, "read#1:EIO")
        with pytest.raises(IOEngineError, match=r"read failed on device 0 .*\[EIO\]") as e:
            vol.write(torch.arange(100, dtype=torch.uint8), 10).wait()  # its head block is read first
        assert e.value.op == "read"
        data = torch.arange(100, dtype=torch.uint8)
        vol.write(data, 10).wait()
        out = torch.empty_like(data)
        vol.read_into(out, 10).wait()
        assert torch.equal(out, data)


def test_wait_all_reports_the_failure_after_all_finished(backend, make_dirs, no_thread_leak):
    with _open(make_dirs(2), backend) as vol:
        inject_faults(vol, "dev1:write#1:EIO")
        bufs = [_payload(vol, 2 * CHUNK, i) for i in range(4)]
        handles = [vol.write(b, i * 2 * CHUNK) for i, b in enumerate(bufs)]
        with pytest.raises(IOEngineError, match="device 1"):
            vol.wait_all()
        assert all(h.done() for h in handles)


# ------------------------------------------------------------------------- fsync
@pytest.mark.parametrize("n_dirs", [1, 2])
def test_fsync_failure_names_the_file(backend, make_dirs, n_dirs, no_thread_leak):
    dirs = make_dirs(n_dirs)
    with _open(dirs, backend) as vol:
        dev = n_dirs - 1
        inject_faults(vol, f"dev{dev}:fsync#1:EIO")
        vol.write(_payload(vol, CHUNK, 5), 0).wait()
        with pytest.raises(IOEngineError) as e:
            vol.sync()
        assert str(e.value) == (f"fsync failed on device {dev} ({dirs[dev]}): Input/output error [EIO] "
                                f"(path={vol.paths[dev]})")
        assert (e.value.op, e.value.device, e.value.errno) == ("fsync", dev, errno.EIO)
        vol.sync()  # the next one works


# ------------------------------------------------------------------------- short transfers (threads)
def _count_calls(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(os, name)

    def counted(fd, views, offset):
        calls.append(sum(len(v) for v in views))
        return real(fd, views, offset)

    monkeypatch.setattr(os, name, counted)
    return calls


@pytest.mark.parametrize("n_dirs", [1, 2])
def test_short_write_and_read_are_retried_byte_exact(make_dirs, monkeypatch, n_dirs, no_thread_leak):
    with _open(make_dirs(n_dirs), "threads") as vol:
        faulty = inject_faults(vol, "write#1:short,read#1:short")
        data = _payload(vol, 6 * CHUNK + 3 * 4096, 6)  # odd block count: the cut is not at the middle
        writes = _count_calls(monkeypatch, "pwritev")
        vol.write(data, 4096).wait()
        out = vol.backend.alloc(data.numel())
        reads = _count_calls(monkeypatch, "preadv")
        vol.read_into(out, 4096).wait()
        assert torch.equal(out, data)
        # Device 0's request (the first) moved its first half, rounded down to 4 KiB; the backend then asked
        # for exactly the rest; the other device's request went through whole.
        first = vol._device_ops(4096, data, True)[0].length
        cut = first // 2 // 4096 * 4096
        for calls in (writes, reads):
            assert sorted(calls) == sorted([cut, first - cut] + [data.numel() - first] * (n_dirs - 1))
        assert [f[0] for f in faulty.plan.fired] == ["write#1:short", "read#1:short"]


@pytest.mark.parametrize("n_dirs", [1, 2])
def test_zero_byte_transfer_raises(make_dirs, n_dirs, no_thread_leak):
    dirs = make_dirs(n_dirs)
    with _open(dirs, "threads") as vol:
        inject_faults(vol, "dev0:read#1:zero,dev0:write#2:zero")
        data = _payload(vol, 2 * CHUNK, 7)
        vol.write(data, 0).wait()
        out = vol.backend.alloc(2 * CHUNK)
        with pytest.raises(IOEngineError, match=r"read failed on device 0 .*read returned 0 bytes after 0 of "
                                                r"\d+ \(end of file.*truncated") as e:
            vol.read_into(out, 0).wait()
        assert (e.value.op, e.value.device, e.value.path, e.value.errno) == ("read", 0, vol.paths[0], None)
        with pytest.raises(IOEngineError, match=r"write failed on device 0 .*write made no progress"):
            vol.write(data, 0).wait()
        vol.read_into(out, 0).wait()
        assert torch.equal(out, data)


def test_real_errors_read_the_same_as_injected_ones(make_dirs, monkeypatch, no_thread_leak):
    """No injector: the OS refuses the write, and the threads backend words it the same way."""
    dirs = make_dirs(2)
    with _open(dirs, "threads") as vol:
        def full(fd, views, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(IOEngineError) as e:
            vol.write(_payload(vol, CHUNK, 8), CHUNK).wait()
        assert str(e.value) == (f"write failed on device 1 ({dirs[1]}): No space left on device [ENOSPC] "
                                f"(path={vol.paths[1]}, offset=0, size={CHUNK})")
        monkeypatch.undo()


def test_short_faults_refused_on_a_backend_without_byte_counts():
    class NoCounts:
        name = "aio"
        reports_transfer_bytes = False

    with pytest.raises(ValueError, match="short/zero faults need"):
        FaultyBackend(NoCounts(), FaultPlan.parse("read#1:short"))  # type: ignore[arg-type]
    FaultyBackend(NoCounts(), FaultPlan.parse("read#1:EIO"))  # type: ignore[arg-type]


# ------------------------------------------------------------------------- the environment variable
def test_env_var_injects_only_when_set(make_dirs, monkeypatch, caplog, no_thread_leak):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    with _open(make_dirs(1, "a"), "threads") as vol:
        assert not isinstance(vol.backend, FaultyBackend)
    monkeypatch.setenv(FAULTS_ENV, "")
    with _open(make_dirs(1, "b"), "threads") as vol:
        assert not isinstance(vol.backend, FaultyBackend)
    monkeypatch.setenv(FAULTS_ENV, "vol=other:write#1:EIO")
    with _open(make_dirs(1, "d"), "threads") as vol:  # nothing for `lohan`: not wrapped at all
        assert not isinstance(vol.backend, FaultyBackend)
    monkeypatch.setenv(FAULTS_ENV, "write#2:ENOSPC,vol=other:write#1:EIO")
    with caplog.at_level(logging.WARNING, logger="io_engine"):
        with _open(make_dirs(1, "c"), "threads") as vol:
            assert isinstance(vol.backend, FaultyBackend)
            buf = _payload(vol, CHUNK, 9)
            vol.write(buf, 0).wait()  # vol=other's rule does not apply to `lohan`
            with pytest.raises(IOEngineError, match=r"\[ENOSPC\]"):
                vol.write(buf, 0).wait()
    assert f"{FAULTS_ENV} is set: injecting faults write#2:ENOSPC into volume 'lohan'" in caplog.text


def test_malformed_env_var_refuses_before_writing(make_dirs, monkeypatch):
    d = make_dirs(1)
    monkeypatch.setenv(FAULTS_ENV, "write#five:EIO")
    with pytest.raises(VolumeConfigError, match=f"{FAULTS_ENV}: bad fault spec"):
        _open(d, "threads")
    assert os.listdir(d[0]) == []


# ------------------------------------------------------------------------- truncated slabs
def _filled_volume(dirs) -> torch.Tensor:
    data = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(10))
    with _open(dirs, "threads") as vol:
        vol.write(data, 0).wait()
    return data


@pytest.mark.parametrize("n_dirs", [1, 2])
def test_truncated_slab_is_refused_not_zero_filled(make_dirs, n_dirs):
    dirs = make_dirs(n_dirs)
    _filled_volume(dirs)
    slab = os.path.join(dirs[-1], "lohan.slab")
    full = os.path.getsize(slab)
    os.truncate(slab, full // 2)
    with pytest.raises(VolumeConfigError) as e:
        _open(dirs, "threads")
    msg = str(e.value)
    assert f"{slab} is {full // 2} bytes, but its manifest lohan.volume.json records {full} bytes" in msg
    assert "the slab file was truncated or replaced; the data in it is lost: restore it" in msg
    assert "or start over" in msg
    assert os.path.getsize(slab) == full // 2, "a refused open must not re-extend the file"


def test_missing_slab_with_manifest_is_refused(make_dirs):
    dirs = make_dirs(2)
    _filled_volume(dirs)
    os.unlink(os.path.join(dirs[0], "lohan.slab"))
    with pytest.raises(VolumeConfigError, match=r"lohan.slab is missing, but its manifest .* deleted or moved; "
                                                "the data in it is lost"):
        _open(dirs, "threads")
    assert not os.path.exists(os.path.join(dirs[0], "lohan.slab"))


def test_growing_a_volume_still_works(make_dirs):
    dirs = make_dirs(2)
    data = _filled_volume(dirs)
    with open_volume(dirs, 16 * MiB, chunk_bytes=CHUNK, backend="threads") as vol:
        out = torch.empty_like(data)
        vol.read_into(out, 0).wait()
        assert torch.equal(out, data)
    with _open(dirs, "threads"):  # and reopening at the old, smaller capacity
        pass


# ------------------------------------------------------------------------- stall watchdog
def _late_future(delay_s: float) -> Future:
    fut: Future = Future()
    timer = threading.Timer(delay_s, fut.set_result, args=(1,))
    timer.start()
    return fut


def test_stalled_request_is_reported_and_still_waited_for(monkeypatch, caplog):
    monkeypatch.setattr(base, "STALL_WARN_S", 0.1)
    h = Handle([_late_future(0.05), _late_future(0.45)], describe="write of 8192 bytes at 4096",
               devices=("device 0 (/mnt/nvme0)", "device 1 (/mnt/nvme1)"))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="io_engine"):
        h.wait()
    assert 0.4 < time.monotonic() - start < 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "io_engine" and r.levelno == logging.WARNING]
    # at 0.1 s, then 0.2 s later (0.3 s), then 0.4 s later (0.7 s: done before)
    assert len(warnings) == 2, warnings
    assert ("io_engine: write of 8192 bytes at 4096 on device 0 (/mnt/nvme0), device 1 (/mnt/nvme1) has not "
            "completed after 0.1 s (1 of 2 piece(s) pending); still waiting") in warnings[0]
    assert "after 0.3 s" in warnings[1]


def test_stall_warning_names_the_volume_devices(make_dirs, monkeypatch, caplog, no_thread_leak):
    monkeypatch.setattr(base, "STALL_WARN_S", 0.05)
    dirs = make_dirs(2)
    with _open(dirs, "threads") as vol:
        real = vol.backend._transfer

        def slow(*args):
            time.sleep(0.2)
            return real(*args)

        monkeypatch.setattr(vol.backend, "_transfer", slow)
        with caplog.at_level(logging.WARNING, logger="io_engine"):
            vol.write(_payload(vol, 2 * CHUNK, 11), 0).wait()
            with pytest.raises(TimeoutError, match="not done after 0.01 s"):
                vol.write(_payload(vol, CHUNK, 12), CHUNK).wait(timeout=0.01)
    assert f"write of {2 * CHUNK} bytes at 0 on device 0 ({dirs[0]}), device 1 ({dirs[1]}) has not completed" \
        in caplog.text


def test_stall_threshold_from_the_environment():
    import subprocess
    import sys

    code = ("import importlib, os; import io_engine.base as b; print(b.STALL_WARN_S)\n"
            "os.environ['IO_ENGINE_STALL_S'] = 'soon'; importlib.reload(b); print(b.STALL_WARN_S)")
    env = {**os.environ, "IO_ENGINE_STALL_S": "2.5"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2.5", "60.0"], out.stderr[-2000:]
    assert "IO_ENGINE_STALL_S='soon' is not a positive number of seconds" in out.stderr
