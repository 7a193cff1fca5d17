"""Bandwidth emulation: pace one device's transfers to a fixed rate.

Used to show striping's scaling on a machine with one physical disk: N directories on the
same disk, each throttled to X GB/s, behave like N independent X GB/s SSDs as long as the
real disk sustains N*X. Read and write share one clock per device because an SSD's
bandwidth is shared between directions (DESIGN.md §2: "read and write times add").
Every volume in the same directory shares that directory's clock (`for_directory`): the model
states and the swapped activations of a run are two volumes on one emulated SSD.
"""

from __future__ import annotations

import os
import threading
import time

_registry: dict[tuple[str, float], Throttle] = {}
_registry_lock = threading.Lock()


class Throttle:
    """A virtual clock per device: each transfer occupies `nbytes / rate` seconds of it."""

    def __init__(self, gbps: float) -> None:
        if gbps <= 0:
            raise ValueError(f"emulated bandwidth must be positive, got {gbps} GB/s")
        self.bytes_per_s = gbps * 1e9
        self._clock = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Book `nbytes` on the device's timeline; returns when (perf_counter) the transfer may complete."""
        with self._lock:
            start = max(time.perf_counter(), self._clock)
            self._clock = start + nbytes / self.bytes_per_s
            return self._clock

    @staticmethod
    def wait_until(deadline: float) -> None:
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def for_directory(path: str, gbps: float) -> Throttle:
    """The one Throttle of the directory holding `path` at `gbps`, shared by every volume in it."""
    key = (os.path.dirname(os.path.realpath(path)), float(gbps))
    with _registry_lock:
        throttle = _registry.get(key)
        if throttle is None:
            throttle = _registry[key] = Throttle(gbps)
        return throttle
