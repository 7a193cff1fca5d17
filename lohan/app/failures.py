"""How a run stops short: a refusal before anything is written, Ctrl-C or SIGTERM, and the errors a run reports
as one ``error:`` line (exit code 2), each saying what stands and how to go on."""

from __future__ import annotations

import errno
import signal
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from io_engine import IOEngineError
from lohan.app.layout import OutputError
from lohan.runtime.parallel import Group
from lohan.store.integrity import StoreCorruptError


class Refusal(Exception):
    """A run refused before (or instead of) training: the message says what is wrong and how to fix it, and
    nothing was written. `_train` prints it as one `error:` line and exits 2."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM while the store was being created: reported, with the exit code to return."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and `kill` send): stops the run exactly as Ctrl-C does."""


def on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def interrupt_name(err: BaseException) -> str:
    return "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"


def interrupt_code(err: BaseException) -> int:
    return 128 + signal.SIGTERM if isinstance(err, Terminated) else 130


def fail(console: Console, dp: Group, msg: str) -> int:
    if dp.is_main:
        console.print(f"[red]error:[/red] {escape(msg)}")  # messages quote paths and lists: "[...]" is not markup
    else:  # a rank's own trouble (its disk, its memory) must be seen too
        print(f"rank {dp.rank}: error: {msg}", file=sys.stderr)
    return 2


def os_error_text(err: OSError, doing: str) -> str:
    """An OSError as a sentence with its path, and what a full disk means (the usual one on a long run). An
    `OutputError` says itself what was being done."""
    if isinstance(err, OutputError):
        doing = err.doing
    where = f" ({err.filename})" if err.filename else ""
    text = f"{err.strerror or err} while {doing}{where}"
    if err.errno == errno.ENOSPC:
        text += ": the disk is full; free space on it (or point --nvme / --metrics / --export elsewhere)"
    return text


def root_cause(err: BaseException) -> BaseException | str:
    """The innermost I/O or integrity error behind `err` (the optimizer thread's failures arrive wrapped)."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, StoreCorruptError | IOEngineError):
            return cause
        cause = cause.__cause__
    return str(err) if not err.__cause__ else f"{err}: {err.__cause__}"
