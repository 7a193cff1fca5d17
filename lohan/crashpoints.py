"""Named crash points: SIGKILL this process at a chosen point, to prove that every phase survives it.

`LOHAN_CRASH_AT="name"` kills the process the first time `crashpoint("name")` is reached;
`"name:N"` the N-th time. A name ending in `*` matches every point with that prefix
(`"engine.backward*:3"`: the third backward point of any block). Unset (always, outside the kill
harness `scripts/kill_harness.py` and its tests), a crash point costs one dictionary lookup.

Points are placed where a kill is most likely to leave half-done work: between a block's initial
record and its progress entry, before the rename of each JSON file (commit, run state, init
progress), inside forward and backward, after the optimizer's writes went out, between export shards.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("LOHAN_CRASH_AT") or None
_hits: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int]:
    name, _, count = spec.rpartition(":")
    if name and count.isdigit():
        return name, int(count)
    return spec, 1


def crashpoint(name: str) -> None:
    """Die here (SIGKILL, no cleanup, like a power cut or the OOM killer) if the harness asked for it."""
    if _SPEC is None:
        return
    want, nth = _parse(_SPEC)
    if want.endswith("*") and name.startswith(want[:-1]) or name == want:
        _hits[want] = _hits.get(want, 0) + 1
        if _hits[want] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
