"""Exclusive use of the NVMe directories: one run per directory at a time.

Two runs on one directory would interleave their writes into the same slab files and commit records,
and both would train on garbage. Each run takes an advisory `flock` on `<dir>/.lohan.lock` for every
directory it uses and writes its pid, host and command line into the file, so a second run refuses at
once and says who holds the directory. The kernel drops a flock when its process dies however it dies
(SIGKILL, OOM, power-off of the process), so a lock left by a dead process is simply taken over; the
stale description in the file is overwritten. A clean release removes the file (so another user of a shared
directory is not met by a file they may not open); one left by another user's killed run is removed when the
directory allows it, and refused with whose it is and what to do when not. Within one process the lock is
re-entrant (counted).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pwd
import socket
import sys
import threading
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

LOCK_NAME = ".lohan.lock"

_held: dict[str, list] = {}  # realpath of the directory -> [fd, count]
_held_lock = threading.Lock()


class DirectoryInUseError(RuntimeError):
    """Another process is using an NVMe directory."""


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            info = json.load(f)
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.get("time", 0)))
        return f"pid {info.get('pid')} on {info.get('host')} since {started}: {info.get('cmd')}"
    except (OSError, ValueError, AttributeError):
        return "another process (its description is unreadable)"


def _stale_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    pid = info.get("pid") if isinstance(info, dict) else None
    return pid if isinstance(pid, int) and pid != os.getpid() and info.get("host") == socket.gethostname() else None


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd` (a lock file is removed as its holder lets go)."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _owner(path: str) -> str:
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return "another user"
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"user id {uid}"


def _in_use(directory: str, path: str, whose: str = "") -> DirectoryInUseError:
    return DirectoryInUseError(
        f"{directory} is in use by another lohan run ({_holder(path)}{whose}). Wait for it to finish or stop it, "
        "or give this run other --nvme directories")


def _open_locked(directory: str) -> tuple[int, str]:
    """(descriptor, path) of the directory's lock file, created if need be and locked (flock, exclusive). The file
    is removed as its holder lets go (`_unlock_one`), so a descriptor may lock a file no longer at the path (opened
    just before the removal): then the lock is worth nothing, and it is taken again on the file there now."""
    path = os.path.join(directory, LOCK_NAME)
    for _ in range(100):
        try:
            # (the umask decides who else may take it over; never through a link, whose target it would truncate)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except PermissionError:
            _foreign(directory, path)  # another user's: refused, or their dead run's, removed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise _in_use(directory, path) from None
            raise
        if _same_file(fd, path):
            return fd, path
        os.close(fd)
    raise DirectoryInUseError(f"{path} keeps being replaced by other processes; give this run other --nvme "
                              "directories")


def _foreign(directory: str, path: str) -> None:
    """A lock file this user may not write (another user's, left by a run that was killed, or held by a live one):
    DirectoryInUseError that says whose it is and what to do, or, when nobody holds it, it is lohan's and the
    directory lets this user remove it, it is removed (the caller creates its own)."""
    whose = _owner(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # flock needs no write access: whether a live run holds it can be told
    except FileNotFoundError:
        return
    except PermissionError:
        raise DirectoryInUseError(
            f"{path} belongs to {whose} and this user can neither write nor read it: whether a run of theirs uses "
            f"{directory} cannot be told. Ask them (or root) to remove it once no run of theirs uses the directory, "
            "or give this run other --nvme directories") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise _in_use(directory, path, f", run by {whose}") from None
            raise
        if not _same_file(fd, path):
            return
        if not _is_lock_file(path):
            raise DirectoryInUseError(f"{path} belongs to {whose} and is not a lohan lock file, so lohan leaves it "
                                      "alone; remove or rename it, or give this run other --nvme directories")
        try:
            os.unlink(path)  # a lock file nobody holds: its run was killed (the kernel dropped the lock)
        except PermissionError:
            raise DirectoryInUseError(
                f"{path} was left by a run of {whose} that is no longer running ({_holder(path)}), and this user may "
                f"not remove it from {directory}: ask them (or root) to remove it, or give this run other --nvme "
                "directories") from None
        log.warning("removed %s: the run of %s that held it is no longer running", path, whose)
    finally:
        os.close(fd)


def _is_lock_file(path: str) -> bool:
    """Empty, or the description a lohan run writes (pid, host, time, cmd)."""
    try:
        with open(path) as f:
            text = f.read()
        return not text or set(json.loads(text)) == {"pid", "host", "time", "cmd"}
    except (OSError, ValueError, TypeError):
        return False


def _lock_one(directory: str) -> None:
    key = os.path.realpath(directory)
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
            return
        fd, path = _open_locked(directory)
        previous = _stale_pid(path)
        if previous is not None:
            log.warning("taking over %s: the run that held it (pid %d) is no longer running", directory, previous)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "cmd": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _held[key] = [fd, 1, path]


def _unlock_one(directory: str) -> None:
    key = os.path.realpath(directory)
    with _held_lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            fd, _, path = entry
            # A clean exit leaves no lock file behind (another user's run could not open it). Removed while still
            # locked, and only if it is still this one: a process that opened it meanwhile sees it gone once it
            # gets the lock (_open_locked) and locks the next file instead.
            try:
                if _same_file(fd, path):
                    os.unlink(path)
            except OSError:  # (a directory made read-only meanwhile) then at least no stale claim is left
                os.ftruncate(fd, 0)
            os.close(fd)  # lets go of the lock


class DirLock:
    """Holds the locks of a run's directories; `release()` (or the context exit) gives them back."""

    def __init__(self, dirs: Sequence[str]) -> None:
        self.dirs = list(dirs)
        taken: list[str] = []
        try:
            for d in self.dirs:
                _lock_one(d)
                taken.append(d)
        except BaseException:
            for d in taken:
                _unlock_one(d)
            raise
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            for d in self.dirs:
                _unlock_one(d)

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
