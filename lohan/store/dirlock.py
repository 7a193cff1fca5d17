"""Exclusive use of the NVMe directories: one run per directory at a time.

Two runs on one directory would interleave their writes into the same slab files and commit records,
and both would train on garbage. Each run takes an advisory `flock` on `<dir>/.lohan.lock` for every
directory it uses and writes its pid, host and command line into the file, so a second run refuses at
once and says who holds the directory. The kernel drops a flock when its process dies however it dies
(SIGKILL, OOM, power-off of the process), so a lock left by a dead process is simply taken over; the
stale description in the file is overwritten. Within one process the lock is re-entrant (counted).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
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
    except (OSError, ValueError):
        return "another process (its description is unreadable)"


def _stale_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    pid = info.get("pid")
    return pid if isinstance(pid, int) and pid != os.getpid() and info.get("host") == socket.gethostname() else None


def _lock_one(directory: str) -> None:
    key = os.path.realpath(directory)
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
            return
        path = os.path.join(directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DirectoryInUseError(
                    f"{directory} is in use by another lohan run ({_holder(path)}). Wait for it to finish or stop "
                    "it, or give this run other --nvme directories") from None
            raise
        previous = _stale_pid(path)
        if previous is not None:
            log.warning("taking over %s: the run that held it (pid %d) is no longer running", directory, previous)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "cmd": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _held[key] = [fd, 1]


def _unlock_one(directory: str) -> None:
    key = os.path.realpath(directory)
    with _held_lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            os.ftruncate(entry[0], 0)  # a clean exit leaves no holder behind (an empty file is no claim)
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


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
