"""The README's commands run as written, in order (issue 42, item 9): after `make run`, its next commands were each
refused because ./runs/tiny/nvme held a store, the dashboards' lines started servers and the data formats named
a folder that does not exist. scripts/readme_commands.py runs every block the README marks `run` in a scratch
copy of the tree; here it runs on a small README first (its rules), then on the real one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import readme_commands as rc  # noqa: E402

SAMPLE = """# a README

<!-- readme: run -->
```bash
make run    # installs, then trains
make test
python finetune.py --steps 300 --resume   # go on
python finetune.py --model m --dry-run \\
    --hardware rtx4090
# step 2/2 | loss 1.0 (what it prints)
python -c "import sys
print(sys.argv)"
```

<!-- readme: run, exit 2 -->

```bash
python finetune.py --model 175b --epochs 3
```

<!-- readme: skip, a server -->
```bash
tensorboard --logdir x
```

```python
not = "a bash block"
```
"""


def test_blocks_their_markers_and_their_commands():
    blocks = rc.parse(SAMPLE)
    assert [(b.line, b.run, b.exit_code, b.reason) for b in blocks] == [
        (4, True, 0, ""), (17, True, 2, ""), (22, False, 0, "a server")]
    assert blocks[0].commands == (
        "make run    # installs, then trains", "make test", "python finetune.py --steps 300 --resume   # go on",
        "python finetune.py --model m --dry-run \\\n    --hardware rtx4090",
        'python -c "import sys\nprint(sys.argv)"')


def test_what_ci_changes_in_a_command():
    py = "/v/bin/python"
    assert rc.for_ci("make test", py) is None
    assert rc.for_ci("make run    # installs", py) == f"{py} finetune.py --steps 2 --overwrite"
    assert rc.for_ci("python finetune.py --steps 300 --resume", py) == f"{py} finetune.py --steps 4 --resume"
    assert rc.for_ci("python finetune.py --steps 150 --overwrite", py) == f"{py} finetune.py --steps 2 --overwrite"
    assert rc.for_ci("python finetune.py --steps 50", py) == f"{py} finetune.py --steps 1"
    assert rc.for_ci("python finetune.py --data d --epochs 2", py) == f"{py} finetune.py --data d --steps 2"
    assert rc.for_ci("X=1 .venv/bin/python finetune.py --mode naive", py) == \
        f"X=1 {py} finetune.py --steps 2 --mode naive"
    for untouched in ("--dry-run", "--help", "--verify"):  # they train nothing
        assert rc.for_ci(f"python finetune.py {untouched}", py) == f"{py} finetune.py {untouched}"
    assert rc.for_ci("python scripts/make_tiny_hf.py runs/x", py) == f"{py} scripts/make_tiny_hf.py runs/x"


@pytest.mark.parametrize("marker,message", [
    ("", "without a marker"),
    ("<!-- readme: skip -->", "needs a reason"),
    ("<!-- readme: run, twice -->", "unknown marker option"),
])
def test_a_block_without_a_clear_marker_is_refused_with_its_line(marker, message):
    text = f"intro\n{marker}\n```bash\necho hi\n```\n"
    with pytest.raises(rc.ReadmeError, match=f"README line 3: .*{message}"):
        rc.parse(text)


def test_every_bash_block_of_the_readme_is_marked_and_runs_something():
    blocks = rc.parse((REPO / "README.md").read_text())
    assert sum(len(b.commands) for b in blocks if b.run) >= 20
    assert any(b.run and b.exit_code == 2 for b in blocks)  # the 175b refusal, as the README shows it


def test_a_command_that_exits_otherwise_than_its_block_says_is_a_failure(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- readme: run -->\n```bash\ntrue\nfalse\n```\n<!-- readme: run, exit 2 -->\n"
                      "```bash\nexit 2\n```\n")
    failures = rc.run_all(readme, tmp_path, log=lambda *_: None)
    assert len(failures) == 1 and "'false'" in failures[0] and "exited 1, the README says 0" in failures[0]


@pytest.mark.slow
def test_the_readmes_commands_run_in_order_in_a_scratch_copy(tmp_path):
    """Every command of every `run` block, as CI runs it (scripts/readme_commands.py: fewer steps), exits as its
    block says; about 5 minutes on a 2-core box (each of ~30 commands starts a process and profiles its first
    step), a fifth of the whole default suite: `make test-all` runs it, and so does
    `python scripts/readme_commands.py`."""
    work = tmp_path / "tree"
    work.mkdir()
    log: list[str] = []
    try:
        rc.scratch_copy(work)
        failures = rc.run_all(work / "README.md", work, timeout=300, log=log.append)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the 125m run's states take 3.5 GB
    assert not failures, "\n\n".join(failures) + "\n\nall commands:\n" + "\n".join(log)
