"""Python's cyclic garbage collector, kept off a step's critical path.

CPython collects reference cycles when its allocation counters cross their thresholds, on whichever thread
happens to allocate, and holds the GIL meanwhile: no other Python thread runs. A lohan process holds some
300,000 long-lived objects (torch, the model's modules, the plan), and every full collection (generation 2)
walks them all: ~190 ms on the emulated GPU box, run by the optimizer worker in the middle of a step
(benchmarks/results/lane_bench: the compute thread stopped feeding the device for as long, and with it the
optimizer, the hashing and the I/O submission). Young collections cost 1-4 ms each, about forty a step.

So while an engine is open (`StepGc`, ``engine.gc_every`` steps per full collection; 0: Python's own schedule):
automatic collection is off; at each step's end the young generations are collected (generation 1: what the
step made, a few ms at a point where the device has the next work queued); after the first step everything
still alive is frozen (`gc.freeze`: the permanent generation, which no collection walks), so that the full
collection every ``gc_every`` steps walks only what was made since. Closing the last open engine gives Python
its schedule back (`gc.unfreeze`, and `gc.enable` where it was enabled), collecting nothing itself.

Cyclic garbage lives at most until its step's end (a young collection) or, once old, ``gc_every`` steps;
garbage frozen with the live objects after the first step (old cycles only: the young ones are collected
first) is freed once the engines are closed. Reference counting, which frees almost everything, is unchanged.
torchtitan (``gc_freq``) and Megatron-LM (``manual_gc``) run their collections the same way.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_open = 0  # engines open with a schedule of their own (gc_every > 0)
_was_enabled = True  # whether automatic collection was on before the first of them opened
_frozen = False


class StepGc:
    """One engine's part in the process-wide collection schedule (module docstring)."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"gc_every={every}: 0 (Python's own schedule) or a number of steps")
        self.every = every
        self.steps = 0
        self._joined = False
        if every:
            self._join()

    def _join(self) -> None:
        global _open, _was_enabled
        with _lock:
            if _open == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _open += 1
            self._joined = True

    def step_done(self) -> None:
        """At a step's end: the young generations; a full collection every `every` steps; after the first
        step, freeze what lives (the model, the pools, the plan are made by then)."""
        global _frozen
        if not self._joined:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            gc.collect()
        else:
            gc.collect(1)
        with _lock:
            if not _frozen:
                gc.freeze()
                _frozen = True

    def close(self) -> None:
        """Leave the schedule; the last engine out gives Python its own back."""
        global _open, _frozen
        if not self._joined:
            return
        self._joined = False
        with _lock:
            _open -= 1
            if _open == 0:
                if _frozen:
                    gc.unfreeze()
                    _frozen = False
                if _was_enabled:
                    gc.enable()
