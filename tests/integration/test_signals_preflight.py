"""Issue 42, item 10: SIGTERM or Ctrl-C while the token cache is built (the pre-flight, before the store is opened)
printed a traceback and ended with 1 / -2; a second Ctrl-C while the first one's clean-up ran printed one too.
Both now stop like the rest of a run: one line, exit code 143 (SIGTERM) or 130 (Ctrl-C), no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lohan.app.cli import main

DATA = Path(__file__).resolve().parents[2] / "data" / "sft_example.jsonl"  # a record file: the token cache

# finetune.py with the slow parts made slower and announced on stdout, so the test signals at a known moment
SLOW = textwrap.dedent("""
    import faulthandler, sys, time
    import lohan.runtime.engine as engine
    from lohan.app.cli import main

    def announce(what, real):
        def slow(*a, **k):
            print(what, flush=True)
            for _ in range(1200):  # a signal ends it (short sleeps: one that lands on another thread of the
                time.sleep(0.1)  # process wakes no sleep of the main thread; its handler runs at the next one)
            return real(*a, **k)
        return slow

    faulthandler.dump_traceback_later(100)  # a run that hangs shows its threads' stacks in the test's failure
    engine.Engine.step = announce("stepping", engine.Engine.step)
    engine.Engine.close = announce("closing", engine.Engine.close)
    sys.exit(main(sys.argv[1:]))
""")


def args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--data", str(DATA), "--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"),
            "--compute-dtype", "fp32", "--seq-len", "64", "--batch-size", "4", "--steps", "2", "--backend", "threads",
            *extra]


def signalled(tmp_path: Path, at: list[tuple[str, signal.Signals]]) -> tuple[int, str]:
    """Run finetune.py (its step and its close slowed), send each signal once its line is printed; (exit code,
    all output)."""
    script = tmp_path / "slow_finetune.py"
    script.write_text(SLOW)
    p = subprocess.Popen([sys.executable, str(script), *args(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "LOHAN_DATA_CACHE": str(tmp_path / "cache")},
                         preexec_fn=_interactive_sigint)
    seen = []
    try:
        for line, sig in at:
            while (got := p.stdout.readline()) and got.strip() != line:
                seen.append(got)
            assert got, f"the run ended before printing {line!r}: {''.join(seen)}"
            p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    return p.returncode, "".join(seen) + out + err


def _interactive_sigint() -> None:
    """In the child before it runs: Ctrl-C's default action, as a terminal's process gets it (a background job of a
    shell, `pytest &`, starts with SIGINT ignored, and its children inherit that: the signal would never arrive)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_self(sig: signal.Signals, real):
    """`real`, preceded by `sig` sent to this process (its handler runs as soon as os.kill returns)."""
    def wrapped(*a, **k):
        os.kill(os.getpid(), sig)
        return real(*a, **k)
    return wrapped


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                             (signal.SIGINT, 130, "interrupted")], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_token_cache_is_built_stops_the_run_quietly(tmp_path, monkeypatch, capsys, sig, code,
                                                                       said):
    import lohan.data.token_cache as tc

    monkeypatch.setenv("LOHAN_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tc, "_build", _signal_self(sig, tc._build))
    # Ctrl-C as an interactive Python gets it: a shell starts a background job (`pytest &`) with SIGINT ignored,
    # and Python then installs no handler of its own, so the signal would never reach the run
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        got = main(args(tmp_path))
    except KeyboardInterrupt as e:  # (SIGTERM's is one too) what finetune.py turned into a traceback
        pytest.fail(f"{type(e).__name__} escaped main(): a traceback and exit code 1 / -2")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == code  # finetune.py exits with it
    out = capsys.readouterr()
    assert f"{said} before the store was opened: nothing of the run was written" in out.out, out
    assert not (tmp_path / "nvme").exists()
    cache = tmp_path / "cache"
    assert not list(cache.glob("*.lock")) and not [p for p in cache.iterdir() if p.suffix == ""]  # nothing trusted
    assert signal.getsignal(signal.SIGTERM) is not None  # (the run put the previous handler back)


def test_a_second_ctrl_c_during_the_first_ones_clean_up_stops_at_once_quietly(tmp_path):
    """In a process of its own: the exit code and everything it prints are the test."""
    rc, out = signalled(tmp_path, [("stepping", signal.SIGINT), ("closing", signal.SIGINT)])
    assert rc == 130, out
    assert "Traceback" not in out, out
    assert "interrupted: stopped at once; a store keeps its last committed step (continue with --resume)" in out, out
    assert main(args(tmp_path, "--resume")) == 0  # and the store it left is resumed
