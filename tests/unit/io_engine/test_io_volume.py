"""io_engine volume: byte-exact round trips, striping layout, concurrency, reopen safety."""

from __future__ import annotations

import threading

import pytest
import torch

from io_engine import ALIGN, VolumeConfigError, open_volume

MiB = 1 << 20


def rand_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("n_dirs", [1, 2, 3, 4])
def test_round_trip_odd_sizes_random_offsets(backend, make_dirs, n_dirs):
    gen = torch.Generator().manual_seed(n_dirs)
    capacity = 200 * MiB + 123
    with open_volume(make_dirs(n_dirs), capacity, chunk_bytes=256 * 1024, backend=backend) as vol:
        for size in [1, 511, 4097, MiB + 3, 64 * MiB]:
            offset = int(torch.randint(0, capacity - size + 1, (1,), generator=gen))
            data = rand_bytes(size, gen)
            vol.write(data, offset).wait()
            out = torch.zeros(size, dtype=torch.uint8)
            vol.read_into(out, offset).wait()
            assert torch.equal(out, data), f"{backend} {n_dirs} dirs: size {size} at {offset} differs"


def test_typed_tensors_and_views(backend, make_dirs):
    """Non-byte dtypes and views at odd addresses go through the same byte-exact path."""
    with open_volume(make_dirs(2), 8 * MiB, chunk_bytes=64 * 1024, backend=backend) as vol:
        x = torch.randn(1000, 37, dtype=torch.float32)
        vol.write(x, 12345).wait()
        y = torch.empty_like(x)
        vol.read_into(y, 12345).wait()
        assert torch.equal(x, y)
        big = torch.arange(5000, dtype=torch.bfloat16)
        view = big[3:4003]  # starts 6 bytes into its storage: never page-aligned
        vol.write(view, 3 * MiB + 1).wait()
        z = torch.empty(4000, dtype=torch.bfloat16)
        vol.read_into(z, 3 * MiB + 1).wait()
        assert torch.equal(z, view)


def test_striping_layout_on_disk(make_dirs):
    """Chunk c of the logical space lives on device c % N at local offset (c // N) * chunk."""
    dirs = make_dirs(3)
    chunk = 64 * 1024
    data = rand_bytes(10 * chunk, torch.Generator().manual_seed(0))
    with open_volume(dirs, 16 * chunk, chunk_bytes=chunk, backend="threads") as vol:
        vol.write(data, 0).wait()
        vol.sync()
        paths = vol.paths
    for c in range(10):
        with open(paths[c % 3], "rb") as f:
            f.seek((c // 3) * chunk)
            on_disk = f.read(chunk)
        assert on_disk == bytes(data[c * chunk:(c + 1) * chunk].tolist()), f"chunk {c} misplaced"


def test_backends_write_identical_files(make_dirs):
    from io_engine.aio import aio_available

    ok, reason = aio_available()
    if not ok:
        pytest.skip(f"aio backend unavailable: {reason}")
    gen = torch.Generator().manual_seed(7)
    writes = [(int(torch.randint(0, 6 * MiB, (1,), generator=gen)), rand_bytes(s, gen))
              for s in (1, 511, 4097, MiB + 3, 2 * MiB)]
    contents = {}
    for be in ("threads", "aio"):
        dirs = make_dirs(3, prefix=f"{be}-")
        with open_volume(dirs, 8 * MiB + 5, chunk_bytes=128 * 1024, backend=be) as vol:
            for off, data in writes:  # they overlap, so their order must be fixed: one at a time
                vol.write(data, off).wait()
            vol.sync()
            paths = vol.paths
        contents[be] = [open(p, "rb").read() for p in paths]
    assert contents["threads"] == contents["aio"]


def test_many_concurrent_requests(backend, make_dirs):
    gen = torch.Generator().manual_seed(3)
    with open_volume(make_dirs(4), 64 * MiB, chunk_bytes=64 * 1024, backend=backend) as vol:
        slot = 256 * 1024
        items = []
        for i in range(200):  # disjoint slots, odd sizes inside each, all in flight at once
            size = int(torch.randint(1, slot, (1,), generator=gen))
            items.append((i * slot + int(torch.randint(0, slot - size + 1, (1,), generator=gen)),
                          rand_bytes(size, gen)))
        handles = [vol.write(d, off) for off, d in items]
        for h in handles:
            h.wait()
        outs = [torch.empty_like(d) for _, d in items]
        handles = [vol.read_into(o, off) for o, (off, _) in zip(outs, items)]
        vol.wait_all()
        assert all(torch.equal(o, d) for o, (_, d) in zip(outs, items))
        assert all(h.done() for h in handles)


def test_unaligned_neighbours_in_one_block_are_not_clobbered(backend, make_dirs):
    """Concurrent writes to disjoint byte ranges sharing 4 KiB blocks (read-modify-write safety)."""
    with open_volume(make_dirs(2), 4 * MiB, chunk_bytes=ALIGN, backend=backend) as vol:
        base = torch.full((4 * ALIGN,), 7, dtype=torch.uint8)
        vol.write(base, 0).wait()
        pieces = [(o, torch.full((37,), o % 251, dtype=torch.uint8)) for o in range(100, 4 * ALIGN - 40, 41)]
        threads = [threading.Thread(target=lambda o=o, p=p: vol.write(p, o).wait()) for o, p in pieces]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expect = base.clone()
        for o, p in pieces:
            expect[o:o + 37] = p
        out = torch.empty_like(expect)
        vol.read_into(out, 0).wait()
        assert torch.equal(out, expect)


def test_reopen_keeps_data_and_refuses_other_layout(make_dirs):
    dirs = make_dirs(2)
    data = rand_bytes(3 * MiB + 17, torch.Generator().manual_seed(1))
    with open_volume(dirs, 8 * MiB, chunk_bytes=MiB, backend="threads") as vol:
        vol.write(data, 999).wait()
    with pytest.raises(VolumeConfigError, match="original directories, order and chunk size"):
        open_volume(list(reversed(dirs)), 8 * MiB, chunk_bytes=MiB, backend="threads")
    with pytest.raises(VolumeConfigError, match="chunk"):
        open_volume(dirs, 8 * MiB, chunk_bytes=2 * MiB, backend="threads")
    with open_volume(dirs, 16 * MiB, chunk_bytes=MiB, backend="threads") as vol:  # growing is fine
        out = torch.empty_like(data)
        vol.read_into(out, 999).wait()
        assert torch.equal(out, data)


def test_counters_account_every_byte(backend, make_dirs):
    with open_volume(make_dirs(2), 16 * MiB, chunk_bytes=MiB, backend=backend) as vol:
        pool = vol.buffer_pool(8 * MiB)
        with pool.acquire(4 * MiB) as buf:  # aligned and direct: no staging, exact byte counts
            buf.tensor.fill_(1)
            vol.write(buf.tensor, 0).wait()
            vol.read_into(buf.tensor, 0).wait()
        s = vol.stats()
    assert s["write_bytes"] == 4 * MiB and s["read_bytes"] == 4 * MiB
    for dev in s["devices"]:  # 4 chunks over 2 devices: 2 MiB each way on each
        assert dev["write"]["bytes"] == 2 * MiB and dev["read"]["bytes"] == 2 * MiB
        assert dev["write"]["busy_s"] > 0 and dev["read"]["busy_s"] > 0


def test_emulated_bandwidth_paces_each_device(make_dirs):
    """Throttled to 0.05 GB/s per device, 4 MiB on one device cannot finish in under ~80 ms."""
    import time

    with open_volume(make_dirs(1), 8 * MiB, backend="threads", emulate_ssd_gbps=0.05) as vol:
        pool = vol.buffer_pool(4 * MiB)
        with pool.acquire(4 * MiB) as buf:
            t0 = time.perf_counter()
            vol.write(buf.tensor, 0).wait()
            elapsed = time.perf_counter() - t0
    assert elapsed >= 4 * MiB / 0.05e9 * 0.95


def test_emulated_device_time_runs_while_the_bytes_move(make_dirs, monkeypatch):
    """A paced transfer takes max(the medium's time, the paced time), as on a real SSD: the medium's copy runs
    inside the device's booked time, not before it (added, a 2 GB/s device on a medium that copies at 5 GB/s
    served 1.4 GB/s, and the lanes of lane_bench overshot the cost model's)."""
    import os
    import time

    import io_engine.threads as threads

    real = os.pwritev
    medium_s = 0.05

    def slow_medium(fd, views, offset):
        time.sleep(medium_s)
        return real(fd, views, offset)

    monkeypatch.setattr(threads.os, "pwritev", slow_medium)
    paced_s = 1 * MiB / 0.02e9  # 52 ms
    with open_volume(make_dirs(1), 2 * MiB, backend="threads", emulate_ssd_gbps=0.02) as vol:
        pool = vol.buffer_pool(1 * MiB)
        with pool.acquire(1 * MiB) as buf:
            t0 = time.perf_counter()
            vol.write(buf.tensor, 0).wait()
            elapsed = time.perf_counter() - t0
    assert paced_s * 0.95 <= elapsed < paced_s + 0.6 * medium_s, elapsed


def test_a_simplex_device_is_busy_while_either_direction_is_in_flight_not_both_summed(make_dirs):
    """A read and a write on one paced device run one after the other (half duplex), but both are in flight from
    the start: each direction's busy time covers the pair, and their sum would count the device twice. Its
    ``any`` lane is the union: the paced time of both, which the cost model's ssd lane prices."""
    import time

    paced_s = 2 * (1 * MiB / 0.02e9)  # 105 ms for the two
    with open_volume(make_dirs(1), 4 * MiB, backend="threads", emulate_ssd_gbps=0.02) as vol:
        pool = vol.buffer_pool(2 * MiB)
        with pool.acquire(1 * MiB) as a, pool.acquire(1 * MiB) as b:
            vol.write(a.tensor, 0).wait()
            before = vol.stats()["devices"][0]
            t0 = time.perf_counter()
            handles = [vol.read_into(b.tensor, 0), vol.write(a.tensor, 1 * MiB)]
            for h in handles:
                h.wait()
            elapsed = time.perf_counter() - t0
            after = vol.stats()["devices"][0]
    busy = {k: after[k]["busy_s"] - before[k]["busy_s"] for k in ("read", "write", "any")}
    assert paced_s * 0.95 <= busy["any"] <= elapsed + 1e-3, (busy, elapsed)
    assert busy["read"] + busy["write"] > 1.3 * busy["any"], busy  # (what the ssd lane once summed)


def test_reopening_a_volume_rewrites_nothing(make_dirs):
    """A volume reopened as it was writes no manifest (a store whose disk filled up can still be opened)."""
    import os

    from io_engine import open_volume

    dirs = make_dirs(2)
    open_volume(dirs, 1 << 20, name="re").close()
    manifests = [os.path.join(d, "re.volume.json") for d in dirs]
    before = [os.stat(m).st_mtime_ns for m in manifests]
    open_volume(dirs, 1 << 20, name="re").close()
    assert [os.stat(m).st_mtime_ns for m in manifests] == before
