"""The catalogue of issue 42's path cases (items 1-3): a store name that escapes --nvme, outputs through symbolic links,
ownership guessed from contents. Every case runs against a workspace holding another run's store, metrics, plot,
export and checkpoints and a user's files; each is refused with a message that says what is wrong (or, where the
run may go on, leaves the foreign file alone and says so), and at the end every file lohan did not write in this
run has the checksum it had at the start."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import xxhash

from lohan.app.cli import main
from tests.integration.test_cli import args as base_args


def args(work: Path, nvme: str, metrics: str, *extra: str) -> list[str]:
    argv = base_args(work, "--compute-dtype", "fp32", *extra)
    argv[argv.index("--nvme") + 1] = str(work / nvme)
    argv[argv.index("--metrics") + 1] = str(work / metrics)
    return argv


def checksums(root: Path, skip: tuple[Path, ...]) -> dict[str, str]:
    """Every file under `root` (links as their targets' names, not followed), but those under `skip`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            path = here / name
            if any(path == s or s in path.parents for s in skip):
                continue
            out[str(path.relative_to(root))] = (f"link:{os.readlink(path)}" if path.is_symlink()
                                                else xxhash.xxh3_64_hexdigest(path.read_bytes()))
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Another run (its store, metrics, plot, export with two checkpoints) and a user's files."""
    w = tmp_path_factory.mktemp("w")
    assert main(args(w, "victim", "v.jsonl", "--steps", "2", "--save-every", "1", "--export", str(w / "vexp"))) == 0
    user = w / "user"
    user.mkdir()
    (user / "my_training_log.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 5.0 - i / 50}) + "\n" for i in range(1, 101)))
    (user / "notes.txt").write_text("a user's notes")
    shutil.copy(w / "v.jsonl", user / "kept_copy.jsonl")  # a user's copy of the other run's metrics
    return w


# (id, setup(w) -> argv, the message; every one is refused before anything is written)
REFUSED = [
    ("name-escapes-nvme", lambda w: args(w, "mine", "m.jsonl", "--steps", "2", "--overwrite", "--set",
                                         "engine.name=../victim/lohan"),
     r"name='\.\./victim/lohan': a store name is a file name"),
    ("name-climbs-out", lambda w: args(w, "mine", "m.jsonl", "--steps", "2", "--set", "engine.name=../../etc/evil"),
     r"name='\.\./\.\./etc/evil'"),
    ("name-empty", lambda w: args(w, "mine", "m.jsonl", "--steps", "2", "--set", "engine.name="),
     r"name=(''|None): a store name is a file name"),
    ("name-null", lambda w: args(w, "mine", "m.jsonl", "--steps", "2", "--set", "engine.name=null"),
     r"name=None: a store name is a file name"),
    ("export-links-to-another-runs-export",
     lambda w: (_link(w / "exp_link", w / "vexp"), args(w, "mine", "m.jsonl", "--steps", "2", "--export",
                                                          str(w / "exp_link")))[1],
     r"--export .*exp_link is a symbolic link \(to .*vexp\)"),
    ("export-staging-links-elsewhere",
     lambda w: (_link(w / "exp2.partial", w / "vexp"), args(w, "mine", "m.jsonl", "--steps", "2", "--export",
                                                              str(w / "exp2")))[1],
     r"staging directory .*exp2\.partial is a symbolic link"),
    ("export-is-another-runs-export", lambda w: args(w, "mine", "m.jsonl", "--steps", "2", "--export", str(w / "vexp")),
     r"vexp holds the export of step 2 of another lohan run \(run id [0-9a-f]+\)"),
    ("export-holds-another-runs-checkpoint",
     lambda w: (shutil.copytree(w / "vexp" / "step-1", w / "exp3" / "step-1"),
                args(w, "mine", "m.jsonl", "--steps", "2", "--export", str(w / "exp3")))[1],
     r"step-1 holds the checkpoint of step 1 of another lohan run"),
    ("metrics-a-users-jsonl-with-steps",
     lambda w: args(w, "mine", "user/my_training_log.jsonl", "--steps", "2"),
     r"--metrics .*my_training_log\.jsonl holds a file lohan did not write \(not lohan's records"),
    ("metrics-of-another-run", lambda w: args(w, "mine", "v.jsonl", "--steps", "2"),
     r"v\.jsonl holds the metrics of another lohan run \(run id [0-9a-f]+\)"),
    ("metrics-a-copy-given-to-its-own-run",
     lambda w: args(w, "victim", "user/kept_copy.jsonl", "--steps", "3", "--resume"),
     r"kept_copy\.jsonl holds a file lohan did not write \(a copy of a metrics file lohan wrote"),
    ("metrics-through-a-link", lambda w: (_link(w / "m_link.jsonl", w / "v.jsonl"),
                                          args(w, "mine", "m_link.jsonl", "--steps", "2"))[1],
     r"--metrics .*m_link\.jsonl is a symbolic link"),
    ("plot-through-a-link", lambda w: (_link(w / "p.png", w / "user" / "notes.txt"),
                                       args(w, "mine", "p.jsonl", "--steps", "2"))[1],
     r"the metrics plot .*p\.png is a symbolic link"),
    ("plot-of-another-run", lambda w: (shutil.copy(w / "v.png", w / "q.png"),
                                       args(w, "mine", "q.jsonl", "--steps", "2"))[1],
     r"q\.png holds the metrics plot of another lohan run"),
    ("store-file-is-a-link", lambda w: (_link(w / "mine2" / "lohan.slab", w / "user" / "notes.txt"),
                                        args(w, "mine2", "m2.jsonl", "--steps", "2"))[1],
     r"the store.s file .*mine2/lohan\.slab is a symbolic link .*remove the link"),
    ("store-record-is-a-link", lambda w: (_link(w / "mine3" / "lohan.commit.json.tmp", w / "user" / "notes.txt"),
                                          args(w, "mine3", "m3.jsonl", "--steps", "2"))[1],
     r"lohan\.commit\.json\.tmp is a symbolic link"),
    ("lock-file-is-a-link", lambda w: (_link(w / "mine4" / ".lohan.lock", w / "user" / "notes.txt"),
                                       args(w, "mine4", "m4.jsonl", "--steps", "2"))[1],
     r"\.lohan\.lock is a symbolic link"),
]


def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_path_lohan_cannot_prove_its_own_is_refused_and_left_as_it_is(case, workspace, tmp_path, capsys):
    name, setup, message = case
    w = tmp_path / "w"
    shutil.copytree(workspace, w, symlinks=True, copy_function=os.link)  # cheap, and inodes kept (hard links)
    argv = setup(w)
    before = checksums(w, ())
    assert main(argv) == 2
    text = "".join(capsys.readouterr())
    assert re.search(message, text, re.S), text
    assert "Traceback" not in text and "unexpected" not in text, text
    assert checksums(w, ()) == before  # nothing at all was written, lohan's or not
    assert not list(w.rglob("None.*")) and not (w.parent / "etc").exists()


def test_files_added_to_an_export_or_a_checkpoint_are_never_removed(tmp_path, capsys):
    """(b) a user's file in a finished export refuses the next export up front; (c) pruning keeps a checkpoint that
    holds a user's file, whole, and says so; a copy of a run's own export is not its own either."""
    w = tmp_path
    own = ("own", "o.jsonl", "--save-every", "1", "--save-total-limit", "2", "--export", str(w / "oexp"))
    assert main(args(w, *own, "--steps", "2")) == 0
    (w / "oexp" / "EVAL_NOTES.md").write_text("the user's evaluation notes")
    (w / "oexp" / "step-1" / "NOTE.md").write_text("why step 1 matters")
    shutil.copytree(w / "oexp", w / "oexp_copy")
    foreign = checksums(w, (w / "own", w / "o.jsonl", w / "o.png", w / "oexp"))
    foreign.update({p: checksums(w, ())[p] for p in ("oexp/EVAL_NOTES.md", "oexp/step-1/NOTE.md")})
    capsys.readouterr()
    assert main(args(w, *own, "--steps", "3", "--resume")) == 2
    text = capsys.readouterr().out
    assert "EVAL_NOTES.md (not written by lohan)" in text and not (w / "oexp" / "step-3").exists()
    copy = [a if a != str(w / "oexp") else str(w / "oexp_copy") for a in own]
    assert main(args(w, *copy, "--steps", "3", "--resume")) == 2
    assert "not the file lohan wrote there: changed, replaced or copied since" in capsys.readouterr().out
    (w / "oexp" / "EVAL_NOTES.md").rename(w / "EVAL_NOTES.md")
    del foreign["oexp/EVAL_NOTES.md"]
    foreign["EVAL_NOTES.md"] = xxhash.xxh3_64_hexdigest((w / "EVAL_NOTES.md").read_bytes())
    assert main(args(w, *own, "--steps", "3", "--resume")) == 0  # step 3 saved, step 1 due for pruning
    text = capsys.readouterr().out
    assert re.search(r"note: .*step-1 is kept: .*NOTE\.md \(not written by lohan\)", text), text
    assert sorted(p.name for p in (w / "oexp").glob("step-*")) == ["step-1", "step-2", "step-3"]
    now = checksums(w, ())
    assert {p: now.get(p) for p in foreign} == foreign


def test_a_second_run_never_takes_a_live_runs_metrics(tmp_path, capsys):
    """(d) a run started with the --metrics of another run that is still going is refused: the first run writes on
    to its own file, which holds each of its committed steps once when it is stopped."""
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    first = args(tmp_path, "first", "shared.jsonl", "--steps", "100000")
    proc = subprocess.Popen([sys.executable, str(root / "finetune.py"), *first], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "shared.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "shared.jsonl").exists(), "the first run wrote no metrics"
        assert main(args(tmp_path, "second", "shared.jsonl", "--steps", "2")) == 2
        assert "shared.jsonl holds the metrics of another lohan run" in capsys.readouterr().out
        assert proc.poll() is None, "the first run was meant to be still going"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out
    records = [json.loads(line) for line in (tmp_path / "shared.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= 1
    assert len({r["run_id"] for r in records}) == 1 and not (tmp_path / "second").exists()
