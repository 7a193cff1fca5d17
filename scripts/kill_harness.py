"""Kill anywhere: SIGKILL `finetune.py` at many points of every phase, resume, and check the result is
bit-identical to an uninterrupted run.

    python scripts/kill_harness.py                      # 24 trials (a few minutes), writes benchmarks/results/
    python scripts/kill_harness.py --trials 6 --seed 3  # a quicker look
    python scripts/kill_harness.py --set engine.resident_mem=all  # every optimizer record kept in RAM too

Each trial runs the same small fine-tune (the tiny preset on the shipped corpus, seq 64, batch 4, 6 steps, an
evaluation on held-out sequences every 3 steps, a checkpoint every 2 steps, export at the end, the steps reported to
TensorBoard and MLflow) and kills it one to three times: at named crash points (`lohan/crashpoints.py`: a block of
store creation, the rename of each JSON file, forward, backward, the optimizer's writes, the commit's fsync, the
run-state write, profiling, an evaluation, a metrics record's write, between two trackers' logs, a checkpoint before
its rename, the export, the export's swap as it moves the checkpoints) or after a random delay. After each kill it
does what the error message tells a user to do: the same command with `--resume` (without it when nothing was
created yet). Checked per trial: the metrics hold every step exactly once, its loss and its evaluation the
uninterrupted run's; TensorBoard and MLflow, read back with their own readers, hold every step exactly once with the
uninterrupted run's values; and the final weights (fp32 masters, every block, read back from the store), the export
and every checkpoint (``export/step-N``) are bit-identical. A trial whose crash point was never reached is counted as
such, not as survived.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_env: where the report goes

from bench_env import result_fields, result_path  # noqa: E402

STEPS = 6

# (phase, crash spec) pairs; `{k:N}` is drawn per trial from 1..N (N: how often a 6-step run of 8 blocks,
# 7 forward visits and 8 backward visits a step, reaches that point, so most draws are reached)
POINTS: list[tuple[str, str]] = [
    ("store creation", "store.init.block_written:{k:8}"),
    ("store creation", "json.rename:lohan.init.json:{k:8}"),
    ("store creation", "json.rename:lohan.store.json"),
    ("store creation", "json.rename:lohan.commit.json:1"),
    ("profiling", "profile.measured"),
    ("forward", "engine.forward:{k:28}"),
    ("backward", "engine.backward:{k:32}"),
    ("optimizer write", "offload.write_issued:{k:32}"),
    ("commit fsync", "store.commit.synced:{k:5}"),
    # (reached only with a durability interval: --set engine.persist_every=4, records resident)
    ("persist", "offload.persisted:{k:3}"),
    ("commit rename", "json.rename:lohan.commit.json:{k:5}"),
    ("run-state write", "json.rename:lohan.run.json:{k:4}"),
    ("evaluation", "eval.batch:{k:14}"),
    ("metrics write", "metrics.write:{k:6}"),
    ("tracker log", "trackers.logged:{k:12}"),
    ("checkpoint save", "checkpoint.written:{k:3}"),
    ("export", "export.written"),
    ("export", "export.checkpoint_moved:{k:3}"),
    ("random time", "random"),
]


SETS: list[str] = []  # --set KEY=VALUE given to every finetune.py run (main's --set)


TRACKERS = "tensorboard,mlflow"  # (wandb too with --report-to: its offline runs start slowly)


def base_args(work: Path, steps: int = STEPS) -> list[str]:
    return [sys.executable, str(ROOT / "finetune.py"), "--steps", str(steps), "--seq-len", "64", "--batch-size", "4",
            "--nvme", str(work / "nvme"), "--metrics", str(work / "metrics.jsonl"), "--export", str(work / "export"),
            "--save-every", "2", "--eval-fraction", "0.002", "--eval-every", "3", "--report-to", TRACKERS,
            "--logging-dir", str(work / "logs"), "--backend", "threads",
            *(a for kv in SETS for a in ("--set", kv))]


@dataclass
class Attempt:
    spec: str | None
    phase: str | None
    rc: int
    seconds: float
    note: str = ""


@dataclass
class Trial:
    index: int
    attempts: list[Attempt] = field(default_factory=list)
    kills: int = 0
    identical: bool = False
    problems: list[str] = field(default_factory=list)


def _env(spec: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOHAN_CRASH_AT", "LOHAN_DEBUG", "MLFLOW_TRACKING_URI",
                                                           "MLFLOW_EXPERIMENT_NAME")}
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    if spec:
        env["LOHAN_CRASH_AT"] = spec
    return env


def run_once(args: list[str], spec: str | None, kill_after: float | None = None) -> tuple[int, str, float]:
    """Run the command; SIGKILL it after `kill_after` seconds if given. Returns (rc, output, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(spec),
                            cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
    return proc.returncode, out, time.perf_counter() - t0


def read_losses(path: Path) -> dict[int, float]:
    losses = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "step" in rec and "loss" in rec:
                losses[int(rec["step"])] = rec["loss"]
    return losses


def read_records(work: Path) -> list[tuple[int, object, object]]:
    """(step, loss, eval loss) of every record of the metrics file, in file order (duplicates kept)."""
    path = work / "metrics.jsonl"
    if not path.exists():
        return []
    return [(r["step"], r["loss"], r.get("eval_loss")) for r in map(json.loads, path.read_text().splitlines())]


def read_trackers(work: Path) -> dict[str, list[tuple[int, float]]]:
    """Each tracker's train/loss and eval/loss series as (step, value), in step order, duplicates kept, read back
    with the tracker's own reader (TensorBoard's event accumulator, MLflow's client)."""
    out: dict[str, list[tuple[int, float]]] = {}
    logs = work / "logs"
    if "tensorboard" in TRACKERS:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for folder in sorted((logs / "tensorboard").glob("*")):
            acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in ("train/loss", "eval/loss"):
                if tag in acc.Tags()["scalars"]:
                    out.setdefault(f"tensorboard {tag}", []).extend((e.step, e.value) for e in acc.Scalars(tag))
    if "mlflow" in TRACKERS and (logs / "mlflow" / "mlflow.db").exists():
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{logs / 'mlflow' / 'mlflow.db'}")
        for run in client.search_runs([client.get_experiment_by_name("lohan").experiment_id]):
            for tag in ("train/loss", "eval/loss"):
                out.setdefault(f"mlflow {tag}", []).extend(
                    (m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
    return {k: sorted(v) for k, v in out.items()}


def read_weights(work: Path) -> dict[str, object]:
    from lohan.store.states import StateStore

    store = StateStore.open([str(work / "nvme")], backend="threads")
    try:
        return {f"{b.name}.{s.name}": t for b in store.layout.blocks for s, t in zip(b.params, store.read_params(b.index))}
    finally:
        store.close()


def read_export(work: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((work / "export").glob("*.safetensors")):
        out.update(load_file(str(f)))
    for f in sorted((work / "export").glob("step-*/*.safetensors")):  # the checkpoints, under their folder's name
        out.update((f"{f.parent.name}/{k}", v) for k, v in load_file(str(f)).items())
    return out


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class Reference:
    """What the uninterrupted run wrote: its metrics records, trackers' series, weights and export."""

    records: list
    trackers: dict
    weights: dict
    export: dict


def reference(work: Path) -> tuple[Reference, float]:
    rc, out, secs = run_once(base_args(work), None)
    if rc != 0:
        raise SystemExit(f"the uninterrupted reference run failed (exit {rc}):\n{out}")
    return Reference(read_records(work), read_trackers(work), read_weights(work), read_export(work)), secs


def compare(work: Path, ref: Reference) -> list[str]:
    """What differs from the uninterrupted run (empty: nothing): the metrics records, each step once, with their
    losses and evaluations; the trackers' series; the weights, the export and the checkpoints."""
    problems = []
    records = read_records(work)
    steps = [r[0] for r in records]
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"the metrics hold steps {steps}, not each of 1..{STEPS} once")
    diff = [(a, b) for a, b in zip(records, ref.records) if a != b]
    if diff:
        problems.append(f"metrics records (step, loss, eval loss) differ: {diff}")
    trackers = read_trackers(work)
    for series, want in ref.trackers.items():
        got = trackers.get(series, [])
        # a step a resumed run gives a tracker again comes from the metrics file (6 significant digits), and
        # TensorBoard keeps float32: the values agree to those
        if [s for s, _ in got] != [s for s, _ in want] or not all(
                math.isclose(a, b, rel_tol=2e-6) for (_, a), (_, b) in zip(got, want)):
            problems.append(f"{series}: {got} where the uninterrupted run has {want}")
    if not same_tensors(read_weights(work), ref.weights):
        problems.append("final weights differ from the uninterrupted run")
    if not same_tensors(read_export(work), ref.export):
        problems.append("the export or a checkpoint differs from the uninterrupted run")
    return problems


def run_trial(index: int, work: Path, kills: list[tuple[str, str]], ref: Reference, ref_s: float,
              rng: random.Random) -> Trial:
    """Kill the run once per entry of `kills`, resuming after each, then finish and compare with `ref`."""
    trial = Trial(index)
    resume = False
    pending = list(kills)
    for _ in range(len(kills) + 4):  # kills, plus re-runs after refusals, plus the final run
        phase, spec = pending.pop(0) if pending else (None, None)
        args = base_args(work) + (["--resume"] if resume else [])
        kill_after = None
        if spec == "random":
            kill_after, spec = rng.uniform(0.5, ref_s), None
        rc, out, secs = run_once(args, spec, kill_after)
        note = ""
        if rc == -signal.SIGKILL:
            trial.kills += 1
            note = "killed"
        elif rc == 2 and "nothing to resume" in out:
            note = "nothing to resume yet: the same command without --resume"
            resume = False
            trial.attempts.append(Attempt(spec, phase, rc, secs, note))
            continue
        elif rc == 0:
            note = "finished" + (" (crash point not reached)" if spec or kill_after else "")
        else:
            trial.problems.append(f"exit {rc} after {phase or 'no kill'}: {out.strip().splitlines()[-1:]}")
            trial.attempts.append(Attempt(spec, phase, rc, secs, note or "failed"))
            return trial
        trial.attempts.append(Attempt(spec or (f"SIGKILL after {kill_after:.2f} s" if kill_after else None), phase,
                                      rc, secs, note))
        resume = True
        if rc == 0 and not pending:
            break
    trial.problems += compare(work, ref)
    trial.identical = not trial.problems
    return trial


def draw_kills(rng: random.Random, n: int) -> list[tuple[str, str]]:
    out = []
    for phase, spec in rng.sample(POINTS, n):
        if "{k:" in spec:
            head, _, top = spec.partition("{k:")
            spec = head + str(rng.randint(1, int(top.rstrip("}"))))
        out.append((phase, spec))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON report (default benchmarks/results/kill_harness[/seed<N>]/<machine>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the trials' directories")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, e.g. engine.resident_mem=all (repeatable)")
    ap.add_argument("--report-to", default=TRACKERS, help="the trackers every run reports to (checked read back)")
    args = ap.parse_args(argv)
    SETS[:] = args.set
    globals()["TRACKERS"] = args.report_to
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="lohan-kill-"))
    try:
        ref, ref_s = reference(root / "ref")
        print(f"reference run: {ref_s:.1f} s, {len(ref.records)} steps")
        trials = []
        for i in range(args.trials):
            kills = draw_kills(rng, 1 if i % 3 == 0 else 2 if i % 3 == 1 else 3)
            t = run_trial(i, root / f"trial{i}", kills, ref, ref_s, rng)
            trials.append(t)
            got = ", ".join(f"{a.phase or '-'}: {a.note}" for a in t.attempts)
            print(f"trial {i:2d}: {'identical' if t.identical else 'DIFFERENT'} | {t.kills} kill(s) | {got}"
                  + (f" | {t.problems}" if t.problems else ""))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    by_phase: dict[str, list[int]] = {}
    for t in trials:
        for a in t.attempts:
            if a.phase:
                ok = t.identical and a.note == "killed"
                row = by_phase.setdefault(a.phase, [0, 0, 0])
                row[0] += a.note == "killed"
                row[1] += ok
                row[2] += a.note.startswith("finished")
    kills = sum(t.kills for t in trials)
    survived = sum(t.kills for t in trials if t.identical)
    summary = {
        "kills": kills, "kills_survived": survived, "trials": len(trials),
        "trials_identical": sum(t.identical for t in trials),
        "trials_killed_several_times": sum(t.kills > 1 for t in trials),
        "by_phase": {p: {"killed": r[0], "survived": r[1], "point_not_reached": r[2]} for p, r in sorted(by_phase.items())},
        "command": " ".join(["python finetune.py", *base_args(Path("WORK"))[2:]]), "seed": args.seed,
        "trial_log": [asdict(t) for t in trials], **result_fields("kill_harness", {"seed": args.seed}),
    }
    args.out = result_path("kill_harness", {"seed": args.seed}, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nkill points survived / tried: {survived} / {kills} over {len(trials)} trials "
          f"({summary['trials_killed_several_times']} killed several times)")
    for p, r in summary["by_phase"].items():
        print(f"  {p:16s} {r['survived']:3d} / {r['killed']:3d}" + (f"   ({r['point_not_reached']} not reached)"
                                                                    if r["point_not_reached"] else ""))
    print(f"results: {args.out}")
    return 0 if survived == kills and all(t.identical for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
