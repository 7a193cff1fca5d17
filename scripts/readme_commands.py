"""Run README.md's commands in order, as a new user pastes them, in a scratch copy of the working tree.

Which blocks run is written in the README, next to each block: every fenced ``bash`` block is preceded by an HTML
comment (invisible on the rendered page) that says what CI does with it:

- ``<!-- readme: run -->``: each command runs and must exit 0;
- ``<!-- readme: run, exit 2 -->``: each command runs and must exit 2 (the README shows it refused);
- ``<!-- readme: skip, REASON -->``: not run (another box, a server, a benchmark, a run too big for CI).

After ``run.`` a marker may explain itself (the README's first one does).

A ``bash`` block without one is an error, so whoever adds a block decides. What CI changes, as the README says
where it marks the first block: ``make run`` runs as the ``python finetune.py --overwrite`` it ends in and
``make test`` (what runs this) is skipped; ``python`` and ``.venv/bin/python`` are this interpreter; a
``finetune.py`` command that trains runs fewer steps (``--steps N`` becomes ``ceil(N / 75)``, ``--epochs`` and
the config's 150 steps become ``--steps 2``), so a ``--resume`` that goes further still goes further.

Usage: ``python scripts/readme_commands.py [--readme README.md] [--list] [--keep]``; exit 1 when a command
exits otherwise than its block says. `tests/integration/test_readme_commands.py` runs it in the default suite.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*readme:\s*(run|skip)\b(.*?)-->", re.DOTALL)
FENCE = re.compile(r"^```(\S*)\s*$")
STEPS_SCALE = 75
"""A training command's ``--steps N`` runs ``ceil(N / STEPS_SCALE)`` steps in CI (150 -> 2, 300 -> 4)."""
CI_STEPS = 2
"""Steps of a training command that gives none (the config's 150) or gives ``--epochs``."""
NOT_TRAINING = ("--dry-run", "--help", "--help-config", "--verify")


class ReadmeError(ValueError):
    """A fenced bash block without a marker, or a marker that says nothing this script knows."""


@dataclass(frozen=True)
class Block:
    """A fenced bash block: where it starts (1-based line of its fence), what its marker says, its commands."""

    line: int
    run: bool
    exit_code: int
    reason: str
    commands: tuple[str, ...]


def parse(text: str) -> list[Block]:
    """Every fenced ``bash`` block of a README with its marker (the last HTML comment before it, with only blank
    lines between); raises ReadmeError naming the line of a block that has none, or a bad one."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        if fence.group(1) == "bash":
            out.append(_block(lines, i, lines[i + 1:end]))
        i = end + 1
    return out


def _block(lines: list[str], start: int, body: list[str]) -> Block:
    k = start - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    first = k
    if k >= 0 and lines[k].rstrip().endswith("-->"):  # a comment over several lines: from its opening line
        while first > 0 and "<!--" not in lines[first]:
            first -= 1
    marker = MARKER.search(" ".join(lines[first:k + 1])) if k >= 0 else None
    if marker is None:
        raise ReadmeError(f"README line {start + 1}: a bash block without a marker; put <!-- readme: run -->, "
                          "<!-- readme: run, exit 2 --> or <!-- readme: skip, REASON --> on the line before it "
                          "(scripts/readme_commands.py)")
    kind, rest = marker.group(1), marker.group(2).strip()
    if kind == "skip":
        reason = rest[1:].strip() if rest.startswith(",") else ""
        if not reason:
            raise ReadmeError(f"README line {start + 1}: <!-- readme: skip --> needs a reason after a comma")
        return Block(start + 1, False, 0, reason, commands(body))
    code = re.match(r",\s*exit\s+(\d+)\b", rest)
    if not (code or not rest or rest.startswith(".")):
        raise ReadmeError(f"README line {start + 1}: unknown marker option {rest!r} (only ', exit N')")
    return Block(start + 1, True, int(code.group(1)) if code else 0, "", commands(body))


def commands(body: list[str]) -> tuple[str, ...]:
    """The shell commands of a block's lines: comment lines (the output the README shows) dropped, a line
    continued by a trailing backslash or by an open quote joined with the next."""
    out, current = [], ""
    for line in body:
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current = f"{current}\n{line}" if current else line
        if current.endswith("\\") or not _quotes_closed(current):
            continue
        out.append(current)
        current = ""
    if current:
        out.append(current)
    return tuple(out)


def _quotes_closed(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


PYTHON = re.compile(r"(?<![\w/.-])(?:\.venv/bin/)?python(?=\s)")


def for_ci(command: str, python: str = sys.executable) -> str | None:
    """The command as CI runs it (module docstring); None: not run (``make test``)."""
    words = shlex.split(command, comments=True)
    if words == ["make", "test"]:
        return None
    if words == ["make", "run"]:
        command = "python finetune.py --overwrite"
    command = PYTHON.sub(shlex.quote(python), command)
    if "finetune.py" not in command or any(flag in command.split() for flag in NOT_TRAINING):
        return command
    steps = re.search(r"--steps[ =](\d+)", command)
    if steps:
        fewer = max(1, math.ceil(int(steps.group(1)) / STEPS_SCALE))
        return command[:steps.start()] + f"--steps {fewer}" + command[steps.end():]
    epochs = re.search(r"--epochs[ =](\d+)", command)
    if epochs:
        return command[:epochs.start()] + f"--steps {CI_STEPS}" + command[epochs.end():]
    return command.replace("finetune.py", f"finetune.py --steps {CI_STEPS}", 1)


def scratch_copy(dest: Path, src: Path = REPO) -> None:
    """The working tree's files (tracked and untracked, not ignored: what a checkout holds) copied to `dest`;
    outside a git checkout, the tree without its venv, runs and caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=src, capture_output=True)
    except OSError:
        listed = None
    if listed is None or listed.returncode != 0:
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info"))
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = src / name
        if path.is_file() and not path.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / name)


def run_all(readme: Path, workdir: Path, timeout: float = 600, log=print) -> list[str]:
    """Run every marked block's commands in order in `workdir` (a scratch copy); returns the failures."""
    env = {**os.environ, "PYTHONPATH": str(workdir), "LOHAN_DATA_CACHE": str(workdir / ".cache" / "lohan-data"),
           "MPLBACKEND": "Agg"}
    failures = []
    for block in parse(readme.read_text()):
        if not block.run:
            log(f"README:{block.line}: skipped ({block.reason})")
            continue
        for command in block.commands:
            ci = for_ci(command)
            if ci is None:
                log(f"README:{block.line}: skipped {command!r} (what runs this script)")
                continue
            t0 = time.monotonic()
            try:
                done = subprocess.run(["bash", "-c", ci], cwd=workdir, env=env, capture_output=True, text=True,
                                      timeout=timeout)
                code, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as e:
                code, output = None, f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
            log(f"README:{block.line}: exit {code} in {time.monotonic() - t0:5.1f} s: {ci}")
            if code != block.exit_code:
                failures.append(f"README:{block.line}: {command!r} (run as {ci!r}) exited {code}, the README says "
                                f"{block.exit_code}; its output ends:\n{output[-3000:]}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--list", action="store_true", help="print the commands as CI runs them, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    args = parser.parse_args(argv)
    if args.list:
        for block in parse(args.readme.read_text()):
            for command in block.commands:
                print(f"README:{block.line}: " + (f"[exit {block.exit_code}] {for_ci(command)}" if block.run
                                                  else f"[skip: {block.reason}] {command}"))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="lohan-readme-"))
    try:
        scratch_copy(workdir)
        failures = run_all(args.readme, workdir)
    finally:
        if args.keep:
            print(f"scratch copy kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
