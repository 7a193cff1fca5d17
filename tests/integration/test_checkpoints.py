"""Periodic checkpoints (--save-every, --save-total-limit): where and when they are written, that they load with
transformers and hold the engine's weights, pruning, what is never touched, and kills in the middle of a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lohan.app.cli import main
from lohan.app.export import Checkpoints
from lohan.app.layout import EXPORT_MARKER, RunLayout
from lohan.app.ownership import Owner, begin_folder, seal_folder
from tests.integration.test_cli import args

ROOT = Path(__file__).resolve().parents[2]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def steps_saved(out: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in out.glob("step-*") if p.name[5:].isdigit())


def test_checkpoints_at_every_nth_step_with_save_s_in_the_metrics(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(args(tmp_path, "--steps", "5", "--save-every", "2", "--export", str(out))) == 0
    text = capsys.readouterr().out
    assert steps_saved(out) == [2, 4]
    assert f"checkpoint {out / 'step-2'} (step 2, float32) written in" in text
    assert "checkpoints 2 written" in text  # the summary
    assert json.loads((out / "step-4" / EXPORT_MARKER).read_text())["info"]["step"] == 4
    assert (out / EXPORT_MARKER).is_file() and (out / "config.json").is_file()  # the final export, as before
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "save_s" in r] == [2, 4]
    assert all(r["save_s"] > 0 for r in records if "save_s" in r)
    assert not list(out.glob("*.partial")) and not list(tmp_path.glob("*.partial"))


def test_a_checkpoint_is_the_engines_weights_and_loads_with_its_tokenizer(tmp_path, capsys):
    """A Hugging Face model: step-2 and step-4 load with from_pretrained and hold exactly the weights the store
    holds at those steps (the second through a resume); the tokenizer and chat template come along."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lohan import init_from_hf
    from lohan.config import EngineConfig
    from tests.unit.models.test_hf import engine_hf_state, make_hf_dir

    model_dir = make_hf_dir(tmp_path / "llama", "llama")
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    Path(model_dir, "chat_template.jinja").write_text(template)
    out = tmp_path / "export"
    argv = ["--model", model_dir, "--data", "synthetic", "--nvme", str(tmp_path / "nvme"), "--metrics",
            str(tmp_path / "m.jsonl"), "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--compute-dtype",
            "fp32", "--backend", "threads", "--save-every", "2", "--export", str(out)]
    cfg = EngineConfig(nvme=(str(tmp_path / "nvme"),), compute_dtype="fp32", backend="threads")

    def engine_weights(step: int) -> dict[str, torch.Tensor]:
        with init_from_hf(model_dir, cfg, resume=True) as engine:
            assert engine.step_count == step
            return engine_hf_state(engine, engine.program)

    assert main(argv + ["--steps", "2"]) == 0
    at2 = engine_weights(2)
    assert main(argv + ["--steps", "4", "--resume"]) == 0
    at4 = engine_weights(4)
    assert steps_saved(out) == [2, 4]
    for step, want in ((2, at2), (4, at4)):
        loaded = AutoModelForCausalLM.from_pretrained(out / f"step-{step}").state_dict()
        assert same({k: loaded[k] for k in want}, want), step
    assert not same(at2, at4)
    assert (out / "step-4" / "chat_template.jinja").read_text() == template
    assert AutoTokenizer.from_pretrained(out / "step-4")("w3 w4")["input_ids"] == [3, 4]
    assert same(weights(out / "step-4"), weights(out))  # the final export is the same step's


def run_id(work: Path) -> str:
    """The identity of the run whose metrics are in `work`/m.jsonl (every record carries it)."""
    return json.loads((work / "m.jsonl").read_text().splitlines()[0])["run_id"]


def test_total_limit_keeps_the_last_k_and_never_a_foreign_folder(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(args(tmp_path, "--steps", "5", "--save-every", "1", "--save-total-limit", "2", "--export",
                     str(out))) == 0
    assert steps_saved(out) == [4, 5]
    assert "removed step-3 (--save-total-limit 2)" in capsys.readouterr().out

    # pruning by hand, with a stranger's step-1 (no manifest), a later checkpoint of another run's, and a file a
    # user added to step-5: only step-4 goes
    layout = RunLayout(("unused",), "lohan", tmp_path / "m2.jsonl", out, owner=Owner("the store", run_id(tmp_path)))
    foreign = out / "step-1"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    begin_folder(out / "step-9", "another-run", {"step": 9})
    seal_folder(out / "step-9", "another-run", {"step": 9})
    (out / "step-4" / "EVAL_NOTES.md").write_text("mine")
    checkpoints = Checkpoints(layout, None, None, every=1, limit=1, dtype=None)
    removed, kept = checkpoints.prune(6)
    assert removed == [] and len(kept) == 1
    assert "step-4 is kept" in kept[0] and "EVAL_NOTES.md (not written by lohan)" in kept[0]
    assert (out / "step-4" / "EVAL_NOTES.md").read_text() == "mine"
    (out / "step-4" / "EVAL_NOTES.md").unlink()
    assert checkpoints.prune(6) == ([out / "step-4"], [])
    assert steps_saved(out) == [1, 5, 9] and (foreign / "notes.txt").read_text() == "keep me"


def test_a_foreign_file_or_folder_in_the_export_directory_refuses_the_run(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "step-3").mkdir()  # named like a checkpoint, but not lohan's (no manifest)
    (out / "step-3" / "mine.bin").write_bytes(b"x")
    assert main(args(tmp_path, "--steps", "3", "--save-every", "1", "--export", str(out))) == 2
    text = capsys.readouterr().out
    assert "step-3 is named like a checkpoint of lohan's but is not one" in text
    assert not (tmp_path / "nvme").exists()  # refused before anything was written
    assert [p.name for p in out.iterdir()] == ["step-3"] and (out / "step-3" / "mine.bin").read_bytes() == b"x"


def test_save_every_needs_an_export_directory(tmp_path, capsys):
    assert main(args(tmp_path, "--steps", "2", "--save-every", "1")) == 2
    assert "pass --export DIR too" in capsys.readouterr().err
    assert main(args(tmp_path, "--steps", "2", "--save-total-limit", "1", "--export", str(tmp_path / "o"))) == 2
    assert "save_total_limit limits the checkpoints save_every writes" in capsys.readouterr().err
    assert main(args(tmp_path, "--steps", "2", "--save-every", "0", "--export", str(tmp_path / "o"))) == 2
    assert "save_every=0 must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "nvme").exists() and not (tmp_path / "o").exists()


def _finetune(work: Path, crash: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOHAN_CRASH_AT", "LOHAN_DEBUG")}
    if crash:
        env["LOHAN_CRASH_AT"] = crash
    argv = [sys.executable, str(ROOT / "finetune.py"), *args(work, "--steps", "6", "--save-every", "2", "--export",
                                                             str(work / "out"), *extra)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_a_kill_mid_save_keeps_the_previous_checkpoints_and_the_resume_cleans_up(tmp_path):
    """SIGKILL after the second checkpoint's files are written, before its rename: step-2 stands whole, the
    leftover step-4.partial is lohan's and removed by the resumed run, which writes step-4 from the committed
    step 4 first; every checkpoint equals an uninterrupted run's."""
    ref = tmp_path / "ref"
    assert main(args(ref, "--steps", "6", "--save-every", "2", "--export", str(ref / "out"))) == 0
    work = tmp_path / "run"
    killed = _finetune(work, "checkpoint.written:2")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    out = work / "out"
    assert steps_saved(out) == [2] and (out / "step-4.partial" / EXPORT_MARKER).is_file()
    assert same(weights(out / "step-2"), weights(ref / "out" / "step-2"))
    resumed = _finetune(work, None, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"removed {out / 'step-4.partial'}, left by a save that was killed" in resumed.stdout
    assert resumed.stdout.index("checkpoint") < resumed.stdout.index("step 5/6 |")  # step-4 before step 5
    assert steps_saved(out) == [2, 4, 6] and not list(out.glob("*.partial"))
    for step in (2, 4, 6):
        assert same(weights(out / f"step-{step}"), weights(ref / "out" / f"step-{step}")), step
    assert same(weights(out), weights(ref / "out"))


def test_a_kill_while_the_final_export_moves_the_checkpoints_loses_none(tmp_path):
    """The final export swaps in with the checkpoints moved into its staging folder: killed after the first
    move, the next run puts it back, and ends with every checkpoint and the export."""
    work = tmp_path / "run"
    killed = _finetune(work, "export.checkpoint_moved")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    staging = work / "out.partial"
    assert len(steps_saved(staging)) == 1 and len(steps_saved(work / "out")) == 2
    resumed = _finetune(work, None, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "from a killed export's staging folder" in resumed.stdout
    assert steps_saved(work / "out") == [2, 4, 6] and not staging.exists()
    assert same(weights(work / "out" / "step-6"), weights(work / "out"))


@pytest.mark.parametrize("leftover", ["step-8.partial", "step-8.old"])
def test_only_leftovers_lohan_wrote_are_cleaned(tmp_path, leftover, capsys):
    """A folder named like a leftover is removed only when its manifest proves it this run's (a save in writing, or
    a sealed checkpoint being removed, with the files it lists unchanged); a stranger's, or one holding a file
    added since, refuses the run and stays as it is."""
    out = tmp_path / "out"
    assert main(args(tmp_path, "--steps", "1", "--save-every", "1", "--export", str(out))) == 0
    (out / leftover).mkdir(parents=True)
    (out / leftover / "data.bin").write_bytes(b"mine")
    assert main(args(tmp_path, "--steps", "2", "--save-every", "1", "--export", str(out), "--resume")) == 2
    assert "data.bin (no lohan_export.json)" in capsys.readouterr().out
    assert (out / leftover / "data.bin").read_bytes() == b"mine"
    (out / leftover / "data.bin").unlink()
    (out / leftover).rmdir()
    begin_folder(out / leftover, run_id(tmp_path), {"step": 8})
    (out / leftover / "model.safetensors").write_bytes(b"lohan's")
    if leftover.endswith(".old"):  # a sealed checkpoint a kill caught in its removal, and a file added since
        seal_folder(out / leftover, run_id(tmp_path), {"step": 8})
        (out / leftover / "notes.md").write_text("mine")
        assert main(args(tmp_path, "--steps", "2", "--save-every", "1", "--export", str(out), "--resume")) == 2
        assert "notes.md (not written by lohan)" in capsys.readouterr().out
        (out / leftover / "notes.md").unlink()
    assert main(args(tmp_path, "--steps", "2", "--save-every", "1", "--export", str(out), "--resume")) == 0
    assert not (out / leftover).exists() and steps_saved(out) == [1, 2]


def test_what_the_layout_takes_for_lohans_in_an_export_directory(tmp_path):
    """An export directory a run may write to: empty, an export of its own run (the files its manifest lists,
    unchanged), its checkpoints and their leftovers; never a folder without a manifest, a loose file, a file
    named like a checkpoint, a changed file, or another run's export."""
    out = tmp_path / "out"
    me = Owner("the store", "run-a")

    def problems(owner: Owner = me) -> list[str]:
        return RunLayout((str(tmp_path / "nvme"),), "lohan", tmp_path / "m.jsonl", out, owner=owner).problems()

    begin_folder(out / "step-2", "run-a", {"step": 2})
    seal_folder(out / "step-2", "run-a", {"step": 2})
    (out / "step-4.partial").mkdir()  # empty: a kill right after its mkdir
    assert problems() == []
    assert "holds the checkpoint of step 2 of another lohan run (run id run-a)" in problems(Owner("x", "run-b"))[0]
    (out / "config.json").write_text("{}")  # a loose file, and no manifest beside it
    assert "config.json (no lohan_export.json)" in problems()[0]
    (out / "config.json").unlink()
    (out / "step-2").rename(tmp_path / "step-2")
    (out / "step-4.partial").rmdir()
    out.rmdir()
    begin_folder(out, "run-a", {"step": 3})
    (out / "config.json").write_text("{}")
    seal_folder(out, "run-a", {"step": 3})
    (tmp_path / "step-2").rename(out / "step-2")
    assert problems() == []
    (out / EXPORT_MARKER).write_text("{}")  # a marker without a manifest proves nothing
    assert "config.json (its lohan_export.json was written by an older lohan" in problems()[0]
    os.utime(out / "config.json", ns=(1, 1))  # touched since it was sealed
    (out / "step-2").rename(tmp_path / "step-2")
    seal_folder(out, "run-a", {"step": 3})
    (tmp_path / "step-2").rename(out / "step-2")
    assert problems() == []
    (out / "config.json").write_text('{"edited": true}')
    assert "config.json (not the file lohan wrote there: changed, replaced or copied since)" in problems()[0]
    (out / "config.json").unlink()
    (out / "step-6").write_text("not a checkpoint")
    assert "step-6 (not written by lohan)" in problems()[0]
