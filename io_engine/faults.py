"""Fault injection: make chosen device requests fail (EIO, ENOSPC, ...) or move short, on purpose.

Long runs must survive (or stop cleanly on) a full or failing SSD, and the code that handles that
can only be tested by making disks fail on cue. A `FaultyBackend` wraps a real backend (threads or
aio), counts the requests going through it and hands the chosen ones a `Fault`, which the backend
realizes where a real failure would happen (the threads backend in place of its pwritev/preadv/fsync
call, so its own error and short-transfer paths run; aio in its dispatcher, since the op itself
reports neither errno nor byte counts).

Spec language (the `IO_ENGINE_FAULTS` environment variable, or `FaultPlan.parse`): comma-separated
rules, each `[selector:]...op#N[+]:kind`:

    write#5:ENOSPC            the 5th write request fails with ENOSPC
    dev0:write#5:ENOSPC       the 5th write request on device 0 (counted on device 0 only)
    read#3:short              the 3rd read moves only part of its bytes (the backend must retry)
    read#2:zero               the 2nd read moves 0 bytes (end of file: must raise)
    write#11+:EIO             every write from the 11th on fails with EIO
    fsync#1:EIO               the first fsync (Volume.sync(): one per device, in device order) fails
    vol=lohan:write#5:EIO     only in volumes named `lohan` (each volume counts for itself)

    op:        read | write | fsync
    N:         1-based count of the requests this rule matches (op, and device/volume if selected);
               `N+` fires on the N-th and every later one
    kind:      an errno name (EIO, ENOSPC, EROFS, ...) | short | zero  (short/zero not for fsync)
    selectors: devK (device index K of the volume) | vol=NAME (the volume's `name`)

A request is one device transfer the volume issues: a volume read/write over k devices makes k
requests (in device order), an unaligned write adds the read-modify-write reads of its edge blocks,
and a staged (unaligned or unlocked-buffer) request makes a set per staging window. Each rule keeps
its own count; when several rules fire on one request, the first in the spec wins.
`short` moves the first half of the request (rounded down to 4 KiB; a one-block request cannot be cut
under O_DIRECT and moves whole); it needs a backend that sees byte counts (threads: the async_io op
reports none, so short and zero rules are refused on aio).

The environment variable is read only when set and non-empty, by every volume opened in that process
(a WARNING says so); a malformed spec refuses to open the volume. From Python:

    faulty = inject_faults(vol, "dev1:write#2:ENOSPC")  # wraps vol.backend in place
    ...; faulty.plan.fired                              # [(rule, device, count), ...]: what fired
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .base import Backend, DeviceOp, align_down

if TYPE_CHECKING:
    from .volume import Volume

FAULTS_ENV = "IO_ENGINE_FAULTS"
OPS = ("read", "write", "fsync")
TRANSFER_KINDS = ("short", "zero")


@dataclass(frozen=True)
class FaultRule:
    """One parsed rule of a fault spec (see the module docstring)."""

    op: str
    nth: int
    kind: str
    onwards: bool = False
    device: int | None = None
    volume: str | None = None

    def __str__(self) -> str:
        sel = (f"vol={self.volume}:" if self.volume is not None else "") + \
              (f"dev{self.device}:" if self.device is not None else "")
        return f"{sel}{self.op}#{self.nth}{'+' if self.onwards else ''}:{self.kind}"

    @property
    def errno(self) -> int | None:
        return None if self.kind in TRANSFER_KINDS else getattr(errno, self.kind)


@dataclass(frozen=True)
class Fault:
    """What happens to one request: fail with `err`, or move short ("short") or nothing ("zero")."""

    rule: FaultRule

    @property
    def err(self) -> int | None:
        return self.rule.errno

    @property
    def kind(self) -> str:
        return self.rule.kind

    def oserror(self) -> OSError:
        assert self.err is not None, f"{self.rule} is a transfer fault, not an errno"
        return OSError(self.err, os.strerror(self.err))

    def syscall(self, write: bool, fd: int, views: list[memoryview], offset: int) -> int:
        """Stand in for one os.pwritev/os.preadv call: raise the errno, or move part or none of the bytes.

        A short transfer really moves its bytes (a prefix of the iovec), so data stays exact when the
        caller retries the rest, as it must for any short count.
        """
        if self.err is not None:
            raise self.oserror()
        if self.kind == "zero":
            return 0
        total = sum(len(v) for v in views)
        cut = align_down(total // 2)
        if cut == 0:  # one 4 KiB block cannot be split under O_DIRECT: move it whole
            cut = total
        head, left = [], cut
        for v in views:
            if left == 0:
                break
            head.append(v[:left])
            left -= len(head[-1])
        return os.pwritev(fd, head, offset) if write else os.preadv(fd, head, offset)

    def fsync(self) -> None:
        """Stand in for os.fsync: raise the errno."""
        raise self.oserror()


class FaultPlan:
    """Rules plus their counters; `take()` decides, thread-safely, which fault (if any) a request gets."""

    def __init__(self, rules: Iterable[FaultRule] | str) -> None:
        self.rules: list[FaultRule] = list(parse_rules(rules) if isinstance(rules, str) else rules)
        self._counts = [0] * len(self.rules)
        self._lock = threading.Lock()
        self.fired: list[tuple[str, int, int]] = []  # (rule, device, count at that rule)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        return cls(parse_rules(spec))

    def for_volume(self, name: str) -> FaultPlan:
        """The rules that apply to a volume called `name`, with fresh counters."""
        return FaultPlan([r for r in self.rules if r.volume in (None, name)])

    @property
    def has_transfer_faults(self) -> bool:
        return any(r.kind in TRANSFER_KINDS for r in self.rules)

    def take(self, op: str, device: int) -> Fault | None:
        """Count one `op` request on `device`; return the fault of the first rule that fires on it."""
        chosen: Fault | None = None
        with self._lock:
            for i, r in enumerate(self.rules):
                if r.op != op or (r.device is not None and r.device != device):
                    continue
                self._counts[i] += 1
                n = self._counts[i]
                if chosen is None and (n == r.nth or (r.onwards and n >= r.nth)):
                    chosen = Fault(r)
                    self.fired.append((str(r), device, n))
        return chosen

    def __repr__(self) -> str:
        return f"FaultPlan({','.join(map(str, self.rules))!r})"


def parse_rules(spec: str) -> list[FaultRule]:
    """Parse a fault spec; raise ValueError naming every malformed rule and the expected form."""
    rules: list[FaultRule] = []
    problems: list[str] = []
    for raw in spec.split(","):
        text = raw.strip()
        if not text:
            continue
        try:
            rules.append(_parse_rule(text))
        except ValueError as e:
            problems.append(f"{text!r}: {e}")
    if problems:
        raise ValueError("bad fault spec (expected rules like 'write#5:ENOSPC', 'dev1:read#3:short', "
                         "'write#11+:EIO', 'fsync#1:EIO'): " + "; ".join(problems))
    return rules


def _parse_rule(text: str) -> FaultRule:
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError("needs op#N:kind")
    *selectors, target, kind = parts
    device: int | None = None
    volume: str | None = None
    for sel in selectors:
        if sel.startswith("dev") and sel[3:].isdigit():
            device = int(sel[3:])
        elif sel.startswith("vol=") and sel[4:]:
            volume = sel[4:]
        else:
            raise ValueError(f"unknown selector {sel!r} (devK or vol=NAME)")
    op, sep, count = target.partition("#")
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    onwards = count.endswith("+")
    count = count[:-1] if onwards else count
    if not sep or not count.isdigit() or int(count) < 1:
        raise ValueError("the count after '#' must be a positive integer (optionally followed by '+')")
    if kind not in TRANSFER_KINDS and not (kind.isupper() and isinstance(getattr(errno, kind, None), int)):
        raise ValueError(f"kind must be an errno name (EIO, ENOSPC, ...), 'short' or 'zero', got {kind!r}")
    if op == "fsync" and kind in TRANSFER_KINDS:
        raise ValueError("fsync moves no bytes: it can only fail with an errno")
    return FaultRule(op, int(count), kind, onwards, device, volume)


def plan_from_env(volume_name: str) -> FaultPlan | None:
    """The plan of `IO_ENGINE_FAULTS` for a volume called `volume_name`; None unless the variable is set.

    Raises ValueError for a malformed spec: a test that meant to inject faults must not run without them.
    """
    spec = os.environ.get(FAULTS_ENV, "").strip()
    if not spec:
        return None
    return FaultPlan.parse(spec).for_volume(volume_name)


class FaultyBackend:
    """A backend that behaves like `inner` except for the requests its plan picks.

    Everything but submit() and sync() is forwarded, so buffers, stats and close() are the inner
    backend's own.
    """

    def __init__(self, inner: Backend, plan: FaultPlan) -> None:
        if plan.has_transfer_faults and not getattr(inner, "reports_transfer_bytes", False):
            raise ValueError(f"short/zero faults need a backend that sees byte counts (threads); the {inner.name} "
                             "backend cannot produce or detect short transfers")
        self.inner = inner
        self.plan = plan

    @property
    def name(self) -> str:
        return self.inner.name

    def submit(self, op: DeviceOp, fault: Fault | None = None) -> list[Future]:
        fault = self.plan.take("write" if op.write else "read", op.device) or fault
        return self.inner.submit(op, fault) if fault is not None else self.inner.submit(op)

    def sync(self, fault_for: Callable[[int], Fault | None] | None = None) -> None:
        def decide(device: int) -> Fault | None:
            return self.plan.take("fsync", device) or (fault_for(device) if fault_for else None)

        self.inner.sync(decide)

    def is_direct(self, buffer: torch.Tensor) -> bool:
        return self.inner.is_direct(buffer)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return self.inner.alloc(nbytes)

    def free(self, buffer: torch.Tensor) -> None:
        self.inner.free(buffer)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, attr: str) -> Any:  # stats, paths, direct, ...: the inner backend's
        if attr == "inner":  # not set yet (a failed __init__): no endless recursion
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        return f"FaultyBackend({self.inner.name}, {self.plan!r})"


def inject_faults(target: Volume | Backend, plan: FaultPlan | str) -> FaultyBackend:
    """Wrap a volume's backend in place (or a bare backend) so `plan`'s faults happen; returns the wrapper,
    whose `.plan.fired` says afterwards what fired."""
    from .volume import Volume

    plan = FaultPlan.parse(plan) if isinstance(plan, str) else plan
    if isinstance(target, Volume):
        target.backend = FaultyBackend(target.backend, plan)
        return target.backend
    return FaultyBackend(target, plan)
