"""Trackers across kills and resumes: each continues its own run for a run id, and after a kill at any point
(inside a log call, inside the creation of a store) and a resume's replay, every committed step is in each
tracker exactly once, read back with that tracker's own reader. Plus the one-line errors of a tracker that cannot
open or write."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import lohan
from lohan.app.cli import main
from lohan.app.tracking import Trackers, step_scalars

sys.path.insert(0, os.path.dirname(__file__))
from tracker_worker import records  # noqa: E402

WORKER = Path(__file__).with_name("tracker_worker.py")
RUN = "3f2a9c"  # a run id (the CLI passes the store's volume id)


@pytest.fixture(scope="module")
def env():
    """wandb offline and quiet, mlflow's local store (never a user's MLFLOW_TRACKING_URI)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def mlflow_store(env, tmp_path_factory) -> Path:
    """A complete local MLflow store, built once (about 2 s): tests copy it instead of building their own."""
    from lohan.app.tracker_backends import build_sqlite_store

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    build_sqlite_store(db, "lohan", (db.parent / "artifacts").as_uri())
    return db


@pytest.fixture
def logs(tmp_path, mlflow_store) -> Path:
    """A logging dir whose MLflow store exists (a copy of the template)."""
    (tmp_path / "logs" / "mlflow").mkdir(parents=True)
    shutil.copy(mlflow_store, tmp_path / "logs" / "mlflow" / "mlflow.db")
    return tmp_path / "logs"


def _expected(steps: int) -> dict[str, list[int]]:
    """Each tag and the steps that carry it (evaluations only every other step)."""
    out: dict[str, list[int]] = {}
    for m in records(steps):
        for tag in step_scalars(m):
            out.setdefault(tag, []).append(m.step)
    return out


def _tensorboard(logs: Path, run_id: str = RUN, check: bool = True) -> dict[str, list[int]]:
    """Each tag's steps as TensorBoard's reader shows them (purges applied), with the values of `records`
    checked."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = (logs / "tensorboard").iterdir()
    assert folder.name == f"lohan-{run_id}"
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    want = {m.step: step_scalars(m) for m in records(99)}
    for tag in acc.Tags()["scalars"] if check else ():
        assert all(e.value == pytest.approx(want[e.step][tag], rel=1e-6) for e in acc.Scalars(tag))
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow(logs: Path) -> tuple[list, dict[str, list[int]]]:
    """The MLflow runs of the store and each tag's steps in the (one) run, from MLflow's own client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{logs / 'mlflow' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lohan").experiment_id])
    rid = runs[0].info.run_id
    return runs, {key: sorted(m.step for m in client.get_metric_history(rid, key)) for key in runs[0].data.metrics}


def _open(logs: Path, names=("tensorboard", "wandb", "mlflow"), run_id: str = RUN) -> Trackers:
    return Trackers(list(names), logs, "lohan", {"lr": 1e-3, "steps": 6}, run_id=run_id)


def test_a_resume_continues_each_trackers_run_and_a_new_run_id_starts_new_ones(logs):
    from lohan.app import tracker_backends as backends

    with _open(logs) as t:
        for m in records(2):
            t.log(m)
    with _open(logs) as t:  # the resume: the committed steps replayed, then the new ones
        t.replay(records(2))
        for m in records(4)[2:]:
            t.log(m)
    assert _tensorboard(logs) == _expected(4)
    runs, steps = _mlflow(logs)
    assert len(runs) == 1 and runs[0].data.tags["lohan.run_id"] == RUN and runs[0].info.status == "FINISHED"
    assert steps == _expected(4)
    assert runs[0].data.params == {"lr": "0.001", "steps": "6"}
    files = backends.wandb_run_files(logs / "wandb", RUN)
    assert len(files) == 2  # one local folder per process, both W&B run id RUN: `wandb sync` uploads one run
    assert backends.wandb_steps(logs / "wandb", RUN) == [1, 2, 3, 4]
    with _open(logs, run_id="other") as t:  # a store created afresh: a new run in each tracker
        t.log(records(1)[0])
    assert len(list((logs / "tensorboard").iterdir())) == 2
    assert len(_mlflow(logs)[0]) == 2
    assert backends.wandb_steps(logs / "wandb", "other") == [1]


def _record_bounds(data: bytes, start: int) -> list[int]:
    """The byte offsets where the TFRecords of an event file end, from `start` on (8-byte length, 4-byte CRC,
    data, 4-byte CRC)."""
    out, pos = [], start
    while pos < len(data):
        pos += 16 + int.from_bytes(data[pos:pos + 8], "little")
        out.append(pos)
    return out


def test_tensorboard_a_kill_at_any_point_of_a_log_call_ends_with_each_step_once(logs, tmp_path):
    with _open(logs, ["tensorboard"]) as t:
        for m in records(3):
            t.log(m)
        (events,) = (logs / "tensorboard" / f"lohan-{RUN}").iterdir()
        before = events.stat().st_size
        t.log(records(4)[3])
    data = events.read_bytes()
    ends = _record_bounds(data, before)
    assert len(ends) == len(step_scalars(records(4)[3]))  # one record per scalar of step 4
    # a SIGKILL leaves a prefix of the file: at each record boundary (step 4 partly written) and inside a record
    cuts = [before] + ends + [(a + b) // 2 for a, b in zip([before] + ends, ends)]
    for cut in cuts:
        run = tmp_path / f"cut{cut}"
        shutil.copytree(logs / "tensorboard", run / "tensorboard")
        (run / "tensorboard" / f"lohan-{RUN}" / events.name).write_bytes(data[:cut])
        with _open(run, ["tensorboard"]) as t:
            t.replay(records(4))
            t.log(records(5)[4])
        assert _tensorboard(run) == _expected(5), f"killed at byte {cut} of {len(data)}"
    # killed while the resumed process created its event file: an empty one, and one cut inside its first record
    run = tmp_path / "created"
    shutil.copytree(logs / "tensorboard", run / "tensorboard")
    stamp = int(events.name.split(".")[3])
    (run / "tensorboard" / f"lohan-{RUN}" / f"events.out.tfevents.{stamp + 5}.host.1.0").write_bytes(b"")
    (run / "tensorboard" / f"lohan-{RUN}" / f"events.out.tfevents.{stamp + 9}.host.2.0").write_bytes(data[:5])
    with _open(run, ["tensorboard"]) as t:
        t.replay(records(4))
        t.log(records(5)[4])
    assert _tensorboard(run) == _expected(5)


@pytest.mark.parametrize("logged", ["none", "part", "all"])
def test_mlflow_a_kill_at_any_point_of_a_log_call_ends_with_each_step_once(logs, logged):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    t = _open(logs, ["mlflow"])
    for m in records(3):
        t.log(m)
    # step 4 as a kill left it: not committed (SQLite rolls the transaction back), or a part of its scalars
    # (what a writer that is not one transaction leaves), or all of it
    scalars = list(step_scalars(records(4)[3]).items())
    part = {"none": [], "part": scalars[:5], "all": scalars}[logged]
    client = MlflowClient(tracking_uri=f"sqlite:///{logs / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lohan").experiment_id])
    if part:
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 4) for k, v in part])
    t._open.clear()  # the kill: the process is gone, its run never closed (MLflow still says RUNNING)
    with _open(logs, ["mlflow"]) as t:
        t.replay(records(4))
        t.log(records(5)[4])
    runs, steps = _mlflow(logs)
    assert len(runs) == 1 and steps == _expected(5)


def test_wandb_a_kill_while_it_writes_its_run_file_ends_with_each_step_once(env, tmp_path):
    """A kill while wandb writes its run file leaves a prefix of it, the last record torn: the reader stops at the
    torn record (its CRC), and the resume logs the steps after it."""
    from lohan.app.tracker_backends import wandb_run_files, wandb_steps

    with _open(tmp_path / "full", ["wandb"]) as t:
        for m in records(3):
            t.log(m)
    (run_file,) = wandb_run_files(tmp_path / "full" / "wandb", RUN)
    data = run_file.read_bytes()
    for k in (1, 2, 3):
        logs = tmp_path / f"cut{k}"
        shutil.copytree(tmp_path / "full", logs, symlinks=True)  # wandb's latest-run link stays a link
        (kept,) = wandb_run_files(logs / "wandb", RUN)
        kept.write_bytes(data[:len(data) * k // 4 + 3])  # mid-record (3 bytes past a quarter)
        held = wandb_steps(logs / "wandb", RUN)
        assert held == list(range(1, len(held) + 1)) and len(held) <= 3
        with _open(logs, ["wandb"]) as t:
            t.replay(records(4))
            t.log(records(5)[4])
        assert wandb_steps(logs / "wandb", RUN) == [1, 2, 3, 4, 5], f"cut at byte {len(data) * k // 4 + 3}"


def _kill_worker(logs: Path, names: str, kill: str, n: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(lohan.__file__).parents[1]))
    env.pop("WANDB_SERVICE", None)  # this process's wandb service: the worker starts one of its own, as a run does
    proc = subprocess.run([sys.executable, str(WORKER), str(logs), RUN, names, kill, str(n)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]


def test_a_kill_inside_a_log_call_resumes_with_each_step_once_in_every_tracker(env, tmp_path):
    """SIGKILL inside step 3's MLflow transaction, after tensorboard and wandb took step 3; then the resume."""
    from lohan.app.tracker_backends import wandb_steps

    logs = tmp_path / "logs"
    _kill_worker(logs, "tensorboard,wandb,mlflow", "log", 3)
    assert (logs / "mlflow" / "mlflow.db-journal").exists()  # the transaction the kill cut short
    with _open(logs) as t:
        t.replay(records(3))
        t.log(records(4)[3])
    assert _tensorboard(logs) == _expected(4)
    runs, steps = _mlflow(logs)
    assert len(runs) == 1 and steps == _expected(4)
    assert wandb_steps(logs / "wandb", RUN) == [1, 2, 3, 4]


def test_a_kill_while_mlflow_creates_its_store_leaves_none_half_built(env, tmp_path):
    """Item 5: SIGKILL at the 30th SQL statement of the store's creation (a half-built SQLite database made
    every resume fail with "duplicate column name" or "table ... already exists"); the next run opens fine."""
    logs = tmp_path / "logs"
    _kill_worker(logs, "mlflow", "create", 30)
    left = sorted(p.name for p in (logs / "mlflow").iterdir())
    mine = tmp_path / "logs" / "mlflow" / "mlflow.db.building.notes"  # not lohan's naming: never touched
    mine.write_text("a user's")
    with Trackers(["mlflow"], logs, "lohan") as t:
        for m in records(2):
            t.log(m)
    runs, steps = _mlflow(logs)
    assert len(runs) == 1 and steps == _expected(2)
    assert len(left) == 1 and left[0].startswith("mlflow.db.building.")  # the kill left lohan's temporary file
    # the dead builder's temporary file is gone (its process is), nothing else was touched
    assert sorted(p.name for p in (logs / "mlflow").iterdir()) == ["mlflow.db", "mlflow.db.building.notes"]
    assert mine.read_text() == "a user's"


def test_a_damaged_mlflow_store_is_refused_in_one_line(env, tmp_path):
    """A store half-built in place (by a kill of an older lohan): one line naming the tracker, the file and the
    fix, no SQL dump; the file stays where it is."""
    logs = tmp_path / "logs"
    _kill_worker(logs, "mlflow", "raw-create", 30)
    with pytest.raises(ValueError) as err:
        Trackers(["mlflow"], logs, "lohan")
    msg = str(err.value)
    assert "\n" not in msg and "[SQL" not in msg and "sqlalche.me" not in msg
    assert msg.startswith("--report-to mlflow could not open its store") and str(logs / "mlflow" / "mlflow.db") in msg
    assert "move the file aside" in msg and "--logging-dir" in msg
    assert (logs / "mlflow" / "mlflow.db").exists()


def _full_disk_after(monkeypatch, writes: int) -> list:
    """TensorBoard's record writer fails with ENOSPC from its `writes`-th record on; the threads' uncaught
    exceptions (a writer thread's traceback) are collected."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    real, count, uncaught = RecordWriter.write, [0], []

    def write(self, data: bytes) -> None:
        count[0] += 1
        if count[0] >= writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, data)

    monkeypatch.setattr(RecordWriter, "write", write)
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    return uncaught


def test_a_full_disk_under_tensorboard_stops_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    # the event file's header and the settings are written, then the first step's scalars find the disk full
    uncaught = _full_disk_after(monkeypatch, 3)
    rc = main(["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--steps", "2",
               "--report-to", "tensorboard", "--logging-dir", str(tmp_path / "logs")])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())  # the console wraps nothing, but be safe
    assert rc == 2 and not uncaught and "Traceback" not in text
    assert "error: --report-to tensorboard could not write to" in text and str(tmp_path / "logs" / "tensorboard") in text
    assert "the disk is full; free space on it or point --logging-dir elsewhere" in text
    assert re.search(r"the state committed at step \d+ is intact", text) and "--resume" in text


def test_a_tracker_write_error_says_which_where_and_the_fix():
    from lohan.app.tracking import TrackerWriteError

    err = TrackerWriteError("mlflow", "/logs/mlflow/mlflow.db", RuntimeError("(sqlite3.OperationalError) database "
                                                                            "or disk is full\n[SQL: INSERT ...]"))
    assert isinstance(err, OSError) and "\n" not in str(err) and "[SQL" not in str(err)
    assert str(err).startswith("--report-to mlflow could not write to /logs/mlflow/mlflow.db (")
    assert "point --logging-dir elsewhere" in str(err)


def test_the_cli_passes_the_stores_run_id_the_same_after_resume(env, tmp_path):
    """The CLI's run id is the store's volume id: a resume adds to the run's one TensorBoard folder (the other
    trackers take the same id; the tests above show each continues its run for it)."""
    args = ["--nvme", str(tmp_path / "nvme"), "--metrics", str(tmp_path / "m.jsonl"), "--report-to",
            "tensorboard", "--logging-dir", str(tmp_path / "logs")]
    assert main(args + ["--steps", "1"]) == 0
    assert main(args + ["--steps", "2", "--resume"]) == 0
    (folder,) = (tmp_path / "logs" / "tensorboard").iterdir()
    assert re.fullmatch(r"lohan-[0-9a-f]{32}", folder.name)
    assert _tensorboard(tmp_path / "logs", folder.name.removeprefix("lohan-"), check=False)["train/loss"] == [1, 2]
