"""Steps held in RAM that update in place during backward (`StepPlan.in_place`): what lets them do so safely.

Between durable commits (`engine.persist_every`) the optimizer records live in RAM only, and a step updates them in
place. Updating during backward (active gradient offloading) then leaves nothing to skip back to if the step turns
out not finite, and nothing consistent to persist if it is interrupted halfway. Deferring every such update until
the gradient norm is known avoids both, at the price of the overlap: the update then runs after backward, and on a
box whose CPU lane binds the step costs backward + update instead of about the larger of the two. This module pays
for the overlap with two rare-case mechanisms instead:

- `HeldSteps`, the batches of the steps committed since the last durable commit. A step that updated RAM-only
  states in place and turned out not finite, or clipped after a speculated update, is recovered exactly: the engine
  drops back to the last durable commit, replays these steps (the same batches give the same bits), and runs the
  failed step again as it is now known to end: skipped (its gradients let go) or at its clip coefficient.
- `finish_before_interrupts`: Ctrl-C or SIGTERM during such a step is held until the step has committed, then
  raised, so the driver's persist loses nothing (a second signal stops at once, losing the steps since the last
  durable commit, as a kill does).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from torch import Tensor

log = logging.getLogger("lohan.runtime.engine")

Batch = tuple[Tensor, Tensor]


Outcome = str | Tensor | None
"""How a step ended, so that its replay runs as it is known to end: "skip" (not finite), its clip coefficient (a
0-d tensor, below 1), or None (unclipped)."""


class HeldSteps:
    """The (batch, next batch, outcome) of each step committed since the last durable commit, in order (copies:
    the caller may reuse its tensors)."""

    def __init__(self) -> None:
        self._steps: list[tuple[Batch, Batch | None, Outcome]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def after_commit(self, volatile: bool, batch: Batch, next_batch: Batch | None, outcome: Outcome) -> None:
        """A step committed: held in RAM (`volatile`) it joins the list, durable it ends it."""
        if not volatile:
            self._steps.clear()
            return
        self._steps.append((_copy(batch), None if next_batch is None else _copy(next_batch), outcome))

    def clear(self) -> None:
        """The held steps became durable (a persist), or were lost (dropped back to the last durable commit)."""
        self._steps.clear()

    def take(self) -> list[tuple[Batch, Batch | None, Outcome]]:
        steps, self._steps = self._steps, []
        return steps


def _copy(batch: Batch) -> Batch:
    ids, targets = batch
    return ids.clone(), targets.clone()


_IN_PLACE = ("the step first (it updates in place the states held in RAM since the last durable commit, which a "
             "stop now would lose)")


@contextlib.contextmanager
def finish_before_interrupts(active: bool, pending: list[int] | None = None,
                             note: str | None = _IN_PLACE) -> Iterator[list[int]]:
    """Hold Ctrl-C and SIGTERM until the block ends (then deliver the first one as its handler would have), where
    `active` and in the main thread (the only one signal handlers run in); a second signal meanwhile is delivered
    at once. Yields the signals held so far: where the block raises, none is delivered, and a caller that goes on
    with the same work (a replay) passes them on as `pending`, delivered when its own block ends. `note`: what the
    warning logged for a held signal says is finished first, and why (None: no warning, a block of moments)."""
    caught: list[int] = list(pending or [])
    if not active or threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def hold(signum: int, frame: Any) -> None:
        if caught:  # the user insists: stop now
            restore()
            _deliver(previous[signum], signum, frame)
            return
        caught.append(signum)
        if note is not None:
            log.warning("%s: finishing %s; send it again to stop at once", signal.Signals(signum).name, note)

    for sig in previous:
        signal.signal(sig, hold)
    try:
        yield caught
    finally:
        restore()
    if caught:
        _deliver(previous[caught[0]], caught[0], None)


def _deliver(handler: Any, signum: int, frame: Any) -> None:
    """Run `handler` for `signum` as the interpreter would have (the default SIGINT handler raises
    KeyboardInterrupt; a default SIGTERM ends the process)."""
    if callable(handler):
        handler(signum, frame)
    elif handler in (signal.SIG_DFL, None):  # (None: a handler not set from Python, which the default stands for)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(signum)
