"""Issue 42, item 10: `.lohan.lock` was created 0644 and never removed, so a second user of a shared directory was
refused with "Permission denied ... run the same command again". A clean release removes it (without the unlink
race: a process that opened the file just before its removal locks the file there now), and another user's lock
file is taken over when its run is dead and the directory allows it, or refused saying whose it is and what to do."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from lohan.store import dirlock
from lohan.store.dirlock import LOCK_NAME, DirectoryInUseError, DirLock

HOLDER = textwrap.dedent("""
    import sys
    from lohan.store.dirlock import DirLock
    lock = DirLock([sys.argv[1]])
    print("locked", flush=True)
    sys.stdin.readline()  # a line: let go, cleanly
    lock.release()
    print("released", flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def holder():
    """holder(dir): another process holding the directory's lock until `.stdin` gets a line."""
    procs = []

    def start(directory: str | Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "locked"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def dead_run_lock(directory: Path) -> Path:
    """The lock file of a run that was killed (its description stays; nobody holds the flock)."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"pid": int(p.stdout), "host": socket.gethostname(), "time": 1.0e9,
                                "cmd": "finetune.py --nvme shared"}))
    return path


def test_a_clean_release_removes_the_lock_file(tmp_path):
    with DirLock([str(tmp_path)]):
        assert str(os.getpid()) in (tmp_path / LOCK_NAME).read_text()
        with DirLock([str(tmp_path)]):  # re-entrant: the inner release keeps it
            pass
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_file_opened_just_before_its_removal_is_not_taken_for_the_lock(tmp_path, holder, monkeypatch):
    """The unlink race: this process opens the holder's file, the holder lets go (removing it), and this process's
    flock then succeeds on a file no other process can see. It must lock the file at the path instead."""
    other = holder(tmp_path)
    real = dirlock.fcntl.flock
    calls = []

    def flock_after_the_release(fd, op):
        if not calls:
            other.stdin.write("go\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == "released"
            assert not (tmp_path / LOCK_NAME).exists()  # the holder removed it as it let go
        calls.append(op)
        return real(fd, op)

    monkeypatch.setattr(dirlock.fcntl, "flock", flock_after_the_release)
    with DirLock([str(tmp_path)]):
        monkeypatch.setattr(dirlock.fcntl, "flock", real)
        assert len(calls) == 2  # the removed file's lock, then the new file's
        third = subprocess.run([sys.executable, "-c", "import sys; from lohan.store.dirlock import DirLock; "
                                "DirLock([sys.argv[1]])", str(tmp_path)], capture_output=True, text=True)
        assert third.returncode == 1 and f"in use by another lohan run (pid {os.getpid()} " in third.stderr


def _not_writable(monkeypatch, path: Path, times: int = 10**9) -> None:
    """Opening `path` for writing fails as it does for a file of another user (mode 0644)."""
    real, left = os.open, [times]

    def open_(p, flags, *a, **k):
        if os.fspath(p) == str(path) and flags & os.O_RDWR and left[0] > 0:
            left[0] -= 1
            raise PermissionError(13, "Permission denied", str(path))
        return real(p, flags, *a, **k)

    monkeypatch.setattr(dirlock.os, "open", open_)


def test_another_users_lock_file_held_by_a_live_run_is_refused_saying_whose(tmp_path, holder, monkeypatch):
    other = holder(tmp_path)
    _not_writable(monkeypatch, tmp_path / LOCK_NAME)
    with pytest.raises(DirectoryInUseError, match=rf"{tmp_path} is in use by another lohan run \(pid {other.pid} "
                                                  r".*, run by user .*\)\. Wait for it to finish or stop it"):
        DirLock([str(tmp_path)])


def test_another_users_lock_file_left_by_a_killed_run_is_removed_and_taken(tmp_path, monkeypatch, caplog):
    stale = dead_run_lock(tmp_path)
    _not_writable(monkeypatch, stale, times=1)  # theirs; the one this run creates next is its own
    with DirLock([str(tmp_path)]):
        assert str(os.getpid()) in stale.read_text()
    assert "the run of user" in caplog.text and "is no longer running" in caplog.text
    assert not stale.exists()


def test_another_users_lock_file_that_may_not_be_removed_is_refused_with_what_to_do(tmp_path, monkeypatch):
    stale = dead_run_lock(tmp_path)
    _not_writable(monkeypatch, stale)
    real = os.unlink

    def sticky(p, *a, **k):  # a shared directory with the sticky bit: only the owner removes a file
        if os.fspath(p) == str(stale):
            raise PermissionError(1, "Operation not permitted", str(stale))
        return real(p, *a, **k)

    monkeypatch.setattr(dirlock.os, "unlink", sticky)
    with pytest.raises(DirectoryInUseError, match=rf"{stale} was left by a run of user .* that is no longer running "
                                                  r"\(pid \d+ .*finetune\.py --nvme shared\).*ask them \(or root\) to "
                                                  r"remove it, or give this run other --nvme directories"):
        DirLock([str(tmp_path)])
    assert stale.exists()


def test_a_file_of_that_name_that_is_no_lock_file_is_left_alone(tmp_path, monkeypatch):
    notes = tmp_path / LOCK_NAME
    notes.write_text("my notes\n")
    _not_writable(monkeypatch, notes)
    with pytest.raises(DirectoryInUseError, match="is not a lohan lock file, so lohan leaves it alone"):
        DirLock([str(tmp_path)])
    assert notes.read_text() == "my notes\n"


# ------------------------------------------------------------------ two real users (root can be another one)
def _as_user(uid: int, gid: int, directory: Path) -> str:
    """Take and let go of the directory's lock in a forked child running as `uid`: 'ok', or the error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        out = "ok"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            DirLock([str(directory)]).release()
        except BaseException as e:  # noqa: BLE001 (everything goes back to the parent)
            out = f"{type(e).__name__}: {e}"
        finally:
            os.write(w, out.encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")
def test_a_second_user_of_a_shared_directory(holder):
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' to act as")
    shared = Path(tempfile.mkdtemp(prefix="lohan-shared-"))  # (tmp_path's parents are closed to other users)
    try:
        os.chmod(shared, 0o1777)  # like /tmp: anyone creates, only the owner removes
        as_nobody = lambda: _as_user(nobody.pw_uid, nobody.pw_gid, shared)  # noqa: E731
        stale = dead_run_lock(shared)
        os.chmod(stale, 0o644)
        got = as_nobody()
        assert got.startswith("DirectoryInUseError: ") and "was left by a run of user root that is no longer " \
            "running" in got and "ask them (or root) to remove it" in got, got
        stale.unlink()
        other = holder(shared)  # root's run, alive
        got = as_nobody()
        assert f"in use by another lohan run (pid {other.pid} " in got and "run by user root" in got, got
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "released"
        assert not (shared / LOCK_NAME).exists()  # root's clean release left nothing in the way
        assert as_nobody() == "ok"
        assert not (shared / LOCK_NAME).exists()
    finally:
        shutil.rmtree(shared)
