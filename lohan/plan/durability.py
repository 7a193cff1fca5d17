"""The durability interval (`engine.persist_every`): how often the records held in RAM are written and committed.

Where every optimizer record stays resident, a step need not write them: its states are in RAM, and the SSDs only
have to hold a state a kill can resume from. Persisting every N steps costs 1/N of the record writes (16 B a
parameter in fp32 each time) and a kill replays at most the N - 1 steps after the last durable one (bit-identical:
the replay draws the same batches and computes the same bits). Records that stream from the SSDs are written every
step anyway, and a slot must hold one step's records, all of them: so N > 1 only when every record is resident.

`auto` takes the least N that keeps the persist writes under `WRITE_SHARE` of the run's time: a persist's writes
take ``record_bytes / write rate`` seconds, spread over N steps of ``step_s`` each. Pure, torch-free.
"""

from __future__ import annotations

import math

WRITE_SHARE = 0.1
"""`auto`: the share of the run's time the persist writes may take."""

MAX_AUTO = 100
"""`auto` never goes beyond this many steps between durable commits (what a kill may replay)."""

MIN_WRITE_S = 0.05
"""`auto` keeps every step durable while a persist's writes take less than this: a small model's records cost next
to nothing to write, and a kill should then lose nothing."""


def persist_interval(record_bytes: int, write_bps: float, step_s: float, share: float = WRITE_SHARE,
                     cap: int = MAX_AUTO) -> int:
    """The least N >= 1 for which writing `record_bytes` at `write_bps` once every N steps of `step_s` seconds
    takes at most `share` of the time: ``write_s / (N * step_s) <= share``; at most `cap`, and 1 while the writes
    take under `MIN_WRITE_S`."""
    if record_bytes <= 0 or write_bps <= 0 or step_s <= 0:
        return 1
    write_s = record_bytes / write_bps
    if write_s < MIN_WRITE_S:
        return 1
    return max(1, min(cap, math.ceil(write_s / (share * step_s) - 1e-9)))


def eligible(all_resident: bool, slots: int, one_process: bool, can_defer: bool, in_place: bool = False) -> str | None:
    """Why a durability interval over 1 cannot apply (None: it can): some records stream from the SSDs, one slot (in
    place), data parallel, or no room to hold a step's gradients until its update where a step whose states are only
    in RAM must wait for the gradient norm (clipping, fp16); without either (`in_place`) it updates them during
    backward (lohan.runtime.held)."""
    if not all_resident:
        return "records stream from the SSDs, which are written every step anyway"
    if slots != 2:
        return "slots=1 updates in place"
    if not one_process:
        return "data parallel ranks commit together every step"
    if not (can_defer or in_place):
        return "no gradient stash to hold a step's gradients until its update (clipping or fp16 need one)"
    return None


def loss_text(n: int, step_s: float | None) -> str:
    """'a kill loses at most N steps, about M minutes' (the header's line; M from the predicted step time)."""
    if n <= 1:
        return "a kill loses at most the step in flight"
    lost = n * step_s if step_s else 0.0
    about = "" if not lost else f", about {lost:.2g} s" if lost < 60 else f", about {lost / 60:.1f} minutes"
    return f"a kill loses at most {n} steps{about}"
