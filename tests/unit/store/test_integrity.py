"""Integrity of what is on the SSDs: checksums on every read, damaged metadata, resumable creation, and
exclusive use of the directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lohan
from lohan.store.dirlock import LOCK_NAME, DirectoryInUseError, DirLock
from lohan.store.integrity import StoreCorruptError
from lohan.store.opening import StoreExistsError
from lohan.store.states import StateStore
from tests.unit.store.test_store import batch, ecfg, small_model  # the same tiny model, settings and batches


def trained_store(dirs, steps=2, **kw):
    with lohan.init(small_model(), ecfg(dirs, **kw)) as engine:
        for s in range(steps):
            engine.step(batch(s))
        return engine.state_dict_fp32()


def flip(dirs, offset: int, nbytes: int = 64) -> None:
    """XOR `nbytes` of the (single-directory) slab at logical `offset`, as a failing SSD would."""
    path = os.path.join(dirs[0], "lohan.slab")
    fd = os.open(path, os.O_RDWR)
    try:
        data = bytes(b ^ 0x5A for b in os.pread(fd, nbytes, offset))
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def store_offsets(dirs, block: int) -> tuple[int, int]:
    """(P32 offset, P16 offset) of `block` in the current slot."""
    store = StateStore.open(dirs, backend="threads")
    try:
        return (store.layout.record_offset(block, store.slot), store.layout.p16_offset(block, store.slot))
    finally:
        store.close()


@pytest.mark.parametrize("section", ["p32", "p16"])
def test_flipped_bytes_stop_the_step_and_name_the_block(make_dirs, section):
    dirs = make_dirs(1)
    trained_store(dirs)
    p32, p16 = store_offsets(dirs, 2)
    flip(dirs, (p32 if section == "p32" else p16) + 128)
    with lohan.init(small_model(), ecfg(dirs), resume=True) as engine:
        with pytest.raises((StoreCorruptError, RuntimeError)) as info:
            engine.step(batch(2))
        cause = info.value if isinstance(info.value, StoreCorruptError) else info.value.__cause__
        assert isinstance(cause, StoreCorruptError)
        msg = str(cause)
        # (fp32 records have no P16 copy: the P32 is the P16. The forward reading it as its P16, or the CPU's load of
        # the resident record it computes on (zero copy: `GradOffloader.load_resident`), finds the damage first)
        assert "block 2 (block1)" in msg and ("P32" in msg if section == "p32" else ("P16" in msg or "P32" in msg))
        assert dirs[0] in msg and "--verify" in msg
        assert engine.step_count == 2  # nothing was committed over the damaged state
    store = StateStore.open(dirs, backend="threads")
    try:
        problems = store.verify()
    finally:
        store.close()
    assert len(problems) == 1 and "block 2" in problems[0]


def test_verify_of_an_intact_store_is_clean_and_flips_in_the_stale_slot_are_harmless(make_dirs):
    dirs = make_dirs(1)
    before = trained_store(dirs, steps=3)
    store = StateStore.open(dirs, backend="threads")
    try:
        stale = store.layout.record_offset(1, 1 - store.slot)
    finally:
        store.close()
    flip(dirs, stale + 64)  # the previous slot is rewritten whole by the next step before it is read
    store = StateStore.open(dirs, backend="threads")
    try:
        assert store.verify() == []
        got = {f"{b.name}.{s.name}": t for b in store.layout.blocks for s, t in zip(b.params, store.read_params(b.index))}
    finally:
        store.close()
    assert all(torch.equal(got[k], before[k]) for k in before)
    with lohan.init(small_model(), ecfg(dirs), resume=True) as engine:
        engine.step(batch(3))


def test_chunked_records_are_checked_per_chunk(make_dirs):
    dirs = make_dirs(1)
    # 4096-element chunks: every transformer block is several checksum units
    trained_store(dirs, opt_chunk_bytes=4096 * 16)
    p32, _ = store_offsets(dirs, 1)
    flip(dirs, p32 + 4 * 4096 * 2 + 8)  # inside the third unit's P32
    store = StateStore.open(dirs, backend="threads")
    try:
        problems = store.verify()
    finally:
        store.close()
    assert len(problems) == 1 and "elements 8192..12288" in problems[0], problems


@pytest.mark.parametrize("name", ["lohan.commit.json", "lohan.store.json"])
def test_edited_metadata_is_detected(make_dirs, name):
    dirs = make_dirs(1)
    trained_store(dirs, steps=1)
    path = os.path.join(dirs[0], name)
    data = json.load(open(path))
    if name == "lohan.commit.json":
        data["step"] = 7
    else:
        data["layout"]["blocks"][1]["numel"] += 1
    json.dump(data, open(path, "w"))
    with pytest.raises(StoreCorruptError, match=f"{name}.*checksum does not match.*--overwrite"):
        StateStore.status(dirs)
    with pytest.raises(StoreCorruptError):
        lohan.init(small_model(), ecfg(dirs), resume=True)


def test_a_foreign_store_description_is_detected(make_dirs):
    a, b = make_dirs(1, "a"), make_dirs(1, "b")
    trained_store(a, steps=1)
    trained_store(b, steps=1)
    for f in ("lohan.store.json", "lohan.commit.json"):  # b's metadata now sits beside a's slab
        os.replace(os.path.join(b[0], f), os.path.join(a[0], f))
    with pytest.raises(StoreCorruptError, match="another volume"):
        StateStore.open(a, backend="threads")


def test_checksums_off_trains_identically(make_dirs):
    on = trained_store(make_dirs(1, "on"), steps=2)
    off_dirs = make_dirs(1, "off")
    off = trained_store(off_dirs, steps=2, checksums=False)
    assert all(torch.equal(on[k], off[k]) for k in on)
    store = StateStore.open(off_dirs, backend="threads")
    try:
        assert store.sums is None and "no checksums" in store.verify()[0]
    finally:
        store.close()


def test_interrupted_creation_continues_where_it_stopped(make_dirs):
    dirs, ref_dirs = make_dirs(1), make_dirs(1, "ref")
    model = small_model()
    with lohan.init(model, ecfg(ref_dirs)) as engine:
        reference = engine.state_dict_fp32()

    import lohan.models.gpt as gpt

    calls = []
    real = gpt.init_block_

    def dying(block, cfg, gen):  # block 3 of 5 is being initialized when the process "dies"
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(block, cfg, gen)

    gpt.init_block_, lohan.runtime.engine.init_block_ = dying, dying
    try:
        with pytest.raises(KeyboardInterrupt):
            lohan.init(model, ecfg(dirs))
    finally:
        gpt.init_block_ = lohan.runtime.engine.init_block_ = real
    status = StateStore.status(dirs)
    assert (status.state, status.blocks_done, status.n_blocks) == ("partial", 2, 5)
    with pytest.raises(StoreExistsError, match="initialization stopped after 2 of 5 blocks"):
        lohan.init(model, ecfg(dirs))
    seen = []
    with lohan.init(model, ecfg(dirs), resume=True, progress=lambda done, total: seen.append(done)) as engine:
        assert seen[0] == 2  # blocks 0 and 1 were not written again
        got = engine.state_dict_fp32()
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_a_second_process_is_refused_and_a_dead_holder_is_taken_over(make_dirs, tmp_path):
    dirs = make_dirs(1)
    code = textwrap.dedent(f"""
        import sys, time
        from lohan.store.dirlock import DirLock
        lock = DirLock([{dirs[0]!r}])
        print("locked", flush=True)
        if sys.argv[1] == "hold":
            time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code, "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryInUseError, match=rf"in use by another lohan run \(pid {holder.pid} "):
            lohan.init(small_model(), ecfg(dirs))
        assert not os.path.exists(os.path.join(dirs[0], "lohan.slab"))  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()
    # the killed holder's description is still in the lock file; the lock itself died with it
    assert str(holder.pid) in open(os.path.join(dirs[0], LOCK_NAME)).read()
    with DirLock(dirs):
        assert str(os.getpid()) in open(os.path.join(dirs[0], LOCK_NAME)).read()
    assert not os.path.exists(os.path.join(dirs[0], LOCK_NAME))  # a clean release leaves no lock file


def test_a_removed_store_description_is_not_mistaken_for_a_fresh_directory(make_dirs):
    dirs = make_dirs(1)
    trained_store(dirs, steps=1)
    os.unlink(os.path.join(dirs[0], "lohan.store.json"))
    with pytest.raises(StoreCorruptError, match="store description.*is missing"):
        StateStore.status(dirs)
    with pytest.raises(StoreCorruptError):  # never "resumed" by starting over on top of the slab
        lohan.init(small_model(), ecfg(dirs), resume=True)
    assert os.path.getsize(os.path.join(dirs[0], "lohan.slab")) > 0
