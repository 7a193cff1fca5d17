"""io_engine failure modes: each is a clear Python exception, raised before any damage."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from io_engine import IOEngineError, VolumeConfigError, open_volume
from io_engine.base import DeviceOp

MiB = 1 << 20


def test_missing_directory_is_reported_with_fix(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(VolumeConfigError, match="does not exist.*mkdir -p"):
        open_volume([missing], MiB)


def test_all_problems_reported_together(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with pytest.raises(VolumeConfigError) as e:
        open_volume([a, b], MiB)
    assert a in str(e.value) and b in str(e.value)


def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits; an immutable directory refuses even root
        subprocess.run(["chattr", "+i", str(d)], check=True)
    else:
        d.chmod(0o500)
    try:
        with pytest.raises(VolumeConfigError, match="not writable"):
            open_volume([str(d)], MiB)
        assert os.listdir(d) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        else:
            d.chmod(0o700)


def test_not_enough_space_fails_before_writing(make_dirs):
    dirs = make_dirs(2)
    with pytest.raises(VolumeConfigError, match="not enough free space"):
        open_volume(dirs, 1 << 60)  # an exabyte
    assert all(os.listdir(d) == [] for d in dirs), "nothing may be written when the volume cannot fit"


def test_not_enough_space_keeps_existing_volume_intact(make_dirs):
    dirs = make_dirs(1)
    data = torch.arange(1000, dtype=torch.int32)
    with open_volume(dirs, MiB, backend="threads") as vol:
        vol.write(data, 100).wait()
    with pytest.raises(VolumeConfigError, match="not enough free space"):
        open_volume(dirs, 1 << 60, backend="threads")
    with open_volume(dirs, MiB, backend="threads") as vol:
        out = torch.empty_like(data)
        vol.read_into(out, 100).wait()
    assert torch.equal(out, data)


def test_slab_without_manifest_is_not_overwritten(make_dirs):
    d = make_dirs(1)[0]
    with open(os.path.join(d, "lohan.slab"), "wb") as f:
        f.write(b"precious")
    with pytest.raises(VolumeConfigError, match="refusing to overwrite"):
        open_volume([d], MiB)
    assert open(os.path.join(d, "lohan.slab"), "rb").read() == b"precious"


def test_read_and_write_past_end_raise(backend, make_dirs):
    with open_volume(make_dirs(2), 3 * MiB + 1, backend=backend) as vol:
        out = torch.empty(4096, dtype=torch.uint8)
        with pytest.raises(IOEngineError, match="outside the volume") as e:
            vol.read_into(out, 3 * MiB - 100)
        assert e.value.offset == 3 * MiB - 100 and e.value.size == 4096
        with pytest.raises(IOEngineError, match="outside the volume"):
            vol.write(out, 3 * MiB)
        with pytest.raises(IOEngineError):
            vol.write(out, -1)
        vol.write(out[:1], 3 * MiB).wait()  # the very last byte is fine


def test_backend_rejects_misaligned_or_out_of_bounds_ops(backend, make_dirs):
    """The contract is re-checked below the volume: the aio op would silently drop these."""
    with open_volume(make_dirs(1), 2 * MiB, backend=backend) as vol:
        buf = vol.backend.alloc(8192)
        with pytest.raises(IOEngineError, match="not aligned"):
            vol.backend.submit(DeviceOp(0, True, 512, (buf,)))
        with pytest.raises(IOEngineError, match="not aligned"):
            vol.backend.submit(DeviceOp(0, True, 0, (buf[:1000],)))
        with pytest.raises(IOEngineError, match="past end"):
            vol.backend.submit(DeviceOp(0, False, vol.file_size - 4096, (buf,)))
        vol.backend.free(buf)


def test_aio_rejects_unlocked_buffers(make_dirs):
    from io_engine.aio import aio_available

    ok, reason = aio_available()
    if not ok:
        pytest.skip(f"aio backend unavailable: {reason}")
    with open_volume(make_dirs(1), 2 * MiB, backend="aio") as vol:
        from io_engine.buffers import aligned_empty

        plain = aligned_empty(4096)  # aligned but not page-locked: the op would mlock a bounce buffer
        assert not vol.backend.is_direct(plain)
        with pytest.raises(IOEngineError, match="page-locked"):
            vol.backend.submit(DeviceOp(0, True, 0, (plain,)))
        vol.write(plain, 0).wait()  # through the volume it is staged, and works


def test_gpu_tensor_or_noncontiguous_target_rejected(make_dirs):
    with open_volume(make_dirs(1), MiB, backend="threads") as vol:
        t = torch.zeros(10, 10)[:, 0]
        with pytest.raises(IOEngineError, match="contiguous"):
            vol.read_into(t, 0)
        if torch.cuda.is_available():
            with pytest.raises(IOEngineError, match="host memory"):
                vol.write(torch.zeros(4, device="cuda"), 0)


def test_bad_arguments(make_dirs):
    d = make_dirs(1)
    with pytest.raises(VolumeConfigError, match="multiple of 4096"):
        open_volume(d, MiB, chunk_bytes=1000)
    with pytest.raises(VolumeConfigError, match="repeat"):
        open_volume(d + d, MiB)
    with pytest.raises(VolumeConfigError, match="backend"):
        open_volume(d, MiB, backend="nvme")


def test_closed_volume_refuses_requests(make_dirs):
    vol = open_volume(make_dirs(1), MiB, backend="threads")
    vol.close()
    with pytest.raises(IOEngineError, match="closed"):
        vol.write(torch.zeros(1), 0)


def test_buffered_fallback_when_o_direct_refused(make_dirs, monkeypatch, caplog):
    import errno

    import io_engine.threads as threads

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(threads.os, "open", no_direct)
    with open_volume(make_dirs(1), MiB, backend="threads") as vol:
        assert vol.backend.direct == [False]
        data = torch.arange(100, dtype=torch.uint8)
        vol.write(data, 5).wait()
        out = torch.empty_like(data)
        vol.read_into(out, 5).wait()
        assert torch.equal(out, data)
    assert "refuses O_DIRECT" in caplog.text


def test_interrupt_while_waiting_is_not_turned_into_an_io_error():
    """Ctrl-C during wait() must stay a KeyboardInterrupt (wait_all catches IOEngineError)."""
    from concurrent.futures import Future

    from io_engine import Handle

    class Interrupted(Future):
        def result(self, timeout=None):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Handle([Interrupted()], describe="read").wait()


def test_io_error_says_where_and_keeps_errno():
    """str() keeps the where (OSError would print only "[Errno 28] ..."), and errno is there to branch on."""
    import errno

    from io_engine.base import device_error

    e = device_error("write", errno.ENOSPC, 1, "/mnt/nvme1/lohan.slab", 4096, 8192)
    assert str(e) == ("write failed on device 1 (/mnt/nvme1): No space left on device [ENOSPC] "
                      "(path=/mnt/nvme1/lohan.slab, offset=4096, size=8192)")
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.strerror == "No space left on device"
    assert (e.op, e.device, e.directory, e.path, e.offset, e.size) == (
        "write", 1, "/mnt/nvme1", "/mnt/nvme1/lohan.slab", 4096, 8192)
    plain = IOEngineError("volume is closed", "/d", 0)
    assert str(plain) == "volume is closed (path=/d, offset=0)" and plain.errno is None
