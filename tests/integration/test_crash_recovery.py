"""Kill anywhere (reduced): SIGKILL finetune.py at named points of several phases, resume with the command
the error message gives, and check the run ends bit-identical to an uninterrupted one. The full harness
(24 random trials over every phase) is `scripts/kill_harness.py`; `make test-all` runs a larger sample."""

from __future__ import annotations

import importlib.util
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kill_harness", ROOT / "scripts" / "kill_harness.py")
kh = importlib.util.module_from_spec(_spec)
sys.modules["kill_harness"] = kh  # dataclasses look their module up while the class is created
_spec.loader.exec_module(kh)


SLOW = pytest.mark.slow
"""What `make test` leaves to `make test-all`: the kills and faults beyond one of each kind (~15-20 s each)."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return kh.reference(tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("kills", [
    # killed twice: in the middle of store creation, then inside backward of the resumed run
    [("store creation", "store.init.block_written:3"), ("backward", "engine.backward:13")],
    # killed twice: just before a commit record's rename, then before the run state's rename
    [("commit rename", "json.rename:lohan.commit.json:3"), ("run-state write", "json.rename:lohan.run.json:2")],
    # (the rest run in `make test-all`: each kill pair is ~20 s of processes, and the suite must fit CI's time)
    # after the optimizer's writes went out, then between the export's shards and its rename
    pytest.param([("optimizer write", "offload.write_issued:20"), ("export", "export.written")], marks=SLOW),
    # before the second checkpoint's rename, then as the final export's swap moves the second checkpoint
    pytest.param([("checkpoint save", "checkpoint.written:2"), ("export", "export.checkpoint_moved:2")], marks=SLOW),
    # inside the evaluation of step 3 (after its commit, before its record), then inside the final evaluation
    pytest.param([("evaluation", "eval.batch:4"), ("evaluation", "eval.batch:9")], marks=SLOW),
    # before the record of step 2 is written (its commit durable), then between two trackers' logs of a step
    pytest.param([("metrics write", "metrics.write:2"), ("tracker log", "trackers.logged:5")], marks=SLOW),
], ids=["create+backward", "commit+runstate", "write+export", "checkpoint+swap", "eval+final-eval",
        "metrics+trackers"])
def test_killed_runs_resume_bit_identically(tmp_path, reference, kills):
    ref, ref_s = reference
    trial = kh.run_trial(0, tmp_path / "run", kills, ref, ref_s, random.Random(0))
    assert trial.kills == len(kills), trial.attempts  # every point was reached
    assert trial.identical, trial.problems


@pytest.mark.slow
def test_kill_harness_random_sample(tmp_path):
    assert kh.main(["--trials", "8", "--seed", "1", "--out", str(tmp_path / "kill.json")]) == 0


@SLOW
def test_a_killed_run_in_a_compressed_state_format_resumes_bit_identically(tmp_path, monkeypatch):
    """bf16-master: its stochastic rounding is seeded per block and step, so the resumed run draws what the
    uninterrupted one drew; killed after an optimizer write and before a commit record's rename."""
    monkeypatch.setattr(kh, "SETS", ["engine.state_format=bf16-master"])
    monkeypatch.setattr(kh, "TRACKERS", "none")
    ref, secs = kh.reference(tmp_path / "ref")
    kills = [("optimizer write", "offload.write_issued:20"), ("commit rename", "json.rename:lohan.commit.json:3")]
    trial = kh.run_trial(0, tmp_path / "run", kills, ref, secs, random.Random(0))
    assert trial.kills == len(kills), trial.attempts
    assert trial.identical, trial.problems


def test_kills_between_durable_steps_resume_bit_identically(tmp_path, reference, monkeypatch):
    """A durability interval (records held in RAM between durable steps, `engine.persist_every`): killed in the
    backward of step 6 (step 5 held in RAM, lost, replayed from step 4), then right after the records of a persist
    were written and before their commit; the run ends as the uninterrupted one (every step durable) does."""
    monkeypatch.setattr(kh, "SETS", ["engine.persist_every=4", "engine.resident_mem=all"])
    kills = [("backward", "engine.backward:44"), ("persist", "offload.persisted:1")]
    ref, secs = reference
    trial = kh.run_trial(0, tmp_path / "run", kills, ref, secs, random.Random(0))
    assert trial.kills == len(kills), trial.attempts
    assert trial.identical, trial.problems


@SLOW
def test_kills_between_durable_steps_with_a_record_updated_in_chunks_resume_bit_identically(tmp_path, reference,
                                                                                            monkeypatch):
    """The same kills where every block's record is updated in chunks (of 73728 elements: a layer's 309280 in five):
    they stay resident chunk by chunk, so the interval applies (the persist's crash point is reached only so), and
    the run still ends as the uninterrupted one."""
    monkeypatch.setattr(kh, "SETS", ["engine.persist_every=4", "engine.resident_mem=all",
                                     "engine.opt_chunk_bytes=1MiB"])
    kills = [("backward", "engine.backward:44"), ("persist", "offload.persisted:1")]
    ref, secs = reference
    trial = kh.run_trial(0, tmp_path / "run", kills, ref, secs, random.Random(0))
    assert trial.kills == len(kills), trial.attempts
    assert trial.identical, trial.problems


def test_sigterm_stops_like_ctrl_c_and_resumes(tmp_path, reference):
    ref, _ = reference
    work = tmp_path / "run"
    args = kh.base_args(work, steps=kh.STEPS)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=kh._env(None),
                            cwd=ROOT)
    metrics = work / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(kh.read_losses(metrics)) < 2 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "terminated (SIGTERM)" in out and "--resume" in out and "Traceback" not in out
    rc, out, _ = kh.run_once(args + ["--resume"], None)
    assert rc == 0, out
    assert kh.compare(work, ref) == []


def _run_with_faults(args: list[str], spec: str) -> tuple[int, str]:
    env = kh._env(None)
    env["IO_ENGINE_FAULTS"] = spec
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("spec, expect", [
    # the store's 20th write (step 2's optimizer writes) finds the disk full
    ("vol=lohan:write#20:ENOSPC", r"write failed on device 0 \(.*nvme\): No space left on device \[ENOSPC\] "
                                  r"\(path=.*lohan\.slab, offset=\d+"),
    # a read of step 1 fails (a dying drive): it loads the records the CPU computes on (the steps after it read
    # nothing, every record of the tiny model being resident)
    pytest.param("vol=lohan:read#3:EIO", r"read failed on device 0 \(.*nvme\): Input/output error \[EIO\] "
                 r"\(path=.*lohan\.slab", marks=SLOW),
    # a read of the checkpoint after step 2 fails: step 2 is committed and keeps its metrics line
    pytest.param("vol=lohan:read#30:EIO", r"read failed on device 0 .*\[EIO\].*committed at step 2 is intact",
                 marks=SLOW),
    # the fsync of the second commit fails
    ("vol=lohan:fsync#3:EIO", r"fsync failed on device 0 .*\[EIO\]"),
    # a write of step 3's optimizer pass fails after the step returned (write-behind): its commit never becomes
    # durable, and its record must not be written before it does
    pytest.param("vol=lohan:write#45:ENOSPC", r"\[ENOSPC\].*--resume", marks=SLOW),
    # the disk fills up during store creation (its 4th block)
    pytest.param("vol=lohan:write#4:ENOSPC", r"\[ENOSPC\].*continue with --resume", marks=SLOW),
], ids=["enospc-write", "eio-read", "eio-save-read", "eio-fsync", "enospc-write-behind", "enospc-creation"])
def test_io_faults_end_the_run_cleanly_and_resume_bit_identically(tmp_path, reference, spec, expect):
    ref, _ = reference
    work = tmp_path / "run"
    args = kh.base_args(work)
    rc, out = _run_with_faults(args, spec)
    assert rc == 2, out
    assert re.search(expect, out, re.S), out
    assert "Traceback" not in out and "--resume" in out
    committed = kh.read_records(work)
    assert committed == ref.records[:len(committed)]  # what was committed before the fault, once each, is right
    rc, out = _run_with_faults(args + ["--resume"], "")  # the fault has cleared
    assert rc == 0, out
    assert kh.compare(work, ref) == []  # every step once in the metrics and in each tracker


def test_short_transfers_are_completed_transparently(tmp_path, reference):
    ref, _ = reference
    work = tmp_path / "run"
    rc, out = _run_with_faults(kh.base_args(work), "vol=lohan:write#10+:short,vol=lohan:read#5+:short")
    assert rc == 0, out
    assert kh.same_tensors(kh.read_weights(work), ref.weights)
