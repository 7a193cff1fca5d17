"""--report-to: each tracker's files read back with its own reader, against the metrics JSONL of the same run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from lohan.app import tracking
from lohan.app.cli import DEFAULT_CONFIG, main
from lohan.app.metrics import StepMetrics, load_metrics
from lohan.config import RunConfig

STEPS = 4


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, monkeypatch_module):
    """One CLI run of the default config reporting to every tracker (wandb offline, mlflow a local store)."""
    tmp = tmp_path_factory.mktemp("tracked")
    monkeypatch_module.setenv("WANDB_MODE", "offline")
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    monkeypatch_module.delenv("MLFLOW_TRACKING_URI", raising=False)
    rc = main(["--nvme", str(tmp / "nvme"), "--metrics", str(tmp / "m.jsonl"), "--steps", str(STEPS),
               "--report-to", "tensorboard,wandb,mlflow", "--logging-dir", str(tmp / "logs"),
               "--eval-fraction", "0.1", "--eval-every", "2"])
    assert rc == 0
    return tmp, load_metrics(tmp / "m.jsonl")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5)  # the JSONL rounds to 6 significant digits


def test_tensorboard_event_files_hold_every_step(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, records = tracked_run
    (run_dir,) = (tmp / "logs" / "tensorboard").iterdir()
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(_close(e.value, r["loss"]) for e, r in zip(loss, records))
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 4]
    tags = set(acc.Tags()["scalars"])
    assert {"train/learning_rate", "train/grad_norm", "train/clip_coef", "perf/tokens_per_s", "perf/tflops",
            "perf/ssd_read_gbps", "lanes/gpu_s", "mem/rss_gib"} <= tags
    (text,) = acc.Tensors("config/text_summary")  # the run's settings, as a table
    assert b"| engine.lr |" in text.tensor_proto.string_val[0]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (its LevelDB-style log: 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_run_holds_every_step_and_the_config(tracked_run):
    tmp, records = tracked_run
    (run_file,) = (tmp / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = [], {}
    for rec in _wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    steps = [h for h in history if "train/loss" in h]
    assert [h["_step"] for h in steps] == list(range(1, STEPS + 1))
    assert all(_close(h["train/loss"], r["loss"]) for h, r in zip(steps, records))
    assert config["engine.lr"] == yaml.safe_load(DEFAULT_CONFIG.read_text())["engine"]["lr"]
    assert config["steps"] == STEPS


def test_mlflow_local_store_holds_every_step_and_the_params(tracked_run):
    from mlflow.tracking import MlflowClient

    tmp, records = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'logs' / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lohan")
    (run,) = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    by_step = {m.step: m.value for m in history}
    assert all(_close(by_step[r["step"]], r["loss"]) for r in records)
    assert run.data.params["engine.max_grad_norm"] == str(RunConfig().engine.max_grad_norm)
    assert run.info.artifact_uri.startswith((tmp / "logs" / "mlflow").resolve().as_uri())  # not the working dir


def test_report_to_names_are_checked():
    assert tracking.parse_report_to("TensorBoard, mlflow,tensorboard") == ("tensorboard", "mlflow")
    assert tracking.parse_report_to("all") == tracking.TRACKERS
    assert tracking.parse_report_to("none") == tracking.parse_report_to(None) == ()
    with pytest.raises(ValueError, match="unknown tracker.*tb.*choose from tensorboard, wandb, mlflow"):
        RunConfig(report_to="tb")
    assert RunConfig(report_to=["wandb"]).report_to == ("wandb",)


def test_step_scalars_carry_the_jsonl_fields():
    m = StepMetrics.from_counters(step=3, loss=2.5, lr=1e-3, tokens=64, step_s=0.5, flops=1e12,
                                  ssd_read_bytes=10**9, lanes={"gpu": 0.2, "ssd_read": 0.3}, grad_norm=1.5,
                                  clip_coef=0.5, eval_loss=2.0, eval_s=0.1)
    s = tracking.step_scalars(m)
    assert s["train/loss"] == 2.5 and s["train/clip_coef"] == 0.5 and s["eval/loss"] == 2.0
    assert s["perf/tokens_per_s"] == 128 and s["perf/ssd_read_gbps"] == 2.0 and s["lanes/ssd_read_s"] == 0.3
    assert "mem/gpu_gib" not in s  # None (a CPU run) is left out, not sent as 0
    flat = tracking.flat_params(RunConfig())
    assert flat["engine.betas"] == str(list(RunConfig().engine.betas)) and flat["model"] == "tiny"


def test_a_missing_tracker_package_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    rc = main(["--nvme", str(tmp_path / "nvme"), "--steps", "1", "--report-to", "wandb"])
    assert rc == 2
    err = capsys.readouterr()
    assert "needs the 'wandb' package" in err.out + err.err and "pip install wandb" in err.out + err.err
    assert not (tmp_path / "nvme").exists()


def test_logging_dir_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "logs").write_text("mine")
    rc = main(["--nvme", str(tmp_path / "nvme"), "--steps", "1", "--report-to", "tensorboard",
               "--logging-dir", str(tmp_path / "logs")])
    assert rc == 2 and (tmp_path / "logs").read_text() == "mine"
    assert "--logging-dir" in "".join(capsys.readouterr())


def test_a_signal_during_a_trackers_call_stops_the_run_after_that_call(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while a tracker writes (MLflow's SQL store, TensorBoard's event file) is held until the
    call returns, then delivered as its handler would have been: an interrupt raised inside the tracker's code
    left its own traceback on the terminal (SQLAlchemy's cursor cleanup logs one) and could cut a write short."""
    import os
    import signal
    import threading
    import time

    calls: list[str] = []

    class Slow:
        where = "slow"

        def log_params(self, params):
            pass

        def log(self, step, scalars):
            calls.append("log begins")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # (a Python-level sleep: a handler would run inside it)
            calls.append("log ends")

        def close(self, status):
            calls.append(f"closed {status}")

    from tests.unit.app.test_metrics import _m as record

    monkeypatch.setattr(tracking, "_open_one", lambda *a: Slow())
    assert threading.current_thread() is threading.main_thread()
    trackers = tracking.Trackers(["tensorboard"], tmp_path, "run")
    m = record(1)
    with pytest.raises(KeyboardInterrupt):
        trackers.log(m)
    assert calls == ["log begins", "log ends"]
    trackers.close()
